//! Running code the user hands to the VM (kernels, policies, hooks, adapters, the drops of
//! closures' captures) so that its panic fails the work it belongs to and never unwinds
//! through a VM thread or the engine: every such call goes through [`catch`], every value
//! whose drop is the user's through [`drop_caught`], every caught payload through
//! [`drop_payload`] (ARCHITECTURE.md, "Code the user hands to the VM").
//!
//! Public for the crates that run user code on threads of their own the same way: a graph
//! runtime's kernels and trace callbacks, an adapter's device thread or driver callback.
//!
//! ```
//! use ivm_std::panics::catch;
//!
//! assert_eq!(catch(|| 2 + 2), Ok(4));
//! assert_eq!(catch(|| -> u32 { panic!("boom") }), Err("boom".to_string()));
//! ```

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The message of a panic's payload (`&str` and `String` payloads; a placeholder otherwise).
pub fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Drops a caught panic's payload, whose own drop may panic: that second payload is
/// leaked, not dropped (its drop could panic again, without end).
pub fn drop_payload(payload: Box<dyn Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// Runs `f` (user code); a panic becomes its message (the payload dropped here).
pub fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = panic_message(&*payload);
        drop_payload(payload);
        message
    })
}

/// Drops `value`, whose drop runs user code (a closure's captures); a panic in it is
/// caught and its message returned.
pub fn drop_caught<T>(value: T) -> Option<String> {
    catch(move || drop(value)).err()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct PanicsOnDrop(&'static str);
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("{}", self.0);
        }
    }

    #[test]
    fn a_panicking_drop_is_caught_with_its_message() {
        assert_eq!(drop_caught(PanicsOnDrop("boom")).as_deref(), Some("boom"));
        assert_eq!(drop_caught(5u32), None);
    }

    #[test]
    // The second payload is leaked by design, and Miri reports the leak.
    #[cfg_attr(miri, ignore)]
    fn a_payload_whose_drop_panics_is_leaked_not_rethrown() {
        let r = catch(|| std::panic::panic_any(PanicsOnDrop("payload")));
        assert_eq!(r.unwrap_err(), "non-string panic payload");
    }
}
