//! Runs at rest in multi-thread mode (`engine/at_rest.rs`): a `run` of kernels a caller
//! may run, on a stream whose worker found them tiny or beside busy neighbours, runs them
//! on its caller before it returns, when the engine is at rest; a slow one ends the tiny
//! mark; failures stay the tensors' and the hooks' as on the engine's path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use super::{read_u64, vm_with_a_worker_in};
use crate::Config;
use crate::engine::preemption::mark_tiny_kernels;

/// Runs, at most, before a test gives up on seeing what it waits for.
const RUNS: u64 = 200;

/// A VM of `config` whose default stream's worker is marked as running tiny kernels for
/// longer than any test takes.
fn tiny_in(config: Config) -> super::VmRig {
    let (vm, s, worker, t) = vm_with_a_worker_in(config);
    mark_tiny_kernels(&worker, &vm.shared().core, Duration::from_secs(600));
    (vm, s, worker, t)
}

/// Submits one kernel that computes for `busy` (spinning, as a kernel that computes does)
/// and writes `value` into `t`; returns the thread it ran on if it ran before `run`
/// returned, and whether the run was counted at rest.
fn run_one(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    t: &crate::Tensor,
    value: u64,
    busy: Duration,
) -> (Option<ThreadId>, bool) {
    let ran_on = Arc::new(Mutex::new(None));
    let r = ran_on.clone();
    let before = vm.stats().unwrap().ran_at_rest;
    vm.run(|b| {
        b.call(s, &[], &[t], move |k| {
            let start = std::time::Instant::now();
            while start.elapsed() < busy {
                std::hint::spin_loop();
            }
            k.output_u64(0)[0] = value;
            *r.lock().unwrap() = Some(std::thread::current().id());
        })
    })
    .unwrap();
    let on = *ran_on.lock().unwrap();
    (on, vm.stats().unwrap().ran_at_rest > before)
}

/// `n` [`run_one`]s (writing 0..n) of kernels computing for `busy`: how many ran at rest,
/// each of those on this thread, before its `run` returned.
fn runs_at_rest_here(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    t: &crate::Tensor,
    n: u64,
    busy: Duration,
) -> usize {
    let me = std::thread::current().id();
    let mut at_rest = 0;
    for i in 0..n {
        let (on, counted) = run_one(vm, s, t, i, busy);
        if counted {
            at_rest += 1;
            assert_eq!(
                on,
                Some(me),
                "run {i} at rest ran its kernel here, before returning"
            );
        }
    }
    at_rest
}

/// Twenty [`run_one`]s of kernels computing for `busy`, none of which may run at rest
/// (`why` names the condition); then every one's write has landed, and the VM shuts down.
fn twenty_not_at_rest(rig: super::VmRig, busy: Duration, why: &str) {
    let (vm, s, _worker, t) = rig;
    for i in 0..20 {
        let (_, counted) = run_one(&vm, &s, &t, i, busy);
        assert!(!counted, "run {i} ran at rest {why}");
    }
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 19);
    vm.shutdown().unwrap();
}

/// Run under Miri too: it waits for nothing, and checks the body's ownership on this path
/// (`at_rest.rs`, `run_here`).
#[test]
fn a_run_of_tiny_kernels_runs_at_rest_on_its_caller() {
    let (vm, s, _worker, t) = tiny_in(Config::default());
    // Only another thread holding the engine at that moment sends a run to the worker.
    assert!(
        runs_at_rest_here(&vm, &s, &t, 20, Duration::ZERO) > 0,
        "no run ran at rest"
    );
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 19);
    vm.shutdown().unwrap();
}

#[test]
// Behaviour, run natively: Miri checks this path's unsafe code in the test above.
#[cfg_attr(miri, ignore)]
fn with_run_at_rest_off_no_run_is_counted_at_rest() {
    let rig = tiny_in(Config::default().with_run_at_rest(false));
    twenty_not_at_rest(rig, Duration::ZERO, "with run_at_rest off");
}

/// Beside busy neighbours that leave the VM too few CPUs (the VM's callers and the
/// stream's worker marked contended, as a neighbour look marks them), a `run` of kernels
/// of any length runs at rest on its caller: the caller runs the work there anyway. Such
/// runs set no tiny mark (a judged one must not take contention for tiny kernels).
#[test]
#[cfg_attr(miri, ignore)]
fn a_run_beside_busy_neighbours_runs_at_rest_and_marks_nothing_tiny() {
    let (vm, s, worker, t) = vm_with_a_worker_in(Config::default());
    let hold = Duration::from_secs(600);
    vm.shared().core.callers_contended_until.hold_for(hold);
    worker.callers_contended_until.hold_for(hold);
    // Kernels of 2 µs: not tiny (300 ns), yet within a judged run's budget for one
    // (6.2 µs), which would renew a tiny mark; enough runs that several are judged (one
    // in eight, at random).
    assert!(
        runs_at_rest_here(&vm, &s, &t, 64, Duration::from_micros(2)) > 0,
        "no run ran at rest beside busy neighbours"
    );
    assert!(
        !worker.tiny_until.is_set(),
        "a contended run marked the kernels tiny"
    );
    assert!(!vm.shared().core.tiny_kernels_until.is_set());
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 63);
    vm.shutdown().unwrap();
}

/// A worker marked contended by its caller's own wait for a CPU (`CallerSense`), with no
/// look at busy neighbours behind it, keeps its runs on the engine's path: a flood of the
/// VM's own threads trips that mark too.
#[test]
#[cfg_attr(miri, ignore)]
fn a_worker_marked_by_its_callers_cpu_wait_alone_does_not_run_at_rest() {
    let rig = vm_with_a_worker_in(Config::default());
    rig.2
        .callers_contended_until
        .hold_for(Duration::from_secs(600));
    twenty_not_at_rest(rig, Duration::ZERO, "without a look at busy neighbours");
}

/// Runs of one kernel computing for `busy` on a stream marked tiny, until a judged run at
/// rest (one in `JUDGE_ONE_IN`, at random) ends the mark, within [`RUNS`]; then none of
/// twenty more runs rests: they go to the worker, which times them anew.
fn the_mark_ends_under(busy: Duration) {
    let (vm, s, worker, t) = tiny_in(Config::default());
    let mut runs = 0;
    while worker.tiny_until.is_set() {
        assert!(
            runs < RUNS,
            "the mark outlived {RUNS} runs of {busy:?} kernels"
        );
        let _ = run_one(&vm, &s, &t, runs, busy);
        runs += 1;
    }
    twenty_not_at_rest((vm, s, worker, t), busy, "after the mark ended");
}

/// A run far longer than tiny kernels (200 µs) ends the mark.
#[test]
#[cfg_attr(miri, ignore)]
fn a_slow_run_at_rest_ends_the_tiny_mark() {
    the_mark_ends_under(Duration::from_micros(200));
}

/// Kernels of 8 µs, some twenty-five times the tiny budget of 300 ns yet short of any
/// timer's slice, end the mark too: judged against the kernels' budget (6.2 µs for one),
/// not against a slack of tens of microseconds (where they kept their callers blocked run
/// after run). Short, so that a judged run would have to be held up 13 µs to pass with
/// such a slack back.
#[test]
#[cfg_attr(miri, ignore)]
fn kernels_of_microseconds_at_rest_end_the_tiny_mark() {
    the_mark_ends_under(Duration::from_micros(8));
}

#[test]
#[cfg_attr(miri, ignore)]
fn a_kernel_that_panics_at_rest_poisons_its_output_not_the_caller() {
    let (vm, s, _worker, t) = tiny_in(Config::default());
    let other = vm.new_tensor(8).unwrap();
    let mut runs = 0;
    loop {
        assert!(runs < RUNS, "no run ran at rest in {RUNS}");
        runs += 1;
        let before = vm.stats().unwrap().ran_at_rest;
        // Every run returns Ok: the failure is the tensor's.
        vm.run(|b| {
            b.call(&s, &[], &[&t], |_k| panic!("a kernel that fails at rest"))?;
            b.call(&s, &[], &[&other], |k| k.output_u64(0)[0] = 7)
        })
        .unwrap();
        if vm.stats().unwrap().ran_at_rest > before {
            break;
        }
    }
    let mut out = [0u8; 8];
    let r = vm.read_small(&t, 0, &mut out);
    assert!(
        matches!(
            r,
            Err(crate::Error::Poisoned { .. } | crate::Error::KernelPanicked { .. })
        ),
        "the read reports the kernel's failure: {r:?}"
    );
    // The member after it, which does not read the poisoned tensor, ran.
    assert_eq!(read_u64(&vm, &other), 7);
    vm.shutdown().unwrap();
}

/// A VM as [`tiny_in`] with a [`super::PanickingHook`] installed, and its arming switch.
fn tiny_with_panicking_hook() -> (super::VmRig, Arc<AtomicBool>) {
    let rig = tiny_in(Config::default());
    let arm = Arc::new(AtomicBool::new(false));
    rig.0
        .set_foreign_hooks(
            crate::ForeignHooks::default()
                .with_wait_hook(Arc::new(super::PanickingHook(arm.clone()))),
        )
        .unwrap();
    (rig, arm)
}

/// One `run` writing `value` into `t` with the hook armed: whether it panicked, and
/// whether it ran at rest.
fn run_armed(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    t: &crate::Tensor,
    arm: &AtomicBool,
    value: u64,
) -> (bool, bool) {
    arm.store(true, Ordering::Relaxed);
    let before = vm.stats().unwrap().ran_at_rest;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        vm.run(|b| b.call(s, &[], &[t], move |k| k.output_u64(0)[0] = value))
    }));
    arm.store(false, Ordering::Relaxed);
    (r.is_err(), vm.stats().unwrap().ran_at_rest > before)
}

/// A wait hook that panics around a run at rest: the panic reaches the `run`'s caller,
/// the engine is let go (the VM goes on), and the run's kernel ran.
#[test]
#[cfg_attr(miri, ignore)]
fn a_wait_hook_that_panics_around_a_run_at_rest_lets_the_engine_go() {
    let ((vm, s, _worker, t), arm) = tiny_with_panicking_hook();
    let mut at_rest = false;
    for i in 1..=RUNS {
        let (panicked, counted) = run_armed(&vm, &s, &t, &arm, i);
        if panicked {
            vm.sync().unwrap();
            assert_eq!(read_u64(&vm, &t), i, "run {i}'s kernel ran");
        }
        if panicked && counted {
            at_rest = true;
            break;
        }
    }
    assert!(at_rest, "no run at rest met the hook");
    // The engine was let go: more work goes through.
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 0))
        .unwrap();
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 0);
    vm.shutdown().unwrap();
}

/// A run of tiny kernels that cannot run at rest (another stream's kernel is in flight)
/// goes to the engine whole, with a panicking wait hook armed: its work is never lost to
/// the hook of a run at rest it did not make.
#[test]
#[cfg_attr(miri, ignore)]
fn a_run_that_cannot_rest_is_submitted_whole_with_a_panicking_hook() {
    let ((vm, s, _worker, t), arm) = tiny_with_panicking_hook();
    let other = vm
        .stream(crate::util::ids::StreamId::compute(crate::Device::CPU, 1))
        .unwrap();
    let t2 = vm.new_tensor(8).unwrap();
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    vm.run(|b| {
        b.call(&other, &[], &[&t2], move |_k| {
            while !g.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    })
    .unwrap();
    for i in 1..=20 {
        let (_, counted) = run_armed(&vm, &s, &t, &arm, i);
        assert!(!counted, "run {i} ran at rest beside a kernel in flight");
    }
    gate.store(true, Ordering::Release);
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 20, "every run's kernel ran");
    vm.shutdown().unwrap();
}

/// Runs at rest beside another thread that submits to another stream and reads what the
/// runs at rest write: every increment lands once and in order, and each read sees a
/// value some prefix of the runs wrote (never a torn or a lost one).
#[test]
#[cfg_attr(miri, ignore)]
fn runs_at_rest_beside_another_threads_runs_and_reads() {
    const N: u64 = 2_000;
    let (vm, s, _worker, t) = tiny_in(Config::default());
    let vm = Arc::new(vm);
    let other = vm
        .stream(crate::util::ids::StreamId::compute(crate::Device::CPU, 1))
        .unwrap();
    let t2 = vm.new_tensor(8).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (vm, t, done) = (vm.clone(), t.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut last, mut runs) = (0, 0u64);
            while !done.load(Ordering::Acquire) {
                vm.run(|b| b.call(&other, &[], &[&t2], |k| k.output_u64(0)[0] += 1))
                    .unwrap();
                runs += 1;
                let seen = read_u64(&vm, &t);
                assert!(seen >= last && seen <= N, "read {seen} after {last}");
                last = seen;
            }
            vm.sync().unwrap();
            assert_eq!(
                read_u64(&vm, &t2),
                runs,
                "every run of the other thread landed"
            );
        })
    };
    let mut at_rest = 0;
    for _ in 0..N {
        let before = vm.stats().unwrap().ran_at_rest;
        vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] += 1))
            .unwrap();
        if vm.stats().unwrap().ran_at_rest > before {
            at_rest += 1;
        }
    }
    done.store(true, Ordering::Release);
    reader.join().unwrap();
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), N, "every increment landed once");
    assert!(at_rest > 0, "no run ran at rest");
    Arc::into_inner(vm).unwrap().shutdown().unwrap();
}
