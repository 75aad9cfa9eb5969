//! Loom models of single-thread mode's waiting word (`ivm_std::SingleWaits`, hidden,
//! `cfg(loom)` only; `engine/drive/single_waits.rs`), in the order of operations of `drive_until`:
//!
//! * **announcements publish**: a notifier publishes a result (a loom `UnsafeCell` plus a
//!   Release flag) and `notify`s; a waiter takes a `snapshot`, checks the flag (Acquire)
//!   and otherwise waits for the count to change. A snapshot that reads the notifier's bump
//!   must make the result visible to the check right after it; else the waiter goes to
//!   sleep on a count that will not change again (a lost notification, which loom reports
//!   as a deadlock, since `wait_forever` has no deadline) or reads the cell racily;
//! * **a release asked for is announced**: a holder lets go of the engine (a Release store
//!   on a loom "lock" word) and calls `released`; a caller that found it held calls
//!   `want_engine` and tries once more before it waits. Either its retry finds the lock
//!   free, or the holder sees the request and announces its release.
//!
//! Each ordering of `snapshot`, `notify`, `want_engine` and `released` is needed by one of
//! these models: `.ci/ordering_mutants.sh` weakens each to Relaxed and the models fail.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release
//! --test loom_single_waits`.
#![cfg(loom)]

use ivm_core::sync::{AtomicBool, Ordering, UnsafeCell};
use ivm_std::SingleWaits;
use loom::sync::Arc;
use loom::thread;

#[test]
fn an_announcement_publishes_what_the_notifier_did_before() {
    loom::model(|| {
        let waits = Arc::new(SingleWaits::new());
        let done = Arc::new(AtomicBool::new(false));
        let data = Arc::new(UnsafeCell::new(0u32));
        let notifier = {
            let (waits, done, data) = (waits.clone(), done.clone(), data.clone());
            thread::spawn(move || {
                // SAFETY: the waiter reads the cell only after it saw `done`.
                data.with_mut(|p| unsafe { *p = 42 });
                // Release: publishes the cell to the waiter's Acquire check.
                done.store(true, Ordering::Release);
                waits.notify();
            })
        };
        loop {
            let seen = waits.snapshot();
            // Acquire: pairs with the notifier's Release store.
            if done.load(Ordering::Acquire) {
                // SAFETY: the notifier wrote it before `done` (Release/Acquire).
                assert_eq!(data.with(|p| unsafe { *p }), 42);
                break;
            }
            waits.wait_forever(seen);
        }
        notifier.join().unwrap();
    });
}

/// Two waiters and one notifier: both must see the result (a notification wakes every
/// sleeper, and a waiter's own snapshot decides).
#[test]
fn one_announcement_reaches_every_waiter() {
    loom::model(|| {
        let waits = Arc::new(SingleWaits::new());
        let done = Arc::new(AtomicBool::new(false));
        let waiter = |waits: Arc<SingleWaits>, done: Arc<AtomicBool>| {
            move || loop {
                let seen = waits.snapshot();
                // Acquire: pairs with the notifier's Release store.
                if done.load(Ordering::Acquire) {
                    break;
                }
                waits.wait_forever(seen);
            }
        };
        let w = thread::spawn(waiter(waits.clone(), done.clone()));
        let n = {
            let (waits, done) = (waits.clone(), done.clone());
            thread::spawn(move || {
                // Release: publishes the result to the waiters' Acquire checks.
                done.store(true, Ordering::Release);
                waits.notify();
            })
        };
        waiter(waits, done)();
        w.join().unwrap();
        n.join().unwrap();
    });
}

#[test]
fn a_release_that_was_asked_for_is_announced() {
    loom::model(|| {
        let waits = Arc::new(SingleWaits::new());
        // The engine's lock, held by the holder thread from the start.
        let locked = Arc::new(AtomicBool::new(true));
        // What the holder did with the engine, published by its unlock.
        let engine = Arc::new(UnsafeCell::new(0u32));
        let holder = {
            let (waits, locked, engine) = (waits.clone(), locked.clone(), engine.clone());
            thread::spawn(move || {
                // SAFETY: the holder owns the engine until its unlock below.
                engine.with_mut(|p| unsafe { *p = 7 });
                // Release: publishes the engine to whoever locks it next.
                locked.store(false, Ordering::Release);
                waits.released(None);
            })
        };
        // Acquire: pairs with the holder's Release unlock. A look before the swap, as a
        // lock's try_lock may fail on a stale look (a failed compare-exchange is a plain
        // load): only `want_engine`/`released` make the retry see the unlock.
        let try_lock = || {
            !locked.load(Ordering::Acquire)
                && locked
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
        };
        loop {
            let seen = waits.snapshot();
            if try_lock() {
                break;
            }
            // Held: ask for the release, then try once more before sleeping.
            waits.want_engine();
            if try_lock() {
                break;
            }
            waits.wait_forever(seen);
        }
        // SAFETY: we hold the engine (the lock's Release/Acquire orders the holder's use).
        assert_eq!(engine.with(|p| unsafe { *p }), 7);
        holder.join().unwrap();
    });
}
