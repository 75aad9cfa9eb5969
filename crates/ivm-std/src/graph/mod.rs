//! A graph runtime for lazy jobs: a compiled graph of kernels over its own blobs, run as
//! actors on several threads, served through a [`LazyGraph`]'s named buffers.
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
//! back. Actors live on at least two threads: the protocol actors (ticks, wait, interface
//! kernels, callbacks) on thread 0, compute kernels spread over the others. A thread runs
//! whatever of its actors is ready and sleeps on a notifier when none is.
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
//! use ivm_std::graph::GraphBuilder;
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
//! vm.sync_read_small_mem(&b, &mut out)?;
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```

mod runtime;
#[cfg(all(test, not(loom)))]
mod tests;

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::lazy::{DEFAULT_BUFFER_RUNS, JobInstance, LazyGraph};

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

/// A trace event of a running graph (see [`GraphBuilder::trace`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphEvent {
    /// The actor: `source-tick`, `wait`, `input/{op}`, `output/{op}`, `callback`,
    /// `callback-notifier`, or a kernel's name.
    pub actor: Arc<str>,
    /// The iteration (run number of this graph, from 0).
    pub iteration: u64,
    /// Start or end.
    pub phase: Phase,
    /// The iteration failed at or before this actor.
    pub failed: bool,
}

/// A trace sink.
pub(crate) type TraceFn = Arc<dyn Fn(&GraphEvent) + Send + Sync>;

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

    /// Runs kernel `k` on thread `thread` (`1..threads`; thread 0 runs the protocol
    /// actors). By default compute kernels are spread round-robin over threads 1.. .
    pub fn on_thread(&mut self, k: KernelId, thread: usize) -> &mut Self {
        if let Some(d) = self.kernels.get_mut(k.0) {
            d.thread = Some(thread);
        }
        self
    }

    /// Number of actor threads (at least 2; default 2).
    pub fn threads(&mut self, n: usize) -> &mut Self {
        self.threads = n.max(2);
        self
    }

    /// Register slots per produced blob: how many iterations a producer may run ahead of
    /// its slowest consumer (at least 1; default 2).
    pub fn pipeline_depth(&mut self, depth: usize) -> &mut Self {
        self.depth = depth.max(1);
        self
    }

    /// How many runs each of the job's buffers holds (see
    /// [`LazyGraphBuilder::buffer_runs`](crate::lazy::LazyGraphBuilder::buffer_runs)).
    pub fn buffer_runs(&mut self, runs: usize) -> &mut Self {
        self.buffer_runs = runs.max(1);
        self
    }

    /// Calls `f` at the start and end of every actor firing (tests, profiling). `f` runs
    /// on the graph's threads and must be quick; a panic in it is ignored.
    pub fn trace(&mut self, f: impl Fn(&GraphEvent) + Send + Sync + 'static) -> &mut Self {
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

/// What a graph kernel sees: its iteration, its input and output blobs' bytes and, for
/// parameter kernels, the run's parameter tensors.
pub struct GraphCtx<'a> {
    pub(crate) kernel: &'a str,
    pub(crate) iteration: u64,
    pub(crate) reads: Vec<&'a [u8]>,
    pub(crate) writes: Vec<&'a mut [u8]>,
    pub(crate) job: Option<&'a JobInstance>,
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
        unsafe { job.param(i).bytes() }
    }

    /// The bytes of parameter `i`, mutably (parameter kernels only; panics otherwise).
    pub fn param_mut(&mut self, i: usize) -> &mut [u8] {
        let job = self.job();
        // SAFETY: as in `param`; `&mut self` allows one parameter slice at a time.
        unsafe { job.param(i).bytes_mut() }
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
    // SAFETY: graph blobs and eager tensors are `Box<[u64]>`, so `b` is 8-byte aligned;
    // `len / 8` whole words lie inside it and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u64>(), b.len() / 8) }
}

fn words_mut(b: &mut [u8]) -> &mut [u64] {
    // SAFETY: as in `words`, and `b` is borrowed mutably for the returned lifetime.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u64>(), b.len() / 8) }
}
