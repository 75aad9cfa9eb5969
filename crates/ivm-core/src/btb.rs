//! [`BlockingThenBusy`] (BTB): wait for one instruction by sleeping while the queue in
//! front of it drains, then spinning for the short compute itself — and the notify-skip
//! handshake that lets a waiter skip the sleep (and the worker skip the wake call).
//!
//! # The handshake
//!
//! A BTB is a [`Notifier`] plus a counter set to 1. Two threads share it for one *round*:
//!
//! | worker (runs the instruction)        | waiter (wants its result)                       |
//! |--------------------------------------|-------------------------------------------------|
//! | [`notify`](BlockingThenBusy::notify) when it **starts** | optionally [`skip_blocking`](BlockingThenBusy::skip_blocking) (the notify-skip) |
//! | writes its results                   | [`wait_until_done`](BlockingThenBusy::wait_until_done): block on the notifier, then spin on the counter |
//! | [`decrease`](BlockingThenBusy::decrease) when it has **finished** | reads the results; [`reset`](BlockingThenBusy::reset) before the next round |
//!
//! * **Block, then spin.** The waiter sleeps on the notifier until the worker starts (no
//!   CPU burnt while the queue drains), then spins on the counter (no wake-up latency at the
//!   end). The spin is bounded by a [`SpinBudget`] (default ~50 µs): after it the waiter
//!   sleeps on the counter and the final `decrease()` wakes it — only then, because the
//!   decrease wakes only if its one RMW shows a sleeper. The spin checks the period and the
//!   closed flag.
//! * **Notify-skip.** When little work is in flight, the waiter calls `skip_blocking()`
//!   (it notifies its own BTB) before waiting: it never sleeps and spins from the start, and
//!   the worker's `notify()` finds nobody asleep and makes no wake call (the seed measured
//!   2–3 µs saved per sync access).
//! * **Publication.** `decrease()` is Release and the wait reads zero with Acquire: what
//!   the worker wrote before `decrease()` is visible to the waiter after
//!   `wait_until_done` returns `Ok`. The waiter never returns before `decrease()`.
//! * **Reuse.** A skip round can leave a *stale* notification (the worker's `notify()`
//!   arrives after the waiter consumed its own). A stale notification only lets the next
//!   wait start spinning early — never return early — and `reset()` clears it, so after
//!   `reset()` a non-skip round sleeps until that round's own `notify()`. `reset()` is
//!   legal only after a `wait_until_done` that returned `Ok`: the worker's `notify()` came
//!   before its `decrease()`, which the waiter has acquired, so nothing is in flight.
//! * **Shutdown.** [`close`](BlockingThenBusy::close) ends a wait in any phase with
//!   [`WaitError::Closed`], never a hang; a stop predicate, called once per period, ends
//!   it with [`WaitError::Stopped`].
//!
//! These are the invariants the loom model `tests/loom_handshake.rs` checks, with the BTB
//! reused across rounds.
//!
//! # Examples
//!
//! ```
//! use core::time::Duration;
//! use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
//! use ivm_core::btb::BlockingThenBusy;
//!
//! let btb: BlockingThenBusy = BlockingThenBusy::new();
//! let result = AtomicU32::new(0);
//!
//! for (round, skip) in [(1, false), (2, true), (3, false)] {
//!     std::thread::scope(|s| {
//!         // The worker: notify at start, publish, decrease at the end.
//!         s.spawn(|| {
//!             let _ = btb.notify(); // Err only if closed; the round still completes.
//!             result.store(round, Relaxed);
//!             btb.decrease();
//!         });
//!         // The waiter: skip the sleep when little is in flight, then wait.
//!         if skip {
//!             btb.skip_blocking();
//!         }
//!         // Duration::MAX: no period, the stop predicate is never called.
//!         btb.wait_until_done(Duration::MAX, || false).unwrap();
//!         // Relaxed suffices: decrease() is Release, the wait's read of zero Acquire.
//!         assert_eq!(result.load(Relaxed), round);
//!     });
//!     btb.reset(); // legal: the wait returned Ok
//! }
//! ```

use core::fmt;
use core::time::Duration;

use crate::counter::{BlockingCounter, Periods, WaitError};
use crate::notifier::{Closed, Notifier, Timed};
use crate::wait::{DefaultWait, Wait};

/// How long a [`BlockingThenBusy`] waiter spins on the counter before it sleeps.
///
/// Measured on the wait backend's clock ([`Wait::now`]); while that clock does not advance
/// (`NoClock`, loom) spin iterations are counted instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpinBudget {
    /// Spin at most this long (on the backend's clock).
    pub time: Duration,
    /// Spin at most this many backoff steps while the clock shows no progress.
    pub iterations: u32,
}

impl SpinBudget {
    /// ~50 µs (or 1000 steps without a clock; 2 under loom, to keep models small).
    pub const DEFAULT: SpinBudget = SpinBudget {
        time: Duration::from_micros(50),
        iterations: if cfg!(loom) { 2 } else { 1000 },
    };

    /// No spinning: sleep on the counter as soon as the worker has started.
    pub const NONE: SpinBudget = SpinBudget {
        time: Duration::ZERO,
        iterations: 0,
    };
}

impl Default for SpinBudget {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Block on a notifier until the worker starts, then spin on a counter until it finishes.
///
/// See the [module documentation](self) for the handshake, its invariants and an example.
pub struct BlockingThenBusy<W: Wait = DefaultWait> {
    notifier: Notifier<W>,
    counter: BlockingCounter<W>,
    spin: SpinBudget,
}

impl<W: Wait> Default for BlockingThenBusy<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W: Wait> fmt::Debug for BlockingThenBusy<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingThenBusy")
            .field("notifier", &self.notifier)
            .field("counter", &self.counter)
            .field("spin", &self.spin)
            .finish()
    }
}

impl<W: Wait> BlockingThenBusy<W> {
    crate::sync::loom_const_fn! {
        /// A BTB ready for its first round, with the default [`SpinBudget`].
        pub fn new() -> Self {
            Self::with_spin_budget(SpinBudget::DEFAULT)
        }
    }

    crate::sync::loom_const_fn! {
        /// A BTB ready for its first round that spins at most `spin` before sleeping.
        pub fn with_spin_budget(spin: SpinBudget) -> Self {
            Self {
                notifier: Notifier::new(),
                counter: BlockingCounter::new(1),
                spin,
            }
        }
    }

    /// The notifier (the "worker has started" signal).
    #[inline]
    pub fn notifier(&self) -> &Notifier<W> {
        &self.notifier
    }

    /// The counter (1 while the round's work is not finished), for diagnostics.
    #[inline]
    pub fn counter(&self) -> &BlockingCounter<W> {
        &self.counter
    }

    /// The spin budget.
    #[inline]
    pub fn spin_budget(&self) -> SpinBudget {
        self.spin
    }

    /// Worker, when it **starts** the instruction: lets the waiter move from sleeping to
    /// spinning. Makes no wake call if the waiter is not asleep (e.g. after a skip).
    ///
    /// # Errors
    ///
    /// [`Closed`] if the BTB was closed; the worker should still finish and `decrease()`.
    #[inline]
    pub fn notify(&self) -> Result<(), Closed> {
        self.notifier.notify()
    }

    /// Worker, when it has **finished**: Release (publishes the results to the waiter).
    ///
    /// # Panics
    ///
    /// In debug builds, if called twice in one round (counter underflow).
    #[inline]
    pub fn decrease(&self) {
        self.counter.decrease();
    }

    /// [`decrease`](Self::decrease) with Relaxed: a planted bug for the loom models.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_decrease_relaxed(&self) {
        self.counter.planted_decrease_relaxed();
    }

    /// Waiter, before [`wait_until_done`](Self::wait_until_done): the notify-skip fast path.
    ///
    /// Notifies the waiter's own BTB, so that the wait never sleeps and spins from the
    /// start, and the worker's [`notify`](Self::notify) finds nobody asleep and skips the
    /// wake call. Worth it when the instruction will start soon (little work in flight);
    /// otherwise the waiter would burn its spin budget while the queue drains. On a closed
    /// BTB this does nothing (the wait reports the close).
    #[inline]
    pub fn skip_blocking(&self) {
        let _ = self.notifier.notify();
    }

    /// Whether this round's work is finished (Acquire: the results are then visible).
    #[inline]
    pub fn is_done(&self) -> bool {
        self.counter.is_zero()
    }

    /// Waiter: blocks on the notifier until the worker has started (or a skip / stale
    /// notification is pending), then spins on the counter within the [`SpinBudget`], then
    /// sleeps on the counter until the worker's `decrease()`.
    ///
    /// Every time `period` passes without the round finishing, `stop` is called once; if it
    /// returns `true` the wait ends with [`WaitError::Stopped`]. `Duration::MAX` means no
    /// period (`stop` is never called). Periods are measured on `W`'s clock.
    ///
    /// On `Ok`, everything the worker wrote before `decrease()` is visible.
    ///
    /// # Errors
    ///
    /// [`WaitError::Stopped`] as above; [`WaitError::Closed`] if the BTB was closed before
    /// the round finished. After an error the round is abandoned: do not [`reset`](Self::reset).
    pub fn wait_until_done(
        &self,
        period: Duration,
        stop: impl FnMut() -> bool,
    ) -> Result<(), WaitError> {
        self.wait_inner(period, stop, || {})
    }

    /// [`wait_until_done`](Self::wait_until_done) that calls `on_notified` between the
    /// blocking and the spinning phase: lets the loom models check that a round blocked
    /// until its own `notify()`.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn wait_until_done_observed(
        &self,
        period: Duration,
        stop: impl FnMut() -> bool,
        on_notified: impl FnOnce(),
    ) -> Result<(), WaitError> {
        self.wait_inner(period, stop, on_notified)
    }

    fn wait_inner(
        &self,
        period: Duration,
        stop: impl FnMut() -> bool,
        on_notified: impl FnOnce(),
    ) -> Result<(), WaitError> {
        let mut periods = Periods::<W, _>::new(period, stop);

        // Phase 1: sleep until the worker has started (or a notification is pending).
        loop {
            match self.notifier.wait_inner(periods.deadline())? {
                Timed::Notified => break,
                Timed::TimedOut => periods.expired()?,
            }
        }
        on_notified();

        // Phase 2: spin on the counter, bounded by the spin budget. `spin()` rather than
        // `snooze()`: it caps each step at a few dozen spin hints, so the end of the
        // compute is seen quickly and the clock is read often.
        let backoff = crate::sync::Backoff::new();
        let start = W::now();
        let mut stalled: u32 = 0;
        loop {
            if let Some(done) = self.counter.poll() {
                return done.map_err(WaitError::from);
            }
            let now = W::now();
            periods.check_clock(now)?;
            if now == start {
                // No clock (or it has not ticked yet): count steps instead.
                if stalled >= self.spin.iterations {
                    break;
                }
                stalled += 1;
            } else if now.saturating_duration_since(start) >= self.spin.time {
                break;
            }
            backoff.spin();
        }

        // Phase 3: sleep on the counter; the decrease to zero wakes us.
        loop {
            match self.counter.wait_inner(periods.deadline())? {
                Timed::Notified => return Ok(()),
                Timed::TimedOut => periods.expired()?,
            }
        }
    }

    /// Waiter, between rounds: the counter back to 1 **and** the notifier's pending count
    /// cleared, so that a stale notification from a skip round cannot make the next
    /// non-skip round spin through the whole queue.
    ///
    /// Legal only after a [`wait_until_done`](Self::wait_until_done) that returned `Ok`
    /// (then the worker's `notify()` and `decrease()` have both happened and nothing is in
    /// flight). Publish the reset BTB to the next round's worker the way the work itself
    /// is handed over (a queue push), which orders these Relaxed writes before its use.
    ///
    /// # Panics
    ///
    /// In debug builds, if the round is still in flight (the counter is not zero).
    pub fn reset(&self) {
        self.check_reset();
        self.counter.reset(1);
        self.notifier.clear();
    }

    /// `reset` that forgets to clear the notifier (the C++ original's leak): a planted
    /// bug for the loom models.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_reset_keep_notification(&self) {
        self.check_reset();
        self.counter.reset(1);
    }

    #[inline]
    fn check_reset(&self) {
        let count = self.counter.count();
        debug_assert!(
            count == 0,
            "BlockingThenBusy::reset() while the round is in flight (counter is {count}): \
             reset is legal only after wait_until_done returned Ok"
        );
    }

    /// Closes the BTB: a wait in any phase ends with [`WaitError::Closed`] (unless the
    /// round has already finished); later `notify()` calls fail. Idempotent.
    pub fn close(&self) {
        self.notifier.close();
        self.counter.close();
    }

    /// Whether [`close`](Self::close) has been called.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.counter.is_closed()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::notifier::test_util::{StdYield, iters};
    use crate::sync::UnsafeCell;
    use std::format;

    struct Shared<W: Wait> {
        btb: BlockingThenBusy<W>,
        data: UnsafeCell<u32>,
    }
    // SAFETY: `data` is written by the worker before `decrease()` and read by the waiter
    // after `wait_until_done` returned Ok (Release/Acquire), one round at a time.
    unsafe impl<W: Wait> Sync for Shared<W> {}

    fn rounds<W: Wait>(shared: &Shared<W>, skips: impl IntoIterator<Item = bool>) {
        for (round, skip) in (1u32..).zip(skips) {
            std::thread::scope(|s| {
                s.spawn(|| {
                    let _ = shared.btb.notify();
                    // SAFETY: the waiter reads only after our decrease (see `Shared`).
                    shared.data.with_mut(|p| unsafe { *p = round });
                    shared.btb.decrease();
                });
                if skip {
                    shared.btb.skip_blocking();
                }
                shared
                    .btb
                    .wait_until_done(Duration::MAX, || unreachable!())
                    .unwrap();
                // SAFETY: wait_until_done returned Ok: the worker's write happened-before.
                assert_eq!(shared.data.with(|p| unsafe { *p }), round);
            });
            shared.btb.reset();
            assert_eq!(
                shared.btb.notifier().pending(),
                0,
                "reset clears the notifier"
            );
        }
    }

    fn skips(n: usize) -> impl Iterator<Item = bool> {
        (0..n).map(|i| i % 3 == 1)
    }

    #[test]
    fn rounds_default_wait() {
        let shared = Shared {
            btb: BlockingThenBusy::<DefaultWait>::new(),
            data: UnsafeCell::new(0),
        };
        rounds(&shared, skips(iters(60)));
    }

    #[test]
    fn rounds_std_clock_all_budgets() {
        for budget in [
            SpinBudget::DEFAULT,
            SpinBudget::NONE,
            SpinBudget {
                time: Duration::from_secs(1),
                iterations: 0,
            },
        ] {
            let shared = Shared {
                btb: BlockingThenBusy::<StdYield>::with_spin_budget(budget),
                data: UnsafeCell::new(0),
            };
            assert_eq!(shared.btb.spin_budget(), budget);
            rounds(&shared, skips(iters(60)));
        }
    }

    #[test]
    fn stale_notification_is_cleared_by_reset() {
        let btb: BlockingThenBusy<StdYield> = BlockingThenBusy::new();
        // A skip round where the worker's notify comes after the waiter consumed its own.
        btb.skip_blocking();
        std::thread::scope(|s| {
            let w = s.spawn(|| btb.wait_until_done(Duration::MAX, || false));
            while btb.notifier().pending() != 0 {
                std::thread::yield_now();
            }
            btb.notify().unwrap();
            btb.decrease();
            w.join().unwrap().unwrap();
        });
        assert_eq!(btb.notifier().pending(), 1, "the stale notification");
        btb.reset();
        assert_eq!(btb.notifier().pending(), 0);
        assert!(!btb.is_done());
    }

    #[test]
    fn stop_predicate_in_each_phase() {
        // Phase 1: the worker never starts.
        let btb: BlockingThenBusy<StdYield> = BlockingThenBusy::new();
        let mut calls = 0;
        let r = btb.wait_until_done(Duration::from_micros(100), || {
            calls += 1;
            calls == 2
        });
        assert_eq!((r, calls), (Err(WaitError::Stopped), 2));
        // Phases 2 and 3: started, never finishes.
        for budget in [SpinBudget::NONE, SpinBudget::DEFAULT] {
            let btb: BlockingThenBusy<StdYield> = BlockingThenBusy::with_spin_budget(budget);
            btb.notify().unwrap();
            let r = btb.wait_until_done(Duration::from_micros(100), || true);
            assert_eq!(r, Err(WaitError::Stopped));
        }
    }

    #[test]
    fn close_in_each_phase() {
        let btb: BlockingThenBusy = BlockingThenBusy::new();
        btb.close();
        assert_eq!(btb.notify(), Err(Closed));
        assert_eq!(
            btb.wait_until_done(Duration::MAX, || false),
            Err(WaitError::Closed)
        );
        for notify in [false, true] {
            let btb: BlockingThenBusy<StdYield> = BlockingThenBusy::new();
            std::thread::scope(|s| {
                if notify {
                    btb.notify().unwrap();
                }
                let w = s.spawn(|| btb.wait_until_done(Duration::MAX, || false));
                btb.close();
                assert_eq!(w.join().unwrap(), Err(WaitError::Closed));
            });
            assert!(btb.is_closed());
        }
        // A round that finished before the close still reports success.
        let btb: BlockingThenBusy = BlockingThenBusy::new();
        btb.notify().unwrap();
        btb.decrease();
        btb.close();
        assert_eq!(btb.wait_until_done(Duration::MAX, || false), Ok(()));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "reset() while the round is in flight")]
    fn reset_in_flight_panics() {
        let btb: BlockingThenBusy = BlockingThenBusy::new();
        btb.reset();
    }

    #[test]
    fn debug_and_budget() {
        let btb: BlockingThenBusy = BlockingThenBusy::default();
        assert_eq!(btb.spin_budget(), SpinBudget::default());
        let s = format!("{btb:?}");
        assert!(s.contains("State(0)") && s.contains("State(1)"), "{s}");
        assert!(btb.counter().count() == 1 && !btb.is_done());
    }
}
