//! The index storage of the intrusive list: nodes live in a pool (anything indexable by
//! `u32`: a fixed array, a `heapless::Vec`, a growable vector) and hooks hold the indices of
//! their neighbours instead of pointers.
//!
//! The concept is the pointer list's ([`List`](super::List)): a node embeds one hook per list
//! it can belong to, a zero-sized tag type names each hook, and a list links its nodes
//! through one tag's hook only. What differs is ownership: the pool owns the nodes, a list
//! owns nothing, and every operation borrows the pool. That makes it entirely safe code —
//! no pointers, no pinning, no `unsafe` — which is why the dependency engine (ivm-engine),
//! whose every object lives in a pool it owns, uses it: a node is reached by index from
//! several lists and from other nodes' edges, and moves with the pool if the pool grows.
//!
//! | | [`List`](super::List) (pointer hooks) | [`IndexList`] (index hooks) |
//! |---|---|---|
//! | nodes live | anywhere, pinned (`static`s, `Arc`s) | in one pool indexed by `u32` |
//! | the list owns | one handle per node | nothing (the pool owns the nodes) |
//! | hook | [`Links`](super::Links), atomic state, shareable across threads | [`IndexLinks`], plain data |
//! | used by | the MPSC queue's consumer (`drain_into`), interrupt-fed queues | ivm-engine's lively, ready, running, access and edge lists |
//!
//! A list head is `Copy` so that it can live outside the pool (in a dependence, say) and be
//! read, changed and written back by the pool's owner.
//!
//! # Examples
//!
//! ```
//! use ivm_core::list::{IndexLinked, IndexLinks, IndexList};
//!
//! #[derive(Default)]
//! struct Job {
//!     ready: IndexLinks,
//!     all: IndexLinks,
//! }
//! enum Ready {}
//! enum All {}
//! impl IndexLinked<Ready> for Job {
//!     fn links(&self) -> &IndexLinks { &self.ready }
//!     fn links_mut(&mut self) -> &mut IndexLinks { &mut self.ready }
//! }
//! impl IndexLinked<All> for Job {
//!     fn links(&self) -> &IndexLinks { &self.all }
//!     fn links_mut(&mut self) -> &mut IndexLinks { &mut self.all }
//! }
//!
//! let mut pool: [Job; 3] = Default::default();
//! let mut all = IndexList::<All>::new();
//! let mut ready = IndexList::<Ready>::new();
//! for i in 0..3 {
//!     all.push_back(&mut pool[..], i);
//! }
//! ready.push_back(&mut pool[..], 2);
//! ready.push_back(&mut pool[..], 0);
//! assert_eq!(ready.iter(&pool[..]).collect::<Vec<_>>(), [2, 0]);
//! all.remove(&mut pool[..], 1);
//! assert_eq!(all.iter(&pool[..]).collect::<Vec<_>>(), [0, 2]);
//! assert!(IndexList::<Ready>::is_linked(&pool[..], 0));
//! assert_eq!(ready.pop_front(&mut pool[..]), Some(2));
//! all.assert_valid(&pool[..]);
//! ready.assert_valid(&pool[..]);
//! ```

use core::fmt;
use core::marker::PhantomData;

/// The "no node" index of [`IndexLinks`] and [`IndexList`].
pub const NIL: u32 = u32::MAX;

/// The hook of one index-linked list inside a node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IndexLinks {
    prev: u32,
    next: u32,
    linked: bool,
}

impl IndexLinks {
    /// An unlinked hook.
    pub const fn new() -> Self {
        Self {
            prev: NIL,
            next: NIL,
            linked: false,
        }
    }

    /// Whether the hook is linked into a list.
    pub const fn is_linked(&self) -> bool {
        self.linked
    }

    /// The next node of the list, if any.
    pub const fn next(&self) -> Option<u32> {
        if self.next == NIL {
            None
        } else {
            Some(self.next)
        }
    }

    /// The previous node of the list, if any.
    pub const fn prev(&self) -> Option<u32> {
        if self.prev == NIL {
            None
        } else {
            Some(self.prev)
        }
    }
}

impl Default for IndexLinks {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for IndexLinks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.linked {
            write!(f, "IndexLinks({:?} <- . -> {:?})", self.prev(), self.next())
        } else {
            f.write_str("IndexLinks(unlinked)")
        }
    }
}

/// A node type with an index hook named by `Tag` (a zero-sized type, one per hook).
///
/// Both methods must return the same field, and no other tag's implementation may return
/// that field. This is a safe trait: breaking the rule corrupts the lists that use the
/// field (an operation may then panic or link nodes wrongly) but cannot cause undefined
/// behaviour.
pub trait IndexLinked<Tag> {
    /// The hook of `Tag`.
    fn links(&self) -> &IndexLinks;
    /// The hook of `Tag`, mutably.
    fn links_mut(&mut self) -> &mut IndexLinks;
}

/// The head of a doubly-linked list of pool indices, threaded through the `Tag` hook of
/// the pool's nodes. See the [module docs](self).
///
/// `P` in the methods is the pool: any [`Pool`] of nodes (a slice, ivm-engine's pools). Every index handed in must be in bounds, and a
/// list must always be used with the same pool.
pub struct IndexList<Tag> {
    head: u32,
    tail: u32,
    len: u32,
    _tag: PhantomData<fn() -> Tag>,
}

impl<Tag> Clone for IndexList<Tag> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Tag> Copy for IndexList<Tag> {}

impl<Tag> Default for IndexList<Tag> {
    fn default() -> Self {
        Self::new()
    }
}

impl<Tag> fmt::Debug for IndexList<Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexList")
            .field("head", &(self.head != NIL).then_some(self.head))
            .field("tail", &(self.tail != NIL).then_some(self.tail))
            .field("len", &self.len)
            .finish()
    }
}

/// Index access to a pool of nodes: implemented for slices here, and by ivm-engine's
/// pools.
pub trait Pool<T> {
    /// Node `i`.
    fn node(&self, i: u32) -> &T;
    /// Node `i`, mutably.
    fn node_mut(&mut self, i: u32) -> &mut T;
}

impl<T> Pool<T> for [T] {
    #[inline]
    fn node(&self, i: u32) -> &T {
        &self[i as usize]
    }
    #[inline]
    fn node_mut(&mut self, i: u32) -> &mut T {
        &mut self[i as usize]
    }
}

impl<Tag> IndexList<Tag> {
    /// An empty list.
    pub const fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
            _tag: PhantomData,
        }
    }

    /// Number of linked nodes.
    pub const fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether no node is linked.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first node.
    pub const fn front(&self) -> Option<u32> {
        if self.head == NIL {
            None
        } else {
            Some(self.head)
        }
    }

    /// The last node.
    pub const fn back(&self) -> Option<u32> {
        if self.tail == NIL {
            None
        } else {
            Some(self.tail)
        }
    }

    /// Whether node `i` is linked through the `Tag` hook (into some list).
    pub fn is_linked<T, P>(pool: &P, i: u32) -> bool
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        pool.node(i).links().is_linked()
    }

    /// The node after `i` on this list.
    pub fn next<T, P>(&self, pool: &P, i: u32) -> Option<u32>
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        pool.node(i).links().next()
    }

    /// The node before `i` on this list.
    pub fn prev<T, P>(&self, pool: &P, i: u32) -> Option<u32>
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        pool.node(i).links().prev()
    }

    /// Appends node `i`.
    ///
    /// # Panics
    /// If `i` is already linked through the `Tag` hook (double link).
    #[track_caller]
    pub fn push_back<T, P>(&mut self, pool: &mut P, i: u32)
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let l = pool.node_mut(i).links_mut();
        assert!(!l.linked, "ivm-core index list: double link of node {i}");
        *l = IndexLinks {
            prev: self.tail,
            next: NIL,
            linked: true,
        };
        if self.tail == NIL {
            self.head = i;
        } else {
            pool.node_mut(self.tail).links_mut().next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Prepends node `i`.
    ///
    /// # Panics
    /// If `i` is already linked through the `Tag` hook (double link).
    #[track_caller]
    pub fn push_front<T, P>(&mut self, pool: &mut P, i: u32)
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let l = pool.node_mut(i).links_mut();
        assert!(!l.linked, "ivm-core index list: double link of node {i}");
        *l = IndexLinks {
            prev: NIL,
            next: self.head,
            linked: true,
        };
        if self.head == NIL {
            self.tail = i;
        } else {
            pool.node_mut(self.head).links_mut().prev = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Unlinks node `i`, which must be on this list.
    ///
    /// # Panics
    /// If `i` is not linked; in debug builds also if it is linked into another list
    /// through the same hook (detected at the list's ends).
    #[track_caller]
    pub fn remove<T, P>(&mut self, pool: &mut P, i: u32)
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let IndexLinks { prev, next, linked } = *pool.node(i).links();
        assert!(linked, "ivm-core index list: removing unlinked node {i}");
        if prev == NIL {
            debug_assert_eq!(self.head, i, "ivm-core index list: remove from wrong list");
            self.head = next;
        } else {
            pool.node_mut(prev).links_mut().next = next;
        }
        if next == NIL {
            debug_assert_eq!(self.tail, i, "ivm-core index list: remove from wrong list");
            self.tail = prev;
        } else {
            pool.node_mut(next).links_mut().prev = prev;
        }
        *pool.node_mut(i).links_mut() = IndexLinks::new();
        self.len -= 1;
    }

    /// Unlinks and returns the first node.
    pub fn pop_front<T, P>(&mut self, pool: &mut P) -> Option<u32>
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let f = self.front()?;
        self.remove(pool, f);
        Some(f)
    }

    /// Unlinks and returns the last node.
    pub fn pop_back<T, P>(&mut self, pool: &mut P) -> Option<u32>
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let b = self.back()?;
        self.remove(pool, b);
        Some(b)
    }

    /// Moves every node of `other` to the back of this list, in order; `other` is empty
    /// afterwards. O(1).
    pub fn splice_back<T, P>(&mut self, pool: &mut P, other: &mut Self)
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        if other.is_empty() {
            return;
        }
        if self.is_empty() {
            *self = *other;
        } else {
            pool.node_mut(self.tail).links_mut().next = other.head;
            pool.node_mut(other.head).links_mut().prev = self.tail;
            self.tail = other.tail;
            self.len += other.len;
        }
        *other = Self::new();
    }

    /// Unlinks every node, front to back, calling `each(pool, i)` on each after it left.
    pub fn clear<T, P>(&mut self, pool: &mut P, mut each: impl FnMut(&mut P, u32))
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let mut i = self.head;
        while i != NIL {
            let next = pool.node(i).links().next;
            *pool.node_mut(i).links_mut() = IndexLinks::new();
            each(pool, i);
            i = next;
        }
        *self = Self::new();
    }

    /// The nodes, front to back. The pool is borrowed shared: to change the list while
    /// walking it, step by hand with [`front`](Self::front) and [`next`](Self::next),
    /// reading the next index before removing the current node.
    pub fn iter<'a, T, P>(&self, pool: &'a P) -> Iter<'a, T, P, Tag>
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        Iter {
            pool,
            next: self.head,
            left: self.len,
            _p: PhantomData,
        }
    }

    /// Checks the list's structure against the pool: links point both ways, the ends
    /// match, the length matches, every node is marked linked.
    ///
    /// # Panics
    /// On the first inconsistency, naming it.
    #[track_caller]
    pub fn assert_valid<T, P>(&self, pool: &P)
    where
        T: IndexLinked<Tag>,
        P: Pool<T> + ?Sized,
    {
        let mut prev = NIL;
        let mut i = self.head;
        let mut n = 0u32;
        while i != NIL {
            let l = pool.node(i).links();
            assert!(
                l.linked,
                "ivm-core index list: node {i} on a list but unlinked"
            );
            assert_eq!(
                l.prev, prev,
                "ivm-core index list: node {i} has a wrong prev"
            );
            n += 1;
            assert!(
                n <= self.len,
                "ivm-core index list: longer than its length (a cycle?)"
            );
            prev = i;
            i = l.next;
        }
        assert_eq!(self.tail, prev, "ivm-core index list: wrong tail");
        assert_eq!(n, self.len, "ivm-core index list: wrong length");
    }
}

/// Iterator over an [`IndexList`]'s node indices, front to back.
pub struct Iter<'a, T, P: ?Sized, Tag> {
    pool: &'a P,
    next: u32,
    left: u32,
    _p: PhantomData<fn() -> (Tag, T)>,
}

impl<T: IndexLinked<Tag>, P: Pool<T> + ?Sized, Tag> Iterator for Iter<'_, T, P, Tag> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.next == NIL {
            return None;
        }
        let i = self.next;
        self.next = self.pool.node(i).links().next;
        self.left = self.left.saturating_sub(1);
        Some(i)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::vec::Vec;

    #[derive(Default, Clone)]
    struct N {
        a: IndexLinks,
        b: IndexLinks,
    }
    enum A {}
    enum B {}
    impl IndexLinked<A> for N {
        fn links(&self) -> &IndexLinks {
            &self.a
        }
        fn links_mut(&mut self) -> &mut IndexLinks {
            &mut self.a
        }
    }
    impl IndexLinked<B> for N {
        fn links(&self) -> &IndexLinks {
            &self.b
        }
        fn links_mut(&mut self) -> &mut IndexLinks {
            &mut self.b
        }
    }

    #[test]
    fn two_hooks_two_lists() {
        let mut pool = std::vec![N::default(); 5];
        let mut a = IndexList::<A>::new();
        let mut b = IndexList::<B>::new();
        for i in 0..5 {
            a.push_back(&mut pool[..], i);
        }
        b.push_front(&mut pool[..], 3);
        b.push_front(&mut pool[..], 1);
        a.remove(&mut pool[..], 0);
        a.remove(&mut pool[..], 4);
        a.remove(&mut pool[..], 2);
        assert_eq!(a.iter(&pool[..]).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(b.iter(&pool[..]).collect::<Vec<_>>(), [1, 3]);
        a.assert_valid(&pool[..]);
        b.assert_valid(&pool[..]);
        let mut seen = Vec::new();
        b.clear(&mut pool[..], |_, i| seen.push(i));
        assert_eq!(seen, [1, 3]);
        assert!(!IndexList::<B>::is_linked(&pool[..], 1));
        assert!(IndexList::<A>::is_linked(&pool[..], 1));
    }

    #[test]
    #[should_panic(expected = "double link")]
    fn double_link_panics() {
        let mut pool = std::vec![N::default(); 2];
        let mut a = IndexList::<A>::new();
        let mut a2 = IndexList::<A>::new();
        a.push_back(&mut pool[..], 1);
        a2.push_back(&mut pool[..], 1);
    }

    #[test]
    fn splice_and_pop_match_a_deque() {
        // A small deterministic op sequence checked against VecDeque models.
        let mut pool = std::vec![N::default(); 16];
        let mut l = IndexList::<A>::new();
        let mut m = IndexList::<A>::new();
        let (mut ml, mut mm) = (VecDeque::new(), VecDeque::new());
        let mut seed = 0x9e37_79b9u32;
        for step in 0..2000u32 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let i = seed % 16;
            match step % 5 {
                0 | 1 if !IndexList::<A>::is_linked(&pool[..], i) => {
                    if seed & 1 == 0 {
                        l.push_back(&mut pool[..], i);
                        ml.push_back(i);
                    } else {
                        m.push_front(&mut pool[..], i);
                        mm.push_front(i);
                    }
                }
                2 => {
                    assert_eq!(l.pop_front(&mut pool[..]), ml.pop_front());
                }
                3 => {
                    assert_eq!(m.pop_back(&mut pool[..]), mm.pop_back());
                }
                4 if seed & 7 == 0 => {
                    l.splice_back(&mut pool[..], &mut m);
                    ml.extend(mm.drain(..));
                }
                _ => {
                    if let Some(pos) = ml.iter().position(|&x| x == i) {
                        l.remove(&mut pool[..], i);
                        ml.remove(pos);
                    }
                }
            }
            l.assert_valid(&pool[..]);
            m.assert_valid(&pool[..]);
            assert_eq!(l.iter(&pool[..]).collect::<Vec<_>>(), Vec::from(ml.clone()));
            assert_eq!(m.iter(&pool[..]).collect::<Vec<_>>(), Vec::from(mm.clone()));
        }
    }
}
