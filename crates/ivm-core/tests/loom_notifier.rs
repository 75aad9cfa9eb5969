//! Loom models of what a [`Notifier`] publishes: everything a thread wrote before its
//! `notify` is visible to the wait that consumes the notification, and everything written
//! before `close` is visible to whoever learns of the close (a wait that returns
//! [`Closed`], or `is_closed`).
//!
//! Each model writes a plain cell (a loom `UnsafeCell`) and reads it right after the
//! notifier said so, with nothing but the notifier's state word in between: a weakened
//! ordering on that path is a data race, which loom reports. (Found by
//! `.ci/ordering_mutants.sh`: each ordering these models check survived every other model,
//! which publish through the counters, or not at all.)
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_notifier`.
#![cfg(loom)]

use ivm_core::notifier::{Closed, Notifier};
use ivm_core::wait::LoomWait;
use loom::cell::UnsafeCell;
use loom::thread;

struct Shared {
    notifier: Notifier<LoomWait>,
    /// Written once, before the step that publishes it (the `close`, or a `notify`).
    published: UnsafeCell<u32>,
}

// SAFETY: `published` is written once, before the publishing step, and read only after the
// reader learnt of that step through the notifier, which is what the models check (loom
// reports the read as a race otherwise).
unsafe impl Sync for Shared {}

fn leak() -> &'static Shared {
    Box::leak(Box::new(Shared {
        notifier: Notifier::new(),
        published: UnsafeCell::new(0),
    }))
}

fn closer(s: &'static Shared) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        // SAFETY: see `Shared`.
        s.published.with_mut(|p| unsafe { *p = 9 });
        s.notifier.close();
    })
}

fn read_published(s: &Shared) {
    // SAFETY: see `Shared`.
    let v = s.published.with(|p| unsafe { *p });
    assert_eq!(v, 9);
}

/// A wait racing the close, with nothing ever notified: it returns `Closed` from the first
/// look at the state, from the failed compare-exchange that would have announced its
/// sleep, or after being woken; on each path it then reads the closer's cell.
#[test]
fn close_publishes_to_the_waiter() {
    loom::model(|| {
        let s = leak();
        let c = closer(s);
        assert_eq!(s.notifier.wait_and_clear(), Err(Closed));
        read_published(s);
        c.join().unwrap();
    });
}

/// `is_closed` is how another thread learns of the close: it reads what the closer wrote.
#[test]
fn is_closed_publishes_the_closer_data() {
    loom::model(|| {
        let s = leak();
        let c = closer(s);
        if s.notifier.is_closed() {
            read_published(s);
        }
        c.join().unwrap();
    });
}

/// Two waiters share one notification, and the close comes after it. A waiter that saw
/// the count (and so synchronised only with the notify) can lose the compare-exchange that
/// consumes it to the other waiter, whose consumption came after the close: its failed
/// compare-exchange then returns the closed, empty state, and it reports `Closed` with
/// nothing else read in between, so that failure must be Acquire.
#[test]
fn close_after_a_notification_two_waiters() {
    loom::model(|| {
        let s = leak();
        let t = thread::spawn(move || {
            s.notifier.notify().unwrap();
            // SAFETY: see `Shared` (written after the notify: only the close publishes it).
            s.published.with_mut(|p| unsafe { *p = 9 });
            s.notifier.close();
        });
        let other = thread::spawn(move || {
            if s.notifier.wait_and_clear() == Err(Closed) {
                read_published(s);
            }
        });
        if s.notifier.wait_and_clear() == Err(Closed) {
            read_published(s);
        }
        other.join().unwrap();
        t.join().unwrap();
    });
}

/// Two waiters, two notifications, the second of which publishes a cell: the state word
/// can come back to the very value a waiter saw (the other waiter consumed the first
/// notification, then the second one arrived), so that waiter's compare-exchange consumes
/// the second notification although its Acquire load synchronised only with the first.
/// The consuming compare-exchange must therefore be Acquire on success too.
///
/// The waiter reads the cell once it has joined the other waiter. In every other history
/// that read is safe through some other path: the waiter consumed the second notification
/// directly, or the other waiter did, or a wait ended with `Closed` (the close comes after
/// the second notification, so that a waiter left with nothing to consume does not hang).
#[test]
fn notification_consumed_after_the_word_came_back() {
    loom::model(|| {
        let s = leak();
        let other = thread::spawn(move || {
            let _ = s.notifier.wait_and_clear();
        });
        // The first notification, from the waiter itself, before the close can exist: it
        // publishes nothing.
        s.notifier.notify().unwrap();
        let second = thread::spawn(move || {
            // SAFETY: see `Shared` (published by this notify, and by the close after it).
            s.published.with_mut(|p| unsafe { *p = 9 });
            s.notifier.notify().unwrap();
            s.notifier.close();
        });
        let _ = s.notifier.wait_and_clear();
        other.join().unwrap();
        read_published(s);
        second.join().unwrap();
    });
}
