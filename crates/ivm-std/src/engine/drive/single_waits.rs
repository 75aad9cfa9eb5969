//! Where the callers of a single-thread VM sleep: an event count over one word.

use ivm_core::sync::{AtomicU32, Ordering};
use ivm_core::wait::{Instant, Wait};

use crate::util::futex::FutexWait;

/// Single-thread mode: where callers wait for the engine, for device or lazy-job
/// completions, for instructions pushed by other threads and for each other's progress —
/// without holding the engine while they sleep (a graph kernel on another thread may
/// need to drive it meanwhile).
///
/// An event count: one word, a counter (bits 2..) bumped by every announcement
/// ([`notify`](Self::notify)), a `SLEEPING` bit set by callers about to sleep and a
/// `WANTED` bit set by callers that found the engine held. A waiter reads the count
/// ([`snapshot`](Self::snapshot)) **before** it looks at anything (the engine, its own
/// result), and sleeps only while the count is unchanged ([`wait`](Self::wait)). Every
/// write to the word is a read-modify-write, so its modification order is one chain: a
/// notification after the snapshot changes the count (the wait returns at once, or the
/// notifier sees `SLEEPING` and wakes every sleeper); one before it is read by the
/// snapshot's Acquire, so what the notifier published before it is visible to the
/// waiter's checks.
///
/// Announced: pushes that find the pending queue empty, device and lazy-job completions
/// ([`EngineToken::unpark`](super::EngineToken::unpark)), every engine step that made progress, and a release of the engine
/// that a waiter asked for ([`want_engine`](Self::want_engine),
/// [`released`](Self::released)). A release nobody asked for is not announced, so that
/// two callers waiting for the same slow graph do not wake each other in turn.
pub struct SingleWaits {
    word: AtomicU32,
}

impl Default for SingleWaits {
    fn default() -> Self {
        Self::new()
    }
}

/// A caller sleeps on [`SingleWaits`].
const SLEEPING: u32 = 1;
/// A caller found the engine held and wants its release announced.
const WANTED: u32 = 2;
/// One announcement (the count lives above the two flags).
const BUMP: u32 = 4;
const FLAGS: u32 = SLEEPING | WANTED;

impl SingleWaits {
    /// A count of zero, nobody sleeping.
    pub fn new() -> Self {
        Self {
            word: AtomicU32::new(0),
        }
    }

    /// The count now; take it before looking at anything the wait is for.
    pub fn snapshot(&self) -> u32 {
        // Acquire: pairs with the Release bumps this load reads (or follows in their
        // release sequence): what the notifiers published is visible to the checks after.
        self.word.load(Ordering::Acquire) & !FLAGS
    }

    /// Announces input or progress, **after** publishing it: bumps the count and wakes
    /// every sleeper if one announced itself. Returns the count it replaced and whether it
    /// made a wake call.
    pub fn notify(&self) -> (u32, bool) {
        // AcqRel: Release publishes the notifier's input to waiters whose snapshot or
        // announcement reads this bump (Acquire keeps the word's RMWs a chain of
        // synchronisation, as in `released`).
        let old = self.word.fetch_add(BUMP, Ordering::AcqRel);
        if old & SLEEPING == 0 {
            return (old & !FLAGS, false);
        }
        // Relaxed: clearing the bit needs no ordering; a sleeper that announced itself
        // after our bump sees a changed word (or is woken below) and re-checks.
        self.word.fetch_and(!SLEEPING, Ordering::Relaxed);
        FutexWait::wake_all(&self.word);
        (old & !FLAGS, true)
    }

    /// [`notify`](Self::notify) by a waiter that took `seen` as its snapshot: moves `seen`
    /// past its own bump when nobody else bumped since, so that its own announcement does
    /// not end its next wait (another one's does: then `seen` stays behind).
    pub fn notify_own(&self, seen: &mut u32) {
        let (old, _) = self.notify();
        if old == *seen {
            *seen = old.wrapping_add(BUMP) & !FLAGS;
        }
    }

    /// A caller found the engine held: asks the holder to announce its release. The
    /// caller must try to take the engine once more **after** this: a holder that let go
    /// before this request did so before the retry (this RMW reads its `released` RMW, or
    /// a later one), and one that lets go after it sees the request.
    pub fn want_engine(&self) {
        // AcqRel: Acquire synchronises with the `released` RMWs before it (their unlocks
        // happen before our retry); Release keeps the chain for later ones.
        self.word.fetch_or(WANTED, Ordering::AcqRel);
    }

    /// The holder let go of the engine (**after** unlocking it): announces that if a
    /// caller asked ([`want_engine`](Self::want_engine)). `seen`: the holder's own
    /// snapshot, as in [`notify_own`](Self::notify_own).
    pub fn released(&self, seen: Option<&mut u32>) {
        // AcqRel: Release orders our unlock before a requester's Acquire that reads this
        // RMW (then its retry finds the engine free).
        let old = self.word.fetch_and(!WANTED, Ordering::AcqRel);
        if old & WANTED != 0 {
            match seen {
                Some(seen) => self.notify_own(seen),
                None => {
                    self.notify();
                }
            }
        }
    }

    /// Sleeps until the count differs from `seen` (a notification after the snapshot),
    /// `deadline` or a spurious wake-up; the caller re-checks everything after.
    pub fn wait(&self, seen: u32, deadline: Instant) {
        self.wait_until(seen, Some(deadline));
    }

    /// [`wait`](Self::wait) without a deadline: loom models only, where a lost
    /// notification must show as a deadlock (under loom a deadline returns at once).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn wait_forever(&self, seen: u32) {
        self.wait_until(seen, None);
    }

    fn wait_until(&self, seen: u32, deadline: Option<Instant>) {
        // Relaxed: the RMW only puts the announcement in the word's single modification
        // order (a later bump sees it and wakes us; an earlier one changed the count we
        // read, and we return). Nothing is read through it: every caller takes a fresh
        // `snapshot` (Acquire) before it checks anything again.
        let now = self.word.fetch_or(SLEEPING, Ordering::Relaxed) | SLEEPING;
        if now & !FLAGS != seen {
            return;
        }
        let _ = FutexWait::wait(&self.word, now, deadline);
    }
}
