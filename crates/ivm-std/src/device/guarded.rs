//! The VM's side of a device adapter's objects: every call into an adapter's stream, event
//! or allocator goes through these wrappers, which turn the adapter's panic into an
//! [`Error::Device`] naming the call, so that a third-party adapter that panics fails the
//! work it was given — never a worker, a device thread or the engine.
//!
//! A closure handed to a call that panicked ([`DeviceStream::launch_host`],
//! [`Event::on_complete`]) never runs: the adapter may have queued it before it
//! panicked, so the closure it holds only takes the real one out of a shared slot, which
//! the panicking call empties first. The VM's completion closures rely on that: each
//! owns the instruction's cells until it runs, and a launch that failed hands them to
//! the failure path instead (ARCHITECTURE.md, "Code the user hands to the VM").

use std::any::Any;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::device::{
    DeviceAllocator, DeviceMemory, DeviceStream, Event, HostFn, HostPtr, KernelMode,
};
use crate::util::error::{Error, Result};
use crate::util::ids::Device;
use crate::util::lock;
use crate::util::panics::catch;

/// The error for an adapter's `call` that panicked with `message`.
fn panicked(device: Device, call: &str, message: &str) -> Error {
    Error::Device(format!("the {device} adapter's {call} panicked: {message}"))
}

/// Runs the adapter call `f`; a panic becomes an [`Error::Device`].
fn guard<R>(device: Device, call: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    catch(f).unwrap_or_else(|message| Err(panicked(device, call, &message)))
}

/// `f` in a shared slot, and the closure to hand the adapter instead: it runs `f` if the
/// slot still holds it. Whoever empties the slot first (that closure, or the failure path
/// of a call that panicked) owns `f` (the module docs).
fn slotted(f: HostFn) -> (Arc<Mutex<Option<HostFn>>>, HostFn) {
    let slot = Arc::new(Mutex::new(Some(f)));
    let queued = slot.clone();
    let via: HostFn = Box::new(move || {
        let f = lock(&queued).take();
        if let Some(f) = f {
            f();
        }
    });
    (slot, via)
}

/// Hands `f` to the adapter through `call` so that, if `call` panics, `f` never runs
/// (the module docs).
fn hand_over(
    device: Device,
    what: &str,
    f: HostFn,
    call: impl FnOnce(HostFn) -> Result<()>,
) -> Result<()> {
    let (slot, via) = slotted(f);
    match catch(move || call(via)) {
        Ok(r) => r,
        Err(message) => {
            let unrun = lock(&slot).take();
            drop(unrun);
            Err(panicked(device, what, &message))
        }
    }
}

/// An adapter's stream, as the VM calls it (module docs).
pub(crate) struct GuardedStream {
    inner: Arc<dyn DeviceStream>,
    device: Device,
    mode: KernelMode,
    /// Asked once, when the stream is created (it returns a reference, so a panic could
    /// not be answered later).
    pinned: Arc<dyn DeviceMemory>,
    /// Panics of the stream's events' `on_complete` and of its allocator's memory,
    /// reported as the stream's next device error ([`DeviceStream::take_error`]).
    errors: Arc<Mutex<Option<String>>>,
}

impl GuardedStream {
    /// Wraps `inner`, asking it once for what it must answer without failing. `errors`:
    /// its next device errors, shared with the allocator made with it (its memory's).
    pub(crate) fn wrap(
        inner: Arc<dyn DeviceStream>,
        errors: Arc<Mutex<Option<String>>>,
    ) -> Result<Arc<dyn DeviceStream>> {
        let (device, mode, pinned) = catch(|| {
            (
                inner.device(),
                inner.kernel_mode(),
                inner.pinned_buffer().clone(),
            )
        })
        .map_err(|m| Error::Device(format!("a device adapter's new stream panicked: {m}")))?;
        Ok(Arc::new(Self {
            inner,
            device,
            mode,
            pinned,
            errors,
        }))
    }
}

impl fmt::Debug for GuardedStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedStream")
            .field("device", &self.device)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

// SAFETY: every call is the wrapped stream's own, which upholds the contract; the pinned
// buffer is the one it returned.
unsafe impl DeviceStream for GuardedStream {
    fn device(&self) -> Device {
        self.device
    }

    fn kernel_mode(&self) -> KernelMode {
        self.mode
    }

    fn launch_host(&self, f: HostFn) -> Result<()> {
        hand_over(self.device, "launch_host", f, |f| self.inner.launch_host(f))
    }

    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        guard(self.device, "copy", || {
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { self.inner.copy(src, src_offset, dst, dst_offset, len) }
        })
    }

    fn record_event(&self) -> Result<Arc<dyn Event>> {
        let inner = guard(self.device, "record_event", || self.inner.record_event())?;
        Ok(Arc::new(GuardedEvent {
            inner,
            device: self.device,
            errors: self.errors.clone(),
        }))
    }

    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        // The adapter downcasts `as_any` to its own event type: a guarded event answers
        // with the wrapped one.
        guard(self.device, "wait_event", || self.inner.wait_event(event))
    }

    fn synchronize(&self) -> Result<()> {
        guard(self.device, "synchronize", || self.inner.synchronize())
    }

    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory> {
        &self.pinned
    }

    fn take_error(&self) -> Option<String> {
        let own = lock(&self.errors).take();
        own.or_else(|| {
            catch(|| self.inner.take_error()).unwrap_or_else(|m| {
                Some(format!(
                    "the {} adapter's take_error panicked: {m}",
                    self.device
                ))
            })
        })
    }

    fn as_any(&self) -> &dyn Any {
        // The adapter's own stream type, for adapters and transports that downcast.
        self.inner.as_any()
    }
}

/// An adapter's event, as the VM calls it (module docs).
struct GuardedEvent {
    inner: Arc<dyn Event>,
    device: Device,
    /// Its stream's pending errors (`GuardedStream::errors`).
    errors: Arc<Mutex<Option<String>>>,
}

impl fmt::Debug for GuardedEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl Event for GuardedEvent {
    fn device(&self) -> Device {
        self.device
    }

    /// A panic answers "not complete": waits on the event are bounded, never lied to.
    fn query(&self) -> bool {
        catch(|| self.inner.query()).unwrap_or(false)
    }

    fn synchronize(&self) -> Result<()> {
        guard(self.device, "Event::synchronize", || {
            self.inner.synchronize()
        })
    }

    /// If the adapter's `on_complete` panics, nothing will call `f` later (the module
    /// docs): the panic becomes the stream's next device error, then `f` runs at once on
    /// this thread. The VM's callbacks observe that error (the instruction fails, its
    /// outputs poisoned) instead of waiting for a call that never comes.
    fn on_complete(&self, f: HostFn) {
        let (slot, via) = slotted(f);
        if let Err(m) = catch(move || self.inner.on_complete(via)) {
            let e = panicked(self.device, "Event::on_complete", &m).to_string();
            lock(&self.errors).get_or_insert(e);
            let unrun = lock(&slot).take();
            if let Some(f) = unrun {
                f();
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        // The adapter's own event type, for its `wait_event`.
        self.inner.as_any()
    }
}

/// An adapter's allocator, as the VM calls it (module docs).
#[derive(Debug)]
pub(crate) struct GuardedAllocator {
    inner: Arc<dyn DeviceAllocator>,
    device: Device,
    /// Where its memory's panics go: the stream's next device error (the stream made with
    /// this allocator shares the slot, [`GuardedStream::wrap`]).
    errors: Arc<Mutex<Option<String>>>,
}

impl GuardedAllocator {
    pub(crate) fn wrap(
        inner: Arc<dyn DeviceAllocator>,
        device: Device,
        errors: Arc<Mutex<Option<String>>>,
    ) -> Arc<dyn DeviceAllocator> {
        Arc::new(Self {
            inner,
            device,
            errors,
        })
    }
}

impl DeviceAllocator for GuardedAllocator {
    fn allocate(&self, nbytes: usize) -> Result<Arc<dyn DeviceMemory>> {
        guard(self.device, "allocate", || {
            let inner = self.inner.allocate(nbytes)?;
            Ok(Arc::new(GuardedMemory {
                nbytes: inner.nbytes(),
                host: HostPtr(inner.host_ptr()),
                inner: ManuallyDrop::new(inner),
                device: self.device,
                errors: self.errors.clone(),
            }) as Arc<dyn DeviceMemory>)
        })
    }

    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()> {
        guard(self.device, "free_on", || self.inner.free_on(mem, stream))
    }
}

/// An adapter's memory, as the VM holds it: the two calls that cannot answer with an error,
/// `end_access` and the drop (a tensor's last handle may go on any thread, the user's
/// included), run under a catch, and a panic becomes the stream's next device error.
/// Its size and host pointer are asked once, when it is allocated.
#[derive(Debug)]
struct GuardedMemory {
    inner: ManuallyDrop<Arc<dyn DeviceMemory>>,
    nbytes: usize,
    host: HostPtr,
    device: Device,
    errors: Arc<Mutex<Option<String>>>,
}

impl GuardedMemory {
    fn note(&self, call: &str, message: &str) {
        let e = format!(
            "the {} adapter's memory {call} panicked: {message}",
            self.device
        );
        lock(&self.errors).get_or_insert(e);
    }
}

// SAFETY: the wrapped memory keeps the contract; the host pointer is the answer it gave
// (the same every time, by that contract), the size the one it gave.
unsafe impl DeviceMemory for GuardedMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn nbytes(&self) -> usize {
        self.nbytes
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        self.host.0
    }

    fn device_ptr(&self) -> u64 {
        self.inner.device_ptr()
    }

    fn begin_access(&self) -> Result<()> {
        guard(self.device, "begin_access", || self.inner.begin_access())
    }

    fn end_access(&self) {
        if let Err(m) = catch(|| self.inner.end_access()) {
            self.note("end_access", &m);
        }
    }

    fn as_any(&self) -> &dyn Any {
        // The adapter's own memory type, for its downcasts.
        self.inner.as_any()
    }
}

impl Drop for GuardedMemory {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and not touched after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        if let Err(m) = catch(move || drop(inner)) {
            self.note("drop", &m);
        }
    }
}
