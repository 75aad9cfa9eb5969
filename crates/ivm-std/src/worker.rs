//! Worker threads: one per thread context, running the instructions the engine hands them.
//!
//! A worker drains its queue, runs each instruction, marks it done and has the engine
//! release it (driving the engine itself when nobody holds it, see `drive.rs`); then it
//! keeps polling for the configured window (`worker_poll_window`) and only then blocks on
//! its notifier. The engine notifies only when its push found the
//! queue empty (the MPSC was-empty protocol), and the notifier makes no wake call when the
//! worker is not asleep.

use std::sync::Arc;
use std::time::Instant;

use ivm_core::mpsc::MpscQueue;
use ivm_core::notifier::Notifier;

use crate::futex::FutexWait;
use crate::instruction::{self, Instruction, WorkerTag};
use crate::shared::{ReentryGuard, VmShared};

/// One worker thread's context: its queue of dispatched instructions and its notifier.
pub(crate) struct ThreadCtx {
    pub(crate) name: String,
    queue: MpscQueue<Instruction, WorkerTag>,
    notifier: Notifier<FutexWait>,
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
        }
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

/// The body of a worker thread.
pub(crate) fn worker_loop(ctx: Arc<ThreadCtx>, shared: Arc<VmShared>) {
    let _reentry = ReentryGuard::enter(shared.id);
    let counters = shared.stats.thread(&ctx.name);
    let mut consumer = ctx.queue.consume();
    let poll = shared.config.worker_poll_window;
    // A release this worker owes the engine (see `drive::Owed`).
    let owed = crate::drive::Owed::default();
    let run = |instr: Arc<Instruction>| {
        // Before running anything (it may take long), settle what we owe.
        owed.settle(&shared, true);
        let sync_access = instr.waiter.is_some();
        instruction::execute(&instr);
        drop(instr);
        // After DONE (Release inside `execute`): the engine must release it.
        if sync_access {
            // Its caller is about to come back and drive the engine anyway (usually
            // within a microsecond): leave the release to it, so the engine's data stays
            // in the caller's cache; settled below if nobody takes the engine soon.
            owed.mark(&shared);
        } else {
            // Releases it here (readying its successors, on any stream) when nobody
            // holds the engine, else marks it for the holder (`drive.rs`).
            shared.completed();
            owed.discharged();
        }
    };
    let mut idle_since: Option<Instant> = None;
    // Polling backs off to `yield_now` (few cores: do not starve the caller).
    let backoff = ivm_core::sync::Backoff::new();
    loop {
        let mut ran = false;
        let end = consumer.drain(|i| {
            ran = true;
            run(i);
        });
        if ran {
            idle_since = None;
            backoff.reset();
            continue;
        }
        if !end.may_sleep() {
            // A push is half done: its producer may not wake us. Never sleep here.
            backoff.spin();
            continue;
        }
        owed.settle(&shared, false);
        let now = Instant::now();
        let since = *idle_since.get_or_insert(now);
        if now.duration_since(since) < poll {
            backoff.snooze();
            continue;
        }
        if owed.is_owed() {
            // Never sleep owing a release.
            owed.settle(&shared, true);
            continue;
        }
        let woken = ctx.notifier.wait_and_clear();
        counters.record(true, woken.is_ok());
        match woken {
            Ok(()) => {
                idle_since = None;
                backoff.reset();
            }
            Err(_closed) => {
                consumer.drain_until_empty(run);
                owed.settle(&shared, true);
                break;
            }
        }
    }
}
