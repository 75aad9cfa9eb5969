//! ivm-device: device adapters for the ivm instruction virtual machine.
//!
//! The VM ([`ivm_std`]) is written against the adapter traits of [`ivm_std::device`];
//! adapters are registered when a VM is built
//! ([`VirtualMachine::with_adapters`](ivm_std::VirtualMachine::with_adapters)), so ivm-std
//! never depends on this crate.
//!
//! * [`sim`]: a simulated asynchronous accelerator. Each stream is a queue run by its own
//!   thread with configurable launch, kernel and copy latencies; events complete when the
//!   queue reaches them; device-side waits hold the waiting queue back; its allocator
//!   frees in stream order and poisons what it frees. This is how ivm tests asynchronous
//!   device semantics on machines without a GPU.
//! * `cuda` (feature `cuda`): the same traits over CUDA streams and events through
//!   `cudarc`, loading the driver at run time (builds without a CUDA toolkit; creating the
//!   adapter without a driver is an error, not a panic).
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod sim;

pub use sim::{SimAdapter, SimConfig};
