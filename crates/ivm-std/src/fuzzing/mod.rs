//! Equivalence fuzzing of the VM (feature `fuzzing`): random instruction programs run by a
//! real [`VirtualMachine`](crate::VirtualMachine) must give exactly the results of a
//! sequential interpreter.
//!
//! A [`Program`] is a list of [`Op`]s over [`TENSORS`] one-word (`u64`) tensors and
//! [`STREAMS`] streams spread over three worker threads:
//!
//! * [`Op::Kernel`]: a kernel on one stream that reads some tensors and writes others
//!   (`x ← hash(x, kernel id, inputs)` by default: non-commutative, so any reordering of
//!   dependent kernels changes the result), after an optional small [`Delay`] (spin, yield
//!   or sleep, taken *before* it reads its inputs, so a missing edge lets another thread
//!   overtake it), and optionally panicking (a failed instruction poisons its outputs);
//! * [`Op::SyncRead`] / [`Op::SyncWrite`]: `read_small` / `write_small`
//!   interleaved with the kernels; [`Op::SyncUpdate`]: a read-modify-write through
//!   `access_mut` (which the VM may run on the calling thread);
//! * [`Op::Recreate`]: drops the tensor's handle (its release is enqueued while kernels
//!   may still use it) and puts a fresh zeroed tensor, homed on some stream, in its slot;
//! * [`Op::Barrier`], [`Op::Sync`] and [`Op::Submit`] (ends the current `run` batch).
//!
//! [`interpret`] runs a program sequentially and gives the expected [`Trace`] (every sync
//! read and sync write result, the final value of every tensor, the order barriers ran),
//! with the VM's poison semantics: a kernel that panics poisons its outputs; a kernel or a
//! sync access that touches a poisoned tensor fails without running and poisons its
//! outputs with the same failure (its first poisoned operand's, inputs before outputs);
//! later sync reads of a poisoned tensor get [`Error::Poisoned`](crate::Error::Poisoned)
//! carrying the message of the kernel that panicked. [`Runner`] runs the same program on a
//! VM and compares; a difference is a [`Mismatch`] whose `Display` names the first
//! differing observation and lists the program.
//!
//! Programs come from bytes through [`arbitrary::Arbitrary`] (cargo-fuzz), from
//! [`Program::from_bytes`] (proptest over a byte vector) or from [`Program::from_seed`]
//! (a deterministic loop). libFuzzer aborts on any panic, so fuzz targets call
//! [`Program::without_panics`]; kernel panics belong in proptest.
//!
//! # Fuzzing your own kernels
//!
//! A runtime built on ivm plugs its kernels in through [`Kernels`]: kernel id → a
//! deterministic function from the input words to the output words. The interpreter and
//! the VM call the same function, so the check covers the VM's ordering of *your* kernels
//! (and a kernel that panics on some inputs is modelled too).
//!
//! ```
//! use ivm_std::Config;
//! use ivm_std::fuzzing::{Kernels, Program, Runner};
//!
//! /// Two kernels of "my runtime": an affine update and a saturating subtraction.
//! struct MyKernels;
//!
//! impl Kernels for MyKernels {
//!     fn apply(&self, id: u32, inputs: &[u64], outputs: &mut [u64]) {
//!         let sum = inputs.iter().fold(0u64, |a, &x| a.wrapping_mul(3).wrapping_add(x));
//!         for (j, o) in outputs.iter_mut().enumerate() {
//!             *o = match id % 2 {
//!                 0 => o.wrapping_mul(5).wrapping_add(sum).wrapping_add(j as u64),
//!                 _ => sum.saturating_sub(*o) ^ u64::from(id),
//!             };
//!         }
//!     }
//! }
//!
//! let runner = Runner::with_kernels(Config::default(), MyKernels)?;
//! for seed in 0..8 {
//!     let program = Program::from_seed(seed);
//!     if let Err(mismatch) = runner.run(&program) {
//!         panic!("{mismatch}");
//!     }
//! }
//! // Nothing may outlive the programs in the engine.
//! assert_eq!(runner.shutdown()?, ivm_std::DebugCounters::default());
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! A cargo-fuzz target reuses one runner (one VM) across runs; its body is this function
//! (see `fuzz/fuzz_targets/vm_program.rs` in the ivm repository):
//!
//! ```no_run
//! use std::sync::OnceLock;
//!
//! use ivm_std::Config;
//! use ivm_std::fuzzing::{Program, Runner};
//!
//! static RUNNER: OnceLock<Runner> = OnceLock::new();
//!
//! // libfuzzer_sys::fuzz_target!(|program: Program| fuzz_one(program));
//! fn fuzz_one(program: Program) {
//!     let runner = RUNNER.get_or_init(|| Runner::new(Config::default()).unwrap());
//!     if let Err(mismatch) = runner.run(&program.without_panics()) {
//!         panic!("{mismatch}");
//!     }
//! }
//! ```

pub use arbitrary;

mod faults;
mod interpreter;
mod program;
mod runner;
mod topology;

pub use faults::{FaultCampaign, FaultControl, FaultOutcome};
pub use interpreter::{HashKernels, Kernels, Observed, Trace, interpret};
pub use program::{Delay, KernelOp, LaunchGraphs, LaunchOp, Op, Program, launch_mix};
pub use runner::{Mismatch, Outcome, Point, Runner, check, silence_planned_panics};
pub use topology::{CrossStream, Topology, stream_ids};

/// Tensors per program (one `u64` word each).
pub const TENSORS: usize = 4;
/// Streams per program (see [`stream_ids`]).
pub const STREAMS: usize = 4;
/// Most ops [`Program`]'s `Arbitrary` impl generates: long enough for histories that
/// cross streams and devices many times (a 300 s run at 40 never exceeded a few dozen).
pub const MAX_OPS: usize = 128;
/// Most streams a [`Topology`] may have (stream indices in ops range over `0..MAX_STREAMS`
/// and are taken modulo the topology's length).
pub const MAX_STREAMS: usize = 16;
/// Lazy graphs a [`Runner`] launches (see [`LaunchOp`], [`LaunchGraphs`]).
pub const GRAPHS: usize = 2;
/// Every planned kernel panic's message starts with this.
pub const PANIC_MARKER: &str = "ivm-fuzz: planned panic";

const ALL_TENSORS: u8 = (1 << TENSORS) - 1;

/// `config` with the settings of this test lane: `IVM_FUSION` and `IVM_RUN_AT_REST` (`1` /
/// `0`) where set, else `config`'s own. CI runs the equivalence tests once with the
/// defaults and once with the other setting of each, so every path stays checked against
/// the interpreter.
///
/// # Panics
/// When either is set to anything but `0` or `1`.
pub fn ci_lane(config: crate::Config) -> crate::Config {
    let flag = |name: &str| match std::env::var(name).as_deref() {
        Err(_) => None,
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        Ok(other) => panic!("{name}={other:?}: expected 0 or 1"),
    };
    let config = match flag("IVM_FUSION") {
        Some(on) => config.with_fusion(on),
        None => config,
    };
    match flag("IVM_RUN_AT_REST") {
        Some(on) => config.with_run_at_rest(on),
        None => config,
    }
}

/// A bug planted in the engine (ivm-engine's feature `planted-bugs`) to show that the
/// equivalence check catches it (tests of this module only; see
/// [`Runner::with_planted_bug`]). Never set outside those tests.
#[doc(hidden)]
pub use ivm_engine::PlantedBug;
