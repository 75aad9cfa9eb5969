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

use ivm_core::sync::Ordering;

use crate::engine::core::{ReentryGuard, VmCore};
use crate::model::instruction::Instruction;
use crate::model::thread_ctx::ThreadCtx;

/// The body of a worker thread.
pub(crate) fn worker_loop(ctx: Arc<ThreadCtx>, shared: Arc<VmCore>) {
    let _reentry = ReentryGuard::enter(shared.id);
    let counters = shared.stats.thread(&ctx.name);
    let mut consumer = ctx.queue.consume();
    let poll = shared.config.worker_poll_window;
    // A release this worker owes the engine (see `drive::Owed`).
    let owed = crate::engine::drive::Owed::default();
    let run = |instr: Arc<Instruction>| {
        // Before running anything (it may take long), settle what we owe, unless a
        // helper spins: it takes care of it (`drive::Helping`).
        if owed.is_owed() {
            owed.settle(&shared, !shared.helper_spinning());
        }
        let sync_access = instr.waiter.is_some();
        crate::engine::execute::execute(&instr);
        drop(instr);
        // After DONE (Release inside `execute`): the engine must release it.
        if sync_access {
            // Its caller is about to come back and drive the engine anyway (usually
            // within a microsecond): leave the release to it, so the engine's data stays
            // in the caller's cache; settled below if nobody takes the engine soon.
            owed.mark(&shared, true);
        } else if !ctx.queue.is_empty() && shared.helper_spinning() {
            // More to run, and a caller spins waiting: it releases this one while we run
            // the next (checked again after the mark, before the next instruction).
            owed.mark(&shared, false);
        } else {
            // Releases it here (readying its successors, on any stream) when nobody
            // holds the engine, else marks it for the holder (`drive.rs`).
            shared.completed();
            owed.discharged();
        }
    };
    let mut idle_since: Option<Instant> = None;
    let (mut idle_steps, mut idle_for) = (0u32, std::time::Duration::ZERO);
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
            (idle_steps, idle_for) = (0, std::time::Duration::ZERO);
            backoff.reset();
            continue;
        }
        if !end.may_sleep() {
            // A push is half done: its producer may not wake us. Never sleep here.
            backoff.spin();
            continue;
        }
        owed.settle(&shared, false);
        // Poll: spin-loop hints first (the next instruction of a busy caller comes within
        // microseconds), then back off to `yield_now` (few cores: do not starve anyone),
        // reading the clock every 16 steps only.
        let since = *idle_since.get_or_insert_with(Instant::now);
        idle_steps = idle_steps.wrapping_add(1);
        if idle_steps.is_multiple_of(16) {
            idle_for = since.elapsed();
        }
        if idle_for < poll {
            if idle_for < crate::util::tuning::WORKER_PURE_SPIN {
                ivm_core::sync::spin_loop();
            } else {
                backoff.snooze();
            }
            continue;
        }
        if owed.is_owed() {
            // Never sleep owing a release.
            owed.settle(&shared, true);
            continue;
        }
        // Relaxed: hints (see `ThreadCtx::parked`).
        ctx.parked.store(true, Ordering::Relaxed);
        let woken = ctx.notifier.wait_and_clear();
        ctx.parked.store(false, Ordering::Relaxed);
        counters.record(true, woken.is_ok());
        match woken {
            Ok(()) => {
                idle_since = None;
                (idle_steps, idle_for) = (0, std::time::Duration::ZERO);
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
