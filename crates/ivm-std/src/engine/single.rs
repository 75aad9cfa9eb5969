//! Single-thread mode's driving: the engine sits in a mutex ([`VmCore::engine`]) and the
//! calling thread runs it ([`VmCore::drive_until`]), holding it as a [`SingleEngine`]
//! only while it steps, never while it sleeps; what it waits for between steps is
//! announced through [`SingleWaits`](crate::engine::drive::SingleWaits).

use std::sync::MutexGuard;

use ivm_core::wait::Wait;

use crate::engine::Engine;
use crate::engine::core::{ReentryGuard, VmCore};
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;
use crate::util::lock;

/// Single-thread mode: the engine, held by this thread. Letting go (drop, or
/// [`unlock_own`](Self::unlock_own)) announces the release to a caller that found it held
/// ([`SingleWaits::released`](crate::engine::drive::SingleWaits::released)).
pub(crate) struct SingleEngine<'a> {
    guard: Option<MutexGuard<'a, Engine>>,
    waits: &'a crate::engine::drive::SingleWaits,
}

impl SingleEngine<'_> {
    /// Lets go; `seen` is the holder's own snapshot (see `SingleWaits::notify_own`).
    pub(crate) fn unlock_own(mut self, seen: &mut u32) {
        drop(self.guard.take());
        self.waits.released(Some(seen));
    }
}

impl std::ops::Deref for SingleEngine<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        self.guard
            .as_ref()
            .expect("ivm: the engine guard is held until drop")
    }
}

impl std::ops::DerefMut for SingleEngine<'_> {
    fn deref_mut(&mut self) -> &mut Engine {
        self.guard
            .as_mut()
            .expect("ivm: the engine guard is held until drop")
    }
}

impl Drop for SingleEngine<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            drop(g);
            self.waits.released(None);
        }
    }
}

impl VmCore {
    /// Single-thread mode, holding the engine: drains the pending queue and steps, a few
    /// steps at most, until a step makes no progress (the fast paths that need the engine
    /// at rest: [`run_at_rest`](Self::run_at_rest), `try_direct`).
    pub(crate) fn step_to_rest(&self, engine: &mut SingleEngine<'_>) {
        const REST_STEPS: u32 = 8;
        for _ in 0..REST_STEPS {
            self.drain_pending(engine);
            if !engine.step(self) {
                break;
            }
            // A caller waiting on another thread may be done now.
            self.token().waits.notify();
        }
    }

    /// Single-thread mode: runs the engine in this thread until it can make no progress
    /// (waiting for the engine first if another thread holds it).
    pub(crate) fn drive(&self) -> Result<()> {
        self.drive_until(|idle| idle.is_some(), None)
    }

    /// Single-thread mode: the engine if nobody holds it (see [`SingleEngine`]).
    pub(crate) fn try_engine(&self) -> Option<SingleEngine<'_>> {
        let m = self.single_engine()?;
        let guard = match m.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(SingleEngine {
            guard: Some(guard),
            waits: &self.token().waits,
        })
    }

    /// Single-thread mode: the engine, waiting for it if another thread holds it (which
    /// only ever holds it while it steps, never while it sleeps).
    pub(crate) fn lock_engine(&self) -> Option<SingleEngine<'_>> {
        Some(SingleEngine {
            guard: Some(lock(self.single_engine()?)),
            waits: &self.token().waits,
        })
    }

    /// Single-thread mode: runs the engine in this thread until `done` holds, or
    /// [`Error::Timeout`] with a diagnostic once `deadline` passed or after a whole
    /// timeout period in which no instruction finished.
    ///
    /// `done(Some(idle))` is asked after a drive that left the engine unable to progress
    /// (`idle`: nothing pending or lively); `done(None)` while another thread holds the
    /// engine. In between it sleeps ([`SingleWaits`]) **without** the engine, so that
    /// another thread (a graph kernel calling the VM, another caller) can drive it,
    /// until something is announced: a device or lazy-job completion, a push, another
    /// driver's progress, the release of the engine it found held, or a deadline.
    ///
    /// [`SingleWaits`]: crate::engine::drive::SingleWaits
    pub(crate) fn drive_until(
        &self,
        done: impl FnMut(Option<bool>) -> bool,
        deadline: Option<ivm_core::wait::Instant>,
    ) -> Result<()> {
        self.drive_until_helping(done, deadline, || false, || None)
    }

    /// [`drive_until`](Self::drive_until), and before each sleep `help()`: work that runs
    /// on the waiting caller rather than on a thread of its own (a lazy graph's ready
    /// actors, `LazyGraph::set_caller_helper`). When it ran something the caller drives
    /// again instead of sleeping: waiting for a thread that may not have a CPU is never
    /// faster than doing its work.
    ///
    /// `elsewhere()` counts progress that another thread makes towards what is waited for
    /// (a lazy graph's kernels, `LazyGraph::set_progress_probe`), `None` when there is
    /// none: while it moves the caller spins for the announcement instead of sleeping
    /// ([`spin_for_announcement`](Self::spin_for_announcement)).
    pub(crate) fn drive_until_helping(
        &self,
        mut done: impl FnMut(Option<bool>) -> bool,
        deadline: Option<ivm_core::wait::Instant>,
        mut help: impl FnMut() -> bool,
        mut elsewhere: impl FnMut() -> Option<u64>,
    ) -> Result<()> {
        if self.single_engine().is_none() {
            return Ok(());
        }
        // The caller runs (and waits for) the VM's work from here on.
        let _hook = self.wait_scope();
        let _reentry = ReentryGuard::enter(self.id());
        let waits = &self.token().waits;
        let period = self.config().timeout_period;
        let mut last = self.progress();
        // The end of the current period without progress, from the first look at the clock:
        // a drive that is done at once (every `run` in this mode) reads no clock.
        let mut period_end: Option<ivm_core::wait::Instant> = None;
        // Whether the wait is over: the caller's deadline, or a period without progress.
        let expired = |last: &mut usize, period_end: &mut Option<ivm_core::wait::Instant>| {
            let now = FutexWait::now();
            if deadline.is_some_and(|d| now >= d) {
                return true;
            }
            let end = *period_end.get_or_insert_with(|| now.saturating_add(period));
            if now >= end {
                let f = self.progress();
                if f == *last {
                    return true;
                }
                *last = f;
                *period_end = Some(now.saturating_add(period));
            }
            false
        };
        loop {
            // Before looking at anything: what is announced after this ends the wait.
            let mut seen = waits.snapshot();
            let mut engine = self.try_engine();
            if engine.is_none() {
                // Held by another thread: ask for its release, then try once more (see
                // `SingleWaits::want_engine`).
                waits.want_engine();
                engine = self.try_engine();
            }
            if let Some(mut engine) = engine {
                // Only the holder of the engine consumes the pending queue.
                let mut consumer = self.pending().consume();
                loop {
                    let end = consumer.drain(|i| engine.receive(i));
                    if engine.step(self) {
                        // Another waiter's result may be ready.
                        waits.notify_own(&mut seen);
                        if !end.may_sleep() || engine.has_work() || !self.pending().is_empty() {
                            continue;
                        }
                        // Nothing left that a step could do: no more (empty) step.
                        break;
                    }
                    if !end.may_sleep() {
                        ivm_core::sync::spin_loop();
                        continue;
                    }
                    break;
                }
                drop(consumer);
                if done(Some(engine.is_idle())) {
                    return Ok(());
                }
                if expired(&mut last, &mut period_end) {
                    let d = engine.diagnostic();
                    // What the core adds (device work given up, graphs' states) runs
                    // user code: not while holding the engine.
                    drop(engine);
                    return Err(Error::Timeout(self.completed_diagnostic(d)));
                }
                let busy = engine.has_work();
                engine.unlock_own(&mut seen);
                if busy {
                    continue;
                }
            } else if done(None) {
                return Ok(());
            } else if expired(&mut last, &mut period_end) {
                return Err(Error::Timeout(self.diagnostic()));
            }
            if help() || self.spin_for_announcement(seen, &mut elsewhere) {
                continue;
            }
            // Set: `expired` ran on every way here.
            let end = period_end.unwrap_or_else(|| FutexWait::now().saturating_add(period));
            waits.wait(seen, deadline.map_or(end, |d| d.min(end)));
        }
    }

    /// Single-thread mode, before the caller sleeps for an announcement (`seen`: its
    /// snapshot of [`SingleWaits`](crate::engine::drive::SingleWaits)): spins instead while
    /// `elsewhere()` keeps moving — another thread (a lazy graph's) computes what the caller
    /// waits for and will announce it when done — for at most [`CALLER_PROGRESS_SPIN`],
    /// giving up after [`CALLER_STALL`] without a move. Returns whether the announcement
    /// came (the caller drives again, having saved the futex sleep and wake-up); false at
    /// once with nothing to count, or when the caller's CPU is shared (spinning would only
    /// take it from the thread it waits for: `preemption.rs`).
    ///
    /// [`CALLER_PROGRESS_SPIN`]: crate::util::tuning::CALLER_PROGRESS_SPIN
    /// [`CALLER_STALL`]: crate::util::tuning::CALLER_STALL
    fn spin_for_announcement(
        &self,
        seen: u32,
        elsewhere: &mut impl FnMut() -> Option<u64>,
    ) -> bool {
        use crate::util::tuning::{CALLER_PROGRESS_SPIN, CALLER_STALL};
        let Some(mut last) = elsewhere() else {
            return false;
        };
        let start = std::time::Instant::now();
        if crate::engine::helping::caller_contended(start) {
            return false;
        }
        let waits = &self.token().waits;
        let mut last_change = start;
        loop {
            for _ in 0..32 {
                if waits.snapshot() != seen {
                    return true;
                }
                ivm_core::sync::spin_loop();
            }
            let now = std::time::Instant::now();
            if now.duration_since(start) >= CALLER_PROGRESS_SPIN
                || crate::engine::helping::caller_look(self, now)
            {
                return false;
            }
            match elsewhere() {
                Some(e) if e != last => {
                    last = e;
                    last_change = now;
                }
                _ if now.duration_since(last_change) >= CALLER_STALL => return false,
                _ => {}
            }
        }
    }
}
