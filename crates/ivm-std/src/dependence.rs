//! Dependences: the scheduling identity of a piece of data (a tensor, a stream's schedule
//! order). A dependence keeps the list of accesses since its last write; the engine turns
//! each new access into edges (see `engine.rs`).

use ivm_core::sync::UnsafeCell;

use crate::slab::IdxList;

/// A dependence. Its access list lives in the engine's access pool and is threaded through
/// the engine's `Access` entries; the dependence holds only the list head.
///
/// Invariant ("engine only"): `accesses` is read and written only by the engine of VM
/// `vm_id`, i.e. by code holding that VM's unique `&mut Engine` (the scheduler thread in
/// multi-thread mode, the thread holding the engine lock in single-thread mode). Builders
/// check `vm_id` before an instruction naming this dependence reaches an engine.
pub(crate) struct Dependence {
    pub(crate) vm_id: usize,
    accesses: UnsafeCell<IdxList>,
}

// SAFETY: the only non-Sync part is `accesses`, touched only under the "engine only"
// invariant above: one thread at a time, and the engine lock or the scheduler thread's
// ownership of the engine orders successive users.
unsafe impl Sync for Dependence {}
// SAFETY: as above; `IdxList` is plain data.
unsafe impl Send for Dependence {}

impl Dependence {
    pub(crate) fn new(vm_id: usize) -> Self {
        Self {
            vm_id,
            accesses: UnsafeCell::new(IdxList::new()),
        }
    }

    /// The access list head.
    ///
    /// # Safety
    /// The caller is the engine of VM `self.vm_id` (holds its `&mut Engine`).
    pub(crate) unsafe fn list(&self) -> IdxList {
        // SAFETY: engine-only invariant; the caller's `&mut Engine` excludes every other
        // reader or writer of this cell.
        self.accesses.with(|p| unsafe { *p })
    }

    /// Replaces the access list head.
    ///
    /// # Safety
    /// As for [`Dependence::list`].
    pub(crate) unsafe fn set_list(&self, list: IdxList) {
        // SAFETY: engine-only invariant, as in `list`.
        self.accesses.with_mut(|p| unsafe { *p = list })
    }
}

impl std::fmt::Debug for Dependence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dependence")
            .field("vm_id", &self.vm_id)
            .finish_non_exhaustive()
    }
}
