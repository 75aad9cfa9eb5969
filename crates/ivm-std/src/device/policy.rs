//! Stream policies: what the engine asks of a stream (completion at launch or later,
//! strict same-stream edges, placement, events), chosen per stream type by the device
//! adapter that serves it ([`DeviceAdapter::stream_policy`](crate::DeviceAdapter::stream_policy)).
//! Beside the adapter traits, below the VM's model of a stream, which holds one.

use std::fmt;

use crate::device::KernelMode;
use crate::util::ids::StreamType;

/// Where the instructions of a stream run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On the worker thread of the stream's (device, thread id).
    SharedWorker,
    /// On a worker thread of its own per (device type, stream type).
    OwnWorker,
    /// On the scheduler thread itself.
    Scheduler,
}

/// How the instructions of a stream run and when they are done.
///
/// The VM asks each question once, when it creates a stream, and keeps the answers; a
/// policy whose answer panics fails the stream's creation with [`Error::Device`].
///
/// [`Error::Device`]: crate::Error::Device
///
/// The engine launches an instruction (runs its body on the stream's thread) and then
/// asks the policy whether it is done. On a compute stream an instruction is done at
/// launch (the device queue orders the stream); streams whose work completes later (copy
/// streams on an asynchronous device) answer `false` from
/// [`done_at_launch`](Self::done_at_launch): an event is recorded after each instruction
/// and its [`on_complete`](crate::Event::on_complete) callback marks the instruction done
/// and wakes the scheduler through ivm-core's parking protocol (see [`crate::device`]).
pub trait StreamPolicy: Send + Sync + fmt::Debug + 'static {
    /// The stream type this policy serves.
    fn stream_type(&self) -> StreamType;

    /// Where instructions run.
    fn placement(&self) -> Placement {
        let t = self.stream_type();
        if t.runs_on_scheduler() {
            Placement::Scheduler
        } else if t.needs_own_thread() {
            Placement::OwnWorker
        } else {
            Placement::SharedWorker
        }
    }

    /// Whether an instruction is done as soon as its body returned.
    fn done_at_launch(&self) -> bool {
        true
    }

    /// Whether an edge between two instructions of this stream waits for its source's
    /// release instead of being satisfied by dispatch order (see
    /// [`ivm_engine::StreamPolicy::strict_same_stream_edges`]). Critical sections: the
    /// graph runtime acts on their tensors between a begin and its end's record, outside
    /// the stream's dispatch order.
    fn strict_same_stream_edges(&self) -> bool {
        self.stream_type() == StreamType::CriticalSection
    }

    /// Whether the stream's instructions are dispatched in the order they were built,
    /// each after the one built before it, even when a later one's operands are ready
    /// first (the engine's stream-sequential order). A collective-communication stream
    /// needs it: every rank must issue its collectives to the transport in the same
    /// order, whichever operands become ready first on each rank (OneFlow's transport
    /// dependence); so does a critical-section stream, whose begins publish instances
    /// into the graph runtime's buffers in launch order. Default: those two types.
    fn dispatch_in_build_order(&self) -> bool {
        matches!(
            self.stream_type(),
            StreamType::Collective | StreamType::CriticalSection
        )
    }

    /// Whether the stream supports device events (soft sync needs them).
    fn supports_events(&self) -> bool {
        false
    }

    /// Whether a caller about to wait may run this stream's instructions itself when they
    /// are queued to a worker that is idle (ARCHITECTURE.md, "Who may drive the engine"):
    /// it then runs them on its own thread, in the queue's order, while it holds the
    /// queue's consumer role, instead of waiting for the worker to wake. Only where
    /// running on another thread than the stream's worker is harmless: not on streams
    /// placed on a thread of their own (critical sections, lazy-job launchers, or where an
    /// adapter needs its own thread), not on an asynchronous device's streams unless its
    /// adapter says so. Default `false`.
    fn caller_may_run(&self) -> bool {
        false
    }

    /// Whether a waiting caller may run this stream's queued instructions, custom ones
    /// included, while the stream's thread counts as sharing its CPU (ARCHITECTURE.md,
    /// "When another thread takes a core"), where [`caller_may_run`](Self::caller_may_run)
    /// does not allow it. For a stream on a thread of its own only so that a blocking call
    /// (a collective waiting for its peers) holds up no compute worker: a caller that
    /// waits anyway may run that call itself, and when the stream's thread would first
    /// have to get a CPU back, it is faster to. The instructions must not need the
    /// stream's own thread (a custom instruction's launch runs on the caller, and may
    /// block it). Default `false`; the cpu's and the adapters' synchronous collective
    /// streams answer `true`.
    fn caller_may_run_when_contended(&self) -> bool {
        false
    }
}

/// A policy's answers, asked once when its stream is created: the VM (the engine's
/// dispatch included) reads these, never the policy, which is the adapter's code and so
/// could panic or change its mind mid-run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PolicyAnswers {
    stream_type: StreamType,
    placement: Placement,
    done_at_launch: bool,
    strict_same_stream_edges: bool,
    dispatch_in_build_order: bool,
    supports_events: bool,
    caller_may_run: bool,
    caller_may_run_when_contended: bool,
}

impl PolicyAnswers {
    /// Asks `p` each question once.
    pub(crate) fn of(p: &dyn StreamPolicy) -> Self {
        Self {
            stream_type: p.stream_type(),
            placement: p.placement(),
            done_at_launch: p.done_at_launch(),
            strict_same_stream_edges: p.strict_same_stream_edges(),
            dispatch_in_build_order: p.dispatch_in_build_order(),
            supports_events: p.supports_events(),
            caller_may_run: p.caller_may_run(),
            caller_may_run_when_contended: p.caller_may_run_when_contended(),
        }
    }

    /// [`StreamPolicy::stream_type`].
    pub(crate) fn stream_type(&self) -> StreamType {
        self.stream_type
    }
    /// [`StreamPolicy::placement`].
    pub(crate) fn placement(&self) -> Placement {
        self.placement
    }
    /// [`StreamPolicy::done_at_launch`].
    pub(crate) fn done_at_launch(&self) -> bool {
        self.done_at_launch
    }
    /// [`StreamPolicy::strict_same_stream_edges`].
    pub(crate) fn strict_same_stream_edges(&self) -> bool {
        self.strict_same_stream_edges
    }
    /// [`StreamPolicy::dispatch_in_build_order`].
    pub(crate) fn dispatch_in_build_order(&self) -> bool {
        self.dispatch_in_build_order
    }
    /// [`StreamPolicy::supports_events`].
    pub(crate) fn supports_events(&self) -> bool {
        self.supports_events
    }
    /// [`StreamPolicy::caller_may_run`].
    pub(crate) fn caller_may_run(&self) -> bool {
        self.caller_may_run
    }
    /// [`StreamPolicy::caller_may_run_when_contended`].
    pub(crate) fn caller_may_run_when_contended(&self) -> bool {
        self.caller_may_run_when_contended
    }
}

/// Whether a stream of `stream_type`, placed by `placement`, may in principle be run by a
/// waiting caller (the shared part of the policies' answers): it lives on a shared worker.
fn shared_worker_stream(stream_type: StreamType, placement: Placement) -> bool {
    placement == Placement::SharedWorker
        && !stream_type.needs_own_thread()
        && !stream_type.runs_on_scheduler()
}

/// The policy of the cpu device's streams: synchronous, done at launch, no events.
#[derive(Debug, Clone, Copy)]
pub struct CpuStreamPolicy(pub StreamType);

impl StreamPolicy for CpuStreamPolicy {
    fn stream_type(&self) -> StreamType {
        self.0
    }

    /// The cpu device is synchronous: any thread may run its kernels.
    fn caller_may_run(&self) -> bool {
        shared_worker_stream(self.0, self.placement())
    }

    /// Its collective stream: a host transport's call may run on any thread.
    fn caller_may_run_when_contended(&self) -> bool {
        self.0 == StreamType::Collective
    }
}

/// The policy of a stream served by a device adapter, written against the adapter traits
/// (see [`crate::device`]): compute streams are done at launch; host-to-device and
/// device-to-host streams of an asynchronous device are done when an event recorded after
/// each instruction completes; critical-section and lazy-job-launcher streams run on a
/// thread of their own, their instructions (a lazy job's begins, launch and ends) done
/// when the completion handle of their deferred body fires, whatever the policy answers
/// (`doors/lazy/`); barriers run on the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct DeviceStreamPolicy {
    stream_type: StreamType,
    done_at_launch: bool,
    events: bool,
    caller_runs: bool,
    synchronous: bool,
}

impl DeviceStreamPolicy {
    /// The policy of a `stream_type` stream on a device whose streams run kernels in
    /// `mode` and that supports events (`events`) or not.
    pub fn new(stream_type: StreamType, mode: KernelMode, events: bool) -> Self {
        let asynchronous = mode != KernelMode::Synchronous;
        let done_at_launch = match stream_type {
            StreamType::HostToDevice | StreamType::DeviceToHost => !asynchronous,
            // A lazy job's instructions have deferred bodies, done when their completion
            // handle fires (the graph runtime's end records), not by this answer.
            StreamType::CriticalSection | StreamType::LazyJobLauncher => true,
            StreamType::Compute | StreamType::Barrier | StreamType::Collective => true,
        };
        // A collective stream runs on a thread of its own, but its work on an
        // asynchronous device (a device transport's enqueued collective) completes later:
        // readers on other streams need an event recorded after it (soft sync).
        let own_thread_with_events = stream_type == StreamType::Collective && asynchronous;
        Self {
            stream_type,
            done_at_launch,
            events: events
                && !stream_type.runs_on_scheduler()
                && (!stream_type.needs_own_thread() || own_thread_with_events),
            caller_runs: !asynchronous
                && shared_worker_stream(stream_type, Placement::SharedWorker),
            synchronous: !asynchronous,
        }
    }

    /// This policy, with a waiting caller allowed (or not) to run the stream's queued
    /// instructions itself ([`StreamPolicy::caller_may_run`]): by default only on a
    /// synchronous device. An adapter of an asynchronous device whose launches may come
    /// from any thread may allow it; never on a stream placed on a thread of its own.
    #[must_use]
    pub fn with_caller_runs(mut self, allow: bool) -> Self {
        self.caller_runs = allow && shared_worker_stream(self.stream_type, self.placement());
        self
    }
}

impl StreamPolicy for DeviceStreamPolicy {
    fn stream_type(&self) -> StreamType {
        self.stream_type
    }
    fn done_at_launch(&self) -> bool {
        self.done_at_launch
    }
    fn supports_events(&self) -> bool {
        self.events
    }
    fn caller_may_run(&self) -> bool {
        self.caller_runs
    }
    /// A synchronous device's collective stream (a host transport), as on the cpu.
    fn caller_may_run_when_contended(&self) -> bool {
        self.stream_type == StreamType::Collective && self.synchronous
    }
}
