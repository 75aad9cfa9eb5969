//! Loom model of a wake left to the waiting caller (`model/thread_ctx.rs`, "A wake left to
//! the waiting caller"), with the VM's own `skip_wake` / `withdraw_defer` and the role
//! hand-over of `loom_caller_runs.rs` (`take_role` / `let_go`):
//!
//! * the caller marks its read `DEFER_WAKE` before it is dispatched;
//! * the engine (a thread of its own: any thread may drive) pushes the read to the
//!   worker's queue and, when the push found the queue empty, wakes the worker unless
//!   `skip_wake` says the caller owes the wake; then it pushes a second, ordinary job
//!   (waking the worker only on the empty edge, as `ThreadCtx::submit`);
//! * the worker (`worker_loop`): takes the role, drains, lets go when the queue is empty
//!   and sleeps; after a wake it takes the role again or, when a caller holds it, sleeps;
//! * the caller (`wait_small`): looks a bounded number of times — takes the role if it
//!   can, runs the queue up to its read, lets go (`let_go` wakes the worker if anything is
//!   left) — then, before it blocks, `withdraw_defer`s and wakes the worker if a push
//!   skipped the wake; then it blocks until its read ran.
//!
//! Every interleaving must run both jobs exactly once, in order, and nothing may be left
//! queued with the worker asleep (the caller and the engine block until the jobs ran: a
//! lost wake is a reported deadlock). Planted bugs, each caught: a caller that blocks
//! without withdrawing (a skipped wake nobody pays), and a pusher that decides to skip by
//! a plain load of the caller's offer instead of the read-modify-write (the caller
//! withdraws between the load and the skip, sees no skip, and nobody wakes the worker).
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_deferred_wake`.
#![cfg(loom)]

use std::ptr::NonNull;
use std::sync::Arc;

use ivm_core::LoomWait;
use ivm_core::mpsc::{self, MpscQueue, Pop};
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicU32, AtomicUsize, Ordering, UnsafeCell};

struct Job {
    worker: mpsc::Links<Job>,
    id: usize,
}

struct W;

// SAFETY: Arc::into_raw/from_raw keep the node in place; `links` projects to the only hook.
unsafe impl mpsc::Linked<W> for Job {
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
        unsafe { NonNull::new_unchecked(&raw mut (*p.as_ptr()).worker) }
    }
}

/// The caller's read, then an ordinary job pushed behind it.
const JOBS: usize = 2;
/// How many times the caller looks before it blocks.
const LOOKS: usize = 2;

struct Vm {
    queue: MpscQueue<Job, W>,
    notifier: Notifier<LoomWait>,
    /// The read's status word (`DEFER_WAKE`, `WAKE_SKIPPED`).
    status: AtomicU32,
    /// The ids of the jobs run, in order: written only by the holder of the role.
    log: UnsafeCell<Vec<usize>>,
    busy: AtomicBool,
    /// Jobs run so far (Release: publishes the log).
    ran: AtomicUsize,
    ran_n: loom::sync::Notify,
}

// SAFETY: `log` is touched only by the holder of the queue's consumer role, and by the
// engine after reading `ran == JOBS` with Acquire (loom checks both).
unsafe impl Sync for Vm {}
// SAFETY: as above.
unsafe impl Send for Vm {}

impl Vm {
    fn run(&self, job: Arc<Job>) {
        assert!(
            !self.busy.swap(true, Ordering::Relaxed),
            "two jobs of one queue ran at once"
        );
        // SAFETY: only the role's holder runs jobs (what the model checks).
        self.log.with_mut(|p| unsafe { (*p).push(job.id) });
        self.busy.store(false, Ordering::Relaxed);
        // Release: publishes the log entry.
        self.ran.fetch_add(1, Ordering::Release);
        self.ran_n.notify();
    }

    fn read_ran(&self) -> bool {
        // Acquire: pairs with `run`'s Release.
        self.ran.load(Ordering::Acquire) >= 1
    }

    fn push(&self, id: usize) -> bool {
        self.queue.push(Arc::new(Job {
            worker: mpsc::Links::new(),
            id,
        }))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Sound,
    /// Planted: the caller blocks without withdrawing its offer (nobody pays a skipped
    /// wake).
    PlantedNoWithdraw,
    /// Planted: the pusher skips the wake on a plain load of the caller's offer.
    PlantedSkipByLoad,
}

fn model(variant: Variant) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let vm: &'static Vm = Box::leak(Box::new(Vm {
            queue: MpscQueue::new(),
            notifier: Notifier::new(),
            status: AtomicU32::new(ivm_std::DEFER_WAKE),
            log: UnsafeCell::new(Vec::new()),
            busy: AtomicBool::new(false),
            ran: AtomicUsize::new(0),
            ran_n: loom::sync::Notify::new(),
        }));

        // The worker (`worker_loop`).
        let worker = loom::thread::spawn(move || {
            loop {
                let Some(mut consumer) = ivm_std::take_role(&vm.queue) else {
                    match vm.notifier.wait_and_clear() {
                        Ok(()) => continue,
                        Err(_closed) => break,
                    }
                };
                loop {
                    let mut ran = false;
                    let end = consumer.drain(|j| {
                        ran = true;
                        vm.run(j);
                    });
                    if ran {
                        continue;
                    }
                    if !end.may_sleep() {
                        loom::thread::yield_now();
                        continue;
                    }
                    break;
                }
                drop(consumer);
                if vm.notifier.wait_and_clear().is_err() {
                    break;
                }
            }
            let mut consumer = loop {
                if let Some(c) = ivm_std::take_role(&vm.queue) {
                    break c;
                }
                loom::thread::yield_now();
            };
            consumer.drain_until_empty(|j| vm.run(j));
        });

        // The engine (`ThreadCtx::submit`): the caller's read, then an ordinary job.
        let engine = loom::thread::spawn(move || {
            if vm.push(0) {
                let skip = if variant == Variant::PlantedSkipByLoad {
                    ivm_std::planted_skip_wake_by_load(&vm.status)
                } else {
                    ivm_std::skip_wake(&vm.status)
                };
                if !skip {
                    let _ = vm.notifier.notify();
                }
            }
            if vm.push(1) {
                let _ = vm.notifier.notify();
            }
        });

        // The caller (`wait_small`): a few looks, each running the queue up to its read
        // if it gets the role; then it withdraws its offer and blocks.
        for _ in 0..LOOKS {
            if vm.read_ran() {
                break;
            }
            if let Some(mut consumer) = vm.queue.try_consume() {
                while !vm.read_ran() {
                    match consumer.try_pop() {
                        Pop::Item(j) => vm.run(j),
                        _ => break,
                    }
                }
                ivm_std::let_go(consumer, &vm.notifier);
            }
            loom::thread::yield_now();
        }
        if !vm.read_ran() {
            if variant != Variant::PlantedNoWithdraw && ivm_std::withdraw_defer(&vm.status) {
                let _ = vm.notifier.notify();
            }
            while !vm.read_ran() {
                vm.ran_n.wait();
            }
        }
        engine.join().unwrap();
        // Both jobs run, by whoever: the worker is woken for what the caller left.
        while vm.ran.load(Ordering::Acquire) < JOBS {
            vm.ran_n.wait();
        }
        // SAFETY: every job ran (Acquire above) and nothing else is queued.
        let log = vm.log.with(|p| unsafe { (*p).clone() });
        assert_eq!(
            log,
            (0..JOBS).collect::<Vec<_>>(),
            "each job once, in order"
        );
        vm.notifier.close();
        worker.join().unwrap();
    });
}

#[test]
fn a_skipped_wake_is_paid_by_the_waiting_caller() {
    model(Variant::Sound);
}

/// A caller that blocks without withdrawing its offer: a push that skipped the wake for it
/// leaves the read queued to a sleeping worker. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_block_without_withdrawing() {
    model(Variant::PlantedNoWithdraw);
}

/// A pusher that decides on a plain load of the caller's offer: the caller may withdraw
/// after the load, find no skipped wake recorded, and block; nobody wakes the worker.
/// Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_skip_by_load() {
    model(Variant::PlantedSkipByLoad);
}
