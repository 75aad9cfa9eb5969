//! Loom models of `close()` racing a wait: on a [`Notifier`] and on a
//! [`BlockingThenBusy`] in each of its phases (invariant 4 of ARCHITECTURE.md's notify-skip
//! section: `close()` during a wait ends the wait with an error, never a hang).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_close`.
#![cfg(loom)]

use core::time::Duration;

use ivm_core::btb::{BlockingThenBusy, SpinBudget};
use ivm_core::counter::WaitError;
use ivm_core::notifier::{Closed, Notifier};
use ivm_core::wait::LoomWait;
use loom::cell::UnsafeCell;
use loom::thread;

/// A notify racing a close racing the wait: a notify that succeeded is still delivered,
/// otherwise the wait reports the close; it never hangs.
#[test]
fn notifier_close_races_notify() {
    loom::model(|| {
        let n: &'static Notifier<LoomWait> = Box::leak(Box::new(Notifier::new()));
        let notifier = thread::spawn(move || n.notify());
        let closer = thread::spawn(move || n.close());
        let waited = n.wait_and_clear();
        let notified = notifier.join().unwrap();
        closer.join().unwrap();
        if notified.is_ok() {
            assert_eq!(waited, Ok(()), "a successful notify was lost by close()");
        } else {
            assert_eq!(waited, Err(Closed));
        }
    });
}

/// `close()` wakes every sleeper.
#[test]
fn notifier_close_wakes_all_waiters() {
    loom::model(|| {
        let n: &'static Notifier<LoomWait> = Box::leak(Box::new(Notifier::new()));
        let other = thread::spawn(move || n.wait_and_clear());
        let closer = thread::spawn(move || n.close());
        assert_eq!(n.wait_and_clear(), Err(Closed));
        assert_eq!(other.join().unwrap(), Err(Closed));
        closer.join().unwrap();
        assert_eq!(n.notify(), Err(Closed));
    });
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worker {
    /// Never starts: the waiter is in the blocking phase when the close comes.
    Absent,
    /// Starts (notifies) but never finishes: spinning or parked on the counter.
    Started,
    /// Runs the whole round: the close races the completion.
    Finishes,
}

struct Shared {
    btb: BlockingThenBusy<LoomWait>,
    data: UnsafeCell<u32>,
}

// SAFETY: `data` is written by the worker before `decrease()` and read by the waiter only
// after `wait_until_done` returned Ok.
unsafe impl Sync for Shared {}

fn btb_close(worker: Worker, skip: bool, spin: SpinBudget) {
    loom::model(move || {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            btb: BlockingThenBusy::with_spin_budget(spin),
            data: UnsafeCell::new(0),
        }));
        let w = (worker != Worker::Absent).then(|| {
            thread::spawn(move || {
                let _ = s.btb.notify();
                if worker == Worker::Finishes {
                    // SAFETY: see `Shared`.
                    s.data.with_mut(|p| unsafe { *p = 7 });
                    s.btb.decrease();
                }
            })
        });
        let closer = thread::spawn(move || s.btb.close());
        if skip {
            s.btb.skip_blocking();
        }
        match s
            .btb
            .wait_until_done(Duration::MAX, || unreachable!("no period"))
        {
            Ok(()) => {
                assert_eq!(worker, Worker::Finishes, "Ok without a decrease()");
                // SAFETY: see `Shared`.
                assert_eq!(s.data.with(|p| unsafe { *p }), 7);
            }
            Err(e) => assert_eq!(e, WaitError::Closed),
        }
        closer.join().unwrap();
        if let Some(w) = w {
            w.join().unwrap();
        }
    });
}

#[test]
fn btb_close_while_blocked() {
    btb_close(Worker::Absent, false, SpinBudget::DEFAULT);
}

#[test]
fn btb_close_after_skip() {
    btb_close(Worker::Absent, true, SpinBudget::DEFAULT);
}

#[test]
fn btb_close_while_spinning_or_parked() {
    btb_close(Worker::Started, false, SpinBudget::DEFAULT);
}

#[test]
fn btb_close_while_parked_on_counter() {
    btb_close(Worker::Started, true, SpinBudget::NONE);
}

#[test]
fn btb_close_races_completion() {
    btb_close(Worker::Finishes, false, SpinBudget::DEFAULT);
}

#[test]
fn btb_close_races_completion_skip() {
    btb_close(Worker::Finishes, true, SpinBudget::NONE);
}
