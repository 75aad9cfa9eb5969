//! A graph runtime for ivm's lazy jobs: a compiled graph of kernels over its own blobs,
//! run as actors on several threads, served through a [`LazyGraph`](ivm_std::lazy::LazyGraph)'s named buffers.
//!
//! It is written against ivm-std's public lazy-job protocol ([`ivm_std::lazy`]) only, as
//! any other graph runtime may be; the `ivm` facade re-exports it as `ivm::graph`.
//!
//! A [`Graph`] is built from interface ops (inputs copied in from eager tensors, outputs
//! copied out to eager tensors), intermediate blobs, parameters (eager tensors used in
//! place) and kernels (closures reading and writing blobs). At run time every kernel is an
//! *actor*, and so is each piece of the lazy-job protocol:
//!
//! * the **source tick** takes a job instance from `{job}/source-tick` and starts an
//!   iteration;
//! * the **wait** kernel takes the run's two critical-section instances from `{job}/wait`;
//! * an **input** kernel takes its op's instance from `{job}/input/{op}`, copies the eager
//!   tensor into the graph blob and initialises the op's end record;
//! * compute kernels run the user's closures;
//! * an **output** kernel takes its op's instance, copies the graph blob into the eager
//!   tensor and initialises the op's end record — as soon as that blob is produced, not at
//!   the end of the iteration;
//! * the **callback** kernel takes the instances from `{job}/callback` and calls
//!   `finish` (every end record not yet set is initialised);
//! * the **callback notifier** takes the job instance from `{job}/callback-notifier` and
//!   finishes it, which marks the launch instruction done.
//!
//! Actors are joined by bounded channels: an actor fires for iteration *i* once each
//! predecessor has finished *i* and each successor has consumed iteration *i − depth*,
//! where `depth` (the pipeline depth, default 2) is the number of register slots of every
//! produced blob. So iterations of one graph pipeline — run *i + 1*'s input kernels can
//! copy while run *i*'s compute kernels still run — and a slow consumer holds its producer
//! back. Actors live on [`GraphBuilder::threads`] threads (default 2): the protocol actors
//! (ticks, wait, interface kernels, callbacks) on thread 0, compute kernels spread over the
//! others — or everything on one thread. A thread runs whatever of its actors is ready,
//! polls for a short window when none is ([`GraphBuilder::poll_window`]), then sleeps on
//! a notifier.
//!
//! A kernel gets its operands from a [`GraphCtx`]: one at a time, or all at once with
//! [`GraphCtx::io`] (in place, no copies).
//!
//! Kernels that use parameters ([`GraphBuilder::param_kernel`]) run in one global order,
//! iteration after iteration, so a parameter update of run *i* is seen by run *i + 1*.
//!
//! A kernel that panics fails its iteration downstream of it: output kernels that depend
//! on it fail their end records (the eager outputs are poisoned), the callback notifier
//! finishes the job with the error (the parameters are poisoned); other outputs of that
//! run are still delivered. The graph keeps serving later runs.
//!
//! Dropping (or [`Graph::shutdown`]) closes the job's buffers and joins the threads;
//! every run not finished by then fails with [`Error::GraphClosed`](ivm_std::Error::GraphClosed), so no eager
//! instruction waits forever.
//!
//! # Examples
//!
//! ```
//! use ivm_graph::GraphBuilder;
//! use ivm_std::{Config, VirtualMachine};
//!
//! let mut g = GraphBuilder::new("double");
//! let x = g.input("x", 8);
//! let y = g.blob("y", 8);
//! g.kernel("mul2", &[x], &[y], |k| {
//!     let v = k.input_u64(0)[0];
//!     k.output_u64(0)[0] = 2 * v;
//! });
//! g.output("y", y);
//! let graph = g.build()?;
//!
//! let vm = VirtualMachine::new(Config::default())?;
//! let a = vm.new_tensor_from(&vm.default_stream(), &21u64.to_ne_bytes())?;
//! let b = vm.new_tensor(8)?;
//! vm.run(|bld| bld.launch_lazy_job(&[&a], &[&b], &[], graph.lazy()))?;
//! let mut out = [0u8; 8];
//! vm.read_small(&b, 0, &mut out)?;
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! # Features
//!
//! * `fuzzing`: the [`fuzzing`] module — the two lazy graphs that ivm-std's equivalence
//!   fuzzer launches (`ivm_std::fuzzing::Runner::with_launch_graphs`). Off by default.
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod builder;
mod ctx;
#[cfg(feature = "fuzzing")]
#[cfg_attr(docsrs, doc(cfg(feature = "fuzzing")))]
pub mod fuzzing;
mod runtime;

use std::sync::Arc;

pub(crate) use builder::describe;
pub use builder::{DEFAULT_POLL_WINDOW, GraphBuilder};
pub use ctx::{GraphCtx, KernelIo, Params};
pub use runtime::Graph;

/// A blob of a graph under construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlobId(pub(crate) usize);

/// A kernel of a graph under construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelId(pub(crate) usize);

/// Whether a [`GraphEvent`] marks the start or the end of an actor's firing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The actor started iteration `iteration`.
    Start,
    /// The actor finished it.
    End,
}

/// A trace event of a running graph (see [`GraphBuilder::trace`]). It borrows the
/// actor's name from the graph, so that an event costs the firing nothing but the call
/// (no reference count touched twice per firing); a sink that keeps events copies what
/// it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphEvent<'a> {
    /// The actor: `source-tick`, `wait`, `input/{op}`, `output/{op}`, `callback`,
    /// `callback-notifier`, or a kernel's name.
    pub actor: &'a str,
    /// The iteration (run number of this graph, from 0).
    pub iteration: u64,
    /// Start or end.
    pub phase: Phase,
    /// The iteration failed at or before this actor.
    pub failed: bool,
}

/// A trace sink.
pub(crate) type TraceFn = Arc<dyn Fn(&GraphEvent<'_>) + Send + Sync>;

/// A kernel body.
pub(crate) type KernelBody = Box<dyn FnMut(&mut GraphCtx<'_>) + Send>;
