//! Dependences: the scheduling identity of a piece of data (a tensor, a buffer, a register
//! block). A dependence keeps the list of accesses since its last write; the engine turns
//! each new access into edges (a write waits for every access since the last write, a read
//! waits for the last write).

use ivm_core::list::IndexList;
use ivm_core::sync::UnsafeCell;

use crate::engine::OnDep;

/// How an instruction uses a dependence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessMode {
    /// Reads the data: waits for the last write.
    Read,
    /// Writes the data: waits for every access since the last write.
    Write,
}

/// A dependence: the head of its list of accesses since the last write. The accesses
/// themselves live in the engine's access pool.
///
/// A dependence is owned by whatever owns the data (a tensor's blob, a `static` on a
/// microcontroller); the engine only links accesses into it. The contract that makes this
/// sound is [`Instruction`](crate::Instruction)'s: a dependence named by a lively
/// instruction stays alive and in place until the engine released that instruction, and it
/// is used by one engine only.
///
/// ```
/// use ivm_engine::Dependence;
/// static WEIGHTS: Dependence = Dependence::new();
/// # let _ = &WEIGHTS;
/// ```
pub struct Dependence {
    /// Read and written only by the engine that holds the dependence's accesses, i.e. by
    /// code with that engine's `&mut` ("engine only").
    accesses: UnsafeCell<IndexList<OnDep>>,
}

// SAFETY: the only field is the access-list head, touched only under the "engine only"
// invariant: by the single owner of the engine that links accesses into it (`&mut Engine`),
// and whoever hands the engine from thread to thread orders successive owners
// (ARCHITECTURE.md, "who may drive the engine").
unsafe impl Sync for Dependence {}
// SAFETY: as above; the head is plain data.
unsafe impl Send for Dependence {}

impl Dependence {
    /// A dependence with no access.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            accesses: UnsafeCell::new(IndexList::new()),
        }
    }

    /// A dependence with no access (loom build: loom's cells have no `const` constructor).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            accesses: UnsafeCell::new(IndexList::new()),
        }
    }

    /// The access list head.
    ///
    /// # Safety
    /// The caller is the engine that links this dependence's accesses (holds its `&mut`).
    pub(crate) unsafe fn list(&self) -> IndexList<OnDep> {
        // SAFETY: engine only (the caller's contract): nobody else reads or writes the cell
        // while the caller holds the engine.
        self.accesses.with(|p| unsafe { *p })
    }

    /// Replaces the access list head.
    ///
    /// # Safety
    /// As for [`Dependence::list`].
    pub(crate) unsafe fn set_list(&self, list: IndexList<OnDep>) {
        // SAFETY: engine only, as in `list`.
        self.accesses.with_mut(|p| unsafe { *p = list })
    }
}

impl Default for Dependence {
    fn default() -> Self {
        Self::new()
    }
}

impl core::fmt::Debug for Dependence {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Dependence").finish_non_exhaustive()
    }
}
