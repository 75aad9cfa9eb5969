//! An intrusive, lock-free multi-producer single-consumer queue that tells each producer
//! whether it made the queue non-empty.
//!
//! Producers (any thread handing an instruction to the VM) [`push`](MpscQueue::push) nodes;
//! one consumer (the scheduler) pops them, usually by [draining](Consumer::drain) the queue
//! into a local list. Nothing allocates: a node embeds a [`Links`] hook and the queue
//! threads its nodes through it. The queue owns one [`Handle`](Linked::Handle) per queued
//! node (an `Arc<Node>` in std, a `&'static Node` on bare metal), exactly like
//! [`list::List`](crate::list::List).
//!
//! # Algorithm
//!
//! Dmitry Vyukov's intrusive MPSC queue, in the variant without a stub node whose empty
//! state is a null `head` (the hand-off an MCS lock uses to pass itself on):
//!
//! * `head` is the most recently pushed node, or null when the queue is empty. A push
//!   takes its place in the queue with **one swap** of `head`, then links itself behind
//!   the node the swap returned (`prev.next = node`), or, if the swap returned null, hands
//!   itself to the consumer through `tail`. Producers never wait and never retry.
//! * `tail` is the oldest node not yet popped; only the consumer reads it and, except for
//!   the one hand-off store above, only the consumer writes it. A node whose `next` is set
//!   is popped by moving `tail` on. The last node is popped by a compare-exchange of
//!   `head` from that node to null, which is the moment the queue becomes empty.
//!
//! Between a producer's swap and its link store the queue is *inconsistent*: the node is
//! in the queue's order but not yet reachable from `tail`. [`try_pop`](Consumer::try_pop)
//! reports that as [`Pop::Inconsistent`] instead of waiting for it.
//!
//! ## Why no stub node
//!
//! The classic Vyukov queue keeps a permanent stub node so that `head` is never null; it
//! then needs either a dummy `T` (awkward for an instruction type) or a stub inside the
//! queue (which pins the queue in memory after the first push). Here nothing ever points
//! into the queue itself: the queue is created by a `const fn` with no arguments, can live
//! in a `static`, and may be moved even while it holds nodes. The price is a branch in
//! `push` and a compare-exchange when the consumer takes the last node — the same place
//! where the stub variant re-pushes its stub with a swap.
//!
//! # The was-empty protocol (how the consumer sleeps without losing a wake-up)
//!
//! [`push`](MpscQueue::push) returns `true` exactly when its swap found `head` null, that
//! is, when every node pushed before it had already been popped: only that producer has to
//! wake the consumer. A push that returns `false` linked its node behind a node the
//! consumer has not finished popping, so the consumer reaches it by popping on — no wake
//! needed — **provided the consumer obeys these rules**:
//!
//! 1. Keep popping while [`try_pop`](Consumer::try_pop) returns [`Pop::Item`]. On
//!    [`Pop::Inconsistent`] **never sleep**: a push is half done, its node is on its way,
//!    and its producer may have returned `false` and will not wake anyone. Retry (spin,
//!    or do other work and come back without sleeping).
//! 2. Only [`Pop::Empty`] allows sleeping, and only through a parking protocol that first
//!    announces the sleep with a read-modify-write the producers' wake also performs,
//!    *then* re-checks [`is_empty`](MpscQueue::is_empty), and only then sleeps (this is
//!    [`Parking`](crate::parking)'s `park(has_input, ..)` with
//!    `has_input = || !queue.is_empty()`).
//! 3. A producer whose `push` returned `true` wakes the consumer (`unpark`) after the push.
//!
//! [`DrainEnd::may_sleep`] and [`Consumer::drain_until_empty`] encode rule 1.
//!
//! ```
//! use core::ptr::NonNull;
//! use ivm_core::mpsc::{self, DrainEnd, MpscQueue, Pop};
//! use std::sync::Arc;
//!
//! struct Job {
//!     pending: mpsc::Links<Job>,
//!     id: u32,
//! }
//!
//! struct Pending; // the tag naming the `pending` hook
//!
//! // SAFETY: `into_ptr`/`from_ptr` are `Arc::into_raw`/`Arc::from_raw`, so the node does
//! // not move while the queue holds it; `links` projects to the `pending` field.
//! unsafe impl mpsc::Linked<Pending> for Job {
//!     type Handle = Arc<Job>;
//!     fn into_ptr(job: Arc<Job>) -> NonNull<Job> {
//!         NonNull::new(Arc::into_raw(job).cast_mut()).unwrap()
//!     }
//!     unsafe fn from_ptr(ptr: NonNull<Job>) -> Arc<Job> {
//!         // SAFETY: the caller passes a pointer that `into_ptr` returned.
//!         unsafe { Arc::from_raw(ptr.as_ptr()) }
//!     }
//!     unsafe fn links(ptr: NonNull<Job>) -> NonNull<mpsc::Links<Job>> {
//!         // SAFETY: `ptr` points to a live `Job`; projecting keeps it non-null.
//!         unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).pending) }
//!     }
//! }
//!
//! let queue: MpscQueue<Job, Pending> = MpscQueue::new();
//! let job = |id| Arc::new(Job { pending: mpsc::Links::new(), id });
//! assert!(queue.push(job(1)), "the first push finds the queue empty: wake the consumer");
//! assert!(!queue.push(job(2)), "the consumer will reach this one without a wake");
//!
//! let mut consumer = queue.consume();
//! let mut ids = Vec::new();
//! let end = consumer.drain(|job| ids.push(job.id));
//! assert_eq!(end, DrainEnd::Empty);
//! assert!(end.may_sleep());
//! assert_eq!(ids, [1, 2]);
//! assert!(matches!(consumer.try_pop(), Pop::Empty));
//! ```

use core::fmt;
use core::marker::{PhantomData, PhantomPinned};
use core::ptr::{self, NonNull};

use crossbeam_utils::CachePadded;

#[cfg(debug_assertions)]
use crate::sync::AtomicBool as DebugFlag;
use crate::sync::{AtomicBool, AtomicPtr, Ordering};

mod consumer;
mod push;
pub use consumer::{Consumer, DrainEnd, Pop};

/// The hook a node embeds to be queued in a [`MpscQueue`] (one hook per queue tag).
///
/// It holds the atomic pointer to the next queued node. A node may sit in at most one
/// queue per hook at a time; in debug builds pushing a node that is already queued
/// through this hook panics.
pub struct Links<T> {
    /// The node pushed right after this one, or null while there is none (yet).
    next: AtomicPtr<T>,
    /// Debug check against pushing a node twice: set by `push`, cleared by `pop`.
    #[cfg(debug_assertions)]
    queued: DebugFlag,
    /// The hook is reached through raw pointers while the node is shared: keep it `!Unpin`
    /// so that no `&mut` to a node can be assumed not to alias it.
    _pinned: PhantomPinned,
}

impl<T> Links<T> {
    crate::sync::loom_const_fn! {
        /// An unqueued hook.
        #[must_use]
        pub fn new() -> Self {
            Self {
                next: AtomicPtr::new(ptr::null_mut()),
                #[cfg(debug_assertions)]
                queued: DebugFlag::new(false),
                _pinned: PhantomPinned,
            }
        }
    }
}

impl<T> Default for Links<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for Links<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Relaxed: a diagnostic snapshot; nothing is read through the pointer.
        f.debug_struct("mpsc::Links")
            .field("next", &self.next.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A type whose nodes can be queued in a [`MpscQueue`] through the hook named by `Tag`.
///
/// Same shape as [`list::Linked`](crate::list::Linked), but the hook is an
/// [`mpsc::Links`](Links): a queued node is reached through an atomic `next` pointer.
///
/// # Safety
///
/// Implementors must ensure that:
/// * `into_ptr` gives up one owning `Handle` and returns a pointer to its node that stays
///   valid, at the same address, until `from_ptr` turns it back into that handle; the node
///   must not be moved or freed meanwhile (an `Arc` or `&'static` handle does this);
/// * `from_ptr(into_ptr(h))` returns a handle equivalent to `h`;
/// * `links` returns a pointer to the same [`Links`] field of the node every time, derived
///   from `ptr` without creating a `&mut` to the node, and that field is used by no other
///   queue tag.
pub unsafe trait Linked<Tag>: Sized {
    /// The owning pointer the queue holds while the node is queued.
    type Handle;

    /// Gives up ownership of `handle`, returning its node.
    fn into_ptr(handle: Self::Handle) -> NonNull<Self>;

    /// Takes ownership back from a pointer `into_ptr` returned.
    ///
    /// # Safety
    ///
    /// `ptr` came from [`Linked::into_ptr`] and has not been turned back into a handle since.
    unsafe fn from_ptr(ptr: NonNull<Self>) -> Self::Handle;

    /// The node's hook for `Tag`.
    ///
    /// # Safety
    ///
    /// `ptr` points to a live node.
    unsafe fn links(ptr: NonNull<Self>) -> NonNull<Links<Self>>;
}

/// The consumer's half, on its own cache line.
struct ConsumerSide<T> {
    /// The oldest node not yet popped; null when none has been handed to the consumer.
    tail: AtomicPtr<T>,
    /// Whether a [`Consumer`] guard exists.
    busy: AtomicBool,
}

/// An intrusive, lock-free multi-producer single-consumer queue of `T` nodes linked
/// through their `Tag` hook. See the [module docs](self) for the algorithm and for the
/// consumer's rules.
pub struct MpscQueue<T: Linked<Tag>, Tag> {
    /// The most recently pushed node, or null when the queue is empty. Producers swap it.
    head: CachePadded<AtomicPtr<T>>,
    consumer: CachePadded<ConsumerSide<T>>,
    /// The queue owns a `T::Handle` per queued node.
    _owns: PhantomData<T::Handle>,
    _tag: PhantomData<fn(Tag)>,
}

// SAFETY: the queue owns `T::Handle`s; moving the queue to another thread moves them, so
// `Handle: Send` suffices. Nodes are only reached through their (atomic) hooks.
unsafe impl<T: Linked<Tag>, Tag> Send for MpscQueue<T, Tag> where T::Handle: Send {}
// SAFETY: through `&MpscQueue` producers hand handles in and the (single, enforced by
// `Consumer` or by `try_pop_unchecked`'s contract) consumer takes them out on another
// thread: handles are sent, never shared, so `Handle: Send` suffices. All shared state is
// atomic.
unsafe impl<T: Linked<Tag>, Tag> Sync for MpscQueue<T, Tag> where T::Handle: Send {}

impl<T: Linked<Tag>, Tag> MpscQueue<T, Tag> {
    crate::sync::loom_const_fn! {
        /// An empty queue. `const`: the queue needs no stub node and may live in a `static`.
        #[must_use]
        pub fn new() -> Self {
            Self {
                head: CachePadded::new(AtomicPtr::new(ptr::null_mut())),
                consumer: CachePadded::new(ConsumerSide {
                    tail: AtomicPtr::new(ptr::null_mut()),
                    busy: AtomicBool::new(false),
                }),
                _owns: PhantomData,
                _tag: PhantomData,
            }
        }
    }

    /// Whether the queue holds no node (a linearizable snapshot of `head`).
    ///
    /// This is the consumer's re-check after announcing a park (rule 2 of the
    /// [protocol](self#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)).
    /// `false` while a push is half done, so it never lets the consumer sleep on an
    /// inconsistent queue.
    #[inline]
    pub fn is_empty(&self) -> bool {
        // Acquire: pairs with the Release swap in `push`, so a caller that sees a non-empty
        // queue also sees what the pusher wrote before pushing.
        self.head.load(Ordering::Acquire).is_null()
    }
}

impl<T: Linked<Tag>, Tag> Default for MpscQueue<T, Tag> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Linked<Tag>, Tag> fmt::Debug for MpscQueue<T, Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Relaxed: a diagnostic snapshot; nothing is read through the pointers.
        f.debug_struct("MpscQueue")
            .field("head", &self.head.load(Ordering::Relaxed))
            .field("tail", &self.consumer.tail.load(Ordering::Relaxed))
            .field("has_consumer", &self.consumer.busy.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T: Linked<Tag>, Tag> Drop for MpscQueue<T, Tag> {
    /// Drops every queued handle, oldest first.
    fn drop(&mut self) {
        // `&mut self`: every push has returned (each borrowed the queue), so every node is
        // linked and `tail .. head` is complete. Relaxed loads: whatever gave us `&mut`
        // ordered those pushes before us.
        let mut current = self.consumer.tail.load(Ordering::Relaxed);
        while let Some(node) = NonNull::new(current) {
            // SAFETY: `node` is queued, hence alive.
            current = unsafe { T::links(node).as_ref() }
                .next
                .load(Ordering::Relaxed);
            // SAFETY: the queue owned this node's handle; it is unlinked now.
            drop(unsafe { self.take(node) });
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
