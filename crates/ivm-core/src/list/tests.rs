use super::*;

use std::boxed::Box;
use std::collections::VecDeque;
use std::sync::Arc;
use std::vec::Vec;

/// Tag of the first hook.
enum A {}
/// Tag of the second hook.
enum B {}

trait Value {
    fn value(&self) -> u32;
}

/// A reference-counted node that can be in an `A` list and a `B` list at once.
struct Node {
    value: u32,
    a: Links<Node>,
    b: Links<Node>,
}

impl Node {
    fn new(value: u32) -> Arc<Self> {
        Arc::new(Self {
            value,
            a: Links::new(),
            b: Links::new(),
        })
    }
}

/// A node held through `&'static` handles, with the same two hooks.
struct StaticNode {
    value: u32,
    a: Links<StaticNode>,
    b: Links<StaticNode>,
}

impl Value for Node {
    fn value(&self) -> u32 {
        self.value
    }
}

impl Value for StaticNode {
    fn value(&self) -> u32 {
        self.value
    }
}

macro_rules! arc_linked {
    ($tag:ty, $hook:ident) => {
        // SAFETY: `Arc::into_raw`/`from_raw` move one strong count out and back, and the
        // allocation never moves; `links` projects this tag's own hook.
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
                // SAFETY: `ptr` points to a live node, so the field's address is not null.
                unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).$hook) }
            }
        }
    };
}
arc_linked!(A, a);
arc_linked!(B, b);

macro_rules! static_linked {
    ($tag:ty, $hook:ident) => {
        // SAFETY: a `&'static` node never moves and is never freed while linked (the
        // pool frees nodes only after every list is gone); `links` projects this tag's
        // own hook.
        unsafe impl Linked<$tag> for StaticNode {
            type Handle = &'static StaticNode;

            fn into_ptr(node: &'static StaticNode) -> NonNull<StaticNode> {
                NonNull::from(node)
            }

            unsafe fn from_ptr(ptr: NonNull<StaticNode>) -> &'static StaticNode {
                // SAFETY: `ptr` came from `into_ptr`, i.e. from a `&'static StaticNode`.
                unsafe { ptr.as_ref() }
            }

            unsafe fn links(ptr: NonNull<StaticNode>) -> NonNull<Links<StaticNode>> {
                // SAFETY: `ptr` points to a live node, so the field's address is not null.
                unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).$hook) }
            }
        }
    };
}
static_linked!(A, a);
static_linked!(B, b);

/// `&'static` nodes made with `Box::leak`, freed again when the pool drops so that Miri
/// sees no leak. Declare the pool before the lists that use it: it drops after them.
struct Pool(Vec<NonNull<StaticNode>>);

impl Pool {
    fn new() -> Self {
        Self(Vec::new())
    }

    fn node(&mut self, value: u32) -> &'static StaticNode {
        let node = Box::leak(Box::new(StaticNode {
            value,
            a: Links::new(),
            b: Links::new(),
        }));
        let ptr = NonNull::from(node);
        self.0.push(ptr);
        // SAFETY: the node lives until the pool drops, after every list using it.
        unsafe { ptr.as_ref() }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for ptr in self.0.drain(..) {
            // SAFETY: every list is gone (declared after the pool), so nothing uses the
            // node any more; `ptr` came from `Box::leak`.
            let node = unsafe { Box::from_raw(ptr.as_ptr()) };
            assert!(
                !node.a.is_linked() && !node.b.is_linked(),
                "pool node still linked"
            );
        }
    }
}

/// Checks `list` against `model` through every read-only accessor.
#[track_caller]
fn check<T, Tag>(list: &List<T, Tag>, model: &VecDeque<u32>)
where
    T: Linked<Tag> + Value + ?Sized,
{
    list.assert_valid();
    let forward: Vec<u32> = list.iter().map(Value::value).collect();
    let expected: Vec<u32> = model.iter().copied().collect();
    assert_eq!(forward, expected);
    let mut backward: Vec<u32> = list.iter().rev().map(Value::value).collect();
    backward.reverse();
    assert_eq!(backward, expected);
    assert_eq!(list.len(), model.len());
    assert_eq!(list.iter().len(), model.len());
    assert_eq!(list.is_empty(), model.is_empty());
    assert_eq!(list.front().map(Value::value), model.front().copied());
    assert_eq!(list.back().map(Value::value), model.back().copied());
}

fn assert_send_sync<X: Send + Sync>() {}

#[test]
fn const_constructors() {
    static LIST: List<StaticNode, A> = List::new();
    static HOOK: Links<StaticNode> = Links::new();
    assert!(LIST.is_empty());
    assert!(!HOOK.is_linked());
    LIST.assert_valid();
    assert_send_sync::<List<Node, A>>();
    assert_send_sync::<List<StaticNode, B>>();
}

#[test]
fn static_nodes_behave_like_a_deque() {
    let mut pool = Pool::new();
    let nodes: Vec<&'static StaticNode> = (0..6).map(|v| pool.node(v)).collect();
    let mut list = List::<StaticNode, A>::new();
    let mut model = VecDeque::new();
    check(&list, &model);
    assert!(list.pop_front().is_none() && list.pop_back().is_none());

    for (i, node) in nodes.iter().enumerate() {
        if i % 2 == 0 {
            list.push_back(node);
            model.push_back(node.value);
        } else {
            list.push_front(node);
            model.push_front(node.value);
        }
        check(&list, &model);
    }
    for i in 0..6 {
        let (got, want) = if i % 3 == 0 {
            (list.pop_back(), model.pop_back())
        } else {
            (list.pop_front(), model.pop_front())
        };
        assert_eq!(got.map(Value::value), want);
        check(&list, &model);
    }
    assert!(nodes.iter().all(|n| !n.a.is_linked()));
    // Relink after unlinking.
    list.push_back(nodes[3]);
    model.push_back(3);
    check(&list, &model);
}

#[test]
fn static_node_in_two_lists() {
    let mut pool = Pool::new();
    let nodes: Vec<&'static StaticNode> = (0..4).map(|v| pool.node(v)).collect();
    let mut a = List::<StaticNode, A>::new();
    let mut b = List::<StaticNode, B>::new();
    let (mut ma, mut mb) = (VecDeque::new(), VecDeque::new());
    for node in &nodes {
        a.push_back(node);
        ma.push_back(node.value);
        b.push_front(node);
        mb.push_front(node.value);
        check(&a, &ma);
        check(&b, &mb);
    }
    assert!(List::<StaticNode, A>::is_linked(nodes[2]));
    assert!(List::<StaticNode, B>::is_linked(nodes[2]));
    // Unlinking through one hook leaves the other list alone.
    // SAFETY: nodes[2] is linked into `a`.
    let two = unsafe { a.erase(NonNull::from(nodes[2])) };
    assert_eq!(two.map(Value::value), Some(2));
    ma.retain(|&v| v != 2);
    check(&a, &ma);
    check(&b, &mb);
    assert!(!nodes[2].a.is_linked() && nodes[2].b.is_linked());
    assert_eq!(b.pop_back().map(Value::value), mb.pop_back());
    check(&a, &ma);
    check(&b, &mb);
}

#[test]
fn arc_nodes_in_two_lists_hold_one_count_per_list() {
    let nodes: Vec<Arc<Node>> = (0..4).map(Node::new).collect();
    let mut a = List::<Node, A>::new();
    let mut b = List::<Node, B>::new();
    let (mut ma, mut mb) = (VecDeque::new(), VecDeque::new());
    for node in &nodes {
        a.push_back(node.clone());
        ma.push_back(node.value);
        check(&a, &ma);
    }
    for node in nodes.iter().rev().step_by(2) {
        b.push_back(node.clone());
        mb.push_back(node.value);
        check(&b, &mb);
    }
    let counts: Vec<usize> = nodes.iter().map(Arc::strong_count).collect();
    assert_eq!(counts, [2, 3, 2, 3]);

    let popped = a.pop_front().unwrap();
    ma.pop_front();
    check(&a, &ma);
    assert!(Arc::ptr_eq(&popped, &nodes[0]));
    drop(popped);
    assert_eq!(Arc::strong_count(&nodes[0]), 1);

    // Dropping a list releases the handles it holds, and only those.
    drop(b);
    let counts: Vec<usize> = nodes.iter().map(Arc::strong_count).collect();
    assert_eq!(counts, [1, 2, 2, 2]);
    assert!(nodes.iter().all(|n| !n.b.is_linked()));
    drop(a);
    assert!(
        nodes
            .iter()
            .all(|n| Arc::strong_count(n) == 1 && !n.a.is_linked())
    );
}

#[test]
fn erase_head_middle_tail_and_unlinked() {
    let nodes: Vec<Arc<Node>> = (0..5).map(Node::new).collect();
    let mut list = List::<Node, A>::new();
    let mut model = VecDeque::new();
    for node in &nodes {
        list.push_back(node.clone());
        model.push_back(node.value);
    }
    check(&list, &model);
    for &i in &[2_usize, 0, 4, 1, 3] {
        // A pointer made from a reference: `erase` rebuilds the handle from the list's
        // own pointer, which has the provenance `Arc::from_raw` needs.
        let ptr = NonNull::from(&*nodes[i]);
        // SAFETY: nodes[i] is linked into `list`.
        let handle = unsafe { list.erase(ptr) }.expect("node was linked");
        assert!(Arc::ptr_eq(&handle, &nodes[i]));
        model.retain(|&v| v as usize != i);
        check(&list, &model);
        // SAFETY: nodes[i] is not linked into any list now.
        assert!(unsafe { list.erase(ptr) }.is_none());
        check(&list, &model);
    }
    assert!(list.is_empty());
    assert!(nodes.iter().all(|n| Arc::strong_count(n) == 1));
}

#[test]
fn erase_checked_leaves_other_lists_alone() {
    let nodes: Vec<Arc<Node>> = (0..4).map(Node::new).collect();
    let mut mine = List::<Node, A>::new();
    let mut other = List::<Node, A>::new();
    let (mut mm, mut mo) = (VecDeque::new(), VecDeque::new());
    for node in &nodes[..3] {
        mine.push_back(node.clone());
        mm.push_back(node.value);
    }
    other.push_back(nodes[3].clone());
    mo.push_back(3);
    // Not linked through this hook at all (only through `b`).
    let lone = Node::new(9);
    let mut b = List::<Node, B>::new();
    b.push_back(lone.clone());

    assert!(mine.erase_checked(&nodes[3]).is_none());
    assert!(mine.erase_checked(&lone).is_none());
    assert!(!mine.contains(&nodes[3]) && other.contains(&nodes[3]));
    check(&mine, &mm);
    check(&other, &mo);

    for &i in &[1_usize, 2, 0] {
        assert!(mine.contains(&nodes[i]));
        let handle = mine.erase_checked(&nodes[i]).expect("node is in `mine`");
        assert!(Arc::ptr_eq(&handle, &nodes[i]));
        mm.retain(|&v| v as usize != i);
        check(&mine, &mm);
        assert!(mine.erase_checked(&nodes[i]).is_none());
    }
    assert!(other.erase_checked(&nodes[3]).is_some());
    mo.clear();
    check(&other, &mo);
}

#[test]
fn cursor_removes_while_iterating() {
    let nodes: Vec<Arc<Node>> = (0..7).map(Node::new).collect();
    let mut list = List::<Node, A>::new();
    let mut model = VecDeque::new();
    for node in &nodes {
        list.push_back(node.clone());
        model.push_back(node.value);
    }
    let mut removed = Vec::new();
    let mut cursor = list.cursor_mut();
    while let Some(node) = cursor.current() {
        if node.value % 3 != 1 {
            let handle = cursor.remove_current().unwrap();
            removed.push(handle.value);
            cursor.list().assert_valid();
        } else {
            cursor.move_next();
        }
    }
    assert!(cursor.remove_current().is_none());
    // From the ghost position, `move_prev` goes to the back and `move_next` to the front.
    cursor.move_prev();
    assert_eq!(cursor.current().map(Value::value), Some(4));
    cursor.move_next();
    assert!(cursor.current().is_none());
    cursor.move_next();
    assert_eq!(cursor.current().map(Value::value), Some(1));
    cursor.move_prev();
    assert!(cursor.current().is_none());
    // Removing the last node moves to the ghost position.
    cursor.move_prev();
    assert_eq!(cursor.remove_current().map(|h| h.value), Some(4));
    assert!(cursor.current().is_none());
    model.retain(|v| v % 3 == 1 && *v != 4);
    check(&list, &model);
    assert_eq!(removed, [0, 2, 3, 5, 6]);
    assert_eq!(Arc::strong_count(&nodes[1]), 2);
    assert_eq!(Arc::strong_count(&nodes[4]), 1);
}

#[test]
fn splice_back_moves_every_node() {
    let nodes: Vec<Arc<Node>> = (0..6).map(Node::new).collect();
    let mut x = List::<Node, A>::new();
    let mut y = List::<Node, A>::new();
    let (mut mx, mut my) = (VecDeque::new(), VecDeque::new());

    // empty <- empty
    x.splice_back(&mut y);
    check(&x, &mx);
    check(&y, &my);
    // empty <- two
    for node in &nodes[..2] {
        y.push_back(node.clone());
        my.push_back(node.value);
    }
    x.splice_back(&mut y);
    mx.append(&mut my);
    check(&x, &mx);
    check(&y, &my);
    // two <- empty
    x.splice_back(&mut y);
    check(&x, &mx);
    // two <- three, where `y` already has an id of its own
    for node in &nodes[2..5] {
        y.push_front(node.clone());
        my.push_front(node.value);
    }
    check(&y, &my);
    x.splice_back(&mut y);
    mx.append(&mut my);
    check(&x, &mx);
    check(&y, &my);
    // The moved nodes now belong to `x`: erase one, relink one into `y`.
    // SAFETY: nodes[3] was moved into `x`.
    let three = unsafe { x.erase(NonNull::from(&*nodes[3])) }.unwrap();
    mx.retain(|&v| v != 3);
    y.push_back(three);
    my.push_back(3);
    y.push_back(nodes[5].clone());
    my.push_back(5);
    check(&x, &mx);
    check(&y, &my);
    // Splicing back the other way.
    y.splice_back(&mut x);
    my.append(&mut mx);
    check(&x, &mx);
    check(&y, &my);
    assert_eq!(y.pop_back().map(|h| h.value), my.pop_back());
    check(&y, &my);
}

#[test]
fn lists_move_with_their_nodes() {
    let nodes: Vec<Arc<Node>> = (0..3).map(Node::new).collect();
    let mut list = List::<Node, A>::new();
    for node in &nodes {
        list.push_back(node.clone());
    }
    let mut boxed = Box::new(list);
    boxed.assert_valid();
    let mut swapped = List::<Node, A>::new();
    core::mem::swap(&mut *boxed, &mut swapped);
    assert!(boxed.is_empty());
    swapped.assert_valid();
    // SAFETY: nodes[1] is linked into `swapped` (it moved along with the list).
    assert!(unsafe { swapped.erase(NonNull::from(&*nodes[1])) }.is_some());
    swapped.assert_valid();
    let handle = std::thread::spawn(move || {
        swapped.assert_valid();
        swapped.pop_front().map(|h| h.value)
    });
    assert_eq!(handle.join().unwrap(), Some(0));
    assert!(nodes.iter().all(|n| Arc::strong_count(n) == 1));
}

#[test]
#[should_panic(expected = "double link")]
fn double_link_into_the_same_list_panics() {
    let node = Node::new(1);
    let mut list = List::<Node, A>::new();
    list.push_back(node.clone());
    list.assert_valid();
    list.push_front(node);
}

#[test]
#[should_panic(expected = "double link")]
fn double_link_into_another_list_panics() {
    let node = Node::new(1);
    let mut first = List::<Node, A>::new();
    let mut second = List::<Node, A>::new();
    first.push_back(node.clone());
    first.assert_valid();
    second.push_back(node);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "erase from wrong list")]
fn erase_from_the_wrong_list_panics() {
    let node = Node::new(1);
    let mut first = List::<Node, A>::new();
    let mut second = List::<Node, A>::new();
    first.push_back(node.clone());
    second.push_back(Node::new(2));
    first.assert_valid();
    second.assert_valid();
    // SAFETY: none: this breaks `erase`'s contract on purpose; debug builds catch it
    // before touching any pointer.
    let _ = unsafe { second.erase(NonNull::from(&*node)) };
}

#[cfg(debug_assertions)]
#[test]
fn double_link_leaves_both_lists_intact() {
    let node = Node::new(1);
    let mut first = List::<Node, A>::new();
    let mut second = List::<Node, A>::new();
    first.push_back(node.clone());
    let result = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
        second.push_back(node.clone());
    }));
    let message = result.unwrap_err();
    let message = message.downcast_ref::<std::string::String>().unwrap();
    assert!(
        message.contains("already linked into another list"),
        "{message}"
    );
    first.assert_valid();
    second.assert_valid();
    assert!(second.is_empty());
    // The refused handle was dropped: `node` + `first`'s handle.
    assert_eq!(Arc::strong_count(&node), 2);
}
