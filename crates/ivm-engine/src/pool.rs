//! Storage: the fixed-capacity or growable pools that hold every engine object.
//!
//! The engine keeps four pools — instructions ([`Node`]), accesses ([`AccessSlot`]), edges
//! ([`Edge`]) and streams ([`StreamSlot`]) — and never allocates on its own: a [`Storage`]
//! says which container backs each pool. [`Fixed`] uses `heapless::Vec`s sized by const
//! generics, so an engine on a microcontroller lives in a `static` or on the stack and a
//! full pool is an error value ([`Full`](crate::Full), [`Stalled`](crate::Stalled)), never a
//! panic or an allocation. With the `alloc` feature, [`Growable`] uses `Vec`s that grow
//! on demand and keep their capacity (ivm-std uses it: a steady state allocates nothing).
//!
//! Freed slots are kept on a free list threaded through one of the slot's own hooks (a
//! freed instruction is on no lively list, so that hook is free to use), and reused LIFO.

use ivm_core::list::{IndexLinked, IndexList, Pool};

pub use crate::engine::{AccessSlot, Edge, Node, StreamSlot};

/// A container that backs one pool: a slice view plus a fallible push.
pub trait Slots<T>: Default {
    /// The slots made so far.
    fn as_slice(&self) -> &[T];
    /// The slots made so far, mutably.
    fn as_mut_slice(&mut self) -> &mut [T];
    /// Adds a slot, or gives it back when the container is full.
    fn try_push(&mut self, value: T) -> Result<(), T>;
    /// Makes room for `additional` more slots up front, where the container can grow (a
    /// hint; fixed containers ignore it).
    fn reserve(&mut self, additional: usize) {
        let _ = additional;
    }
}

impl<T, const N: usize> Slots<T> for heapless::Vec<T, N> {
    fn as_slice(&self) -> &[T] {
        self
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        self
    }
    fn try_push(&mut self, value: T) -> Result<(), T> {
        self.push(value)
    }
}

#[cfg(feature = "alloc")]
impl<T> Slots<T> for alloc::vec::Vec<T> {
    fn as_slice(&self) -> &[T] {
        self
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        self
    }
    fn try_push(&mut self, value: T) -> Result<(), T> {
        self.push(value);
        Ok(())
    }
    fn reserve(&mut self, additional: usize) {
        alloc::vec::Vec::reserve(self, additional);
    }
}

/// Which containers back an engine's pools, for instructions of type `I`.
pub trait Storage<I> {
    /// Lively (and received, not yet handled) instructions.
    type Nodes: Slots<Node<I>>;
    /// Accesses of lively instructions to dependences.
    type Accesses: Slots<AccessSlot>;
    /// Edges between lively instructions.
    type Edges: Slots<Edge>;
    /// Streams, indexed by [`Instruction::stream`](crate::Instruction::stream).
    type Streams: Slots<StreamSlot>;
}

/// Fixed capacity, no allocator: at most `NODES` instructions received and not released,
/// `ACCESSES` accesses and `EDGES` edges among them, and streams `0..STREAMS`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fixed<
    const NODES: usize,
    const ACCESSES: usize,
    const EDGES: usize,
    const STREAMS: usize,
>;

impl<I, const N: usize, const A: usize, const E: usize, const S: usize> Storage<I>
    for Fixed<N, A, E, S>
{
    type Nodes = heapless::Vec<Node<I>, N>;
    type Accesses = heapless::Vec<AccessSlot, A>;
    type Edges = heapless::Vec<Edge, E>;
    type Streams = heapless::Vec<StreamSlot, S>;
}

/// Growable pools over `Vec` (feature `alloc`): no capacity limit; a pool that grew keeps
/// its slots, so a steady state allocates nothing.
#[cfg(feature = "alloc")]
#[cfg_attr(docsrs, doc(cfg(feature = "alloc")))]
#[derive(Debug, Clone, Copy, Default)]
pub struct Growable;

#[cfg(feature = "alloc")]
impl<I> Storage<I> for Growable {
    type Nodes = alloc::vec::Vec<Node<I>>;
    type Accesses = alloc::vec::Vec<AccessSlot>;
    type Edges = alloc::vec::Vec<Edge>;
    type Streams = alloc::vec::Vec<StreamSlot>;
}

/// Tag of the hook that threads a pool's free list.
pub(crate) enum Free {}

/// A pool of `T` over the container `C`, addressed by `u32` indices.
pub(crate) struct Slab<T, C> {
    slots: C,
    free: IndexList<Free>,
    live: u32,
    _t: core::marker::PhantomData<fn() -> T>,
}

impl<T: IndexLinked<Free> + Default, C: Slots<T>> Slab<T, C> {
    pub(crate) fn new() -> Self {
        Self {
            slots: C::default(),
            free: IndexList::new(),
            live: 0,
            _t: core::marker::PhantomData,
        }
    }

    /// Makes `n` free slots up front (where the container can grow): the first `n` live
    /// objects then allocate nothing.
    pub(crate) fn presize(&mut self, n: u32) {
        self.slots.reserve(n as usize);
        while self.slots.as_slice().len() < n as usize {
            let i = self.slots.as_slice().len() as u32;
            if self.slots.try_push(T::default()).is_err() {
                break;
            }
            // Lowest index first, as a growing container hands them out.
            self.free.push_back(self.slots.as_mut_slice(), i);
        }
    }

    /// Takes a slot (the most recently freed one if any), or `None` when the container is
    /// full. The slot holds whatever its last user left: the caller sets every field it
    /// relies on.
    pub(crate) fn alloc(&mut self) -> Option<u32> {
        if let Some(i) = self.free.pop_front(self.slots.as_mut_slice()) {
            self.live += 1;
            return Some(i);
        }
        let i = u32::try_from(self.slots.as_slice().len()).ok()?;
        if i == ivm_core::list::NIL {
            return None;
        }
        self.slots.try_push(T::default()).ok()?;
        self.live += 1;
        Some(i)
    }

    /// Returns slot `i` to the pool. Its free-list hook must be unlinked (the caller took
    /// it off every list that uses that hook).
    pub(crate) fn free(&mut self, i: u32) {
        debug_assert!(self.live > 0, "ivm-engine: pool live count underflow");
        self.live -= 1;
        self.free.push_front(self.slots.as_mut_slice(), i);
    }

    /// Slots in use.
    pub(crate) fn live(&self) -> usize {
        self.live as usize
    }

    /// Free slots (that [`alloc`](Self::alloc) hands out before the container grows).
    #[cfg(test)]
    pub(crate) fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Whether `n` more slots can be had: free ones, or room to push.
    pub(crate) fn can_alloc(&mut self, n: usize) -> bool {
        if self.free.len() >= n {
            return true;
        }
        // Probe by growing: a slot pushed now is put on the free list, so it is not lost.
        while self.free.len() < n {
            let i = self.slots.as_slice().len();
            if i >= ivm_core::list::NIL as usize || self.slots.try_push(T::default()).is_err() {
                return false;
            }
            self.free.push_front(self.slots.as_mut_slice(), i as u32);
        }
        true
    }

    pub(crate) fn slice(&self) -> &[T] {
        self.slots.as_slice()
    }
}

impl<T, C: Slots<T>> core::ops::Index<u32> for Slab<T, C> {
    type Output = T;
    #[inline]
    fn index(&self, i: u32) -> &T {
        &self.slots.as_slice()[i as usize]
    }
}

impl<T, C: Slots<T>> core::ops::IndexMut<u32> for Slab<T, C> {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut T {
        &mut self.slots.as_mut_slice()[i as usize]
    }
}

impl<T, C: Slots<T>> Pool<T> for Slab<T, C> {
    #[inline]
    fn node(&self, i: u32) -> &T {
        &self.slots.as_slice()[i as usize]
    }
    #[inline]
    fn node_mut(&mut self, i: u32) -> &mut T {
        &mut self.slots.as_mut_slice()[i as usize]
    }
}

/// Declares `IndexLinked<$tag>` for `$ty` through its field `$field`.
macro_rules! hook {
    ($ty:ty, $tag:ty, $field:ident) => {
        impl ivm_core::list::IndexLinked<$tag> for $ty {
            #[inline]
            fn links(&self) -> &ivm_core::list::IndexLinks {
                &self.$field
            }
            #[inline]
            fn links_mut(&mut self) -> &mut ivm_core::list::IndexLinks {
                &mut self.$field
            }
        }
    };
}
pub(crate) use hook;

#[cfg(test)]
mod tests {
    use super::*;
    use ivm_core::list::IndexLinks;

    #[derive(Default)]
    struct E {
        free: IndexLinks,
        v: u32,
    }
    hook!(E, Free, free);

    #[test]
    fn fixed_pool_reuses_and_reports_full() {
        let mut s: Slab<E, heapless::Vec<E, 2>> = Slab::new();
        let a = s.alloc().unwrap();
        let b = s.alloc().unwrap();
        assert_eq!(s.alloc(), None);
        s[a].v = 7;
        s.free(a);
        assert_eq!(s.alloc(), Some(a));
        assert_eq!(s[a].v, 7, "a reused slot keeps what its last user left");
        assert_eq!(s.live(), 2);
        s.free(b);
        assert!(s.can_alloc(1));
        assert!(!s.can_alloc(2));
    }

    #[test]
    fn presize_fills_the_free_list() {
        let mut s: Slab<E, heapless::Vec<E, 8>> = Slab::new();
        s.presize(4);
        assert_eq!(s.free_slots(), 4);
        assert_eq!(s.alloc(), Some(0), "LIFO from the lowest presized slot");
        s.presize(100);
        assert_eq!(s.free_slots(), 7, "capped by the container");
    }
}
