//! ivm-std: the ivm instruction virtual machine on std.
//!
//! A front end turns every operation into an *instruction* that names the tensors it reads
//! and writes and the [`Stream`] it runs on. The [`VirtualMachine`] builds the dependency
//! graph between instructions (per tensor: a write waits for every access since the last
//! write, a read waits for the last write), runs independent instructions concurrently on
//! worker threads, releases them in order per stream, and offers synchronous doors into
//! that asynchronous world: [`VirtualMachine::sync_read_small_mem`] /
//! [`VirtualMachine::sync_write_small_mem`], sync blob callbacks and [`VirtualMachine::sync`].
//!
//! ```
//! use ivm_std::{Config, VirtualMachine};
//!
//! let vm = VirtualMachine::new(Config::default())?;
//! let s = vm.default_stream();
//! let (a, b) = (vm.new_tensor(8)?, vm.new_tensor(8)?);
//! vm.run(|bld| {
//!     bld.call(&s, &[], &[&a], |k| k.output_u64(0)[0] = 20)?;
//!     bld.call(&s, &[&a], &[&b], |k| {
//!         let x = k.input_u64(0)[0];
//!         k.output_u64(0)[0] = 2 * x + 2;
//!     })
//! })?;
//! let mut out = [0u8; 8];
//! vm.sync_read_small_mem(&b, &mut out)?;
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod builder;
pub mod completion;
mod config;
pub mod contract;
pub mod device;
mod drive;
mod engine;
mod execute;
mod fork;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod graph;
pub mod lazy;
mod model;
mod scheduler;
mod shared;
mod soft_sync;
pub mod stats;
mod sync_access;
mod tensor;
mod util;
mod vm;
mod worker;

pub use builder::InstructionsBuilder;
pub use completion::{Completion, ReadSmallMem};
pub use config::{Config, Mode, SPIN_WINDOW_MIN_CORES};
pub use device::alloc_cache;
pub use device::cpu::{CpuAdapter, CpuAllocator, CpuEvent, CpuStream, HostMemory};
pub use device::ids::{Device, DeviceKind, StreamId, StreamType};
pub use device::{
    DeviceAdapter, DeviceAllocator, DeviceMemory, DeviceStream, Event, HostFn, KernelMode,
};
/// Loom models only: the helper count of the `Helping` protocol (`drive.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use drive::Helpers;
/// Loom models only: the engine token and the scheduler's parking word (`drive.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use drive::Wake;
pub use engine::DebugCounters;
pub use lazy::LazyGraph;
pub use model::instruction::KernelCtx;
pub use model::stream::{CpuStreamPolicy, DeviceStreamPolicy, Placement, Stream, StreamPolicy};
pub use model::trace;
pub use stats::{Dag, DagEdge, DagNode, NodeState, StreamStats, ThreadStats, VmStats};
pub use tensor::Tensor;
pub use util::error::{Diagnostic, Error, LivelyInstruction, Result};
pub use util::futex;
pub use util::tuning::RING_MAX;
pub use vm::VirtualMachine;
