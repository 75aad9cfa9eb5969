//! A burst of work after an idle spell: the fourth instruction callers queue together to a
//! worker in an idle doze wakes it (`ThreadCtx::submit`, `IDLE_BURST`), and a caller that
//! runs a sleeping worker's queue in its wait stops once after an instruction the engine
//! marked awaited (`worker::WaitingCaller`), here the one its read waits for, leaving the
//! rest to the worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{read_u64, until_idle_doze};
use crate::model::instruction::{Instruction, Kind};
use crate::util::ids::StreamType;
use crate::util::tuning::IDLE_BURST;
use crate::{Config, Device, StreamId, VirtualMachine};

/// Rounds the read test tries before it gives up on seeing what it looks for: each round
/// must land its pushes within one idle doze (100 µs), which a loaded machine often takes
/// from it.
const ROUNDS: u64 = 60;

/// Rounds that must show it: a push that lands just as a doze ends may make a round look
/// right without the rule now and then (the worker running part of the queue at its
/// deadline).
const SEEN: usize = 5;

/// Instructions the VM's callers ran from its workers' queues so far: a counter read, cheap
/// enough inside the window of a doze (`VirtualMachine::stats` allocates and locks).
fn caller_ran(vm: &VirtualMachine) -> usize {
    // Relaxed: a statistic, read by the thread that runs the test's calls.
    vm.shared().core.stats().caller_ran.load(Ordering::Relaxed)
}

/// A queue with no worker thread behind it (the test plays the worker), in an idle doze.
fn idle_dozing_queue(r: &super::Rig) -> Arc<crate::model::thread_ctx::ThreadCtx> {
    let ctx = r.streams[0]
        .thread
        .clone()
        .expect("the rig's streams have a context");
    // Relaxed: the hints `submit` reads, set as `Worker::park` sets them before its doze.
    ctx.idle_pushes.store(0, Ordering::Relaxed);
    ctx.idle_doze.store(true, Ordering::Relaxed);
    crate::model::thread_ctx::doze(&ctx.dozing);
    ctx
}

/// A caller's push to `ctx` of an instruction a caller may run, no wake deferred to it.
fn push_op(r: &super::Rig, ctx: &crate::model::thread_ctx::ThreadCtx) {
    let i = Arc::new(Instruction::new("op", r.streams[0].clone(), Kind::Noop));
    ctx.submit(&i, false, true, true);
}

#[test]
fn the_burst_th_instruction_queued_together_wakes_an_idle_dozing_worker() {
    let r = super::Rig::new(1);
    let ctx = idle_dozing_queue(&r);
    let push = || push_op(&r, &ctx);
    for k in 1..IDLE_BURST {
        push();
        assert_eq!(
            ctx.notifier.pending(),
            0,
            "push {k} of {IDLE_BURST} woke it"
        );
    }
    push();
    assert_eq!(
        ctx.notifier.pending(),
        1,
        "the {IDLE_BURST}th push left it asleep"
    );
    while ctx.try_pop().is_some() {}
}

#[test]
fn an_op_then_its_read_never_wakes_an_idle_dozing_worker() {
    // Each op run by its caller before the next is pushed (as a read runs it): every push
    // finds the queue empty, so none makes a burst, however many there are; a burst after
    // them still does.
    let r = super::Rig::new(1);
    let ctx = idle_dozing_queue(&r);
    let push = || push_op(&r, &ctx);
    for _ in 0..4 * IDLE_BURST {
        push();
        assert!(ctx.try_pop().is_some());
    }
    assert_eq!(ctx.notifier.pending(), 0, "a push woke it");
    for _ in 0..IDLE_BURST {
        push();
    }
    assert_eq!(
        ctx.notifier.pending(),
        1,
        "the burst after them left it asleep"
    );
    while ctx.try_pop().is_some() {}
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_read_runs_a_sleeping_workers_queue_only_up_to_what_it_waits_for() {
    // Ops on a compute stream (its own worker), then a read of what the first one wrote
    // (on the default stream: another worker, an edge across streams). Fewer ops than
    // wake a dozing worker: the reader finds them queued to it. It runs the first, which
    // its read waits for, and leaves the others to the worker (woken by its let-go).
    let vm = VirtualMachine::new(Config::default().with_run_at_rest(false)).unwrap();
    // Thread 1: a compute stream with a worker of its own, as the training demo's (the
    // default stream is thread 0's).
    let c = vm
        .stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::Compute,
            thread_id: 1,
        })
        .unwrap();
    let worker = c
        .shared
        .thread
        .clone()
        .expect("a compute stream has a worker");
    let (t, u) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    vm.run(|b| b.call(&c, &[], &[&t], |_| {})).unwrap();
    vm.sync().unwrap();
    // The first op and these: one fewer than wakes the worker, at least one after it.
    const { assert!(IDLE_BURST >= 3, "no op after the first") };
    let after_first = IDLE_BURST - 2;
    let (mut stopped, mut rounds) = (0, 0u64);
    for round in 0..ROUNDS {
        if stopped >= SEEN {
            break;
        }
        rounds += 1;
        until_idle_doze(&vm, &c, &worker);
        let ran0 = caller_ran(&vm);
        vm.run(|b| b.call(&c, &[], &[&t], move |k| k.output_u64(0)[0] = round))
            .unwrap();
        for _ in 0..after_first {
            vm.run(|b| b.call(&c, &[], &[&u], |k| k.output_u64(0)[0] += 1))
                .unwrap();
        }
        assert_eq!(read_u64(&vm, &t), round);
        // The caller ran the first op, not the ones after it (nor the read, which the
        // engine hands it). Without the stop it runs all or none of them (the worker
        // woken first).
        if caller_ran(&vm) - ran0 == 1 {
            stopped += 1;
        }
        vm.sync().unwrap();
    }
    assert!(
        stopped >= SEEN,
        "a read stopped after the op it waited for in {stopped} of {rounds} rounds"
    );
    // Nothing the worker was left went missing.
    assert_eq!(read_u64(&vm, &u), rounds * after_first as u64);
    vm.shutdown().unwrap();
}
