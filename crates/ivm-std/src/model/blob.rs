//! The eager blob object that instructions hold: memory on a device plus its dependence,
//! and its poison (a failed producer's error). Users hold a [`Tensor`](crate::Tensor)
//! instead (`tensor.rs`).

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crossbeam_utils::CachePadded;

use ivm_core::sync::{AtomicBool, Ordering};

use crate::device::cpu::HostMemory;
use crate::device::{DeviceMemory, HostPtr};
use crate::model::dependence::Dependence;
use crate::util::error::Failure;
use crate::util::ids::Device;

/// The eager blob object: memory on a device plus its dependence. Instructions hold it
/// through `Arc<Blob>`, never through a user [`Tensor`].
pub(crate) struct Blob {
    pub(crate) id: usize,
    pub(crate) device: Device,
    pub(crate) nbytes: usize,
    /// The memory (host memory for cpu tensors; an adapter's allocation otherwise).
    /// Invariant ("engine-ordered"): only instruction bodies (and the device work they
    /// enqueue) touch it, and the engine never has a body writing it lively-and-running
    /// together with any other body accessing it (writes connect to every earlier access;
    /// reads to the leading write; same-stream sources run earlier on the same in-order
    /// thread or device queue; work on other streams of an asynchronous device is ordered
    /// by soft sync).
    pub(crate) mem: Arc<dyn DeviceMemory>,
    /// `mem.host_ptr()`, asked once (the `DeviceMemory` contract makes the answer the same
    /// on every call): a kernel reaches its operands' bytes without a dynamic call per
    /// operand (two through a caching allocator's block).
    host: HostPtr,
    /// Written by the engine for every instruction that uses the blob, on whichever thread
    /// drives it (usually the submitting caller): on cache lines of its own, so that a
    /// worker on another core reading `mem`, `nbytes` and `poisoned` (every instruction
    /// body does) does not miss each time. `CachePadded` also aligns the whole blob, which
    /// keeps `Arc`'s reference counts (cloned by the builder) off those lines too.
    pub(crate) dep: CachePadded<Dependence>,
    poisoned: AtomicBool,
    poison: Mutex<Option<Failure>>,
}

impl Blob {
    /// A blob of `nbytes` zero-filled bytes of host memory.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new(vm_id: usize, id: usize, device: Device, nbytes: usize) -> Self {
        let mut b = Self::with_memory(vm_id, id, Arc::new(HostMemory::zeroed(nbytes)));
        b.device = device;
        b
    }

    /// A blob over memory an allocator returned.
    pub(crate) fn with_memory(vm_id: usize, id: usize, mem: Arc<dyn DeviceMemory>) -> Self {
        Self {
            id,
            device: mem.device(),
            nbytes: mem.nbytes(),
            host: HostPtr(mem.host_ptr()),
            mem,
            dep: CachePadded::new(Dependence::new(vm_id)),
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
        }
    }

    /// The contents.
    ///
    /// # Safety
    /// Called from an instruction body that reads this blob (engine-ordered invariant):
    /// no body writing it runs concurrently, and the returned slice does not outlive the
    /// body.
    ///
    /// # Panics
    /// If the memory is not host-accessible (device-only memory: use device pointers),
    /// unless it is empty.
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        if self.nbytes == 0 {
            // Nothing to reach: an empty tensor has no bytes on any device.
            return &[];
        }
        let p = self.host_ptr();
        // SAFETY: engine-ordered invariant (no concurrent writer); the `DeviceMemory`
        // contract makes `p` valid for `nbytes` initialised bytes while `mem` lives.
        unsafe { std::slice::from_raw_parts(p.as_ptr(), self.nbytes) }
    }

    fn host_ptr(&self) -> NonNull<u8> {
        self.host.0.unwrap_or_else(|| {
            panic!(
                "ivm: the memory of this {}-byte tensor on {} is not host-accessible; use its device pointer",
                self.nbytes, self.device
            )
        })
    }

    /// The contents, mutably.
    ///
    /// # Safety
    /// Called from an instruction body that writes this blob (engine-ordered invariant):
    /// no other body accesses it concurrently, the body asks for it at most once at a
    /// time, and the slice does not outlive the body.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &mut [u8] {
        if self.nbytes == 0 {
            // As in `bytes`.
            return &mut [];
        }
        let p = self.host_ptr();
        // SAFETY: engine-ordered invariant (exclusive access for this body); the memory is
        // valid for `nbytes` initialised bytes (the `DeviceMemory` contract).
        unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.nbytes) }
    }

    /// The failure that poisoned this blob, if any.
    pub(crate) fn poison(&self) -> Option<Failure> {
        // Acquire: pairs with the Release in `set_poison`, publishing the stored failure.
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.poison
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Poisons the blob (first failure wins).
    pub(crate) fn set_poison(&self, f: &Failure) {
        let mut g = self.poison.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(f.clone());
        }
        drop(g);
        // Release: publishes the failure stored above to `poison()`.
        self.poisoned.store(true, Ordering::Release);
    }
}
