//! The VM on a sim device with injected faults (`SimFaults`).
//!
//! Regression tests of the fault findings: a wait on device work that never completes is
//! bounded and its diagnostic names that work; a sync write whose completion reports a
//! device error poisons its tensor.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ivm_device::sim::{SimAdapter, SimConfig, SimFaults, sim_device};
use ivm_std::{Config, Diagnostic, Error, StreamId, VirtualMachine};

const PERIOD: Duration = Duration::from_millis(200);

/// A sim whose faults (`faults`) are off until `resume_faults`.
fn sim(faults: SimFaults) -> Arc<SimAdapter> {
    let sim = SimAdapter::new(SimConfig {
        faults: SimFaults { seed: 5, ..faults },
        ..SimConfig::default()
    });
    sim.heal();
    sim
}

fn stuck_events() -> SimFaults {
    SimFaults {
        event_never_completes: 1,
        ..SimFaults::NONE
    }
}

fn vm(sim: &Arc<SimAdapter>) -> Arc<VirtualMachine> {
    let config = Config::default().with_timeout_period(PERIOD);
    Arc::new(VirtualMachine::with_adapters(config, vec![sim.clone()]).unwrap())
}

/// Runs `f` on a thread of its own and returns its result, failing the test if it has
/// not returned within 10 s (a hang; the thread is left behind).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(v) => v,
        Err(_) => panic!("{what} hung on device work that never completes"),
    }
}

fn timeout_diagnostic(r: ivm_std::Result<()>) -> Diagnostic {
    match r {
        Err(Error::Timeout(d)) => d,
        other => panic!("expected a timeout, got {other:?}"),
    }
}

fn names_device_work(d: &Diagnostic, stream: &str) -> bool {
    d.lively.iter().any(|l| {
        l.name.starts_with("device work of ") && l.stream == stream && l.launched && !l.done
    })
}

/// A VM with one sim tensor written by a kernel on the device's default stream, all
/// complete; then the faults are turned on.
fn vm_with_device_work(sim: &Arc<SimAdapter>) -> (Arc<VirtualMachine>, StreamId) {
    let vm = vm(sim);
    let id = StreamId::compute(sim_device(0), 0);
    let s = vm.stream(id).unwrap();
    let x = vm.new_tensor_on(&s, 8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 7))
        .unwrap();
    vm.sync().unwrap();
    sim.resume_faults();
    (vm, id)
}

// Finding 1: `sync`, `sync_timeout`, `shutdown` and dropping the VM waited on a device
// `synchronize()` for as long as an event took: forever.

#[test]
fn sync_waits_for_stuck_device_work_at_most_one_period() {
    let sim = sim(stuck_events());
    let (vm, id) = vm_with_device_work(&sim);
    let v2 = vm.clone();
    let t0 = Instant::now();
    let d = timeout_diagnostic(bounded("sync", move || v2.sync()));
    assert!(t0.elapsed() < PERIOD * 5, "{:?}", t0.elapsed());
    assert!(names_device_work(&d, &id.to_string()), "{d}");
    let v2 = vm.clone();
    let d = timeout_diagnostic(bounded("sync_timeout", move || {
        v2.sync_timeout(Duration::from_millis(100))
    }));
    assert!(names_device_work(&d, &id.to_string()), "{d}");
    sim.heal();
    vm.sync().unwrap();
    vm.shutdown().unwrap();
}

#[test]
fn shutdown_waits_for_stuck_device_work_at_most_one_period_then_retries() {
    let sim = sim(stuck_events());
    let (vm, id) = vm_with_device_work(&sim);
    let v2 = vm.clone();
    let d = timeout_diagnostic(bounded("shutdown", move || v2.shutdown()));
    assert!(names_device_work(&d, &id.to_string()), "{d}");
    sim.heal();
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), ivm_std::DebugCounters::default());
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!((st.live_allocations, st.double_frees), (0, 0), "{st:?}");
}

#[test]
fn dropping_a_vm_with_stuck_device_work_returns() {
    let sim = sim(stuck_events());
    let (vm, _) = vm_with_device_work(&sim);
    bounded("dropping the VM", move || drop(vm));
    sim.heal();
}

#[test]
fn shutdown_with_an_instruction_whose_event_never_completes_is_bounded() {
    let sim = sim(stuck_events());
    let vm = vm(&sim);
    let cpu = vm
        .stream(StreamId::default_for(ivm_std::Device::CPU))
        .unwrap();
    let h2d = vm
        .stream(StreamId {
            device: sim_device(0),
            stream_type: ivm_std::StreamType::HostToDevice,
            thread_id: 0,
        })
        .unwrap();
    let (src, dst) = (
        vm.new_tensor_on(&cpu, 8).unwrap(),
        vm.new_tensor_on(&h2d, 8).unwrap(),
    );
    vm.sync().unwrap();
    sim.resume_faults();
    // Done when its event completes: never, so the engine stays lively.
    vm.run(|b| b.copy(&h2d, &src, &dst)).unwrap();
    drop((src, dst));
    let v2 = vm.clone();
    let d = timeout_diagnostic(bounded("shutdown", move || v2.shutdown()));
    assert!(
        d.lively
            .iter()
            .any(|l| l.name.starts_with("copy") && !l.done),
        "{d}"
    );
    sim.heal();
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), ivm_std::DebugCounters::default());
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!((st.live_allocations, st.double_frees), (0, 0), "{st:?}");
}

// Finding 2: a sync read behind a device-side wait on an event that never completes is
// done at launch (the engine released it), so its timeout diagnostic named nothing.

#[test]
fn a_read_stuck_behind_a_device_side_wait_names_the_device_work() {
    let sim = sim(stuck_events());
    let vm = vm(&sim);
    let default = StreamId::compute(sim_device(0), 0);
    let other = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
    let x = vm.new_tensor_on(&other, 8).unwrap();
    vm.run(|b| b.call(&other, &[], &[&x], |k| k.output_u64(0)[0] = 7))
        .unwrap();
    vm.sync().unwrap();
    // The read runs on the default stream: soft sync records an event on `other` (stuck)
    // and makes the default stream wait for it on the device.
    sim.resume_faults();
    let (v2, x2) = (vm.clone(), x.clone());
    let d = timeout_diagnostic(bounded("the read", move || {
        let mut out = [0u8; 8];
        v2.sync_read_small_mem(&x2, &mut out)
    }));
    assert!(names_device_work(&d, &default.to_string()), "{d}");
    assert!(
        d.lively
            .iter()
            .any(|l| l.name.contains("sync_read_small_mem")),
        "the diagnostic does not name the waited read: {d}"
    );
    sim.heal();
    let mut out = [0u8; 8];
    vm.sync_read_small_mem(&x, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 7);
    drop(x);
    vm.shutdown().unwrap();
}

// Finding 3: a sync write whose completion (the finisher queued after it on the device)
// picked up a device error returned the error but left the tensor unpoisoned.

#[test]
fn a_sync_write_that_observes_a_device_error_poisons_its_tensor() {
    let sim = sim(SimFaults {
        event_error: 1,
        ..SimFaults::NONE
    });
    let vm = vm(&sim);
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let other = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
    let x = vm.new_tensor_on(&s, 8).unwrap();
    let y = vm.new_tensor_on(&other, 8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 7))
        .unwrap();
    vm.sync().unwrap();
    // A kernel reading `x` on another stream has soft sync record an event on the
    // default stream, which completes with an error that no host-observed completion
    // takes (a device-side wait is no data instruction): the write on that stream is the
    // next to observe it.
    sim.resume_faults();
    vm.run(|b| {
        b.call(&other, &[&x], &[&y], |k| {
            k.output_u64(0)[0] = k.input_u64(0)[0];
        })
    })
    .unwrap();
    let r = vm.sync_write_small_mem(&x, &9u64.to_ne_bytes());
    sim.heal();
    let Err(Error::Poisoned { instruction, .. }) = r else {
        panic!("the write did not observe the device error: {r:?}");
    };
    assert!(
        instruction.starts_with("sync_write_small_mem"),
        "{instruction}"
    );
    let mut out = [0u8; 8];
    match vm.sync_read_small_mem(&x, &mut out) {
        Err(Error::Poisoned { instruction: i, .. }) => assert_eq!(i, instruction),
        other => panic!(
            "after a failed write the tensor reads {other:?} ({})",
            u64::from_ne_bytes(out)
        ),
    }
    drop((x, y));
    vm.shutdown().unwrap();
}
