//! ivm-core: the `no_std`, allocation-free concurrency primitives of the ivm VM.
#![no_std]
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(any(test, loom))]
extern crate std;

#[doc(hidden)]
pub mod sync;

pub mod btb;
pub mod counter;
pub mod list;
pub mod mpsc;
pub mod notifier;
pub mod parking;
pub mod wait;

#[cfg(loom)]
pub use wait::LoomWait;
pub use wait::{Clock, DefaultWait, Instant, NoClock, SpinWait, Wait, WaitResult};
