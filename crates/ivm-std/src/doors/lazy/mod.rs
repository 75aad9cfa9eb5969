//! Lazy jobs: compiled graphs run by a graph runtime, launched from the eager VM through
//! critical sections (ARCHITECTURE.md, "Lazy jobs and critical sections").
//!
//! A [`LazyGraph`] describes a job to the VM: its name, its input and output interface
//! ops (name, size of the graph blob, valid flag), its parameters, and the named buffers
//! through which the VM hands each run to the graph runtime:
//!
//! | buffer | pushed by | popped by |
//! |---|---|---|
//! | `{job}/input/{op}`, one per valid input op | input critical-section begin | the op's input kernel |
//! | `{job}/output/{op}`, one per valid output op | output critical-section begin | the op's output kernel |
//! | `{job}/wait` | both begins (input, then output) | the wait kernel |
//! | `{job}/callback` | both begins | the callback kernel (`finish`) |
//! | `{job}/source-tick` | launch lazy job | the source tick (starts an iteration) |
//! | `{job}/callback-notifier` | launch lazy job | the callback notifier (finishes the launch) |
//!
//! The crate `ivm-graph` is a graph runtime that serves these buffers (through this public
//! protocol only);
//! [`InstructionsBuilder::launch_lazy_job`](crate::InstructionsBuilder::launch_lazy_job)
//! emits the instructions of one run.

mod bodies;
mod buffer;
mod instance;
pub(crate) mod launch;
mod launcher_queue;
mod record;
pub(crate) mod vm_lazy;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

pub use buffer::{Buffer, BufferClosed, TryPop};
pub use instance::{CriticalSectionInstance, CsKind, JobInstance};
pub use record::{AlreadyInitialised, EndEvent, RecordResult, SharedEventRecord};

/// Marks the calling thread as one of a graph runtime's threads, for the rest of its life:
/// when it completes a critical section or a run (initialises a record, finishes a
/// critical-section or job instance) and nobody drives the VM's engine, it drives the
/// engine itself, right there, instead of waking the VM's scheduler thread — which would
/// cost every completion a thread wake-up. Call it first thing on each thread of a graph
/// runtime; never on a thread that holds a lock a VM kernel may need, since driving may
/// run the VM's own short steps (never user kernels) on it.
///
/// A graph runtime that does not call it is served the same, a wake-up later.
pub fn mark_graph_thread() {
    crate::engine::drive::mark_graph_thread();
    // Not a busy neighbour of the VMs it serves (`engine/neighbours.rs`).
    crate::engine::neighbours::note_serving_thread();
}

/// Whether the VM caller running a graph's caller helper (on this thread, inside the
/// helper: [`LazyGraph::set_caller_helper_until`]) counts the VM's threads as short of
/// CPUs now: a busy neighbour leaves them fewer CPUs than they would use, or a caller
/// bound to one CPU shares it with workers (ARCHITECTURE.md, "When another thread takes a
/// core"). A graph runtime may then have its threads hand their ready work to the helping
/// caller rather than run it while they wait for a CPU. `false` outside a helper.
///
/// # Examples
///
/// ```
/// // Outside a caller helper (here: no VM call at all), never crowded.
/// assert!(!ivm_std::lazy::helping_caller_crowded());
/// ```
pub fn helping_caller_crowded() -> bool {
    HELPING_CROWDED.with(std::cell::Cell::get)
}

thread_local! {
    /// [`helping_caller_crowded`]'s answer, set around the helpers' calls
    /// (`doors/sync_access.rs`, `graph_help`).
    pub(crate) static HELPING_CROWDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) use instance::CsOp;

use ivm_core::sync::{AtomicUsize, Ordering};

use crate::util::error::{Error, Result};

/// Default capacity of a job's buffers, in runs.
pub const DEFAULT_BUFFER_RUNS: usize = 2;

/// One interface op of a lazy graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// The op name (unique among the graph's inputs, and among its outputs).
    pub name: String,
    /// Bytes of the graph blob behind it; the eager tensor must have as many.
    pub nbytes: usize,
    /// Whether the graph reads (input) or writes (output) it at all. An invalid interface
    /// gets no buffer and its end record is done at once.
    pub valid: bool,
}

/// A parameter of a lazy graph: an eager tensor the graph's kernels use in place (the
/// launch instruction writes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// The parameter name (unique).
    pub name: String,
    /// Bytes the graph expects.
    pub nbytes: usize,
}

type CsBuffer = Buffer<Arc<CriticalSectionInstance>>;
type JobBuffer = Buffer<Arc<JobInstance>>;

/// The named buffers of one job (see the [module docs](self)).
pub struct JobBuffers {
    /// `{job}/wait`: both critical sections of every run.
    pub wait: CsBuffer,
    /// `{job}/callback`: both critical sections of every run.
    pub callback: CsBuffer,
    /// `{job}/input/{op}` per input op, `None` for an invalid one.
    pub inputs: Vec<Option<CsBuffer>>,
    /// `{job}/output/{op}` per output op, `None` for an invalid one.
    pub outputs: Vec<Option<CsBuffer>>,
    /// `{job}/source-tick`: one job instance per run.
    pub source_tick: JobBuffer,
    /// `{job}/callback-notifier`: one job instance per run.
    pub callback_notifier: JobBuffer,
}

impl fmt::Debug for JobBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl JobBuffers {
    fn cs_buffers(&self) -> impl Iterator<Item = &CsBuffer> {
        [&self.wait, &self.callback]
            .into_iter()
            .chain(self.inputs.iter().flatten())
            .chain(self.outputs.iter().flatten())
    }

    fn job_buffers(&self) -> impl Iterator<Item = &JobBuffer> {
        [&self.source_tick, &self.callback_notifier].into_iter()
    }

    /// Every buffer name.
    pub fn names(&self) -> Vec<&str> {
        self.cs_buffers()
            .map(Buffer::name)
            .chain(self.job_buffers().map(Buffer::name))
            .collect()
    }

    /// Every buffer's name and how many records it holds now (a snapshot, for a graph
    /// runtime's [state probe](LazyGraph::set_state_probe)).
    pub fn occupancy(&self) -> Vec<(&str, usize)> {
        self.cs_buffers()
            .map(|b| (b.name(), b.len()))
            .chain(self.job_buffers().map(|b| (b.name(), b.len())))
            .collect()
    }

    /// Closes every buffer and fails what was left inside with [`Error::GraphClosed`].
    pub fn close(&self) {
        for b in self.cs_buffers() {
            drop(b.close());
        }
        for b in self.job_buffers() {
            drop(b.close());
        }
    }

    /// Whether the buffers were closed.
    pub fn is_closed(&self) -> bool {
        self.source_tick.is_closed()
    }
}

/// Process-unique graph ids (the launcher tells graphs apart by id). Not part of any
/// synchronisation protocol: a plain std atomic, used with Relaxed.
static NEXT_GRAPH_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

pub(crate) struct LazyInner {
    pub(crate) id: usize,
    /// Id of the VM that launches this graph (0: none yet). A graph serves one VM: the
    /// order of its runs is the order of that VM's launcher.
    pub(crate) vm: AtomicUsize,
    pub(crate) job: Arc<str>,
    pub(crate) inputs: Vec<Interface>,
    pub(crate) outputs: Vec<Interface>,
    pub(crate) params: Vec<Param>,
    pub(crate) buffers: JobBuffers,
    /// The graph runtime's offer to run on a waiting caller ([`LazyGraph::set_caller_helper`]).
    /// Set once: by the runtime (`Some`), or sealed by the first launch (`None` when the
    /// runtime had not offered one), so that an offer racing the first launch is either
    /// seen by it or refused, never lost.
    pub(crate) helper: std::sync::OnceLock<Option<CallerHelper>>,
    /// The graph runtime's progress count ([`LazyGraph::set_progress_probe`]); set and
    /// sealed like `helper`.
    pub(crate) progress: std::sync::OnceLock<Option<ProgressProbe>>,
    /// The graph runtime's account of its state for timeout diagnostics
    /// ([`LazyGraph::set_state_probe`]); set and sealed like `helper`.
    pub(crate) state: std::sync::OnceLock<Option<StateProbe>>,
}

/// A graph runtime's offer to make progress on a thread of the VM's caller: runs what of
/// the graph is ready until the caller's wait is over (its argument turns `true`),
/// returns whether anything ran.
pub type CallerHelper = Arc<dyn Fn(&dyn Fn() -> bool) -> bool + Send + Sync>;

/// A graph runtime's progress count: any number that grows while the graph does work
/// (kernels fired, say) and stays put while it waits.
pub type ProgressProbe = Arc<dyn Fn() -> u64 + Send + Sync>;

/// A graph runtime's account of what its threads are doing, for a timeout's diagnostic
/// ([`LazyGraph::set_state_probe`]).
pub type StateProbe = Arc<dyn Fn() -> String + Send + Sync>;

/// The description of a lazy job that the VM launches: job name, interface ops, parameters
/// and the job's named buffers. Cheap to clone (shared). Build one with
/// [`LazyGraph::builder`], or get the one of a graph runtime's graph (`ivm_graph::Graph::lazy`).
///
/// # Examples
///
/// ```
/// use ivm_std::lazy::LazyGraph;
///
/// let g = LazyGraph::builder("train_step")
///     .input("x", 16)
///     .output("loss", 8)
///     .param("w", 16)
///     .build()?;
/// assert_eq!(g.job_name(), "train_step");
/// assert!(g.buffers().names().contains(&"train_step/input/x"));
/// assert!(LazyGraph::builder("bad").input("x", 8).input("x", 8).build().is_err());
/// # Ok::<(), ivm_std::Error>(())
/// ```
#[derive(Clone)]
pub struct LazyGraph {
    pub(crate) inner: Arc<LazyInner>,
}

impl fmt::Debug for LazyGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LazyGraph")
            .field("job", &self.inner.job)
            .field("inputs", &self.inner.inputs)
            .field("outputs", &self.inner.outputs)
            .field("params", &self.inner.params)
            .finish()
    }
}

impl PartialEq for LazyGraph {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
impl Eq for LazyGraph {}

impl LazyGraph {
    /// Starts describing the job `job_name`.
    pub fn builder(job_name: impl Into<String>) -> LazyGraphBuilder {
        LazyGraphBuilder {
            job: job_name.into(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            params: Vec::new(),
            runs: DEFAULT_BUFFER_RUNS,
        }
    }

    /// A process-unique id of this graph.
    pub fn id(&self) -> usize {
        self.inner.id
    }

    /// The job name.
    pub fn job_name(&self) -> &str {
        &self.inner.job
    }

    /// The input interface ops, in order.
    pub fn inputs(&self) -> &[Interface] {
        &self.inner.inputs
    }

    /// The output interface ops, in order.
    pub fn outputs(&self) -> &[Interface] {
        &self.inner.outputs
    }

    /// The parameters, in order.
    pub fn params(&self) -> &[Param] {
        &self.inner.params
    }

    /// The job's named buffers.
    pub fn buffers(&self) -> &JobBuffers {
        &self.inner.buffers
    }

    /// Offers the VM a way to run this graph's work on its caller's thread: a caller that
    /// is about to wait for the VM in multi-thread mode (a sync read or write, a callback,
    /// `sync`) calls `helper` while it spins, before it sleeps, until the wait is over; a
    /// helper with nothing to do returns `false` at once. On a machine the VM counts as
    /// quiet (no busy thread beside its own at its last looks) the caller spins without
    /// calling it while the graph's progress probe moves, and calls it after 50 µs
    /// without progress or before it sleeps. For graphs of short
    /// kernels on few cores, where handing each run to the graph's thread costs more than
    /// the run (ivm-graph's `GraphBuilder::run_on_caller`).
    ///
    /// `helper` runs inside the VM call: a call into the same VM from it is refused with
    /// [`Error::Reentrant`], and it must not block on anything the VM's caller holds. It
    /// may complete critical sections and runs (the caller then drives the engine for
    /// them). Set once, before the first launch; returns `false` (and drops `helper`)
    /// when a helper was set before or the graph was launched already. An offer racing the
    /// first launch is either registered by it (`true`) or refused (`false`), never lost.
    pub fn set_caller_helper(&self, helper: impl Fn() -> bool + Send + Sync + 'static) -> bool {
        self.set_caller_helper_until(move |_| helper())
    }

    /// Like [`set_caller_helper`](Self::set_caller_helper), for a helper that can stop
    /// early: `helper(wait_over)` checks `wait_over()` between units of its work (an actor
    /// firing, say) and returns soon after it turns `true`, leaving the rest to the
    /// graph's own threads (waking them if it leaves ready work behind). The caller then
    /// returns from its wait at once, and what the graph does next overlaps whatever the
    /// caller does next, as it would if no caller had helped.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use ivm_std::lazy::LazyGraph;
    ///
    /// let g = LazyGraph::builder("step").output("loss", 4).build()?;
    /// let ready = Arc::new(AtomicUsize::new(0)); // the runtime's ready actors
    /// let r = ready.clone();
    /// assert!(g.set_caller_helper_until(move |wait_over| {
    ///     let mut ran = false;
    ///     // One actor at a time, looking at `wait_over` between firings.
    ///     while !wait_over() && r.load(Ordering::Relaxed) > 0 {
    ///         r.fetch_sub(1, Ordering::Relaxed); // fire it
    ///         ran = true;
    ///     }
    ///     ran
    /// }));
    /// assert!(!g.set_caller_helper(|| false)); // set once
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn set_caller_helper_until(
        &self,
        helper: impl Fn(&dyn Fn() -> bool) -> bool + Send + Sync + 'static,
    ) -> bool {
        // Relaxed: a check that the VM has not bound (and so registered) the graph yet.
        if self.inner.vm.load(Ordering::Relaxed) != 0 {
            return false;
        }
        self.inner.helper.set(Some(Arc::new(helper))).is_ok()
    }

    /// Tells the VM how to see this graph's progress: `probe` returns a count that grows
    /// while the graph does work (ivm-graph counts its actors' firings) and stays put
    /// while it waits. A caller waiting for the VM spins while instructions keep finishing
    /// and sleeps once none has for a while (ARCHITECTURE.md, "Who may drive the
    /// engine"); while a graph computes, no instruction finishes until its output
    /// critical section ends, so without a probe a caller waiting for a graph's output
    /// sleeps through the graph's forward pass and pays a wake-up at its end. With one,
    /// it keeps spinning (yielding its CPU) while the count moves, within the wait's
    /// overall spin limit (1 ms). The VM calls `probe` once when a wait starts spinning,
    /// then when the caller would otherwise sleep, at most every 200 µs of a wait; and,
    /// where the graph also offers a caller helper on a machine the VM counts as quiet, at
    /// most every 5 µs of a caller's spin, to see whether it may leave the graph to its
    /// threads ([`set_caller_helper`](Self::set_caller_helper)). From any thread; it must be
    /// cheap and must not block or call into the VM.
    ///
    /// Set once, before the first launch; returns `false` (and drops `probe`) when one
    /// was set before or the graph was launched already, like
    /// [`set_caller_helper`](Self::set_caller_helper).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use ivm_std::lazy::LazyGraph;
    ///
    /// let g = LazyGraph::builder("step").output("loss", 4).build()?;
    /// let fired = Arc::new(AtomicU64::new(0)); // the runtime bumps it per kernel
    /// let count = fired.clone();
    /// assert!(g.set_progress_probe(move || count.load(Ordering::Relaxed)));
    /// assert!(!g.set_progress_probe(|| 0)); // set once
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn set_progress_probe(&self, probe: impl Fn() -> u64 + Send + Sync + 'static) -> bool {
        // Relaxed: as in `set_caller_helper`.
        if self.inner.vm.load(Ordering::Relaxed) != 0 {
            return false;
        }
        self.inner.progress.set(Some(Arc::new(probe))).is_ok()
    }

    /// Tells the VM how to describe this graph's state when a wait times out: `probe`
    /// returns a short text (its threads, what each waits for, its actors' progress),
    /// which [`Diagnostic::graphs`](crate::Diagnostic::graphs) carries with the job's
    /// name. A lazy job's launch that never finishes shows in a diagnostic as one lively
    /// instruction; what the graph was doing is the runtime's to say. The VM calls
    /// `probe` only while it builds a diagnostic, on the thread whose wait timed out,
    /// under a catch (a panic is reported in its line); it must not block, and a call
    /// into the VM from it fails with [`Error::Reentrant`]. Capture the graph's state
    /// weakly: the VM keeps `probe` while it lives, so a strong reference to the graph
    /// (or to the VM) in it keeps that alive. Like the other offers, a VM keeps those of
    /// eight live graphs at most.
    ///
    /// Set once, before the first launch; returns `false` (and drops `probe`) when one
    /// was set before or the graph was launched already, like
    /// [`set_caller_helper`](Self::set_caller_helper).
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_std::lazy::LazyGraph;
    ///
    /// let g = LazyGraph::builder("step").output("loss", 4).build()?;
    /// assert!(g.set_state_probe(|| "thread 0: idle".to_string()));
    /// assert!(!g.set_state_probe(String::new)); // set once
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn set_state_probe(&self, probe: impl Fn() -> String + Send + Sync + 'static) -> bool {
        // Relaxed: as in `set_caller_helper`.
        if self.inner.vm.load(Ordering::Relaxed) != 0 {
            return false;
        }
        self.inner.state.set(Some(Arc::new(probe))).is_ok()
    }

    /// Closes the job's buffers (graph runtime shutdown): later runs fail with
    /// [`Error::GraphClosed`] instead of waiting.
    pub fn close(&self) {
        self.inner.buffers.close();
    }

    /// Binds the graph to VM `vm` on its first launch; returns whether this was the first
    /// (the caller then registers the graph's helper and progress probe, if any).
    ///
    /// # Errors
    /// [`Error::InvalidGraph`] if another VM launched it before.
    pub(crate) fn bind(&self, vm: usize) -> Result<bool> {
        // Relaxed: an identity check; nothing is published through it.
        match self
            .inner
            .vm
            .compare_exchange(0, vm, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => Ok(true),
            Err(v) if v == vm => Ok(false),
            Err(_) => Err(Error::InvalidGraph {
                job: self.inner.job.to_string(),
                message: "the graph is launched by another virtual machine (a graph serves one)"
                    .into(),
            }),
        }
    }
}

/// Builds a [`LazyGraph`].
#[derive(Debug, Clone)]
pub struct LazyGraphBuilder {
    job: String,
    inputs: Vec<Interface>,
    outputs: Vec<Interface>,
    params: Vec<Param>,
    runs: usize,
}

impl LazyGraphBuilder {
    /// A valid input op whose graph blob holds `nbytes`.
    pub fn input(self, name: impl Into<String>, nbytes: usize) -> Self {
        self.input_with(name, nbytes, true)
    }

    /// An input op with an explicit valid flag.
    pub fn input_with(mut self, name: impl Into<String>, nbytes: usize, valid: bool) -> Self {
        self.inputs.push(Interface {
            name: name.into(),
            nbytes,
            valid,
        });
        self
    }

    /// A valid output op whose graph blob holds `nbytes`.
    pub fn output(self, name: impl Into<String>, nbytes: usize) -> Self {
        self.output_with(name, nbytes, true)
    }

    /// An output op with an explicit valid flag.
    pub fn output_with(mut self, name: impl Into<String>, nbytes: usize, valid: bool) -> Self {
        self.outputs.push(Interface {
            name: name.into(),
            nbytes,
            valid,
        });
        self
    }

    /// A parameter of `nbytes`.
    pub fn param(mut self, name: impl Into<String>, nbytes: usize) -> Self {
        self.params.push(Param {
            name: name.into(),
            nbytes,
        });
        self
    }

    /// How many runs each buffer holds before a push blocks (default
    /// [`DEFAULT_BUFFER_RUNS`], at least 1).
    pub fn buffer_runs(mut self, runs: usize) -> Self {
        self.runs = runs.max(1);
        self
    }

    /// Checks the description and creates the buffers.
    ///
    /// # Errors
    /// [`Error::DuplicateInterfaceName`] when an op name appears twice among the inputs,
    /// among the outputs, or a parameter name twice.
    pub fn build(self) -> Result<LazyGraph> {
        let dup = |names: &mut dyn Iterator<Item = &String>| -> Result<()> {
            let mut seen = HashSet::new();
            for n in names {
                if !seen.insert(n.as_str()) {
                    return Err(Error::DuplicateInterfaceName {
                        job: self.job.clone(),
                        name: n.clone(),
                    });
                }
            }
            Ok(())
        };
        dup(&mut self.inputs.iter().map(|i| &i.name))?;
        dup(&mut self.outputs.iter().map(|i| &i.name))?;
        dup(&mut self.params.iter().map(|p| &p.name))?;
        let job = &self.job;
        let runs = self.runs;
        let cs = |kind: &str, ops: &[Interface]| -> Vec<Option<CsBuffer>> {
            ops.iter()
                .map(|o| {
                    o.valid
                        .then(|| Buffer::new(format!("{job}/{kind}/{}", o.name), runs))
                })
                .collect()
        };
        let buffers = JobBuffers {
            wait: Buffer::new(format!("{job}/wait"), 2 * runs),
            callback: Buffer::new(format!("{job}/callback"), 2 * runs),
            inputs: cs("input", &self.inputs),
            outputs: cs("output", &self.outputs),
            source_tick: Buffer::new(format!("{job}/source-tick"), runs),
            callback_notifier: Buffer::new(format!("{job}/callback-notifier"), runs),
        };
        Ok(LazyGraph {
            inner: Arc::new(LazyInner {
                id: NEXT_GRAPH_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                vm: AtomicUsize::new(0),
                job: self.job.into(),
                inputs: self.inputs,
                outputs: self.outputs,
                params: self.params,
                buffers,
                helper: std::sync::OnceLock::new(),
                progress: std::sync::OnceLock::new(),
                state: std::sync::OnceLock::new(),
            }),
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn duplicate_names_are_errors() {
        for b in [
            LazyGraph::builder("j").input("a", 1).input("a", 2),
            LazyGraph::builder("j")
                .output("o", 1)
                .output_with("o", 1, false),
            LazyGraph::builder("j").param("w", 1).param("w", 1),
        ] {
            match b.build() {
                Err(Error::DuplicateInterfaceName { job, name }) => {
                    assert_eq!(job, "j");
                    assert!(name == "a" || name == "o" || name == "w");
                }
                other => panic!("expected DuplicateInterfaceName, got {other:?}"),
            }
        }
        // The same name as an input and an output is fine (different buffers).
        LazyGraph::builder("j")
            .input("a", 1)
            .output("a", 1)
            .build()
            .unwrap();
    }

    #[test]
    fn buffers_are_named_per_valid_interface() {
        let g = LazyGraph::builder("job")
            .input("x", 8)
            .input_with("unused", 8, false)
            .output("y", 8)
            .buffer_runs(3)
            .build()
            .unwrap();
        let names = g.buffers().names();
        assert_eq!(
            names,
            [
                "job/wait",
                "job/callback",
                "job/input/x",
                "job/output/y",
                "job/source-tick",
                "job/callback-notifier"
            ]
        );
        assert!(g.buffers().inputs[1].is_none());
        assert_eq!(g.buffers().source_tick.capacity(), 3);
        assert_eq!(g.buffers().wait.capacity(), 6);
        assert!(!g.buffers().is_closed());
        g.close();
        assert!(g.buffers().is_closed());
        let g2 = g.clone();
        assert_eq!(g, g2);
        assert_ne!(g.id(), LazyGraph::builder("job").build().unwrap().id());
    }

    /// One run of a graph that only its caller helper runs (no thread of its own): y =
    /// x * w, then w += 1, advanced as far as its buffers allow at each call (`try_pop`).
    #[derive(Default)]
    struct HelperRun {
        job: Option<Arc<JobInstance>>,
        x: Option<u64>,
        held: Vec<Arc<CriticalSectionInstance>>,
        waits: usize,
        computed: bool,
        callbacks: usize,
    }

    impl HelperRun {
        /// Advances the run; whether anything moved.
        fn advance(&mut self, b: &JobBuffers) -> bool {
            let mut moved = false;
            loop {
                let step = if self.job.is_none() {
                    b.source_tick.try_pop().item().map(|j| self.job = Some(j))
                } else if self.x.is_none() {
                    let input = b.inputs[0].as_ref().expect("an input");
                    input.try_pop().item().map(|cs| {
                        let mut x = [0u8; 8];
                        cs.copy_input(0, &mut x).unwrap();
                        self.x = Some(u64::from_ne_bytes(x));
                        self.held.push(cs);
                    })
                } else if self.waits < 2 {
                    b.wait.try_pop().item().map(|cs| {
                        self.waits += 1;
                        self.held.push(cs);
                    })
                } else if !self.computed {
                    let output = b.outputs[0].as_ref().expect("an output");
                    output.try_pop().item().map(|cs| {
                        let job = self.job.as_ref().expect("popped first");
                        // SAFETY: between the run's pop from the source tick and its
                        // `finish`, the parameter belongs to the run; this is its only
                        // slice.
                        let w = unsafe { job.param_mut(0) };
                        let wv = u64::from_ne_bytes(w[..8].try_into().unwrap());
                        let y = self.x.expect("copied in") * wv;
                        w[..8].copy_from_slice(&(wv + 1).to_ne_bytes());
                        cs.copy_output(0, &y.to_ne_bytes()).unwrap();
                        self.computed = true;
                        self.held.push(cs);
                    })
                } else if self.callbacks < 2 {
                    b.callback.try_pop().item().map(|cs| {
                        cs.finish();
                        self.callbacks += 1;
                    })
                } else {
                    b.callback_notifier.try_pop().item().map(|j| {
                        j.finish(Ok(()));
                        *self = HelperRun::default();
                    })
                };
                if step.is_none() {
                    return moved;
                }
                moved = true;
            }
        }
    }

    impl<T> TryPop<T> {
        fn item(self) -> Option<T> {
            match self {
                TryPop::Item(x) => Some(x),
                TryPop::Empty | TryPop::Closed => None,
            }
        }
    }

    /// On a machine the VM counts as quiet, a waiting caller leaves a graph's work to the
    /// graph's thread while the graph makes progress (`vm_lazy::HelpGate`). A graph that
    /// makes none (here: its progress probe stands still, and its thread looks at its
    /// buffers only every 2 ms) is run by the caller all the same, after
    /// `GRAPH_HELP_PATIENCE` or before it sleeps. Whoever runs a step, every read sees
    /// its run's result.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_caller_on_a_quiet_machine_runs_a_graph_that_makes_no_progress() {
        use ivm_core::sync::AtomicBool;
        use std::sync::Mutex;
        let vm = crate::VirtualMachine::new(crate::Config::default()).unwrap();
        let lazy = LazyGraph::builder("slow_thread")
            .input("x", 8)
            .output("y", 8)
            .param("w", 8)
            .build()
            .unwrap();
        let run = Arc::new(Mutex::new(HelperRun::default()));
        let me = std::thread::current().id();
        let helped = Arc::new(AtomicUsize::new(0));
        let (r, l, h) = (run.clone(), lazy.clone(), helped.clone());
        // A helper's panic is caught by the VM (it ran nothing): a helper on another
        // thread is recorded, and asserted on below.
        let elsewhere = Arc::new(AtomicBool::new(false));
        let e = elsewhere.clone();
        assert!(lazy.set_caller_helper(move || {
            if std::thread::current().id() != me {
                // Relaxed: read after the VM's `sync` below, which orders it.
                e.store(true, Ordering::Relaxed);
            }
            let moved = r.lock().unwrap().advance(l.buffers());
            // Relaxed: a count read after `sync`.
            h.fetch_add(usize::from(moved), Ordering::Relaxed);
            moved
        }));
        assert!(lazy.set_progress_probe(|| 0));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, l, st) = (run.clone(), lazy.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            mark_graph_thread();
            // Relaxed: a stop flag; the buffers' locks order the work.
            while !st.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(2));
                r.lock().unwrap().advance(l.buffers());
            }
        });
        let (x, y, w) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.write_small(&w, 0, &2u64.to_ne_bytes()).unwrap();
        let s = vm.default_stream();
        for i in 0..20u64 {
            // Counted quiet (a look that finds a busy thread ends it: the caller then
            // helps at once, which this test accepts too).
            vm.shared()
                .core
                .neighbours_quiet_until
                .hold_for(std::time::Duration::from_secs(600));
            vm.run(|b| {
                b.call(&s, &[], &[&x], move |k| k.output_u64(0)[0] = i + 1)?;
                b.launch_lazy_job(&[&x], &[&y], &[&w], &lazy)
            })
            .unwrap();
            let mut out = [0u8; 8];
            vm.read_small(&y, 0, &mut out).unwrap();
            assert_eq!(u64::from_ne_bytes(out), (i + 1) * (i + 2), "run {i}");
        }
        vm.sync().unwrap();
        assert!(
            !elsewhere.load(Ordering::Relaxed),
            "a helper ran off its caller"
        );
        assert!(
            helped.load(Ordering::Relaxed) > 0,
            "the caller never ran the graph that made no progress"
        );
        // Relaxed: the thread only polls it; `join` orders the rest.
        stop.store(true, Ordering::Relaxed);
        thread.join().unwrap();
        lazy.close();
        vm.shutdown().unwrap();
    }
}
