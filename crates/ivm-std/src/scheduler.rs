//! The scheduler thread: owns the engine, drains the pending queue into it, steps it, and
//! sleeps through ivm-core's parking protocol when it cannot make progress.
//!
//! After its last progress the scheduler keeps polling for `scheduler_work_window` while
//! instructions are lively (a completion may come any moment); then it parks. An idle
//! engine parks at once: only new input can wake it, and its producer unparks us. Before sleeping, `Parking::park` re-checks every input: the pending queue, a
//! releasable instruction at the front of a running list (workers set DONE, then unpark),
//! submitted probes and shutdown. While probes are registered it parks with a deadline (a
//! probe is polled, it cannot wake anyone). It never busy-polls while an instruction runs
//! for long.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::Engine;
use crate::futex::FutexWait;
use crate::shared::{ReentryGuard, VmShared};

pub(crate) fn scheduler_loop(shared: Arc<VmShared>, mut engine: Engine) {
    let _reentry = ReentryGuard::enter(shared.id);
    let mut consumer = shared.pending.consume();
    let window = shared.config.scheduler_work_window;
    let mut last_progress = Instant::now();
    // Idle polling backs off to `yield_now`, so that on a machine with few cores the
    // scheduler's work window does not starve the caller or the workers.
    let backoff = ivm_core::sync::Backoff::new();
    loop {
        let end = consumer.drain(|i| engine.receive(i));
        let progress = engine.step(&shared);
        if progress {
            last_progress = Instant::now();
            backoff.reset();
            continue;
        }
        if !end.may_sleep() {
            backoff.spin();
            continue;
        }
        if shared.stop_requested() && engine.is_idle() && shared.pending.is_empty() {
            break;
        }
        // Poll through the window only while something lively may complete; an idle
        // engine can only get new input, whose producer unparks us.
        if !engine.is_idle() && last_progress.elapsed() < window {
            backoff.snooze();
            continue;
        }
        let deadline = engine.has_probes().then(|| {
            use ivm_core::wait::Wait;
            FutexWait::now().saturating_add(window)
        });
        let _ = shared.parking.park(
            || {
                !shared.pending.is_empty()
                    || engine.has_work()
                    || shared.probes_submitted()
                    || (shared.stop_requested() && engine.is_idle())
            },
            deadline,
        );
        last_progress = Instant::now();
        backoff.reset();
    }
    shared.publish_counters(engine.counters());
    shared.close_workers();
    drop(consumer);
    drop(engine);
}
