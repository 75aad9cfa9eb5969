//! The hook a node embeds per list ([`Links`]) and its state word: how a list takes a hook
//! (`List::claim`, an Acquire compare-and-swap) and gives it back (`List::unlink`, a
//! Release store), and the debug-build list ids and panics that name a misused hook.
//!
//! Separate from `list.rs` so that the hand-off of a hook between lists (and threads) —
//! the pointer list's Acquire and Release — reads in one place, next to the `Send` and
//! `Sync` reasoning that relies on it.

use core::fmt;
use core::marker::PhantomPinned;
use core::ptr::{self, NonNull};

use super::{Linked, List};
use crate::sync::{AtomicUsize, Ordering, UnsafeCell, loom_const_fn};

pub(super) type Link<T> = Option<NonNull<T>>;

/// The hook's state word when it is not linked into any list.
pub(super) const UNLINKED: usize = 0;

/// The hook's state word when it is linked, in release builds (debug builds store the id of
/// the list instead, which is never [`UNLINKED`]).
#[cfg(not(debug_assertions))]
const LINKED: usize = 1;

/// A hook: the links that put a node into one list.
///
/// Embed one per list a node can be in, and return it from that list's
/// [`Linked::links`]. A fresh hook is unlinked.
pub struct Links<T: ?Sized> {
    /// The neighbours. Only the owner of the list the node is linked into reads or writes
    /// them (the list that claimed the state word).
    pointers: UnsafeCell<Pointers<T>>,
    /// [`UNLINKED`], or the value the list that links this hook writes ([`LINKED`] in
    /// release builds, the list's id in debug builds). Atomic so that anyone may ask
    /// [`Links::is_linked`]; also the hand-off of the pointers from one list to the next
    /// (Release when unlinking, Acquire when claiming).
    state: AtomicUsize,
    /// Keeps the hook (and so the node) `!Unpin`: no `noalias` on references to it
    /// (rust-lang/rust#63818).
    _pin: PhantomPinned,
}

/// The two pointers of a hook.
struct Pointers<T: ?Sized> {
    prev: Link<T>,
    next: Link<T>,
}

impl<T: ?Sized> Links<T> {
    loom_const_fn! {
        /// A hook that is not linked into any list.
        #[must_use]
        pub fn new() -> Self {
            Self {
                pointers: UnsafeCell::new(Pointers { prev: None, next: None }),
                state: AtomicUsize::new(UNLINKED),
                _pin: PhantomPinned,
            }
        }
    }

    /// Whether the node is linked into a list through this hook.
    ///
    /// From a thread that does not own that list the answer is only a snapshot: the owner
    /// may link or unlink the node at any time.
    #[inline]
    pub fn is_linked(&self) -> bool {
        // Relaxed: a snapshot; the caller synchronizes with the list's owner if it acts on it.
        self.state.load(Ordering::Relaxed) != UNLINKED
    }

    /// The hook's state word.
    ///
    /// # Safety
    ///
    /// `this` must point to a live hook, for as long as the reference is used.
    #[inline]
    pub(super) unsafe fn state<'a>(this: NonNull<Self>) -> &'a AtomicUsize {
        // SAFETY: the caller guarantees the hook is live. This references the field only,
        // never the hook or the node, and a shared reference to an atomic is always allowed.
        unsafe { &(*this.as_ptr()).state }
    }

    /// The cell holding the hook's pointers.
    ///
    /// # Safety
    ///
    /// `this` must point to a live hook, for as long as the reference is used.
    #[inline]
    unsafe fn pointers<'a>(this: NonNull<Self>) -> &'a UnsafeCell<Pointers<T>> {
        // SAFETY: the caller guarantees the hook is live. This references the field only,
        // never the hook or the node, and a shared reference to an `UnsafeCell` permits
        // writes through the pointer it hands out.
        unsafe { &(*this.as_ptr()).pointers }
    }

    /// The previous node.
    ///
    /// # Safety
    ///
    /// `this` must point to a live hook whose pointers the caller may read: it borrows the
    /// list the hook is linked into, or it has claimed the hook's state word.
    #[inline]
    pub(super) unsafe fn prev(this: NonNull<Self>) -> Link<T> {
        // SAFETY: the hook is live (caller's contract).
        let cell = unsafe { Self::pointers(this) };
        // SAFETY: the caller's right to read the pointers makes this read race-free.
        cell.with(|p| unsafe { (*p).prev })
    }

    /// The next node.
    ///
    /// # Safety
    ///
    /// As for [`Links::prev`].
    #[inline]
    pub(super) unsafe fn next(this: NonNull<Self>) -> Link<T> {
        // SAFETY: the hook is live (caller's contract).
        let cell = unsafe { Self::pointers(this) };
        // SAFETY: the caller's right to read the pointers makes this read race-free.
        cell.with(|p| unsafe { (*p).next })
    }

    /// Sets the previous node.
    ///
    /// # Safety
    ///
    /// `this` must point to a live hook whose pointers the caller may write: it borrows
    /// the list the hook is linked into exclusively, or it has claimed the state word.
    #[inline]
    pub(super) unsafe fn set_prev(this: NonNull<Self>, prev: Link<T>) {
        // SAFETY: the hook is live (caller's contract).
        let cell = unsafe { Self::pointers(this) };
        // SAFETY: the caller's exclusive right to the pointers makes this write race-free.
        cell.with_mut(|p| unsafe { (*p).prev = prev });
    }

    /// Sets the next node.
    ///
    /// # Safety
    ///
    /// As for [`Links::set_prev`].
    #[inline]
    pub(super) unsafe fn set_next(this: NonNull<Self>, next: Link<T>) {
        // SAFETY: the hook is live (caller's contract).
        let cell = unsafe { Self::pointers(this) };
        // SAFETY: the caller's exclusive right to the pointers makes this write race-free.
        cell.with_mut(|p| unsafe { (*p).next = next });
    }
}

impl<T: ?Sized> Default for Links<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: ?Sized> fmt::Debug for Links<T> {
    /// Shows only whether the hook is linked: its pointers belong to the list's owner.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Links")
            .field("linked", &self.is_linked())
            .finish_non_exhaustive()
    }
}

// SAFETY: nothing reachable through `&Links` reads the pointers (`is_linked` reads the
// atomic state word only). The pointers are read and written only by the owner of the list
// the hook is linked into, and pass from one list's owner to the next through the state
// word (Release when unlinking, Acquire when claiming). The pointers are never dereferenced
// through the hook itself, so what `T` is does not matter.
unsafe impl<T: ?Sized> Send for Links<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: ?Sized> Sync for Links<T> {}

/// A fresh list id for debug membership checks, never [`UNLINKED`].
#[cfg(debug_assertions)]
fn next_list_id() -> usize {
    // This counter only hands out distinct numbers for diagnostics and publishes nothing,
    // so loom has nothing to check in it; loom's atomics cannot live in a `static` either.
    #[cfg(not(loom))]
    use crate::sync::AtomicUsize as IdCounter;
    #[cfg(loom)]
    use core::sync::atomic::AtomicUsize as IdCounter;

    static NEXT_ID: IdCounter = IdCounter::new(UNLINKED + 1);
    loop {
        // Relaxed: the ids only need to be distinct.
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        if id != UNLINKED {
            return id;
        }
    }
}

/// The panic for linking a hook whose state word shows `state` into the list whose word is
/// `mine`.
#[cold]
#[track_caller]
fn double_link(state: usize, mine: usize) -> ! {
    #[cfg(debug_assertions)]
    if state == mine {
        panic!(
            "double link: the node is already linked into this list (list #{mine}) through \
             this hook; erase or pop it before linking it again"
        );
    } else {
        panic!(
            "double link: the node is already linked into another list (list #{state}) \
             through this hook, so it cannot also go into list #{mine}; erase it there first"
        );
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = (state, mine);
        panic!(
            "double link: the node is already linked into a list through this hook; erase \
             or pop it before linking it again"
        );
    }
}

/// The panic for erasing, from the list whose word is `mine`, a node whose hook shows
/// `state`.
#[cfg(debug_assertions)]
#[cold]
#[track_caller]
pub(super) fn wrong_list(state: usize, mine: usize) -> ! {
    if mine == UNLINKED {
        panic!(
            "erase from wrong list: the node is linked into list #{state}, not into this list \
             (which has never linked a node); erasing it here is undefined behavior in release \
             builds"
        );
    }
    panic!(
        "erase from wrong list: the node is linked into list #{state}, not into this list \
         (list #{mine}); erasing it here is undefined behavior in release builds"
    );
}

/// Whether two links point to the same node (by address, ignoring metadata).
#[inline]
pub(super) fn same<T: ?Sized>(a: Link<T>, b: Link<T>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => ptr::addr_eq(a.as_ptr(), b.as_ptr()),
        _ => false,
    }
}

// How a list takes a hook and gives it back: the only writes of the state word besides
// debug builds' re-tagging in `splice_back`.
impl<T: Linked<Tag> + ?Sized, Tag> List<T, Tag> {
    /// The state word this list writes into the hooks it links (assigning its id in debug
    /// builds if it has none yet).
    #[inline]
    pub(super) fn owner_word(&mut self) -> usize {
        #[cfg(debug_assertions)]
        {
            if self.id == UNLINKED {
                self.id = next_list_id();
            }
            self.id
        }
        #[cfg(not(debug_assertions))]
        LINKED
    }

    /// The state word the hooks linked into this list hold (in debug builds, [`UNLINKED`]
    /// if this list never linked a node: then no hook holds its id).
    #[inline]
    pub(super) fn owner_word_if_any(&self) -> usize {
        #[cfg(debug_assertions)]
        return self.id;
        #[cfg(not(debug_assertions))]
        LINKED
    }

    /// Claims `node`'s hook for this list, or panics (`double link`) if it is linked.
    ///
    /// `node` must have just come from `into_ptr`: on panic it is turned back into its
    /// handle and dropped.
    #[track_caller]
    pub(super) fn claim(&mut self, node: NonNull<T>) -> NonNull<Links<T>> {
        let mine = self.owner_word();
        // SAFETY: `node` came from `into_ptr`, so it points to a live node.
        let hook = unsafe { T::links(node) };
        // SAFETY: the hook is inside the live node.
        let state = unsafe { Links::state(hook) };
        // Acquire: pairs with the Release store of the list that unlinked this hook last,
        // so its writes to the hook's pointers happen before ours. One CAS (not a load and
        // a store) so that of two threads racing to link the node, one fails.
        if let Err(found) =
            state.compare_exchange(UNLINKED, mine, Ordering::Acquire, Ordering::Relaxed)
        {
            // SAFETY: `node` came from `into_ptr` in the caller and the list did not keep
            // it: give the ownership back, to be dropped while the panic unwinds.
            let _handle = unsafe { T::from_ptr(node) };
            double_link(found, mine);
        }
        hook
    }

    /// Unlinks `node` and returns its handle.
    ///
    /// # Safety
    ///
    /// `node` must be linked into this list, and be the pointer this list stored for it.
    pub(super) unsafe fn unlink(&mut self, node: NonNull<T>) -> T::Handle {
        // SAFETY: `node` is linked into this list, which `self` borrows exclusively, and so
        // are its neighbours.
        unsafe {
            let hook = T::links(node);
            debug_assert_eq!(
                Links::state(hook).load(Ordering::Relaxed),
                self.owner_word_if_any(),
                "list invariant: unlinking a node whose hook is not marked as in this list"
            );
            let prev = Links::prev(hook);
            let next = Links::next(hook);
            match prev {
                Some(prev) => Links::set_next(T::links(prev), next),
                None => {
                    debug_assert!(
                        same(self.head, Some(node)),
                        "list invariant: no prev, not head"
                    );
                    self.head = next;
                }
            }
            match next {
                Some(next) => Links::set_prev(T::links(next), prev),
                None => {
                    debug_assert!(
                        same(self.tail, Some(node)),
                        "list invariant: no next, not tail"
                    );
                    self.tail = prev;
                }
            }
            Links::set_prev(hook, None);
            Links::set_next(hook, None);
            self.len -= 1;
            // Release: publishes this list's writes to the hook's pointers to whichever list
            // claims the hook next (its claim is an Acquire CAS).
            Links::state(hook).store(UNLINKED, Ordering::Release);
            // SAFETY: `node` is the pointer this list got from `into_ptr` and it no longer
            // holds it.
            T::from_ptr(node)
        }
    }
}
