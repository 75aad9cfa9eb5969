use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::thread;
use std::vec::Vec;

struct Node {
    links: Links<Node>,
    producer: usize,
    seq: usize,
}

struct Q;

// SAFETY: `Arc::into_raw`/`from_raw` keep the node in place; `links` projects.
unsafe impl Linked<Q> for Node {
    type Handle = Arc<Node>;
    fn into_ptr(handle: Arc<Node>) -> NonNull<Node> {
        NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> Arc<Node> {
        // SAFETY: `ptr` came from `into_ptr` (caller's contract).
        unsafe { Arc::from_raw(ptr.as_ptr()) }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<Links<Node>> {
        // SAFETY: `ptr` is live (caller's contract); a field projection is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).links) }
    }
}

fn node(producer: usize, seq: usize) -> Arc<Node> {
    Arc::new(Node {
        links: Links::new(),
        producer,
        seq,
    })
}

#[test]
fn sequential_fifo_and_was_empty() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    assert!(q.is_empty());
    let mut c = q.consume();
    assert!(matches!(c.try_pop(), Pop::Empty));
    assert!(q.push(node(0, 0)), "first push finds the queue empty");
    assert!(!q.is_empty());
    assert!(!q.push(node(0, 1)));
    assert!(!q.push(node(0, 2)));
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(0));
    assert!(!q.push(node(0, 3)), "nodes 1..2 still queued");
    for seq in 1..4 {
        assert_eq!(c.try_pop().item().map(|n| n.seq), Some(seq));
    }
    assert!(q.is_empty());
    assert!(matches!(c.try_pop(), Pop::Empty));
    assert!(q.push(node(0, 4)), "the consumer emptied the queue");
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(4));
    assert!(
        q.push(node(0, 5)),
        "popping the single node empties the queue"
    );
    let mut seen = Vec::new();
    assert_eq!(c.drain(|n| seen.push(n.seq)), DrainEnd::Empty);
    assert_eq!(seen, [5]);
}

#[test]
fn peek_shows_the_oldest_node_without_popping_it() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    let mut c = q.consume();
    assert!(c.peek().is_none());
    q.push(node(0, 0));
    q.push(node(0, 1));
    assert_eq!(c.peek().map(|n| n.seq), Some(0));
    assert_eq!(c.peek().map(|n| n.seq), Some(0), "peeking pops nothing");
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(0));
    assert_eq!(c.peek().map(|n| n.seq), Some(1));
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(1));
    assert!(c.peek().is_none());
    drop(c);
    q.push(node(0, 2));
    let c = q.try_consume().expect("the role was let go");
    assert_eq!(c.peek().map(|n| n.seq), Some(2), "a new holder sees it too");
}

#[test]
fn chains_are_pushed_whole_and_in_order() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    assert!(!q.push_chain(Vec::new()), "an empty chain pushes nothing");
    assert!(q.is_empty());
    assert!(
        q.push_chain((0..3).map(|s| node(0, s))),
        "found the queue empty"
    );
    assert!(!q.push(node(1, 0)));
    assert!(!q.push_chain((0..2).map(|s| node(2, s))));
    let mut c = q.consume();
    let mut got = Vec::new();
    c.drain_until_empty(|n| got.push((n.producer, n.seq)));
    assert_eq!(got, [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]);
    drop(c);
    assert!(
        q.push_chain([node(3, 0)]),
        "empty again: a one-node chain is a push"
    );
}

#[test]
fn concurrent_chains_never_interleave() {
    let q: Arc<MpscQueue<Node, Q>> = Arc::new(MpscQueue::new());
    let (producers, chains, len) = (3, if cfg!(miri) { 5 } else { 200 }, 4);
    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let q = q.clone();
            thread::spawn(move || {
                for c in 0..chains {
                    q.push_chain((0..len).map(|i| node(p, c * len + i)));
                }
            })
        })
        .collect();
    let mut got = Vec::new();
    let mut c = q.consume();
    while got.len() < producers * chains * len {
        let _ = c.drain(|n| got.push((n.producer, n.seq)));
        thread::yield_now();
    }
    drop(c);
    for h in handles {
        h.join().unwrap();
    }
    for run in got.chunks(len) {
        let (p, first) = run[0];
        assert_eq!(first % len, 0, "a chain starts at its first node: {run:?}");
        for (i, &(pp, seq)) in run.iter().enumerate() {
            assert_eq!((pp, seq), (p, first + i), "a chain was split: {run:?}");
        }
    }
}

#[test]
fn static_handles_and_static_queue() {
    struct S;
    struct SNode {
        links: Links<SNode>,
        value: u32,
    }
    // SAFETY: `&'static` handles never move or free; `links` projects.
    unsafe impl Linked<S> for SNode {
        type Handle = &'static SNode;
        fn into_ptr(handle: &'static SNode) -> NonNull<SNode> {
            NonNull::from(handle)
        }
        unsafe fn from_ptr(ptr: NonNull<SNode>) -> &'static SNode {
            // SAFETY: `ptr` came from a `&'static SNode`.
            unsafe { ptr.as_ref() }
        }
        unsafe fn links(ptr: NonNull<SNode>) -> NonNull<Links<SNode>> {
            // SAFETY: `ptr` is live; a field projection is non-null.
            unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).links) }
        }
    }
    static A: SNode = SNode {
        links: Links::new(),
        value: 1,
    };
    static B: SNode = SNode {
        links: Links::new(),
        value: 2,
    };
    static QUEUE: MpscQueue<SNode, S> = MpscQueue::new();
    for _round in 0..2 {
        assert!(QUEUE.push(&A));
        assert!(!QUEUE.push(&B));
        let mut c = QUEUE.consume();
        assert_eq!(c.try_pop().item().map(|n| n.value), Some(1));
        assert_eq!(c.try_pop().item().map(|n| n.value), Some(2));
        assert!(matches!(c.try_pop(), Pop::Empty));
    }
}

#[test]
fn queue_may_move_while_holding_nodes() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    assert!(q.push(node(0, 0)));
    assert!(!q.push(node(0, 1)));
    let boxed = std::boxed::Box::new(q); // moves the queue
    let mut c = boxed.consume();
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(0));
    assert!(!boxed.push(node(0, 2)));
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(1));
    assert_eq!(c.try_pop().item().map(|n| n.seq), Some(2));
    assert!(matches!(c.try_pop(), Pop::Empty));
}

#[test]
fn drop_releases_queued_handles() {
    let nodes: Vec<_> = (0..4).map(|i| node(0, i)).collect();
    {
        let q: MpscQueue<Node, Q> = MpscQueue::new();
        for n in &nodes {
            q.push(n.clone());
        }
        let mut c = q.consume();
        assert_eq!(c.try_pop().item().map(|n| n.seq), Some(0));
        assert!(nodes.iter().skip(1).all(|n| Arc::strong_count(n) == 2));
    }
    assert!(nodes.iter().all(|n| Arc::strong_count(n) == 1));
    // A popped node can be queued again, in another queue too.
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    assert!(q.push(nodes[0].clone()));
    assert_eq!(q.consume().try_pop().item().map(|n| n.seq), Some(0));
}

#[test]
fn drain_into_list_moves_handles() {
    use crate::list::{self, List};

    struct Both {
        pending: Links<Both>,
        local: list::Links<Both>,
        id: usize,
    }
    struct Local;
    // SAFETY: `Arc::into_raw`/`from_raw` keep the node in place; `links` projects.
    unsafe impl Linked<Q> for Both {
        type Handle = Arc<Both>;
        fn into_ptr(handle: Arc<Both>) -> NonNull<Both> {
            NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
        }
        unsafe fn from_ptr(ptr: NonNull<Both>) -> Arc<Both> {
            // SAFETY: `ptr` came from `into_ptr` (caller's contract).
            unsafe { Arc::from_raw(ptr.as_ptr()) }
        }
        unsafe fn links(ptr: NonNull<Both>) -> NonNull<Links<Both>> {
            // SAFETY: `ptr` is live; a field projection is non-null.
            unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).pending) }
        }
    }
    // SAFETY: as above, for the list hook.
    unsafe impl list::Linked<Local> for Both {
        type Handle = Arc<Both>;
        fn into_ptr(handle: Arc<Both>) -> NonNull<Both> {
            NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
        }
        unsafe fn from_ptr(ptr: NonNull<Both>) -> Arc<Both> {
            // SAFETY: `ptr` came from `into_ptr` (caller's contract).
            unsafe { Arc::from_raw(ptr.as_ptr()) }
        }
        unsafe fn links(ptr: NonNull<Both>) -> NonNull<list::Links<Both>> {
            // SAFETY: `ptr` is live; a field projection is non-null.
            unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).local) }
        }
    }
    let both = |id| {
        Arc::new(Both {
            pending: Links::new(),
            local: list::Links::new(),
            id,
        })
    };
    let q: MpscQueue<Both, Q> = MpscQueue::new();
    let mut local: List<Both, Local> = List::new();
    local.push_back(both(0));
    let kept = both(3);
    for n in [both(1), both(2), kept.clone()] {
        q.push(n);
    }
    let mut c = q.consume();
    assert_eq!(c.drain_into(&mut local), DrainEnd::Empty);
    local.assert_valid();
    assert_eq!(local.iter().map(|n| n.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(Arc::strong_count(&kept), 2, "the handle moved, not cloned");
    // The node can go straight back into the queue from the list.
    assert!(q.push(local.pop_front().unwrap()));
    assert_eq!(c.drain_into(&mut local), DrainEnd::Empty);
    assert_eq!(local.back().map(|n| n.id), Some(0));
    drop(local);
    assert_eq!(Arc::strong_count(&kept), 1);
}

#[test]
fn single_consumer_is_enforced() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    let c = q.consume();
    assert!(q.try_consume().is_none());
    let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drop(q.consume());
    }));
    assert!(second.is_err());
    drop(c);
    assert!(q.try_consume().is_some());
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "double push")]
fn double_push_panics_in_debug() {
    let q: MpscQueue<Node, Q> = MpscQueue::new();
    let n = node(0, 0);
    q.push(n.clone());
    q.push(n);
}

/// Producers push from real threads and wake the consumer only when `push` returned
/// `true`; the consumer sleeps (`thread::park`) only on `Empty`. Nothing is lost or
/// duplicated, each producer's nodes come out in order, and the run ends (no lost
/// wake-up).
#[test]
fn threads_nothing_lost_fifo_per_producer() {
    const PRODUCERS: usize = 3;
    let per_producer: usize = if cfg!(miri) { 30 } else { 20_000 };
    let q: Arc<MpscQueue<Node, Q>> = Arc::new(MpscQueue::new());
    let wakes = Arc::new(AtomicUsize::new(0));
    let consumer = {
        let q = q.clone();
        thread::spawn(move || {
            let mut next = [0usize; PRODUCERS];
            let mut received = 0;
            let mut inconsistent = 0usize;
            let mut emptied = 0usize;
            let mut c = q.consume();
            while received < PRODUCERS * per_producer {
                let (pop, took_last) = c.try_pop_observed();
                emptied += usize::from(took_last);
                match pop {
                    Pop::Item(n) => {
                        assert_eq!(n.seq, next[n.producer], "FIFO per producer");
                        next[n.producer] += 1;
                        received += 1;
                    }
                    // Std's park keeps an unpark token, which stands in for the
                    // parking protocol's re-check.
                    Pop::Empty => thread::park(),
                    Pop::Inconsistent => {
                        inconsistent += 1;
                        crate::sync::spin_loop();
                    }
                }
            }
            assert!(matches!(c.try_pop(), Pop::Empty));
            (emptied, inconsistent)
        })
    };
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let q = q.clone();
            let wakes = wakes.clone();
            let consumer = consumer.thread().clone();
            thread::spawn(move || {
                for seq in 0..per_producer {
                    if q.push(node(p, seq)) {
                        wakes.fetch_add(1, Relaxed);
                        consumer.unpark();
                    }
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let (emptied, _inconsistent) = consumer.join().unwrap();
    // Each `true` push follows the pop that emptied the queue before it (or the start),
    // and the last pop emptied it: exactly as many of one as of the other.
    assert_eq!(
        wakes.load(Relaxed),
        emptied,
        "was-empty answers vs emptying pops"
    );
    assert!(q.is_empty());
}
