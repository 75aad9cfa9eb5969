//! The doors into the VM, above the engine: the instructions builder (`run`), the
//! synchronous small accesses and callbacks, the futures of the `_async` entry points, and
//! the lazy-job launch through critical sections. Each submits instructions to the engine
//! and waits in its own way; none decides order (that is ivm-engine's).

pub(crate) mod builder;
pub mod completion;
pub mod custom;
pub mod lazy;
pub(crate) mod small_ring;
pub(crate) mod sync_access;
