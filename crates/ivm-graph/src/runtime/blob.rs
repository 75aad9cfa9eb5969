//! A graph blob's register slots (the register protocol is in the parent module's docs).

use ivm_core::sync::UnsafeCell;

/// `words` zero words, or why the host cannot provide them (sizes come from the user: an
/// error, never an abort).
fn try_zeroed_words(words: usize) -> std::result::Result<Box<[u64]>, String> {
    let mut w = Vec::new();
    w.try_reserve_exact(words).map_err(|_| {
        format!(
            "the host allocator refused {words} words ({} bytes)",
            words.saturating_mul(8)
        )
    })?;
    // Within the reserved capacity: no reallocation.
    w.resize(words, 0);
    Ok(w.into_boxed_slice())
}

/// A graph blob: `depth` register slots if an actor produces it, one (zero, read-only)
/// slot otherwise.
pub(super) struct GBlob {
    nbytes: usize,
    slots: Box<[UnsafeCell<Box<[u64]>>]>,
}

// SAFETY: a slot is written only by the blob's producer actor while no consumer reads it,
// and read by consumers only after the producer published it (the register protocol in
// the module docs; each hand-over is a Release/Acquire pair on an actor's `done`).
unsafe impl Sync for GBlob {}

impl GBlob {
    /// `slots` zero-filled slots of `nbytes`, or why the host cannot provide them.
    pub(super) fn new(nbytes: usize, slots: usize) -> std::result::Result<Self, String> {
        let words = nbytes.div_ceil(8);
        let mut v = Vec::new();
        v.try_reserve_exact(slots)
            .map_err(|_| format!("{slots} register slots do not fit in memory"))?;
        for _ in 0..slots {
            v.push(UnsafeCell::new(try_zeroed_words(words)?));
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
        // box holds at least `nbytes` initialised bytes.
        self.slots[self.slot_index(iteration)]
            .with(|p| unsafe { std::slice::from_raw_parts((*p).as_ptr().cast::<u8>(), nbytes) })
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
        // SAFETY: by the caller's contract this is the only access to the slot.
        self.slots[self.slot_index(iteration)].with_mut(|p| unsafe {
            std::slice::from_raw_parts_mut((*p).as_mut_ptr().cast::<u8>(), nbytes)
        })
    }
}
