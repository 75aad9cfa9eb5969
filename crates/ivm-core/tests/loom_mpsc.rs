//! Loom models of the intrusive MPSC queue (`ivm_core::mpsc`) together with the
//! was-empty wake protocol the scheduler uses.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release
//! --test loom_mpsc`. A bounded run is evidence, not proof: it covers every interleaving
//! with at most that many preemptions.
//!
//! The consumer sleeps through a tiny local park/unpark (an `AtomicU32` slept on with
//! [`LoomWait`]), standing in for `ivm_core::parking`: producers publish with `push`, then
//! wake the consumer only if `push` returned `true`; the consumer announces its park with a
//! swap, re-checks `is_empty()`, and only then sleeps. A lost wake-up is therefore reported
//! by loom as a deadlock, never hidden in a yield loop.
#![cfg(loom)]

use std::ptr::NonNull;
use std::vec::Vec;

use ivm_core::mpsc::{self, MpscQueue, Pop};
use ivm_core::wait::{LoomWait, Wait};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU32, Ordering};
use loom::thread;

/// A queued node: a payload in a loom `UnsafeCell` (so a missing Release/Acquire between
/// producer and consumer is a reported causality violation) and two hooks, one for the
/// `Arc`-handled queue and one for the `&'static`-handled queue of the planted models.
struct Node {
    links: mpsc::Links<Node>,
    links_static: mpsc::Links<Node>,
    producer: usize,
    seq: usize,
    data: UnsafeCell<usize>,
}

impl Node {
    fn new(producer: usize, seq: usize) -> Self {
        Node {
            links: mpsc::Links::new(),
            links_static: mpsc::Links::new(),
            producer,
            seq,
            data: UnsafeCell::new(0),
        }
    }

    fn expected(&self) -> usize {
        100 + 10 * self.producer + self.seq
    }

    /// The producer's write, made after the node exists and before it is pushed.
    fn publish(&self) {
        // SAFETY: only the producer holds the node before pushing it.
        self.data.with_mut(|p| unsafe { *p = self.expected() });
    }

    /// The consumer's read, after popping the node.
    fn check(&self) {
        // SAFETY: the consumer holds the node after popping it; loom checks the ordering.
        let value = self.data.with(|p| unsafe { *p });
        assert_eq!(value, self.expected(), "payload not published");
    }
}

/// Tag of the `Arc`-handled hook.
struct ArcTag;
/// Tag of the `&'static`-handled hook (planted models leak their state per iteration).
struct StaticTag;

// SAFETY: `Arc::into_raw`/`from_raw` keep the node in place; `links` projects to `links`.
unsafe impl mpsc::Linked<ArcTag> for Node {
    type Handle = Arc<Node>;
    fn into_ptr(handle: Arc<Node>) -> NonNull<Node> {
        NonNull::new(Arc::into_raw(handle).cast_mut()).expect("Arc is non-null")
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> Arc<Node> {
        // SAFETY: `ptr` came from `into_ptr` (caller's contract).
        unsafe { Arc::from_raw(ptr.as_ptr()) }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<mpsc::Links<Node>> {
        // SAFETY: `ptr` is live (caller's contract); a field projection is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).links) }
    }
}

// SAFETY: leaked `&'static` nodes never move or free; `links` projects to `links_static`.
unsafe impl mpsc::Linked<StaticTag> for Node {
    type Handle = &'static Node;
    fn into_ptr(handle: &'static Node) -> NonNull<Node> {
        NonNull::from(handle)
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> &'static Node {
        // SAFETY: `ptr` came from a `&'static Node`.
        unsafe { ptr.as_ref() }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<mpsc::Links<Node>> {
        // SAFETY: `ptr` is live; a field projection is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).links_static) }
    }
}

const RUNNING: u32 = 0;
const PARKED: u32 = 1;
const NOTIFIED: u32 = 2;

/// A minimal park/unpark on one `AtomicU32`, slept on with [`LoomWait`].
struct Park {
    state: AtomicU32,
}

impl Park {
    fn new() -> Self {
        Park {
            state: AtomicU32::new(RUNNING),
        }
    }

    /// Producer side, after publishing: one RMW decides whether anyone must be woken.
    fn unpark(&self) {
        // Release: publishes the push to the consumer's Acquire swap in `park`.
        if self.state.swap(NOTIFIED, Ordering::AcqRel) == PARKED {
            LoomWait::wake_all(&self.state);
        }
    }

    /// Consumer side: announce (RMW), re-check the inputs, only then sleep. A pending
    /// `NOTIFIED` (an unpark while the consumer was running) ends the park at once.
    fn park(&self, has_input: impl FnOnce() -> bool) {
        // Acquire: pairs with `unpark`'s Release swap, so a push whose unpark came before
        // this swap is seen by `has_input`.
        if self.state.swap(PARKED, Ordering::AcqRel) == NOTIFIED || has_input() {
            self.state.swap(RUNNING, Ordering::AcqRel);
            return;
        }
        while self.state.load(Ordering::Acquire) == PARKED {
            LoomWait::wait(&self.state, PARKED, None);
        }
        self.state.swap(RUNNING, Ordering::AcqRel);
    }
}

/// What the consumer saw of one popped node.
#[derive(Debug, Clone, Copy)]
struct Popped {
    producer: usize,
    seq: usize,
    /// The pop took the last node (the queue became empty).
    emptied: bool,
}

/// Checks what the consumer got against what the producers pushed: nothing lost or
/// duplicated, FIFO per producer, and every was-empty answer exact — a push returned
/// `true` iff it is the first node or the pop of the node before it emptied the queue.
fn check_run(order: &[Popped], was_empty: &[Vec<bool>]) {
    let total: usize = was_empty.iter().map(Vec::len).sum();
    assert_eq!(order.len(), total, "lost or duplicated node");
    let mut next = std::vec![0; was_empty.len()];
    for (i, popped) in order.iter().enumerate() {
        assert_eq!(
            popped.seq, next[popped.producer],
            "FIFO per producer broken"
        );
        next[popped.producer] += 1;
        let expected = i == 0 || order[i - 1].emptied;
        assert_eq!(
            was_empty[popped.producer][popped.seq], expected,
            "push returned the wrong was-empty answer"
        );
    }
    assert!(
        order.last().is_none_or(|p| p.emptied),
        "the last pop must empty the queue"
    );
}

/// The correct protocol: two producers (pushing `counts[p]` nodes each) and the consumer
/// (the model's main thread). Terminates for every interleaving only if no wake is lost.
fn run_protocol(counts: &'static [usize]) {
    let queue: Arc<MpscQueue<Node, ArcTag>> = Arc::new(MpscQueue::new());
    let park = Arc::new(Park::new());
    let producers: Vec<_> = counts
        .iter()
        .enumerate()
        .map(|(producer, &count)| {
            let queue = queue.clone();
            let park = park.clone();
            thread::spawn(move || {
                let mut was_empty = Vec::new();
                for seq in 0..count {
                    let node = Arc::new(Node::new(producer, seq));
                    node.publish();
                    let first = queue.push(node);
                    if first {
                        park.unpark();
                    }
                    was_empty.push(first);
                }
                was_empty
            })
        })
        .collect();

    let total: usize = counts.iter().sum();
    let mut order = Vec::new();
    let mut consumer = queue.consume();
    while order.len() < total {
        let (pop, emptied) = consumer.try_pop_observed();
        match pop {
            Pop::Item(node) => {
                node.check();
                order.push(Popped {
                    producer: node.producer,
                    seq: node.seq,
                    emptied,
                });
            }
            // A push is half done: retry without sleeping.
            Pop::Inconsistent => thread::yield_now(),
            Pop::Empty => park.park(|| !queue.is_empty()),
        }
    }
    assert!(matches!(consumer.try_pop(), Pop::Empty));
    drop(consumer);
    let was_empty: Vec<Vec<bool>> = producers.into_iter().map(|h| h.join().unwrap()).collect();
    check_run(&order, &was_empty);
    assert!(queue.is_empty());
}

#[test]
fn two_producers_one_consumer() {
    loom::model(|| run_protocol(&[2, 1]));
}

#[test]
fn two_producers_one_node_each() {
    loom::model(|| run_protocol(&[1, 1]));
}

/// Each producer pushes its `counts[p]` nodes as one chain (`push_chain`); the consumer
/// drains them with the same park protocol as [`run_protocol`]. Checks, beyond payloads
/// and FIFO: every chain arrives in one piece (its nodes popped one after another), and a
/// chain's was-empty answer is exact for its first node.
fn run_chains(counts: &'static [usize]) {
    let queue: Arc<MpscQueue<Node, ArcTag>> = Arc::new(MpscQueue::new());
    let park = Arc::new(Park::new());
    let producers: Vec<_> = counts
        .iter()
        .enumerate()
        .map(|(producer, &count)| {
            let queue = queue.clone();
            let park = park.clone();
            thread::spawn(move || {
                let nodes: Vec<_> = (0..count)
                    .map(|seq| {
                        let node = Arc::new(Node::new(producer, seq));
                        node.publish();
                        node
                    })
                    .collect();
                let first = queue.push_chain(nodes);
                if first {
                    park.unpark();
                }
                first
            })
        })
        .collect();

    let total: usize = counts.iter().sum();
    let mut order: Vec<Popped> = Vec::new();
    let mut consumer = queue.consume();
    while order.len() < total {
        let (pop, emptied) = consumer.try_pop_observed();
        match pop {
            Pop::Item(node) => {
                node.check();
                order.push(Popped {
                    producer: node.producer,
                    seq: node.seq,
                    emptied,
                });
            }
            Pop::Inconsistent => thread::yield_now(),
            Pop::Empty => park.park(|| !queue.is_empty()),
        }
    }
    drop(consumer);
    let was_empty: Vec<bool> = producers.into_iter().map(|h| h.join().unwrap()).collect();
    let mut i = 0;
    while i < order.len() {
        let p = order[i].producer;
        let expected_first = i == 0 || order[i - 1].emptied;
        assert_eq!(was_empty[p], expected_first, "wrong was-empty answer");
        for seq in 0..counts[p] {
            assert_eq!(
                (order[i].producer, order[i].seq),
                (p, seq),
                "a chain was split or reordered: {order:?}"
            );
            assert!(
                seq + 1 == counts[p] || !order[i].emptied,
                "the queue emptied inside a chain"
            );
            i += 1;
        }
    }
    assert!(order.last().is_none_or(|p| p.emptied));
    assert!(queue.is_empty());
}

#[test]
fn two_chains_arrive_whole() {
    loom::model(|| run_chains(&[2, 2]));
}

#[test]
fn a_chain_and_a_single_push() {
    loom::model(|| run_chains(&[3, 1]));
}

/// Dropping the queue drops the handles still queued (loom reports a leaked `Arc`).
#[test]
fn drop_releases_queued_handles() {
    loom::model(|| {
        let queue: Arc<MpscQueue<Node, ArcTag>> = Arc::new(MpscQueue::new());
        let nodes: Vec<_> = (0..2).map(|p| Arc::new(Node::new(p, 0))).collect();
        let producers: Vec<_> = nodes
            .iter()
            .map(|node| {
                let queue = queue.clone();
                let node = node.clone();
                thread::spawn(move || {
                    queue.push(node);
                })
            })
            .collect();
        // Pop at most one while the pushes race.
        let popped = queue.consume().try_pop().item();
        for h in producers {
            h.join().unwrap();
        }
        let queue = Arc::try_unwrap(queue).expect("producers are done");
        drop(queue);
        drop(popped);
        assert!(
            nodes.iter().all(|n| Arc::strong_count(n) == 1),
            "handle leaked"
        );
    });
}

// ---- publication outside the pops ------------------------------------------------------
//
// The models above read a node's payload only after popping it, so every ordering they
// check lies on the push → pop path. These models read data right after `is_empty` or
// right after taking the consumer role, with nothing but that look in between: a weakened
// ordering there is a data race or a stale `tail`, which loom reports. (Found by
// `.ci/ordering_mutants.sh`: each ordering these models check survived every other model.)

/// A queue leaked per iteration, on the `&'static`-handled hook.
fn leaked_queue() -> &'static MpscQueue<Node, StaticTag> {
    Box::leak(Box::new(MpscQueue::new()))
}

/// `is_empty` promises that a caller who sees a non-empty queue also sees what the pusher
/// wrote before pushing (here: the node's payload, read without popping the node).
/// Polled until non-empty: with a single look loom explored only the schedule in which the
/// look comes first.
#[test]
fn non_empty_look_publishes_the_push() {
    loom::model(|| {
        let queue = leaked_queue();
        let node = leaked_node(0, 0);
        let producer = thread::spawn(move || {
            node.publish();
            queue.push(node);
        });
        while queue.is_empty() {
            thread::yield_now();
        }
        node.check();
        producer.join().unwrap();
    });
}

/// `Consumer::peek` promises that the node it returns is readable: a consumer that peeks
/// a node a push handed off into the empty queue sees what the producer wrote before
/// pushing, without popping it (ivm-std's worker reads the peeked instruction's body to
/// decide whether a waiting caller may run it). Polled until the peek finds the node, as
/// above.
#[test]
fn peek_publishes_the_push() {
    loom::model(|| {
        let queue = leaked_queue();
        let node = leaked_node(0, 0);
        let producer = thread::spawn(move || {
            node.publish();
            queue.push(node);
        });
        let mut consumer = queue.consume();
        loop {
            if let Some(peeked) = consumer.peek() {
                assert!(std::ptr::eq(peeked, node), "peek returned another node");
                peeked.check();
                break;
            }
            thread::yield_now();
        }
        // Peeking left the node queued.
        match consumer.try_pop() {
            Pop::Item(popped) => assert!(std::ptr::eq(popped, node)),
            other => panic!("the peeked node was not queued: {other:?}"),
        }
        drop(consumer);
        producer.join().unwrap();
    });
}

/// What one thread saw when it tried to take the consumer role and pop once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// The other thread held the role.
    NoRole,
    Item,
    Empty,
    Inconsistent,
}

fn take_turn(queue: &'static MpscQueue<Node, StaticTag>) -> Turn {
    let Some(mut consumer) = queue.try_consume() else {
        return Turn::NoRole;
    };
    match consumer.try_pop() {
        Pop::Item(node) => {
            node.check();
            Turn::Item
        }
        Pop::Empty => Turn::Empty,
        Pop::Inconsistent => Turn::Inconsistent,
    }
}

/// The consumer role passes between threads (`try_consume`, the guard's drop) like a lock:
/// the next consumer must see the previous one's writes to `tail`. One node was pushed
/// before both threads started and no push is under way, so a pop never finds the queue
/// inconsistent — unless it read a stale `tail` (the node the previous consumer already
/// took).
#[test]
fn consumer_role_hands_over_the_tail() {
    loom::model(|| {
        let queue = leaked_queue();
        let node = leaked_node(0, 0);
        node.publish();
        queue.push(node);
        let other = thread::spawn(move || take_turn(queue));
        let mine = take_turn(queue);
        let theirs = other.join().unwrap();
        for turn in [mine, theirs] {
            assert_ne!(turn, Turn::Inconsistent, "the consumer read a stale tail");
        }
        assert_eq!(
            [mine, theirs].iter().filter(|&&t| t == Turn::Item).count(),
            1,
            "the node was lost or popped twice: {mine:?}, {theirs:?}"
        );
    });
}

/// State shared by a planted model, leaked per iteration: a second panic while unwinding a
/// loom `Arc` would abort the test binary.
struct Leaked {
    queue: &'static MpscQueue<Node, StaticTag>,
    park: &'static Park,
}

fn leaked() -> Leaked {
    Leaked {
        queue: Box::leak(Box::new(MpscQueue::new())),
        park: Box::leak(Box::new(Park::new())),
    }
}

fn leaked_node(producer: usize, seq: usize) -> &'static Node {
    Box::leak(Box::new(Node::new(producer, seq)))
}

/// How a planted producer pushes and decides whether to wake the consumer.
#[derive(Clone, Copy)]
enum Producer {
    Correct,
    /// BUG: computes was-empty from `is_empty()` read before the push.
    RacyWasEmpty,
    /// BUG: pushes with the link/hand-off stores Relaxed instead of Release.
    RelaxedLink,
}

/// How a planted consumer reacts to `Pop::Inconsistent`.
#[derive(Clone, Copy)]
enum Consumer {
    Correct,
    /// BUG: treats a half-done push as "nothing there" and sleeps.
    SleepsOnInconsistent,
}

fn run_planted(counts: &'static [usize], producer_kind: Producer, consumer_kind: Consumer) {
    let Leaked { queue, park } = leaked();
    let mut producers = Vec::new();
    for (producer, &count) in counts.iter().enumerate() {
        // Created before the spawn: what the model checks is the payload written below.
        let nodes: Vec<_> = (0..count).map(|seq| leaked_node(producer, seq)).collect();
        producers.push(thread::spawn(move || {
            for node in nodes {
                node.publish();
                let wake = match producer_kind {
                    Producer::Correct => queue.push(node),
                    Producer::RacyWasEmpty => {
                        let was_empty = queue.is_empty();
                        queue.push(node);
                        was_empty
                    }
                    Producer::RelaxedLink => queue.planted_push_relaxed_link(node),
                };
                if wake {
                    park.unpark();
                }
            }
        }));
    }
    let total: usize = counts.iter().sum();
    let mut received = 0;
    // Not dropped on unwind: its `Drop` touches a loom atomic, which would panic again.
    let mut consumer = std::mem::ManuallyDrop::new(queue.consume());
    while received < total {
        match consumer.try_pop() {
            Pop::Item(node) => {
                node.check();
                received += 1;
            }
            Pop::Inconsistent => match consumer_kind {
                Consumer::Correct => thread::yield_now(),
                // Sleeps as if it had just found nothing (the `is_empty()` re-check would
                // have saved it: a half-done push already shows in `head`).
                Consumer::SleepsOnInconsistent => park.park(|| false),
            },
            Pop::Empty => park.park(|| !queue.is_empty()),
        }
    }
    for h in producers {
        h.join().unwrap();
    }
}

/// The planted models' harness itself is sound.
#[test]
fn planted_harness_passes_when_correct() {
    loom::model(|| run_planted(&[2, 1], Producer::Correct, Consumer::Correct));
}

/// PLANTED: the consumer sleeps on `Inconsistent`. The half-done push returned `false`,
/// so nobody wakes the consumer: loom reports a deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_consumer_sleeps_on_inconsistent() {
    loom::model(|| run_planted(&[2], Producer::Correct, Consumer::SleepsOnInconsistent));
}

/// PLANTED: the producer decides to wake from an `is_empty()` read before its push. The
/// consumer can empty the queue and park between that read and the push: deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_racy_was_empty() {
    loom::model(|| run_planted(&[2], Producer::RacyWasEmpty, Consumer::Correct));
}

/// PLANTED: the node is linked with a Relaxed store, so the consumer reads its payload
/// without synchronizing with the producer's write: a causality violation.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_relaxed_link() {
    loom::model(|| run_planted(&[1], Producer::RelaxedLink, Consumer::Correct));
}
