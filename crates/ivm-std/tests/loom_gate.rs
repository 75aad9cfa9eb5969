//! Loom model of the VM's shutdown gate (`ivm_std::Gate`, hidden, `cfg(loom)` only; the
//! VM's `engine/gate.rs`), against the way the VM uses it:
//!
//! * callers (`VmCore::enter`, `receive_*`, a tensor's release): enter the gate; when
//!   they got in, push (here: write their slot, a loom `UnsafeCell`), then leave;
//! * shutdown (`vm/lifecycle.rs`): close the gate, wait until nobody is inside, then drain
//!   (here: read every slot).
//!
//! Every interleaving must let shutdown's drain see every push of a caller that got in
//! (no lost submission), and race with none (a caller that got in after the drain began
//! would write its slot while shutdown reads it: a reported race). Entering and closing
//! are Relaxed; the model is the evidence that the word's modification order is enough.
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_gate`.
#![cfg(loom)]

use std::mem::ManuallyDrop;
use std::sync::Arc;

use ivm_core::sync::{AtomicBool, Ordering, UnsafeCell};
use ivm_std::Gate;

const CALLERS: usize = 2;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Correct,
    PlantedLeaveRelaxed,
    PlantedCloseByStore,
}

struct Vm {
    gate: Gate,
    /// Caller i's push.
    slots: [UnsafeCell<u32>; CALLERS],
    /// Whether caller i got in (Relaxed: read after the joins).
    got_in: [AtomicBool; CALLERS],
}

// SAFETY: caller i writes `slots[i]` only while inside the gate, and shutdown reads the
// slots only once the gate is closed and empty: loom checks exactly that (a race is a
// reported causality violation).
unsafe impl Sync for Vm {}

fn model(variant: Variant) {
    loom::model(move || {
        // Loom objects are dropped by hand at the end: when loom reports a planted bug (a
        // panic in some thread), they must not be dropped while that thread unwinds (a
        // loom access in a destructor during a panic aborts).
        let vm = ManuallyDrop::new(Arc::new(Vm {
            gate: Gate::new(),
            slots: std::array::from_fn(|_| UnsafeCell::new(0)),
            got_in: std::array::from_fn(|_| AtomicBool::new(false)),
        }));
        let callers: Vec<_> = (0..CALLERS)
            .map(|i| {
                let vm = ManuallyDrop::new(Arc::clone(&vm));
                loom::thread::spawn(move || {
                    if let Some(pass) = vm.gate.enter() {
                        let pass = ManuallyDrop::new(pass);
                        // SAFETY: the slot is this caller's until it leaves the gate;
                        // shutdown reads it only once the gate is empty.
                        vm.slots[i].with_mut(|p| unsafe { *p = 42 + i as u32 });
                        vm.got_in[i].store(true, Ordering::Relaxed);
                        let pass = ManuallyDrop::into_inner(pass);
                        if variant == Variant::PlantedLeaveRelaxed {
                            pass.planted_leave_relaxed();
                        } else {
                            drop(pass);
                        }
                    }
                    drop(ManuallyDrop::into_inner(vm));
                })
            })
            .collect();

        // Shutdown.
        if variant == Variant::PlantedCloseByStore {
            vm.gate.planted_close_by_store();
        } else {
            vm.gate.close();
        }
        vm.gate.wait_until_empty(loom::thread::yield_now);
        // The drain.
        // SAFETY: the gate is closed and empty: no caller writes a slot any more.
        let drained: Vec<u32> = vm.slots.iter().map(|s| s.with(|p| unsafe { *p })).collect();
        assert!(vm.gate.enter().is_none(), "the gate stays closed");

        for c in callers {
            c.join().unwrap();
        }
        for (i, &seen) in drained.iter().enumerate() {
            if vm.got_in[i].load(Ordering::Relaxed) {
                assert_eq!(
                    seen,
                    42 + i as u32,
                    "caller {i} got in: its push was drained"
                );
            } else {
                assert_eq!(seen, 0, "caller {i} was rejected: it pushed nothing");
            }
        }
        drop(ManuallyDrop::into_inner(vm));
    });
}

#[test]
fn gate_drains_every_caller_that_got_in() {
    model(Variant::Correct);
}

/// A caller that leaves with Relaxed: shutdown sees the gate empty without seeing the
/// caller's push (a race on its slot). Loom must find it.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_leave_relaxed() {
    model(Variant::PlantedLeaveRelaxed);
}

/// A shutdown that closes with a plain store, forgetting the callers inside: it drains
/// while one still pushes. Loom must find it.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_close_by_store() {
    model(Variant::PlantedCloseByStore);
}
