//! ivm-std: the ivm instruction virtual machine on std.
//!
//! A front end turns every operation into an *instruction* that names the tensors it reads
//! and writes and the [`Stream`] it runs on. The [`VirtualMachine`] builds the dependency
//! graph between instructions (per tensor: a write waits for every access since the last
//! write, a read waits for the last write), runs independent instructions concurrently on
//! worker threads, releases them in order per stream, and offers synchronous doors into
//! that asynchronous world: [`VirtualMachine::read_small`] /
//! [`VirtualMachine::write_small`], sync blob callbacks and [`VirtualMachine::sync`].
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
//! vm.read_small(&b, 0, &mut out)?;
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! # Features
//!
//! * `fuzzing`: the [`fuzzing`] module — the equivalence fuzzer (random programs over
//!   several streams, a sequential interpreter, a runner that compares them) that the
//!   fuzz targets and the `vm_equivalence` tests use. Off by default.
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod contract;
pub mod device;
mod doors;
mod engine;
#[cfg(feature = "fuzzing")]
#[cfg_attr(docsrs, doc(cfg(feature = "fuzzing")))]
pub mod fuzzing;
mod model;
mod runtime;
mod util;
mod vm;

pub use device::alloc_cache;
pub use device::cpu::{CpuAdapter, CpuAllocator, CpuEvent, CpuStream, HostMemory};
pub use device::policy::{CpuStreamPolicy, DeviceStreamPolicy, Placement, StreamPolicy};
pub use device::{
    DeviceAdapter, DeviceAllocator, DeviceMemory, DeviceStream, Event, HostFn, KernelMode,
};
pub use doors::builder::InstructionsBuilder;
pub use doors::completion::{Completion, ReadSmallMem};
pub use doors::custom::{Done, InstructionPolicy};
pub use doors::lazy::LazyGraph;
pub use doors::{completion, custom, lazy};
pub use engine::DebugCounters;
/// Loom models only: backpressure's waiters and the word they sleep on
/// (`engine/backpressure.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use engine::backpressure::{Backpressure, Waiting};
/// Loom models only: the engine token and the scheduler's parking word (`engine/drive/token.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use engine::drive::EngineToken;
/// Loom models only: single-thread mode's waiting word (`engine/drive/single_waits.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use engine::drive::SingleWaits;
/// Loom models only: the shutdown gate (`engine/gate.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use engine::gate::{Gate, Pass};
/// Loom models only: the helper count of the `Helping` protocol (`engine/helping.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use engine::helping::Helpers;
pub use engine::stats;
pub use engine::stats::{Dag, DagEdge, DagNode, NodeState, StreamStats, ThreadStats, VmStats};
/// Loom models only: a worker's express lane (`model/express.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use model::express::{EXPRESS_MAX, Express, ExpressLane, Planted};
/// Loom models only: a worker's hand-over of its queue to waiting callers
/// (`model/hand_over.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use model::hand_over::HandOver;
pub use model::kernel::KernelCtx;
pub use model::stream::Stream;
/// Loom models only: the consumer-role hand-over between a worker and a caller that runs
/// its queued instructions (`model/thread_ctx.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use model::thread_ctx::{
    DEFER_WAKE, doze, leave_wake_to_deadline, let_go, let_go_to_doze, planted_leave_wake_by_load,
    planted_let_go_recheck_first, planted_let_go_to_any_sleep, planted_let_go_without_fence,
    planted_let_go_without_recheck, planted_skip_wake_by_load, planted_take_role_without_fence,
    skip_wake, take_role, wake_from_doze, withdraw_defer,
};
pub use model::trace;
pub use runtime::tensor::Tensor;
pub use util::config::{Config, MAX_FUSED_RUN, MAX_POLL_WINDOW, Mode, SPIN_WINDOW_MIN_CORES};
pub use util::error::{Diagnostic, Error, LivelyInstruction, Result};
pub use util::futex;
pub use util::hooks::{Captures, DropSink, ForeignHooks, WaitHook};
pub use util::ids::{Device, DeviceKind, StreamId, StreamType};
pub use util::panics;
pub use util::tuning::RING_MAX;
pub use vm::VirtualMachine;
