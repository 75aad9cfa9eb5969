//! Single-thread mode's runs at rest (`Config::run_at_rest`): a `run` whose instructions
//! all run to completion on the caller goes around the engine only while nothing else is
//! in flight, and then behaves as through the engine: values, poison, a panicking
//! kernel, the stats. Behind a custom instruction that has not completed, the engine
//! orders it as before. (The equivalence fuzzer checks random programs in both settings:
//! `vm_equivalence.rs`.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ivm_std::{Config, Done, Error, InstructionPolicy, KernelCtx, Tensor, VirtualMachine};

fn single(at_rest: bool) -> VirtualMachine {
    VirtualMachine::new(
        Config::single_thread()
            .with_run_at_rest(at_rest)
            .with_timeout_period(Duration::from_secs(20)),
    )
    .unwrap()
}

fn read(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

#[test]
fn a_chain_of_kernels_gives_the_same_values_and_counts_either_way() {
    for at_rest in [true, false] {
        let vm = single(at_rest);
        let s = vm.default_stream();
        let (a, b) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
        for i in 0..100u64 {
            vm.run(|bl| {
                bl.call(&s, &[&a], &[&b], move |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x.wrapping_mul(31).wrapping_add(i);
                })?;
                bl.call(&s, &[&b], &[&a], |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x ^ 0x5555;
                })
            })
            .unwrap();
        }
        let mut want = 0u64;
        for i in 0..100u64 {
            want = want.wrapping_mul(31).wrapping_add(i) ^ 0x5555;
        }
        assert_eq!(read(&vm, &a).unwrap(), want, "at rest {at_rest}");
        let st = vm.stats().unwrap();
        assert_eq!(st.ran_at_rest, if at_rest { 200 } else { 0 });
        assert!(st.released >= 200, "{} released", st.released);
        assert_eq!(st.flying, 0);
        vm.shutdown().unwrap();
        let c = vm.debug_counters();
        assert_eq!((c.instructions, c.flying), (0, 0), "at rest {at_rest}");
    }
}

const PLANNED: &str = "run_at_rest: planned panic";

/// Keeps the planned panics' messages out of the test output (others still print).
fn silence_planned_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planned = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.contains(PLANNED));
        if !planned {
            default(info);
        }
    }));
}

#[test]
fn a_panicking_kernel_poisons_its_output_and_readers_either_way() {
    silence_planned_panics();
    for at_rest in [true, false] {
        let vm = single(at_rest);
        let s = vm.default_stream();
        let (a, b, c) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.run(|bl| {
            bl.call(&s, &[], &[&a], |_k| panic!("{PLANNED} at rest"))?;
            // Reads the poisoned tensor: fails by that poison.
            bl.call(&s, &[&a], &[&b], |k| k.output_u64(0)[0] = 1)?;
            // Reads nothing poisoned: runs.
            bl.call(&s, &[], &[&c], |k| k.output_u64(0)[0] = 7)
        })
        .unwrap();
        assert!(
            matches!(read(&vm, &a), Err(Error::Poisoned { .. })),
            "at rest {at_rest}"
        );
        assert!(
            matches!(read(&vm, &b), Err(Error::Poisoned { .. })),
            "at rest {at_rest}"
        );
        assert_eq!(read(&vm, &c).unwrap(), 7, "at rest {at_rest}");
        assert_eq!(vm.stats().unwrap().ran_at_rest > 0, at_rest);
        vm.shutdown().unwrap();
    }
}

/// Writes 1 into its output and completes when the test says so, from another thread.
struct Held {
    done: Arc<Mutex<Option<Done>>>,
}

impl InstructionPolicy for Held {
    fn launch(self: Box<Self>, k: &mut KernelCtx<'_>, done: Done) {
        k.output_u64(0)[0] = 1;
        *self.done.lock().unwrap() = Some(done);
    }
}

#[test]
fn behind_an_uncompleted_custom_instruction_the_engine_orders_the_run() {
    let vm = single(true);
    let s = vm.default_stream();
    let (t, u) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    let done = Arc::new(Mutex::new(None));
    vm.run(|b| b.custom(&s, &[], &[&t], Held { done: done.clone() }))
        .unwrap();
    assert!(
        done.lock().unwrap().is_some(),
        "launched by the run's drive"
    );
    // `t` is being written by a custom instruction that has not completed: the engine is
    // not at rest, so this run goes through it and waits for the completion.
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    vm.run(|b| {
        b.call(&s, &[&t], &[&u], move |k| {
            r.store(true, Ordering::SeqCst);
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
        })
    })
    .unwrap();
    assert!(
        !ran.load(Ordering::SeqCst),
        "ran before its input was complete"
    );
    assert_eq!(vm.stats().unwrap().ran_at_rest, 0);
    let d = done.lock().unwrap().take().unwrap();
    std::thread::spawn(move || d.complete().unwrap())
        .join()
        .unwrap();
    assert_eq!(read(&vm, &u).unwrap(), 2);
    assert!(ran.load(Ordering::SeqCst));
    // At rest again: the next run goes around the engine.
    vm.run(|b| b.call(&s, &[&u], &[&t], |k| k.output_u64(0)[0] = 9))
        .unwrap();
    assert_eq!(vm.stats().unwrap().ran_at_rest, 1);
    assert_eq!(read(&vm, &t).unwrap(), 9);
    vm.shutdown().unwrap();
}

#[test]
fn a_kernel_that_calls_its_vm_is_refused_at_rest_too() {
    let vm = Arc::new(single(true));
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    let answer = Arc::new(Mutex::new(None));
    let (v, a) = (vm.clone(), answer.clone());
    vm.run(|b| {
        b.call(&s, &[], &[&t], move |_k| {
            *a.lock().unwrap() = Some(v.run(|_| Ok(())));
        })
    })
    .unwrap();
    assert!(matches!(
        answer.lock().unwrap().take(),
        Some(Err(Error::Reentrant))
    ));
    assert_eq!(vm.stats().unwrap().ran_at_rest, 1);
    drop(answer);
    vm.shutdown().unwrap();
}

#[test]
fn releases_of_tensors_dropped_between_runs_do_not_keep_runs_off_the_rest_path() {
    let vm = single(true);
    let s = vm.default_stream();
    let kept = vm.new_tensor(8).unwrap();
    for i in 0..10u64 {
        let tmp = vm.new_tensor(8).unwrap();
        vm.run(|b| {
            b.call(&s, &[], &[&tmp], move |k| k.output_u64(0)[0] = i)?;
            b.call(&s, &[&tmp], &[&kept], |k| {
                k.output_u64(0)[0] = k.input_u64(0)[0] * 2;
            })
        })
        .unwrap();
        // Its release waits in the pending queue until the next call handles it first.
        drop(tmp);
    }
    assert_eq!(read(&vm, &kept).unwrap(), 18);
    assert_eq!(vm.stats().unwrap().ran_at_rest, 20);
    vm.shutdown().unwrap();
    let c = vm.debug_counters();
    assert_eq!((c.instructions, c.flying), (0, 0));
}

/// Counts the wait hook's open scopes (`before_wait` .. `after_wait`).
#[derive(Default)]
struct Scopes(std::sync::atomic::AtomicUsize);

impl ivm_std::WaitHook for Scopes {
    fn before_wait(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn after_wait(&self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn pending_work_a_run_at_rest_handles_first_runs_inside_the_wait_hook() {
    let vm = single(true);
    let scopes = Arc::new(Scopes::default());
    vm.set_foreign_hooks(ivm_std::ForeignHooks::default().with_wait_hook(scopes.clone()))
        .unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    // Single-thread mode: an async access is only pushed; the next call runs it.
    let sc = scopes.clone();
    let inside = vm.access_async(&t, move |_| sc.0.load(Ordering::SeqCst) > 0);
    vm.run(|b| b.call(&s, &[&t], &[], |_k| {})).unwrap();
    assert_eq!(vm.stats().unwrap().ran_at_rest, 1);
    assert!(
        inside.wait().unwrap(),
        "the callback ran outside the wait hook"
    );
    assert_eq!(scopes.0.load(Ordering::SeqCst), 0);
    vm.shutdown().unwrap();
}
