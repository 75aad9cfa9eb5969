//! A worker behind long kernels leaves the release of a finished instruction to whoever
//! drives the engine next when nothing waits for that release (ARCHITECTURE.md, "Who may
//! drive the engine": an *unawaited* debt). These check the two ways something can wait
//! for it without driving, each with a kernel that blocks until that something happened
//! and a caller that, meanwhile, does not call into the VM: a deferred release would hang
//! both (the kernels give up after a while and report it, so a failure is an assertion,
//! not a hang).
//!
//! * a successor on another stream (the engine tells the instruction it is awaited:
//!   `ivm_engine::Instruction::awaited`), or a barrier received before it was released
//!   (told at its dispatch, or when the barrier arrives while it runs);
//! * a successor of *another* instruction, which the worker's kernel completed (a custom
//!   instruction's `Done`): the completion only marks the engine on a VM thread, so the
//!   worker must drive after that kernel whatever its own release waits for;
//! * a submitter waiting for backpressure (it pays a debt it finds, and a worker that
//!   sees it waiting pays its own: one round of each).
//!
//! And one thing that must not look like a stall: a read behind a long queue whose
//! releases are left for later still sees progress (the waits' stall detectors count
//! finished instructions, not only released ones).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use std::sync::Mutex;

use ivm_std::{
    Config, Device, Done, InstructionsBuilder, KernelCtx, Stream, StreamId, StreamType, Tensor,
    VirtualMachine,
};

/// The default configuration with `IVM_FUSION` (`1` / `0`) applied, if set: CI's fusion
/// lane runs these tests with the other fusion setting than the default.
fn base() -> Config {
    match std::env::var("IVM_FUSION").as_deref() {
        Ok("1") => Config::default().with_fusion(true),
        Ok("0") => Config::default().with_fusion(false),
        _ => Config::default(),
    }
}

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
    let vm = VirtualMachine::new(base()).unwrap();
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
fn a_barrier_waiting_for_a_finished_kernel_is_not_stranded() {
    let vm = VirtualMachine::new(base()).unwrap();
    let a = compute(&vm, 1);
    let (x, y) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    warm_up(&vm, &a, &y);
    for round in 0..20 {
        // Even rounds: the barrier is received with `first`, before its dispatch (told at
        // the dispatch). Odd rounds: in a later submission, while `first` runs (every
        // running instruction is told when a barrier arrives); should `first` have
        // finished by then, that submission's own drive releases it, and the round checks
        // nothing more than an even one.
        let late = round % 2 == 1;
        let flag = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = mpsc::channel();
        let (f1, f2) = (flag.clone(), flag.clone());
        let first = if late {
            Duration::from_millis(3)
        } else {
            Duration::from_micros(50)
        };
        // `first` writes x on stream a; the barrier waits for its release; `blocked`,
        // received after the barrier (which does not hold it back) and queued behind
        // `first` on the same stream (so nothing else waits for that release), waits for
        // the barrier's callback. The worker of a finishes `first` with `blocked` queued.
        let submit_first = |bl: &mut InstructionsBuilder<'_>| {
            bl.call_named("first", &a, &[], &[&x], move |_| spin(first))
        };
        let (a2, x2, y2) = (&a, &x, &y);
        let then_barrier = move |bl: &mut InstructionsBuilder<'_>| {
            bl.barrier(move || f1.store(true, Ordering::Release))?;
            bl.call_named("blocked", a2, &[x2], &[y2], move |_| {
                let _ = done_tx.send(wait_for(&f2));
            })
        };
        if late {
            vm.run(submit_first).unwrap();
            std::thread::sleep(Duration::from_millis(1));
            vm.run(then_barrier).unwrap();
        } else {
            vm.run(|bl| {
                submit_first(bl)?;
                then_barrier(bl)
            })
            .unwrap();
        }
        // Not a VM call: this thread drives nothing while it waits.
        let saw_barrier = done_rx.recv_timeout(GIVE_UP * 2).unwrap();
        assert!(
            saw_barrier,
            "round {round}: the barrier never ran (the release of `first` was left for later)"
        );
    }
    vm.sync().unwrap();
}

#[test]
fn a_kernel_completing_an_awaited_custom_instruction_has_it_released() {
    let vm = VirtualMachine::new(base()).unwrap();
    let (a, b, c) = (compute(&vm, 1), compute(&vm, 2), compute(&vm, 3));
    let (p, y) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    warm_up(&vm, &a, &y);
    for round in 0..10 {
        let slot: Arc<Mutex<Option<Done>>> = Arc::new(Mutex::new(None));
        let flag = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = mpsc::channel();
        let (s1, s2, f1, f2) = (slot.clone(), slot.clone(), flag.clone(), flag.clone());
        vm.run(|bl| {
            // `pending` (stream c) completes later, through its `Done`; `reader` (stream
            // b) waits for its release; on stream a, `fires` completes it and `blocked`,
            // queued behind it, waits for `reader`.
            bl.custom_named(
                "pending",
                &c,
                &[],
                &[&p],
                move |_: &mut KernelCtx<'_>, done: Done| {
                    *s1.lock().unwrap() = Some(done);
                },
            )?;
            bl.call_named("reader", &b, &[&p], &[], move |_| {
                f1.store(true, Ordering::Release);
            })?;
            bl.call_named("fires", &a, &[], &[&y], move |_| {
                let t = Instant::now();
                while t.elapsed() < GIVE_UP {
                    if let Some(done) = s2.lock().unwrap().take() {
                        // Long enough for `reader` to be waiting on the engine's edge.
                        spin(Duration::from_micros(300));
                        done.complete().unwrap();
                        break;
                    }
                    std::hint::spin_loop();
                }
            })?;
            bl.call_named("blocked", &a, &[&y], &[], move |_| {
                let _ = done_tx.send(wait_for(&f2));
            })
        })
        .unwrap();
        // Not a VM call: this thread drives nothing while it waits.
        let saw_reader = done_rx.recv_timeout(GIVE_UP * 2).unwrap();
        assert!(
            saw_reader,
            "round {round}: the reader of the completed custom instruction was never dispatched"
        );
    }
    vm.sync().unwrap();
}

#[test]
fn a_read_behind_a_queue_whose_releases_wait_sees_progress() {
    // A stall is `timeout_period` without progress; the queue below runs longer than that
    // with every release left for the read's own drive (same-stream successors await
    // nothing).
    let config = base().with_timeout_period(Duration::from_millis(100));
    let vm = VirtualMachine::new(config).unwrap();
    let a = compute(&vm, 1);
    let t = vm.new_tensor(8).unwrap();
    warm_up(&vm, &a, &t);
    vm.run(|bl| {
        for _ in 0..8 {
            bl.call(&a, &[], &[&t], |_| spin(Duration::from_millis(40)))?;
        }
        Ok(())
    })
    .unwrap();
    let mut out = [0u8; 8];
    vm.read_small(&t, 0, &mut out)
        .expect("no stall: kernels kept finishing");
}

#[test]
fn a_submitter_waiting_for_backpressure_is_not_stranded_by_a_deferred_release() {
    // More than two in flight blocks a submission until fewer than two are.
    let config = base().with_high_water_mark(2).with_low_water_mark(2);
    let vm = Arc::new(VirtualMachine::new(config).unwrap());
    let (a, b) = (compute(&vm, 1), compute(&vm, 2));
    let (x, y, z) = (
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
    );
    warm_up(&vm, &a, &y);
    for round in 0..10 {
        // Even rounds: the submitter comes after the worker kept its debt (it finds the
        // mark and pays). Odd rounds: it waits before the kernels finish (the worker sees
        // it and pays).
        let late = round % 2 == 0;
        let kernel = if late {
            Duration::from_micros(20)
        } else {
            Duration::from_millis(2)
        };
        let flag = Arc::new(AtomicBool::new(false));
        let saw = Arc::new(AtomicBool::new(false));
        let (f, s) = (flag.clone(), saw.clone());
        // Three short kernels, then one that waits for `flag`, which the next
        // submission's kernel sets: that submission finds four in flight and waits until
        // the three finished ones are released. (One `run`: a submission waits for
        // backpressure before it is received, not after.)
        vm.run(|bl| {
            for _ in 0..3 {
                bl.call(&a, &[], &[&x], move |_| spin(kernel))?;
            }
            // It writes x as well: queued behind the three (ready work of a stream is
            // dispatched in the order it became ready, not in submission order).
            bl.call_named("blocked", &a, &[], &[&x], move |_| {
                s.store(wait_for(&f), Ordering::Release);
            })
        })
        .unwrap();
        if late {
            // Let the worker finish the three (and start `blocked`) before we submit.
            std::thread::sleep(Duration::from_millis(2));
        }
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
