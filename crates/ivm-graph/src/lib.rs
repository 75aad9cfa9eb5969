//! A graph runtime for ivm's lazy jobs: a compiled graph of kernels over its own blobs,
//! run as actors on several threads, served through a [`LazyGraph`]'s named buffers.
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
//! every run not finished by then fails with [`Error::GraphClosed`], so no eager
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

#[cfg(feature = "fuzzing")]
#[cfg_attr(docsrs, doc(cfg(feature = "fuzzing")))]
pub mod fuzzing;
mod runtime;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ivm_std::lazy::{DEFAULT_BUFFER_RUNS, JobInstance, LazyGraph};
use ivm_std::{Error, Result};

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

pub(crate) struct BlobDesc {
    pub(crate) name: String,
    pub(crate) nbytes: usize,
}

pub(crate) struct InterfaceDesc {
    pub(crate) name: String,
    pub(crate) blob: usize,
    pub(crate) valid: bool,
}

pub(crate) struct KernelDesc {
    pub(crate) name: Arc<str>,
    pub(crate) reads: Vec<usize>,
    pub(crate) writes: Vec<usize>,
    pub(crate) params: bool,
    pub(crate) thread: Option<usize>,
    pub(crate) body: KernelBody,
}

/// Builds a [`Graph`]. Kernels are declared in topological order: a kernel may read only
/// blobs written by an earlier kernel or by an input op.
pub struct GraphBuilder {
    pub(crate) job: String,
    pub(crate) blobs: Vec<BlobDesc>,
    pub(crate) inputs: Vec<InterfaceDesc>,
    pub(crate) outputs: Vec<InterfaceDesc>,
    pub(crate) params: Vec<(String, usize)>,
    pub(crate) kernels: Vec<KernelDesc>,
    pub(crate) threads: usize,
    pub(crate) depth: usize,
    pub(crate) buffer_runs: usize,
    pub(crate) poll: Duration,
    pub(crate) on_caller: bool,
    pub(crate) trace: Option<TraceFn>,
}

impl fmt::Debug for GraphBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphBuilder")
            .field("job", &self.job)
            .field("blobs", &self.blobs.len())
            .field("kernels", &self.kernels.len())
            .finish_non_exhaustive()
    }
}

impl GraphBuilder {
    /// An empty graph for the job `job_name` (2 threads, pipeline depth 2).
    pub fn new(job_name: impl Into<String>) -> Self {
        Self {
            job: job_name.into(),
            blobs: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            params: Vec::new(),
            kernels: Vec::new(),
            threads: 2,
            depth: 2,
            buffer_runs: DEFAULT_BUFFER_RUNS,
            poll: DEFAULT_POLL_WINDOW,
            on_caller: false,
            trace: None,
        }
    }

    /// An intermediate blob of `nbytes`.
    pub fn blob(&mut self, name: impl Into<String>, nbytes: usize) -> BlobId {
        self.blobs.push(BlobDesc {
            name: name.into(),
            nbytes,
        });
        BlobId(self.blobs.len() - 1)
    }

    /// A valid input op: a blob of `nbytes` filled from the eager tensor of each run.
    pub fn input(&mut self, name: impl Into<String>, nbytes: usize) -> BlobId {
        self.input_with(name, nbytes, true)
    }

    /// An input op with an explicit valid flag. The blob of an invalid input is never
    /// filled (it stays zero) and its end record is done at once.
    pub fn input_with(&mut self, name: impl Into<String>, nbytes: usize, valid: bool) -> BlobId {
        let name = name.into();
        let b = self.blob(format!("input/{name}"), nbytes);
        self.inputs.push(InterfaceDesc {
            name,
            blob: b.0,
            valid,
        });
        b
    }

    /// A valid output op: `blob` is copied into the eager tensor of each run as soon as it
    /// is produced.
    pub fn output(&mut self, name: impl Into<String>, blob: BlobId) {
        self.output_with(name, blob, true);
    }

    /// An output op with an explicit valid flag (an invalid one is never copied out and
    /// its end record is done at once).
    pub fn output_with(&mut self, name: impl Into<String>, blob: BlobId, valid: bool) {
        self.outputs.push(InterfaceDesc {
            name: name.into(),
            blob: blob.0,
            valid,
        });
    }

    /// A parameter of `nbytes`: an eager tensor passed to every launch, used in place by
    /// [`param_kernel`](Self::param_kernel)s. Returns its index.
    pub fn param(&mut self, name: impl Into<String>, nbytes: usize) -> usize {
        self.params.push((name.into(), nbytes));
        self.params.len() - 1
    }

    /// A kernel reading `reads` and writing `writes` (distinct blobs, not among `reads`),
    /// run once per iteration.
    pub fn kernel(
        &mut self,
        name: impl Into<String>,
        reads: &[BlobId],
        writes: &[BlobId],
        body: impl FnMut(&mut GraphCtx<'_>) + Send + 'static,
    ) -> KernelId {
        self.push_kernel(name.into(), reads, writes, false, Box::new(body))
    }

    /// A kernel that may also read and write the parameters
    /// ([`GraphCtx::param`], [`GraphCtx::param_mut`]). Parameter kernels run in
    /// declaration order within an iteration and iteration after iteration.
    pub fn param_kernel(
        &mut self,
        name: impl Into<String>,
        reads: &[BlobId],
        writes: &[BlobId],
        body: impl FnMut(&mut GraphCtx<'_>) + Send + 'static,
    ) -> KernelId {
        self.push_kernel(name.into(), reads, writes, true, Box::new(body))
    }

    fn push_kernel(
        &mut self,
        name: String,
        reads: &[BlobId],
        writes: &[BlobId],
        params: bool,
        body: KernelBody,
    ) -> KernelId {
        self.kernels.push(KernelDesc {
            name: name.into(),
            reads: reads.iter().map(|b| b.0).collect(),
            writes: writes.iter().map(|b| b.0).collect(),
            params,
            thread: None,
            body,
        });
        KernelId(self.kernels.len() - 1)
    }

    /// Runs kernel `k` on thread `thread`: `1..threads` (thread 0 runs the protocol
    /// actors), or 0 in a one-thread graph. By default compute kernels are spread
    /// round-robin over threads 1.. (all on thread 0 in a one-thread graph).
    pub fn on_thread(&mut self, k: KernelId, thread: usize) -> &mut Self {
        if let Some(d) = self.kernels.get_mut(k.0) {
            d.thread = Some(thread);
        }
        self
    }

    /// Number of actor threads (at least 1; default 2). With one, the protocol actors
    /// and every kernel share it: no hand-over inside the graph, the right choice for a
    /// chain of short kernels on a machine with few cores. With more, the protocol actors
    /// run on thread 0 and the kernels on the others, so a run's interface copies overlap
    /// another run's kernels.
    pub fn threads(&mut self, n: usize) -> &mut Self {
        self.threads = n.max(1);
        self
    }

    /// How long a graph thread with nothing ready keeps looking (spinning briefly, then
    /// yielding its CPU) before it sleeps until an actor is notified (default
    /// [`DEFAULT_POLL_WINDOW`]; zero: sleep at once). A thread that sleeps between runs
    /// costs every run a wake-up (tens of microseconds on a small VM); one that polls
    /// between runs that come faster than the window never sleeps.
    pub fn poll_window(&mut self, window: Duration) -> &mut Self {
        self.poll = window;
        self
    }

    /// Whether a VM caller that waits for the VM while runs of this graph are in flight
    /// runs the graph's ready actors itself (default `false`): every actor, protocol and
    /// kernels, of any graph thread it finds not scanning
    /// ([`LazyGraph::set_caller_helper`](ivm_std::lazy::LazyGraph::set_caller_helper)).
    /// For graphs of short kernels on few cores: a run then costs no hand-over to the
    /// graph's thread while the caller would only wait. An actor still fires once per
    /// iteration and never on two threads at once (each graph thread's actors are behind
    /// one lock, held for a scan). Kernels run on the caller's thread then, inside its VM
    /// call: a kernel that calls into the VM gets [`Error::Reentrant`]. In single-thread
    /// mode the caller drives the VM's engine instead and leaves the graph to its threads.
    pub fn run_on_caller(&mut self, on: bool) -> &mut Self {
        self.on_caller = on;
        self
    }

    /// Register slots per produced blob: how many iterations a producer may run ahead of
    /// its slowest consumer (at least 1; default 2).
    pub fn pipeline_depth(&mut self, depth: usize) -> &mut Self {
        self.depth = depth.max(1);
        self
    }

    /// How many runs each of the job's buffers holds (see
    /// [`LazyGraphBuilder::buffer_runs`](ivm_std::lazy::LazyGraphBuilder::buffer_runs)).
    pub fn buffer_runs(&mut self, runs: usize) -> &mut Self {
        self.buffer_runs = runs.max(1);
        self
    }

    /// Calls `f` at the start and end of every actor firing (tests, profiling). `f` runs
    /// on the graph's threads and must be quick; a panic in it is ignored.
    pub fn trace(&mut self, f: impl Fn(&GraphEvent<'_>) + Send + Sync + 'static) -> &mut Self {
        self.trace = Some(Arc::new(f));
        self
    }

    /// Checks the graph, creates its [`LazyGraph`] and buffers, and starts its threads.
    ///
    /// # Errors
    /// [`Error::DuplicateInterfaceName`]; [`Error::InvalidGraph`] for an unknown blob, a
    /// blob written twice (or an input blob written by a kernel), a kernel that reads a
    /// blob no earlier kernel or input writes, a kernel writing a blob it reads or the
    /// same blob twice, a kernel on a thread that does not exist; [`Error::Spawn`].
    pub fn build(self) -> Result<Graph> {
        runtime::build(self)
    }

    pub(crate) fn invalid(&self, message: String) -> Error {
        Error::InvalidGraph {
            job: self.job.clone(),
            message,
        }
    }
}

/// How long a graph thread polls before it sleeps, by default (see
/// [`GraphBuilder::poll_window`]): the same order as the VM workers' poll window.
pub const DEFAULT_POLL_WINDOW: Duration = Duration::from_micros(100);

/// What a graph kernel sees: its iteration, its input and output blobs' bytes and, for
/// parameter kernels, the run's parameter tensors.
///
/// The accessors lend one operand at a time; [`io`](Self::io) lends all of them at once
/// (no copies: a kernel reads its inputs and parameters and writes its outputs in place).
pub struct GraphCtx<'a> {
    pub(crate) kernel: &'a str,
    pub(crate) iteration: u64,
    pub(crate) reads: &'a [&'a [u8]],
    pub(crate) writes: &'a mut [&'a mut [u8]],
    pub(crate) job: Option<&'a JobInstance>,
}

/// Every operand of a graph kernel at once (see [`GraphCtx::io`]).
#[derive(Debug)]
pub struct KernelIo<'c, 'a> {
    /// The bytes of each read blob, in declaration order.
    pub inputs: &'c [&'a [u8]],
    /// The bytes of each written blob, in declaration order.
    pub outputs: &'c mut [&'a mut [u8]],
    /// The run's parameters, read-only, except the one in `param_mut`.
    pub params: Params<'c>,
    /// The parameter lent mutably, if one was asked for.
    pub param_mut: Option<&'c mut [u8]>,
}

/// Read-only access to the parameters of a run, inside a parameter kernel (see
/// [`GraphCtx::io`]).
#[derive(Debug, Clone, Copy)]
pub struct Params<'c> {
    kernel: &'c str,
    job: Option<&'c JobInstance>,
    /// The parameter lent mutably (not readable here).
    except: Option<usize>,
}

impl<'c> Params<'c> {
    /// Number of parameters (0 outside parameter kernels).
    pub fn len(&self) -> usize {
        self.job.map_or(0, JobInstance::num_params)
    }

    /// Whether there are none (always outside parameter kernels).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of parameter `i`.
    ///
    /// # Panics
    /// Outside a parameter kernel, for an index out of range, and for the parameter lent
    /// mutably in the same [`KernelIo`] (a panic fails the iteration).
    pub fn get(&self, i: usize) -> &'c [u8] {
        let job = self.job.unwrap_or_else(|| {
            panic!(
                "graph kernel `{}` uses parameters: declare it with param_kernel",
                self.kernel
            )
        });
        assert!(
            self.except != Some(i),
            "graph kernel `{}`: parameter {i} is lent mutably (use `param_mut`)",
            self.kernel
        );
        // SAFETY: as in `GraphCtx::param` (parameter kernels run one at a time while the
        // launch instruction holds every parameter); the only mutable slice of a
        // parameter lent out with this view is `except`'s, which this refuses, and the
        // view does not outlive the kernel call (`'c` is a borrow of its `GraphCtx`).
        unsafe { job.param(i) }
    }
}

impl fmt::Debug for GraphCtx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphCtx")
            .field("kernel", &self.kernel)
            .field("iteration", &self.iteration)
            .finish_non_exhaustive()
    }
}

impl<'a> GraphCtx<'a> {
    /// The kernel's name.
    pub fn kernel_name(&self) -> &str {
        self.kernel
    }

    /// The iteration (the graph's run number, from 0).
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Number of blobs read.
    pub fn num_inputs(&self) -> usize {
        self.reads.len()
    }

    /// Number of blobs written.
    pub fn num_outputs(&self) -> usize {
        self.writes.len()
    }

    /// The bytes of read blob `i` (panics if out of range: the iteration fails).
    pub fn input(&self, i: usize) -> &[u8] {
        self.reads[i]
    }

    /// The bytes of written blob `i` (panics if out of range: the iteration fails).
    pub fn output(&mut self, i: usize) -> &mut [u8] {
        self.writes[i]
    }

    /// Read blob `i` as `u64`s (blobs are 8-byte aligned; a trailing partial word is left
    /// out).
    pub fn input_u64(&self, i: usize) -> &[u64] {
        words(self.reads[i])
    }

    /// Written blob `i` as `u64`s.
    pub fn output_u64(&mut self, i: usize) -> &mut [u64] {
        words_mut(self.writes[i])
    }

    /// Every operand at once: the inputs and outputs, read-only access to the
    /// parameters, and parameter `param_mut` (if any) mutably. Parameters need a
    /// parameter kernel.
    ///
    /// # Panics
    /// A `param_mut` outside a parameter kernel or out of range (a panic fails the
    /// iteration).
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_graph::GraphBuilder;
    ///
    /// let mut g = GraphBuilder::new("axpy");
    /// let x = g.input("x", 16);
    /// let y = g.blob("y", 16);
    /// let w = g.param("w", 16);
    /// // y = w * x, then w += y: every operand borrowed at once, nothing copied.
    /// g.param_kernel("axpy", &[x], &[y], move |ctx| {
    ///     let mut io = ctx.io(Some(w));
    ///     let w = io.param_mut.take().expect("asked for it");
    ///     for i in 0..16 {
    ///         io.outputs[0][i] = w[i].wrapping_mul(io.inputs[0][i]);
    ///         w[i] = w[i].wrapping_add(io.outputs[0][i]);
    ///     }
    /// });
    /// # let _ = g;
    /// ```
    pub fn io(&mut self, param_mut: Option<usize>) -> KernelIo<'_, 'a> {
        let mutable = param_mut.map(|i| {
            let job = self.job();
            assert!(
                i < job.num_params(),
                "graph kernel `{}`: no parameter {i}",
                self.kernel
            );
            // SAFETY: as in `param_mut`; `Params` refuses to lend this parameter, so this
            // is its only slice while the `KernelIo` lives (it borrows `self` mutably).
            unsafe { job.param_mut(i) }
        });
        KernelIo {
            inputs: self.reads,
            outputs: &mut *self.writes,
            params: Params {
                kernel: self.kernel,
                job: self.job,
                except: param_mut,
            },
            param_mut: mutable,
        }
    }

    fn job(&self) -> &'a JobInstance {
        self.job.unwrap_or_else(|| {
            panic!(
                "graph kernel `{}` uses parameters: declare it with param_kernel",
                self.kernel
            )
        })
    }

    /// Number of parameter tensors of this run (0 outside parameter kernels).
    pub fn num_params(&self) -> usize {
        self.job.map_or(0, JobInstance::num_params)
    }

    /// The bytes of parameter `i` (parameter kernels only; panics otherwise).
    pub fn param(&self, i: usize) -> &[u8] {
        let job = self.job();
        // SAFETY: parameter kernels run one at a time, in one global order (the graph's
        // parameter turn), while the run's launch instruction — which writes every
        // parameter — is neither done nor released, so no eager body and no other
        // parameter kernel accesses the tensor meanwhile; runs of other graphs wait for
        // this graph's queue to drain. The slice does not outlive the kernel call.
        unsafe { job.param(i) }
    }

    /// The bytes of parameter `i`, mutably (parameter kernels only; panics otherwise).
    pub fn param_mut(&mut self, i: usize) -> &mut [u8] {
        let job = self.job();
        // SAFETY: as in `param`; `&mut self` allows one parameter slice at a time.
        unsafe { job.param_mut(i) }
    }

    /// Parameter `i` as `u64`s.
    pub fn param_u64(&self, i: usize) -> &[u64] {
        words(self.param(i))
    }

    /// Parameter `i` as `u64`s, mutably.
    pub fn param_u64_mut(&mut self, i: usize) -> &mut [u64] {
        words_mut(self.param_mut(i))
    }
}

/// The [`LazyGraph`] description of a builder's interface (used by `runtime::build`).
pub(crate) fn describe(b: &GraphBuilder) -> Result<LazyGraph> {
    let mut l = LazyGraph::builder(b.job.clone()).buffer_runs(b.buffer_runs);
    for i in &b.inputs {
        let n = b.blobs.get(i.blob).map_or(0, |d| d.nbytes);
        l = l.input_with(i.name.clone(), n, i.valid);
    }
    for o in &b.outputs {
        let n = b
            .blobs
            .get(o.blob)
            .ok_or_else(|| b.invalid(format!("output `{}`: unknown blob", o.name)))?
            .nbytes;
        l = l.output_with(o.name.clone(), n, o.valid);
    }
    for (name, n) in &b.params {
        l = l.param(name.clone(), *n);
    }
    l.build()
}

fn words(b: &[u8]) -> &[u64] {
    // SAFETY: graph blobs and eager tensors are host memory at least 8-byte aligned (both
    // `ivm_std::HostMemory`, or an eager tensor under the `DeviceMemory` contract), so `b`
    // is; `len / 8` whole words lie inside it and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u64>(), b.len() / 8) }
}

fn words_mut(b: &mut [u8]) -> &mut [u64] {
    // SAFETY: as in `words`, and `b` is borrowed mutably for the returned lifetime.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u64>(), b.len() / 8) }
}
