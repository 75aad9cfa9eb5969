//! What the lazy-job instructions' bodies do to the graph's buffers: whether a
//! critical-section begin or a launch would find room, publishing a begin's
//! critical-section instance, pushing a launch's job instance.

use std::sync::Arc;

use crate::doors::lazy::{
    CriticalSectionInstance, CsKind, CsOp, JobInstance, LazyGraph, SharedEventRecord,
};
use crate::model::blob::Blob;
use crate::util::error::Error;

impl LazyGraph {
    /// Whether a critical-section begin of `kind` would find room in every buffer it
    /// pushes to.
    pub(crate) fn room_for_begin(&self, kind: CsKind) -> bool {
        let bufs = &self.inner.buffers;
        let per_op = match kind {
            CsKind::Input => &bufs.inputs,
            CsKind::Output => &bufs.outputs,
        };
        let room = |b: &crate::doors::lazy::Buffer<_>| b.len() < b.capacity();
        room(&bufs.wait) && room(&bufs.callback) && per_op.iter().flatten().all(room)
    }

    /// Whether a launch would find room for its job instance.
    pub(crate) fn room_for_job(&self) -> bool {
        let bufs = &self.inner.buffers;
        bufs.callback_notifier.len() < bufs.callback_notifier.capacity()
            && bufs.source_tick.len() < bufs.source_tick.capacity()
    }

    /// A critical-section begin's body: builds the run's instance over `blobs` and
    /// `records` (one per interface op, in declaration order) and publishes it into the
    /// wait and callback buffers and each valid op's buffer. If the graph is closed, the
    /// instance is dropped and its records fail with [`Error::GraphClosed`].
    pub(crate) fn begin(
        &self,
        kind: CsKind,
        blobs: Vec<Arc<Blob>>,
        records: Vec<Arc<SharedEventRecord>>,
        block: bool,
    ) {
        let ifaces = match kind {
            CsKind::Input => &self.inner.inputs,
            CsKind::Output => &self.inner.outputs,
        };
        let ops = ifaces
            .iter()
            .zip(blobs)
            .zip(records)
            .map(|((i, blob), record)| CsOp {
                name: i.name.as_str().into(),
                blob,
                record,
            })
            .collect();
        let cs = Arc::new(CriticalSectionInstance::new(
            kind,
            self.inner.job.clone(),
            ops,
        ));
        let bufs = &self.inner.buffers;
        let per_op = match kind {
            CsKind::Input => &bufs.inputs,
            CsKind::Output => &bufs.outputs,
        };
        let mut ok = bufs.wait.push_with(cs.clone(), block).is_ok()
            && bufs.callback.push_with(cs.clone(), block).is_ok();
        for b in per_op.iter().flatten() {
            ok = ok && b.push_with(cs.clone(), block).is_ok();
        }
        if !ok {
            cs.finish_with_error(&Error::GraphClosed {
                job: self.inner.job.to_string(),
            });
        }
    }

    /// The launch's body, after the queue step: pushes `job` to the callback-notifier,
    /// then the source-tick buffer (blocking while full if `block`). If the graph is
    /// closed, `job` finishes with [`Error::GraphClosed`].
    pub(crate) fn push_job(&self, job: Arc<JobInstance>, block: bool) {
        let bufs = &self.inner.buffers;
        let ok = bufs.callback_notifier.push_with(job.clone(), block).is_ok()
            && bufs.source_tick.push_with(job.clone(), block).is_ok();
        if !ok {
            job.finish(Err(Error::GraphClosed {
                job: self.inner.job.to_string(),
            }));
        }
    }
}
