//! What the VM hands a graph runtime per run: critical-section instances (one for the
//! inputs, one for the outputs) and a job instance.

use std::fmt;
use std::sync::{Arc, Mutex};

use crate::doors::lazy::record::{EndEvent, SharedEventRecord};
use crate::model::blob::Blob;
use crate::util::error::Error;
use crate::util::lock;

/// Which side of a run a [`CriticalSectionInstance`] covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CsKind {
    /// The run's inputs: the graph copies eager tensors into its blobs.
    Input,
    /// The run's outputs: the graph copies its blobs into eager tensors.
    Output,
}

/// One interface op of a critical section.
pub(crate) struct CsOp {
    pub(crate) name: Arc<str>,
    pub(crate) blob: Arc<Blob>,
    pub(crate) record: Arc<SharedEventRecord>,
}

/// One run's critical section over its input (or output) tensors, published by a
/// critical-section begin instruction into the job's buffers: one entry per valid
/// interface op, plus the wait and callback buffers.
///
/// Between its begin instruction and the end instruction of an op, the graph runtime may
/// access that op's eager tensor: the VM holds every conflicting eager instruction back
/// until the op's end record is done. [`copy_input`](Self::copy_input) /
/// [`copy_output`](Self::copy_output) do the copy and initialise the op's record in one
/// step, so no copy can start after the record was set. [`finish`](Self::finish)
/// initialises whatever is still empty. Dropped unfinished, it fails every empty record
/// with [`Error::GraphClosed`], so no end instruction waits forever.
pub struct CriticalSectionInstance {
    kind: CsKind,
    job: Arc<str>,
    ops: Box<[CsOp]>,
}

impl fmt::Debug for CriticalSectionInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CriticalSectionInstance")
            .field("kind", &self.kind)
            .field("job", &self.job)
            .field(
                "ops",
                &self.ops.iter().map(|o| &*o.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl CriticalSectionInstance {
    pub(crate) fn new(kind: CsKind, job: Arc<str>, ops: Vec<CsOp>) -> Self {
        Self {
            kind,
            job,
            ops: ops.into_boxed_slice(),
        }
    }

    /// Inputs or outputs.
    pub fn kind(&self) -> CsKind {
        self.kind
    }

    /// The job name.
    pub fn job_name(&self) -> &str {
        &self.job
    }

    /// Number of interface ops (valid or not), in the graph's declaration order.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the graph declares no interface op on this side.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The name of interface op `i`.
    pub fn op_name(&self, i: usize) -> &str {
        &self.ops[i].name
    }

    /// Bytes of the eager tensor of op `i`.
    pub fn nbytes(&self, i: usize) -> usize {
        self.ops[i].blob.nbytes
    }

    /// The end record of op `i`.
    pub fn record(&self, i: usize) -> &Arc<SharedEventRecord> {
        &self.ops[i].record
    }

    fn size_error(&self, i: usize, expected: usize) -> Error {
        Error::InterfaceSizeMismatch {
            job: self.job.to_string(),
            name: self.ops[i].name.to_string(),
            expected,
            got: self.ops[i].blob.nbytes,
        }
    }

    fn device_only(&self, i: usize) -> Error {
        Error::InvalidGraph {
            job: self.job.to_string(),
            message: format!(
                "interface op `{}`: the eager tensor's memory is not host-accessible \
                 (device-only memory is not supported by host copies)",
                self.ops[i].name
            ),
        }
    }

    fn already(&self, i: usize) -> Error {
        Error::InvalidGraph {
            job: self.job.to_string(),
            message: format!(
                "interface op `{}`: its end record was already initialised",
                self.ops[i].name
            ),
        }
    }

    /// Copies the eager input tensor of op `i` into `dst` and initialises the op's end
    /// record (done at once: the copy is synchronous). A tensor without memory (0 bytes)
    /// copies nothing and gets a done event.
    ///
    /// # Errors
    /// Not an input instance, `dst` of another size than the tensor
    /// ([`Error::InterfaceSizeMismatch`]; the record then fails with it), a poisoned
    /// tensor ([`Error::Poisoned`]; likewise), device-only memory, or the record was
    /// already initialised.
    pub fn copy_input(&self, i: usize, dst: &mut [u8]) -> Result<(), Error> {
        self.copy(i, CsKind::Input, dst.len(), |blob| {
            // SAFETY: the input begin instruction of this run has run (it published us)
            // and this op's end instruction, a reader of the tensor, cannot be done before
            // the record `copy` initialises right after this closure: the engine runs no
            // eager writer of the tensor meanwhile (engine-ordered invariant, extended over
            // the critical section). `copy` checked the memory is host-accessible.
            dst.copy_from_slice(unsafe { blob.bytes() });
        })
    }

    /// Copies `src` into the eager output tensor of op `i` and initialises the op's end
    /// record (done at once). A tensor without memory gets a done event.
    ///
    /// # Errors
    /// As [`copy_input`](Self::copy_input), for an output instance.
    pub fn copy_output(&self, i: usize, src: &[u8]) -> Result<(), Error> {
        self.copy(i, CsKind::Output, src.len(), |blob| {
            // SAFETY: the output begin instruction of this run has run and this op's end
            // instruction, a writer of the tensor, cannot be done before the record `copy`
            // initialises right after this closure: no other eager body accesses the
            // tensor meanwhile (engine-ordered invariant, extended over the critical
            // section; critical-section instructions' tensor edges are strict, so an
            // earlier run's access of the tensor is finished too).
            unsafe { blob.bytes_mut() }.copy_from_slice(src);
        })
    }

    fn wrong_kind(&self) -> Error {
        Error::InvalidGraph {
            job: self.job.to_string(),
            message: format!("copy on a {:?} critical section", self.kind),
        }
    }

    /// Checks op `i` and runs `f` on its tensor, then initialises its record, all under
    /// the record's lock (so no copy starts after the record was set).
    fn copy(&self, i: usize, kind: CsKind, len: usize, f: impl FnOnce(&Blob)) -> Result<(), Error> {
        let op = &self.ops[i];
        let mut res = Ok(());
        let ran = op.record.init_with(|| {
            let check = if self.kind != kind {
                Err(self.wrong_kind())
            } else if op.blob.nbytes == 0 {
                // A tensor without memory: nothing to copy.
                return EndEvent::Done;
            } else if op.blob.mem.host_ptr().is_none() {
                Err(self.device_only(i))
            } else if len != op.blob.nbytes {
                Err(self.size_error(i, len))
            } else if let Some(p) = op.blob.poison() {
                Err(p.poison_error())
            } else {
                Ok(())
            };
            match check {
                Ok(()) => {
                    f(&op.blob);
                    EndEvent::Done
                }
                Err(e) => {
                    res = Err(e.clone());
                    EndEvent::Failed(e)
                }
            }
        });
        if !ran {
            return Err(self.already(i));
        }
        res
    }

    /// Fails op `i`'s record with `err` unless it is already initialised.
    pub fn fail_op(&self, i: usize, err: Error) -> bool {
        self.ops[i].record.try_init(EndEvent::Failed(err))
    }

    /// The run's callback: initialises every record not yet initialised with a done event
    /// (init-once: initialised records keep their event), so every end instruction
    /// completes.
    pub fn finish(&self) {
        for op in self.ops.iter() {
            op.record.try_init(EndEvent::Done);
        }
    }

    /// Like [`finish`](Self::finish), failing every record not yet initialised with `err`.
    pub fn finish_with_error(&self, err: &Error) {
        for op in self.ops.iter() {
            op.record.try_init(EndEvent::Failed(err.clone()));
        }
    }

    /// Whether every record is initialised.
    pub fn is_finished(&self) -> bool {
        self.ops.iter().all(|o| o.record.is_initialised())
    }
}

impl Drop for CriticalSectionInstance {
    fn drop(&mut self) {
        // The common case, a finished instance, builds no error (no allocation per run).
        if self.is_finished() {
            return;
        }
        let err = Error::GraphClosed {
            job: self.job.to_string(),
        };
        self.finish_with_error(&err);
    }
}

/// What happens when a job instance finishes (the launch instruction's completion).
pub(crate) type JobFinish = Box<dyn FnOnce(Result<(), Error>) + Send>;

/// One run of a lazy job, pushed by the launch instruction into the job's source-tick
/// buffer (the graph starts an iteration) and callback-notifier buffer (the graph
/// finishes it at the end of the iteration). Finishing it marks the launch instruction
/// done. Dropped unfinished, it finishes with [`Error::GraphClosed`].
pub struct JobInstance {
    job: Arc<str>,
    params: Box<[Arc<Blob>]>,
    on_finish: Mutex<Option<JobFinish>>,
}

impl fmt::Debug for JobInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobInstance")
            .field("job", &self.job)
            .field("params", &self.params.len())
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl JobInstance {
    pub(crate) fn new(job: Arc<str>, params: Vec<Arc<Blob>>, on_finish: JobFinish) -> Self {
        Self {
            job,
            params: params.into_boxed_slice(),
            on_finish: Mutex::new(Some(on_finish)),
        }
    }

    /// The job name.
    pub fn job_name(&self) -> &str {
        &self.job
    }

    /// Number of parameter tensors.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// The error of the first parameter that a failed instruction poisoned, if any: a run
    /// must not compute from it. A graph runtime fails the run's iteration with it (its
    /// outputs are then poisoned with an error naming the first failure, and the run
    /// finishes with it).
    pub fn param_poison(&self) -> Option<Error> {
        self.params
            .iter()
            .find_map(|b| b.poison())
            .map(|f| f.poison_error())
    }

    /// Bytes of parameter `i`. Panics if there is no parameter `i`.
    pub fn param_nbytes(&self, i: usize) -> usize {
        self.params[i].nbytes
    }

    /// The bytes of parameter `i` (the eager tensor itself, used in place). Panics if
    /// there is no parameter `i`.
    ///
    /// # Safety
    /// Parameters belong to the run while its launch instruction — which writes every
    /// parameter — is neither finished nor released: between the pop of this instance
    /// from the source-tick buffer and [`finish`](Self::finish), no eager instruction
    /// accesses them. Within that window the graph runtime must not let a write of
    /// parameter `i` (a [`param_mut`](Self::param_mut) slice) overlap another access of
    /// it, and no slice may be used after `finish`.
    pub unsafe fn param(&self, i: usize) -> &[u8] {
        // SAFETY: the caller's contract: no write of this parameter while the slice lives,
        // and the launch instruction keeps eager bodies away from it.
        unsafe { self.params[i].bytes() }
    }

    /// The bytes of parameter `i`, mutably. Panics if there is no parameter `i`.
    ///
    /// # Safety
    /// As for [`param`](Self::param), and this slice is the only one of parameter `i`
    /// while it lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn param_mut(&self, i: usize) -> &mut [u8] {
        // SAFETY: the caller's contract: exclusive access to this parameter while the
        // slice lives.
        unsafe { self.params[i].bytes_mut() }
    }

    /// Finishes the run (the first call wins; later calls do nothing). Returns whether
    /// this call finished it.
    pub fn finish(&self, result: Result<(), Error>) -> bool {
        self.finish_with(|| result)
    }

    /// [`finish`](Self::finish) with a result made only if this call finishes the run.
    fn finish_with(&self, result: impl FnOnce() -> Result<(), Error>) -> bool {
        let f = lock(&self.on_finish).take();
        match f {
            Some(f) => {
                f(result());
                true
            }
            None => false,
        }
    }

    /// Whether [`finish`](Self::finish) was called.
    pub fn is_finished(&self) -> bool {
        lock(&self.on_finish).is_none()
    }
}

impl Drop for JobInstance {
    fn drop(&mut self) {
        // The error is built only for an unfinished run (no allocation per finished one).
        self.finish_with(|| {
            Err(Error::GraphClosed {
                job: self.job.to_string(),
            })
        });
    }
}
