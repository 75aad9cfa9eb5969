//! Loom model of the VM's wake path at small scale, with the VM's own engine token
//! (`ivm_std::EngineToken`, hidden, `cfg(loom)` only) and the same ivm-core building blocks and
//! order of operations as `engine/drive/` / `scheduler.rs` / `worker.rs` / `sync_access.rs`:
//!
//! * caller: pushes its instruction to the pending queue, then `acquire_or_mark`: if it got
//!   the engine it drives it (drain pending, dispatch to the worker queue with a notify on
//!   the empty edge, release what is DONE, `unlock` until clean); then (optionally)
//!   notify-skip, waits on the instruction's BTB and reads the result;
//! * worker: runs the instruction (BTB notify, write, DONE Release, BTB decrease), then
//!   `acquire_or_mark` and drives when it got the engine — or, in the device variant, only
//!   `unpark()`s (as a device completion callback does);
//! * scheduler: the driver of last resort: `try_lock` and drive; park through `Parking`
//!   re-checking "input marked on an engine nobody holds"; at shutdown it exits once the
//!   instruction is released.
//!
//! The engine's state is a loom `UnsafeCell`: two threads driving at once would be a
//! reported race. Every interleaving must release the instruction exactly once, let the
//! caller see the worker's data, and terminate (no lost wake-up, no lost input).
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_wake_path`.
#![cfg(loom)]

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use ivm_core::LoomWait;
use ivm_core::btb::BlockingThenBusy;
use ivm_core::mpsc::{self, MpscQueue};
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering, UnsafeCell};
use ivm_std::EngineToken;

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

/// What the engine owns: lively (dispatched, unreleased) jobs and the release count.
#[derive(Default)]
struct Engine {
    lively: Vec<Arc<Job>>,
    released: usize,
}

struct Vm {
    pending: MpscQueue<Job, P>,
    wake: EngineToken,
    engine: UnsafeCell<Engine>,
    worker_q: MpscQueue<Job, W>,
    worker_n: Notifier<LoomWait>,
    /// Notified by the driver that released the instruction (the model's observer: the
    /// release must happen without any later input, such as shutdown, nudging the engine).
    released_n: Notifier<LoomWait>,
    /// Releases so far, for the observer (the engine's own count is read at the end).
    released_cnt: AtomicUsize,
    stop: AtomicBool,
}

// SAFETY: `engine` is touched only by the holder of the token in `wake` (loom reports a
// race otherwise: that is what the model checks).
unsafe impl Sync for Vm {}
// SAFETY: as above.
unsafe impl Send for Vm {}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// The worker drives after its completion (`acquire_or_mark`).
    WorkerDrives,
    /// The worker only `unpark()`s (a device completion callback).
    DeviceCompletion,
    /// The worker leaves the release to the caller (`helping::Owed`): marks the word, and
    /// drives only if nobody took the engine after its mark.
    WorkerDefers,
    /// Planted: the worker neither marks nor unparks after its completion.
    PlantedNoMark,
    /// Planted: drivers let go of the engine ignoring marks left meanwhile.
    PlantedUnlockIgnoresMark,
    /// The caller submits a second job and waits for the engine to be handed over
    /// (`acquire_or_want`); drivers hand over at step boundaries (`hand_over`).
    CallerWants,
    /// Planted: as `CallerWants`, but the caller gives up without withdrawing its want.
    PlantedWantWithoutWithdraw,
    /// Planted: as `CallerWants`, but the hand-over is Relaxed.
    PlantedHandOverRelaxed,
}

impl Variant {
    /// Jobs the caller submits.
    fn jobs(self) -> usize {
        match self {
            Variant::CallerWants
            | Variant::PlantedWantWithoutWithdraw
            | Variant::PlantedHandOverRelaxed => 2,
            _ => 1,
        }
    }

    /// The caller's submission (`VmCore::after_push`): takes the engine, or marks it (and
    /// in the hand-over variants waits a little for the holder to hand it over). Whether
    /// it got the engine.
    fn submit(self, vm: &Vm) -> bool {
        // One look, then give up (the real caller: a few microseconds).
        let mut looks = 0;
        let keep_waiting = move || {
            looks += 1;
            looks <= 1
        };
        match self {
            Variant::CallerWants | Variant::PlantedHandOverRelaxed => {
                vm.wake.acquire_or_want(keep_waiting)
            }
            Variant::PlantedWantWithoutWithdraw => vm
                .wake
                .planted_acquire_or_want_without_withdraw(keep_waiting),
            _ => vm.wake.acquire_or_mark(),
        }
    }
}

/// One engine step by the token holder; returns whether anything changed.
fn step(vm: &Vm) -> bool {
    // SAFETY: the caller holds the engine token (loom checks it through the cell).
    vm.engine.with_mut(|e| {
        let e = unsafe { &mut *e };
        let mut progress = false;
        let mut consumer = vm.pending.consume();
        // Inconsistent needs no retry: the producer marks after its push (engine/drive/token.rs).
        let _ = consumer.drain(|j| {
            progress = true;
            e.lively.push(j.clone());
            if vm.worker_q.push(j) {
                let _ = vm.worker_n.notify();
            }
        });
        drop(consumer);
        let before = e.lively.len();
        // Acquire: pairs with the worker's Release DONE.
        e.lively.retain(|j| !j.done.load(Ordering::Acquire));
        if before != e.lively.len() {
            e.released += before - e.lively.len();
            // Release: nothing is read through it but the count itself.
            vm.released_cnt
                .fetch_add(before - e.lively.len(), Ordering::Release);
            let _ = vm.released_n.notify();
        }
        progress | (before != e.lively.len())
    })
}

fn released(vm: &Vm) -> usize {
    // SAFETY: the caller holds the engine token.
    vm.engine.with(|e| unsafe { (*e).released })
}

/// A caller's or worker's drive (`VmShared::drive_as`): step until clean, hand over to
/// the scheduler at shutdown, or to a caller that wants the engine after a step.
fn drive(vm: &Vm, variant: Variant) {
    loop {
        let progress = step(vm);
        if vm.stop.load(Ordering::Acquire) {
            vm.wake.unlock_to_scheduler();
            return;
        }
        if progress {
            let handed = if variant == Variant::PlantedHandOverRelaxed {
                vm.wake.planted_hand_over_relaxed()
            } else {
                vm.wake.hand_over()
            };
            if handed {
                return;
            }
            continue;
        }
        let unlocked = if variant == Variant::PlantedUnlockIgnoresMark {
            vm.wake.planted_unlock_ignoring_marks()
        } else {
            vm.wake.unlock()
        };
        if unlocked {
            return;
        }
    }
}

fn model(skip: bool, variant: Variant) {
    let mut builder = loom::model::Builder::new();
    if variant.jobs() == 2 {
        // The hand-over bugs need three preemptions (the caller gives up between the
        // worker's drain and its look for a want); without the scheduler thread that
        // stays small (seconds).
        builder.preemption_bound = Some(3);
    }
    builder.check(move || {
        // Dropped by hand at the end: when loom reports a planted bug (a panic in this
        // thread), the VM may still hold queued jobs, whose loom objects must not be
        // dropped while the execution unwinds (a panic in a destructor aborts).
        let vm = std::mem::ManuallyDrop::new(Arc::new(Vm {
            pending: MpscQueue::new(),
            wake: EngineToken::new(),
            engine: UnsafeCell::new(Engine::default()),
            worker_q: MpscQueue::new(),
            worker_n: Notifier::new(),
            released_n: Notifier::new(),
            released_cnt: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }));
        let jobs = variant.jobs();
        let new_job = || {
            Arc::new(Job {
                pending: mpsc::Links::new(),
                worker: mpsc::Links::new(),
                data: UnsafeCell::new(0),
                done: AtomicBool::new(false),
                btb: BlockingThenBusy::new(),
            })
        };
        let job = new_job();

        // The scheduler thread (`scheduler.rs`). Not in the hand-over variants, to keep
        // their state space small: there only the caller and the worker drive (no device
        // completion, no shutdown hand-over), so a lost input is a deadlock all the same.
        let v = Arc::clone(&vm);
        let scheduler = (jobs == 1).then(|| {
            loom::thread::spawn(move || {
                loop {
                    if v.wake.try_lock() {
                        let exit = loop {
                            if step(&v) {
                                continue;
                            }
                            if v.stop.load(Ordering::Acquire) && released(&v) == jobs {
                                break true;
                            }
                            if v.wake.unlock() {
                                break false;
                            }
                        };
                        if exit {
                            return; // keeps the token
                        }
                    }
                    let _ = v.wake.park(|| v.wake.dirty_unlocked(), None);
                }
            })
        });

        // The worker thread (`worker.rs`): `jobs` instructions, then exit.
        let v = Arc::clone(&vm);
        let worker = loom::thread::spawn(move || {
            // Dropped by hand (its drop lets go of the consumer role, a loom store, which
            // must not run while loom unwinds a reported deadlock).
            let mut consumer = std::mem::ManuallyDrop::new(v.worker_q.consume());
            let mut ran = 0;
            loop {
                let end = consumer.drain(|j| {
                    let _ = j.btb.notify();
                    // SAFETY: the worker owns `data` between dispatch and DONE.
                    j.data.with_mut(|p| unsafe { *p = 42 });
                    // Release: publishes `data` to the engine's Acquire.
                    j.done.store(true, Ordering::Release);
                    j.btb.decrease();
                    drop(j);
                    match variant {
                        Variant::WorkerDrives
                        | Variant::PlantedUnlockIgnoresMark
                        | Variant::CallerWants
                        | Variant::PlantedWantWithoutWithdraw
                        | Variant::PlantedHandOverRelaxed => {
                            if v.wake.acquire_or_mark() {
                                drive(&v, variant);
                            }
                        }
                        Variant::DeviceCompletion => {
                            v.wake.unpark();
                        }
                        Variant::WorkerDefers => {
                            if v.wake.mark() {
                                // Owed: give the caller a chance, then settle (the real
                                // worker: after `RELEASE_DEFER`, or before it sleeps).
                                loom::thread::yield_now();
                                if v.wake.dirty_unlocked() && v.wake.try_lock() {
                                    drive(&v, variant);
                                }
                            }
                        }
                        Variant::PlantedNoMark => {}
                    }
                    ran += 1;
                });
                if ran == jobs {
                    break;
                }
                if !end.may_sleep() {
                    ivm_core::sync::spin_loop();
                    continue;
                }
                v.worker_n.wait_and_clear().unwrap();
            }
            drop(std::mem::ManuallyDrop::into_inner(consumer));
        });

        // The caller (`shared.rs` receive + `engine/drive/` after_push + `sync_access.rs`).
        vm.pending.push(job.clone());
        if variant.submit(&vm) {
            drive(&vm, variant);
        }
        // Dropped by hand at the end, as `vm`.
        let mut waited = std::mem::ManuallyDrop::new(vec![job]);
        if jobs == 2 {
            // A second submission, while the worker may be driving after the first.
            let second = new_job();
            vm.pending.push(second.clone());
            if variant.submit(&vm) {
                drive(&vm, variant);
            }
            waited.push(second);
        }
        for job in waited.iter() {
            if skip {
                job.btb.skip_blocking();
            }
            job.btb.wait_until_done(Duration::MAX, || false).unwrap();
            // SAFETY: the wait acquired the worker's Release decrease.
            assert_eq!(job.data.with(|p| unsafe { *p }), 42);
        }
        // The engine releases them without further input.
        while vm.released_cnt.load(Ordering::Acquire) < jobs {
            vm.released_n.wait_and_clear().unwrap();
        }
        if let Some(scheduler) = scheduler {
            // Shutdown (`vm/lifecycle.rs`): stop, then unpark (marks the word).
            vm.stop.store(true, Ordering::Release);
            vm.wake.unpark();
            worker.join().unwrap();
            scheduler.join().unwrap();
            // The scheduler exited holding the token after the release; read it through
            // the cell (joins order everything before us).
        } else {
            worker.join().unwrap();
            // Every driver let go of the engine (a hand-over nobody took would leave it
            // unlocked but never drained: the wait above would have deadlocked).
            assert!(vm.wake.try_lock(), "the engine was let go");
        }
        assert_eq!(released(&vm), jobs, "released exactly once");
        drop(std::mem::ManuallyDrop::into_inner(waited));
        drop(std::mem::ManuallyDrop::into_inner(vm));
    });
}

#[test]
fn wake_path_blocking() {
    model(false, Variant::WorkerDrives);
}

#[test]
fn wake_path_notify_skip() {
    model(true, Variant::WorkerDrives);
}

#[test]
fn wake_path_worker_defers_release() {
    model(false, Variant::WorkerDefers);
}

#[test]
fn wake_path_device_completion() {
    model(false, Variant::DeviceCompletion);
}

/// A completion that neither marks the engine nor unparks the scheduler: every driver may
/// let go before the instruction is DONE and nobody is told, so it is never released.
/// Loom must find it.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_completion_without_mark() {
    model(false, Variant::PlantedNoMark);
}

/// Drivers that let go of the engine with a plain store, dropping a mark left while they
/// held it: a completion marked during the caller's drive is lost. Loom must find it.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_unlock_ignoring_marks() {
    model(false, Variant::PlantedUnlockIgnoresMark);
}

/// A caller that submits again while a worker drives, and waits for the worker to hand
/// the engine over (`acquire_or_want` / `hand_over`): nothing lost, one driver at a time.
#[test]
fn wake_path_caller_wants() {
    model(false, Variant::CallerWants);
}

/// A caller that gives up waiting for the hand-over without withdrawing its want: the
/// holder hands the engine to nobody and the second job is never dispatched. Loom must
/// find it.
#[test]
#[should_panic(expected = "deadlock")]
fn planted_want_without_withdraw() {
    model(false, Variant::PlantedWantWithoutWithdraw);
}

/// A Relaxed hand-over: the caller that takes the engine does not see what the worker
/// did to it (a race on the engine's cell). Loom must find it.
#[test]
#[should_panic]
fn planted_hand_over_relaxed() {
    model(false, Variant::PlantedHandOverRelaxed);
}
