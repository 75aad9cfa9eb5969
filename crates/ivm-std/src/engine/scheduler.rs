//! The scheduler thread: the engine's driver of last resort (see `drive/`).
//!
//! Callers and workers drive the engine themselves whenever it is free, so on the common
//! paths this thread sleeps. It takes the engine when it is woken: a device completion,
//! a probe or shutdown arrived while nobody drove, a driver handed over (step budget
//! spent, a probe or user barrier to run: both belong to this thread), or shutdown. It then
//! drives until the engine makes no progress, polls for `scheduler_work_window` while
//! instructions are lively (many-core machines; a completion may come any moment), lets
//! go of the engine and parks through ivm-core's parking protocol, re-checking before it
//! sleeps whether input was marked on an engine nobody holds, or a probe was submitted.
//! While probes are registered it parks with a deadline (a probe is polled, it cannot
//! wake anyone). It never busy-polls while an instruction runs for long.
//!
//! At shutdown, once the engine is idle, it takes the engine out of its cell, closes the
//! workers and exits **holding** the engine token, so that nobody drives again.

use std::sync::Arc;
use std::time::Instant;

use ivm_core::wait::Wait;

use crate::engine::core::{ReentryGuard, VmCore};
use crate::engine::drive::Driver;
use crate::util::futex::FutexWait;
use crate::util::tuning::PROBE_POLL;

pub(crate) fn scheduler_loop(shared: Arc<VmCore>) {
    let _reentry = ReentryGuard::enter(shared.id());
    // Relaxed: a hint for callers' looks at the threads beside the VM's (`neighbours.rs`).
    shared.scheduler_tid.store(
        crate::engine::neighbours::current_tid(),
        ivm_core::sync::Ordering::Relaxed,
    );
    let counters = shared.stats().scheduler();
    let wake = shared.token();
    let window = shared.config().scheduler_work_window;
    let probe_period = if window.is_zero() { PROBE_POLL } else { window };
    let mut last_progress = Instant::now();
    let mut lively = false;
    let mut probes = false;
    // Window polling backs off to `yield_now`, so that on a machine with few cores it does
    // not starve the caller or the workers.
    let backoff = ivm_core::sync::Backoff::new();
    loop {
        if wake.try_lock() {
            // SAFETY: we hold the engine token; the reference ends before we let go.
            let cell = unsafe { shared.cell().get() };
            let engine = cell
                .as_mut()
                .expect("ivm: the engine stays in its cell until the scheduler exits");
            engine.set_driver(Driver::Scheduler, shared.config().inline_sync_access);
            let exit = loop {
                shared.drain_pending(engine);
                if engine.step(&shared) {
                    last_progress = Instant::now();
                    backoff.reset();
                    continue;
                }
                if shared.stop_requested() && engine.is_idle() && shared.pending().is_empty() {
                    break true;
                }
                lively = !engine.is_idle();
                probes = engine.has_probes();
                if wake.unlock() {
                    break false;
                }
            };
            if exit {
                shared.publish_counters(engine.counters());
                let engine = cell.take();
                shared.close_workers();
                drop(engine);
                shared.pool().clear();
                shared.scheduler_exited();
                // Keep the token: nobody drives a VM that is gone.
                return;
            }
        }
        // Poll through the window only while something lively may complete; an idle
        // engine can only get new input, whose producer drives or unparks us.
        if lively && last_progress.elapsed() < window {
            if wake.dirty_unlocked() {
                continue;
            }
            backoff.snooze();
            continue;
        }
        let deadline = probes.then(|| FutexWait::now().saturating_add(probe_period));
        let parked = wake.park(
            || wake.dirty_unlocked() || shared.probes_submitted(),
            deadline,
        );
        counters.record(
            parked != ivm_core::parking::Park::HadInput,
            parked == ivm_core::parking::Park::Unparked,
        );
        last_progress = Instant::now();
        backoff.reset();
    }
}
