#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

/// The `no_std` core: intrusive lists, MPSC queue, notifier, counters, blocking-then-busy,
/// scheduler parking.
pub use ivm_core;
/// Device adapters.
pub use ivm_device;
/// The VM on std.
pub use ivm_std;
