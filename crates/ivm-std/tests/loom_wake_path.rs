//! Loom model of the VM's wake path at small scale, with the same ivm-core building
//! blocks and the same order of operations as `scheduler.rs` / `worker.rs` /
//! `sync_access.rs`:
//!
//! caller: push to the pending queue, unpark on the empty edge, (optionally) notify-skip,
//! wait on the instruction's BTB, read the result;
//! scheduler: drain pending, dispatch to the worker queue (notify on the empty edge),
//! release when DONE, park through `Parking` re-checking pending + completions;
//! worker: drain, run (BTB notify, write, DONE Release, BTB decrease), unpark the
//! scheduler, block on its notifier.
//!
//! A completion races the scheduler's park in every interleaving. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_wake_path`.
#![cfg(loom)]

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use ivm_core::LoomWait;
use ivm_core::btb::BlockingThenBusy;
use ivm_core::mpsc::{self, MpscQueue};
use ivm_core::notifier::Notifier;
use ivm_core::parking::Parking;
use ivm_core::sync::{AtomicBool, Ordering, UnsafeCell};

struct Job {
    pending: mpsc::Links<Job>,
    worker: mpsc::Links<Job>,
    data: UnsafeCell<u32>,
    done: AtomicBool,
    btb: BlockingThenBusy<LoomWait>,
}

// SAFETY: `data` is written by the worker before its Release DONE / BTB decrease and read
// by the caller after the BTB wait (Acquire): loom checks exactly that.
unsafe impl Sync for Job {}
// SAFETY: as above.
unsafe impl Send for Job {}

struct P;
struct W;

macro_rules! linked {
    ($tag:ty, $field:ident) => {
        // SAFETY: Arc::into_raw/from_raw keep the node in place; `links` projects to a
        // field used by this tag only.
        unsafe impl mpsc::Linked<$tag> for Job {
            type Handle = Arc<Job>;
            fn into_ptr(h: Arc<Job>) -> NonNull<Job> {
                NonNull::new(Arc::into_raw(h).cast_mut()).unwrap()
            }
            unsafe fn from_ptr(p: NonNull<Job>) -> Arc<Job> {
                // SAFETY: `p` came from `into_ptr`.
                unsafe { Arc::from_raw(p.as_ptr()) }
            }
            unsafe fn links(p: NonNull<Job>) -> NonNull<mpsc::Links<Job>> {
                // SAFETY: `p` is live; a field projection is non-null.
                unsafe { NonNull::new_unchecked(&raw mut (*p.as_ptr()).$field) }
            }
        }
    };
}
linked!(P, pending);
linked!(W, worker);

struct Vm {
    pending: MpscQueue<Job, P>,
    parking: Parking<LoomWait>,
    worker_q: MpscQueue<Job, W>,
    worker_n: Notifier<LoomWait>,
}

fn model(skip: bool, planted_no_unpark: bool) {
    loom::model(move || {
        let vm = Arc::new(Vm {
            pending: MpscQueue::new(),
            parking: Parking::new(),
            worker_q: MpscQueue::new(),
            worker_n: Notifier::new(),
        });
        let job = Arc::new(Job {
            pending: mpsc::Links::new(),
            worker: mpsc::Links::new(),
            data: UnsafeCell::new(0),
            done: AtomicBool::new(false),
            btb: BlockingThenBusy::new(),
        });

        let v = vm.clone();
        let scheduler = loom::thread::spawn(move || {
            let mut consumer = v.pending.consume();
            let mut lively: Vec<Arc<Job>> = Vec::new();
            let mut released = 0;
            while released < 1 {
                let mut progress = false;
                let end = consumer.drain(|j| {
                    progress = true;
                    lively.push(j.clone());
                    if v.worker_q.push(j) {
                        let _ = v.worker_n.notify();
                    }
                });
                // Release: Acquire read of DONE (the worker's Release).
                let before = lively.len();
                lively.retain(|j| !j.done.load(Ordering::Acquire));
                released += before - lively.len();
                progress |= before != lively.len();
                if progress || released == 1 {
                    continue;
                }
                if !end.may_sleep() {
                    // A push is half done: never sleep here (as `scheduler.rs`).
                    ivm_core::sync::spin_loop();
                    continue;
                }
                let l = &lively;
                let _ = v.parking.park(
                    || !v.pending.is_empty() || l.iter().any(|j| j.done.load(Ordering::Acquire)),
                    None,
                );
            }
        });

        let v = vm.clone();
        let worker = loom::thread::spawn(move || {
            let mut consumer = v.worker_q.consume();
            let mut ran = 0;
            loop {
                let end = consumer.drain(|j| {
                    let _ = j.btb.notify();
                    // SAFETY: the worker owns `data` between dispatch and DONE.
                    j.data.with_mut(|p| unsafe { *p = 42 });
                    j.done.store(true, Ordering::Release);
                    j.btb.decrease();
                    drop(j);
                    if !planted_no_unpark {
                        v.parking.unpark();
                    }
                    ran += 1;
                });
                if ran == 1 {
                    break;
                }
                if !end.may_sleep() {
                    ivm_core::sync::spin_loop();
                    continue;
                }
                v.worker_n.wait_and_clear().unwrap();
            }
        });

        // The caller.
        if vm.pending.push(job.clone()) {
            vm.parking.unpark();
        }
        if skip {
            job.btb.skip_blocking();
        }
        job.btb.wait_until_done(Duration::MAX, || false).unwrap();
        // SAFETY: the wait acquired the worker's Release decrease.
        assert_eq!(job.data.with(|p| unsafe { *p }), 42);
        scheduler.join().unwrap();
        worker.join().unwrap();
    });
}

#[test]
fn wake_path_blocking() {
    model(false, false);
}

#[test]
fn wake_path_notify_skip() {
    model(true, false);
}

/// A worker that forgets to unpark the scheduler after a completion: the scheduler can
/// park after checking for completions and never wake (the caller is fine: it waits on
/// its BTB), so shutdown would hang. Loom must find it.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_completion_without_unpark() {
    model(false, true);
}
