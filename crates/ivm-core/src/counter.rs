//! Counters a thread waits on until they reach zero: [`SpinCounter`] (the waiter spins) and
//! [`BlockingCounter`] (the waiter sleeps through a wait backend).
//!
//! Both give the same guarantee: [`decrease`](BlockingCounter::decrease) is a Release
//! operation and the waiter reads zero with Acquire, so everything a worker wrote before
//! its `decrease()` is visible to the waiter once the wait returns.

use core::fmt;
use core::marker::PhantomData;
use core::time::Duration;

use crate::notifier::{Closed, Timed};
use crate::sync::AtomicU32;
use crate::sync::Ordering::{self, Acquire, Relaxed, Release};
use crate::wait::{DefaultWait, Instant, Wait, WaitResult};

/// Why a wait with a stop predicate ended without its condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitError {
    /// The stop predicate, called at the end of a period, returned `true`.
    Stopped,
    /// The counter (or notifier) was closed before the condition held.
    Closed,
}

impl fmt::Display for WaitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WaitError::Stopped => "wait stopped by its stop predicate",
            WaitError::Closed => "closed",
        })
    }
}

impl core::error::Error for WaitError {}

impl From<Closed> for WaitError {
    fn from(_: Closed) -> Self {
        WaitError::Closed
    }
}

/// The period clock of a wait with a stop predicate: `stop` is called once each time a
/// period passes without the condition, and ends the wait if it returns `true`.
pub(crate) struct Periods<W, F> {
    period: Duration,
    deadline: Option<Instant>,
    stop: F,
    _wait: PhantomData<fn() -> W>,
}

impl<W: Wait, F: FnMut() -> bool> Periods<W, F> {
    pub(crate) fn new(period: Duration, stop: F) -> Self {
        Self {
            period,
            deadline: Self::deadline_after(period),
            stop,
            _wait: PhantomData,
        }
    }

    /// `now + period`, or no deadline if that reaches the end of the clock (so
    /// `Duration::MAX` means "no period": `stop` is never called).
    fn deadline_after(period: Duration) -> Option<Instant> {
        let d = W::now().saturating_add(period);
        (d.as_nanos() != u64::MAX).then_some(d)
    }

    /// The deadline of the current period.
    #[inline]
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The current period has passed: ask `stop`, then start the next period.
    pub(crate) fn expired(&mut self) -> Result<(), WaitError> {
        if (self.stop)() {
            return Err(WaitError::Stopped);
        }
        self.deadline = Self::deadline_after(self.period);
        Ok(())
    }

    /// [`expired`](Self::expired) if `now` (read from `W`'s clock) shows the current
    /// period has passed.
    #[inline]
    pub(crate) fn check_clock(&mut self, now: Instant) -> Result<(), WaitError> {
        match self.deadline {
            Some(d) if now >= d => self.expired(),
            _ => Ok(()),
        }
    }
}

const UNDERFLOW: &str = "counter underflow: decrease() called on a counter that is already zero (more decreases than increases)";
const OVERFLOW: &str = "counter overflow: increase() past the counter's maximum";

/// An atomic count; the waiter spins until it reads zero.
///
/// [`decrease`](Self::decrease) is Release and [`is_zero`](Self::is_zero) /
/// [`wait_until_zero`](Self::wait_until_zero) read with Acquire: what a thread wrote before
/// its `decrease()` is visible to the thread that then sees zero.
///
/// # Examples
///
/// ```
/// use ivm_core::counter::SpinCounter;
///
/// let c = SpinCounter::new(2);
/// std::thread::scope(|s| {
///     s.spawn(|| c.decrease());
///     s.spawn(|| c.decrease());
///     c.wait_until_zero();
/// });
/// assert!(c.is_zero());
/// ```
#[derive(Debug)]
pub struct SpinCounter {
    count: AtomicU32,
}

impl SpinCounter {
    crate::sync::loom_const_fn! {
        /// A counter at `n`.
        pub fn new(n: u32) -> Self {
            Self { count: AtomicU32::new(n) }
        }
    }

    /// Adds one. Relaxed: handing the counter to the thread that will decrease it is what
    /// publishes the new count (a queue push, a thread spawn).
    ///
    /// # Panics
    ///
    /// In debug builds, if the count would overflow `u32` (release builds saturate).
    #[inline]
    pub fn increase(&self) {
        let r = self
            .count
            .fetch_update(Relaxed, Relaxed, |c| c.checked_add(1));
        debug_assert!(r.is_ok(), "SpinCounter: {OVERFLOW}");
    }

    /// Subtracts one, with Release: publishes everything this thread wrote before to the
    /// thread that reads zero.
    ///
    /// # Panics
    ///
    /// In debug builds, if the count is already zero (release builds leave it at zero).
    #[inline]
    pub fn decrease(&self) {
        let r = self
            .count
            .fetch_update(Release, Relaxed, |c| c.checked_sub(1));
        debug_assert!(r.is_ok(), "SpinCounter: {UNDERFLOW}");
    }

    /// Whether the count is zero. Acquire: pairs with [`decrease`](Self::decrease).
    #[inline]
    pub fn is_zero(&self) -> bool {
        self.count.load(Acquire) == 0
    }

    /// The count, a Relaxed snapshot for diagnostics.
    #[inline]
    pub fn count(&self) -> u32 {
        self.count.load(Relaxed)
    }

    /// Spins (with exponential backoff) until the count is zero.
    pub fn wait_until_zero(&self) {
        let backoff = crate::sync::Backoff::new();
        while !self.is_zero() {
            backoff.snooze();
        }
    }
}

/// The state word of a [`BlockingCounter`]: bits 0..30 the count, bit 30 `WAITERS` (a
/// waiter may be asleep: the decrease to zero must wake), bit 31 `CLOSED`.
#[derive(Clone, Copy, PartialEq, Eq)]
struct CState(u32);

impl CState {
    const COUNT_MAX: u32 = (1 << 30) - 1;
    const WAITERS: u32 = 1 << 30;
    const CLOSED: u32 = 1 << 31;

    #[inline]
    fn count(self) -> u32 {
        self.0 & Self::COUNT_MAX
    }

    #[inline]
    fn has_waiters(self) -> bool {
        self.0 & Self::WAITERS != 0
    }

    #[inline]
    fn is_closed(self) -> bool {
        self.0 & Self::CLOSED != 0
    }
}

impl fmt::Debug for CState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "State({}", self.count())?;
        if self.has_waiters() {
            f.write_str(" | WAITERS")?;
        }
        if self.is_closed() {
            f.write_str(" | CLOSED")?;
        }
        f.write_str(")")
    }
}

/// An atomic count; the waiter sleeps (wait backend `W`) until it reaches zero.
///
/// Same contract as [`SpinCounter`]; in addition the count and a `WAITERS` bit share one
/// word, so the `decrease()` that reaches zero clears `WAITERS` and wakes **only if the
/// value its RMW replaced had `WAITERS` set**: a counter nobody sleeps on costs no wake
/// call. A waiter sets `WAITERS` with a compare-exchange from the nonzero value it saw
/// before sleeping on that value; both RMWs hit one location, so either the decrease sees
/// `WAITERS`, or the waiter's compare-exchange fails and it re-reads the count.
///
/// [`close`](Self::close) ends every wait on a nonzero count with [`WaitError::Closed`].
///
/// The count is limited to 2<sup>30</sup> − 1.
///
/// # Examples
///
/// ```
/// use core::time::Duration;
/// use ivm_core::counter::BlockingCounter;
///
/// let c: BlockingCounter = BlockingCounter::new(1);
/// std::thread::scope(|s| {
///     s.spawn(|| c.decrease());
///     // No period (Duration::MAX): the stop predicate is never called.
///     c.wait_until_zero(Duration::MAX, || false).unwrap();
/// });
/// ```
pub struct BlockingCounter<W: Wait = DefaultWait> {
    state: AtomicU32,
    _wait: PhantomData<fn() -> W>,
}

impl<W: Wait> fmt::Debug for BlockingCounter<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingCounter")
            .field("state", &CState(self.state.load(Relaxed)))
            .finish()
    }
}

impl<W: Wait> BlockingCounter<W> {
    crate::sync::loom_const_fn! {
        /// A counter at `n`.
        ///
        /// # Panics
        ///
        /// If `n` exceeds 2<sup>30</sup> − 1.
        pub fn new(n: u32) -> Self {
            assert!(n <= CState::COUNT_MAX, "BlockingCounter::new: count exceeds 2^30 - 1");
            Self {
                state: AtomicU32::new(n),
                _wait: PhantomData,
            }
        }
    }

    /// Adds one. Relaxed: handing the counter to the thread that will decrease it is what
    /// publishes the new count.
    ///
    /// # Panics
    ///
    /// In debug builds, if the count would pass 2<sup>30</sup> − 1 (release builds saturate).
    #[inline]
    pub fn increase(&self) {
        let r = self.state.fetch_update(Relaxed, Relaxed, |s| {
            (CState(s).count() < CState::COUNT_MAX).then_some(s + 1)
        });
        debug_assert!(r.is_ok(), "BlockingCounter: {OVERFLOW}");
    }

    /// Subtracts one, with Release (publishes what this thread wrote before to the waiter
    /// that reads zero); the decrease to zero wakes the waiters, if any announced a sleep.
    ///
    /// # Panics
    ///
    /// In debug builds, if the count is already zero (release builds leave it at zero).
    #[inline]
    pub fn decrease(&self) {
        self.decrease_with(Release);
    }

    /// `decrease` with Relaxed instead of Release: a planted missing publication for the
    /// loom models (loom reports the waiter's read of the data as a causality violation).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_decrease_relaxed(&self) {
        self.decrease_with(Relaxed);
    }

    #[inline]
    fn decrease_with(&self, order: Ordering) {
        let mut cur = CState(self.state.load(Relaxed));
        loop {
            debug_assert!(cur.count() != 0, "BlockingCounter: {UNDERFLOW}");
            if cur.count() == 0 {
                return;
            }
            // Reaching zero clears WAITERS: the wake below covers every announced sleeper,
            // and a later waiter sees zero before it would announce anything.
            let new = if cur.count() == 1 {
                CState(cur.0 & CState::CLOSED)
            } else {
                CState(cur.0 - 1)
            };
            match self
                .state
                .compare_exchange_weak(cur.0, new.0, order, Relaxed)
            {
                Ok(_) => {
                    if new.count() == 0 && cur.has_waiters() {
                        W::wake_all(&self.state);
                    }
                    return;
                }
                Err(actual) => cur = CState(actual),
            }
        }
    }

    /// Whether the count is zero. Acquire: pairs with [`decrease`](Self::decrease).
    #[inline]
    pub fn is_zero(&self) -> bool {
        CState(self.state.load(Acquire)).count() == 0
    }

    /// One Acquire look: `Some(Ok)` if zero, `Some(Err)` if closed while nonzero, `None`
    /// if the wait goes on.
    #[inline]
    pub(crate) fn poll(&self) -> Option<Result<(), Closed>> {
        // Acquire: pairs with `decrease` (and `close`) as in `wait_inner`.
        let s = CState(self.state.load(Acquire));
        if s.count() == 0 {
            Some(Ok(()))
        } else if s.is_closed() {
            Some(Err(Closed))
        } else {
            None
        }
    }

    /// The count, a Relaxed snapshot for diagnostics.
    #[inline]
    pub fn count(&self) -> u32 {
        CState(self.state.load(Relaxed)).count()
    }

    /// Sleeps until the count is zero.
    ///
    /// Every time `period` passes without that, `stop` is called once; if it returns
    /// `true` the wait ends with [`WaitError::Stopped`] (the VM uses this to fail with a
    /// diagnostic instead of hanging). A period that reaches past the end of the clock
    /// (`Duration::MAX`) means no period: `stop` is never called. Periods are measured on
    /// `W`'s clock ([`Wait::now`]); with a clock that does not advance they never end.
    ///
    /// # Errors
    ///
    /// [`WaitError::Stopped`] as above; [`WaitError::Closed`] if the counter was closed
    /// while nonzero.
    pub fn wait_until_zero(
        &self,
        period: Duration,
        stop: impl FnMut() -> bool,
    ) -> Result<(), WaitError> {
        let mut periods = Periods::<W, _>::new(period, stop);
        loop {
            match self.wait_inner(periods.deadline())? {
                Timed::Notified => return Ok(()),
                Timed::TimedOut => periods.expired()?,
            }
        }
    }

    /// Sleeps until the count is zero or `deadline` has passed.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the counter was closed while nonzero.
    pub fn timed_wait_until_zero(&self, deadline: Instant) -> Result<Timed, Closed> {
        self.wait_inner(Some(deadline))
    }

    pub(crate) fn wait_inner(&self, deadline: Option<Instant>) -> Result<Timed, Closed> {
        let mut timed_out = false;
        loop {
            // Acquire: pairs with the Release of the decrease that reached zero (and, as
            // all decreases are RMWs of one release sequence, with every earlier one).
            let mut s = CState(self.state.load(Acquire));
            if s.count() == 0 {
                return Ok(Timed::Notified);
            }
            if s.is_closed() {
                return Err(Closed);
            }
            if timed_out || deadline.is_some_and(|d| W::now() >= d) {
                return Ok(Timed::TimedOut);
            }
            if !s.has_waiters() {
                let announced = CState(s.0 | CState::WAITERS);
                // From the exact nonzero value seen: fails (and we re-read) if a decrease
                // or close slipped in. See the type's docs for why no wake is lost.
                if self
                    .state
                    .compare_exchange_weak(s.0, announced.0, Relaxed, Relaxed)
                    .is_err()
                {
                    continue;
                }
                s = announced;
            }
            if W::wait(&self.state, s.0, deadline) == WaitResult::TimedOut {
                timed_out = true;
            }
        }
    }

    /// Closes the counter: every wait on a nonzero count ends with [`WaitError::Closed`]
    /// (a count already at zero still reports success). Idempotent; decreases still work.
    pub fn close(&self) {
        // Release: a waiter that sees CLOSED (Acquire) sees what was written before.
        let prev = CState(self.state.fetch_or(CState::CLOSED, Release));
        if prev.has_waiters() {
            W::wake_all(&self.state);
        }
    }

    /// Whether [`close`](Self::close) has been called.
    #[inline]
    pub fn is_closed(&self) -> bool {
        CState(self.state.load(Acquire)).is_closed()
    }

    /// Sets the count back to `n` (keeps `CLOSED`; nobody may wait or decrease meanwhile).
    /// Relaxed: the hand-over of the next round publishes it.
    pub(crate) fn reset(&self, n: u32) {
        debug_assert!(n <= CState::COUNT_MAX);
        let _ = self
            .state
            .fetch_update(Relaxed, Relaxed, |s| Some((s & CState::CLOSED) | n));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::notifier::test_util::{StdYield, iters};
    use std::format;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn spin_counter_counts() {
        let c = SpinCounter::new(1);
        c.increase();
        assert_eq!(c.count(), 2);
        c.decrease();
        assert!(!c.is_zero());
        c.decrease();
        assert!(c.is_zero());
        c.wait_until_zero();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "counter underflow")]
    fn spin_counter_underflow_panics() {
        let c = SpinCounter::new(0);
        c.decrease();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "counter underflow")]
    fn blocking_counter_underflow_panics() {
        let c: BlockingCounter = BlockingCounter::new(1);
        c.decrease();
        c.decrease();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "counter overflow")]
    fn blocking_counter_overflow_panics() {
        let c: BlockingCounter = BlockingCounter::new(CState::COUNT_MAX);
        c.increase();
    }

    #[test]
    #[should_panic(expected = "count exceeds")]
    fn blocking_counter_new_rejects_flag_bits() {
        let _c: BlockingCounter = BlockingCounter::new(CState::WAITERS);
    }

    #[test]
    fn spin_counter_publishes() {
        for _ in 0..iters(100) {
            let c = SpinCounter::new(2);
            let a = AtomicBool::new(false);
            let b = AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    a.store(true, Relaxed);
                    c.decrease();
                });
                s.spawn(|| {
                    b.store(true, Relaxed);
                    c.decrease();
                });
                c.wait_until_zero();
                assert!(a.load(Relaxed) && b.load(Relaxed));
            });
        }
    }

    #[test]
    fn blocking_counter_waits() {
        for _ in 0..iters(100) {
            let c: BlockingCounter<StdYield> = BlockingCounter::new(3);
            std::thread::scope(|s| {
                for _ in 0..3 {
                    s.spawn(|| c.decrease());
                }
                c.wait_until_zero(Duration::MAX, || unreachable!()).unwrap();
            });
            assert!(c.is_zero());
            assert_eq!(format!("{c:?}"), "BlockingCounter { state: State(0) }");
        }
    }

    #[test]
    fn blocking_counter_stop_predicate_once_per_period() {
        let c: BlockingCounter<StdYield> = BlockingCounter::new(1);
        let mut calls = 0;
        let r = c.wait_until_zero(Duration::from_micros(200), || {
            calls += 1;
            calls == 3
        });
        assert_eq!(r, Err(WaitError::Stopped));
        assert_eq!(calls, 3);
        assert_eq!(
            c.timed_wait_until_zero(StdYield::now()),
            Ok(Timed::TimedOut)
        );
    }

    #[test]
    fn blocking_counter_close() {
        let c: BlockingCounter<StdYield> = BlockingCounter::new(1);
        std::thread::scope(|s| {
            let w = s.spawn(|| c.wait_until_zero(Duration::MAX, || false));
            c.close();
            assert_eq!(w.join().unwrap(), Err(WaitError::Closed));
        });
        assert!(c.is_closed());
        // The waiter may or may not have announced itself (WAITERS) before the close.
        let debug = format!("{c:?}");
        assert!(
            debug == "BlockingCounter { state: State(1 | CLOSED) }"
                || debug == "BlockingCounter { state: State(1 | WAITERS | CLOSED) }",
            "{debug}"
        );
        // A decrease still works, and zero beats closed.
        c.decrease();
        assert_eq!(c.wait_until_zero(Duration::MAX, || false), Ok(()));
        c.reset(2);
        assert!(c.is_closed() && c.count() == 2);
    }

    #[test]
    fn state_debug_names_bits() {
        assert_eq!(
            format!("{:?}", CState(2 | CState::WAITERS | CState::CLOSED)),
            "State(2 | WAITERS | CLOSED)"
        );
    }

    #[test]
    fn decrease_to_zero_clears_waiters() {
        let c: BlockingCounter = BlockingCounter::new(2);
        c.state.fetch_or(CState::WAITERS, Relaxed);
        c.decrease();
        assert!(CState(c.state.load(Relaxed)).has_waiters());
        c.decrease();
        assert_eq!(CState(c.state.load(Relaxed)), CState(0));
    }

    #[test]
    fn wait_error_display() {
        assert_eq!(
            format!("{}", WaitError::Stopped),
            "wait stopped by its stop predicate"
        );
        assert_eq!(WaitError::from(Closed), WaitError::Closed);
    }
}
