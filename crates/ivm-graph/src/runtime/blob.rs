//! A graph blob's register slots (the register protocol is in the parent module's docs).

use ivm_core::sync::UnsafeCell;
use ivm_std::{DeviceMemory, HostMemory};

/// A graph blob: `depth` register slots if an actor produces it, one (zero, read-only)
/// slot otherwise. Each slot is the VM's host memory (zeroed, aligned to two cache lines
/// and padded to them): a slot shares no cache line with another allocation, which a
/// thread could write while a kernel computes on the slot.
pub(super) struct GBlob {
    nbytes: usize,
    slots: Box<[UnsafeCell<HostMemory>]>,
}

// SAFETY: a slot is written only by the blob's producer actor while no consumer reads it,
// and read by consumers only after the producer published it (the register protocol in
// the module docs; each hand-over is a Release/Acquire pair on an actor's `done`).
unsafe impl Sync for GBlob {}

impl GBlob {
    /// `slots` zero-filled slots of `nbytes`, or why the host cannot provide them.
    pub(super) fn new(nbytes: usize, slots: usize) -> std::result::Result<Self, String> {
        let mut v = Vec::new();
        v.try_reserve_exact(slots)
            .map_err(|_| format!("{slots} register slots do not fit in memory"))?;
        for _ in 0..slots {
            let slot = HostMemory::try_zeroed(nbytes).map_err(|e| e.to_string())?;
            v.push(UnsafeCell::new(slot));
        }
        Ok(Self {
            nbytes,
            slots: v.into_boxed_slice(),
        })
    }

    pub(super) fn slot_index(&self, iteration: usize) -> usize {
        iteration % self.slots.len()
    }

    /// The slot of `iteration`.
    ///
    /// # Safety
    /// The caller is a consumer firing `iteration` (its producer published the slot and
    /// cannot overwrite it before the caller's `done` moves past `iteration`), or a
    /// constant blob; the slice does not outlive the firing.
    pub(super) unsafe fn read(&self, iteration: usize) -> &[u8] {
        let nbytes = self.nbytes;
        // SAFETY: by the caller's contract no write to this slot runs concurrently; the
        // slot holds `nbytes` initialised (zeroed, then written) bytes.
        self.slots[self.slot_index(iteration)]
            .with(|p| unsafe { std::slice::from_raw_parts(host(&*p), nbytes) })
    }

    /// The slot of `iteration`, mutably.
    ///
    /// # Safety
    /// The caller is the blob's producer firing `iteration` (every consumer finished the
    /// slot's previous iteration); the slice does not outlive the firing and is the only
    /// one.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn write(&self, iteration: usize) -> &mut [u8] {
        let nbytes = self.nbytes;
        // SAFETY: by the caller's contract this is the only access to the slot, which
        // holds `nbytes` initialised bytes.
        self.slots[self.slot_index(iteration)]
            .with_mut(|p| unsafe { std::slice::from_raw_parts_mut(host(&*p), nbytes) })
    }
}

/// The bytes of a slot: cpu host memory always has a host pointer.
fn host(m: &HostMemory) -> *mut u8 {
    m.host_ptr()
        .expect("cpu memory has a host pointer")
        .as_ptr()
}
