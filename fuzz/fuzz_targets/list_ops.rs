//! Random operations on intrusive lists whose nodes sit in several lists at once, checked
//! against a `VecDeque` model per list.
//!
//! A fixed pool of reference-counted nodes has three hooks (tags `H0`, `H1`, `H2`). Each
//! hook has a main list and a spare list, so a node can be in three lists at once (one per
//! hook), and `splice_back` and erasing from the wrong list of the same hook are exercised
//! too. After every step every list is checked with `assert_valid` and against its model
//! (order, both directions, len, front, back, membership), and every node's reference count
//! must be one (the pool) plus the number of lists it is in.
#![no_main]

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;

use arbitrary::Arbitrary;
use ivm_core::list::{Linked, Links, List};
use libfuzzer_sys::fuzz_target;

/// Nodes in the pool.
const NODES: usize = 8;
/// Longest cursor walk per step.
const MAX_CURSOR_STEPS: usize = 64;

enum H0 {}
enum H1 {}
enum H2 {}

struct Node {
    index: usize,
    hooks: [Links<Node>; 3],
}

macro_rules! linked {
    ($tag:ty, $hook:literal) => {
        // SAFETY: `Arc::into_raw`/`from_raw` move one strong count out and back, and the
        // allocation never moves; `links` projects this tag's own hook without making a
        // reference to the node.
        unsafe impl Linked<$tag> for Node {
            type Handle = Arc<Node>;

            fn into_ptr(node: Arc<Node>) -> NonNull<Node> {
                // SAFETY: `Arc::into_raw` never returns null.
                unsafe { NonNull::new_unchecked(Arc::into_raw(node).cast_mut()) }
            }

            unsafe fn from_ptr(ptr: NonNull<Node>) -> Arc<Node> {
                // SAFETY: `ptr` came from `into_ptr`, i.e. from `Arc::into_raw`.
                unsafe { Arc::from_raw(ptr.as_ptr()) }
            }

            unsafe fn links(ptr: NonNull<Node>) -> NonNull<Links<Node>> {
                // SAFETY: `ptr` points to a live node, so the address of a field is not null.
                // Indexing an array place is a built-in projection: no reference is made.
                unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).hooks[$hook]) }
            }
        }
    };
}
linked!(H0, 0);
linked!(H1, 1);
linked!(H2, 2);

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Step {
    Next,
    Prev,
    Remove,
}

#[derive(Arbitrary, Debug)]
enum HookOp {
    PushBack {
        list: bool,
        node: u8,
    },
    PushFront {
        list: bool,
        node: u8,
    },
    PopFront {
        list: bool,
    },
    PopBack {
        list: bool,
    },
    /// The unsafe `erase`, only where its contract holds.
    Erase {
        list: bool,
        node: u8,
    },
    /// The safe `erase_checked`, with any node.
    EraseChecked {
        list: bool,
        node: u8,
    },
    /// `lists[into].splice_back(lists[!into])`.
    Splice {
        into: bool,
    },
    /// A cursor walk from the front that may remove nodes on the way.
    Cursor {
        list: bool,
        steps: Vec<Step>,
    },
    /// Drop the list (releasing its handles) and start a new one.
    Reset {
        list: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Op {
    hook: u8,
    op: HookOp,
}

/// The two lists of one hook and their models (node indices, front to back).
struct Hook<Tag>
where
    Node: Linked<Tag, Handle = Arc<Node>>,
{
    lists: [List<Node, Tag>; 2],
    models: [VecDeque<usize>; 2],
    hook: usize,
}

impl<Tag> Hook<Tag>
where
    Node: Linked<Tag, Handle = Arc<Node>>,
{
    fn new(hook: usize) -> Self {
        Self {
            lists: [List::new(), List::new()],
            models: [VecDeque::new(), VecDeque::new()],
            hook,
        }
    }

    /// Which of this hook's lists holds node `n`, by the model.
    fn owner(&self, n: usize) -> Option<usize> {
        (0..2).find(|&l| self.models[l].contains(&n))
    }

    fn apply(&mut self, op: &HookOp, pool: &[Arc<Node>]) {
        let node = |n: u8| usize::from(n) % NODES;
        match *op {
            HookOp::PushBack { list, node: n } | HookOp::PushFront { list, node: n } => {
                let (l, n) = (usize::from(list), node(n));
                if self.owner(n).is_some() {
                    // A double link panics by design; libFuzzer would report the panic.
                    return;
                }
                if matches!(op, HookOp::PushBack { .. }) {
                    self.lists[l].push_back(pool[n].clone());
                    self.models[l].push_back(n);
                } else {
                    self.lists[l].push_front(pool[n].clone());
                    self.models[l].push_front(n);
                }
            }
            HookOp::PopFront { list } => {
                let l = usize::from(list);
                let got = self.lists[l].pop_front();
                expect_handle(got, self.models[l].pop_front(), pool);
            }
            HookOp::PopBack { list } => {
                let l = usize::from(list);
                let got = self.lists[l].pop_back();
                expect_handle(got, self.models[l].pop_back(), pool);
            }
            HookOp::Erase { list, node: n } => {
                let (l, n) = (usize::from(list), node(n));
                let owner = self.owner(n);
                if owner.is_some_and(|o| o != l) {
                    // Erasing from the wrong list breaks `erase`'s contract.
                    return;
                }
                // A pointer made from a reference, as a caller that found the node elsewhere
                // would have.
                let ptr = NonNull::from(&*pool[n]);
                // SAFETY: node `n` is linked into list `l` through this hook, or not linked
                // through it at all (checked against the model just above).
                let got = unsafe { self.lists[l].erase(ptr) };
                expect_handle(got, owner.map(|_| self.remove_from_model(l, n)), pool);
            }
            HookOp::EraseChecked { list, node: n } => {
                let (l, n) = (usize::from(list), node(n));
                assert_eq!(self.lists[l].contains(&pool[n]), self.owner(n) == Some(l));
                let got = self.lists[l].erase_checked(&pool[n]);
                let want = (self.owner(n) == Some(l)).then(|| self.remove_from_model(l, n));
                expect_handle(got, want, pool);
            }
            HookOp::Splice { into } => {
                let (to, from) = (usize::from(into), usize::from(!into));
                let [a, b] = &mut self.lists;
                if to == 0 {
                    a.splice_back(b)
                } else {
                    b.splice_back(a)
                }
                let moved = std::mem::take(&mut self.models[from]);
                self.models[to].extend(moved);
            }
            HookOp::Cursor { list, ref steps } => {
                let l = usize::from(list);
                let model = &mut self.models[l];
                let mut cursor = self.lists[l].cursor_mut();
                let mut at = (!model.is_empty()).then_some(0_usize);
                for &step in steps.iter().take(MAX_CURSOR_STEPS) {
                    match step {
                        Step::Next => {
                            cursor.move_next();
                            at = match at {
                                Some(i) if i + 1 < model.len() => Some(i + 1),
                                Some(_) => None,
                                None => (!model.is_empty()).then_some(0),
                            };
                        }
                        Step::Prev => {
                            cursor.move_prev();
                            at = match at {
                                Some(i) => i.checked_sub(1),
                                None => model.len().checked_sub(1),
                            };
                        }
                        Step::Remove => {
                            let got = cursor.remove_current();
                            let want = at.map(|i| model.remove(i).expect("cursor in range"));
                            expect_handle(got, want, pool);
                            at = at.filter(|&i| i < model.len());
                        }
                    }
                    assert_eq!(cursor.current().map(|n| n.index), at.map(|i| model[i]));
                    cursor.list().assert_valid();
                }
            }
            HookOp::Reset { list } => {
                let l = usize::from(list);
                self.lists[l] = List::new();
                self.models[l].clear();
            }
        }
    }

    fn remove_from_model(&mut self, l: usize, n: usize) -> usize {
        let at = self.models[l]
            .iter()
            .position(|&m| m == n)
            .expect("node in model");
        self.models[l].remove(at).expect("index in range")
    }

    /// Checks both lists against their models; returns how many lists hold each node.
    fn check(&self, pool: &[Arc<Node>], counts: &mut [usize; NODES]) {
        for (list, model) in self.lists.iter().zip(&self.models) {
            list.assert_valid();
            assert!(list.iter().map(|n| n.index).eq(model.iter().copied()));
            assert!(
                list.iter()
                    .rev()
                    .map(|n| n.index)
                    .eq(model.iter().rev().copied())
            );
            assert_eq!(list.len(), model.len());
            assert_eq!(list.iter().len(), model.len());
            assert_eq!(list.is_empty(), model.is_empty());
            assert_eq!(list.front().map(|n| n.index), model.front().copied());
            assert_eq!(list.back().map(|n| n.index), model.back().copied());
            for &n in model {
                counts[n] += 1;
            }
        }
        for (n, node) in pool.iter().enumerate() {
            let linked = self.owner(n).is_some();
            assert_eq!(List::<Node, Tag>::is_linked(node), linked);
            assert_eq!(node.hooks[self.hook].is_linked(), linked);
        }
    }
}

/// Checks that a handle a list gave back is the one the model expects.
#[track_caller]
fn expect_handle(got: Option<Arc<Node>>, want: Option<usize>, pool: &[Arc<Node>]) {
    match (got, want) {
        (None, None) => {}
        (Some(got), Some(want)) => assert!(Arc::ptr_eq(&got, &pool[want]), "wrong node"),
        (got, want) => panic!(
            "list gave {:?}, model expects {want:?}",
            got.map(|n| n.index)
        ),
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let pool: Vec<Arc<Node>> = (0..NODES)
        .map(|index| {
            Arc::new(Node {
                index,
                hooks: [Links::new(), Links::new(), Links::new()],
            })
        })
        .collect();
    let mut h0 = Hook::<H0>::new(0);
    let mut h1 = Hook::<H1>::new(1);
    let mut h2 = Hook::<H2>::new(2);
    for op in &ops {
        match op.hook % 3 {
            0 => h0.apply(&op.op, &pool),
            1 => h1.apply(&op.op, &pool),
            _ => h2.apply(&op.op, &pool),
        }
        let mut counts = [0; NODES];
        h0.check(&pool, &mut counts);
        h1.check(&pool, &mut counts);
        h2.check(&pool, &mut counts);
        for (node, lists) in pool.iter().zip(counts) {
            assert_eq!(Arc::strong_count(node), 1 + lists, "one handle per list");
        }
    }
    drop((h0, h1, h2));
    assert!(
        pool.iter().all(|n| Arc::strong_count(n) == 1),
        "dropped lists release handles"
    );
});
