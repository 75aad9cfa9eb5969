//! The producer side of [`MpscQueue`]: [`push`](MpscQueue::push) and
//! [`push_chain`](MpscQueue::push_chain) claim a node's hook, then publish it with one
//! AcqRel swap of `head` and one Release store (the hand-off into `tail`, or the link into
//! the previous node's `next`); and the planted Relaxed-link bug the loom model must catch.
//!
//! Separate from `mpsc.rs` so that the producers' orderings read in one place; the
//! consumer's Acquire loads and emptying compare-exchange they pair with are in
//! `consumer.rs`.

use core::ptr::{self, NonNull};

use super::{Linked, MpscQueue};
use crate::sync::Ordering;

impl<T: Linked<Tag>, Tag> MpscQueue<T, Tag> {
    /// Pushes `handle`'s node at the back of the queue. Wait-free: one swap and one store.
    ///
    /// Returns `true` exactly when the queue was empty before this push (every node pushed
    /// before it had already been popped). Then, and only then, the caller must wake the
    /// consumer. When it returns `false`, the node is linked behind a node the consumer has
    /// not finished popping, and a consumer that follows the
    /// [rules](super#the-was-empty-protocol-how-the-consumer-sleeps-without-losing-a-wake-up)
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
