//! A burst of work after an idle spell: the fourth instruction a caller queues to a worker
//! in an idle doze wakes it (`ThreadCtx::submit`, `IDLE_BURST`), and a caller that runs a
//! sleeping worker's queue in its wait stops after the instruction its read waits for
//! (`worker::WaitingCaller`), leaving the rest to the worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{read_u64, spin_until, until_idle_doze};
use crate::util::ids::StreamType;
use crate::util::tuning::IDLE_BURST;
use crate::{Config, Device, StreamId, VirtualMachine};

/// Rounds a test tries before it gives up on seeing what it looks for: each round must
/// land its pushes within one idle doze (100 µs), which a loaded machine often takes from
/// it.
const ROUNDS: u64 = 60;

/// The worker's wakes by a notification so far (not its doze deadlines).
fn notified_wakes(vm: &VirtualMachine, name: &str) -> usize {
    vm.stats()
        .unwrap()
        .threads
        .iter()
        .find(|t| t.name == name)
        .map_or(0, |t| t.wakes)
}

#[test]
// Waits in real time for the worker's idle states (minutes under Miri, which covers the
// VM's unsafe code in `tests/miri_vm.rs`).
#[cfg_attr(miri, ignore)]
fn a_burst_of_pushes_wakes_an_idle_dozing_worker() {
    // No run at rest (a run of tiny kernels would run on this caller), nothing waited for:
    // the pushes alone decide whether the worker wakes before its doze's deadline.
    let (vm, s, worker, t) = super::vm_with_a_worker_in(Config::default().with_run_at_rest(false));
    vm.run(|b| b.call(&s, &[], &[&t], |_| {})).unwrap();
    vm.sync().unwrap();
    // Several rounds: a push that lands just as a doze ends may wake the worker without
    // the burst now and then (its notification left pending for the next doze).
    const WOKEN: usize = 5;
    let mut woken = 0;
    for _ in 0..ROUNDS {
        if woken >= WOKEN {
            break;
        }
        until_idle_doze(&vm, &s, &worker);
        let wakes = notified_wakes(&vm, &worker.name);
        let ran = Arc::new(AtomicUsize::new(0));
        for _ in 0..IDLE_BURST {
            let ran = ran.clone();
            vm.run(|b| {
                b.call(&s, &[], &[&t], move |_| {
                    ran.fetch_add(1, Ordering::Release);
                })
            })
            .unwrap();
        }
        // Nobody calls into the VM meanwhile (a wait would wake it, or run the work):
        // the worker runs them when woken, or at its doze's deadline.
        spin_until("the pushes never ran", || {
            ran.load(Ordering::Acquire) == IDLE_BURST
        });
        if notified_wakes(&vm, &worker.name) > wakes {
            woken += 1;
        }
    }
    assert!(
        woken >= WOKEN,
        "{IDLE_BURST} pushes to an idle dozing worker woke it in {woken} of {ROUNDS} rounds"
    );
    vm.shutdown().unwrap();
}

#[test]
// As above.
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
    let after_first = IDLE_BURST - 2;
    let (mut stopped, mut rounds) = (0, 0u64);
    for round in 0..ROUNDS {
        if stopped > 0 {
            break;
        }
        rounds += 1;
        until_idle_doze(&vm, &c, &worker);
        let ran0 = vm.stats().unwrap().caller_ran;
        vm.run(|b| b.call(&c, &[], &[&t], move |k| k.output_u64(0)[0] = round))
            .unwrap();
        for _ in 0..after_first {
            vm.run(|b| b.call(&c, &[], &[&u], |k| k.output_u64(0)[0] += 1))
                .unwrap();
        }
        assert_eq!(read_u64(&vm, &t), round);
        // The caller ran the first op (and perhaps the read's own instruction), not the
        // ones after it.
        let ran = vm.stats().unwrap().caller_ran - ran0;
        if (1..=2).contains(&ran) {
            stopped += 1;
        }
        vm.sync().unwrap();
    }
    assert!(
        stopped > 0,
        "no read stopped after the op it waited for in {ROUNDS} rounds"
    );
    // Nothing the worker was left went missing.
    assert_eq!(read_u64(&vm, &u), rounds * after_first as u64);
    vm.shutdown().unwrap();
}
