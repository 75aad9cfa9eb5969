//! Loom model of the *unawaited* debt (`helping::Owed::leave_unless_awaited`), with the
//! VM's own engine token (`ivm_std::EngineToken`, hidden, `cfg(loom)` only) in the order
//! of operations of `worker.rs`'s `run` closure:
//!
//! * worker: finishes a job (writes its data, DONE Release), marks the word
//!   (`EngineToken::mark`, AcqRel), and if nobody held the engine reads the job's
//!   `AWAITED` bit and, after a SeqCst fence, the count of submitters waiting for
//!   backpressure (`VmCore::backpressured`). If either is set it pays (`try_lock`, drive);
//!   else it keeps the debt and "runs its next instruction for ever": it never settles.
//! * a second thread, one of two roles:
//!   * `Successor`: a submitter whose new instruction reads what the job wrote, on another
//!     stream. It takes the engine (`acquire_or_mark`) and, holding it, tells the
//!     dispatched job it is awaited (`Instruction::awaited`: a Relaxed `fetch_or` of the
//!     bit) and records the successor in the engine; its drive then releases the job if
//!     DONE is set (and with it readies the successor).
//!   * `Backpressure`: a submitter about to wait for backpressure (`wait_backpressure`):
//!     counts itself and fences (the VM's own `Backpressure::announce`), and drives if the
//!     word reads "dirty, unlocked"; it stays counted while it waits.
//!
//! Every interleaving must release the job exactly once and leave no mark undriven: a
//! debt the worker keeps must be one nothing waits for. Planted: the worker reads the bit
//! before its mark (`PlantedReadBeforeMark`: a holder may tell the job between the read
//! and the mark, see it not done, and let go), the backpressured submitter does not look
//! for a mark (`PlantedWaiterDoesNotLook`) or counts itself without the fence
//! (`PlantedWaiterNoFence`), the worker reads the count without the fence
//! (`PlantedNoFence`), or its mark is Release only (`PlantedMarkRelease`: it may miss the
//! bit the last holder set); loom must find the release left undone in each.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_awaited`.
#![cfg(loom)]

use ivm_core::sync::{AtomicBool, AtomicU32, Ordering, UnsafeCell};
use ivm_std::{Backpressure, EngineToken};

/// `status::AWAITED` of the job.
const AWAITED: u32 = 1;

/// What the engine owns: whether the job is lively (dispatched, unreleased), the release
/// count, and whether a successor waits for the job's release.
struct Engine {
    lively: bool,
    released: usize,
    successor: bool,
}

struct Vm {
    wake: EngineToken,
    engine: UnsafeCell<Engine>,
    /// The job's output, written by the worker before its Release DONE.
    data: UnsafeCell<u32>,
    done: AtomicBool,
    /// The job's status bits other than DONE (`AWAITED`).
    status: AtomicU32,
    /// Submitters waiting for backpressure (`VmCore::backpressure`).
    backpressure: Backpressure,
    /// The successor was pushed to the pending queue (not yet handled by the engine).
    pending: AtomicBool,
}

// SAFETY: `engine` is touched only by the holder of the token in `wake`, `data` by the
// worker before DONE and by the engine after reading DONE (loom reports a race otherwise:
// that is what the model checks).
unsafe impl Sync for Vm {}
// SAFETY: as above.
unsafe impl Send for Vm {}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Successor,
    Backpressure,
    PlantedReadBeforeMark,
    PlantedWaiterDoesNotLook,
    PlantedWaiterNoFence,
    PlantedNoFence,
    PlantedMarkRelease,
}

impl Vm {
    /// One engine step by the token holder; returns whether anything changed.
    fn step(&self) -> bool {
        // SAFETY: the caller holds the engine token (loom checks it through the cell).
        self.engine.with_mut(|e| {
            let e = unsafe { &mut *e };
            // Acquire: pairs with the worker's Release DONE.
            // Acquire: pairs with the submitter's Release store (its input).
            if !e.successor && self.pending.load(Ordering::Acquire) {
                self.add_successor(e);
                return true;
            }
            if e.lively && self.done.load(Ordering::Acquire) {
                // SAFETY: DONE was read with Acquire: the worker's write is visible.
                assert_eq!(self.data.with(|p| unsafe { *p }), 42);
                e.lively = false;
                e.released += 1;
                return true;
            }
            false
        })
    }

    /// A drive (`VmCore::drive_as`) by the token holder: step until no progress, let go
    /// unless a mark came meanwhile.
    fn drive(&self) {
        loop {
            if self.step() {
                continue;
            }
            if self.wake.unlock() {
                return;
            }
        }
    }

    /// The engine handles the successor (holding the token): an edge from the dispatched
    /// job, so the job is told it is awaited (`Engine::add_edge`).
    fn add_successor(&self, e: &mut Engine) {
        e.successor = true;
        if e.lively {
            // Relaxed: published by the holder's unlock (Release) to the worker's mark
            // (Acquire), as `Job::awaited`.
            self.status.fetch_or(AWAITED, Ordering::Relaxed);
        }
    }
}

fn model(variant: Variant) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let vm: &'static Vm = Box::leak(Box::new(Vm {
            wake: EngineToken::new(),
            engine: UnsafeCell::new(Engine {
                lively: true,
                released: 0,
                successor: false,
            }),
            data: UnsafeCell::new(0),
            done: AtomicBool::new(false),
            status: AtomicU32::new(0),
            backpressure: Backpressure::new(),
            pending: AtomicBool::new(false),
        }));

        // The worker (`worker.rs` `run`): finishes the job, more instructions queued,
        // long kernels: `Owed::leave_unless_awaited`.
        let worker = loom::thread::spawn(move || {
            // SAFETY: the worker owns `data` until DONE.
            vm.data.with_mut(|p| unsafe { *p = 42 });
            // Release: publishes `data` to the engine's Acquire.
            vm.done.store(true, Ordering::Release);
            let early = (variant == Variant::PlantedReadBeforeMark)
                .then(|| vm.status.load(Ordering::Relaxed) & AWAITED != 0);
            let marked = if variant == Variant::PlantedMarkRelease {
                vm.wake.planted_mark_release()
            } else {
                vm.wake.mark()
            };
            if !marked {
                // A holder drains the mark before it lets go.
                return;
            }
            // Relaxed: the mark's Acquire read the last holder's unlock.
            let awaited = early.unwrap_or_else(|| vm.status.load(Ordering::Relaxed) & AWAITED != 0);
            // `VmCore::backpressured`: a fence, then the count (store buffering with the
            // waiter's count and fence).
            let backpressured = if variant == Variant::PlantedNoFence {
                vm.backpressure.planted_waiting_without_fence()
            } else {
                vm.backpressure.waiting()
            };
            if (awaited || backpressured) && vm.wake.try_lock() {
                vm.drive();
            }
            // Else the debt is kept: the worker runs its next instruction "for ever".
        });

        // A backpressured submitter stays counted while it waits (until the end here).
        let mut waiting = None;
        match variant {
            Variant::Successor | Variant::PlantedReadBeforeMark | Variant::PlantedMarkRelease => {
                // A submission of the successor: push, then drive if nobody holds the
                // engine, else mark it for the holder (`after_push`).
                // Release: as the pending queue's push.
                vm.pending.store(true, Ordering::Release);
                if vm.wake.acquire_or_mark() {
                    vm.drive();
                }
            }
            Variant::Backpressure
            | Variant::PlantedWaiterDoesNotLook
            | Variant::PlantedWaiterNoFence
            | Variant::PlantedNoFence => {
                // `wait_backpressure`: count, fence, pay a debt marked before our count.
                waiting = Some(if variant == Variant::PlantedWaiterNoFence {
                    vm.backpressure.planted_announce_without_fence()
                } else {
                    vm.backpressure.announce()
                });
                if variant != Variant::PlantedWaiterDoesNotLook
                    && vm.wake.dirty_unlocked()
                    && vm.wake.try_lock()
                {
                    vm.drive();
                }
                // Then it waits for the release (not modelled: it only ends if the job
                // is released, checked below).
            }
        }

        worker.join().unwrap();
        drop(waiting);
        // SAFETY: both threads are joined; nobody holds the engine (checked below).
        let (released, successor) = vm
            .engine
            .with(|e| unsafe { ((*e).released, (*e).successor) });
        if matches!(
            variant,
            Variant::Successor | Variant::PlantedReadBeforeMark | Variant::PlantedMarkRelease
        ) {
            assert!(successor, "the successor was handled");
        }
        assert_eq!(released, 1, "released exactly once");
        assert!(!vm.wake.dirty_unlocked(), "no mark left undriven");
        assert!(vm.wake.try_lock(), "the engine was let go");
    });
}

#[test]
fn awaited_by_a_successor() {
    model(Variant::Successor);
}

#[test]
fn awaited_by_a_backpressured_submitter() {
    model(Variant::Backpressure);
}

#[test]
#[should_panic(expected = "released exactly once")]
fn planted_read_before_mark() {
    model(Variant::PlantedReadBeforeMark);
}

#[test]
#[should_panic(expected = "released exactly once")]
fn planted_waiter_does_not_look() {
    model(Variant::PlantedWaiterDoesNotLook);
}

#[test]
#[should_panic(expected = "released exactly once")]
fn planted_waiter_no_fence() {
    model(Variant::PlantedWaiterNoFence);
}

#[test]
#[should_panic(expected = "released exactly once")]
fn planted_no_fence() {
    model(Variant::PlantedNoFence);
}

#[test]
#[should_panic(expected = "released exactly once")]
fn planted_mark_release() {
    model(Variant::PlantedMarkRelease);
}
