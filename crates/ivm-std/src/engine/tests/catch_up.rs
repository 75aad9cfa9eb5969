//! Backpressure on a busy machine (`Config::contended_high_water_mark`): a submission that
//! finds more than the mark in flight while the callers count as losing their CPU, or
//! while a worker's instructions are tiny, runs what the dozing worker has queued, built
//! before it, and never its own kernels.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{read_u64, spin_until, vm_with_a_contended_worker_in, vm_with_a_worker_in};
use crate::Config;

/// Submissions at most, each one kernel, before a test gives up on seeing a catch-up.
const RUNS: usize = 2_000;

/// The configuration of a test that waits for a catch-up: more than two in flight is
/// enough. A contended worker wakes from its doze every `WORKER_DOZE` (500 µs) and runs its
/// queue; at the default mark (16) a debug build on a loaded machine may never push that
/// many within a doze. No run at rest: with the worker's kernels tiny (marked by a test
/// or found so by the worker), a `run` would run its own kernels itself
/// (`engine/at_rest.rs`; `tests/at_rest.rs` here), and the catch-up is what is tested.
fn catching_up() -> Config {
    no_run_at_rest().with_contended_high_water_mark(2)
}

/// The default configuration without runs at rest (see [`catching_up`]).
fn no_run_at_rest() -> Config {
    Config::default().with_run_at_rest(false)
}

/// A VM of `config` whose default stream's worker is marked contended, with its callers
/// marked as losing their CPU too (as `preemption::look_neighbours` marks them beside a
/// busy thread), once that worker dozes.
fn contended_callers(config: Config) -> super::VmRig {
    let (vm, s, worker, t) = vm_with_a_contended_worker_in(config);
    let hold = Duration::from_secs(600);
    worker.callers_contended_until.hold_for(hold);
    vm.shared().core.callers_contended_until.hold_for(hold);
    spin_until("the worker never dozed", || {
        worker.dozing.load(ivm_core::sync::Ordering::Relaxed)
    });
    (vm, s, worker, t)
}

/// Submits one kernel per `run` until one ran on this thread (or `RUNS`); each kernel
/// records, when it runs on the submitting thread, its own run's index and the index of
/// the run being submitted then, and panics there if `kernel_panics`. Returns those pairs,
/// and how many runs it took.
fn submit_until_caught_up(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    t: &crate::Tensor,
    kernel_panics: bool,
) -> (Vec<(usize, usize)>, usize) {
    let me = std::thread::current().id();
    let submitting = Arc::new(AtomicUsize::new(0));
    let on_caller = Arc::new(Mutex::new(Vec::new()));
    let mut runs = 0;
    while runs < RUNS && on_caller.lock().unwrap().is_empty() {
        let (sub, seen) = (submitting.clone(), on_caller.clone());
        // Relaxed: read on this same thread when a kernel runs on it.
        submitting.store(runs, Ordering::Relaxed);
        vm.run(|b| {
            b.call(s, &[], &[t], move |k| {
                let on_me = std::thread::current().id() == me;
                if on_me {
                    seen.lock()
                        .unwrap()
                        .push((runs, sub.load(Ordering::Relaxed)));
                }
                // Only on the caller: one the worker runs first (its doze may end before
                // the mark is passed) would poison the output, and a kernel whose output
                // is poisoned never runs again, on any thread.
                assert!(
                    !(kernel_panics && on_me),
                    "a kernel that fails in a catch-up"
                );
                k.output_u64(0)[0] = runs as u64;
            })
        })
        .unwrap();
        runs += 1;
    }
    let seen = std::mem::take(&mut *on_caller.lock().unwrap());
    (seen, runs)
}

/// [`submit_until_caught_up`] without failing kernels: asserts that some kernel ran on the
/// submitting thread, each inside a later run than its own; returns how many runs it took.
fn caught_up_before_their_own(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    t: &crate::Tensor,
) -> usize {
    let (seen, runs) = submit_until_caught_up(vm, s, t, false);
    assert!(
        !seen.is_empty(),
        "no kernel ran on the submitting thread in {runs} runs"
    );
    for &(own, during) in &seen {
        assert!(
            own < during,
            "the kernel of run {own} ran inside run {during}: a run's own kernels run after it returns"
        );
    }
    runs
}

#[test]
// Waits in real time for the worker's states (Miri covers the VM's unsafe code in
// `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_contended_submission_runs_the_dozing_workers_queue_built_before_it() {
    let (vm, s, _worker, t) = contended_callers(catching_up());
    let before = vm.stats().unwrap().caller_ran;
    let runs = caught_up_before_their_own(&vm, &s, &t);
    assert!(vm.stats().unwrap().caller_ran > before);
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), runs as u64 - 1);
    vm.shutdown().unwrap();
}

/// A worker that found its instructions tiny (`preemption::mark_tiny_kernels`, as the
/// worker marks itself) has its queue run by the submitting callers, although nobody
/// counts as losing a CPU: the VM's busy-machine hint, which lazy graphs' helpers read,
/// stays off.
#[test]
#[cfg_attr(miri, ignore)]
fn a_worker_with_tiny_kernels_has_its_queue_caught_up_by_its_submitters() {
    let (vm, s, worker, t) = vm_with_a_worker_in(catching_up());
    let core = &vm.shared().core;
    crate::engine::preemption::mark_tiny_kernels(&worker, core, Duration::from_secs(600));
    // Idle past its idle dozes, the worker sleeps without a deadline: wake it to see the
    // mark and doze.
    worker.notifier.notify().unwrap();
    spin_until("the worker never dozed", || {
        worker.dozing.load(ivm_core::sync::Ordering::Relaxed)
    });
    let runs = caught_up_before_their_own(&vm, &s, &t);
    assert!(!core.callers_contended_until.holds());
    let st = vm.stats().unwrap();
    assert_eq!(st.tiny_kernel_marks, 1);
    assert!(st.caller_ran > 0);
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), runs as u64 - 1);
    vm.shutdown().unwrap();
}

#[test]
#[cfg_attr(miri, ignore)]
fn a_kernel_that_panics_in_a_catch_up_poisons_its_output_not_the_caller() {
    let (vm, s, _worker, t) = contended_callers(catching_up());
    let (seen, runs) = submit_until_caught_up(&vm, &s, &t, true);
    assert!(
        !seen.is_empty(),
        "no kernel ran on the submitting thread in {runs} runs"
    );
    // Every run returned; the failure is the tensor's, reported where it is read.
    let mut out = [0u8; 8];
    let r = vm.read_small(&t, 0, &mut out);
    assert!(
        matches!(
            r,
            Err(crate::Error::Poisoned { .. } | crate::Error::KernelPanicked { .. })
        ),
        "the read reports the kernel's failure: {r:?}"
    );
    vm.shutdown().unwrap();
}

#[test]
#[cfg_attr(miri, ignore)]
fn with_the_mark_off_no_submission_runs_a_kernel() {
    let (vm, s, _worker, t) =
        contended_callers(no_run_at_rest().with_contended_high_water_mark(usize::MAX));
    let (seen, runs) = submit_until_caught_up(&vm, &s, &t, false);
    assert!(seen.is_empty(), "{seen:?}");
    assert_eq!(runs, RUNS);
    vm.sync().unwrap();
    vm.shutdown().unwrap();
}

/// A timed read keeps its deadline: beside a busy thread and with more than the mark in
/// flight it runs no queued kernel (only `run` catches up).
#[test]
#[cfg_attr(miri, ignore)]
fn a_timed_read_runs_no_queued_kernel() {
    use std::sync::atomic::AtomicBool;
    let (vm, s, worker, t) = contended_callers(Config::default());
    let other = vm
        .stream(crate::util::ids::StreamId::compute(crate::Device::CPU, 1))
        .unwrap();
    let (t2, t3) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    // More than the mark in flight: a gate on another stream, 20 behind it.
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    let me = std::thread::current().id();
    vm.run(|b| {
        b.call(&other, &[], &[&t3], move |_k| {
            // A `run` here may catch up with the gate (were its worker marked contended
            // meanwhile, by a loaded machine): it must not wait for this thread then.
            while !g.load(Ordering::Acquire) && std::thread::current().id() != me {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    })
    .unwrap();
    for _ in 0..20 {
        vm.run(|b| b.call(&other, &[], &[&t3], |_k| {})).unwrap();
    }
    spin_until("the worker never dozed", || {
        worker.dozing.load(ivm_core::sync::Ordering::Relaxed)
    });
    let in_timed = Arc::new(AtomicBool::new(false));
    let ran_in_timed = Arc::new(AtomicUsize::new(0));
    for _ in 0..400 {
        let (f, n) = (in_timed.clone(), ran_in_timed.clone());
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |_k| {
                // Relaxed: set and read on this same thread.
                if std::thread::current().id() == me && f.load(Ordering::Relaxed) {
                    n.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .unwrap();
        in_timed.store(true, Ordering::Relaxed);
        let mut out = [0u8; 8];
        let _ = vm.read_small_timeout(&t2, 0, &mut out, Duration::from_millis(2));
        in_timed.store(false, Ordering::Relaxed);
    }
    gate.store(true, Ordering::Release);
    vm.sync().unwrap();
    assert_eq!(ran_in_timed.load(Ordering::Relaxed), 0);
    vm.shutdown().unwrap();
}

/// A wait hook that panics around a catch-up: the panic reaches the `run`'s caller, and
/// the run's work was submitted all the same.
#[test]
#[cfg_attr(miri, ignore)]
fn a_wait_hook_that_panics_in_a_catch_up_keeps_the_runs_work() {
    use std::sync::atomic::AtomicBool;
    let (vm, s, _worker, t) = contended_callers(catching_up());
    let arm = Arc::new(AtomicBool::new(false));
    vm.set_foreign_hooks(
        crate::ForeignHooks::default().with_wait_hook(Arc::new(super::PanickingHook(arm.clone()))),
    )
    .unwrap();
    let mut panicked_at = None;
    for i in 1..=RUNS as u64 {
        arm.store(true, Ordering::Relaxed);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = i))
        }));
        arm.store(false, Ordering::Relaxed);
        if r.is_err() {
            panicked_at = Some(i);
            break;
        }
    }
    let i = panicked_at.expect("no run caught up");
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), i, "run {i}'s kernel ran");
    vm.shutdown().unwrap();
}

/// The catch-up takes a queued fused run only if every member was built before the
/// submission (`worker::run_built_before`): a run dispatched between a submission's push
/// and its catch-up may end in that submission's own instructions, which must run after
/// `run` returns. The engine is driven by hand, so the run is formed deterministically.
#[test]
fn a_fused_run_counts_as_built_before_only_if_its_last_member_is() {
    let mut r = super::Rig::new(1);
    r.engine = crate::engine::Engine::for_config(&Config::default().with_fusion(true));
    let (x, y, z) = (r.blob(), r.blob(), r.blob());
    let a = r.instr("a", 0, &[], &[&x]);
    let b = r.instr("b", 0, &[], &[&y]);
    let c = r.instr("c", 0, &[], &[&z]);
    r.step();
    let queued = r.dispatched(0);
    assert_eq!(queued.len(), 1, "one fused run, queued as its head");
    let head = &queued[0];
    assert!(Arc::ptr_eq(head, &a));
    let built_before = |bound| crate::engine::worker::run_built_before(head, bound);
    assert!(built_before(c.id + 1), "every member before the bound");
    assert!(!built_before(c.id), "the last member is the bound's");
    assert!(!built_before(b.id), "a middle member is the bound's");
    assert!(!built_before(a.id), "the head is the bound's");
    // Run as a caller runs a queued run: every member, then every one released.
    assert_eq!(crate::engine::execute::execute_run(head).0, 3);
    r.step();
    assert_eq!(r.engine.counters(), (0, 0, 0));
}
