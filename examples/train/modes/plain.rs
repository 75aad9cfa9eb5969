//! Plain: the program's kernels called directly on the training thread, no VM.

use std::sync::Arc;

use ivm::ivm_std::{DeviceMemory, HostMemory, Result};

use crate::kernels;
use crate::program::Program;
use crate::trace::{self, Cat};

use super::*;

/// `f32`s in the memory the VM gives a cpu tensor ([`HostMemory`]: aligned to 128 bytes),
/// so that the plain baseline computes on memory laid out like the VM modes' and the
/// comparison measures the VM, not the allocator (with `Vec<f32>`, 16-byte aligned, the
/// kernels' vector loads straddle cache lines where the VM's do not).
struct PlainBuf {
    mem: HostMemory,
    len: usize,
}

impl Default for PlainBuf {
    fn default() -> Self {
        Self::from_slice(&[])
    }
}

impl PlainBuf {
    fn from_slice(v: &[f32]) -> Self {
        Self {
            mem: HostMemory::from_bytes(&bytes_of(v)),
            len: v.len(),
        }
    }

    fn ptr(&self) -> *mut f32 {
        let p = self.mem.host_ptr().expect("cpu memory has a host pointer");
        p.as_ptr().cast()
    }

    fn as_slice(&self) -> &[f32] {
        // SAFETY: the memory holds `len` initialised `f32`s (4 * len bytes, copied in or
        // written through `as_mut_slice`; none for an empty buffer, whose pointer is
        // aligned and non-null), is aligned to 128 bytes, and is owned by `self`, which
        // this shared borrow keeps from being written meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_slice`; the exclusive borrow of `self` makes this the only view
        // of the memory.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

/// Plain: the same kernels called directly on host buffers, one thread, no VM.
pub struct Plain {
    prog: Arc<Program>,
    rows: TrainRows,
    bufs: Vec<PlainBuf>,
}

impl Plain {
    /// A plain trainer with the program's initial state.
    pub fn new(prog: Arc<Program>, rows: TrainRows) -> Self {
        let bufs = (0..prog.bufs.len())
            .map(|i| PlainBuf::from_slice(&prog.initial(i)))
            .collect();
        Self { prog, rows, bufs }
    }
}

impl Trainer for Plain {
    fn step(&mut self, batch: &Batch, _next: Option<&Batch>) -> Result<f32> {
        let p = &self.prog;
        let idx = &batch.order[batch.start..batch.start + p.batch];
        let (rows, bufs) = (&self.rows, &mut self.bufs);
        trace::span("gather", Cat::Kernel, || {
            kernels::gather(&rows.x, idx, bufs[p.x].as_mut_slice(), rows.width)
        });
        trace::span("gather", Cat::Kernel, || {
            kernels::gather(&rows.y, idx, bufs[p.y].as_mut_slice(), 1)
        });
        for op in &p.ops {
            let mut out = std::mem::take(&mut self.bufs[op.write]);
            let mut reads: [&[f32]; 4] = [&[]; 4];
            for (r, &i) in reads.iter_mut().zip(&op.reads) {
                *r = self.bufs[i].as_slice();
            }
            trace::span(op.name, Cat::Kernel, || {
                (op.kernel)(&reads[..op.reads.len()], out.as_mut_slice())
            });
            self.bufs[op.write] = out;
        }
        Ok(self.bufs[p.loss].as_slice()[0])
    }

    fn weights(&mut self) -> Result<Weights> {
        Ok(self
            .prog
            .weights
            .iter()
            .map(|&(w, b)| {
                (
                    self.bufs[w].as_slice().to_vec(),
                    self.bufs[b].as_slice().to_vec(),
                )
            })
            .collect())
    }
}
