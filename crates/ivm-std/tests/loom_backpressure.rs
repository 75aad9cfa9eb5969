//! Loom model of backpressure's wait and wake, with the VM's own `Backpressure`
//! (`engine/backpressure.rs`, hidden, `cfg(loom)` only) in the order of operations of
//! `VmCore::wait_backpressure` and `VmCore::after_release`:
//!
//! * a submitter found too much in flight: it counts itself (`announce`: count, SeqCst
//!   fence), then loops: reads the sequence word (`Waiting::seq`, Acquire), returns once
//!   the count in flight is below the low-water mark, else sleeps on the word while it
//!   still reads what it read (the futex, emulated by ivm-core's `LoomWait`, so a lost
//!   wake-up is a deadlock loom reports);
//! * releasers (one, or two one after the other on another thread) each decrement the
//!   count in flight (Relaxed, as `VmCore::instruction_released`), then
//!   `after_release`: a SeqCst fence, the waiters' count, and if someone waits and the
//!   count is below the mark, a Release bump of the word and a wake of every sleeper.
//!
//! Every interleaving must end with the submitter returned. Planted:
//! `after_release` without its fence (`planted_after_release_without_fence`: the
//! releaser may read no waiter while the waiter reads the old count, and nobody wakes it);
//! loom must report the deadlock. (The waiter's fence and the Acquire/Release pair are
//! each checked by weakening them in the source: `.ci/ordering_mutants.sh`.)
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_backpressure`.
#![cfg(loom)]

use ivm_core::sync::{AtomicUsize, Ordering};
use ivm_std::Backpressure;

/// The low-water mark: the submitter waits until fewer than this are in flight.
const LOW: usize = 1;

struct Vm {
    backpressure: Backpressure,
    /// Instructions in flight (`VmCore::flying`).
    flying: AtomicUsize,
}

fn below_low(vm: &Vm) -> bool {
    // Relaxed: as `VmCore::flying`.
    vm.flying.load(Ordering::Relaxed) < LOW
}

/// `VmCore::wait_backpressure`'s waiting, without its timeout.
fn wait(vm: &Vm) {
    let waiting = vm.backpressure.announce();
    loop {
        let seq = waiting.seq();
        if below_low(vm) {
            return;
        }
        waiting.sleep(seq, None);
    }
}

/// One release: the count's decrement, then `VmCore::after_release`.
fn release(vm: &Vm, planted: bool) {
    // Relaxed: as `VmCore::instruction_released`.
    vm.flying.fetch_sub(1, Ordering::Relaxed);
    if planted {
        vm.backpressure
            .planted_after_release_without_fence(|| below_low(vm));
    } else {
        vm.backpressure.after_release(|| below_low(vm));
    }
}

/// `in_flight` instructions, released one after the other on one thread, while the
/// submitter waits on the main thread.
fn model(in_flight: usize, planted: bool) {
    loom::model(move || {
        // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a
        // loom Arc aborts the test binary.
        let vm: &'static Vm = Box::leak(Box::new(Vm {
            backpressure: Backpressure::new(),
            flying: AtomicUsize::new(in_flight),
        }));
        let releaser = loom::thread::spawn(move || {
            for _ in 0..in_flight {
                release(vm, planted);
            }
        });
        wait(vm);
        releaser.join().unwrap();
        assert!(below_low(vm));
    });
}

#[test]
fn a_waiter_is_woken_by_the_release_that_lets_it_go() {
    model(1, false);
}

#[test]
fn a_waiter_sleeps_through_a_release_that_is_not_enough() {
    model(2, false);
}

#[test]
#[should_panic(expected = "deadlock")]
fn planted_after_release_without_fence() {
    model(1, true);
}
