//! A downstream crate that models its *own* code with ivm-core's types under loom.
//!
//! ivm-core lists loom as a `[target.'cfg(loom)'.dependencies]` entry, so building this
//! crate with `RUSTFLAGS="--cfg loom"` gives ivm-core's [`Notifier`] loom atomics and the
//! loom futex emulation: a loom model of [`Mailbox`] (see `tests/loom_mailbox.rs`) checks
//! ivm-core and this crate together.
//!
//! ```sh
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release -p ivm-core-loom-downstream
//! ```

use ivm_core::notifier::{Closed, Notifier};
use ivm_core::sync::UnsafeCell;

/// A one-slot mailbox: one thread puts a value, another takes it.
///
/// The value is published by the [`Notifier`]: `notify()` happens after the write, and
/// `wait_and_clear()` returning `Ok` synchronises with it (the notifier's RMWs are
/// Release/Acquire), so the reader sees the write.
pub struct Mailbox<T> {
    slot: UnsafeCell<Option<T>>,
    full: Notifier,
}

// SAFETY: the slot is written only by the single producer before `notify()` and read only
// by the single consumer after `wait_and_clear()` returned `Ok` (see `put`/`take`).
unsafe impl<T: Send> Sync for Mailbox<T> {}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Mailbox<T> {
    /// An empty mailbox.
    pub fn new() -> Self {
        Mailbox {
            slot: UnsafeCell::new(None),
            full: Notifier::new(),
        }
    }

    /// Puts `value`. At most one `put` per mailbox, before one `take`.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the mailbox was closed.
    pub fn put(&self, value: T) -> Result<(), Closed> {
        // SAFETY: single producer, and the consumer reads only after our notify below.
        self.slot.with_mut(|slot| unsafe { *slot = Some(value) });
        self.full.notify()
    }

    /// Waits for the value and takes it.
    ///
    /// # Errors
    ///
    /// [`Closed`] if the mailbox was closed before a value arrived.
    pub fn take(&self) -> Result<T, Closed> {
        self.full.wait_and_clear()?;
        // SAFETY: `wait_and_clear` returned Ok, so the producer's write happened-before this
        // read (Release notify / Acquire wait) and the producer writes no more.
        Ok(self
            .slot
            .with_mut(|slot| unsafe { (*slot).take() })
            .expect("a value was put"))
    }

    /// Closes the mailbox: a waiting `take` returns `Err(Closed)`.
    pub fn close(&self) {
        self.full.close();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn put_then_take_across_threads() {
        let mailbox = Mailbox::new();
        std::thread::scope(|s| {
            s.spawn(|| mailbox.put(42).unwrap());
            assert_eq!(mailbox.take(), Ok(42));
        });
    }
}
