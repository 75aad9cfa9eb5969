//! Loom model of the VM's wake path at small scale, with the VM's own engine token
//! (`ivm_std::EngineToken`, hidden, `cfg(loom)` only) and the same ivm-core building blocks and
//! order of operations as `drive.rs` / `scheduler.rs` / `worker.rs` / `sync_access.rs`:
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
use ivm_core::sync::{AtomicBool, Ordering, UnsafeCell};
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
}

/// One engine step by the token holder; returns whether anything changed.
fn step(vm: &Vm) -> bool {
    // SAFETY: the caller holds the engine token (loom checks it through the cell).
    vm.engine.with_mut(|e| {
        let e = unsafe { &mut *e };
        let mut progress = false;
        let mut consumer = vm.pending.consume();
        // Inconsistent needs no retry: the producer marks after its push (drive.rs).
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
/// the scheduler at shutdown.
fn drive(vm: &Vm, variant: Variant) {
    loop {
        let progress = step(vm);
        if vm.stop.load(Ordering::Acquire) {
            vm.wake.unlock_to_scheduler();
            return;
        }
        if progress {
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
    loom::model(move || {
        let vm = Arc::new(Vm {
            pending: MpscQueue::new(),
            wake: EngineToken::new(),
            engine: UnsafeCell::new(Engine::default()),
            worker_q: MpscQueue::new(),
            worker_n: Notifier::new(),
            released_n: Notifier::new(),
            stop: AtomicBool::new(false),
        });
        let job = Arc::new(Job {
            pending: mpsc::Links::new(),
            worker: mpsc::Links::new(),
            data: UnsafeCell::new(0),
            done: AtomicBool::new(false),
            btb: BlockingThenBusy::new(),
        });

        // The scheduler thread (`scheduler.rs`).
        let v = vm.clone();
        let scheduler = loom::thread::spawn(move || {
            loop {
                if v.wake.try_lock() {
                    let exit = loop {
                        if step(&v) {
                            continue;
                        }
                        if v.stop.load(Ordering::Acquire) && released(&v) == 1 {
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
        });

        // The worker thread (`worker.rs`): one instruction, then exit.
        let v = vm.clone();
        let worker = loom::thread::spawn(move || {
            let mut consumer = v.worker_q.consume();
            loop {
                let mut ran = false;
                let end = consumer.drain(|j| {
                    let _ = j.btb.notify();
                    // SAFETY: the worker owns `data` between dispatch and DONE.
                    j.data.with_mut(|p| unsafe { *p = 42 });
                    // Release: publishes `data` to the engine's Acquire.
                    j.done.store(true, Ordering::Release);
                    j.btb.decrease();
                    drop(j);
                    match variant {
                        Variant::WorkerDrives | Variant::PlantedUnlockIgnoresMark => {
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
                    ran = true;
                });
                if ran {
                    break;
                }
                if !end.may_sleep() {
                    ivm_core::sync::spin_loop();
                    continue;
                }
                v.worker_n.wait_and_clear().unwrap();
            }
        });

        // The caller (`shared.rs` receive + `drive.rs` after_push + `sync_access.rs`).
        vm.pending.push(job.clone());
        if vm.wake.acquire_or_mark() {
            drive(&vm, variant);
        }
        if skip {
            job.btb.skip_blocking();
        }
        job.btb.wait_until_done(Duration::MAX, || false).unwrap();
        // SAFETY: the wait acquired the worker's Release decrease.
        assert_eq!(job.data.with(|p| unsafe { *p }), 42);
        // The engine releases it without further input.
        vm.released_n.wait_and_clear().unwrap();
        // Shutdown (`vm/mod.rs`): stop, then unpark (marks the word).
        vm.stop.store(true, Ordering::Release);
        vm.wake.unpark();
        worker.join().unwrap();
        scheduler.join().unwrap();
        // The scheduler exited holding the token after the release; read it through the
        // cell (joins order everything before us).
        assert_eq!(released(&vm), 1, "released exactly once");
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
