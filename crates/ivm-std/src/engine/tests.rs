//! Engine unit tests. The engine is driven by hand: instructions are dispatched to worker
//! contexts that no thread runs, so each test decides when each instruction completes.
use super::*;
use crate::device::policy::CpuStreamPolicy;
use crate::model::blob::Blob;
use crate::model::instruction::Instruction;
use crate::model::thread_ctx::ThreadCtx;
use crate::util::config::Config;
use crate::util::ids::{Device, StreamId, StreamType};

struct Rig {
    vm: crate::VirtualMachine,
    engine: Engine,
    streams: Vec<Arc<StreamShared>>,
}

impl Rig {
    fn new(nstreams: u32) -> Self {
        let vm = crate::VirtualMachine::new(Config::single_thread()).unwrap();
        let id = vm.shared().id;
        let streams = (0..nstreams)
            .map(|k| {
                Arc::new(StreamShared {
                    vm_id: id,
                    index: 100 + k,
                    id: StreamId::compute(Device::CPU, k),
                    policy: crate::device::policy::PolicyAnswers::of(&CpuStreamPolicy(
                        StreamType::Compute,
                    )),
                    in_build_order: false,
                    thread: Some(Arc::new(ThreadCtx::new(format!("t{k}")))),
                    dev: crate::model::stream::DeviceCtx::cpu(
                        vm.shared().core.token().clone(),
                        false,
                    ),
                })
            })
            .collect();
        Self {
            engine: Engine::new(1024),
            vm,
            streams,
        }
    }

    fn blob(&self) -> Arc<Blob> {
        Arc::new(Blob::new(self.vm.shared().id, 0, Device::CPU, 8))
    }

    fn instr(
        &mut self,
        name: &'static str,
        s: usize,
        inputs: &[&Arc<Blob>],
        outputs: &[&Arc<Blob>],
    ) -> Arc<Instruction> {
        let i = Instruction::new(name, self.streams[s].clone(), Kind::Noop);
        // SAFETY: not shared yet.
        let body = unsafe { i.body_mut() };
        for b in inputs {
            body.inputs.push(Arc::clone(b));
        }
        for b in outputs {
            body.outputs.push(Arc::clone(b));
        }
        let i = Arc::new(i);
        self.vm.shared().core.count_in_flight(1);
        self.engine.receive(i.clone());
        i
    }

    fn step(&mut self) {
        while self.engine.step(&self.vm.shared().core) {}
    }

    /// Names of instructions dispatched to stream `s` since the last call.
    fn dispatched(&self, s: usize) -> Vec<Arc<Instruction>> {
        let t = self.streams[s].thread.as_ref().unwrap();
        std::iter::from_fn(|| t.try_pop()).collect()
    }

    fn lively(&self) -> usize {
        self.engine.core.lively_len()
    }
}

fn names(v: &[Arc<Instruction>]) -> Vec<&'static str> {
    v.iter().map(|i| i.name).collect()
}

#[test]
fn write_waits_for_reads_and_release_is_in_order() {
    let mut r = Rig::new(2);
    let a = r.blob();
    let _w1 = r.instr("w1", 0, &[], &[&a]);
    let _r2 = r.instr("r2", 1, &[&a], &[]);
    let _r3 = r.instr("r3", 1, &[&a], &[]);
    let _w4 = r.instr("w4", 0, &[], &[&a]);
    r.step();
    let d0 = r.dispatched(0);
    assert_eq!(names(&d0), ["w1"], "only the first write is ready");
    assert!(
        r.dispatched(1).is_empty(),
        "reads wait for the leading write"
    );
    crate::engine::execute::execute(&d0[0]);
    r.step();
    let d1 = r.dispatched(1);
    assert_eq!(names(&d1), ["r2", "r3"]);
    assert!(
        r.dispatched(0).is_empty(),
        "the second write waits for both reads"
    );
    // Complete r3 before r2: nothing may be released out of order.
    crate::engine::execute::execute(&d1[1]);
    r.step();
    assert_eq!(r.lively(), 3, "r3 is done but behind r2 on its stream");
    assert!(r.dispatched(0).is_empty());
    crate::engine::execute::execute(&d1[0]);
    r.step();
    assert_eq!(r.lively(), 1);
    let d0 = r.dispatched(0);
    assert_eq!(names(&d0), ["w4"]);
    crate::engine::execute::execute(&d0[0]);
    r.step();
    assert_eq!(r.engine.counters(), (0, 0, 0));
}

#[test]
fn same_stream_successors_are_prescheduled() {
    let mut r = Rig::new(1);
    let (a, b) = (r.blob(), r.blob());
    r.instr("w", 0, &[], &[&a]);
    r.instr("rw", 0, &[&a], &[&b]);
    r.instr("r", 0, &[&b], &[]);
    r.step();
    // All three run on one in-order stream: dispatched before the first is done.
    let d = r.dispatched(0);
    assert_eq!(names(&d), ["w", "rw", "r"]);
    assert_eq!(
        r.engine.core.edges(),
        2,
        "edges were made (sources not yet dispatched), then satisfied"
    );
    for i in &d {
        crate::engine::execute::execute(i);
    }
    r.step();
    assert_eq!(r.engine.counters(), (0, 0, 0));
}

#[test]
fn no_edge_to_a_dispatched_source_on_the_same_stream() {
    let mut r = Rig::new(2);
    let a = r.blob();
    r.instr("w", 0, &[], &[&a]);
    r.step();
    let d = r.dispatched(0);
    r.instr("r_same", 0, &[&a], &[]);
    r.instr("r_other", 1, &[&a], &[]);
    r.step();
    assert_eq!(
        names(&r.dispatched(0)),
        ["r_same"],
        "same stream: no edge, dispatched at once"
    );
    assert!(
        r.dispatched(1).is_empty(),
        "other stream: waits for the write's release"
    );
    assert_eq!(r.engine.core.edges(), 1);
    crate::engine::execute::execute(&d[0]);
    r.step();
    let d1 = r.dispatched(1);
    assert_eq!(names(&d1), ["r_other"]);
}

#[test]
fn read_after_released_write_has_no_edge_and_write_after_reads_waits() {
    let mut r = Rig::new(2);
    let a = r.blob();
    r.instr("w", 0, &[], &[&a]);
    r.step();
    crate::engine::execute::execute(&r.dispatched(0)[0]);
    r.step();
    assert_eq!(r.lively(), 0);
    r.instr("r1", 1, &[&a], &[]);
    r.instr("w2", 0, &[], &[&a]);
    r.step();
    let d1 = r.dispatched(1);
    assert_eq!(names(&d1), ["r1"]);
    assert!(
        r.dispatched(0).is_empty(),
        "w2 waits for r1 (write after read)"
    );
    crate::engine::execute::execute(&d1[0]);
    r.step();
    assert_eq!(names(&r.dispatched(0)), ["w2"]);
}

#[test]
fn barrier_runs_when_oldest_and_holds_back_nothing_later() {
    let mut r = Rig::new(2);
    let (a, b) = (r.blob(), r.blob());
    r.instr("i1", 0, &[], &[&a]);
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ran2 = ran.clone();
    let mut bar = Instruction::new(
        "barrier",
        r.vm.shared().barrier_stream(),
        Kind::Barrier(Box::new(move || {
            ran2.store(true, std::sync::atomic::Ordering::SeqCst)
        })),
    );
    bar.barrier = true;
    r.vm.shared().core.count_in_flight(1);
    r.engine.receive(Arc::new(bar));
    r.instr("i2", 1, &[], &[&b]);
    r.step();
    let d0 = r.dispatched(0);
    let d1 = r.dispatched(1);
    assert_eq!(
        names(&d1),
        ["i2"],
        "the barrier does not hold back later instructions"
    );
    crate::engine::execute::execute(&d1[0]);
    r.step();
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "i1 is older and lively"
    );
    crate::engine::execute::execute(&d0[0]);
    r.step();
    assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(r.engine.counters(), (0, 0, 0));
}

#[test]
fn stream_sequential_instructions_order_through_the_schedule_dependence() {
    let mut r = Rig::new(2);
    let mk = |r: &mut Rig, name, s: usize| {
        let mut i = Instruction::new(name, r.streams[s].clone(), Kind::Noop);
        i.stream_sequential = true;
        // Both write stream 0's schedule dependence.
        i.stream = r.streams[0].clone();
        let _ = s;
        r.vm.shared().core.count_in_flight(1);
        r.engine.receive(Arc::new(i));
    };
    mk(&mut r, "s1", 0);
    mk(&mut r, "s2", 0);
    r.step();
    // Same stream: the second is prescheduled after the first.
    assert_eq!(names(&r.dispatched(0)), ["s1", "s2"]);
    assert_eq!(r.engine.core.edges(), 1);
}

/// The instruction ownership steps end to end on one instruction: pool → builder's fill →
/// engine → dispatch → execute (`DONE`) → release (the engine clears the body) → back to
/// the pool once nobody else holds it → reset in place for the next use (same allocation).
#[test]
fn released_instruction_goes_back_to_the_pool_and_is_reused_in_place() {
    let mut r = Rig::new(1);
    let a = r.blob();
    let pool = r.vm.shared().core.pool();
    let i = pool.instruction("first", &r.streams[0], Kind::Noop);
    let first = Arc::as_ptr(&i);
    // SAFETY: not shared yet (the pool gave us its only reference).
    unsafe { i.body_mut() }.outputs.push(a.clone());
    r.vm.shared().core.count_in_flight(1);
    r.engine.receive(i);
    r.step();
    let d = r.dispatched(0);
    assert_eq!(names(&d), ["first"]);
    crate::engine::execute::execute(&d[0]);
    // Still held here: the engine keeps it for a later give-back instead of pooling it.
    r.step();
    assert_eq!(r.lively(), 0);
    drop(d);
    // The next step hands it to the pool (nobody else holds it now).
    r.step();
    let pool = r.vm.shared().core.pool();
    let j = pool.instruction("second", &r.streams[0], Kind::Noop);
    assert_eq!(Arc::as_ptr(&j), first, "reused in place");
    assert_eq!(j.name, "second");
    assert_eq!(j.status(), 0);
    // SAFETY: not shared (the pool gave us its only reference).
    let body = unsafe { j.body() };
    assert!(body.inputs.as_slice().is_empty() && body.outputs.as_slice().is_empty());
    assert_eq!(Arc::strong_count(&a), 1, "the release let go of the blob");
}

// A waiting caller's spin (`helping::spin_while_progress`).

fn single_vm() -> crate::VirtualMachine {
    crate::VirtualMachine::new(crate::Config::single_thread()).unwrap()
}

/// No instruction finishes and the outside count stands still: the caller gives up
/// (to sleep) instead of spinning on.
#[test]
fn a_stalled_wait_gives_up() {
    let vm = single_vm();
    let asked = std::cell::Cell::new(0);
    let elsewhere = || {
        asked.set(asked.get() + 1);
        Some(7)
    };
    assert!(!crate::engine::helping::spin_while_progress(
        &vm.shared().core,
        || false,
        elsewhere
    ));
    assert_eq!(asked.get(), 2, "asked at the start and at the stall");
    assert!(!crate::engine::helping::spin_while_progress(
        &vm.shared().core,
        || false,
        || None
    ));
}

/// Progress the engine does not see (a lazy graph computing) keeps the caller
/// spinning past a stall: here the wait ends only after the count was asked at a
/// stall and had moved. A wait that ignores the count never gets past the first stall.
/// No timing matters: after a look that saw the count move the wait looks at `done`
/// before its budget, so a test thread preempted past the whole budget (1 ms) passes
/// too (the test failed on a loaded machine while it allowed that to end the wait).
#[test]
fn progress_elsewhere_keeps_the_caller_spinning() {
    let vm = single_vm();
    let asked = std::cell::Cell::new(0u64);
    let elsewhere = || {
        asked.set(asked.get() + 1);
        Some(asked.get())
    };
    // Done once the count was asked at a stall (its second look) and moved.
    let done = || asked.get() >= 2;
    assert!(
        crate::engine::helping::spin_while_progress(&vm.shared().core, done, elsewhere),
        "the caller slept although the count kept moving"
    );
}

/// A worker asleep inside a kernel (as one blocked on a device call or I/O) is off its CPU
/// by its own doing: a caller that waits for it and sees no release is not to take it for
/// one waiting for a CPU (`preemption::WorkerWatch`), which would mark it contended and
/// move its stream's next kernels to the callers.
#[test]
// Reads threads' states from `/proc`, which Miri's isolation refuses.
#[cfg_attr(miri, ignore)]
fn a_worker_asleep_in_a_kernel_is_not_taken_for_a_stalled_one() {
    use std::sync::atomic::{AtomicBool, Ordering as O};
    let (vm, s, worker, t) = vm_with_a_worker();
    let started = Arc::new(AtomicBool::new(false));
    let st = started.clone();
    vm.run(|b| {
        b.call(&s, &[], &[&t], move |k| {
            // Relaxed: a signal; no data rides on it.
            st.store(true, O::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(300));
            k.output_u64(0)[0] = 1;
        })
    })
    .unwrap();
    // Outside the VM: the caller's wait below must not run the kernel itself. Then until
    // the worker sleeps in it (it may be preempted between the flag and the sleep).
    spin_until("the kernel never started", || started.load(O::Relaxed));
    let tid = worker.tid.load(ivm_core::sync::Ordering::Relaxed);
    spin_until("the worker never slept in its kernel", || {
        crate::engine::neighbours::thread_runnable(tid) == Some(false)
    });
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 1);
    assert_eq!(vm.stats().unwrap().worker_stalled, 0);
    vm.shutdown().unwrap();
}

/// A worker marked contended (as a waiting caller marks one it finds off its CPU) still
/// runs its stream's kernels after `run` returns: a kernel may wait for what its
/// submitting thread does next (here: open a gate), so it never runs inside `run` on that
/// thread. (Moving contended kernels to the driving caller at dispatch deadlocked
/// exactly here, under ThreadSanitizer, which slows a worker enough to look contended.)
#[test]
fn a_contended_worker_still_runs_kernels_after_run_returns() {
    use std::sync::atomic::{AtomicBool, Ordering as O};
    let (vm, s, _worker, t) = vm_with_a_contended_worker();
    for round in 0..20u64 {
        let gate = Arc::new(AtomicBool::new(false));
        let g = gate.clone();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |ctx| {
                // Fails the kernel instead of hanging the test.
                spin_until(
                    "the gate was never opened: the kernel ran inside `run`",
                    || g.load(O::Acquire),
                );
                ctx.output_u64(0)[0] = round;
            })
        })
        .unwrap();
        gate.store(true, O::Release);
        assert_eq!(read_u64(&vm, &t), round);
    }
    vm.shutdown().unwrap();
}

/// A VM whose default stream's worker is marked contended for the whole test (as a
/// waiting caller marks one it finds off its CPU), its stream, the worker and a tensor.
fn vm_with_a_contended_worker() -> VmRig {
    vm_with_a_contended_worker_in(crate::Config::default())
}

/// [`vm_with_a_contended_worker`] for a VM of `config`.
fn vm_with_a_contended_worker_in(config: crate::Config) -> VmRig {
    let (vm, s, worker, t) = vm_with_a_worker_in(config);
    crate::engine::preemption::mark_contended(&worker, std::time::Duration::from_secs(600));
    // A worker idle for longer than its idle dozes (a loaded machine may keep this thread
    // off its CPU that long) sleeps without a deadline: wake it to see its mark and doze.
    worker.notifier.notify().unwrap();
    (vm, s, worker, t)
}

/// A VM, its default stream, that stream's worker and a tensor of 8 bytes.
type VmRig = (
    crate::VirtualMachine,
    crate::Stream,
    Arc<crate::model::thread_ctx::ThreadCtx>,
    crate::Tensor,
);

/// A new VM as [`VmRig`].
fn vm_with_a_worker() -> VmRig {
    vm_with_a_worker_in(crate::Config::default())
}

/// A new VM of `config` as [`VmRig`].
fn vm_with_a_worker_in(config: crate::Config) -> VmRig {
    let vm = crate::VirtualMachine::new(config).unwrap();
    let s = vm.default_stream();
    let worker = s
        .shared
        .thread
        .clone()
        .expect("the default stream has a worker");
    let t = vm.new_tensor(8).unwrap();
    (vm, s, worker, t)
}

/// The first 8 bytes of `t`, read with `read_small`.
fn read_u64(vm: &crate::VirtualMachine, t: &crate::Tensor) -> u64 {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out).unwrap();
    u64::from_ne_bytes(out)
}

/// A custom instruction on `s` (a deferred body) that writes `value` into `t`, calls
/// `also` and completes during its launch.
fn custom_write(
    b: &mut crate::InstructionsBuilder<'_>,
    s: &crate::Stream,
    t: &crate::Tensor,
    value: u64,
    also: impl FnOnce() + Send + 'static,
) -> crate::Result<()> {
    b.custom(
        s,
        &[],
        &[t],
        move |k: &mut crate::KernelCtx<'_>, done: crate::Done| {
            k.output_u64(0)[0] = value;
            also();
            done.complete().unwrap();
        },
    )
}

/// Yields until `done`, for 10 s at most (then panics with `what`).
fn spin_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "{what}"
        );
        std::thread::yield_now();
    }
}

/// A VM whose default stream's worker has run work (a new VM's worker sleeps without a
/// deadline until it is first woken), its stream, the worker and a tensor.
fn vm_with_a_worker_that_ran() -> VmRig {
    let (vm, s, worker, t) = vm_with_a_worker();
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
        .unwrap();
    vm.sync().unwrap();
    (vm, s, worker, t)
}

/// Waits (up to 10 s) until the worker of `worker` sleeps in an idle doze. A worker that
/// sleeps without a deadline (its idle dozes used up, or off after a push that waited
/// for one) dozes again after it is woken: a kernel on `s`, run to completion, wakes it.
fn until_idle_doze(
    vm: &crate::VirtualMachine,
    s: &crate::Stream,
    worker: &crate::model::thread_ctx::ThreadCtx,
) {
    let start = std::time::Instant::now();
    let mut since = start;
    while !worker.idle_doze.load(ivm_core::sync::Ordering::Relaxed) {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the idle worker never dozed"
        );
        if since.elapsed() > std::time::Duration::from_millis(200) {
            vm.run(|b| b.call(s, &[], &[], |_| {})).unwrap();
            vm.sync().unwrap();
            since = std::time::Instant::now();
        }
        std::thread::yield_now();
    }
}

/// The counts that show a read ran queued work itself and then took the fast path:
/// instructions run by callers, small accesses done directly.
struct RanThenDirect(usize, usize);

impl RanThenDirect {
    fn before(vm: &crate::VirtualMachine) -> Self {
        Self(
            vm.stats().unwrap().caller_ran,
            vm.shared().core.inline_accesses().0,
        )
    }

    /// Whether both grew since `self` was taken.
    fn happened(&self, vm: &crate::VirtualMachine) -> bool {
        let now = Self::before(vm);
        now.0 > self.0 && now.1 > self.1
    }
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_caller_runs_what_it_pushed_to_an_idle_dozing_worker_without_waking_it() {
    // The worker dozes after its poll window; an op pushed then is left to its deadline,
    // and the caller's read runs it (ARCHITECTURE.md, "An idle worker dozes first").
    // Having run it, the read finds the engine at rest and copies the bytes itself, with
    // no access instruction (`doors/sync_access.rs`).
    let (vm, s, worker, t) = vm_with_a_worker_that_ran();
    // Relaxed: counts, read by this thread between its own calls.
    let left = || {
        worker
            .left_to_idle_doze
            .load(ivm_core::sync::Ordering::Relaxed)
    };
    let mut ran_then_direct = 0;
    // Until one round shows it: the read must look within the 100 µs left of an idle
    // doze, which a loaded machine often takes from it.
    for round in 0..60u64 {
        if ran_then_direct > 0 {
            break;
        }
        until_idle_doze(&vm, &s, &worker);
        let (left0, ran0) = (left(), RanThenDirect::before(&vm));
        vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round))
            .unwrap();
        assert_eq!(read_u64(&vm, &t), round);
        if left() > left0 && ran0.happened(&vm) {
            ran_then_direct += 1;
        }
    }
    assert!(
        left() > 0,
        "no push left its wake to an idle doze in 60 rounds"
    );
    assert!(vm.stats().unwrap().caller_ran > 0);
    assert!(
        ran_then_direct > 0,
        "no read ran the op left to the doze and then read directly"
    );
    vm.shutdown().unwrap();
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_read_that_runs_a_sleeping_workers_queue_leaves_later_submissions_alone() {
    // Another thread keeps submitting to the stream while a read runs the op it found
    // queued to the sleeping worker: the read returns without waiting for that thread to
    // stop (it would never stop here: it stops after the read returned, or after CAP).
    // Its kernels take longer than the pause between its pushes, so a reader that ran
    // everything queued would fall further behind with each one, until CAP; CAP pushes
    // take that thread at least CAP pauses, far longer than a descheduled reader waits
    // for a CPU on a loaded machine.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering as O};
    const CAP: usize = 3_000;
    let (vm, s, worker, t) = vm_with_a_worker_that_ran();
    let vm = Arc::new(vm);
    for round in 0..10u64 {
        until_idle_doze(&vm, &s, &worker);
        let stop = Arc::new(AtomicBool::new(false));
        let pushed = Arc::new(AtomicUsize::new(0));
        let other = {
            let (vm, s, stop, pushed) = (vm.clone(), s.clone(), stop.clone(), pushed.clone());
            let u = vm.new_tensor(8).unwrap();
            std::thread::spawn(move || {
                while !stop.load(O::Acquire) && pushed.load(O::Relaxed) < CAP {
                    vm.run(|b| {
                        b.call(&s, &[], &[&u], |k| {
                            let start = std::time::Instant::now();
                            while start.elapsed() < std::time::Duration::from_micros(500) {
                                std::hint::spin_loop();
                            }
                            k.output_u64(0)[0] += 1;
                        })
                    })
                    .unwrap();
                    pushed.fetch_add(1, O::Relaxed);
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            })
        };
        // Let the other thread's pushes start.
        while pushed.load(O::Relaxed) < 2 {
            std::thread::yield_now();
        }
        vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round))
            .unwrap();
        assert_eq!(read_u64(&vm, &t), round);
        let at_return = pushed.load(O::Relaxed);
        stop.store(true, O::Release);
        other.join().unwrap();
        assert!(
            at_return < CAP,
            "round {round}: the read returned only after the other thread stopped"
        );
    }
    vm.sync().unwrap();
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_read_that_ran_a_failing_op_left_to_an_idle_doze_reports_the_poison() {
    // The read's fast path after running the op itself sees the poison the op left; the
    // tensors the op did not write read as before.
    let (vm, s, worker, t) = vm_with_a_worker_that_ran();
    let mut ran_then_direct = 0;
    // Until one read found the op still queued: it must look within the 100 µs left of
    // an idle doze, which a loaded machine often takes from it.
    for _ in 0..50 {
        if ran_then_direct > 0 {
            break;
        }
        let failed = vm.new_tensor(8).unwrap();
        until_idle_doze(&vm, &s, &worker);
        // Before the push: a debug build's `stats` inside the window would shrink it.
        let before = RanThenDirect::before(&vm);
        vm.run(|b| b.call(&s, &[], &[&failed], |_| panic!("planted failure")))
            .unwrap();
        let mut out = [0u8; 8];
        let r = vm.read_small(&failed, 0, &mut out);
        assert!(
            matches!(&r, Err(crate::Error::Poisoned { message, .. }) if message.contains("planted failure")),
            "{r:?}"
        );
        if before.happened(&vm) {
            ran_then_direct += 1;
        }
        assert_eq!(read_u64(&vm, &t), 1);
    }
    assert!(
        ran_then_direct > 0,
        "no read ran the failing op and then took the fast path"
    );
    vm.shutdown().unwrap();
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn work_left_to_an_idle_doze_starts_by_its_deadline_when_nobody_waits() {
    use std::sync::atomic::{AtomicBool, Ordering as O};
    let (vm, s, worker, t) = vm_with_a_worker_that_ran();
    // Five rounds: after a push that had to wait for the deadline, the worker dozes no more
    // for `IDLE_DOZE_OFF`.
    for _ in 0..5 {
        until_idle_doze(&vm, &s, &worker);
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        vm.run(|b| b.call(&s, &[], &[&t], move |_| r.store(true, O::Release)))
            .unwrap();
        // Nobody calls into the VM now: only the doze's deadline (or a wake) runs it.
        spin_until("a push left to an idle doze's deadline never ran", || {
            ran.load(O::Acquire)
        });
    }
    // Relaxed: a count, read after every kernel ran.
    let left = worker
        .left_to_idle_doze
        .load(ivm_core::sync::Ordering::Relaxed);
    assert!(left > 0, "no push left its wake to an idle doze");
    vm.shutdown().unwrap();
}

/// A worker marked contended hands its queue to a waiting caller only when the caller may
/// run what is queued next (here a custom instruction on a compute stream: a deferred
/// body): a worker that handed over such a queue would be woken straight back by the
/// caller (a futex wake and a context switch per instruction, found on a collective
/// stream in the data-parallel demo on two cores).
#[test]
// Waits in real time for the worker's states (minutes under Miri, which covers the VM's
// unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_contended_worker_keeps_a_queue_its_callers_may_not_run() {
    use std::sync::atomic::{AtomicUsize, Ordering as O};
    let (vm, s, worker, t) = vm_with_a_contended_worker();
    // Rounds whose first kernel ended with the caller waiting and a custom instruction
    // queued behind it. A caller may also be held before its wait (a submitting caller
    // can be left the release of a kernel the clock sampled as long): such a round is not
    // counted.
    let seen = Arc::new(AtomicUsize::new(0));
    for round in 0..20u64 {
        let w = worker.clone();
        let sn = seen.clone();
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let st = started.clone();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |_| {
                st.store(true, O::Release);
                let start = std::time::Instant::now();
                while start.elapsed() < std::time::Duration::from_millis(200) {
                    if w.hand.has_waiters() {
                        sn.fetch_add(1, O::Relaxed);
                        return;
                    }
                    std::thread::yield_now();
                }
            })?;
            custom_write(b, &s, &t, u64::MAX, || {})?;
            custom_write(b, &s, &t, round, || {})
        })
        .unwrap();
        // The worker runs the first kernel (its doze ends): a read that found it asleep
        // with the kernel queued would run the kernel itself before it waits.
        spin_until("the first kernel never started", || {
            started.load(O::Acquire)
        });
        assert_eq!(read_u64(&vm, &t), round);
        if seen.load(O::Relaxed) >= 3 {
            break;
        }
    }
    assert!(seen.load(O::Relaxed) > 0, "no round had a caller waiting");
    let handed: usize = vm
        .stats()
        .unwrap()
        .threads
        .iter()
        .map(|t| t.handed_over)
        .sum();
    assert_eq!(
        handed, 0,
        "a queue no caller may run was handed to the callers"
    );
    vm.shutdown().unwrap();
}

/// How many times the worker of `ctx` was woken by a notification (`ThreadStats::wakes`).
fn wakes_of(vm: &crate::VirtualMachine, ctx: &ThreadCtx) -> usize {
    vm.stats()
        .unwrap()
        .threads
        .iter()
        .find(|t| t.name == ctx.name)
        .map_or(0, |t| t.wakes)
}

/// A worker marked contended that wakes to find a caller holding its queue's consumer role
/// (the caller runs its queue) dozes, with a deadline, rather than sleep until woken: the
/// caller's next pushes then leave its wake to that deadline (`ThreadCtx::submit`). Asleep
/// without one, every push of the caller that runs its queue paid a futex wake (one a step
/// in the demo's eager mode on a busy machine).
#[test]
// Waits in real time for the worker's states (minutes under Miri, which covers the VM's
// unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_contended_worker_whose_queue_a_caller_runs_dozes() {
    use ivm_core::sync::Ordering as O;
    let (vm, _s, worker, _t) = vm_with_a_contended_worker();
    spin_until("the worker never dozed", || worker.dozing.load(O::Relaxed));
    // As a caller that runs the queue holds it (`worker::caller_runs`).
    let consumer = loop {
        if let Some(c) = worker.take_role() {
            break c;
        }
        std::thread::yield_now();
    };
    let wakes = || wakes_of(&vm, &worker);
    let before = wakes();
    worker.notifier.notify().unwrap();
    // Woken by that notification (its doze's flags are cleared by then), the worker finds
    // the role taken and sleeps again.
    spin_until("the worker never woke", || wakes() > before);
    spin_until("the worker slept without a deadline", || {
        worker.is_parked() && worker.dozing.load(O::Relaxed)
    });
    worker.let_go(consumer);
    vm.shutdown().unwrap();
}

/// A caller that runs part of a contended worker's queue and stops (its wait is over)
/// leaves the rest to the worker's doze (`ThreadCtx::let_go_to_doze`), without a wake:
/// woken, the worker would take turns with the caller on a shared CPU to run what the
/// caller runs at its next wait anyway, or the worker by its deadline.
#[test]
// Waits in real time for the worker's states (minutes under Miri, which covers the VM's
// unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_caller_that_stops_short_leaves_the_rest_to_a_contended_workers_doze() {
    use ivm_core::sync::Ordering as O;
    let (vm, s, worker, t) = vm_with_a_contended_worker();
    let wakes = || wakes_of(&vm, &worker);
    // Rounds where the caller ran the first kernel and left the second queued (the doze
    // may end first: then the worker runs both, and the round does not count).
    let mut counted = 0;
    for round in 0..200u64 {
        spin_until("the worker never dozed", || worker.dozing.load(O::Relaxed));
        let woken = wakes();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round)?;
            b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round + 1)
        })
        .unwrap();
        // As a wait that is over after one instruction.
        let mut looks = 0;
        let ran = crate::engine::worker::caller_runs(&vm.shared().core, &worker, || {
            looks += 1;
            looks > 1
        });
        if ran && !worker.queue.is_empty() {
            // The worker sleeps on until its deadline (a notification would count as a
            // wake as soon as it ran).
            std::thread::sleep(std::time::Duration::from_micros(100));
            assert_eq!(wakes(), woken, "the caller woke the worker for the rest");
            counted += 1;
            if counted == 5 {
                break;
            }
        }
        assert_eq!(read_u64(&vm, &t), round + 1);
    }
    assert!(counted > 0, "no round left the second kernel queued");
    vm.shutdown().unwrap();
}

/// A collective stream's thread that shares its CPU leaves its queued instructions, custom
/// ones included, to the caller that waits for them
/// (`StreamPolicy::caller_may_run_when_contended`): waiting for a thread that must first
/// get a CPU back is slower than running its work.
#[test]
// Waits in real time for the worker's states (minutes under Miri, which covers the VM's
// unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_caller_runs_a_contended_collective_streams_custom_instruction() {
    use std::sync::{Mutex, atomic::Ordering as O};
    let vm = crate::VirtualMachine::new(crate::Config::default()).unwrap();
    let s = vm
        .stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::Collective,
            thread_id: 0,
        })
        .unwrap();
    assert!(s.shared.policy.caller_may_run_when_contended());
    let worker = s.shared.thread.clone().expect("a thread of its own");
    // As a caller that sees itself share its CPU marks every worker (`CallerSense`).
    crate::engine::preemption::mark_contended(&worker, std::time::Duration::from_secs(600));
    worker
        .callers_contended_until
        .hold_for(std::time::Duration::from_secs(600));
    let t = vm.new_tensor(8).unwrap();
    let me = std::thread::current().id();
    let ran_on = Arc::new(Mutex::new(Vec::new()));
    for round in 0..20u64 {
        // The worker parks at once when idle (contended: no poll window); a push left to
        // its doze's deadline may still find it awake.
        spin_until("the worker never parked", || {
            worker.parked.load(O::Relaxed) && worker.queue.is_empty()
        });
        let r = ran_on.clone();
        vm.run(|b| {
            custom_write(b, &s, &t, round, move || {
                r.lock().unwrap().push(std::thread::current().id());
            })
        })
        .unwrap();
        assert_eq!(read_u64(&vm, &t), round);
    }
    let by_caller = ran_on
        .lock()
        .unwrap()
        .iter()
        .filter(|&&id| id == me)
        .count();
    assert!(
        by_caller > 0,
        "the caller ran none of 20 custom instructions"
    );
    vm.shutdown().unwrap();
}

/// A contended worker's dozes double while its callers run everything, up to
/// `WORKER_DOZE_MAX`, and start again at `WORKER_DOZE` once one finds work.
#[test]
fn a_contended_workers_dozes_grow_while_callers_run_everything() {
    use crate::engine::worker::next_contended_doze;
    use crate::util::tuning::{WORKER_DOZE, WORKER_DOZE_MAX};
    let mut d = WORKER_DOZE;
    let mut seen = vec![d];
    for _ in 0..10 {
        d = next_contended_doze(d, true);
        seen.push(d);
    }
    assert_eq!(seen[1], WORKER_DOZE * 2);
    assert!(seen.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(d, WORKER_DOZE_MAX);
    assert_eq!(next_contended_doze(d, false), WORKER_DOZE);
}

/// Binds the calling thread to the one CPU it runs on now; returns its mask before.
#[cfg(all(target_os = "linux", not(miri)))]
fn bind_to_current_cpu() -> libc::cpu_set_t {
    // SAFETY: plain data, all-zero valid; pid 0 is this thread; the pointers are valid
    // for the sizes passed; the CPU index comes from the kernel, below CPU_SETSIZE.
    unsafe {
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old),
            0
        );
        let cpu = usize::try_from(libc::sched_getcpu()).expect("sched_getcpu");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
            0
        );
        old
    }
}

/// A worker bound to its caller's CPU when it noted its mask, then re-bound to several
/// CPUs (as the demo moves its threads after its first epoch), is not taken for one that
/// shares the caller's CPU: a caller's look reads the worker's mask again on a match.
/// Before, the stale note marked it (and the VM's callers contended) until the worker's
/// next note, which an idle worker may not make for long.
#[test]
#[cfg(all(target_os = "linux", not(miri)))]
fn a_worker_rebound_off_the_callers_cpu_is_not_marked() {
    let old = bind_to_current_cpu();
    // SAFETY: `old` is a valid, initialised mask.
    let several = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &old) })
        .count()
        > 1;
    let vm = crate::VirtualMachine::new(crate::Config::default()).unwrap();
    let s = vm.default_stream();
    let worker = s.shared.thread.clone().expect("a worker");
    let t = vm.new_tensor(8).unwrap();
    spin_until("the worker never noted its CPU", || {
        worker.sole_cpu.load(ivm_core::sync::Ordering::Relaxed) != 0
            && worker.tid.load(ivm_core::sync::Ordering::Relaxed) != 0
    });
    if several {
        let tid = libc::pid_t::try_from(worker.tid.load(ivm_core::sync::Ordering::Relaxed))
            .expect("a thread id");
        // SAFETY: `tid` is the worker's thread (alive: the VM is); `old` is a valid mask
        // of the size passed.
        let rebound =
            unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &old) };
        assert_eq!(rebound, 0);
        // This thread's first call into the VM looks.
        vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
            .unwrap();
        assert_eq!(read_u64(&vm, &t), 1);
        assert!(
            !worker.same_cpu_until.holds(),
            "a worker re-bound off the caller's CPU was marked as sharing it"
        );
    }
    vm.shutdown().unwrap();
    // SAFETY: pid 0 is this thread; `old` is a valid mask of the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &old) };
}

/// A VM made by a thread bound to one CPU (its workers inherit the mask, as under
/// `mpirun`'s binding or `taskset`): the caller's first looks mark the workers bound to its
/// CPU contended, callers then run their work (at their waits, or at rest in their `run`s),
/// and an idle worker wakes at growing intervals.
#[test]
#[cfg(all(target_os = "linux", not(miri)))]
fn workers_bound_to_the_callers_cpu_leave_it_the_work() {
    let old = bind_to_current_cpu();
    let vm = crate::VirtualMachine::new(crate::Config::default()).unwrap();
    let s = vm.default_stream();
    let worker = s.shared.thread.clone().expect("a worker");
    let t = vm.new_tensor(8).unwrap();
    let mut round = 0u64;
    let mut step = |vm: &crate::VirtualMachine| {
        round += 1;
        let r = round;
        vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = r))
            .unwrap();
        assert_eq!(read_u64(vm, &t), r);
    };
    // The worker notes its mask as it starts; this thread's first call into a VM looks.
    spin_until("the worker never noted its CPU", || {
        worker.sole_cpu.load(ivm_core::sync::Ordering::Relaxed) != 0
    });
    step(&vm);
    // Set only by a caller's look: its first finds no switches to count, only this binding.
    assert!(
        worker.callers_contended(),
        "the worker bound to the caller's CPU was not marked at its first look"
    );
    for _ in 0..20 {
        step(&vm);
    }
    // Through the worker's queue at the wait (`caller_ran`), or at rest in the `run`
    // itself (`ran_at_rest`: the VM's callers are marked contended too).
    let stats = vm.stats().unwrap();
    assert!(
        stats.caller_ran + stats.ran_at_rest > 0,
        "no caller ran a kernel"
    );
    let parks = |vm: &crate::VirtualMachine| -> usize {
        vm.stats().unwrap().threads.iter().map(|t| t.parks).sum()
    };
    let before = parks(&vm);
    std::thread::sleep(std::time::Duration::from_millis(200));
    // At 500 µs a doze, a worker would park about 400 times; with the doze doubling up to
    // 8 ms, about 30. A loaded machine only wakes it less often.
    let n = parks(&vm) - before;
    assert!(n < 150, "idle workers parked {n} times in 200 ms");
    vm.shutdown().unwrap();
    // SAFETY: pid 0 is this thread; `old` is a valid mask of the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &old) };
}

/// A wait with a deadline of its own runs nothing itself: it wakes a worker asleep with
/// work that a caller's push left to its doze (here one whose dozes grew to 8 ms, as when
/// bound to the caller's CPU), rather than wait for the doze's deadline.
#[test]
// Waits in real time for the worker's states (minutes under Miri, which covers the VM's
// unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_timed_wait_wakes_a_worker_its_work_was_left_to() {
    let (vm, s, worker, t) = vm_with_a_contended_worker();
    let hold = std::time::Duration::from_secs(600);
    worker.callers_contended_until.hold_for(hold);
    worker.same_cpu_until.hold_for(hold);
    let wakes = |vm: &crate::VirtualMachine| -> usize {
        let stats = vm.stats().unwrap();
        let mine = stats.threads.iter().find(|t| t.name == worker.name);
        mine.expect("the worker's counters").wakes
    };
    // A doze after a wake is 500 µs again: a round whose thread is descheduled that long
    // between its push and its wait finds the kernel run at the deadline. Without the
    // wake, every round would.
    let mut woken = 0;
    for round in 0..10u64 {
        spin_until("the worker never dozed", || {
            worker.dozing.load(ivm_core::sync::Ordering::Relaxed) && worker.queue.is_empty()
        });
        let before = wakes(&vm);
        vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round))
            .unwrap();
        vm.sync_timeout(std::time::Duration::from_secs(10)).unwrap();
        woken += usize::from(wakes(&vm) > before);
        assert_eq!(read_u64(&vm, &t), round);
    }
    assert!(
        woken > 0,
        "the worker ran every kernel at its doze's deadline, never woken"
    );
    vm.shutdown().unwrap();
}

/// A wait hook that panics in `before_wait` while armed (once per arming): shared by the
/// run-at-rest and catch-up tests.
struct PanickingHook(Arc<std::sync::atomic::AtomicBool>);

impl crate::WaitHook for PanickingHook {
    fn before_wait(&self) {
        assert!(
            !self.0.swap(false, std::sync::atomic::Ordering::Relaxed),
            "the wait hook panics"
        );
    }
    fn after_wait(&self) {}
}

mod after_idle;
mod at_rest;
mod catch_up;
