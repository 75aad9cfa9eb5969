//! A worker that shares its CPU hands its queue to the callers waiting for it.
//!
//! A worker that another thread keeps off its CPU runs its kernels at a fraction of
//! their speed, while a caller waiting for one of them spins or sleeps on the other CPU.
//! Waiting for a thread that is not running is never faster than doing its work, so such
//! a worker, between two instructions, lets go of its queue's consumer role and sleeps
//! while a caller waits for it: the caller then runs the queue itself
//! (`worker::caller_runs`), and the busy neighbour keeps the worker's CPU.
//!
//! Letting go with instructions still queued breaks the rule the role hand-over rests on
//! (`thread_ctx.rs`: the worker sleeps only on an empty queue, so the next push wakes it).
//! Here nobody is woken by a push, so the callers that were waiting owe the worker a wake
//! when they stop waiting. The protocol:
//!
//! * a caller counts itself in `waiting` before it looks at the queue
//!   ([`enter`](HandOver::enter)), and out when it stops looking ([`leave`](HandOver::leave));
//! * the worker sets `handed`, lets go of the role, then reads `waiting` with a
//!   read-modify-write: with nobody waiting it takes its offer back (`handed` swapped to
//!   false) and then the role ([`hand_over`](HandOver::hand_over)); otherwise it sleeps;
//! * a leaving caller counts itself out, then swaps `handed` to false and, if it was set,
//!   wakes the worker.
//!
//! The two read-modify-writes of `waiting` are ordered in its modification order, and
//! each reads the value just before it. If the worker's comes second, it reads the last
//! caller's count-out: nobody waits, it takes its offer back. If it comes first, the
//! caller's count-out reads from it (Release, then Acquire), so the caller's swap sees
//! `handed` set. The swap decides which of them acts, so the worker never sleeps with its
//! offer open and nobody waiting. A caller that takes the role clears `handed`
//! ([`taken`](HandOver::taken)): its own `let_go` re-checks the queue and wakes the worker
//! for what is left. Checked by the third model of `tests/loom_caller_runs.rs`, with three
//! planted bugs.

use ivm_core::mpsc::{Consumer, Linked};
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering};
use ivm_core::wait::Wait;

/// The hand-over state of one worker's queue (module docs).
#[derive(Debug, Default)]
pub struct HandOver {
    /// Callers that may run the queue now (between `enter` and `leave`).
    waiting: AtomicUsize,
    /// The worker let go of the role for the waiting callers and sleeps: whoever clears it
    /// owes the queue a runner (a wake, or its own `let_go`).
    handed: AtomicBool,
}

impl HandOver {
    /// A queue nobody waits for.
    pub fn new() -> Self {
        Self::default()
    }

    /// A caller starts waiting for the queue's work, ready to run it itself.
    pub fn enter(&self) {
        // Relaxed: the worker's look at the count before it hands over is a hint; what
        // must not be missed is ordered by the fences of `hand_over` and `leave`.
        self.waiting.fetch_add(1, Ordering::Relaxed);
    }

    /// A caller stops waiting (its wait is over, or it blocks): wakes the worker through
    /// `notifier` if it handed its queue over and no caller has taken it since.
    pub fn leave<W: Wait>(&self, notifier: &Notifier<W>) {
        // Acquire: reading the worker's count (a Release read-modify-write in
        // `hand_over`) makes its offer visible to our swap below (module docs).
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        self.wake_if_handed(notifier);
    }

    /// Whether a caller waits (a hint for the worker's decision to hand over).
    pub fn has_waiters(&self) -> bool {
        // Relaxed: a hint (see `enter`).
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// A caller took the role the worker handed over: its `let_go` looks after the queue
    /// from now on, so no leaving caller needs to wake the worker.
    pub fn taken(&self) {
        // Relaxed: this runs while the caller holds the role (its `let_go` re-checks the
        // queue), so a worker that still takes its offer back only takes the role or
        // sleeps in vain. A swap for loom, as in `hand_over`.
        self.handed.swap(false, Ordering::Relaxed);
    }

    /// Worker: lets go of `consumer` for the waiting callers. Returns `true` when nobody
    /// waits any more and the offer is taken back: the worker takes the role again
    /// (`thread_ctx::take_role`; a caller holding it meanwhile re-checks the queue in its
    /// `let_go`) and runs on. `false`: the worker sleeps, and a caller runs the queue or
    /// wakes it.
    pub fn hand_over<T: Linked<Tag>, Tag>(&self, consumer: Consumer<'_, T, Tag>) -> bool {
        // Relaxed: published by the Release read-modify-write below. A swap, not a
        // store: loom 0.7 lets a later read-modify-write of another thread miss a plain
        // store that came before it (and so would report lost wakes that cannot happen).
        self.handed.swap(true, Ordering::Relaxed);
        // Release (in the guard's drop): publishes our pops to the role's next holder.
        drop(consumer);
        // A read-modify-write, not a load: it reads the latest count (module docs).
        // Release: a caller whose count-out reads it sees our offer.
        self.waiting.fetch_add(0, Ordering::AcqRel) == 0 && self.take_back()
    }

    /// Clears the offer; whether it was still open (the clearer owes the queue a runner).
    fn take_back(&self) -> bool {
        // AcqRel: one swap of the offer wins; the winner's later look at the queue (or
        // the worker it wakes) follows the loser's writes.
        self.handed.swap(false, Ordering::AcqRel)
    }

    fn wake_if_handed<W: Wait>(&self, notifier: &Notifier<W>) {
        if self.take_back() {
            // Err(Closed): shutdown; the worker drains on its way out.
            let _ = notifier.notify();
        }
    }

    /// [`hand_over`](Self::hand_over) reading the count with a plain load: a planted bug
    /// for the loom model (the load may miss the last caller's count-out while that
    /// caller's swap missed the offer).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_hand_over_by_load<T: Linked<Tag>, Tag>(
        &self,
        consumer: Consumer<'_, T, Tag>,
    ) -> bool {
        self.handed.swap(true, Ordering::Relaxed);
        drop(consumer);
        self.waiting.load(Ordering::Relaxed) == 0 && self.take_back()
    }

    /// [`hand_over`](Self::hand_over) that sleeps without reading the count: a planted
    /// bug for the loom model (the last caller left before the offer; nobody wakes us).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_hand_over_blindly<T: Linked<Tag>, Tag>(
        &self,
        consumer: Consumer<'_, T, Tag>,
    ) -> bool {
        self.handed.swap(true, Ordering::Relaxed);
        drop(consumer);
        false
    }
}
