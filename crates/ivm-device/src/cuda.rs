//! `cuda` (feature `cuda`): the adapter traits over CUDA streams and events, through
//! `cudarc`'s driver API loaded at run time.
//!
//! * Creating the adapter checks that the driver library is present first (cudarc panics
//!   instead of erring without it) and returns [`Error::Device`] when it is not, or when
//!   the driver reports no device.
//! * Kernels run in [`KernelMode::Launcher`] mode: the body runs on the VM's worker thread
//!   and enqueues device work on [`KernelCtx::device_stream`](ivm_std::KernelCtx) (copies,
//!   host closures, or real kernels through the raw stream of [`CudaDeviceStream::cuda`]).
//! * Host closures run in stream order through `cuLaunchHostFunc` (they must not call the
//!   CUDA API); an event's completion is a host closure queued right after its record, so
//!   [`Event::on_complete`] wakes the VM without polling.
//! * Memory is device memory (`cuMemAlloc`, zero-filled); frees are stream-ordered: an
//!   event is recorded on the freeing stream and the memory returns to the driver once it
//!   completed (checked on later allocations and when the allocator drops). Nothing that
//!   a host function may drop calls the driver (CUDA forbids it there).
//! * Copies take host memory (cpu tensors, the stream's pinned buffer) or device memory
//!   of the stream's device, and keep both alive until the copy ran.
//!
//! Tested for real only where a GPU exists (`cargo test -p ivm-device --features cuda --
//! --ignored`).

use std::any::Any;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use cudarc::driver::safe::{CudaContext, CudaEvent, CudaStream};
use cudarc::driver::{DriverError, result, sys};
use ivm_core::sync::{AtomicBool, Ordering};
use ivm_std::device::check_range;
use ivm_std::panics::catch;
use ivm_std::{
    Device, DeviceAdapter, DeviceAllocator, DeviceKind, DeviceMemory, DeviceStream, Error, Event,
    HostFn, KernelMode, Result, StreamType,
};

fn derr(what: &str, e: DriverError) -> Error {
    Error::Device(format!("cuda: {what}: {e}"))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The CUDA adapter's device kind, `"cuda"`.
pub const CUDA: DeviceKind = DeviceKind::named("cuda");

/// `cuda:index`.
pub const fn cuda_device(index: u32) -> Device {
    Device { kind: CUDA, index }
}

/// The CUDA device adapter.
#[derive(Debug)]
pub struct CudaAdapter {
    contexts: Vec<OnceLock<Arc<CudaContext>>>,
    allocators: Vec<OnceLock<Arc<CudaAllocator>>>,
}

impl CudaAdapter {
    /// The adapter over every CUDA device of this machine.
    ///
    /// # Errors
    /// [`Error::Device`] when the driver library is missing, fails to initialise, or
    /// reports no device. Never panics for that.
    pub fn new() -> Result<Arc<Self>> {
        // SAFETY: `is_culib_present` only tries to load the driver library by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Device(
                "cuda: the CUDA driver library (libcuda) is not present".into(),
            ));
        }
        let n = CudaContext::device_count().map_err(|e| derr("device count", e))?;
        let n = usize::try_from(n).unwrap_or(0);
        if n == 0 {
            return Err(Error::Device("cuda: no CUDA device".into()));
        }
        Ok(Arc::new(Self {
            contexts: (0..n).map(|_| OnceLock::new()).collect(),
            allocators: (0..n).map(|_| OnceLock::new()).collect(),
        }))
    }

    fn context(&self, index: u32) -> Result<Arc<CudaContext>> {
        let slot = self.contexts.get(index as usize).ok_or_else(|| {
            Error::UnsupportedStream(format!(
                "cuda:{index}: {} CUDA device(s)",
                self.contexts.len()
            ))
        })?;
        if let Some(c) = slot.get() {
            return Ok(c.clone());
        }
        let c = CudaContext::new(index as usize).map_err(|e| derr("context", e))?;
        Ok(slot.get_or_init(|| c).clone())
    }

    fn cuda_allocator(&self, index: u32) -> Result<Arc<CudaAllocator>> {
        let ctx = self.context(index)?;
        Ok(self.allocators[index as usize]
            .get_or_init(|| {
                Arc::new(CudaAllocator {
                    device: cuda_device(index),
                    ctx,
                    deferred: Arc::new(Mutex::new(Vec::new())),
                })
            })
            .clone())
    }
}

impl DeviceAdapter for CudaAdapter {
    fn kind(&self) -> DeviceKind {
        CUDA
    }
    fn device_count(&self) -> u32 {
        u32::try_from(self.contexts.len()).unwrap_or(u32::MAX)
    }
    fn create_stream(&self, index: u32, _stream_type: StreamType) -> Result<Arc<dyn DeviceStream>> {
        let ctx = self.context(index)?;
        let stream = ctx.new_stream().map_err(|e| derr("stream", e))?;
        let pinned: Arc<dyn DeviceMemory> = Arc::new(PinnedMemory::new(&ctx, 64)?);
        Ok(Arc::new(CudaDeviceStream {
            device: cuda_device(index),
            ctx,
            stream,
            pinned,
            error: Arc::new(Mutex::new(None)),
        }))
    }
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>> {
        Ok(self.cuda_allocator(index)?)
    }
}

/// Page-locked host memory (a stream's pinned buffer).
#[derive(Debug)]
pub struct PinnedMemory {
    ptr: NonNull<u8>,
    nbytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: owns a page-locked host allocation; accesses are ordered by the VM.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above; only raw pointers are handed out.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    fn new(ctx: &Arc<CudaContext>, nbytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| derr("bind", e))?;
        // SAFETY: allocates `nbytes` page-locked bytes (flags 0); we zero them below.
        let p = unsafe { result::malloc_host(nbytes, 0) }.map_err(|e| derr("pinned", e))?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::Device("cuda: null pinned allocation".into()))?;
        // SAFETY: fresh allocation of `nbytes` bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, nbytes) };
        Ok(Self {
            ptr,
            nbytes,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host`, freed once; no copy uses it any more (the
        // streams holding it keep it alive until their work ran).
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast::<c_void>()) };
    }
}

// SAFETY: page-locked host memory (page-aligned, zeroed, valid until drop); always the
// same pointer.
unsafe impl DeviceMemory for PinnedMemory {
    fn device(&self) -> Device {
        Device::CPU
    }
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
    fn device_ptr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Frees waiting to be returned to the driver: (event that must complete first, pointer).
type Deferred = Arc<Mutex<Vec<(Option<CudaEvent>, sys::CUdeviceptr)>>>;

/// Device memory of one CUDA device.
///
/// Dropping it never calls the driver (the last handle may go inside a host function,
/// where CUDA calls are forbidden): the pointer joins the allocator's deferred frees.
#[derive(Debug)]
pub struct CudaMemory {
    ptr: sys::CUdeviceptr,
    nbytes: usize,
    device: Device,
    /// A stream-ordered free was queued (the allocator returns it to the driver).
    freed: AtomicBool,
    deferred: Deferred,
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // Acquire: pairs with the AcqRel swap in `free_on`.
        if self.ptr != 0 && !self.freed.load(Ordering::Acquire) {
            // No `free_on`: the VM dropped its last handle once nothing used it any more.
            lock(&self.deferred).push((None, self.ptr));
        }
    }
}

// SAFETY: device memory: no host pointer is handed out.
unsafe impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        self.device
    }
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The allocator of one CUDA device: `cuMemAlloc` (zero-filled); frees are deferred until
/// an event recorded on the freeing stream completed.
#[derive(Debug)]
pub struct CudaAllocator {
    device: Device,
    ctx: Arc<CudaContext>,
    deferred: Deferred,
}

impl CudaAllocator {
    /// Returns to the driver every deferred free whose event completed (all of them,
    /// waiting, with `all`). Called on ordinary threads only (allocations, drop).
    fn reclaim(&self, all: bool) {
        let mut d = lock(&self.deferred);
        let _ = self.ctx.bind_to_thread();
        d.retain(|(ev, ptr)| {
            if let Some(ev) = ev {
                if all {
                    let _ = ev.synchronize();
                } else if !ev.is_complete() {
                    return true;
                }
            }
            // SAFETY: the event recorded after every use on the freeing stream completed;
            // soft sync ordered other streams' uses before it; freed once.
            let _ = unsafe { result::free_sync(*ptr) };
            false
        });
    }
}

impl Drop for CudaAllocator {
    fn drop(&mut self) {
        self.reclaim(true);
    }
}

impl DeviceAllocator for CudaAllocator {
    fn allocate(&self, nbytes: usize) -> Result<Arc<dyn DeviceMemory>> {
        self.reclaim(false);
        self.ctx.bind_to_thread().map_err(|e| derr("bind", e))?;
        let ptr = if nbytes == 0 {
            0
        } else {
            // SAFETY: a plain allocation, zero-filled below before anyone sees it.
            let p = unsafe { result::malloc_sync(nbytes) }.map_err(|e| derr("alloc", e))?;
            // SAFETY: `p` is a fresh allocation of `nbytes` bytes.
            unsafe { result::memset_d8_sync(p, 0, nbytes) }.map_err(|e| derr("memset", e))?;
            p
        };
        Ok(Arc::new(CudaMemory {
            ptr,
            nbytes,
            device: self.device,
            freed: AtomicBool::new(false),
            deferred: self.deferred.clone(),
        }))
    }

    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()> {
        let (Some(m), Some(s)) = (
            mem.as_any().downcast_ref::<CudaMemory>(),
            stream.as_any().downcast_ref::<CudaDeviceStream>(),
        ) else {
            return Err(Error::DeviceMismatch(format!(
                "the allocator of {} frees its own memory on its own streams",
                self.device
            )));
        };
        if m.device != self.device || s.device != self.device {
            return Err(Error::DeviceMismatch(format!(
                "memory of {} freed on a stream of {} by the allocator of {}",
                m.device, s.device, self.device
            )));
        }
        // AcqRel: one free wins; Drop then leaves the pointer to us.
        if m.ptr == 0 || m.freed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let ev = s.ctx.new_event(None).map_err(|e| derr("event", e))?;
        ev.record(&s.stream).map_err(|e| derr("record", e))?;
        lock(&self.deferred).push((Some(ev), m.ptr));
        Ok(())
    }
}

#[derive(Default)]
struct Done {
    state: Mutex<(bool, Vec<HostFn>)>,
    cv: Condvar,
}

impl Done {
    fn complete(&self) {
        let callbacks = {
            let mut s = lock(&self.state);
            s.0 = true;
            std::mem::take(&mut s.1)
        };
        self.cv.notify_all();
        for f in callbacks {
            f();
        }
    }
}

/// An event recorded on a CUDA stream; completed by a host function queued after it.
pub struct CudaDeviceEvent {
    device: Device,
    event: CudaEvent,
    done: Arc<Done>,
}

impl std::fmt::Debug for CudaDeviceEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceEvent")
            .field("device", &self.device)
            .finish()
    }
}

impl Event for CudaDeviceEvent {
    fn device(&self) -> Device {
        self.device
    }
    fn query(&self) -> bool {
        lock(&self.done.state).0
    }
    fn synchronize(&self) -> Result<()> {
        let mut s = lock(&self.done.state);
        while !s.0 {
            // A device fault can keep the host function from ever running: look at the
            // event itself now and then.
            let (g, _) = self
                .done
                .cv
                .wait_timeout(s, Duration::from_millis(10))
                .unwrap_or_else(PoisonError::into_inner);
            s = g;
            if !s.0
                && let Err(e) = self.event.try_is_complete()
            {
                return Err(derr("event", e));
            }
        }
        Ok(())
    }
    fn on_complete(&self, f: HostFn) {
        let mut s = lock(&self.done.state);
        if s.0 {
            drop(s);
            f();
        } else {
            s.1.push(f);
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A CUDA stream of one device.
pub struct CudaDeviceStream {
    device: Device,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pinned: Arc<dyn DeviceMemory>,
    error: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for CudaDeviceStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceStream")
            .field("device", &self.device)
            .finish()
    }
}

impl Drop for CudaDeviceStream {
    fn drop(&mut self) {
        // Let every queued host function run (and drop what it holds) while the stream and
        // its pinned buffer still exist; nothing may be freed from inside one.
        let _ = self.stream.synchronize();
    }
}

impl CudaDeviceStream {
    /// The cudarc stream (to launch real kernels on it).
    pub fn cuda(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn side(&self, m: &dyn DeviceMemory) -> Result<Side> {
        if let Some(c) = m.as_any().downcast_ref::<CudaMemory>() {
            if c.device == self.device {
                return Ok(Side::Device(c.ptr));
            }
        } else if m.device() == Device::CPU
            && let Some(p) = m.host_ptr()
        {
            return Ok(Side::Host(p.as_ptr()));
        }
        Err(Error::DeviceMismatch(format!(
            "a stream of {} copies memory of {} or host memory, not of {}",
            self.device,
            self.device,
            m.device()
        )))
    }
}

enum Side {
    Host(*mut u8),
    Device(sys::CUdeviceptr),
}

unsafe extern "C" fn trampoline(arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<HostFn>` leaked by `launch_host` for exactly this call.
    let f = unsafe { Box::from_raw(arg.cast::<HostFn>()) };
    // Never unwind into the driver (the payload is dropped under a catch of its own).
    let _ = catch(move || (*f)());
}

// SAFETY: a CUDA stream runs its work in order; copies are followed by a host function that
// holds both memories until it ran; the pinned buffer is 64 page-locked bytes.
unsafe impl DeviceStream for CudaDeviceStream {
    fn device(&self) -> Device {
        self.device
    }
    fn kernel_mode(&self) -> KernelMode {
        KernelMode::Launcher
    }
    fn launch_host(&self, f: HostFn) -> Result<()> {
        let err = self.error.clone();
        let device = self.device;
        let g: HostFn = Box::new(move || {
            if let Err(msg) = catch(f) {
                let mut e = lock(&err);
                if e.is_none() {
                    *e = Some(format!("{device}: host closure panicked: {msg}"));
                }
            }
        });
        self.ctx.bind_to_thread().map_err(|e| derr("bind", e))?;
        let raw = Box::into_raw(Box::new(g)).cast::<c_void>();
        // SAFETY: the stream is alive; `trampoline` takes ownership of `raw` when it runs.
        if let Err(e) = unsafe {
            result::stream::launch_host_function(self.stream.cu_stream(), trampoline, raw)
        } {
            // SAFETY: the launch failed, so the driver will not call `trampoline`: the box
            // is still ours.
            drop(unsafe { Box::from_raw(raw.cast::<HostFn>()) });
            return Err(derr("launch host function", e));
        }
        Ok(())
    }
    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range(&**src, src_offset, len)?;
        check_range(&**dst, dst_offset, len)?;
        let (s, d) = (self.side(&**src)?, self.side(&**dst)?);
        if let (Side::Host(sp), Side::Host(dp)) = (&s, &d) {
            let (sp, dp) = (*sp as usize, *dp as usize);
            let keep = (src.clone(), dst.clone());
            return self.launch_host(Box::new(move || {
                // SAFETY: ranges checked above; `keep` holds both memories; the caller
                // guarantees nothing else touches the ranges; stream order runs this once.
                unsafe {
                    std::ptr::copy(
                        (sp as *const u8).add(src_offset),
                        (dp as *mut u8).add(dst_offset),
                        len,
                    )
                };
                drop(keep);
            }));
        }
        if len > 0 {
            self.ctx.bind_to_thread().map_err(|e| derr("bind", e))?;
            let cs = self.stream.cu_stream();
            // SAFETY: (all arms) ranges checked above; both memories stay alive until the
            // keep-alive host function below ran; the caller guarantees nothing else
            // touches the ranges until the copy completes.
            let r = unsafe {
                match (s, d) {
                    (Side::Host(sp), Side::Device(dp)) => result::memcpy_htod_async(
                        dp + dst_offset as u64,
                        std::slice::from_raw_parts(sp.add(src_offset), len),
                        cs,
                    ),
                    (Side::Device(sp), Side::Host(dp)) => result::memcpy_dtoh_async(
                        std::slice::from_raw_parts_mut(dp.add(dst_offset), len),
                        sp + src_offset as u64,
                        cs,
                    ),
                    (Side::Device(sp), Side::Device(dp)) => result::memcpy_dtod_async(
                        dp + dst_offset as u64,
                        sp + src_offset as u64,
                        len,
                        cs,
                    ),
                    (Side::Host(_), Side::Host(_)) => unreachable!("handled above"),
                }
            };
            r.map_err(|e| derr("copy", e))?;
        }
        let keep = (src.clone(), dst.clone());
        self.launch_host(Box::new(move || drop(keep)))
    }
    fn record_event(&self) -> Result<Arc<dyn Event>> {
        let event = self.ctx.new_event(None).map_err(|e| derr("event", e))?;
        event.record(&self.stream).map_err(|e| derr("record", e))?;
        let done = Arc::new(Done::default());
        let d2 = done.clone();
        self.launch_host(Box::new(move || d2.complete()))?;
        Ok(Arc::new(CudaDeviceEvent {
            device: self.device,
            event,
            done,
        }))
    }
    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        match event.as_any().downcast_ref::<CudaDeviceEvent>() {
            Some(e) if e.device == self.device => {
                self.stream.wait(&e.event).map_err(|e| derr("wait", e))
            }
            _ => Err(Error::ForeignEvent {
                stream: self.device,
                event: event.device(),
            }),
        }
    }
    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| derr("synchronize", e))
    }
    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory> {
        &self.pinned
    }
    fn take_error(&self) -> Option<String> {
        if let Some(e) = lock(&self.error).take() {
            return Some(e);
        }
        self.ctx.check_err().err().map(|e| format!("cuda: {e}"))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
