//! Engine-private pools: a slab whose slots keep their allocations when reused, and
//! doubly-linked lists threaded through slab indices.
//!
//! Everything here is owned by the engine (one thread at a time, through `&mut Engine`),
//! so it is plain sequential code: no atomics, no `unsafe`.

/// The "no index" marker of [`Links`] and [`IdxList`].
pub(crate) const NIL: u32 = u32::MAX;

/// A pool of `T` addressed by `u32` indices. Freed slots are reused in LIFO order and keep
/// whatever capacity their `Vec` fields had, so a steady state allocates nothing.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<T>,
    free: Vec<u32>,
    live: usize,
}

impl<T: Default> Slab<T> {
    /// An empty pool (the engine uses [`Slab::prefilled`]).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) const fn new() -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }

    /// A pool with `n` free slots made by `make` (pre-sized: the first `n` live entries
    /// allocate nothing, beyond what `make` reserved up front).
    pub(crate) fn prefilled(n: u32, mut make: impl FnMut() -> T) -> Self {
        let mut s = Self {
            entries: Vec::with_capacity(n as usize),
            free: Vec::with_capacity(n as usize),
            live: 0,
        };
        for _ in 0..n {
            s.entries.push(make());
        }
        // LIFO: slot 0 is taken first.
        s.free.extend((0..n).rev());
        s
    }

    /// Takes a slot (a reused one if any) and returns its index. The slot holds whatever
    /// its previous user left: the caller re-initialises every field it relies on.
    pub(crate) fn alloc(&mut self) -> u32 {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            return i;
        }
        let i = u32::try_from(self.entries.len()).expect("ivm: more than 2^32 live engine objects");
        assert!(i != NIL, "ivm: more than 2^32 - 1 live engine objects");
        self.entries.push(T::default());
        i
    }

    /// Returns slot `i` to the pool.
    pub(crate) fn free(&mut self, i: u32) {
        debug_assert!(
            (i as usize) < self.entries.len(),
            "ivm: freeing a slot that was never allocated"
        );
        debug_assert!(self.live > 0, "ivm: slab live count underflow");
        self.live -= 1;
        self.free.push(i);
    }

    /// Number of slots in use.
    pub(crate) fn live(&self) -> usize {
        self.live
    }
}

impl<T> core::ops::Index<u32> for Slab<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: u32) -> &T {
        &self.entries[i as usize]
    }
}

impl<T> core::ops::IndexMut<u32> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut T {
        &mut self.entries[i as usize]
    }
}

/// The hook of one index-linked list inside a slab entry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Links {
    pub(crate) prev: u32,
    pub(crate) next: u32,
    pub(crate) linked: bool,
}

impl Default for Links {
    fn default() -> Self {
        Self {
            prev: NIL,
            next: NIL,
            linked: false,
        }
    }
}

/// The head of a doubly-linked list of slab indices; `hook` selects which [`Links`] field
/// of the entry the list threads through (an entry can be on several lists at once).
#[derive(Debug, Clone, Copy)]
pub(crate) struct IdxList {
    pub(crate) head: u32,
    pub(crate) tail: u32,
    pub(crate) len: u32,
}

impl Default for IdxList {
    fn default() -> Self {
        Self::new()
    }
}

impl IdxList {
    pub(crate) const fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `i`. Panics if `i` is already linked through `hook`.
    pub(crate) fn push_back<T>(
        &mut self,
        slab: &mut Slab<T>,
        i: u32,
        hook: fn(&mut T) -> &mut Links,
    ) {
        let l = hook(&mut slab[i]);
        assert!(
            !l.linked,
            "ivm engine: linking an entry that is already linked"
        );
        *l = Links {
            prev: self.tail,
            next: NIL,
            linked: true,
        };
        if self.tail == NIL {
            self.head = i;
        } else {
            hook(&mut slab[self.tail]).next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Unlinks `i`, which must be on this list.
    pub(crate) fn remove<T>(&mut self, slab: &mut Slab<T>, i: u32, hook: fn(&mut T) -> &mut Links) {
        let Links { prev, next, linked } = *hook(&mut slab[i]);
        assert!(linked, "ivm engine: unlinking an entry that is not linked");
        if prev == NIL {
            debug_assert_eq!(
                self.head, i,
                "ivm engine: unlinking an entry from the wrong list"
            );
            self.head = next;
        } else {
            hook(&mut slab[prev]).next = next;
        }
        if next == NIL {
            debug_assert_eq!(
                self.tail, i,
                "ivm engine: unlinking an entry from the wrong list"
            );
            self.tail = prev;
        } else {
            hook(&mut slab[next]).prev = prev;
        }
        *hook(&mut slab[i]) = Links::default();
        self.len -= 1;
    }

    /// Unlinks every entry, calling `each` on it after it left the list.
    pub(crate) fn clear<T>(
        &mut self,
        slab: &mut Slab<T>,
        hook: fn(&mut T) -> &mut Links,
        mut each: impl FnMut(&mut Slab<T>, u32),
    ) {
        let mut i = self.head;
        while i != NIL {
            let next = hook(&mut slab[i]).next;
            *hook(&mut slab[i]) = Links::default();
            each(slab, i);
            i = next;
        }
        *self = Self::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct E {
        a: Links,
        v: Vec<u32>,
    }

    #[test]
    fn slab_reuses_slots_and_capacity() {
        let mut s: Slab<E> = Slab::new();
        let i = s.alloc();
        s[i].v.extend([1, 2, 3]);
        s.free(i);
        let j = s.alloc();
        assert_eq!(i, j);
        assert!(s[j].v.capacity() >= 3);
        assert_eq!(s.live(), 1);
    }

    #[test]
    fn list_push_remove() {
        let mut s: Slab<E> = Slab::new();
        let ids: Vec<u32> = (0..4).map(|_| s.alloc()).collect();
        let mut l = IdxList::new();
        for &i in &ids {
            l.push_back(&mut s, i, |e| &mut e.a);
        }
        l.remove(&mut s, ids[1], |e| &mut e.a);
        l.remove(&mut s, ids[3], |e| &mut e.a);
        l.remove(&mut s, ids[0], |e| &mut e.a);
        assert_eq!(l.front(), Some(ids[2]));
        assert_eq!(l.len, 1);
        let mut seen = Vec::new();
        l.clear(&mut s, |e| &mut e.a, |_, i| seen.push(i));
        assert_eq!(seen, vec![ids[2]]);
        assert!(l.is_empty());
        assert!(!s[ids[2]].a.linked);
    }
}
