//! Loom model of the `Helping` protocol of `engine/helping.rs` at small scale, with the VM's own
//! engine token (`ivm_std::EngineToken`) and helper count (`ivm_std::Helpers`, both hidden,
//! `cfg(loom)` only) in the order of operations of `worker.rs`'s `run` closure,
//! `helping::Owed` and `helping::Helping`:
//!
//! * worker: finishes a job (writes its data, DONE Release), then leaves the release to a
//!   helper: `EngineToken::mark` and owes a drive if nobody held the engine (`Owed::mark`; in the
//!   `WorkerDecides` variant only if `Helpers::spinning`, else it drives itself through
//!   `acquire_or_mark` as `VmShared::completed` does). Before it runs its next instruction
//!   it settles (`Owed::settle(&shared, !shared.helper_spinning())`): the debt is gone if
//!   the word no longer reads "dirty, unlocked"; else it pays (`try_lock`, drive) unless a
//!   helper spins. Then it "runs the next instruction" for ever: it never settles again;
//! * helper (a caller in `spin_while_progress`): `enter`s, polls the word a bounded number
//!   of times and drives whenever it reads "dirty, unlocked" (`Helping::poll`), then
//!   `leave`s and polls once more (`Helping`'s drop).
//!
//! A drive (`VmShared::drive_as`) steps the engine until it makes no progress — a step
//! releases the job once it reads DONE (Acquire) and reads its data — then `unlock`s,
//! driving again while the unlock fails (a mark came meanwhile). The engine's state is a
//! loom `UnsafeCell`: two threads driving at once would be a reported race. Every
//! interleaving must release the job exactly once and end with the word clean and
//! unlocked: no mark is left with nobody to drive it. This is the store-buffering
//! argument of `Helping`'s docs (two RMWs, each followed by a SeqCst fence and a load of
//! the other thread's word); loom models `fence(SeqCst)` and lets a Relaxed or Acquire
//! load read a store that is not yet visible to it (stale values), so the planted models
//! without either fence must fail.
//!
//! A submitting caller (`helping::Helping::submitting`, registered from its push to its drive) uses
//! a second `Helpers` count with the same protocol: it enters, drives once (its push, a
//! poll), leaves and polls once more. `helpers_submitter_grace` runs the worker's actual
//! rule with both counts: before its next instruction it keeps the debt if a helper spins
//! or (once: the debt's grace) a submitter is registered, else pays; before the
//! instruction after that, only a spinning helper lets it keep the debt. That bound is
//! checked too: once the worker has settled without grace, the word must not read "dirty,
//! unlocked" (the release is done, or held by a thread that will do it).
//! `planted_grace_never_used_up` keeps the debt whenever a submitter is registered, and
//! loom must find the release left waiting past the grace.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_helpers`.
#![cfg(loom)]

use ivm_core::sync::{AtomicBool, Ordering, UnsafeCell};
use ivm_std::{EngineToken, Helpers};

/// What the engine owns: whether the job is lively (dispatched, unreleased), and the
/// release count.
struct Engine {
    lively: bool,
    released: usize,
}

struct Vm {
    wake: EngineToken,
    helpers: Helpers,
    /// Submitting callers (`Variant::SubmitterGrace` registers the caller here).
    submitters: Helpers,
    engine: UnsafeCell<Engine>,
    /// The job's output, written by the worker before its Release DONE.
    data: UnsafeCell<u32>,
    done: AtomicBool,
    /// Set by the worker when its debt outlived its grace (the submitter variants).
    late: AtomicBool,
}

// SAFETY: `engine` is touched only by the holder of the token in `wake`, `data` by the
// worker before DONE and by the engine after reading DONE (loom reports a race otherwise:
// that is what the model checks).
unsafe impl Sync for Vm {}
// SAFETY: as above.
unsafe impl Send for Vm {}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// The worker always marks and owes (covers a helper that registers after the mark).
    WorkerMarks,
    /// The worker marks only if it sees a helper, else it drives (`worker.rs`).
    WorkerDecides,
    /// Planted: the helper leaves without the SeqCst fence.
    PlantedLeaveWithoutFence,
    /// Planted: the worker reads the helper count without the SeqCst fence.
    PlantedSpinningWithoutFence,
    /// The caller is a submitter, not a helper; the worker applies its grace rule.
    SubmitterGrace,
    /// Planted: as `SubmitterGrace`, but the grace is never used up (the worker keeps
    /// the debt whenever a submitter is registered).
    PlantedGraceNeverUsedUp,
}

impl Variant {
    /// The caller is a submitting caller (registered in `submitters`).
    fn submitter(self) -> bool {
        matches!(
            self,
            Variant::SubmitterGrace | Variant::PlantedGraceNeverUsedUp
        )
    }
}

impl Vm {
    /// The worker's view of `Helpers::spinning` (or the planted one).
    fn spinning(&self, variant: Variant) -> bool {
        if variant == Variant::PlantedSpinningWithoutFence {
            self.helpers.planted_spinning_without_fence()
        } else {
            self.helpers.spinning()
        }
    }

    /// The helper's `Helpers::leave` (or the planted one).
    fn leave(&self, variant: Variant) {
        if variant == Variant::PlantedLeaveWithoutFence {
            self.helpers.planted_leave_without_fence();
        } else {
            self.helpers.leave();
        }
    }

    /// One engine step by the token holder; returns whether anything changed.
    fn step(&self) -> bool {
        // SAFETY: the caller holds the engine token (loom checks it through the cell).
        self.engine.with_mut(|e| {
            let e = unsafe { &mut *e };
            // Acquire: pairs with the worker's Release DONE.
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

    /// A drive (`VmShared::drive_as`) by the token holder: step until no progress, let go
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

    /// `Helping::poll`: drive if the word reads "dirty, unlocked" (`VmShared::help`).
    fn poll(&self) {
        if self.wake.dirty_unlocked() && self.wake.try_lock() {
            self.drive();
        }
    }
}

fn model(polls: usize, variant: Variant) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let vm: &'static Vm = Box::leak(Box::new(Vm {
            wake: EngineToken::new(),
            helpers: Helpers::new(),
            submitters: Helpers::new(),
            engine: UnsafeCell::new(Engine {
                lively: true,
                released: 0,
            }),
            data: UnsafeCell::new(0),
            done: AtomicBool::new(false),
            late: AtomicBool::new(false),
        }));

        // The worker (`worker.rs` `run`): finishes the job, more instructions queued.
        let worker = loom::thread::spawn(move || {
            // SAFETY: the worker owns `data` until DONE.
            vm.data.with_mut(|p| unsafe { *p = 42 });
            // Release: publishes `data` to the engine's Acquire.
            vm.done.store(true, Ordering::Release);
            // `Owed::mark` (owes if nobody held the engine) or `VmShared::completed`.
            let owed = if variant == Variant::WorkerDecides && !vm.spinning(variant) {
                if vm.wake.acquire_or_mark() {
                    vm.drive();
                }
                false
            } else {
                vm.wake.mark()
            };
            if variant.submitter() {
                // `worker.rs` `run`, before each of the next two instructions: keep the
                // debt if a helper spins or, the first time only, a submitter is
                // registered; else `settle(true)`: gone if somebody took the engine after
                // the mark, else pay.
                let mut owed = owed;
                for grace in [true, false] {
                    let grace = grace || variant == Variant::PlantedGraceNeverUsedUp;
                    let kept = vm.helpers.spinning() || (grace && vm.submitters.spinning());
                    if owed && !kept {
                        owed = false;
                        if vm.wake.dirty_unlocked() && vm.wake.try_lock() {
                            vm.drive();
                        }
                    }
                    // Runs that instruction.
                }
                // The grace is over: the release must be done or held by somebody (no
                // helper spins in this variant, so nobody else would come for it soon).
                if vm.wake.dirty_unlocked() {
                    // Relaxed: read after the join (which orders it).
                    vm.late.store(true, Ordering::Relaxed);
                }
                return;
            }
            // Before the next instruction: `owed.settle(&shared, !shared.helper_spinning())`.
            if owed {
                let force = !vm.spinning(variant);
                // `Owed::settle`: the debt is gone once somebody took the engine after
                // the mark; else pay if forced or nobody helps (a non-patient debt).
                if vm.wake.dirty_unlocked()
                    && (force || !vm.spinning(variant))
                    && vm.wake.try_lock()
                {
                    vm.drive();
                }
            }
            // Runs the next instruction "for ever": never settles again.
        });

        // The helper (`helping::spin_while_progress`): registers, polls, leaves, polls. A
        // submitter (`helping::Helping::submitting`) the same on its own count.
        let count = if variant.submitter() {
            &vm.submitters
        } else {
            &vm.helpers
        };
        count.enter();
        for _ in 0..polls {
            vm.poll();
        }
        if variant.submitter() {
            count.leave();
        } else {
            vm.leave(variant);
        }
        vm.poll();

        worker.join().unwrap();
        // Relaxed: the join orders the worker's store before this load.
        assert!(
            !vm.late.load(Ordering::Relaxed),
            "a release outlived its grace"
        );
        // SAFETY: both threads are joined; nobody holds the engine (checked below).
        let released = vm.engine.with(|e| unsafe { (*e).released });
        assert_eq!(released, 1, "released exactly once");
        assert!(!vm.wake.dirty_unlocked(), "no mark left undriven");
        assert!(vm.wake.try_lock(), "the engine was let go");
    });
}

#[test]
fn helpers_helper_polls() {
    model(2, Variant::WorkerMarks);
}

#[test]
fn helpers_helper_leaves_without_polling() {
    model(0, Variant::WorkerMarks);
}

/// A submitter: registered, drives once (its push), leaves, polls once more; the worker
/// keeps the debt past one instruction at most, by its grace rule.
#[test]
fn helpers_submitter_grace() {
    model(1, Variant::SubmitterGrace);
}

/// A submitter that leaves without driving in between (its push found the engine held).
#[test]
fn helpers_submitter_grace_no_drive() {
    model(0, Variant::SubmitterGrace);
}

#[test]
fn helpers_worker_decides() {
    model(1, Variant::WorkerDecides);
}

/// A helper that leaves without the fence may read the word before the worker's mark
/// while the worker read the count before the decrement: the mark is left undriven.
/// Loom must find it.
#[test]
#[should_panic(expected = "released exactly once")]
fn planted_leave_without_fence() {
    model(0, Variant::PlantedLeaveWithoutFence);
}

/// A worker that reads the helper count without the fence: its mark is not ordered before
/// the helper's fence, so it may see the helper registered while the leaving helper's
/// poll still reads the word without the mark. Loom must find it.
#[test]
#[should_panic(expected = "released exactly once")]
fn planted_spinning_without_fence() {
    model(0, Variant::PlantedSpinningWithoutFence);
}

/// A worker that keeps its debt whenever a submitter is registered, not once: the release
/// may wait past the one kernel the grace allows (here, until the submitter's last
/// poll). Loom must find it.
#[test]
#[should_panic(expected = "a release outlived its grace")]
fn planted_grace_never_used_up() {
    model(1, Variant::PlantedGraceNeverUsedUp);
}
