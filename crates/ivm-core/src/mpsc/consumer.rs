//! The consumer side of [`MpscQueue`]: what a pop says ([`Pop`], [`DrainEnd`]), the
//! consumer role ([`Consumer`], taken with [`consume`](MpscQueue::consume) or
//! [`try_consume`](MpscQueue::try_consume) and handed over through its `busy` flag), the
//! single-consumer `*_unchecked` pops and the pop itself (`pop_raw`: moving `tail` on, or
//! taking the last node with a compare-exchange of `head` to null).
//!
//! Separate from `mpsc.rs` so that the consumer's orderings and the single-consumer
//! reasoning read in one place; the producers' swap and publishing stores they pair with
//! are in `push.rs`.

use core::fmt;
use core::ptr::{self, NonNull};

use super::{Linked, MpscQueue};
use crate::sync::{Backoff, Ordering};

/// The result of one pop attempt.
#[must_use = "a popped handle is dropped when ignored; `Inconsistent` forbids sleeping"]
pub enum Pop<H> {
    /// The oldest queued node.
    Item(H),
    /// The queue held nothing when looked at. The consumer may sleep, through the parking
    /// protocol (see the [module docs](super#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)).
    Empty,
    /// A push is half done (it took its place but has not linked its node yet). Its node
    /// will be reachable in a moment; its producer may not wake anyone, so **the consumer
    /// must not sleep**: retry instead.
    Inconsistent,
}

impl<H> Pop<H> {
    /// The handle, if this is an [`Pop::Item`].
    pub fn item(self) -> Option<H> {
        match self {
            Pop::Item(h) => Some(h),
            Pop::Empty | Pop::Inconsistent => None,
        }
    }
}

impl<H> fmt::Debug for Pop<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pop::Item(_) => "Item(..)",
            Pop::Empty => "Empty",
            Pop::Inconsistent => "Inconsistent",
        })
    }
}

/// Why a drain stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "`Inconsistent` means a node is on its way: the consumer must not sleep"]
pub enum DrainEnd {
    /// The queue held nothing: the consumer may park (re-checking
    /// [`MpscQueue::is_empty`] after announcing the park).
    Empty,
    /// A push was half done: drain again soon, **without sleeping** in between.
    Inconsistent,
}

impl DrainEnd {
    /// Whether the consumer may go to sleep now (through the parking protocol): `true` only
    /// for [`DrainEnd::Empty`].
    #[inline]
    #[must_use]
    pub fn may_sleep(self) -> bool {
        matches!(self, DrainEnd::Empty)
    }
}

/// The raw result of a pop, before the node is turned back into a handle.
enum RawPop<T> {
    /// `emptied`: the pop took the last node (compare-exchange of `head` to null).
    Item {
        node: NonNull<T>,
        #[cfg_attr(not(any(test, loom, fuzzing)), allow(dead_code))]
        emptied: bool,
    },
    Empty,
    Inconsistent,
}

impl<T: Linked<Tag>, Tag> MpscQueue<T, Tag> {
    /// Takes the consumer role until the returned guard is dropped.
    ///
    /// # Panics
    ///
    /// If another [`Consumer`] of this queue is alive (this is a single-consumer queue).
    #[track_caller]
    pub fn consume(&self) -> Consumer<'_, T, Tag> {
        match self.try_consume() {
            Some(consumer) => consumer,
            None => panic!("mpsc: a second consumer while another `Consumer` guard is alive"),
        }
    }

    /// Takes the consumer role until the returned guard is dropped, or returns `None` if
    /// another [`Consumer`] of this queue is alive.
    pub fn try_consume(&self) -> Option<Consumer<'_, T, Tag>> {
        // Acquire: pairs with the Release in `Consumer::drop`, so the previous consumer's
        // writes to `tail` happen before ours.
        self.consumer
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Consumer { queue: self })
    }

    /// Pops the oldest node, without checking for other consumers.
    ///
    /// Never waits. On [`Pop::Inconsistent`] the caller must not sleep (see the
    /// [rules](super#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)).
    ///
    /// # Safety
    ///
    /// The caller must ensure that no other thread pops from this queue concurrently:
    /// no other call of a `*_unchecked` consumer method and no [`Consumer`] guard may
    /// overlap this call, and earlier consumer calls on other threads must happen before
    /// it.
    pub unsafe fn try_pop_unchecked(&self) -> Pop<T::Handle> {
        // SAFETY: single consumer, by this function's contract.
        match unsafe { self.pop_raw() } {
            // SAFETY: `pop_raw` returned a node it unlinked, owning its handle.
            RawPop::Item { node, .. } => Pop::Item(unsafe { self.take(node) }),
            RawPop::Empty => Pop::Empty,
            RawPop::Inconsistent => Pop::Inconsistent,
        }
    }

    /// Pops every node reachable now into `f`, oldest first, and says why it stopped.
    ///
    /// # Safety
    ///
    /// As for [`try_pop_unchecked`](Self::try_pop_unchecked), for the whole call (`f` must
    /// not pop from this queue either; pushing is fine).
    pub unsafe fn drain_unchecked(&self, mut f: impl FnMut(T::Handle)) -> DrainEnd {
        loop {
            // SAFETY: single consumer, by this function's contract.
            match unsafe { self.try_pop_unchecked() } {
                Pop::Item(handle) => f(handle),
                Pop::Empty => return DrainEnd::Empty,
                Pop::Inconsistent => return DrainEnd::Inconsistent,
            }
        }
    }

    /// The pop itself.
    ///
    /// # Safety
    ///
    /// Single consumer (see [`try_pop_unchecked`](Self::try_pop_unchecked)).
    unsafe fn pop_raw(&self) -> RawPop<T> {
        let tail_cell = &self.consumer.tail;
        // Acquire: pairs with the Release hand-off store in `push` (for a node pushed onto
        // an empty queue): publishes that node's payload. When the value is our own
        // earlier store, we already see the node.
        let Some(node) = NonNull::new(tail_cell.load(Ordering::Acquire)) else {
            // Nothing handed over. Either empty, or a push that found the queue empty has
            // swapped `head` but not yet stored `tail`.
            // Relaxed: only decides between two answers; no data is read through it.
            return if self.head.load(Ordering::Relaxed).is_null() {
                RawPop::Empty
            } else {
                RawPop::Inconsistent
            };
        };
        // SAFETY: `node` is queued, hence alive (the queue owns its handle).
        let links = unsafe { T::links(node).as_ref() };
        // Acquire: pairs with the Release link store in `push`: publishes the next node's
        // payload.
        if let Some(next) = NonNull::new(links.next.load(Ordering::Acquire)) {
            // Relaxed: only the consumer reads `tail` while it is non-null.
            tail_cell.store(next.as_ptr(), Ordering::Relaxed);
            return RawPop::Item {
                node,
                emptied: false,
            };
        }
        // `node` is the last linked node. If `head` moved on, its successor is half pushed.
        // Relaxed: `head` is at least `node` here (we reached `node` through an Acquire
        // chain from its push), so a different value means a later swap.
        if self.head.load(Ordering::Relaxed) != node.as_ptr() {
            return RawPop::Inconsistent;
        }
        // Clear `tail` *before* emptying the queue: the next push that finds the queue
        // empty stores `tail`, and our store must come first in `tail`'s order.
        // Relaxed: ordered before that push's store by the Release CAS below.
        tail_cell.store(ptr::null_mut(), Ordering::Relaxed);
        // Release: pairs with the Acquire swap of the push that next finds `head` null:
        // publishes `tail = null` (so its hand-off store lands after ours).
        // Failure Relaxed: we only learn that a push came in between.
        match self.head.compare_exchange(
            node.as_ptr(),
            ptr::null_mut(),
            Ordering::Release,
            Ordering::Relaxed,
        ) {
            Ok(_) => RawPop::Item {
                node,
                emptied: true,
            },
            Err(_) => {
                // A push swapped `head` from `node` and will link `node.next`; no push can
                // store `tail` while `head` is non-null, so restoring it is race-free.
                tail_cell.store(node.as_ptr(), Ordering::Relaxed);
                RawPop::Inconsistent
            }
        }
    }

    /// Turns a node `pop_raw` unlinked back into its handle.
    ///
    /// # Safety
    ///
    /// `node` was just returned by `pop_raw` as an item.
    pub(super) unsafe fn take(&self, node: NonNull<T>) -> T::Handle {
        #[cfg(debug_assertions)]
        {
            // SAFETY: the node is alive: the queue still owns its handle.
            let links = unsafe { T::links(node).as_ref() };
            // Relaxed: a misuse check; handing the handle on orders any later push.
            links.queued.store(false, Ordering::Relaxed);
        }
        // SAFETY: the node was queued, so it came from `into_ptr` in `push`, and popping it
        // ended the queue's ownership.
        unsafe { T::from_ptr(node) }
    }

    /// Loom/fuzz observation hook: pops like [`try_pop_unchecked`](Self::try_pop_unchecked)
    /// and also says whether the pop took the last node (emptied the queue), so that a
    /// model can check `push`'s was-empty answers exactly.
    ///
    /// # Safety
    ///
    /// As for [`try_pop_unchecked`](Self::try_pop_unchecked).
    #[cfg(any(test, loom, fuzzing))]
    #[doc(hidden)]
    pub unsafe fn try_pop_observed_unchecked(&self) -> (Pop<T::Handle>, bool) {
        // SAFETY: single consumer, by this function's contract.
        match unsafe { self.pop_raw() } {
            // SAFETY: `pop_raw` returned a node it unlinked, owning its handle.
            RawPop::Item { node, emptied } => (Pop::Item(unsafe { self.take(node) }), emptied),
            RawPop::Empty => (Pop::Empty, false),
            RawPop::Inconsistent => (Pop::Inconsistent, false),
        }
    }
}

/// The consumer role of a [`MpscQueue`], held exclusively until dropped.
///
/// Methods take `&mut self`, so the guard cannot be used from two threads at once.
pub struct Consumer<'q, T: Linked<Tag>, Tag> {
    queue: &'q MpscQueue<T, Tag>,
}

impl<'q, T: Linked<Tag>, Tag> Consumer<'q, T, Tag> {
    /// The queue this guard consumes from.
    #[inline]
    pub fn queue(&self) -> &'q MpscQueue<T, Tag> {
        self.queue
    }

    /// The oldest node, without popping it: `None` when the queue is empty or a push
    /// that found it empty is half done (then [`try_pop`](Self::try_pop) would say
    /// [`Pop::Inconsistent`]). The node stays queued; the borrow ends before the next pop.
    #[inline]
    pub fn peek(&self) -> Option<&T> {
        // Acquire: pairs with the Release hand-off store in `push` (or, for a `tail` this
        // consumer role stored itself, the Acquire load of `next` before that store, read
        // by the role's previous holder and published by `try_consume`'s Acquire), so the
        // node's payload is visible.
        let node = NonNull::new(self.queue.consumer.tail.load(Ordering::Acquire))?;
        // SAFETY: `node` is queued (the queue owns its handle) and only the holder of the
        // consumer role, this guard, can pop it; popping takes `&mut self`, so the node
        // outlives the returned borrow.
        Some(unsafe { node.as_ref() })
    }

    /// Pops the oldest node. Never waits. On [`Pop::Inconsistent`] do not sleep: retry.
    #[inline]
    pub fn try_pop(&mut self) -> Pop<T::Handle> {
        // SAFETY: this guard holds the consumer role (`busy`), and `&mut self` keeps the
        // guard itself on one thread at a time.
        unsafe { self.queue.try_pop_unchecked() }
    }

    /// Pops every node reachable now into `f`, oldest first; returns [`DrainEnd::Empty`]
    /// (the consumer may park) or [`DrainEnd::Inconsistent`] (drain again without
    /// sleeping).
    #[inline]
    pub fn drain(&mut self, f: impl FnMut(T::Handle)) -> DrainEnd {
        // SAFETY: as in `try_pop`.
        unsafe { self.queue.drain_unchecked(f) }
    }

    /// Pops every node reachable now to the back of `list`, oldest first; returns
    /// [`DrainEnd::Empty`] (the consumer may park) or [`DrainEnd::Inconsistent`] (drain
    /// again without sleeping).
    ///
    /// The node must implement [`list::Linked`](crate::list::Linked) for the list's tag with
    /// the same handle type, so the handle moves from the queue to the list as is.
    ///
    /// # Panics
    ///
    /// If a popped node is already linked through `LTag`'s hook (the list's `double link`
    /// check); nodes popped before it stay in `list`, the rest stay queued.
    #[track_caller]
    pub fn drain_into<LTag>(&mut self, list: &mut crate::list::List<T, LTag>) -> DrainEnd
    where
        T: crate::list::Linked<LTag, Handle = <T as Linked<Tag>>::Handle>,
    {
        self.drain(|handle| list.push_back(handle))
    }

    /// Pops into `f` until the queue is empty, spinning (with backoff) through
    /// inconsistent states. When it returns, the consumer may park. A producer preempted
    /// in the middle of its push keeps this spinning; a consumer with other work to do
    /// should prefer [`drain`](Self::drain).
    pub fn drain_until_empty(&mut self, mut f: impl FnMut(T::Handle)) {
        let backoff = Backoff::new();
        while !self.drain(&mut f).may_sleep() {
            backoff.snooze();
        }
    }

    /// Like [`try_pop`](Self::try_pop), and also says whether the pop emptied the queue.
    /// Loom/fuzz observation hook.
    #[cfg(any(test, loom, fuzzing))]
    #[doc(hidden)]
    pub fn try_pop_observed(&mut self) -> (Pop<T::Handle>, bool) {
        // SAFETY: as in `try_pop`.
        unsafe { self.queue.try_pop_observed_unchecked() }
    }
}

impl<T: Linked<Tag>, Tag> Drop for Consumer<'_, T, Tag> {
    fn drop(&mut self) {
        // Release: pairs with the Acquire in `try_consume`: publishes our `tail` writes to
        // the next consumer.
        self.queue.consumer.busy.store(false, Ordering::Release);
    }
}

impl<T: Linked<Tag>, Tag> fmt::Debug for Consumer<'_, T, Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", self.queue)
            .finish()
    }
}
