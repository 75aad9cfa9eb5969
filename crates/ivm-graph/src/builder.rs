//! Building a graph: its blobs, interface ops, parameters and kernels, and the settings
//! of the threads that will run it ([`GraphBuilder`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ivm_std::lazy::{DEFAULT_BUFFER_RUNS, LazyGraph};
use ivm_std::{Error, Result};

use crate::{BlobId, Graph, GraphCtx, GraphEvent, KernelBody, KernelId, TraceFn};

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
    /// one lock, held for a scan). The caller stops after a kernel whose outputs were
    /// copied out, or once its wait is over, and leaves the rest to the graph's thread,
    /// so what follows an output (a backward pass) overlaps what the caller does next.
    /// Kernels run on the caller's thread then, inside its VM call: a kernel that calls
    /// into the VM gets [`Error::Reentrant`]. On a machine the VM counts as quiet the
    /// caller leaves the work to a graph thread that makes progress (it has a CPU, and
    /// runs each run on warm caches). In single-thread mode the caller runs them whenever
    /// the VM's engine has nothing left to do, before it sleeps.
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
        crate::runtime::build(self)
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
