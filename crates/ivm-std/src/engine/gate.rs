//! The shutdown gate: one word that counts the callers inside a submission and says
//! whether shutdown has begun. Shutdown closes the gate, then waits until nobody is inside;
//! after that, everything a caller pushed while inside is visible to shutdown's drain, and
//! no caller pushes again (ARCHITECTURE.md, "The life of one instruction", step 2).
//!
//! Only two orderings carry the protocol: a caller leaves with Release and shutdown's wait
//! reads the empty count with Acquire. Entering, closing and the `is_closed` hint are
//! Relaxed; why that is enough is written at each of them. `tests/loom_gate.rs` checks it,
//! with two planted bugs.

use ivm_core::sync::{AtomicUsize, Ordering};

/// Bit 0 of the word: closed (shutdown has begun). The rest counts the callers inside
/// (each adds 2).
const CLOSED: usize = 1;
const ONE_INSIDE: usize = 2;

/// The shutdown gate of a VM (`VmCore::gate`).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_gate.rs`.
#[derive(Default)]
pub struct Gate {
    state: AtomicUsize,
}

/// Shows the word by its parts: `Gate { closed: false, inside: 2 }`.
impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Relaxed: a diagnostic snapshot.
        let s = self.state.load(Ordering::Relaxed);
        f.debug_struct("Gate")
            .field("closed", &(s & CLOSED != 0))
            .field("inside", &(s / ONE_INSIDE))
            .finish()
    }
}

/// A caller inside the gate: shutdown waits for it to be dropped.
#[derive(Debug)]
#[must_use = "dropping the pass leaves the gate at once"]
pub struct Pass<'a>(&'a Gate);

impl Gate {
    /// An open gate with nobody inside.
    pub fn new() -> Self {
        Self::default()
    }

    /// Enters the gate: `None` once it is closed.
    ///
    /// Relaxed is enough: the word's modification order decides. Our increment comes
    /// either before [`close`](Self::close)'s in that order, and then shutdown counts us
    /// and waits for our [`Pass`] to go (whose Release publishes what we pushed), or
    /// after it, and then it reads `CLOSED` and we push nothing. Shutdown publishes
    /// nothing that a rejected caller reads.
    pub fn enter(&self) -> Option<Pass<'_>> {
        let s = self.state.fetch_add(ONE_INSIDE, Ordering::Relaxed);
        let pass = Pass(self);
        (s & CLOSED == 0).then_some(pass)
    }

    /// Whether the gate is closed. A hint for early errors, Relaxed: a caller that reads
    /// it open still goes through [`enter`](Self::enter), and one that reads it closed
    /// reads nothing that shutdown wrote. A thread that happens after `close` (through a
    /// lock shutdown took afterwards, say) reads it closed by coherence.
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Relaxed) & CLOSED != 0
    }

    /// Closes the gate: every later [`enter`](Self::enter) fails. Relaxed: see `enter`;
    /// what shutdown needs from the callers it gets in
    /// [`wait_until_empty`](Self::wait_until_empty).
    pub fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::Relaxed);
    }

    /// Calls `pause` until nobody is inside. Everything the callers did inside (their
    /// pushes) happens before this returns. Meant for after [`close`](Self::close):
    /// callers leave within a submission, so the wait is short (shutdown passes
    /// `std::thread::yield_now`).
    pub fn wait_until_empty(&self, mut pause: impl FnMut()) {
        // Acquire: pairs with `Pass::drop`'s Release. The value read is in the release
        // sequence of the last leaver's decrement (every write to the word is a
        // read-modify-write), so its pushes happen before our return.
        while self.state.load(Ordering::Acquire) >> 1 != 0 {
            pause();
        }
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        // Release: our pushes happen before `wait_until_empty`'s Acquire of a zero count.
        self.0.state.fetch_sub(ONE_INSIDE, Ordering::Release);
    }
}

/// Planted bugs for the loom model `tests/loom_gate.rs`; loom must find each.
#[cfg(loom)]
impl Gate {
    /// [`close`](Self::close) as a plain store: it forgets the callers inside, so shutdown
    /// drains while one still pushes.
    pub fn planted_close_by_store(&self) {
        self.state.store(CLOSED, Ordering::Relaxed);
    }
}

#[cfg(loom)]
impl Pass<'_> {
    /// Leaves with Relaxed: shutdown sees the count reach zero without seeing what the
    /// caller pushed.
    pub fn planted_leave_relaxed(self) {
        self.0.state.fetch_sub(ONE_INSIDE, Ordering::Relaxed);
        std::mem::forget(self);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_closed_gate_rejects_and_counts_who_is_inside() {
        let gate = Gate::new();
        let pass = gate.enter().expect("open");
        assert!(!gate.is_closed());
        gate.close();
        assert!(gate.is_closed());
        assert!(gate.enter().is_none(), "closed: rejected");
        let mut pauses = 0;
        let mut pass = Some(pass);
        gate.wait_until_empty(|| {
            pauses += 1;
            pass.take(); // the caller inside leaves
        });
        assert_eq!(pauses, 1, "waited for the caller inside, and only for it");
    }

    #[test]
    fn debug_names_the_parts_of_the_word() {
        let gate = Gate::new();
        let _a = gate.enter();
        let _b = gate.enter();
        gate.close();
        assert_eq!(format!("{gate:?}"), "Gate { closed: true, inside: 2 }");
    }
}
