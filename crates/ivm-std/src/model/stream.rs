//! Streams: a device, a stream type and a thread id, with a policy saying where their
//! instructions run and when they are done.

use std::fmt;
use std::sync::{Arc, Mutex};

use ivm_core::sync::{AtomicBool, Ordering};

use crate::device::{DeviceAllocator, DeviceStream, KernelMode};
use crate::model::thread_ctx::ThreadCtx;
use crate::util::error::Failure;
use crate::util::ids::{StreamId, StreamType};

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

    /// Whether the stream supports device events (soft sync needs them).
    fn supports_events(&self) -> bool {
        false
    }
}

/// The policy of the cpu device's streams: synchronous, done at launch, no events.
#[derive(Debug, Clone, Copy)]
pub struct CpuStreamPolicy(pub StreamType);

impl StreamPolicy for CpuStreamPolicy {
    fn stream_type(&self) -> StreamType {
        self.0
    }
}

/// The policy of a stream served by a device adapter, written against the adapter traits
/// (see [`crate::device`]): compute streams are done at launch; host-to-device and
/// device-to-host streams of an asynchronous device are done when an event recorded after
/// each instruction completes; critical-section and lazy-job-launcher streams run on a
/// thread of their own and (for now: a stub until lazy jobs land) are done at launch;
/// barriers run on the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct DeviceStreamPolicy {
    stream_type: StreamType,
    done_at_launch: bool,
    events: bool,
}

impl DeviceStreamPolicy {
    /// The policy of a `stream_type` stream on a device whose streams run kernels in
    /// `mode` and that supports events (`events`) or not.
    pub fn new(stream_type: StreamType, mode: KernelMode, events: bool) -> Self {
        let asynchronous = mode != KernelMode::Synchronous;
        let done_at_launch = match stream_type {
            StreamType::HostToDevice | StreamType::DeviceToHost => !asynchronous,
            // Stubs until lazy jobs land: their status is handled at launch.
            StreamType::CriticalSection | StreamType::LazyJobLauncher => true,
            StreamType::Compute | StreamType::Barrier => true,
        };
        Self {
            stream_type,
            done_at_launch,
            events: events && !stream_type.runs_on_scheduler() && !stream_type.needs_own_thread(),
        }
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
}

/// A stream's sticky asynchronous failure: set by a kernel that failed on the device after
/// its instruction was done at launch; poisons the outputs launched on the stream until a
/// host-observed completion takes it and reports it.
#[derive(Default)]
pub(crate) struct Sticky {
    set: AtomicBool,
    failure: Mutex<Option<Failure>>,
}

impl Sticky {
    /// The failure, if one is pending (not cleared).
    pub(crate) fn get(&self) -> Option<Failure> {
        // Acquire: pairs with the Release store in `set`, publishing the stored failure.
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        crate::util::lock(&self.failure).clone()
    }

    /// Records `f` unless a failure is already pending (the first one wins).
    pub(crate) fn set(&self, f: &Failure) {
        let mut g = crate::util::lock(&self.failure);
        if g.is_none() {
            *g = Some(f.clone());
        }
        drop(g);
        // Release: publishes the failure stored above to `get`/`take`.
        self.set.store(true, Ordering::Release);
    }

    /// Takes the pending failure (a host-observed completion reports it).
    pub(crate) fn take(&self) -> Option<Failure> {
        // Acquire: as in `get`.
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        let mut g = crate::util::lock(&self.failure);
        // Relaxed: the mutex orders the failure itself; a `set` racing us stores the flag
        // again after its own insertion.
        self.set.store(false, Ordering::Relaxed);
        g.take()
    }
}

/// How a completion that happens outside the engine (a device's event callback, a graph
/// runtime finishing a lazy-job instruction) gets the engine to see it: the engine token
/// (`drive.rs`) implements it. A trait, so that streams (a lower layer) do not name the
/// engine layer.
pub(crate) trait CompletionSink: Send + Sync {
    /// After publishing a completion (`DONE`, with Release): marks the engine dirty and
    /// wakes the scheduler thread if nobody drives (`EngineToken::unpark`). Returns whether it
    /// made a wake call.
    fn unpark(&self) -> bool;

    /// After a deferred body's completion fired: as [`unpark`](Self::unpark), or drives
    /// the engine right there on a graph runtime's thread (`EngineToken::complete_outside`).
    fn complete_outside(&self);
}

/// The device side of a VM stream: its adapter stream and allocator, how kernels run, and
/// the sticky failure. Completion callbacks wake the scheduler through `wake`.
pub(crate) struct DeviceCtx {
    pub(crate) stream: Arc<dyn DeviceStream>,
    pub(crate) allocator: Arc<dyn DeviceAllocator>,
    /// The stream's caching allocator, when [`Config::caching_allocator`] is on (then
    /// `allocator` is this cache too).
    ///
    /// [`Config::caching_allocator`]: crate::Config::caching_allocator
    pub(crate) cache: Option<Arc<crate::device::alloc_cache::CachingAllocator>>,
    pub(crate) mode: KernelMode,
    /// The VM's parking spot: completions unpark the scheduler (or a single-thread caller).
    pub(crate) wake: Arc<dyn CompletionSink>,
    /// The VM runs in single-thread mode (callers drive the engine and park on `wake`).
    pub(crate) single_thread: bool,
    pub(crate) sticky: Sticky,
}

impl DeviceCtx {
    /// A cpu stream's device side.
    pub(crate) fn cpu(wake: Arc<dyn CompletionSink>, single_thread: bool) -> Self {
        Self {
            stream: Arc::new(crate::device::cpu::CpuStream::default()),
            allocator: Arc::new(crate::device::cpu::CpuAllocator),
            cache: None,
            mode: KernelMode::Synchronous,
            wake,
            single_thread,
            sticky: Sticky::default(),
        }
    }

    /// Whether work on this stream completes after its launch returns.
    pub(crate) fn is_async(&self) -> bool {
        self.mode != KernelMode::Synchronous
    }
}

/// The VM-side state of one stream, shared by every instruction on it.
pub(crate) struct StreamShared {
    pub(crate) vm_id: usize,
    /// Dense index of the stream in its VM (the engine's per-stream table).
    pub(crate) index: u32,
    pub(crate) id: StreamId,
    pub(crate) policy: Box<dyn StreamPolicy>,
    /// The worker that runs this stream; `None` when it runs on the scheduler or in
    /// single-thread mode.
    pub(crate) thread: Option<Arc<ThreadCtx>>,
    /// The device side: adapter stream, allocator, sticky failure.
    pub(crate) dev: DeviceCtx,
}

impl fmt::Debug for StreamShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id)
            .field("index", &self.index)
            .finish()
    }
}

/// A handle on one of a VM's streams (cheap to clone). Get one with
/// [`VirtualMachine::stream`](crate::VirtualMachine::stream).
#[derive(Clone, Debug)]
pub struct Stream {
    pub(crate) shared: Arc<StreamShared>,
}

impl Stream {
    /// The stream's identity.
    pub fn id(&self) -> StreamId {
        self.shared.id
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}
impl Eq for Stream {}
