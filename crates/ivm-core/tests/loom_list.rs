//! Loom model of the pointer list's hook hand-off (`ivm_core::list`): a node's hook
//! pointers belong to the list that claimed the hook's state word, and pass to the next
//! list through that word alone (Release when unlinking, Acquire when claiming).
//!
//! The hook's pointers are a loom `UnsafeCell` (through `ivm_core::sync`), so when the
//! next owner's claim does not synchronise with the previous owner's unlink, its writes to
//! the pointers race with the unlink's, and loom reports it. (Found by
//! `.ci/ordering_mutants.sh`: both orderings survived every other model.)
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_list`.
#![cfg(loom)]

use core::ptr::NonNull;

use ivm_core::list::{self, List};
use loom::thread;

/// A node with one hook, handled by `&'static` reference: a handle is `Copy`, so another
/// thread can hold the node without taking it from the list it is in — the case where
/// nothing but the hook's state word orders the two lists' writes.
struct Node {
    hook: list::Links<Node>,
}

enum Tag {}

// SAFETY: `&'static` nodes never move or free; `into_ptr`/`from_ptr` convert the reference
// and back; `links` projects to the `hook` field without making a reference to the node.
unsafe impl list::Linked<Tag> for Node {
    type Handle = &'static Node;
    fn into_ptr(handle: &'static Node) -> NonNull<Node> {
        NonNull::from(handle)
    }
    unsafe fn from_ptr(ptr: NonNull<Node>) -> &'static Node {
        // SAFETY: `ptr` came from a `&'static Node` (caller's contract).
        unsafe { ptr.as_ref() }
    }
    unsafe fn links(ptr: NonNull<Node>) -> NonNull<list::Links<Node>> {
        // SAFETY: `ptr` points to a live node (caller's contract); a field projection of a
        // non-null pointer is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).hook) }
    }
}

/// The owner of list A unlinks a node while another thread waits for the node to be
/// unlinked and then links it into its own list B: B's claim (Acquire) must see A's unlink
/// (Release), or B's writes to the hook's pointers race with A's.
#[test]
fn unlink_hands_the_hook_to_the_next_list() {
    loom::model(|| {
        let node: &'static Node = Box::leak(Box::new(Node {
            hook: list::Links::new(),
        }));
        let mut a: List<Node, Tag> = List::new();
        a.push_back(node);
        let next_owner = thread::spawn(move || {
            while List::<Node, Tag>::is_linked(node) {
                thread::yield_now();
            }
            let mut b: List<Node, Tag> = List::new();
            b.push_back(node);
            assert!(b.pop_front().is_some_and(|n| core::ptr::eq(n, node)));
        });
        assert!(a.pop_front().is_some_and(|n| core::ptr::eq(n, node)));
        next_owner.join().unwrap();
    });
}
