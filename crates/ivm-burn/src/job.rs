//! The box an operation travels in from the caller to its kernel, and back.
//!
//! An op is built on the caller's thread (burn allocates its shapes there) and its kernel
//! runs on a worker. With glibc's allocator a heap block freed on another thread than the
//! one that allocated it takes the allocating arena's lock, so every op whose box and
//! shapes the worker freed made the caller's next allocations wait on that lock or wake
//! the worker from it (ARCHITECTURE.md, "ivm-burn"). Here the client allocates each box
//! once and reuses it: the kernel runs the op, drops the op's operands at once (a value no
//! later op needs is freed as soon as it would have been before), and hands the box, with
//! the spent op still inside, back to the client's [`Yard`]. The client takes boxes back
//! at its next flush and drops the spent op on its own thread when it reuses the box.
//! The kernel's closure holds only a [`Ticket`] (two pointers), which the VM keeps inline
//! in the instruction, so submitting an op allocates nothing of ivm's either.

use std::sync::{Arc, Mutex, MutexGuard};

use burn_ir::{OperationIr, TensorIr};

use crate::dispatch::{self, Operands};
use crate::fuse::FillWhereLe;

/// What one instruction's kernel runs: one of burn's operations, or two the client fused
/// (`fuse.rs`).
pub(crate) enum Work {
    Op(OperationIr),
    FillWhereLe(FillWhereLe),
}

impl Work {
    /// Every tensor the work reads or writes, with the status burn gave it.
    pub(crate) fn operands(&self) -> Vec<&TensorIr> {
        match self {
            Work::Op(op) => dispatch::operands(op),
            Work::FillWhereLe(f) => f.operands(),
        }
    }

    /// Whether it draws from ndarray's random generator (`dispatch::draws_random`).
    pub(crate) fn draws_random(&self) -> bool {
        match self {
            Work::Op(op) => dispatch::draws_random(op),
            Work::FillWhereLe(_) => false,
        }
    }

    fn run(&self, operands: &Operands) {
        match self {
            Work::Op(op) => dispatch::run(op, operands),
            Work::FillWhereLe(f) => f.run(operands),
        }
    }
}

/// One operation and its operands' slots, in a box the client reuses.
pub(crate) struct Job {
    /// The work: the next one while the job is on its way, the spent one (dropped when the
    /// box is reused) once it came back.
    op: Work,
    operands: Operands,
}

/// A job's box. The box, not the job, is what moves between threads: the kernel's
/// closure holds one pointer, and the block is allocated once, on the client's thread.
pub(crate) struct JobBox(Box<Job>);

/// Where kernels hand their boxes back to the client.
#[derive(Default)]
pub(crate) struct Yard {
    returned: Mutex<Vec<JobBox>>,
}

impl Yard {
    fn lock(&self) -> MutexGuard<'_, Vec<JobBox>> {
        // Nothing panics while the list is held (a push or a drain), so a poisoned lock
        // still holds a consistent list.
        self.returned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves every box handed back so far into `spare`, keeping at most `cap` there (the
    /// others are dropped here, on the client's thread). The yard's list keeps its
    /// capacity, so a kernel's hand-back does not allocate in steady state.
    pub(crate) fn collect(&self, spare: &mut Vec<JobBox>, cap: usize) {
        let mut returned = self.lock();
        let room = cap.saturating_sub(spare.len()).min(returned.len());
        spare.extend(returned.drain(..room));
        let extra: Vec<JobBox> = returned.drain(..).collect();
        drop(returned);
        drop(extra);
    }
}

/// A job on its way to its kernel. Whether the kernel runs, panics or never runs (a
/// failed input, a VM shutting down), the box goes back to the yard when the ticket goes.
pub(crate) struct Ticket {
    job: Option<JobBox>,
    yard: Arc<Yard>,
}

impl Ticket {
    /// `op` with `operands` in a box from `spare` (a new one if none is left), bound for
    /// `yard`. A reused box's spent op is dropped here, on the caller's thread.
    pub(crate) fn new(
        spare: &mut Vec<JobBox>,
        yard: &Arc<Yard>,
        op: Work,
        operands: Operands,
    ) -> Self {
        let job = match spare.pop() {
            Some(JobBox(mut job)) => {
                job.op = op;
                job.operands = operands;
                JobBox(job)
            }
            None => JobBox(Box::new(Job { op, operands })),
        };
        Self {
            job: Some(job),
            yard: yard.clone(),
        }
    }

    /// Runs the work on the inner backend (see [`dispatch::run`]).
    pub(crate) fn run(self) {
        if let Some(JobBox(job)) = &self.job {
            job.op.run(&job.operands);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(mut job) = self.job.take() {
            // The operands now: their values may be a tensor's last handles.
            job.0.operands = Operands::default();
            self.yard.lock().push(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drop_op() -> Work {
        Work::Op(OperationIr::Drop(burn_ir::TensorIr {
            id: burn_ir::TensorId::new(7),
            shape: burn_tensor::Shape::new([2, 3]),
            status: burn_ir::TensorStatus::ReadWrite,
            dtype: burn_tensor::DType::F32,
        }))
    }

    #[test]
    fn a_box_comes_back_whether_its_kernel_ran_or_not() {
        let yard = Arc::new(Yard::default());
        let mut spare = Vec::new();
        let ran = Ticket::new(&mut spare, &yard, drop_op(), Operands::default());
        let unrun = Ticket::new(&mut spare, &yard, drop_op(), Operands::default());
        ran.run();
        drop(unrun);
        yard.collect(&mut spare, 8);
        assert_eq!(spare.len(), 2);
        // Reused, not allocated again.
        let before: Vec<*const Job> = spare.iter().map(|b| &*b.0 as *const Job).collect();
        let t = Ticket::new(&mut spare, &yard, drop_op(), Operands::default());
        let used = &*t.job.as_ref().unwrap().0 as *const Job;
        assert!(before.contains(&used));
        assert_eq!(spare.len(), 1);
    }

    #[test]
    fn at_most_cap_boxes_are_kept() {
        let yard = Arc::new(Yard::default());
        let mut spare = Vec::new();
        for _ in 0..5 {
            drop(Ticket::new(
                &mut spare,
                &yard,
                drop_op(),
                Operands::default(),
            ));
        }
        yard.collect(&mut spare, 3);
        assert_eq!(spare.len(), 3);
        assert!(yard.lock().is_empty());
    }

    #[test]
    fn a_panicking_kernel_still_returns_its_box() {
        let yard = Arc::new(Yard::default());
        let mut spare = Vec::new();
        // A custom op has no kernel here: `dispatch::run` panics.
        let op = Work::Op(OperationIr::Custom(burn_ir::CustomOpIr::new(
            "nope",
            &[],
            &[],
        )));
        let t = Ticket::new(&mut spare, &yard, op, Operands::default());
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.run())).is_err());
        yard.collect(&mut spare, 8);
        assert_eq!(spare.len(), 1);
    }
}
