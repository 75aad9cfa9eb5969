//! Fuzz `ivm_core::mpsc::MpscQueue` against a `VecDeque` model.
//!
//! Single-threaded ops (push from producer k, pop, drain, drain into a `list::List`,
//! re-push a popped node) check every answer exactly, including `push`'s was-empty and
//! whether a pop emptied the queue. A `Threaded` op runs a small real-thread phase:
//! producer threads push while this thread consumes; the checks there are the ones that
//! hold for every interleaving (nothing lost or duplicated, nodes already queued come
//! first, FIFO per producer, was-empty answers match the emptying pops one for one).
#![no_main]

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;
use std::thread;

use arbitrary::Arbitrary;
use ivm_core::list::{self, List};
use ivm_core::mpsc::{self, DrainEnd, MpscQueue, Pop};
use libfuzzer_sys::fuzz_target;

const PRODUCERS: usize = 4;

struct Node {
    pending: mpsc::Links<Node>,
    local: list::Links<Node>,
    id: usize,
    producer: usize,
}

struct Pending;
struct Local;

// SAFETY: `Arc::into_raw`/`from_raw` keep the node in place; `links` projects.
unsafe impl mpsc::Linked<Pending> for Node {
    type Handle = Arc<Node>;
    fn into_ptr(handle: Arc<Node>) -> NonNull<Node> {
        NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> Arc<Node> {
        // SAFETY: `ptr` came from `into_ptr` (caller's contract).
        unsafe { Arc::from_raw(ptr.as_ptr()) }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<mpsc::Links<Node>> {
        // SAFETY: `ptr` is live; a field projection is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).pending) }
    }
}

// SAFETY: as above, for the list hook.
unsafe impl list::Linked<Local> for Node {
    type Handle = Arc<Node>;
    fn into_ptr(handle: Arc<Node>) -> NonNull<Node> {
        NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> Arc<Node> {
        // SAFETY: `ptr` came from `into_ptr` (caller's contract).
        unsafe { Arc::from_raw(ptr.as_ptr()) }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<list::Links<Node>> {
        // SAFETY: `ptr` is live; a field projection is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).local) }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Push a fresh node from producer `k % PRODUCERS`.
    Push(u8),
    /// Pop one node.
    Pop,
    /// Drain through a callback.
    Drain,
    /// Drain into the local list.
    DrainInto,
    /// Push a node that was popped earlier (`i` picks it) back into the queue.
    Repush(u8),
    /// Producer threads push `per_producer % 32` nodes each while this thread consumes.
    Threaded { producers: u8, per_producer: u8 },
}

struct Harness {
    queue: MpscQueue<Node, Pending>,
    /// The model: ids in queue order.
    model: VecDeque<usize>,
    /// The local list `DrainInto` appends to, and its model.
    local: List<Node, Local>,
    local_model: Vec<usize>,
    /// Popped nodes kept for `Repush`.
    spare: Vec<Arc<Node>>,
    /// One clone of every node ever made, to check that no handle leaks.
    all: Vec<Arc<Node>>,
    threaded_phases: usize,
}

impl Harness {
    fn fresh(&mut self, producer: usize) -> Arc<Node> {
        let node = Arc::new(Node {
            pending: mpsc::Links::new(),
            local: list::Links::new(),
            id: self.all.len(),
            producer,
        });
        self.all.push(node.clone());
        node
    }

    fn push(&mut self, node: Arc<Node>) {
        let id = node.id;
        let was_empty = self.queue.push(node);
        assert_eq!(
            was_empty,
            self.model.is_empty(),
            "push: wrong was-empty answer"
        );
        self.model.push_back(id);
    }

    /// The popped node, checked against the model (no producer is running here, so the
    /// queue is never inconsistent).
    fn received(&mut self, pop: Pop<Arc<Node>>, emptied: bool) -> Option<Arc<Node>> {
        match pop {
            Pop::Item(node) => {
                assert_eq!(Some(node.id), self.model.pop_front(), "pop: wrong node");
                assert_eq!(emptied, self.model.is_empty(), "pop: wrong emptied flag");
                Some(node)
            }
            Pop::Empty => {
                assert!(self.model.is_empty(), "pop: Empty while nodes are queued");
                None
            }
            Pop::Inconsistent => panic!("pop: Inconsistent with no push in flight"),
        }
    }

    fn keep_spare(&mut self, node: Arc<Node>) {
        if self.spare.len() < 16 {
            self.spare.push(node);
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Push(k) => {
                let node = self.fresh(usize::from(k) % PRODUCERS);
                self.push(node);
            }
            Op::Pop => {
                let (pop, emptied) = self.queue.consume().try_pop_observed();
                if let Some(node) = self.received(pop, emptied) {
                    self.keep_spare(node);
                }
            }
            Op::Drain => {
                let mut got = Vec::new();
                let end = self.queue.consume().drain(|node| got.push(node));
                assert_eq!(end, DrainEnd::Empty, "drain: stopped without producers");
                let expected: Vec<usize> = self.model.drain(..).collect();
                assert_eq!(got.iter().map(|n| n.id).collect::<Vec<_>>(), expected);
                for node in got {
                    self.keep_spare(node);
                }
            }
            Op::DrainInto => {
                let end = self.queue.consume().drain_into(&mut self.local);
                assert_eq!(
                    end,
                    DrainEnd::Empty,
                    "drain_into: stopped without producers"
                );
                self.local_model.extend(self.model.drain(..));
                self.local.assert_valid();
                assert_eq!(
                    self.local.iter().map(|n| n.id).collect::<Vec<_>>(),
                    self.local_model
                );
                if self.local.len() > 64 {
                    self.local = List::new();
                    self.local_model.clear();
                }
            }
            Op::Repush(i) => {
                if !self.spare.is_empty() {
                    let node = self.spare.swap_remove(usize::from(i) % self.spare.len());
                    self.push(node);
                }
            }
            Op::Threaded {
                producers,
                per_producer,
            } => {
                // Threads are slow to start (more so under ASan): one phase per input.
                if self.threaded_phases < 1 {
                    self.threaded_phases += 1;
                    self.threaded(
                        1 + usize::from(producers) % 3,
                        usize::from(per_producer) % 32,
                    );
                }
            }
        }
        assert_eq!(
            self.queue.is_empty(),
            self.model.is_empty(),
            "is_empty disagrees"
        );
    }

    fn threaded(&mut self, producers: usize, per_producer: usize) {
        let batches: Vec<Vec<Arc<Node>>> = (0..producers)
            .map(|p| (0..per_producer).map(|_| self.fresh(p)).collect())
            .collect();
        let initially_empty = self.model.is_empty();
        let queued_before: Vec<usize> = self.model.drain(..).collect();
        let total = queued_before.len() + producers * per_producer;
        let queue = &self.queue;
        let (order, emptied, trues) = thread::scope(|s| {
            let handles: Vec<_> = batches
                .into_iter()
                .map(|batch| {
                    s.spawn(move || {
                        batch
                            .into_iter()
                            .map(|node| usize::from(queue.push(node)))
                            .sum::<usize>()
                    })
                })
                .collect();
            let mut order = Vec::with_capacity(total);
            let mut emptied = 0;
            let mut consumer = queue.consume();
            while order.len() < total {
                match consumer.try_pop_observed() {
                    (Pop::Item(node), took_last) => {
                        emptied += usize::from(took_last);
                        order.push(node);
                    }
                    // No sleeping here: Empty only means the producers are not done yet.
                    (Pop::Empty | Pop::Inconsistent, _) => thread::yield_now(),
                }
            }
            assert!(matches!(consumer.try_pop(), Pop::Empty), "extra node");
            let trues: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
            (order, emptied, trues)
        });
        // Nodes queued before the phase come out first, in order.
        let ids: Vec<usize> = order.iter().map(|n| n.id).collect();
        assert_eq!(ids[..queued_before.len()], queued_before[..]);
        // Then every pushed node exactly once, FIFO per producer (ids grow per producer).
        let mut last = [None::<usize>; PRODUCERS];
        for node in &order[queued_before.len()..] {
            let prev = last[node.producer].replace(node.id);
            assert!(prev < Some(node.id), "FIFO per producer broken");
        }
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), total, "duplicated node");
        // Each `true` push follows an emptying pop (or the start, if the queue was empty),
        // and the last pop empties the queue.
        if total > 0 {
            assert_eq!(
                trues + usize::from(!initially_empty),
                emptied,
                "was-empty answers do not match the emptying pops"
            );
        }
        for node in order {
            self.keep_spare(node);
        }
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut h = Harness {
        queue: MpscQueue::new(),
        model: VecDeque::new(),
        local: List::new(),
        local_model: Vec::new(),
        spare: Vec::new(),
        all: Vec::new(),
        threaded_phases: 0,
    };
    for op in ops.iter().take(512) {
        h.apply(op);
    }
    let Harness {
        queue,
        local,
        spare,
        all,
        ..
    } = h;
    // Dropping the queue and the list drops every handle they hold.
    drop((queue, local, spare));
    assert!(
        all.iter().all(|n| Arc::strong_count(n) == 1),
        "handle leaked"
    );
});
