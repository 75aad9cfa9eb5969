//! A worker behind long kernels leaves the release of a finished instruction to whoever
//! drives the engine next when nothing waits for that release (ARCHITECTURE.md, "Who may
//! drive the engine": an *unawaited* debt). These check the two ways something can wait
//! for it without driving, each with a kernel that blocks until that something happened
//! and a caller that, meanwhile, does not call into the VM: a deferred release would hang
//! both (the kernels give up after a while and report it, so a failure is an assertion,
//! not a hang).
//!
//! * a successor on another stream (the engine tells the instruction it is awaited:
//!   `ivm_engine::Instruction::awaited`);
//! * a submitter waiting for backpressure (it pays a debt it finds, and a worker that
//!   sees it waiting pays its own).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ivm_std::{Config, Device, Stream, StreamId, StreamType, Tensor, VirtualMachine};

/// How long a blocked kernel waits before it gives up (and the test fails).
const GIVE_UP: Duration = Duration::from_secs(5);

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn compute(vm: &VirtualMachine, thread_id: u32) -> Stream {
    vm.stream(StreamId {
        device: Device::CPU,
        stream_type: StreamType::Compute,
        thread_id,
    })
    .unwrap()
}

/// Kernels of 20 µs on `s` until its worker counts as running long kernels (the only
/// workers that leave releases for later).
fn warm_up(vm: &VirtualMachine, s: &Stream, t: &Tensor) {
    for _ in 0..64 {
        vm.run(|b| b.call(s, &[], &[t], |_| spin(Duration::from_micros(20))))
            .unwrap();
    }
    vm.sync().unwrap();
}

/// Waits (outside the VM) until `flag` is set, for [`GIVE_UP`] at most; whether it was.
fn wait_for(flag: &AtomicBool) -> bool {
    let t = Instant::now();
    while !flag.load(Ordering::Acquire) {
        if t.elapsed() > GIVE_UP {
            return false;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    true
}

#[test]
fn a_kernel_waiting_for_another_streams_reader_of_its_predecessor_is_not_stranded() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (a, b) = (compute(&vm, 1), compute(&vm, 2));
    let (x, y) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    warm_up(&vm, &a, &y);
    for round in 0..20 {
        let flag = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = mpsc::channel();
        let (f1, f2) = (flag.clone(), flag.clone());
        vm.run(|bl| {
            // `first` writes x on stream a; `reader` (stream b) reads it, so it waits for
            // `first`'s release; `blocked` reads it too, on stream a (queued behind
            // `first`: an edge of one stream), and waits for `reader`. The worker of a
            // finishes `first` with `blocked` queued.
            bl.call_named("first", &a, &[], &[&x], |_| {
                spin(Duration::from_micros(50));
            })?;
            bl.call_named("reader", &b, &[&x], &[], move |_| {
                f1.store(true, Ordering::Release);
            })?;
            bl.call_named("blocked", &a, &[&x], &[&y], move |_| {
                let _ = done_tx.send(wait_for(&f2));
            })
        })
        .unwrap();
        // Not a VM call: this thread drives nothing while it waits.
        let saw_reader = done_rx.recv_timeout(GIVE_UP * 2).unwrap();
        assert!(
            saw_reader,
            "round {round}: the reader of `first` was never dispatched (its release was left for later)"
        );
    }
    vm.sync().unwrap();
}

#[test]
fn a_submitter_waiting_for_backpressure_is_not_stranded_by_a_deferred_release() {
    // More than two in flight blocks a submission until fewer than two are.
    let config = Config::default()
        .with_high_water_mark(2)
        .with_low_water_mark(2);
    let vm = Arc::new(VirtualMachine::new(config).unwrap());
    let (a, b) = (compute(&vm, 1), compute(&vm, 2));
    let (x, y, z) = (
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
    );
    warm_up(&vm, &a, &y);
    for round in 0..10 {
        let flag = Arc::new(AtomicBool::new(false));
        let saw = Arc::new(AtomicBool::new(false));
        let (f, s) = (flag.clone(), saw.clone());
        // Three short kernels, then one that waits for `flag`, which the next
        // submission's kernel sets: that submission finds four in flight and waits until
        // the three finished ones are released. (One `run`: a submission waits for
        // backpressure before it is received, not after.)
        vm.run(|bl| {
            for _ in 0..3 {
                bl.call(&a, &[], &[&x], |_| spin(Duration::from_micros(20)))?;
            }
            // It writes x as well: queued behind the three (ready work of a stream is
            // dispatched in the order it became ready, not in submission order).
            bl.call_named("blocked", &a, &[], &[&x], move |_| {
                s.store(wait_for(&f), Ordering::Release);
            })
        })
        .unwrap();
        // Let the worker finish the three (and start `blocked`) before we submit.
        std::thread::sleep(Duration::from_millis(2));
        let f = flag.clone();
        vm.run(|bl| {
            bl.call_named("opener", &b, &[], &[&z], move |_| {
                f.store(true, Ordering::Release);
            })
        })
        .unwrap();
        vm.sync().unwrap();
        assert!(
            saw.load(Ordering::Acquire),
            "round {round}: the backpressured submission waited for releases left for later"
        );
    }
}
