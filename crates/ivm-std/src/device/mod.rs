//! Device adapters: the traits the VM's stream policies are written against.
//!
//! A device adapter ([`DeviceAdapter`]) is registered with the VM when it is built
//! ([`VirtualMachine::with_adapters`](crate::VirtualMachine::with_adapters)); ivm-std never
//! depends on a concrete device. An adapter gives, per device:
//!
//! * streams ([`DeviceStream`]) that run work asynchronously and in order: host closures
//!   ([`DeviceStream::launch_host`]), memory copies ([`DeviceStream::copy`]), event records
//!   and device-side waits;
//! * events ([`Event`]): recorded on a stream, queried, synchronised, waited on by another
//!   stream of the same device, and able to call back when they complete
//!   ([`Event::on_complete`]) so that the VM's scheduler is woken instead of polling;
//! * a small pinned host buffer per stream ([`DeviceStream::pinned_buffer`]) for small
//!   synchronous copies;
//! * an allocator ([`DeviceAllocator`]) whose frees are ordered on a stream.
//!
//! The cpu adapter ([`CpuAdapter`](crate::CpuAdapter)) is always registered: synchronous,
//! its events are done when recorded. `ivm-device` provides `sim` (a simulated
//! asynchronous accelerator) and `cuda`.
//!
//! # How the VM uses an adapter (the stream policies)
//!
//! * **compute**: an instruction is *done at launch*: the worker hands its kernel to the
//!   stream and the device queue orders it after everything launched before on that
//!   stream. A kernel that fails later poisons its outputs and, stickily, every output
//!   launched on that stream until the next host-observed completion, which reports it.
//! * **host-to-device / device-to-host**: an event is recorded after each instruction's
//!   work; the instruction is done when the event completes ([`Event::on_complete`] sets
//!   it done and unparks the scheduler).
//! * **critical section / lazy-job launcher**: run on a thread of their own; a lazy job's
//!   begins, launch and ends have deferred bodies, done when their completion handle fires
//!   (the graph runtime's end records), on every device.
//! * **collective**: a thread of its own; dispatched in build order
//!   ([`StreamPolicy::dispatch_in_build_order`](crate::StreamPolicy::dispatch_in_build_order));
//!   done at launch, with events on an asynchronous device (a device transport enqueues
//!   the collective, and readers on other streams wait for an event recorded after it).
//! * **barrier**: on the scheduler thread.

pub mod alloc_cache;
pub(crate) mod cpu;
pub(crate) mod given_up;
pub(crate) mod guarded;
pub(crate) mod policy;

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::util::error::Result;
use crate::util::ids::{Device, DeviceKind, StreamType};

/// A closure run on the host in a stream's order (after all work enqueued on the stream
/// before it, before all work enqueued after it).
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// Bytes every stream's pinned buffer holds at least (the largest small-memory access).
pub const PINNED_BUFFER_MIN: usize = 16;

/// Where the body of a kernel runs on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelMode {
    /// The device is synchronous: work runs inline when it is launched and is complete
    /// when the launch returns (cpu).
    Synchronous,
    /// Kernel bodies run on the launching worker thread and enqueue device work
    /// themselves through [`KernelCtx::device_stream`](crate::KernelCtx::device_stream)
    /// (cuda). Memory is addressed through device pointers.
    Launcher,
    /// Kernel bodies are host closures queued with [`DeviceStream::launch_host`]: they run
    /// in stream order on a device thread and see the memory's bytes (sim).
    Queued,
}

/// One allocation of a device (or of the host).
///
/// # Safety
///
/// Implementations guarantee that [`host_ptr`](Self::host_ptr) gives the same answer on
/// every call (the VM asks once, when it wraps the memory in a tensor), and that, if it
/// returns a pointer, it is 8-byte aligned, points to [`nbytes`](Self::nbytes) initialised
/// bytes that stay valid for reads and writes for as long as the object lives, and that
/// the implementation itself touches those bytes only through operations it was asked to
/// perform (copies, frees). The VM orders every access to them (engine order plus soft sync).
pub unsafe trait DeviceMemory: Send + Sync + fmt::Debug + 'static {
    /// The device this memory lives on ([`Device::CPU`] for host memory).
    fn device(&self) -> Device;

    /// Its size in bytes.
    fn nbytes(&self) -> usize;

    /// A host pointer to the bytes, when host code may touch them (host memory, the sim's
    /// simulated device memory, managed memory); `None` for device-only memory. The same
    /// answer every time (see the trait's safety contract).
    fn host_ptr(&self) -> Option<NonNull<u8>>;

    /// The device address (what a real device kernel gets); the host address for host
    /// memory.
    fn device_ptr(&self) -> u64;

    /// A stream-ordered body starts touching this memory. Checking allocators (the sim's)
    /// report a use after free as an error here; the default does nothing.
    fn begin_access(&self) -> Result<()> {
        Ok(())
    }

    /// The body that called [`begin_access`](Self::begin_access) successfully is done.
    fn end_access(&self) {}

    /// For adapters that need their own memory type back (downcasting). A block of the
    /// caching allocator ([`CachedBlock`](crate::device::alloc_cache::CachedBlock)) answers with
    /// the allocation it wraps, so adapters' downcasts keep working on it.
    fn as_any(&self) -> &dyn Any;

    /// `Some` for a block handed out by a caching allocator
    /// ([`crate::device::alloc_cache`]), which is how that allocator recognises its blocks when
    /// they are freed. Other memory answers `None` (the default).
    fn cached_block(&self) -> Option<&crate::device::alloc_cache::CachedBlock> {
        None
    }
}

/// A copy of a memory's host pointer ([`DeviceMemory::host_ptr`], asked once, the same
/// answer every time by its contract), kept next to that memory (a blob, a guarded
/// adapter memory).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostPtr(pub(crate) Option<NonNull<u8>>);

// SAFETY: the pointer is a copy of what a `DeviceMemory` (which is `Send + Sync`) returned,
// pointing into memory that memory keeps alive; it is dereferenced only under that
// memory's own rules (for a blob, the engine-ordered invariant of `Blob::bytes` and
// `Blob::bytes_mut`).
unsafe impl Send for HostPtr {}
// SAFETY: as above.
unsafe impl Sync for HostPtr {}

/// An allocator of one device's memory.
pub trait DeviceAllocator: Send + Sync + fmt::Debug + 'static {
    /// Allocates `nbytes` zero-filled bytes. The memory is ready for every stream of the
    /// device when this returns. Running out of memory is
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory), never an abort.
    fn allocate(&self, nbytes: usize) -> Result<Arc<dyn DeviceMemory>>;

    /// Frees `mem` in `stream`'s order: after every work item enqueued on `stream` so far.
    /// The object stays valid (its bytes poisoned or unmapped on the device) until its last
    /// `Arc` drops; freeing twice is a no-op.
    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()>;
}

/// An event: a point in one stream's order.
pub trait Event: Send + Sync + fmt::Debug + 'static {
    /// The device of the stream it was recorded on.
    fn device(&self) -> Device;

    /// Whether every work item enqueued on its stream before the record has completed.
    fn query(&self) -> bool;

    /// Blocks the calling thread until the event completes (sleeping, not spinning).
    fn synchronize(&self) -> Result<()>;

    /// Calls `f` exactly once when the event completes: at once, on the calling thread, if
    /// it already has; otherwise on a thread of the adapter. `f` must be short and must not
    /// block (the VM's callbacks set a status bit and unpark the scheduler).
    fn on_complete(&self, f: HostFn);

    /// For adapters that need their own event type back (device-side waits).
    fn as_any(&self) -> &dyn Any;
}

/// A stream of a device: an in-order queue of asynchronous work.
///
/// # Safety
///
/// Implementations run the work enqueued on one stream in enqueue order, each item after
/// the previous one completed; [`copy`](Self::copy) keeps both memories alive (holds an
/// `Arc` of each) until the copy has completed; [`pinned_buffer`](Self::pinned_buffer) is
/// host memory of at least [`PINNED_BUFFER_MIN`] bytes, touched by the adapter only
/// through copies it was asked to perform. The VM relies on these for memory safety.
pub unsafe trait DeviceStream: Send + Sync + fmt::Debug + 'static {
    /// The device this stream runs on.
    fn device(&self) -> Device;

    /// Where kernel bodies run on this stream.
    fn kernel_mode(&self) -> KernelMode;

    /// Runs `f` on the host in stream order. Returns once it is enqueued (at once on an
    /// asynchronous device; after running it on a synchronous one).
    fn launch_host(&self, f: HostFn) -> Result<()>;

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` in stream
    /// order. Each side is memory of this stream's device or host memory, or, when the
    /// adapter [supports peer copies](DeviceAdapter::supports_peer_copy), memory of
    /// another device of the same kind.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`](crate::Error::OutOfBounds) if a range does not fit;
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) for memory of another device.
    ///
    /// # Safety
    ///
    /// Until the copy completes in stream order, nothing else writes the source range or
    /// touches the destination range.
    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;

    /// Records an event after every work item enqueued so far.
    fn record_event(&self) -> Result<Arc<dyn Event>>;

    /// Makes this stream's later work wait, on the device, for `event`.
    ///
    /// # Errors
    ///
    /// [`Error::ForeignEvent`](crate::Error::ForeignEvent) for an event of another device
    /// (or adapter).
    fn wait_event(&self, event: &dyn Event) -> Result<()>;

    /// Blocks the calling thread until every work item enqueued so far has completed.
    fn synchronize(&self) -> Result<()>;

    /// The stream's small pinned host buffer (at least [`PINNED_BUFFER_MIN`] bytes).
    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory>;

    /// An asynchronous failure the device reported on this stream since the last call
    /// (taken: the next call returns `None` unless another one happened).
    fn take_error(&self) -> Option<String> {
        None
    }

    /// For adapters that need their own stream type back.
    fn as_any(&self) -> &dyn Any;
}

/// A device adapter: the VM's door to every device of one [`DeviceKind`].
pub trait DeviceAdapter: Send + Sync + fmt::Debug + 'static {
    /// The kind of device it serves (one adapter per kind in a VM).
    fn kind(&self) -> DeviceKind;

    /// How many devices of this kind exist (valid indices are `0..device_count()`).
    fn device_count(&self) -> u32;

    /// Whether its streams support events that soft sync can use (device-side waits and
    /// host-observed records). The cpu adapter answers `false`: its work is synchronous.
    fn supports_events(&self) -> bool {
        true
    }

    /// Whether a stream of one of its devices copies memory of another of its devices
    /// (a peer copy: [`DeviceStream::copy`] with one side on another device of this
    /// kind). The VM then accepts device-to-device copies between two devices of this
    /// kind ([`InstructionsBuilder::copy`](crate::InstructionsBuilder::copy)). Default:
    /// `false`.
    fn supports_peer_copy(&self) -> bool {
        false
    }

    /// The policy of a VM stream of type `stream_type` on device `index`, whose device
    /// stream runs kernels in `mode`: what the engine asks of it (completion at launch or
    /// later, strict same-stream edges, placement on a worker, events for soft sync).
    /// Default: [`DeviceStreamPolicy`](crate::DeviceStreamPolicy) for the stream type,
    /// the mode and [`supports_events`](Self::supports_events).
    fn stream_policy(
        &self,
        index: u32,
        stream_type: StreamType,
        mode: KernelMode,
    ) -> Box<dyn policy::StreamPolicy> {
        let _ = index;
        Box::new(policy::DeviceStreamPolicy::new(
            stream_type,
            mode,
            self.supports_events(),
        ))
    }

    /// Creates a stream of device `index` for a VM stream of type `stream_type`.
    fn create_stream(&self, index: u32, stream_type: StreamType) -> Result<Arc<dyn DeviceStream>>;

    /// The allocator of device `index`.
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>>;
}

/// Checks that `offset..offset + len` lies inside `mem`, an overflowing end included:
/// [`OutOfBounds`](crate::Error::OutOfBounds) otherwise (adapters' copies and the VM's
/// small accesses use it).
pub fn check_range(mem: &dyn DeviceMemory, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > mem.nbytes()) {
        return Err(crate::Error::OutOfBounds {
            len,
            offset,
            size: mem.nbytes(),
        });
    }
    Ok(())
}

/// Waits until the device work queued so far on each of `streams` has completed, or until
/// `deadline`: records an event on each and waits for all of them together. Unlike
/// [`DeviceStream::synchronize`], which blocks for as long as the device takes, this wait
/// is bounded, so a device whose event never completes (or whose queue is held back by a
/// device-side wait on such an event) cannot hang its caller. Returns the indices of the
/// streams whose work had not completed by the deadline, each with the event it waited
/// for (empty: all done).
///
/// # Errors
/// What [`DeviceStream::record_event`] returns.
pub(crate) fn wait_streams(
    streams: &[&dyn DeviceStream],
    deadline: std::time::Instant,
) -> Result<Vec<(usize, Arc<dyn Event>)>> {
    use crate::util::futex::FutexWait;
    use ivm_core::counter::BlockingCounter;
    use ivm_core::wait::Wait;
    if streams.is_empty() {
        // Nothing to wait for, and nothing allocated (`sync` on a cpu-only VM).
        return Ok(Vec::new());
    }
    let count = u32::try_from(streams.len()).unwrap_or(u32::MAX);
    let done = Arc::new(BlockingCounter::<FutexWait>::new(count));
    let mut events = Vec::with_capacity(streams.len());
    for s in streams {
        let ev = match s.record_event() {
            Ok(ev) => ev,
            Err(e) => {
                // The callbacks already registered decrease a counter nobody waits on.
                return Err(e);
            }
        };
        let d2 = done.clone();
        // Release inside `decrease`: publishes the completion to the timed wait below
        // (its Acquire read of zero).
        ev.on_complete(Box::new(move || d2.decrease()));
        events.push(ev);
    }
    if let Ok(ivm_core::notifier::Timed::Notified) = done.timed_wait_until_zero(
        FutexWait::now()
            .saturating_add(deadline.saturating_duration_since(std::time::Instant::now())),
    ) {
        return Ok(Vec::new());
    }
    // An adapter may run an event's callbacks before `query` reports it done: ask only
    // after a timeout.
    Ok(events
        .into_iter()
        .enumerate()
        .filter(|(_, ev)| !ev.query())
        .collect())
}
