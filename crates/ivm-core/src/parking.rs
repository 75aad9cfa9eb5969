//! [`Parking`]: how a single consumer (the VM's scheduler) sleeps when it has nothing to do
//! without ever missing new input from its producers.
//!
//! # The protocol
//!
//! * A **producer** first publishes its input (pushes to a queue, marks a completion,
//!   sets a flag), then calls [`Parking::unpark`]: one `swap(RUNNING)` (Release) on the
//!   state word, and a wake call only if the value it replaced was `PARKED`.
//! * The **consumer** calls [`Parking::park`] when it has run out of work: one
//!   `swap(PARKED)` (Acquire) on the same word, then it re-checks **every** input source
//!   (`has_input`), and sleeps only if all are empty, while the word still holds `PARKED`.
//!
//! # Why no wake-up is lost (the store-load argument)
//!
//! This is Dekker's pattern: each side writes one location and then reads another. With a
//! plain store and a plain load on each side, both sides could read the old values (a
//! store-load reordering) — the producer would see "not parked", the consumer "no input",
//! and the consumer would sleep forever. The usual cure is `SeqCst` fences. Here both
//! sides instead perform a **read-modify-write on the same word**, and all RMWs of one
//! location are totally ordered (its modification order), each reading the value the
//! previous one wrote. Take the producer's `unpark` swap *P* and the consumer's park swap
//! *C*:
//!
//! * *C* before *P*: *P* reads `PARKED` (or a later consumer write, see below) and makes
//!   the wake call; the consumer either sees `RUNNING` before it sleeps (the backend's
//!   `wait` returns at once on a changed value) or is woken.
//! * *P* before *C*: *C* reads what *P* wrote — or what a later RMW wrote, which is still
//!   in *P*'s release sequence — and, being Acquire, synchronizes with *P*'s Release. The
//!   producer's input was published before *P*, so it happens-before the consumer's
//!   `has_input()`, which sees it: the consumer does not sleep.
//!
//! Every write to the state word is an RMW (the consumer also clears `PARKED` with a swap,
//! never a store), so release sequences are never broken. No `SeqCst` is needed, and a
//! producer whose consumer is running makes no wake call.
//!
//! [`Parking::close`] is shutdown as one more input: it publishes the closed flag, then
//! unparks.
//!
//! # Examples
//!
//! ```
//! use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
//! use ivm_core::parking::{Park, Parking};
//!
//! let parking: Parking = Parking::new();
//! let input = AtomicBool::new(false);
//! std::thread::scope(|s| {
//!     s.spawn(|| {
//!         input.store(true, Relaxed); // publish ...
//!         parking.unpark(); // ... then unpark (Release)
//!     });
//!     // The consumer: park until the input shows up.
//!     while !input.load(Relaxed) {
//!         match parking.park(|| input.load(Relaxed), None) {
//!             Park::HadInput | Park::Unparked => {}
//!             Park::TimedOut | Park::Closed => unreachable!(),
//!         }
//!     }
//! });
//! ```

use core::fmt;
use core::marker::PhantomData;

use crate::sync::Ordering::{Acquire, Relaxed, Release};
use crate::sync::{AtomicBool, AtomicU32};
use crate::wait::{DefaultWait, Instant, Wait, WaitResult};

const RUNNING: u32 = 0;
const PARKED: u32 = 1;

/// How [`Parking::park`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Park {
    /// A producer unparked the consumer after it had announced the park.
    Unparked,
    /// `has_input` found input after the park was announced: the consumer never slept.
    HadInput,
    /// The deadline passed with no input and no unpark.
    TimedOut,
    /// [`Parking::close`] was called.
    Closed,
}

/// The parking protocol between many producers and one consumer (see the
/// [module documentation](self)).
pub struct Parking<W: Wait = DefaultWait> {
    state: AtomicU32,
    closed: AtomicBool,
    _wait: PhantomData<fn() -> W>,
}

impl<W: Wait> Default for Parking<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W: Wait> fmt::Debug for Parking<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Parking")
            .field("parked", &self.is_parked())
            .field("closed", &self.closed.load(Relaxed))
            .finish()
    }
}

impl<W: Wait> Parking<W> {
    crate::sync::loom_const_fn! {
        /// A parking spot with the consumer running, not closed.
        pub fn new() -> Self {
            Self {
                state: AtomicU32::new(RUNNING),
                closed: AtomicBool::new(false),
                _wait: PhantomData,
            }
        }
    }

    /// Producer, **after** publishing its input: one RMW; wakes the consumer only if that
    /// RMW shows it `PARKED`. Returns whether it did (the consumer had announced a park).
    #[inline]
    pub fn unpark(&self) -> bool {
        // Release: publishes the producer's input to the consumer's Acquire swap/load that
        // reads this write (or a later RMW in its release sequence). See module docs.
        if self.state.swap(RUNNING, Release) == PARKED {
            W::wake_one(&self.state);
            true
        } else {
            false
        }
    }

    /// Consumer (one thread at a time): announces the park with one RMW, re-checks every
    /// input with `has_input` (call it only after the announcement: that order is the whole
    /// protocol), and sleeps only if there is none, until an [`unpark`](Self::unpark),
    /// `deadline` (on `W`'s clock; `None`: no deadline) or [`close`](Self::close).
    /// Handles spurious wake-ups.
    ///
    /// # Panics
    ///
    /// In debug builds, if two threads park at once.
    pub fn park(&self, mut has_input: impl FnMut() -> bool, deadline: Option<Instant>) -> Park {
        // Acquire: synchronizes with every unpark earlier in the word's modification
        // order, so `has_input` sees what those producers published.
        let prev = self.state.swap(PARKED, Acquire);
        debug_assert!(
            prev != PARKED,
            "Parking::park called by two threads at once (Parking has a single consumer)"
        );
        // Acquire: `close` publishes the flag before its unpark, like any input.
        if self.closed.load(Acquire) {
            self.cancel();
            return Park::Closed;
        }
        if has_input() {
            self.cancel();
            return Park::HadInput;
        }
        loop {
            let r = W::wait(&self.state, PARKED, deadline);
            // Acquire: pairs with the unpark that wrote RUNNING (its input is visible).
            if self.state.load(Acquire) == RUNNING {
                return if self.closed.load(Acquire) {
                    Park::Closed
                } else {
                    Park::Unparked
                };
            }
            if r == WaitResult::TimedOut || deadline.is_some_and(|d| W::now() >= d) {
                // Withdraw the announcement; an unpark that raced the timeout wins.
                return if self.cancel() {
                    Park::TimedOut
                } else if self.closed.load(Acquire) {
                    Park::Closed
                } else {
                    Park::Unparked
                };
            }
            // A spurious wake-up: still PARKED, so no producer has published since the
            // check; sleep again.
        }
    }

    /// Withdraws a park announcement; returns whether it was still in place (no producer
    /// unparked meanwhile). An RMW, never a store, so it does not break the release
    /// sequence of an unpark it follows; Acquire so it synchronizes with such an unpark.
    #[inline]
    fn cancel(&self) -> bool {
        self.state.swap(RUNNING, Acquire) == PARKED
    }

    /// Whether the consumer has announced a park (a Relaxed snapshot, for diagnostics).
    #[inline]
    pub fn is_parked(&self) -> bool {
        self.state.load(Relaxed) == PARKED
    }

    /// Shutdown: every current and later [`park`](Self::park) returns [`Park::Closed`].
    /// Idempotent.
    pub fn close(&self) {
        // Release: the flag is an input like any other, published before the unpark.
        self.closed.store(true, Release);
        if self.state.swap(RUNNING, Release) == PARKED {
            W::wake_all(&self.state);
        }
    }

    /// Whether [`close`](Self::close) has been called.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Acquire)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::notifier::test_util::{StdYield, iters};
    use core::time::Duration;
    use std::format;
    use std::sync::atomic::AtomicU32 as StdAtomicU32;

    #[test]
    fn had_input_never_sleeps() {
        let p: Parking = Parking::new();
        assert_eq!(p.park(|| true, None), Park::HadInput);
        assert!(!p.is_parked());
        assert!(!p.unpark(), "nobody parked: no wake call");
    }

    #[test]
    fn times_out_with_a_clock() {
        let p: Parking<StdYield> = Parking::new();
        let deadline = StdYield::now().saturating_add(Duration::from_millis(1));
        assert_eq!(p.park(|| false, Some(deadline)), Park::TimedOut);
        assert!(!p.is_parked());
        // Already passed: times out at once (after the input check).
        let mut checked = false;
        let r = p.park(
            || {
                checked = true;
                false
            },
            Some(Instant::ZERO),
        );
        assert_eq!((r, checked), (Park::TimedOut, true));
    }

    #[test]
    fn close_ends_parks() {
        let p: Parking<StdYield> = Parking::new();
        std::thread::scope(|s| {
            let c = s.spawn(|| p.park(|| false, None));
            p.close();
            assert_eq!(c.join().unwrap(), Park::Closed);
        });
        assert!(p.is_closed());
        assert_eq!(p.park(|| true, None), Park::Closed);
        assert_eq!(format!("{p:?}"), "Parking { parked: false, closed: true }");
    }

    #[test]
    fn producers_never_lose_input() {
        // Two producers publish increments; the consumer parks whenever it has seen all
        // published input so far and must still see every one of them.
        let n = iters(500) as u32;
        let p: Parking<StdYield> = Parking::new();
        let published = StdAtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..n {
                        published.fetch_add(1, Relaxed);
                        p.unpark();
                    }
                });
            }
            let mut seen = 0;
            while seen < 2 * n {
                let now = published.load(Relaxed);
                if now > seen {
                    seen = now;
                    continue;
                }
                let r = p.park(|| published.load(Relaxed) > seen, None);
                assert_ne!(r, Park::TimedOut);
            }
        });
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "single consumer")]
    fn two_consumers_panic() {
        let p: Parking = Parking::new();
        p.state.store(PARKED, Relaxed);
        p.park(|| true, None);
    }
}
