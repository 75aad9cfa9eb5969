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
use crate::sync::{AtomicBool, AtomicPtr, Backoff, Ordering};

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

/// The result of one pop attempt.
#[must_use = "a popped handle is dropped when ignored; `Inconsistent` forbids sleeping"]
pub enum Pop<H> {
    /// The oldest queued node.
    Item(H),
    /// The queue held nothing when looked at. The consumer may sleep, through the parking
    /// protocol (see the [module docs](self#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)).
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

    /// Pushes `handle`'s node at the back of the queue. Wait-free: one swap and one store.
    ///
    /// Returns `true` exactly when the queue was empty before this push (every node pushed
    /// before it had already been popped). Then, and only then, the caller must wake the
    /// consumer. When it returns `false`, the node is linked behind a node the consumer has
    /// not finished popping, and a consumer that follows the
    /// [rules](self#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)
    /// reaches it without a wake.
    ///
    /// # Panics
    ///
    /// In debug builds, if the node is already queued through this hook (a double push,
    /// e.g. of two clones of one `Arc`).
    #[inline]
    pub fn push(&self, handle: T::Handle) -> bool {
        // Release, both: see `push_with`.
        self.push_with(handle, Ordering::Release, Ordering::Release)
    }

    /// Pushes the nodes of `handles`, in order, at the back of the queue as one unit: no
    /// other producer's node lands between them, and the consumer meets them in a row.
    /// Wait-free: the nodes are linked to each other first, then the chain is published
    /// with one swap and one store, as a single [`push`](Self::push). Returns what `push`
    /// returns for the chain's first node (`false` for an empty `handles`, which pushes
    /// nothing).
    ///
    /// # Panics
    ///
    /// In debug builds, if a node is already queued through this hook (a double push).
    pub fn push_chain(&self, handles: impl IntoIterator<Item = T::Handle>) -> bool {
        let mut chain: Option<(NonNull<T>, NonNull<T>)> = None;
        for handle in handles {
            let node = self.claim(handle);
            if let Some((_, last)) = &mut chain {
                // SAFETY: `last` is a node of this chain, claimed above and not yet
                // published: only this thread touches its hook.
                let last_links = unsafe { T::links(*last).as_ref() };
                // Relaxed: published with the whole chain by the Release store that links
                // its first node (`publish`); the consumer reads it only after that.
                last_links.next.store(node.as_ptr(), Ordering::Relaxed);
                *last = node;
            } else {
                chain = Some((node, node));
            }
        }
        match chain {
            // Release, both: see `publish`.
            Some((first, last)) => self.publish(first, last, Ordering::Release, Ordering::Release),
            None => false,
        }
    }

    /// `push` with the orderings of its two publishing stores given: the hand-off store
    /// into `tail` (`hand_off`) and the link store into the previous node's `next`
    /// (`link`). `push` passes Release for both; the planted bug passes Relaxed.
    #[inline]
    fn push_with(&self, handle: T::Handle, hand_off: Ordering, link: Ordering) -> bool {
        let node = self.claim(handle);
        self.publish(node, node, hand_off, link)
    }

    /// Turns `handle` into the queue's node pointer, its `next` cleared (not yet visible
    /// to anyone).
    #[inline]
    fn claim(&self, handle: T::Handle) -> NonNull<T> {
        let node = T::into_ptr(handle);
        // SAFETY: `into_ptr` returned a live node that stays put until `from_ptr`
        // (`Linked`'s contract); the hook holds only atomics, so a shared reference to it
        // aliases nothing mutable.
        let links = unsafe { T::links(node).as_ref() };
        // Relaxed: a misuse check; ownership transfer orders the legitimate cases.
        #[cfg(debug_assertions)]
        if links.queued.swap(true, Ordering::Relaxed) {
            // SAFETY: `node` came from `into_ptr` just above; giving the handle back (and
            // dropping it) leaves the queue's own handle for the node untouched.
            drop(unsafe { T::from_ptr(node) });
            panic!("mpsc: push of a node that is already queued through this hook (double push)");
        }
        // Relaxed: published by the Release swap/link in `publish` before anyone reads it.
        links.next.store(ptr::null_mut(), Ordering::Relaxed);
        node
    }

    /// Publishes the claimed chain `first ..= last` (linked through `next`, `last.next`
    /// null): one swap of `head`, then the hand-off into `tail` or the link from the
    /// previous last node. Returns whether the queue was empty.
    #[inline]
    fn publish(
        &self,
        first: NonNull<T>,
        last: NonNull<T>,
        hand_off: Ordering,
        link: Ordering,
    ) -> bool {
        // AcqRel. Release: publishes the chain (payloads, the `next` links inside it,
        //   `last.next = null`) to the producer that swaps next and then stores into
        //   `last.next`.
        // Acquire: pairs with the previous swap's Release (or the consumer's emptying CAS),
        //   so that `prev.next = null` (or the consumer's `tail = null`) happens before our
        //   store below.
        let prev = self.head.swap(last.as_ptr(), Ordering::AcqRel);
        match NonNull::new(prev) {
            None => {
                // The queue was empty: hand the chain to the consumer.
                // `hand_off` (Release in `push`): publishes the chain's payloads and links
                // to the consumer's Acquire load of `tail` in `pop_raw`.
                self.consumer.tail.store(first.as_ptr(), hand_off);
                true
            }
            Some(prev) => {
                // SAFETY: `prev` stays queued (alive) until its `next` is set: the consumer
                // pops it only after reading a non-null `next`, or by a compare-exchange of
                // `head` from `prev`, which fails now that `head` is `last`.
                let prev_links = unsafe { T::links(prev).as_ref() };
                // `link` (Release in `push`): publishes the chain's payloads and links to
                // the consumer's Acquire load of `prev.next` in `pop_raw`.
                prev_links.next.store(first.as_ptr(), link);
                false
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
    /// [rules](self#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)).
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
    unsafe fn take(&self, node: NonNull<T>) -> T::Handle {
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

    /// PLANTED BUG, for the loom model only: [`push`](Self::push) with the link and
    /// hand-off stores `Relaxed` instead of `Release`, so the consumer can read a node's
    /// payload before the producer's write to it is visible. Loom must report a
    /// causality violation.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_push_relaxed_link(&self, handle: T::Handle) -> bool {
        self.push_with(handle, Ordering::Relaxed, Ordering::Relaxed) // BUG
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

#[cfg(all(test, not(loom)))]
mod tests;
