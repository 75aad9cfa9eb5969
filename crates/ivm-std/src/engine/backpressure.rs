//! Backpressure's waiting: a submitter that finds more than the high-water mark in flight
//! sleeps on a sequence word until a release brings the count below the low-water mark
//! (`VmCore::wait_backpressure`, ARCHITECTURE.md, "The life of one instruction").
//!
//! Three pairs of orderings carry it, each checked by a loom model through this type:
//!
//! * **waiter and releaser** (store buffering): a waiter counts itself and fences
//!   ([`announce`](Backpressure::announce)) before it looks at the count in flight; a
//!   releaser decrements that count, fences and reads the waiters
//!   ([`after_release`](Backpressure::after_release)). One of them sees the other: the
//!   waiter sees the decrement, or the releaser sees the waiter and wakes it.
//! * **the wake itself** (a release fence and an Acquire load): the releaser bumps the
//!   sequence word after its decrement and its SeqCst fence (which releases the bump); a
//!   waiter reads the word with Acquire ([`Waiting::seq`]) before it looks at the count. A
//!   waiter that read the bump sees the decrement; one that read the old value sleeps on
//!   it and is woken by the bump's wake. `tests/loom_backpressure.rs`.
//! * **waiter and a worker that left a release for later** (store buffering): the waiter,
//!   after `announce`'s fence, looks for a mark on the engine word and drives; a worker
//!   marks the word, then asks [`waiting`](Backpressure::waiting) (a fence, then the
//!   count) and pays its debt if anyone waits. `tests/loom_awaited.rs`.

use ivm_core::sync::{AtomicU32, AtomicUsize, Ordering, fence};
use ivm_core::wait::{Instant, Wait};

use crate::util::futex::FutexWait;

/// The waiters of a VM's backpressure and the word they sleep on (`VmCore::backpressure`).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for the loom models.
#[derive(Debug, Default)]
pub struct Backpressure {
    /// Submitters waiting for the count in flight to fall below the low-water mark.
    waiters: AtomicUsize,
    /// Bumped by a release that found waiters and the count below the mark; they sleep
    /// on it.
    seq: AtomicU32,
}

/// A submitter counted as waiting ([`Backpressure::announce`]); dropping it stops counting.
#[derive(Debug)]
#[must_use = "dropping it stops counting the submitter as waiting"]
pub struct Waiting<'a>(&'a Backpressure);

impl Backpressure {
    /// Nobody waiting.
    pub fn new() -> Self {
        Self::default()
    }

    /// A submitter about to wait: counts itself, then a SeqCst fence, before it looks at
    /// the count in flight or the engine word (see the module docs: the releaser's and the
    /// worker's fences pair with this one). The count's increment is Relaxed: the fences
    /// order it.
    pub fn announce(&self) -> Waiting<'_> {
        self.waiters.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        Waiting(self)
    }

    /// Whether a submitter waits, asked by a worker after it marked the engine word for a
    /// release it leaves for later: a SeqCst fence, then the count (Relaxed: the fences
    /// order it). Pairs with [`announce`](Self::announce)'s fence: a waiter that counted
    /// itself after our fence sees our mark.
    pub fn waiting(&self) -> bool {
        fence(Ordering::SeqCst);
        self.waiters.load(Ordering::Relaxed) > 0
    }

    /// A releaser, after decrementing the count in flight: if a submitter waits and
    /// `below_low()` (the count is below the low-water mark now), bumps the sequence word
    /// and wakes every sleeper. The SeqCst fence before the waiters' count pairs with
    /// [`announce`](Self::announce)'s.
    pub fn after_release(&self, below_low: impl FnOnce() -> bool) {
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fences.
        if self.waiters.load(Ordering::Relaxed) > 0 && below_low() {
            // Relaxed: the SeqCst fence above is a release fence for this bump, so a
            // waiter whose Acquire load in `Waiting::seq` reads it sees our decrement of
            // the count in flight (fence-to-acquire synchronisation; a Release here adds
            // nothing: weakening it to Relaxed passes every model, and removing the fence
            // fails `tests/loom_backpressure.rs`).
            self.seq.fetch_add(1, Ordering::Relaxed);
            FutexWait::wake_all(&self.seq);
        }
    }

    /// A planted bug for `tests/loom_awaited.rs`: [`announce`](Self::announce) without its
    /// fence.
    #[cfg(loom)]
    pub fn planted_announce_without_fence(&self) -> Waiting<'_> {
        self.waiters.fetch_add(1, Ordering::Relaxed);
        Waiting(self)
    }

    /// A planted bug for `tests/loom_awaited.rs`: [`waiting`](Self::waiting) without its
    /// fence.
    #[cfg(loom)]
    pub fn planted_waiting_without_fence(&self) -> bool {
        self.waiters.load(Ordering::Relaxed) > 0
    }

    /// A planted bug for `tests/loom_backpressure.rs`: [`after_release`](Self::after_release)
    /// without its fence.
    #[cfg(loom)]
    pub fn planted_after_release_without_fence(&self, below_low: impl FnOnce() -> bool) {
        if self.waiters.load(Ordering::Relaxed) > 0 && below_low() {
            self.seq.fetch_add(1, Ordering::Relaxed);
            FutexWait::wake_all(&self.seq);
        }
    }
}

impl Waiting<'_> {
    /// The sequence word now, read before the waiter looks at the count in flight (then
    /// passed to [`sleep`](Self::sleep)). Acquire: pairs with the fence before the bump in
    /// [`Backpressure::after_release`], so a waiter that reads a bump sees the decrement
    /// that came before it.
    pub fn seq(&self) -> u32 {
        self.0.seq.load(Ordering::Acquire)
    }

    /// Sleeps while the sequence word still reads `seen`, until `deadline` at most (the
    /// futex's own check: a bump after [`seq`](Self::seq) returns at once).
    pub fn sleep(&self, seen: u32, deadline: Option<Instant>) {
        FutexWait::wait(&self.0.seq, seen, deadline);
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        // Relaxed: a stale count costs a releaser one useless wake, nothing else.
        self.0.waiters.fetch_sub(1, Ordering::Relaxed);
    }
}
