//! [`Notifier`]: a count of notifications plus a closed flag, in one `AtomicU32`.
//!
//! A notifier lets one side say "something happened" ([`Notifier::notify`]) and another
//! side sleep until it did ([`Notifier::wait_and_clear`]). Notifications are counted, not
//! queued: a wait consumes every pending notification at once.
//!
//! # The protocol
//!
//! The whole state lives in one word (count, a `SLEEPING` bit, a `CLOSED` bit), so that
//! each side decides from the value **one read-modify-write** returns — the pattern of
//! *Rust Atomics and Locks*, ch. 9, and of crossbeam's zero-capacity channel:
//!
//! * a waiter that finds no notification sets `SLEEPING` with a compare-exchange from
//!   the exact value it saw, and only then sleeps while the word still holds that value;
//! * `notify` increments the count **and clears `SLEEPING`** in one RMW and calls the wait
//!   backend's wake only if the value that RMW replaced had `SLEEPING` set.
//!
//! Both RMWs act on the same location, so they are totally ordered (modification order):
//! either the waiter's compare-exchange comes first and `notify` sees `SLEEPING` (and
//! wakes; the backend does not lose a wake that races with a sleep, and the word no longer
//! holds the value the waiter sleeps on), or `notify` comes first and the waiter's
//! compare-exchange fails, so it re-reads and finds the count. No `SeqCst` is needed, and
//! a notify with no sleeper makes no wake call (no syscall on the fast path).

use core::fmt;
use core::marker::PhantomData;

use crate::sync::AtomicU32;
use crate::sync::Ordering::{Acquire, Relaxed, Release};
use crate::wait::{DefaultWait, Instant, Wait, WaitResult};

/// The error of an operation on a closed [`Notifier`] (or a closed counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Closed;

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("closed")
    }
}

impl core::error::Error for Closed {}

/// How a timed wait ended (when it did not end with [`Closed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timed {
    /// The condition was met (a notification was consumed, or the count reached zero).
    Notified,
    /// The deadline passed first.
    TimedOut,
}

/// The state word of a [`Notifier`].
///
/// Bits 0..30: the number of pending notifications (saturating at [`State::COUNT_MAX`]);
/// bit 30: `SLEEPING` (a waiter may be asleep, `notify` must wake); bit 31: `CLOSED`.
#[derive(Clone, Copy, PartialEq, Eq)]
struct State(u32);

impl State {
    const COUNT_MAX: u32 = (1 << 30) - 1;
    const SLEEPING: u32 = 1 << 30;
    const CLOSED: u32 = 1 << 31;

    #[inline]
    fn count(self) -> u32 {
        self.0 & Self::COUNT_MAX
    }

    #[inline]
    fn is_sleeping(self) -> bool {
        self.0 & Self::SLEEPING != 0
    }

    #[inline]
    fn is_closed(self) -> bool {
        self.0 & Self::CLOSED != 0
    }

    /// One more notification (saturating: the count never spills into the flag bits),
    /// and nobody asleep any more (the notifier wakes all sleepers).
    #[inline]
    fn notified(self) -> Self {
        let count = if self.count() < Self::COUNT_MAX {
            self.count() + 1
        } else {
            self.count()
        };
        State((self.0 & Self::CLOSED) | count)
    }

    /// The count consumed (flags kept).
    #[inline]
    fn cleared(self) -> Self {
        State(self.0 & !Self::COUNT_MAX)
    }
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "State({}", self.count())?;
        if self.is_sleeping() {
            f.write_str(" | SLEEPING")?;
        }
        if self.is_closed() {
            f.write_str(" | CLOSED")?;
        }
        f.write_str(")")
    }
}

/// A count of notifications plus a closed flag; waiters sleep through the wait backend `W`.
///
/// * [`notify`](Self::notify) adds one notification and wakes sleepers, making **no wake
///   call when nobody sleeps**;
/// * [`wait_and_clear`](Self::wait_and_clear) blocks until a notification is pending (or
///   the notifier is closed) and consumes every pending notification;
/// * [`close`](Self::close) wakes everybody; later notifies fail with [`Closed`] and waits
///   with nothing pending return [`Closed`].
///
/// A notification publishes: everything the notifying thread wrote before `notify` is
/// visible to the thread whose wait consumes that notification.
///
/// Several threads may wait at once; a notify wakes them all and one of them consumes the
/// count, the others sleep again.
///
/// # Examples
///
/// ```
/// use ivm_core::notifier::Notifier;
///
/// let n: Notifier = Notifier::new();
/// std::thread::scope(|s| {
///     s.spawn(|| n.notify().unwrap());
///     n.wait_and_clear().unwrap();
/// });
/// n.close();
/// assert!(n.notify().is_err());
/// assert!(n.wait_and_clear().is_err());
/// ```
pub struct Notifier<W: Wait = DefaultWait> {
    state: AtomicU32,
    _wait: PhantomData<fn() -> W>,
}

impl<W: Wait> Default for Notifier<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W: Wait> fmt::Debug for Notifier<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifier")
            .field("state", &State(self.state.load(Relaxed)))
            .finish()
    }
}

impl<W: Wait> Notifier<W> {
    crate::sync::loom_const_fn! {
        /// A notifier with nothing pending, not closed.
        pub fn new() -> Self {
            Self {
                state: AtomicU32::new(0),
                _wait: PhantomData,
            }
        }
    }

    /// Adds one notification (the count saturates instead of overflowing) and wakes the
    /// sleepers, if any. Makes no wake call when no thread sleeps.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the notifier has been closed (nothing is recorded then).
    #[inline]
    pub fn notify(&self) -> Result<(), Closed> {
        self.notify_inner(true)
    }

    /// `notify` with the wake call left out: a planted lost wake-up for the loom models
    /// (a sleeping waiter is never woken, which loom reports as a deadlock).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_notify_without_wake(&self) -> Result<(), Closed> {
        self.notify_inner(false)
    }

    #[inline]
    fn notify_inner(&self, wake: bool) -> Result<(), Closed> {
        // Release: publishes what this thread wrote before `notify` to the waiter whose
        // clearing compare-exchange (Acquire, in `wait_inner`) consumes this count.
        // One successful RMW: the value it replaced decides whether to wake.
        let prev = self
            .state
            .fetch_update(Release, Relaxed, |s| {
                let s = State(s);
                if s.is_closed() {
                    None
                } else {
                    Some(s.notified().0)
                }
            })
            .map_err(|_| Closed)?;
        if wake && State(prev).is_sleeping() {
            W::wake_all(&self.state);
        }
        Ok(())
    }

    /// Blocks until a notification is pending or the notifier is closed; consumes every
    /// pending notification. Handles spurious wake-ups.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the notifier was closed with nothing pending (a pending notification
    /// is still delivered after `close`).
    pub fn wait_and_clear(&self) -> Result<(), Closed> {
        match self.wait_inner(None)? {
            Timed::Notified => Ok(()),
            // Without a deadline the wait never times out.
            Timed::TimedOut => unreachable!("untimed wait timed out"),
        }
    }

    /// Like [`wait_and_clear`](Self::wait_and_clear), but gives up when `deadline` (on the
    /// wait backend's clock, [`Wait::now`]) has passed.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the notifier was closed with nothing pending.
    pub fn timed_wait_and_clear(&self, deadline: Instant) -> Result<Timed, Closed> {
        self.wait_inner(Some(deadline))
    }

    pub(crate) fn wait_inner(&self, deadline: Option<Instant>) -> Result<Timed, Closed> {
        let mut timed_out = false;
        // Acquire: a `Closed` answer then also shows what the closer wrote before `close`.
        let mut s = State(self.state.load(Acquire));
        loop {
            if s.count() > 0 {
                // Acquire: pairs with the Release of every `notify` whose count we
                // consume (they form one release sequence of RMWs on `state`).
                match self
                    .state
                    .compare_exchange_weak(s.0, s.cleared().0, Acquire, Acquire)
                {
                    Ok(_) => return Ok(Timed::Notified),
                    Err(actual) => {
                        s = State(actual);
                        continue;
                    }
                }
            }
            if s.is_closed() {
                return Err(Closed);
            }
            if timed_out || deadline.is_some_and(|d| W::now() >= d) {
                return Ok(Timed::TimedOut);
            }
            if !s.is_sleeping() {
                // Announce the sleep with an RMW from the exact value seen: if a notify
                // or close slipped in since, this fails and we re-read (see module docs).
                let sleeping = State(s.0 | State::SLEEPING);
                match self
                    .state
                    .compare_exchange_weak(s.0, sleeping.0, Relaxed, Acquire)
                {
                    Ok(_) => s = sleeping,
                    Err(actual) => {
                        s = State(actual);
                        continue;
                    }
                }
            }
            if W::wait(&self.state, s.0, deadline) == WaitResult::TimedOut {
                // Look once more (a notify may have raced the timeout), then give up.
                timed_out = true;
            }
            s = State(self.state.load(Acquire));
        }
    }

    /// Closes the notifier and wakes every sleeper. Idempotent.
    ///
    /// Pending notifications stay deliverable; later [`notify`](Self::notify) calls fail.
    pub fn close(&self) {
        // Release: a waiter that sees `CLOSED` (Acquire) also sees what was written before
        // `close`. The returned value shows whether anybody announced a sleep.
        let prev = State(self.state.fetch_or(State::CLOSED, Release));
        if prev.is_sleeping() {
            W::wake_all(&self.state);
        }
    }

    /// Whether [`close`](Self::close) has been called.
    #[inline]
    pub fn is_closed(&self) -> bool {
        // Acquire: pairs with `close`'s Release.
        State(self.state.load(Acquire)).is_closed()
    }

    /// Drops every pending notification (flags kept).
    ///
    /// Used by [`BlockingThenBusy::reset`](crate::btb::BlockingThenBusy::reset) to remove
    /// a stale notification between rounds. Relaxed: it publishes nothing; whoever hands
    /// the notifier to the next round publishes the clear along with everything else.
    #[inline]
    pub fn clear(&self) {
        self.state.fetch_and(!State::COUNT_MAX, Relaxed);
    }

    /// The number of pending notifications (saturated), a Relaxed snapshot for
    /// diagnostics, tests and hints (whether a wake is already on its way).
    #[inline]
    pub fn pending(&self) -> u32 {
        State(self.state.load(Relaxed)).count()
    }
}

/// Std-based helpers for the unit tests of the sync modules.
#[cfg(all(test, not(loom)))]
pub(crate) mod test_util {
    use crate::sync::{AtomicU32, Ordering};
    use crate::wait::{Instant, Wait, WaitResult};

    /// A wait backend on std: sleeping is a `yield_now` loop, the clock is
    /// `std::time::Instant` (so deadlines and spin budgets work), wakes are no-ops.
    pub(crate) struct StdYield;

    fn origin() -> std::time::Instant {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        *ORIGIN.get_or_init(std::time::Instant::now)
    }

    impl Wait for StdYield {
        fn now() -> Instant {
            let nanos = origin().elapsed().as_nanos();
            Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }

        fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
            while atom.load(Ordering::Relaxed) == expected {
                if deadline.is_some_and(|d| Self::now() >= d) {
                    return WaitResult::TimedOut;
                }
                std::thread::yield_now();
            }
            WaitResult::Woken
        }

        fn wake_one(_atom: &AtomicU32) {}

        fn wake_all(_atom: &AtomicU32) {}
    }

    /// Iterations for stress loops: small under miri.
    pub(crate) const fn iters(normal: usize) -> usize {
        if cfg!(miri) { 3 } else { normal }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::test_util::{StdYield, iters};
    use super::*;
    use core::time::Duration;
    use std::format;

    #[test]
    fn state_debug_names_bits() {
        let s = State(3 | State::SLEEPING | State::CLOSED);
        assert_eq!(format!("{s:?}"), "State(3 | SLEEPING | CLOSED)");
        assert_eq!(format!("{:?}", State(0)), "State(0)");
    }

    #[test]
    fn count_saturates_without_touching_flags() {
        let s = State(State::COUNT_MAX | State::SLEEPING);
        let n = s.notified();
        assert_eq!(n.count(), State::COUNT_MAX);
        assert!(!n.is_sleeping() && !n.is_closed());
        let n: Notifier = Notifier::new();
        n.state.store(State::COUNT_MAX, Relaxed);
        n.notify().unwrap();
        assert_eq!(n.pending(), State::COUNT_MAX);
        assert!(!n.is_closed());
    }

    #[test]
    fn notify_then_wait_consumes_all() {
        let n: Notifier = Notifier::new();
        n.notify().unwrap();
        n.notify().unwrap();
        assert_eq!(n.pending(), 2);
        n.wait_and_clear().unwrap();
        assert_eq!(n.pending(), 0);
        assert_eq!(
            n.timed_wait_and_clear(Instant::ZERO),
            Ok(Timed::TimedOut),
            "nothing pending after the clear"
        );
    }

    #[test]
    fn clear_drops_pending() {
        let n: Notifier = Notifier::new();
        n.notify().unwrap();
        n.clear();
        assert_eq!(n.pending(), 0);
        assert_eq!(n.timed_wait_and_clear(Instant::ZERO), Ok(Timed::TimedOut));
    }

    #[test]
    fn close_semantics() {
        let n: Notifier = Notifier::new();
        n.notify().unwrap();
        n.close();
        n.close();
        assert!(n.is_closed());
        assert_eq!(n.notify(), Err(Closed));
        // A notification pending at close is still delivered ...
        assert_eq!(n.wait_and_clear(), Ok(()));
        // ... then the wait reports the close.
        assert_eq!(n.wait_and_clear(), Err(Closed));
        assert_eq!(n.timed_wait_and_clear(Instant::ZERO), Err(Closed));
    }

    #[test]
    fn timed_wait_times_out_with_a_clock() {
        let n: Notifier<StdYield> = Notifier::new();
        let deadline = StdYield::now().saturating_add(Duration::from_millis(2));
        assert_eq!(n.timed_wait_and_clear(deadline), Ok(Timed::TimedOut));
        assert!(StdYield::now() >= deadline);
    }

    #[test]
    fn notify_wakes_a_sleeper() {
        for _ in 0..iters(200) {
            let n: Notifier<StdYield> = Notifier::new();
            std::thread::scope(|s| {
                s.spawn(|| n.notify().unwrap());
                n.wait_and_clear().unwrap();
            });
        }
    }

    #[test]
    fn close_wakes_sleepers() {
        let n: Notifier<StdYield> = Notifier::new();
        std::thread::scope(|s| {
            let a = s.spawn(|| n.wait_and_clear());
            let b = s.spawn(|| n.wait_and_clear());
            n.close();
            assert_eq!(a.join().unwrap(), Err(Closed));
            assert_eq!(b.join().unwrap(), Err(Closed));
        });
    }

    #[test]
    fn notification_publishes_data() {
        let n: Notifier<StdYield> = Notifier::new();
        let data = crate::sync::UnsafeCell::new(0u32);
        struct Shared<'a>(&'a crate::sync::UnsafeCell<u32>);
        // SAFETY: the two threads below access the cell one after the other, ordered by
        // the notification (that is what the test checks, with miri's race detector).
        unsafe impl Sync for Shared<'_> {}
        let shared = Shared(&data);
        for round in 1..=iters(100) as u32 {
            std::thread::scope(|s| {
                let (shared, n) = (&shared, &n);
                s.spawn(move || {
                    // SAFETY: the waiter reads only after consuming the notify below.
                    shared.0.with_mut(|p| unsafe { *p = round });
                    n.notify().unwrap();
                });
                n.wait_and_clear().unwrap();
                // SAFETY: the notify (Release) follows the write; our clear is Acquire.
                assert_eq!(shared.0.with(|p| unsafe { *p }), round);
            });
        }
    }

    #[test]
    fn debug_shows_state() {
        let n: Notifier = Notifier::new();
        n.notify().unwrap();
        assert_eq!(format!("{n:?}"), "Notifier { state: State(1) }");
    }
}
