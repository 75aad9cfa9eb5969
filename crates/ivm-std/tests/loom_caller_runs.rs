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
//! The second model, a wake left to the waiting caller (`model/thread_ctx.rs`), reuses the
//! worker and the queue with the VM's own `skip_wake` / `withdraw_defer`:
//!
//! * the caller marks its read `DEFER_WAKE` before it is dispatched;
//! * the engine (a thread of its own: any thread may drive) pushes the read and, when the
//!   push found the queue empty, wakes the worker unless `skip_wake` says the caller owes
//!   the wake; then it pushes an ordinary job (waking the worker on the empty edge only);
//! * the caller (`wait_small`) looks a bounded number of times — takes the role if it can,
//!   runs the queue up to its read, lets go — then, before it blocks, `withdraw_defer`s
//!   and wakes the worker if a push skipped the wake; then it blocks until its read ran.
//!
//! Both jobs must run once, in order, with no lost wake. Planted bugs, each caught as a
//! deadlock: a caller that blocks without withdrawing (a skipped wake nobody pays), and a
//! pusher that decides on a plain load of the caller's offer instead of the RMW (the
//! caller withdraws between the load and the skip, sees no skip, and nobody wakes the
//! worker).
//!
//! The third model is a contended worker that hands its queue to the waiting caller
//! (`model/hand_over.rs`), the fourth a worker that dozes and a push that leaves its wake
//! to the doze's deadline (`model/thread_ctx.rs`), the fifth a caller that runs part of a
//! dozing worker's queue and leaves the rest to the doze (`let_go_to_doze`); each says
//! what it checks and plants.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_caller_runs`.
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

const JOBS: usize = 2;

struct Vm {
    queue: MpscQueue<Job, W>,
    notifier: Notifier<LoomWait>,
    /// The deferred-wake model's read: its status word (`DEFER_WAKE`, `WAKE_SKIPPED`).
    status: AtomicU32,
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

    /// A fresh VM, leaked, not Arc'd: a planted bug panics, and a second panic while
    /// unwinding a loom Arc aborts the test binary.
    fn leaked() -> &'static Vm {
        Box::leak(Box::new(Vm {
            queue: MpscQueue::new(),
            notifier: Notifier::new(),
            status: AtomicU32::new(ivm_std::DEFER_WAKE),
            log: UnsafeCell::new(Vec::new()),
            busy: AtomicBool::new(false),
            ran: AtomicUsize::new(0),
            ran_n: loom::sync::Notify::new(),
        }))
    }

    /// Queues job `id`; whether the queue was empty.
    fn push(&self, id: usize) -> bool {
        self.queue.push(Arc::new(Job {
            worker: mpsc::Links::new(),
            id,
        }))
    }

    /// Blocks until `n` jobs ran (Acquire: pairs with `run`'s Release; the log is visible).
    fn wait_ran(&self, n: usize) {
        while self.ran.load(Ordering::Acquire) < n {
            self.ran_n.wait();
        }
    }

    /// The log, once every job ran (`wait_ran(JOBS)`).
    fn log(&self) -> Vec<usize> {
        // SAFETY: every job ran (Acquire in `wait_ran`) and nothing else is queued.
        self.log.with(|p| unsafe { (*p).clone() })
    }

    /// The end of a model: waits until every job ran, checks they ran once each, in
    /// order, then closes the notifier and joins the worker.
    fn finish(&self, worker: loom::thread::JoinHandle<()>) {
        self.wait_ran(JOBS);
        assert_eq!(
            self.log(),
            (0..JOBS).collect::<Vec<_>>(),
            "each job once, in order"
        );
        self.notifier.close();
        worker.join().unwrap();
    }

    /// A closed worker's way out: takes the role (yielding while a caller holds it) and
    /// drains what is left.
    fn drain_at_close(&self) {
        let mut consumer = loop {
            if let Some(c) = ivm_std::take_role(&self.queue) {
                break c;
            }
            loom::thread::yield_now();
        };
        consumer.drain_until_empty(|j| self.run(j));
    }
}

/// The worker (`worker_loop`): takes the role, drains, lets go and sleeps when the queue
/// is empty; after a wake it takes the role again, or sleeps again while a caller holds
/// it; when closed, it takes the role (yielding while a caller holds it) and drains.
/// `planted_take_role`: its retry without the SeqCst fence.
fn spawn_worker(vm: &'static Vm, planted_take_role: bool) -> loom::thread::JoinHandle<()> {
    loom::thread::spawn(move || {
        loop {
            let role = if planted_take_role {
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
        vm.drain_at_close();
    })
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
        let vm = Vm::leaked();
        let worker = spawn_worker(vm, variant == Variant::PlantedTakeRoleWithoutFence);

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
            if vm.push(id) {
                let _ = vm.notifier.notify();
            }
        }
        vm.wait_ran(JOBS);
        caller.join().unwrap();
        assert_eq!(
            vm.log(),
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

// ---- a wake left to the waiting caller ----------------------------------------------

/// How many times the deferred-wake model's caller looks before it blocks.
const LOOKS: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Deferred {
    Sound,
    /// Planted: the caller blocks without withdrawing its offer.
    PlantedNoWithdraw,
    /// Planted: the pusher skips the wake on a plain load of the caller's offer.
    PlantedSkipByLoad,
}

fn deferred_model(variant: Deferred) {
    loom::model(move || {
        let vm = Vm::leaked();
        let worker = spawn_worker(vm, false);
        let read_ran = || vm.ran.load(Ordering::Acquire) >= 1;

        // The engine (`ThreadCtx::submit`): the caller's read, then an ordinary job.
        let engine = loom::thread::spawn(move || {
            if vm.push(0) {
                let skip = if variant == Deferred::PlantedSkipByLoad {
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
            if read_ran() {
                break;
            }
            if let Some(mut consumer) = vm.queue.try_consume() {
                while !read_ran() {
                    match consumer.try_pop() {
                        Pop::Item(j) => vm.run(j),
                        _ => break,
                    }
                }
                ivm_std::let_go(consumer, &vm.notifier);
            }
            loom::thread::yield_now();
        }
        if !read_ran() {
            if variant != Deferred::PlantedNoWithdraw && ivm_std::withdraw_defer(&vm.status) {
                let _ = vm.notifier.notify();
            }
            vm.wait_ran(1);
        }
        engine.join().unwrap();
        // Both jobs run, by whoever: the worker is woken for what the caller left.
        vm.finish(worker);
    });
}

#[test]
fn a_skipped_wake_is_paid_by_the_waiting_caller() {
    deferred_model(Deferred::Sound);
}

/// A caller that blocks without withdrawing its offer: a push that skipped the wake for it
/// leaves the read queued to a sleeping worker. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_block_without_withdrawing() {
    deferred_model(Deferred::PlantedNoWithdraw);
}

/// A pusher that decides on a plain load of the caller's offer: the caller may withdraw
/// after the load, find no skipped wake recorded, and block; nobody wakes the worker.
/// Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_skip_by_load() {
    deferred_model(Deferred::PlantedSkipByLoad);
}

// ---- a worker that hands its queue to the waiting caller ----------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Handed {
    Sound,
    /// Planted: the worker reads the count with a plain load.
    PlantedCountByLoad,
    /// Planted: the worker sleeps after its offer without reading the count.
    PlantedHandOverBlindly,
    /// Planted: the caller blocks without counting itself out.
    PlantedNoLeave,
}

/// The third model (`model/hand_over.rs`): both jobs are queued; the worker runs the
/// first, and, with a caller counted as waiting and the second still queued, hands its
/// queue over (`HandOver::hand_over`) and sleeps unless nobody waits any more. The caller
/// (`sync_access::wait_small`) counts itself in, looks once —
/// taking the role if it can (`HandOver::taken`), running the queue up to the second
/// job, letting go (`let_go`) — then counts itself out (`HandOver::leave`) and blocks
/// until the second job ran. Both jobs must run once, in order, with no lost wake; each
/// planted bug must be caught as a deadlock.
fn hand_over_model(variant: Handed) {
    // Three preemptions, whatever `LOOM_MAX_PREEMPTIONS` says: the lost wakes need a
    // worker preempted between its run and its offer and a caller preempted between its
    // look and its count-out; the model is small enough to explore them all in seconds.
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let vm = Vm::leaked();
        let hand: &'static ivm_std::HandOver = Box::leak(Box::new(ivm_std::HandOver::new()));
        vm.push(0);
        vm.push(1);
        let worker = loom::thread::spawn(move || {
            let mut handed = false;
            loop {
                let Some(mut consumer) = ivm_std::take_role(&vm.queue) else {
                    match vm.notifier.wait_and_clear() {
                        Ok(()) => continue,
                        Err(_closed) => break,
                    }
                };
                let mut hand_now = false;
                loop {
                    match consumer.try_pop() {
                        Pop::Item(j) => {
                            vm.run(j);
                            if !handed && hand.has_waiters() && !vm.queue.is_empty() {
                                hand_now = true;
                                break;
                            }
                        }
                        Pop::Empty => break,
                        Pop::Inconsistent => loom::thread::yield_now(),
                    }
                }
                if hand_now {
                    handed = true;
                    vm.notifier.clear();
                    let back = match variant {
                        Handed::PlantedHandOverBlindly => hand.planted_hand_over_blindly(consumer),
                        Handed::PlantedCountByLoad => hand.planted_hand_over_by_load(consumer),
                        _ => hand.hand_over(consumer),
                    };
                    if back {
                        continue;
                    }
                } else {
                    drop(consumer);
                }
                if vm.notifier.wait_and_clear().is_err() {
                    break;
                }
            }
            vm.drain_at_close();
        });

        let second_ran = || vm.ran.load(Ordering::Acquire) >= JOBS;
        hand.enter();
        // One look: a caller that gives up while the worker still runs is the case the
        // count-out is for, and it stays within the CI's preemption bound.
        for _ in 0..1 {
            if second_ran() {
                break;
            }
            if let Some(mut consumer) = vm.queue.try_consume() {
                hand.taken();
                while !second_ran() {
                    match consumer.try_pop() {
                        Pop::Item(j) => vm.run(j),
                        _ => break,
                    }
                }
                ivm_std::let_go(consumer, &vm.notifier);
            }
            loom::thread::yield_now();
        }
        if variant != Handed::PlantedNoLeave {
            hand.leave(&vm.notifier);
        }
        vm.finish(worker);
    });
}

#[test]
fn a_handed_over_queue_is_run_by_the_caller_or_the_woken_worker() {
    hand_over_model(Handed::Sound);
}

/// A worker that reads the count with a plain load: it may read a count the last caller
/// already left, while that caller's swap came before the offer. Loom must find the
/// deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_count_read_by_a_load() {
    hand_over_model(Handed::PlantedCountByLoad);
}

/// A worker that sleeps after its offer without reading the count: the caller may have
/// counted itself out before the offer. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_hand_over_blindly() {
    hand_over_model(Handed::PlantedHandOverBlindly);
}

/// A caller that blocks without counting itself out: the worker that handed its queue
/// over sleeps with the second job queued. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_caller_blocks_without_leaving() {
    hand_over_model(Handed::PlantedNoLeave);
}

// ---- a worker that wakes itself ------------------------------------------------------

/// The fourth model (`model/thread_ctx.rs`, "A worker that wakes itself"): an idle worker
/// that shares its CPU dozes — offers its deadline (`doze`), sleeps with one (under loom a
/// timed wait ends at once), ends the doze (`wake_from_doze`), takes the role, drains — and
/// then, no longer contended, lets go and sleeps without a deadline. The engine pushes one
/// job and, on the empty edge, leaves the wake to the deadline when
/// `leave_wake_to_deadline` says the worker dozes, else notifies. The job must run; a
/// pusher that decides on a plain load must be caught as a deadlock.
fn doze_model(planted_load: bool) {
    loom::model(move || {
        let vm = Vm::leaked();
        let dozing: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
        let worker = loom::thread::spawn(move || {
            let mut doze = true;
            loop {
                if doze {
                    ivm_std::doze(dozing);
                    let deadline = <LoomWait as ivm_core::wait::Wait>::now();
                    let r = vm.notifier.timed_wait_and_clear(deadline);
                    ivm_std::wake_from_doze(dozing);
                    if r.is_err() {
                        break;
                    }
                    doze = false;
                }
                if let Some(mut consumer) = ivm_std::take_role(&vm.queue) {
                    consumer.drain_until_empty(|j| vm.run(j));
                }
                if vm.notifier.wait_and_clear().is_err() {
                    break;
                }
            }
            vm.drain_at_close();
        });
        if vm.push(0) {
            let skip = if planted_load {
                ivm_std::planted_leave_wake_by_load(dozing)
            } else {
                ivm_std::leave_wake_to_deadline(dozing)
            };
            if !skip {
                let _ = vm.notifier.notify();
            }
        }
        vm.wait_ran(1);
        vm.notifier.close();
        worker.join().unwrap();
    });
}

#[test]
fn a_wake_left_to_a_dozing_workers_deadline_is_never_lost() {
    doze_model(false);
}

/// A pusher that decides on a plain load of the doze flag: it may read a doze that already
/// ended, whose drain missed the push; the worker then sleeps without a deadline and
/// nobody wakes it. Loom must find the deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_leave_wake_by_load() {
    doze_model(true);
}

// ---- a caller that leaves the rest to the doze ---------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LeftTo {
    /// `let_go_to_doze` as in the VM.
    Sound,
    /// Planted: the wake is left whether or not the worker dozes.
    PlantedAnySleep,
}

/// The fifth model (`worker::caller_runs`, `ThreadCtx::let_go_to_doze`): the engine queues
/// two jobs to a contended worker (its pushes leave the wake to a doze, or notify); the
/// worker dozes twice at most (under loom a timed wait ends at once), taking the role after
/// each doze and draining, and dozing again when a caller holds it (as `worker_loop` does
/// while contended), then sleeps without a deadline; a caller takes the role if it can,
/// runs the first job only (its wait is over) and lets go leaving the rest to the doze.
/// Both jobs must run once, in order; the planted bug must be caught as a deadlock. (A
/// caller that reads the doze flag with a plain load is not caught at this bound: the
/// role's SeqCst fences already order that read after a doze end whose look at the role
/// failed. The read-modify-write is kept: it is the pushes' protocol, `leave_wake_to_deadline`.)
fn left_to_doze_model(variant: LeftTo) {
    loom::model(move || {
        let vm = Vm::leaked();
        let dozing: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
        let worker = loom::thread::spawn(move || {
            let mut dozes = 2;
            loop {
                if dozes > 0 {
                    dozes -= 1;
                    ivm_std::doze(dozing);
                    let deadline = <LoomWait as ivm_core::wait::Wait>::now();
                    let r = vm.notifier.timed_wait_and_clear(deadline);
                    ivm_std::wake_from_doze(dozing);
                    if r.is_err() {
                        break;
                    }
                } else if vm.notifier.wait_and_clear().is_err() {
                    break;
                }
                if let Some(mut consumer) = ivm_std::take_role(&vm.queue) {
                    consumer.drain_until_empty(|j| vm.run(j));
                }
            }
            vm.drain_at_close();
        });
        for id in 0..JOBS {
            if vm.push(id) && !ivm_std::leave_wake_to_deadline(dozing) {
                let _ = vm.notifier.notify();
            }
        }
        let caller = loom::thread::spawn(move || {
            if let Some(mut consumer) = vm.queue.try_consume() {
                if let Some(job) = consumer.try_pop().item() {
                    vm.run(job);
                }
                match variant {
                    LeftTo::Sound => ivm_std::let_go_to_doze(consumer, dozing, &vm.notifier),
                    LeftTo::PlantedAnySleep => ivm_std::planted_let_go_to_any_sleep(consumer),
                }
            }
        });
        caller.join().unwrap();
        vm.finish(worker);
    });
}

#[test]
fn the_rest_left_to_a_dozing_workers_deadline_is_never_lost() {
    left_to_doze_model(LeftTo::Sound);
}

/// A caller that leaves the rest whether or not the worker dozes: the worker that found
/// the role taken after its last doze sleeps without a deadline. Loom must find the
/// deadlock.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_let_go_to_any_sleep() {
    left_to_doze_model(LeftTo::PlantedAnySleep);
}
