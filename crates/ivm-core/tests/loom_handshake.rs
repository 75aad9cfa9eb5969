//! Loom model of the BlockingThenBusy handshake with the notify-skip fast path, the BTB
//! reused across rounds (ARCHITECTURE.md, "The notify-skip fast path").
//!
//! Each round spawns a worker (the spawn stands for the VM handing it the instruction):
//! the worker records that it started, `notify()`s, writes its result into a loom
//! `UnsafeCell` and `decrease()`s; the waiter optionally skips blocking, waits, reads the
//! result and `reset()`s. Workers are joined only at the very end (LoomWait's parking spot
//! is a loom `lazy_static`, dropped when the model closure returns). Checked for every
//! interleaving (within the preemption bound):
//!
//! 1. the waiter never returns before the worker's `decrease()` and then sees its data
//!    (the result cell: a missing Release/Acquire is a causality violation, an early
//!    return an assertion);
//! 2. no lost wake-up: every round terminates, skip or not (loom reports deadlocks);
//! 3. a stale notification (the `Stale` rounds inject one) lets the waiter start spinning
//!    early but never return early (the result check);
//! 4. `close()` during a wait ends it with an error: see `loom_close.rs`;
//! 5. after `reset()`, a non-skip round blocks until that round's own `notify()`: between
//!    its blocking and spinning phase the waiter must see the worker's "started" mark.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_handshake`.
#![cfg(loom)]

use core::time::Duration;

use ivm_core::btb::{BlockingThenBusy, SpinBudget};
use ivm_core::counter::WaitError;
use ivm_core::wait::LoomWait;
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU32;
use loom::sync::atomic::Ordering::Relaxed;
use loom::thread;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    /// The waiter blocks on the notifier until the worker starts.
    Block,
    /// The notify-skip fast path: the waiter notifies its own BTB first.
    Skip,
    /// A stale notification is pending when the (non-skip) round starts.
    Stale,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// `decrease()` with Relaxed instead of Release.
    DecreaseRelaxed,
    /// The worker's `notify()` never calls the wake.
    NotifyWithoutWake,
    /// `reset()` leaves the notifier's count alone (the C++ original's leak).
    ResetKeepsNotification,
}

struct Shared {
    btb: BlockingThenBusy<LoomWait>,
    /// The worker's result: written before `decrease()`, read after the wait.
    data: UnsafeCell<u32>,
    /// The round the worker last started, marked before its `notify()`. Relaxed on both
    /// sides: only the notifier's Release/Acquire can make the waiter see it.
    started: AtomicU32,
}

// SAFETY: `data` is accessed by one worker at a time (the next is spawned after the
// waiter has acquired the previous one's decrease) and by the waiter only after its wait
// returned Ok; that ordering is what the model checks.
unsafe impl Sync for Shared {}

fn handshake(rounds: &'static [Round], spin: SpinBudget, bug: Bug) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let s: &'static Shared = Box::leak(Box::new(Shared {
            btb: BlockingThenBusy::with_spin_budget(spin),
            data: UnsafeCell::new(0),
            started: AtomicU32::new(0),
        }));
        let mut workers = Vec::new();
        for (round, &kind) in (1u32..).zip(rounds) {
            if kind == Round::Stale {
                s.btb.notifier().notify().unwrap();
            }
            workers.push(thread::spawn(move || {
                s.started.store(round, Relaxed);
                if bug == Bug::NotifyWithoutWake {
                    s.btb.notifier().planted_notify_without_wake().unwrap();
                } else {
                    s.btb.notify().unwrap();
                }
                // SAFETY: see `Shared`.
                s.data.with_mut(|p| unsafe { *p = round });
                if bug == Bug::DecreaseRelaxed {
                    s.btb.planted_decrease_relaxed();
                } else {
                    s.btb.decrease();
                }
            }));
            if kind == Round::Skip {
                s.btb.skip_blocking();
            }
            s.btb
                .wait_until_done_observed(
                    Duration::MAX,
                    || unreachable!("no period"),
                    || {
                        if kind == Round::Block {
                            assert_eq!(
                                s.started.load(Relaxed),
                                round,
                                "a non-skip round passed its notifier before its own notify()"
                            );
                        }
                    },
                )
                .unwrap();
            // SAFETY: see `Shared`.
            let got = s.data.with(|p| unsafe { *p });
            assert_eq!(
                got, round,
                "the waiter returned before the worker's decrease()"
            );
            if bug == Bug::ResetKeepsNotification {
                s.btb.planted_reset_keep_notification();
            } else {
                s.btb.reset();
            }
        }
        for w in workers {
            w.join().unwrap();
        }
    });
}

use Round::{Block, Skip, Stale};

#[test]
fn block_then_block() {
    handshake(&[Block, Block], SpinBudget::DEFAULT, Bug::None);
}

#[test]
fn skip_then_block() {
    handshake(&[Skip, Block], SpinBudget::DEFAULT, Bug::None);
}

#[test]
fn block_then_skip() {
    handshake(&[Block, Skip], SpinBudget::DEFAULT, Bug::None);
}

#[test]
fn skip_then_skip() {
    handshake(&[Skip, Skip], SpinBudget::DEFAULT, Bug::None);
}

#[test]
fn skip_then_block_park_at_once() {
    handshake(&[Skip, Block], SpinBudget::NONE, Bug::None);
}

#[test]
fn stale_notification_never_returns_early() {
    handshake(&[Stale, Block], SpinBudget::DEFAULT, Bug::None);
}

#[test]
fn skip_block_skip() {
    handshake(&[Skip, Block, Skip], SpinBudget::DEFAULT, Bug::None);
}

/// A wait with a period whose stop predicate gives up: the waiter either saw the round
/// finish (and its data) or reports `Stopped`; nothing hangs and nothing is torn.
#[test]
fn stop_predicate_abandons_cleanly() {
    loom::model(|| {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            btb: BlockingThenBusy::new(),
            data: UnsafeCell::new(0),
            started: AtomicU32::new(0),
        }));
        let worker = thread::spawn(move || {
            let _ = s.btb.notify();
            // SAFETY: see `Shared`.
            s.data.with_mut(|p| unsafe { *p = 1 });
            s.btb.decrease();
        });
        s.btb.skip_blocking();
        match s.btb.wait_until_done(Duration::from_secs(1), || true) {
            // SAFETY: see `Shared`.
            Ok(()) => assert_eq!(s.data.with(|p| unsafe { *p }), 1),
            Err(e) => assert_eq!(e, WaitError::Stopped),
        }
        worker.join().unwrap();
    });
}

#[test]
#[should_panic(expected = "Causality violation")]
fn planted_decrease_relaxed() {
    handshake(&[Block], SpinBudget::DEFAULT, Bug::DecreaseRelaxed);
}

#[test]
#[should_panic(expected = "deadlock")]
fn planted_notify_without_wake() {
    handshake(&[Block], SpinBudget::DEFAULT, Bug::NotifyWithoutWake);
}

#[test]
#[should_panic(expected = "passed its notifier before its own notify()")]
fn planted_reset_keeps_notification() {
    handshake(
        &[Skip, Block],
        SpinBudget::DEFAULT,
        Bug::ResetKeepsNotification,
    );
}
