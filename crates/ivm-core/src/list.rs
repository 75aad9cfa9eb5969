//! An intrusive, allocation-free doubly-linked list whose nodes can sit in several lists at
//! once, one hook per list — with two storages: pointer hooks ([`List`], this file) for
//! nodes that live anywhere and are owned by the list through a handle, and index hooks
//! ([`IndexList`], [`index`]) for nodes that live in one pool. The module [`index`] compares
//! the two and names their users.
//!
//! A node embeds one [`Links`] hook per list it can belong to. A zero-sized *tag* type names
//! each hook, and the node type implements [`Linked<Tag>`] once per tag: `links` finds that
//! tag's hook, `into_ptr` / `from_ptr` say how the list holds the node. A [`List<T, Tag>`]
//! links its nodes through the `Tag` hook only, so an instruction can be at once in a ready
//! list, a stream's running list and a worker's pending list.
//!
//! # Ownership
//!
//! A list owns one handle per linked node: [`List::push_back`] turns the handle into a
//! pointer with [`Linked::into_ptr`], and popping or erasing turns it back with
//! [`Linked::from_ptr`]. With `&'static T` handles (bare metal: nodes in `static`s or in a
//! pool) this costs nothing; with `Arc<T>` handles every list a node is in holds one strong
//! count. Dropping a list drops the handles of the nodes still in it.
//!
//! # Hook states
//!
//! Besides its two pointers, a hook has an explicit state word: unlinked, or linked (in
//! debug builds, the word holds the id of the list the hook is linked into). Linking claims
//! the word with one compare-and-swap, so linking a node that is already linked through
//! that hook panics (`double link`) in every build, even when two threads race to link it.
//! Debug builds also panic, naming the mistake, when [`List::erase`] is handed a node that
//! is linked into another list (`erase from wrong list`).
//!
//! # Soundness notes
//!
//! * The pointers live in an [`UnsafeCell`] next to a [`PhantomPinned`]. The list reaches a
//!   hook through the raw pointer [`Linked::links`] projects (`&raw mut (*node).hook`) and
//!   then borrows only the hook's cell and state fields, shared: it never makes a `&mut` to
//!   a node or a hook, so `&T` references handed out by [`List::front`] or [`List::iter`],
//!   or held by other lists' owners, stay valid while the list relinks the node
//!   (tokio-rs/tokio#3101, hawkw/mycelium#139).
//! * The state word is an atomic, so [`Links::is_linked`] may be asked from any thread; the
//!   pointers are only touched by the owner of the list the node is linked into.
//! * Erasing goes through the pointer the list stored, not the caller's: a pointer made from
//!   a `&T` may lack the provenance `Arc::from_raw` needs to reach the reference count.
//!
//! [`UnsafeCell`]: core::cell::UnsafeCell
//! [`PhantomPinned`]: core::marker::PhantomPinned
//!
//! # Examples
//!
//! One `static` node in two lists at once (no allocation anywhere):
//!
//! ```
//! use core::ptr::NonNull;
//! use ivm_core::list::{Linked, Links, List};
//!
//! /// A task that can wait in a run queue and, at the same time, in a timer list.
//! struct Task {
//!     id: u32,
//!     run: Links<Task>,
//!     timer: Links<Task>,
//! }
//!
//! /// One zero-sized tag per hook.
//! enum RunQueue {}
//! enum Timers {}
//!
//! // SAFETY: a `&'static Task` never moves and is never freed; `links` projects the `run`
//! // hook without making a reference, and no other tag uses that hook.
//! unsafe impl Linked<RunQueue> for Task {
//!     type Handle = &'static Task;
//!     fn into_ptr(task: &'static Task) -> NonNull<Task> {
//!         NonNull::from(task)
//!     }
//!     unsafe fn from_ptr(ptr: NonNull<Task>) -> &'static Task {
//!         // SAFETY: `ptr` came from `into_ptr`, so it is a `&'static Task`.
//!         unsafe { ptr.as_ref() }
//!     }
//!     unsafe fn links(ptr: NonNull<Task>) -> NonNull<Links<Task>> {
//!         // SAFETY: `ptr` points to a live `Task`, so the field's address is not null.
//!         unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).run) }
//!     }
//! }
//!
//! // SAFETY: as above, for the `timer` hook.
//! unsafe impl Linked<Timers> for Task {
//!     type Handle = &'static Task;
//!     fn into_ptr(task: &'static Task) -> NonNull<Task> {
//!         NonNull::from(task)
//!     }
//!     unsafe fn from_ptr(ptr: NonNull<Task>) -> &'static Task {
//!         // SAFETY: `ptr` came from `into_ptr`, so it is a `&'static Task`.
//!         unsafe { ptr.as_ref() }
//!     }
//!     unsafe fn links(ptr: NonNull<Task>) -> NonNull<Links<Task>> {
//!         // SAFETY: `ptr` points to a live `Task`, so the field's address is not null.
//!         unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).timer) }
//!     }
//! }
//!
//! static A: Task = Task { id: 1, run: Links::new(), timer: Links::new() };
//! static B: Task = Task { id: 2, run: Links::new(), timer: Links::new() };
//!
//! let mut run = List::<Task, RunQueue>::new();
//! let mut timers = List::<Task, Timers>::new();
//! run.push_back(&A);
//! run.push_back(&B);
//! timers.push_back(&B); // B is in both lists now
//! assert!(List::<Task, Timers>::is_linked(&B));
//! assert_eq!(run.iter().map(|t| t.id).collect::<Vec<_>>(), [1, 2]);
//!
//! // B's timer fires: take it off the timer list, it stays runnable.
//! let fired = timers.erase_checked(&B).expect("B was in the timer list");
//! assert_eq!(fired.id, 2);
//! assert!(!B.timer.is_linked() && B.run.is_linked());
//! assert_eq!(run.pop_front().map(|t| t.id), Some(1));
//! ```

use core::fmt;
use core::marker::PhantomData;
use core::ptr::{self, NonNull};

use crate::sync::Ordering;

pub mod index;
pub use index::{IndexLinked, IndexLinks, IndexList, NIL, Pool};

mod iter;
mod links;
pub use iter::{CursorMut, Iter};
pub use links::Links;
#[cfg(debug_assertions)]
use links::wrong_list;
use links::{Link, UNLINKED, same};

/// How a node is held by the lists of one hook.
///
/// A node type implements `Linked<Tag>` once per hook it embeds; `Tag` is a zero-sized
/// type (an empty `enum` does nicely) that names the hook.
///
/// # Safety
///
/// Implementing this trait promises, for every node:
///
/// * `into_ptr` gives up ownership of the node without dropping or moving it, and returns a
///   pointer valid for reads of the whole node (it is what [`List::front`] and
///   [`List::iter`] hand out as `&Self`); `from_ptr`, given that pointer back, returns
///   exactly that ownership. Each pointer from `into_ptr` is passed to `from_ptr` at most
///   once.
/// * While a list holds the pointer (between `into_ptr` and `from_ptr`), the node stays
///   alive and does not move (it is pinned).
/// * `links` returns a pointer, derived from `ptr`, to a [`Links<Self>`] field inside the
///   node, without reading or writing the node and without making a reference to it
///   (project with `&raw mut (*ptr.as_ptr()).hook`). It always returns the same field for
///   this `Tag`, and no other `Tag`'s implementation returns that field.
pub unsafe trait Linked<Tag> {
    /// The owning pointer a list holds per linked node: `&'static Self`, `Arc<Self>`, ...
    type Handle;

    /// Turns a handle into a raw pointer to its node, without dropping the node.
    fn into_ptr(handle: Self::Handle) -> NonNull<Self>;

    /// Turns a pointer made by [`Linked::into_ptr`] back into the handle it came from.
    ///
    /// # Safety
    ///
    /// `ptr` must come from [`Linked::into_ptr`], and this must be the only call of
    /// `from_ptr` for that `into_ptr` call.
    unsafe fn from_ptr(ptr: NonNull<Self>) -> Self::Handle;

    /// Returns a pointer to this tag's hook inside the node `ptr` points to.
    ///
    /// # Safety
    ///
    /// `ptr` must point to a live node.
    unsafe fn links(ptr: NonNull<Self>) -> NonNull<Links<Self>>;
}

/// An intrusive doubly-linked list of `T`s, linked through `T`'s `Tag` hook.
///
/// All operations are O(1) except [`List::contains`], [`List::erase_checked`] (O(n) walks),
/// iteration and [`List::assert_valid`]. Allocation-free. See the [module docs](self) for
/// the ownership rules and an example.
pub struct List<T: Linked<Tag> + ?Sized, Tag> {
    head: Link<T>,
    tail: Link<T>,
    len: usize,
    /// This list's id for membership checks, assigned when it first links a node
    /// ([`UNLINKED`] until then).
    #[cfg(debug_assertions)]
    id: usize,
    /// The list owns one handle per node (for drop check).
    _handles: PhantomData<T::Handle>,
    /// `Tag` only selects the hook.
    _tag: PhantomData<fn() -> Tag>,
}

impl<T: Linked<Tag> + ?Sized, Tag> List<T, Tag> {
    /// An empty list.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            head: None,
            tail: None,
            len: 0,
            #[cfg(debug_assertions)]
            id: UNLINKED,
            _handles: PhantomData,
            _tag: PhantomData,
        }
    }

    /// The number of nodes in the list.
    #[inline]
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether the list has no nodes.
    #[inline]
    pub const fn is_empty(&self) -> bool {
        self.head.is_none()
    }

    /// Whether `node` is linked into some list through the `Tag` hook (this one or another).
    ///
    /// Same as `Links::is_linked` on the node's `Tag` hook; a snapshot when another thread
    /// owns that list.
    #[inline]
    pub fn is_linked(node: &T) -> bool {
        // SAFETY: `node` is a live reference, so the node is live.
        let hook = unsafe { T::links(NonNull::from(node)) };
        // SAFETY: the hook is inside the live node.
        unsafe { Links::state(hook) }.load(Ordering::Relaxed) != UNLINKED
    }

    /// Whether `node` is linked into this list. O(n): walks the list from both ends.
    pub fn contains(&self, node: &T) -> bool {
        self.find(node).is_some()
    }

    /// The first node, if any.
    #[inline]
    pub fn front(&self) -> Option<&T> {
        // SAFETY: the head is linked into this list, which holds its handle and so keeps it
        // alive while `self` is borrowed; `into_ptr` pointers are valid for reads (Linked).
        self.head.map(|node| unsafe { node.as_ref() })
    }

    /// The last node, if any.
    #[inline]
    pub fn back(&self) -> Option<&T> {
        // SAFETY: as in `front`, for the tail.
        self.tail.map(|node| unsafe { node.as_ref() })
    }

    /// Links the node `handle` owns at the front of the list; the list keeps the handle.
    ///
    /// # Panics
    ///
    /// If the node is already linked into a list through the `Tag` hook (`double link`);
    /// the handle is dropped.
    #[track_caller]
    pub fn push_front(&mut self, handle: T::Handle) {
        let node = T::into_ptr(handle);
        let hook = self.claim(node);
        // SAFETY: this list has claimed `node`'s hook; the head is linked into this list,
        // which `self` borrows exclusively.
        unsafe {
            Links::set_prev(hook, None);
            Links::set_next(hook, self.head);
            match self.head {
                Some(head) => Links::set_prev(T::links(head), Some(node)),
                None => self.tail = Some(node),
            }
        }
        self.head = Some(node);
        self.len += 1;
    }

    /// Links the node `handle` owns at the back of the list; the list keeps the handle.
    ///
    /// # Panics
    ///
    /// If the node is already linked into a list through the `Tag` hook (`double link`);
    /// the handle is dropped.
    #[track_caller]
    pub fn push_back(&mut self, handle: T::Handle) {
        let node = T::into_ptr(handle);
        let hook = self.claim(node);
        // SAFETY: this list has claimed `node`'s hook; the tail is linked into this list,
        // which `self` borrows exclusively.
        unsafe {
            Links::set_next(hook, None);
            Links::set_prev(hook, self.tail);
            match self.tail {
                Some(tail) => Links::set_next(T::links(tail), Some(node)),
                None => self.head = Some(node),
            }
        }
        self.tail = Some(node);
        self.len += 1;
    }

    /// Unlinks the first node and returns its handle.
    pub fn pop_front(&mut self) -> Option<T::Handle> {
        let head = self.head?;
        // SAFETY: the head is linked into this list.
        Some(unsafe { self.unlink(head) })
    }

    /// Unlinks the last node and returns its handle.
    pub fn pop_back(&mut self) -> Option<T::Handle> {
        let tail = self.tail?;
        // SAFETY: the tail is linked into this list.
        Some(unsafe { self.unlink(tail) })
    }

    /// Unlinks `node` from this list and returns its handle, or returns `None` if `node` is
    /// not linked through the `Tag` hook. O(1).
    ///
    /// # Safety
    ///
    /// `node` must point to a live node (any pointer valid for reads will do: the handle is
    /// rebuilt from the pointer the list stored), and the caller must ensure that exactly
    /// one of the following is true:
    ///
    /// * `node` is linked into this list through the `Tag` hook;
    /// * `node` is not linked into any list through the `Tag` hook, and no other thread
    ///   links it while this call runs.
    ///
    /// Erasing a node that is linked into *another* list is undefined behavior; debug
    /// builds catch it and panic with `erase from wrong list`. Use
    /// [`List::erase_checked`] when the caller cannot tell which list the node is in.
    #[track_caller]
    pub unsafe fn erase(&mut self, node: NonNull<T>) -> Option<T::Handle> {
        // SAFETY: the caller guarantees that `node` points to a live node.
        let hook = unsafe { T::links(node) };
        // SAFETY: the hook is inside the live node. Relaxed: if it is linked it is linked
        // into this list (caller's contract), which wrote the word itself.
        let state = unsafe { Links::state(hook) }.load(Ordering::Relaxed);
        if state == UNLINKED {
            return None;
        }
        #[cfg(debug_assertions)]
        if state != self.id {
            wrong_list(state, self.id);
        }
        // SAFETY: `node` is linked, so it is linked into this list (caller's contract), and
        // this list owns its pointers: the neighbour that points at it stores the pointer
        // the list got from `into_ptr`.
        let stored = unsafe {
            match Links::prev(hook) {
                Some(prev) => Links::next(T::links(prev)),
                None => self.head,
            }
        };
        let Some(stored) = stored else {
            unreachable!("list invariant: a linked node's neighbour does not point back at it")
        };
        debug_assert!(
            ptr::addr_eq(stored.as_ptr(), node.as_ptr()),
            "list invariant: a linked node's neighbour does not point back at it"
        );
        // SAFETY: `stored` is `node` as this list stored it, and it is linked into this list.
        Some(unsafe { self.unlink(stored) })
    }

    /// Unlinks `node` if it is linked into this list and returns its handle; returns `None`
    /// if it is not linked, or linked into another list (which is left untouched).
    ///
    /// O(1) when `node` is not linked through the `Tag` hook; otherwise O(n): it walks the
    /// list from both ends looking for `node`, reading only this list's nodes.
    pub fn erase_checked(&mut self, node: &T) -> Option<T::Handle> {
        let found = self.find(node)?;
        // SAFETY: `found` was reached from this list's ends, so it is linked into it.
        Some(unsafe { self.unlink(found) })
    }

    /// Moves every node of `other` to the back of this list, in order; `other` ends empty.
    ///
    /// O(1). (Debug builds also re-tag every moved hook with this list's id: O(len of
    /// `other`).)
    pub fn splice_back(&mut self, other: &mut Self) {
        let (Some(other_head), Some(other_tail)) = (other.head.take(), other.tail.take()) else {
            debug_assert_eq!(
                other.len, 0,
                "list invariant: an empty list has a non-zero len"
            );
            return;
        };
        let moved = core::mem::replace(&mut other.len, 0);
        #[cfg(debug_assertions)]
        {
            let mine = self.owner_word();
            let mut node = Some(other_head);
            while let Some(n) = node {
                // SAFETY: `n` was linked into `other`, which is borrowed exclusively; its
                // nodes now belong to this list, also borrowed exclusively.
                unsafe {
                    let hook = T::links(n);
                    debug_assert_eq!(
                        Links::state(hook).load(Ordering::Relaxed),
                        other.id,
                        "list invariant: a node of the spliced list does not carry its id"
                    );
                    // Relaxed: the hook stays with an owner that holds `&mut`; the Release
                    // of a later unlink publishes this store along with the pointers.
                    Links::state(hook).store(mine, Ordering::Relaxed);
                    node = Links::next(hook);
                }
            }
        }
        // SAFETY: the tail is linked into this list and `other_head` was linked into
        // `other`; both lists are borrowed exclusively.
        unsafe {
            match self.tail {
                Some(tail) => {
                    Links::set_next(T::links(tail), Some(other_head));
                    Links::set_prev(T::links(other_head), Some(tail));
                }
                None => self.head = Some(other_head),
            }
        }
        self.tail = Some(other_tail);
        self.len += moved;
    }

    /// Checks the list's invariants and panics, naming the broken one, if any fails: head
    /// and tail both set or both unset, every node's `prev` points back at its predecessor,
    /// the walk from the head ends at the tail after exactly `len` nodes, and every hook is
    /// marked as linked (in debug builds: into this list). O(n).
    #[track_caller]
    pub fn assert_valid(&self) {
        let (head, tail) = match (self.head, self.tail) {
            (None, None) => {
                assert_eq!(
                    self.len, 0,
                    "list invariant: a list without head and tail must have len 0"
                );
                return;
            }
            (Some(head), Some(tail)) => (head, tail),
            (head, tail) => panic!(
                "list invariant: head ({head:?}) and tail ({tail:?}) must be both set or both \
                 unset"
            ),
        };
        let mine = self.owner_word_if_any();
        let mut prev: Link<T> = None;
        let mut node = head;
        let mut count = 0_usize;
        loop {
            count += 1;
            assert!(
                count <= self.len,
                "list invariant: more than len ({}) nodes are reachable from the head (a cycle, \
                 or a wrong len)",
                self.len
            );
            // SAFETY: `node` is reachable from this list's head, so it is linked into this
            // list (whose invariants this checks; the walk is bounded by `len`).
            let hook = unsafe { T::links(node) };
            // SAFETY: the hook is inside a live node linked into this list.
            let state = unsafe { Links::state(hook) }.load(Ordering::Relaxed);
            assert_eq!(
                state, mine,
                "list invariant: node {count} ({node:p}) has hook state {state}, but this list \
                 marks its hooks with {mine} (0 = unlinked; in debug builds, a list id)"
            );
            // SAFETY: the node is linked into this list, which `self` borrows.
            let (node_prev, node_next) = unsafe { (Links::prev(hook), Links::next(hook)) };
            assert!(
                same(node_prev, prev),
                "list invariant: node {count} ({node:p}) has prev {node_prev:?}, but its \
                 predecessor is {prev:?}"
            );
            match node_next {
                Some(next) => {
                    prev = Some(node);
                    node = next;
                }
                None => {
                    assert!(
                        ptr::addr_eq(node.as_ptr(), tail.as_ptr()),
                        "list invariant: the walk from the head ends at {node:p}, but the tail \
                         is {tail:p}"
                    );
                    break;
                }
            }
        }
        assert_eq!(
            count, self.len,
            "list invariant: {count} nodes are reachable from the head, but len is {}",
            self.len
        );
    }
    /// Walks the list from both ends looking for `node`; returns the list's own pointer to
    /// it. Reads only this list's nodes (and `node`'s state word).
    fn find(&self, node: &T) -> Link<T> {
        let target = NonNull::from(node);
        if !Self::is_linked(node) {
            return None;
        }
        let (mut front, mut back) = (self.head, self.tail);
        let mut left = self.len;
        let mut found = None;
        while left > 0 {
            let (Some(f), Some(b)) = (front, back) else {
                break;
            };
            if ptr::addr_eq(f.as_ptr(), target.as_ptr()) {
                found = Some(f);
                break;
            }
            if ptr::addr_eq(b.as_ptr(), target.as_ptr()) {
                found = Some(b);
                break;
            }
            // SAFETY: `f` and `b` are linked into this list, which `self` borrows.
            unsafe {
                front = Links::next(T::links(f));
                back = Links::prev(T::links(b));
            }
            left = left.saturating_sub(2);
        }
        #[cfg(debug_assertions)]
        {
            // SAFETY: `target` comes from a live reference. Relaxed: only this list writes
            // its own id, and it is borrowed.
            let state = unsafe { Links::state(T::links(target)) }.load(Ordering::Relaxed);
            debug_assert_eq!(
                found.is_some(),
                self.id != UNLINKED && state == self.id,
                "list invariant: a node's hook id disagrees with the list walk"
            );
        }
        found
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> Drop for List<T, Tag> {
    /// Unlinks every node and drops its handle.
    fn drop(&mut self) {
        while let Some(handle) = self.pop_front() {
            drop(handle);
        }
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> Default for List<T, Tag> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> fmt::Debug for List<T, Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("List");
        s.field("len", &self.len)
            .field("head", &self.head)
            .field("tail", &self.tail);
        #[cfg(debug_assertions)]
        s.field("id", &self.id);
        s.finish()
    }
}

// SAFETY: sending the list sends the handles it owns (hence `T::Handle: Send`); the hooks'
// pointers go with it, as only the list's owner touches them.
unsafe impl<T: Linked<Tag> + ?Sized, Tag> Send for List<T, Tag> where T::Handle: Send {}
// SAFETY: `&List` hands out `&T` (hence `T: Sync`) and reads the hooks' pointers, which
// nobody writes while the list is shared (writes need `&mut List`).
unsafe impl<T: Linked<Tag> + ?Sized, Tag> Sync for List<T, Tag> where T: Sync {}

#[cfg(all(test, not(loom)))]
mod tests;
