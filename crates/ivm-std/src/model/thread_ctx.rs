//! A worker thread's context: the queue of instructions the engine dispatched to it and
//! the notifier it sleeps on. Streams hold their thread's context; the thread that runs it
//! is in `worker.rs`.

use std::sync::Arc;

use ivm_core::mpsc::MpscQueue;
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, Ordering};

use crate::model::instruction::{Instruction, WorkerTag};
use crate::util::futex::FutexWait;

/// One worker thread's context: its queue of dispatched instructions and its notifier.
pub(crate) struct ThreadCtx {
    pub(crate) name: String,
    pub(crate) queue: MpscQueue<Instruction, WorkerTag>,
    pub(crate) notifier: Notifier<FutexWait>,
    /// A hint, not part of any protocol: set while the worker sleeps on its notifier (and
    /// until it runs again after a wake). Waiters spin with spin-loop hints only while it
    /// is clear (the worker is running), and yield their CPU otherwise.
    pub(crate) parked: AtomicBool,
}

impl std::fmt::Debug for ThreadCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadCtx")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ThreadCtx {
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            queue: MpscQueue::new(),
            notifier: Notifier::new(),
            parked: AtomicBool::new(false),
        }
    }

    /// Whether the worker sleeps (or was woken and has not run yet): a hint.
    pub(crate) fn is_parked(&self) -> bool {
        // Relaxed: a hint; nothing is read through it.
        self.parked.load(Ordering::Relaxed)
    }

    /// Hands `instr` to this worker (engine side). Wakes the worker only on the
    /// empty-to-non-empty edge; a worker that is draining or polling reaches it anyway.
    pub(crate) fn submit(&self, instr: Arc<Instruction>) {
        if self.queue.push(instr) {
            // Err(Closed) only after shutdown closed us, when the engine is idle: the
            // push above cannot happen then.
            let _ = self.notifier.notify();
        }
    }

    /// Test hook: pops one dispatched instruction (no worker thread may run for `self`).
    #[cfg(test)]
    pub(crate) fn try_pop(&self) -> Option<Arc<Instruction>> {
        // SAFETY: tests that call this run no worker for this context, so this is the
        // only consumer.
        unsafe { self.queue.try_pop_unchecked() }.item()
    }

    /// Shutdown: the worker drains what is left and exits.
    pub(crate) fn close(&self) {
        self.notifier.close();
    }
}
