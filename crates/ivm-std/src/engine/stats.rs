//! Introspection: a cheap stats snapshot ([`VirtualMachine::stats`](crate::VirtualMachine::stats)) and an on-demand dump
//! of the lively instruction DAG ([`VirtualMachine::dump_dag`](crate::VirtualMachine::dump_dag)) as text or Graphviz DOT.
//!
//! * **Stats** are read from counters that the VM's threads keep anyway or publish with
//!   Relaxed stores after each engine step that made progress; taking a snapshot never
//!   talks to the scheduler. The fields are read one by one, so they are mutually
//!   consistent only when the VM is quiescent (a monitoring view, not a proof).
//! * **The DAG dump** is taken by the engine's owner itself (a probe run by the scheduler
//!   thread, or by the caller in single-thread mode): it is exact, but it waits for the
//!   scheduler (at most `min(timeout_period, 2 s)`; a scheduler blocked in a barrier makes
//!   it fail with [`Error::Timeout`](crate::Error::Timeout)).
//!
//! ```
//! use ivm_std::{Config, VirtualMachine};
//!
//! let vm = VirtualMachine::new(Config::default())?;
//! let s = vm.default_stream();
//! let x = vm.new_tensor(8)?;
//! vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 1))?;
//! vm.sync()?;
//! let st = vm.stats()?;
//! // Everything received before `sync` is released; `sync`'s own barrier may still be
//! // on its way out of the engine (it is done when `sync` returns, released just after).
//! assert!(st.flying <= 1);
//! assert!(st.released >= 1);
//! let dag = vm.dump_dag()?;
//! assert!(dag.to_dot().starts_with("digraph ivm"));
//! # Ok::<(), ivm_std::Error>(())
//! ```

use std::fmt::{self, Write as _};
use std::sync::{Arc, Mutex};

use ivm_core::counter::BlockingCounter;
use ivm_core::sync::{AtomicU32, AtomicUsize, Ordering};

use crate::util::futex::FutexWait;
use crate::util::ids::StreamId;
use crate::util::lock;

/// Streams (by dense index) whose running-list length is tracked individually.
pub(crate) const TRACKED_STREAMS: usize = 64;

/// Counters of one VM thread (the scheduler or a worker).
#[derive(Debug)]
pub(crate) struct ThreadCounters {
    pub(crate) name: String,
    pub(crate) parks: AtomicUsize,
    pub(crate) wakes: AtomicUsize,
    /// Times it saw itself descheduled while it polled (`engine/preemption.rs`).
    pub(crate) preempted: AtomicUsize,
    /// Windows of running instructions with less than three quarters of a CPU
    /// (`preemption::CpuShare`).
    pub(crate) cpu_shared: AtomicUsize,
    /// Times it handed its queue to waiting callers (`model/hand_over.rs`).
    pub(crate) handed_over: AtomicUsize,
}

impl ThreadCounters {
    /// The thread went to sleep (`slept`) and, if `woken`, was woken by a producer (not by a
    /// deadline).
    #[inline]
    pub(crate) fn record(&self, slept: bool, woken: bool) {
        // Relaxed: statistics only.
        if slept {
            self.parks.fetch_add(1, Ordering::Relaxed);
        }
        if woken {
            self.wakes.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The counters a VM keeps for [`VirtualMachine::stats`](crate::VirtualMachine::stats) (in `VmShared`).
pub(crate) struct StatsCells {
    pub(crate) lively: AtomicUsize,
    pub(crate) engine_pending: AtomicUsize,
    pub(crate) ready: AtomicUsize,
    /// Running-list length per stream index (`< TRACKED_STREAMS`).
    pub(crate) running: [AtomicU32; TRACKED_STREAMS],
    /// Sum of the running lengths of the other streams.
    pub(crate) running_other: AtomicUsize,
    pub(crate) threads: Mutex<Vec<Arc<ThreadCounters>>>,
    /// Instructions queued to a sleeping worker that a waiting caller ran itself.
    pub(crate) caller_ran: AtomicUsize,
    /// Callers that saw themselves descheduled while spinning for the VM, and slept.
    pub(crate) caller_preempted: AtomicUsize,
    /// Callers' looks that found a busy neighbour taking a CPU the VM needs.
    pub(crate) crowded: AtomicUsize,
    /// Stalls in which a waiting caller found a worker awake but off its CPU.
    pub(crate) worker_stalled: AtomicUsize,
    /// See [`VmStats::tiny_kernel_marks`].
    pub(crate) tiny_kernel_marks: AtomicUsize,
    /// Fused runs (of two or more) handed over, their members, the longest.
    pub(crate) fused_runs: AtomicUsize,
    pub(crate) fused_instructions: AtomicUsize,
    pub(crate) longest_fused_run: AtomicUsize,
    /// Instructions single-thread mode ran at rest, without the engine.
    pub(crate) ran_at_rest: AtomicUsize,
}

impl Default for StatsCells {
    fn default() -> Self {
        Self::new()
    }
}

impl StatsCells {
    /// The scheduler thread's counters (registered before it is spawned).
    pub(crate) fn scheduler(&self) -> Arc<ThreadCounters> {
        let found = lock(&self.threads)
            .iter()
            .find(|c| c.name.ends_with("-scheduler"))
            .cloned();
        found.unwrap_or_else(|| self.thread("ivm-scheduler"))
    }

    pub(crate) fn new() -> Self {
        Self {
            lively: AtomicUsize::new(0),
            engine_pending: AtomicUsize::new(0),
            ready: AtomicUsize::new(0),
            running: std::array::from_fn(|_| AtomicU32::new(0)),
            running_other: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
            caller_ran: AtomicUsize::new(0),
            caller_preempted: AtomicUsize::new(0),
            crowded: AtomicUsize::new(0),
            worker_stalled: AtomicUsize::new(0),
            tiny_kernel_marks: AtomicUsize::new(0),
            fused_runs: AtomicUsize::new(0),
            fused_instructions: AtomicUsize::new(0),
            longest_fused_run: AtomicUsize::new(0),
            ran_at_rest: AtomicUsize::new(0),
        }
    }

    /// The engine's driver handed `f.runs` fused runs over since it last counted.
    pub(crate) fn fused(&self, f: FusedCount) {
        // Relaxed: statistics.
        self.fused_runs.fetch_add(f.runs, Ordering::Relaxed);
        self.fused_instructions
            .fetch_add(f.instructions, Ordering::Relaxed);
        self.longest_fused_run
            .fetch_max(f.longest, Ordering::Relaxed);
    }

    /// A waiting caller ran `n` instructions queued to a sleeping worker.
    pub(crate) fn caller_ran(&self, n: usize) {
        // Relaxed: a statistic.
        self.caller_ran.fetch_add(n, Ordering::Relaxed);
    }

    /// The counters of the VM thread `name`, registered on first use (on the spawning
    /// thread: a later lookup by the thread itself allocates nothing).
    pub(crate) fn thread(&self, name: &str) -> Arc<ThreadCounters> {
        if let Some(c) = lock(&self.threads).iter().find(|c| c.name == name) {
            return c.clone();
        }
        let c = Arc::new(ThreadCounters {
            name: name.to_string(),
            parks: AtomicUsize::new(0),
            wakes: AtomicUsize::new(0),
            preempted: AtomicUsize::new(0),
            cpu_shared: AtomicUsize::new(0),
            handed_over: AtomicUsize::new(0),
        });
        lock(&self.threads).push(c.clone());
        c
    }
}

/// The running-list length of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStats {
    /// The stream.
    pub id: StreamId,
    /// Instructions dispatched on it and not yet released.
    pub running: usize,
}

/// Sleeps of one VM thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadStats {
    /// The thread's name (`ivm<vm>-scheduler`, `ivm<vm>-cpu:0-t0`, ...).
    pub name: String,
    /// Times it went to sleep (scheduler: parked; worker: blocked on its notifier).
    pub parks: usize,
    /// Times a producer woke it (the rest of its sleeps ended on a deadline or shutdown).
    pub wakes: usize,
    /// Times it saw itself descheduled while it polled for work (another thread took its
    /// CPU); it then polls no more for a while and parks at once when idle.
    pub preempted: usize,
    /// Times a stretch of its running instructions had less than three quarters of a CPU
    /// (a busy neighbour shares it): it then counts as contended for a while.
    pub cpu_shared: usize,
    /// Times a contended worker handed its queued instructions to the callers waiting for
    /// them and went to sleep: they ran the instructions themselves.
    pub handed_over: usize,
}

/// Fused runs of two or more instructions handed over as one, counted by the engine's
/// owner during a step (`VmStats`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FusedCount {
    pub(crate) runs: usize,
    pub(crate) instructions: usize,
    pub(crate) longest: usize,
}

/// A snapshot of a VM's counters (see the [module docs](crate::engine::stats)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VmStats {
    /// The VM's id (process-unique).
    pub vm_id: usize,
    /// Instructions received and not yet released (`flying_instruction_count`).
    pub flying: usize,
    /// Instructions received since the VM started.
    pub received: usize,
    /// Instructions released since the VM started.
    pub released: usize,
    /// Received instructions the engine has not handled yet (still in the pending queue or
    /// the engine's pending window).
    pub pending: usize,
    /// Instructions the engine holds (handled, not released).
    pub lively: usize,
    /// Instructions ready to dispatch at the engine's last step.
    pub ready: usize,
    /// Running-list length per stream, in creation order (the internal barrier stream
    /// included).
    pub streams: Vec<StreamStats>,
    /// Running instructions of streams beyond the first 64, summed.
    pub running_other_streams: usize,
    /// Parks and wakes per VM thread.
    pub threads: Vec<ThreadStats>,
    /// Instructions queued to a sleeping worker that a caller about to wait ran itself
    /// instead (ARCHITECTURE.md, "Who may drive the engine").
    pub caller_ran: usize,
    /// Times a caller saw another thread take its CPU (`engine/preemption.rs`): descheduled
    /// while spinning for the VM (it went to sleep instead), or, at a look between its
    /// calls, runnable but waiting for its CPU a tenth of the time (its workers were then
    /// marked contended).
    pub caller_preempted: usize,
    /// Looks of a caller (one per 40 ms at most) that found a busy neighbour, a thread
    /// not the VM's that stayed runnable, leaving the VM's threads too few CPUs: its
    /// workers were then marked contended (`engine/neighbours.rs`).
    pub crowded: usize,
    /// Stalls in which a waiting caller found a worker awake but off its CPU (waiting for
    /// one): that worker was then marked contended (`engine/preemption.rs`).
    pub worker_stalled: usize,
    /// Times a worker not marked already found its instructions tiny, shorter on average
    /// than handing one to it costs (`engine/kernel_clock.rs`): it was then marked
    /// contended for 20 ms, and its callers ran its queue (`engine/preemption.rs`,
    /// `mark_tiny_kernels`).
    pub tiny_kernel_marks: usize,
    /// Fused runs of two or more instructions handed to a worker as one
    /// ([`Config::fusion`](crate::Config::fusion)).
    pub fused_runs: usize,
    /// Instructions in those runs (their mean length is this over `fused_runs`).
    pub fused_instructions: usize,
    /// The longest fused run.
    pub longest_fused_run: usize,
    /// Instructions that a `run` ran as its caller built them, without the dependency
    /// engine, because nothing else was in flight (single-thread mode, or tiny kernels in
    /// multi-thread mode: [`Config::run_at_rest`](crate::Config::run_at_rest)); counted in
    /// `received` and `released` too.
    pub ran_at_rest: usize,
}

/// Where the engine's owner leaves a DAG dump for the caller who asked for it.
pub(crate) struct DagSlot {
    pub(crate) done: BlockingCounter<FutexWait>,
    pub(crate) value: Mutex<Option<Dag>>,
}

impl DagSlot {
    pub(crate) fn fulfil(&self, d: Dag) {
        *lock(&self.value) = Some(d);
        // Release: publishes the stored dump to the waiting caller.
        self.done.decrease();
    }
}

/// Where a lively instruction is in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeState {
    /// Waiting for in-edges.
    Waiting,
    /// On the ready list.
    Ready,
    /// Handed to its stream.
    Dispatched,
    /// A barrier waiting to become the oldest lively instruction.
    Barrier,
}

/// One lively instruction of a [`Dag`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DagNode {
    /// The instruction's process-unique id.
    pub id: usize,
    /// `name#id`.
    pub name: String,
    /// The stream it runs on.
    pub stream: String,
    /// Its engine state.
    pub state: NodeState,
    /// Its body started.
    pub launched: bool,
    /// Its stream reports it done.
    pub done: bool,
    /// Its body failed.
    pub failed: bool,
}

/// One edge of a [`Dag`]: `to` waits for `from`'s release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DagEdge {
    /// Source instruction id.
    pub from: usize,
    /// Destination instruction id.
    pub to: usize,
    /// Dispatch already satisfied it (same-stream order); it is kept until the release.
    pub satisfied: bool,
    /// A strict same-stream edge (critical sections): waits for the source's release.
    pub strict: bool,
}

/// The lively instruction DAG (oldest first), from [`VirtualMachine::dump_dag`](crate::VirtualMachine::dump_dag).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dag {
    /// Received instructions the engine has not handled yet (not in the DAG).
    pub pending: usize,
    /// Lively instructions, oldest first.
    pub nodes: Vec<DagNode>,
    /// Edges between lively instructions.
    pub edges: Vec<DagEdge>,
}

impl Dag {
    /// One line per instruction with its state and the instructions it waits for.
    pub fn to_text(&self) -> String {
        self.to_string()
    }

    /// The DAG in Graphviz DOT (`dot -Tsvg`): one node per instruction (dispatched ones
    /// filled, done ones green), one arrow per edge (dashed when already satisfied).
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph ivm {\n  rankdir=LR;\n  node [shape=box];\n");
        for n in &self.nodes {
            let color = if n.failed {
                "red"
            } else if n.done {
                "palegreen"
            } else if n.state == NodeState::Dispatched {
                "lightblue"
            } else {
                "white"
            };
            let _ = writeln!(
                s,
                "  n{} [label=\"{}\\n{}\\n{:?}\", style=filled, fillcolor={color}];",
                n.id,
                escape(&n.name),
                escape(&n.stream),
                n.state
            );
        }
        for e in &self.edges {
            let style = match (e.satisfied, e.strict) {
                (_, true) => " [style=bold]",
                (true, false) => " [style=dashed]",
                (false, false) => "",
            };
            let _ = writeln!(s, "  n{} -> n{}{style};", e.from, e.to);
        }
        s.push_str("}\n");
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

impl fmt::Display for Dag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} pending, {} lively instruction(s), {} edge(s)",
            self.pending,
            self.nodes.len(),
            self.edges.len()
        )?;
        for n in &self.nodes {
            write!(
                f,
                "  {} on {}: {:?} launched={} done={}{}",
                n.name,
                n.stream,
                n.state,
                n.launched,
                n.done,
                if n.failed { " FAILED" } else { "" }
            )?;
            let mut first = true;
            for e in self.edges.iter().filter(|e| e.to == n.id) {
                let src = self
                    .nodes
                    .iter()
                    .find(|m| m.id == e.from)
                    .map_or("?", |m| m.name.as_str());
                f.write_str(if first { ", after [" } else { ", " })?;
                f.write_str(src)?;
                if e.satisfied {
                    f.write_str(" (dispatched)")?;
                }
                first = false;
            }
            if !first {
                f.write_str("]")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
