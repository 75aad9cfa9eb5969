//! The lowest layer of ivm-std, the vocabulary every layer above uses: errors, the names
//! of devices and streams, the futex wait backend, the mutex helper, the tuning
//! constants, what a VM is configured with ([`Config`](crate::Config)) and the fork
//! policy (the fork generation every entry point checks). Plain data and process-wide
//! state: nothing here knows about instructions, streams or the engine.

pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod fork;
pub mod futex;
pub(crate) mod hooks;
pub(crate) mod ids;
pub(crate) mod panics;
pub(crate) mod tuning;

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning: every VM mutex guards data that a panicking holder leaves
/// consistent (kernels run outside every lock, and their panics are caught).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
