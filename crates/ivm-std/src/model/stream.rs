//! Streams: a device, a stream type and a thread id, with a policy saying where their
//! instructions run and when they are done.

use std::fmt;
use std::sync::{Arc, Mutex};

use ivm_core::sync::{AtomicBool, Ordering};

use crate::device::policy::PolicyAnswers;
use crate::device::{DeviceAllocator, DeviceStream, KernelMode};
use crate::model::thread_ctx::ThreadCtx;
use crate::util::error::Failure;
use crate::util::ids::StreamId;

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
/// (`engine/drive/token.rs`) implements it. A trait, so that streams (a lower layer) do not name the
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
    /// The longest a worker waits for the stream's queued work before it poisons the
    /// outputs of a failed launch itself (the VM's timeout period; `engine/device_launch/completion.rs`).
    pub(crate) drain_bound: std::time::Duration,
    /// Where a drain that gave up leaves the device work it waited for (the VM's,
    /// `device/given_up.rs`), so that diagnostics name it.
    pub(crate) given_up: Arc<crate::device::given_up::GivenUpWork>,
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
            drain_bound: std::time::Duration::ZERO,
            // A cpu stream never drains.
            given_up: Arc::default(),
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
    pub(crate) policy: PolicyAnswers,
    /// `policy.dispatch_in_build_order()`, asked once: every instruction built on the
    /// stream is then stream-sequential.
    pub(crate) in_build_order: bool,
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
