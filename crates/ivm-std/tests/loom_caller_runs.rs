//! Loom model of a waiting caller that runs the instructions queued to a sleeping worker
//! (`worker::caller_runs`), with the VM's own hand-over of the queue's consumer role
//! (`ivm_std::take_role` / `ivm_std::let_go`, hidden, `cfg(loom)` only) and the same
//! ivm-core building blocks and order of operations as `worker.rs` / `thread_ctx.rs`:
//!
//! * the engine (the main thread) dispatches two jobs to the worker's queue, one after the
//!   other, notifying the worker when its push found the queue empty;
//! * the worker (`worker_loop`): takes the role (`take_role`), drains and runs what is
//!   queued, lets go of the role when the queue is empty and sleeps on its notifier; after
//!   a wake it takes the role again, or — when a caller holds it — sleeps again at once;
//!   when closed, it takes the role (yielding while a caller holds it) and drains;
//! * the caller, about to wait: if the queue holds something, takes the role
//!   (`try_consume`), runs what is queued, in order, and lets go (`let_go`: re-check the
//!   queue after letting go, and wake the worker if anything is left).
//!
//! Every interleaving must run each job exactly once, in queue order, never two at once
//! (a shared log in a loom `UnsafeCell`: two runners not ordered by the role's hand-over
//! are a reported race; a flag catches overlap too), and nothing may be left queued with
//! the worker asleep and no caller running (the engine waits for both jobs: a lost wake
//! is a reported deadlock). The planted bugs must each be caught: a caller that lets go
//! without re-checking the queue, or re-checks before letting go (a push that woke the
//! worker while the caller held the role is stranded); either SeqCst fence of the
//! hand-over missing (the store-buffering pattern of `thread_ctx.rs`: the caller's look
//! and the worker's retry both miss the other); and a caller that lets go of the role
//! before it runs the job it popped (the worker runs the next job beside it).
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_caller_runs`.
#![cfg(loom)]

use std::ptr::NonNull;
use std::sync::Arc;

use ivm_core::LoomWait;
use ivm_core::mpsc::{self, MpscQueue, Pop};
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering, UnsafeCell};

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

const JOBS: usize = 2;

struct Vm {
    queue: MpscQueue<Job, W>,
    notifier: Notifier<LoomWait>,
    /// The ids of the jobs run, in the order they ran: written only by the holder of the
    /// consumer role (loom reports a race otherwise).
    log: UnsafeCell<Vec<usize>>,
    /// Set while a job runs: two at once is a bug even if loom saw no race.
    busy: AtomicBool,
    /// Jobs run so far (Release: publishes the log to the engine).
    ran: AtomicUsize,
    /// Notified after each job runs (the engine waits for all of them).
    ran_n: loom::sync::Notify,
}

// SAFETY: `log` is touched only by the holder of the queue's consumer role, and by the
// engine after reading `ran == JOBS` with Acquire (loom checks both).
unsafe impl Sync for Vm {}
// SAFETY: as above.
unsafe impl Send for Vm {}

impl Vm {
    /// Runs `job` (as `execute` would) and tells the engine.
    fn run(&self, job: Arc<Job>) {
        assert!(
            !self.busy.swap(true, Ordering::Relaxed),
            "two jobs of one queue ran at once"
        );
        // SAFETY: only the role's holder runs jobs (what the model checks).
        self.log.with_mut(|p| unsafe { (*p).push(job.id) });
        self.busy.store(false, Ordering::Relaxed);
        // Release: publishes the log entry to the engine's Acquire.
        self.ran.fetch_add(1, Ordering::Release);
        self.ran_n.notify();
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// `let_go` as in the VM.
    Sound,
    /// Planted: the caller lets go without re-checking the queue.
    PlantedNoRecheck,
    /// Planted: the caller re-checks the queue before it lets go of the role.
    PlantedRecheckFirst,
    /// Planted: the caller lets go of the role, then runs the job it popped.
    PlantedRunAfterLettingGo,
    /// Planted: the caller's `let_go` without its SeqCst fence.
    PlantedLetGoWithoutFence,
    /// Planted: the worker's `take_role` without its SeqCst fence.
    PlantedTakeRoleWithoutFence,
}

fn model(variant: Variant) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let vm: &'static Vm = Box::leak(Box::new(Vm {
            queue: MpscQueue::new(),
            notifier: Notifier::new(),
            log: UnsafeCell::new(Vec::new()),
            busy: AtomicBool::new(false),
            ran: AtomicUsize::new(0),
            ran_n: loom::sync::Notify::new(),
        }));

        // The worker (`worker_loop`).
        let worker = loom::thread::spawn(move || {
            loop {
                let role = if variant == Variant::PlantedTakeRoleWithoutFence {
                    ivm_std::planted_take_role_without_fence(&vm.queue)
                } else {
                    ivm_std::take_role(&vm.queue)
                };
                let Some(mut consumer) = role else {
                    // A caller holds the role: sleep again (its `let_go` wakes us).
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
                // Let go before sleeping (no re-check: the queue was empty under us).
                drop(consumer);
                if vm.notifier.wait_and_clear().is_err() {
                    break;
                }
            }
            // Closed: take the role (yield while a caller holds it) and drain.
            let mut consumer = loop {
                if let Some(c) = ivm_std::take_role(&vm.queue) {
                    break c;
                }
                loom::thread::yield_now();
            };
            consumer.drain_until_empty(|j| vm.run(j));
        });

        // The caller about to wait (`caller_runs`): if something is queued, takes the
        // role, runs what is queued, then lets go (one look, anywhere between the pushes).
        let caller = loom::thread::spawn(move || {
            if vm.queue.is_empty() {
                return;
            }
            let Some(mut consumer) = vm.queue.try_consume() else {
                return;
            };
            if variant == Variant::PlantedRunAfterLettingGo {
                if let Pop::Item(j) = consumer.try_pop() {
                    ivm_std::let_go(consumer, &vm.notifier);
                    vm.run(j);
                } else {
                    ivm_std::let_go(consumer, &vm.notifier);
                }
                return;
            }
            while let Pop::Item(j) = consumer.try_pop() {
                vm.run(j);
            }
            match variant {
                Variant::PlantedNoRecheck => {
                    ivm_std::planted_let_go_without_recheck(consumer, &vm.notifier);
                }
                Variant::PlantedRecheckFirst => {
                    ivm_std::planted_let_go_recheck_first(consumer, &vm.notifier);
                }
                Variant::PlantedLetGoWithoutFence => {
                    ivm_std::planted_let_go_without_fence(consumer, &vm.notifier);
                }
                _ => ivm_std::let_go(consumer, &vm.notifier),
            }
        });

        // The engine: dispatches the jobs (`ThreadCtx::submit`), then waits for them.
        for id in 0..JOBS {
            let job = Arc::new(Job {
                worker: mpsc::Links::new(),
                id,
            });
            if vm.queue.push(job) {
                let _ = vm.notifier.notify();
            }
        }
        // Acquire: pairs with the runners' Release increments (the log is visible).
        while vm.ran.load(Ordering::Acquire) < JOBS {
            vm.ran_n.wait();
        }
        caller.join().unwrap();
        // SAFETY: every job ran (Acquire above) and nothing else is queued.
        let log = vm.log.with(|p| unsafe { (*p).clone() });
        assert_eq!(
            log,
            (0..JOBS).collect::<Vec<_>>(),
            "each job once, in queue order"
        );
        vm.notifier.close();
        worker.join().unwrap();
    });
}

#[test]
fn caller_runs_beside_a_waking_worker() {
    model(Variant::Sound);
}

/// A caller that lets go of the role without looking at the queue again: the second job,
/// pushed while the caller held the role (it woke the worker, which found the role taken
/// and slept again), is left with nobody to run it. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_let_go_without_recheck() {
    model(Variant::PlantedNoRecheck);
}

/// A caller that looks at the queue before it lets go of the role: a push after the look
/// wakes a worker that still finds the role taken. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_recheck_before_letting_go() {
    model(Variant::PlantedRecheckFirst);
}

/// A caller that lets go of the role before it runs the job it popped: the worker takes
/// the role and runs the next job beside it (a race on the log, two jobs at once, or the
/// log out of order). Loom must find it.
#[test]
#[should_panic]
fn planted_run_after_letting_go() {
    model(Variant::PlantedRunAfterLettingGo);
}

/// A caller whose look at the queue after letting go is not fenced: it may miss the push
/// that woke the worker, while the worker (which happens after that push) still finds the
/// role taken. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_let_go_without_fence() {
    model(Variant::PlantedLetGoWithoutFence);
}

/// A worker whose retry of the role after a wake is not fenced: it may find the role
/// taken although the caller let go and its look at the queue missed the push. Loom must
/// find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_take_role_without_fence() {
    model(Variant::PlantedTakeRoleWithoutFence);
}
