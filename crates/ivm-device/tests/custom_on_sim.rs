//! Custom instructions (`InstructionsBuilder::custom`) on an asynchronous device: the
//! sim, on queued streams (kernels run in its queue) and on launcher streams (the mode
//! cuda's streams have), each test as `queued::<test>` and `launcher::<test>`. On a queued
//! stream the policy's launch runs in the device's stream order (it sees what the kernels
//! before it wrote); on a launcher stream it runs on the worker and enqueues its work on
//! the device stream lent to it (`KernelCtx::device_stream`, `KernelCtx::on_host`). Its
//! handle completes it later from another thread, and what follows reads its output; a
//! poisoned operand is announced to the policy instead of a launch; a device that refuses
//! the launch (or, on a launcher stream, the policy's work) fails the instruction with an
//! error naming it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::host;
use ivm_device::sim::{SimAdapter, SimConfig, SimFaults, sim_device};
use ivm_std::{Config, Done, Error, InstructionPolicy, KernelCtx, Mode, StreamId, VirtualMachine};

kernel_modes!(
    a_custom_instruction_runs_in_device_order_and_completes_later,
    a_poisoned_operand_is_announced_instead_of_a_launch,
    a_device_that_refuses_the_launch_fails_the_instruction,
    a_failed_custom_instruction_does_not_poison_an_earlier_reader_still_queued,
);

fn sim(mut config: SimConfig, launcher: bool) -> Arc<SimAdapter> {
    config.launcher = launcher;
    SimAdapter::new(config)
}

fn vm(sim: &Arc<SimAdapter>, mode: Mode) -> VirtualMachine {
    let config = Config::default()
        .with_mode(mode)
        .with_timeout_period(Duration::from_secs(5));
    VirtualMachine::with_adapters(config, vec![sim.clone()]).unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &ivm_std::Tensor) -> Result<u64, Error> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn a_custom_instruction_runs_in_device_order_and_completes_later(launcher: bool) {
    for mode in [Mode::MultiThread, Mode::SingleThread] {
        let sim = sim(SimConfig::random(1, 0xc0ffee), launcher);
        let vm = vm(&sim, mode);
        let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
        let (t, u, v) = (
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
        );
        for round in 0..20u64 {
            vm.run(|b| {
                b.call(&s, &[], &[&t], host(move |k| k.output_u64(0)[0] = round))?;
                b.custom(
                    &s,
                    &[&t],
                    &[&u],
                    move |k: &mut KernelCtx<'_>, done: Done| {
                        // In device order: the kernel before it has written `t`.
                        k.on_host(|k| k.output_u64(0)[0] = 2 * k.input_u64(0)[0] + 1)
                            .unwrap();
                        let fire = move || {
                            std::thread::spawn(move || {
                                std::thread::sleep(Duration::from_millis(1));
                                done.complete().unwrap();
                            });
                        };
                        match k.device_stream() {
                            // A launcher device lends its stream: the handle fires once the
                            // device ran the work enqueued above.
                            Some(d) => {
                                assert!(launcher, "a queued device lends no stream");
                                d.launch_host(Box::new(fire)).unwrap();
                            }
                            None => {
                                assert!(!launcher, "a launcher device lends its stream");
                                fire();
                            }
                        }
                    },
                )?;
                b.call(
                    &s,
                    &[&u],
                    &[&v],
                    host(|k| {
                        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
                    }),
                )
            })
            .unwrap();
            assert_eq!(read_u64(&vm, &v).unwrap(), 2 * round + 2, "{mode:?}");
        }
        drop((t, u, v));
        vm.shutdown().unwrap();
    }
}

/// A policy that records whether it was launched or told of a poisoned operand.
struct Watch {
    launched: Arc<AtomicBool>,
    poisoned: Arc<AtomicBool>,
}

impl InstructionPolicy for Watch {
    fn launch(self: Box<Self>, _ctx: &mut KernelCtx<'_>, done: Done) {
        self.launched.store(true, Ordering::Relaxed);
        let _ = done.complete();
    }
    fn poisoned(&mut self, _error: &Error) {
        self.poisoned.store(true, Ordering::Relaxed);
    }
}

fn a_poisoned_operand_is_announced_instead_of_a_launch(launcher: bool) {
    let sim = sim(SimConfig::random(1, 7), launcher);
    let vm = vm(&sim, Mode::MultiThread);
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let (t, u) = (
        vm.new_tensor_on(&s, 8).unwrap(),
        vm.new_tensor_on(&s, 8).unwrap(),
    );
    let (launched, poisoned) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let policy = Watch {
        launched: launched.clone(),
        poisoned: poisoned.clone(),
    };
    ivm_std::fuzzing::silence_planned_panics();
    vm.run(|b| {
        // Fails where the body runs: in the device queue on a queued stream (the policy,
        // in stream order after it, sees the poison), on the worker on a launcher stream
        // (the poison is in place before the next launch). A launcher kernel's host work
        // failing on the device is not known when the policy is launched.
        b.call_named("bad", &s, &[], &[&t], |_| {
            panic!("{} in the producer", ivm_std::fuzzing::PANIC_MARKER)
        })?;
        b.custom_named("watched", &s, &[&t], &[&u], policy)
    })
    .unwrap();
    match read_u64(&vm, &u) {
        Err(Error::Poisoned { instruction, .. }) => assert!(instruction.starts_with("bad#")),
        other => panic!("the custom instruction's output reads {other:?}"),
    }
    assert!(poisoned.load(Ordering::Relaxed), "the policy was not told");
    assert!(
        !launched.load(Ordering::Relaxed),
        "a poisoned instruction launched"
    );
    let _ = vm.sync();
    drop((t, u));
    vm.shutdown().unwrap();
}

fn a_device_that_refuses_the_launch_fails_the_instruction(launcher: bool) {
    let sim = sim(
        SimConfig {
            faults: SimFaults {
                seed: 3,
                kernel_launch_fail: 1,
                ..SimFaults::NONE
            },
            ..SimConfig::default()
        },
        launcher,
    );
    sim.heal();
    let vm = vm(&sim, Mode::MultiThread);
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let u = vm.new_tensor_on(&s, 8).unwrap();
    let launched = Arc::new(AtomicBool::new(false));
    let l2 = launched.clone();
    sim.resume_faults();
    vm.run(|b| {
        b.custom_named(
            "refused",
            &s,
            &[],
            &[&u],
            move |k: &mut KernelCtx<'_>, done: Done| {
                // On a launcher stream the policy runs (on the worker) and the device
                // refuses its work; on a queued one the device refuses the policy itself.
                match k.on_host(move |_| l2.store(true, Ordering::Relaxed)) {
                    Ok(()) => drop(done.complete()),
                    Err(e) => drop(done.fail(e.to_string())),
                }
            },
        )
    })
    .unwrap();
    let _ = vm.sync();
    sim.heal();
    match read_u64(&vm, &u) {
        Err(Error::Poisoned {
            instruction,
            message,
        }) => {
            assert!(instruction.starts_with("refused#"), "{instruction}");
            assert!(message.contains("launch failed"), "{message}");
        }
        other => panic!("the refused instruction's output reads {other:?}"),
    }
    assert!(!launched.load(Ordering::Relaxed));
    drop(u);
    vm.shutdown().unwrap();
}

/// A custom instruction that fails at once (its policy fails its handle during launch)
/// while an earlier reader of its output is still queued on the device: the reader must
/// not see the later instruction's failure. On a launcher stream the policy runs on the
/// worker, ahead of the device.
fn a_failed_custom_instruction_does_not_poison_an_earlier_reader_still_queued(launcher: bool) {
    let sim = sim(SimConfig::default(), launcher);
    let vm = vm(&sim, Mode::MultiThread);
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let (t, u, x) = (
        vm.new_tensor_on(&s, 8).unwrap(),
        vm.new_tensor_on(&s, 8).unwrap(),
        vm.new_tensor_on(&s, 8).unwrap(),
    );
    vm.write_small(&t, 0, &5u64.to_ne_bytes()).unwrap();
    // A blocker the device runs until released, then the reader queued behind it.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let blocked = Arc::new(AtomicBool::new(false));
    let b2 = blocked.clone();
    vm.run(|b| {
        b.call_named(
            "blocker",
            &s,
            &[],
            &[&x],
            host(move |_| {
                b2.store(true, Ordering::Release);
                let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(10));
            }),
        )?;
        b.call_named(
            "reader",
            &s,
            &[&t],
            &[&u],
            host(|k| k.output_u64(0)[0] = k.input_u64(0)[0] + 1),
        )?;
        b.custom_named(
            "failing",
            &s,
            &[],
            &[&t],
            |_k: &mut KernelCtx<'_>, done: Done| drop(done.fail("the policy gave up")),
        )
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    while !blocked.load(Ordering::Acquire) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the blocker never ran"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The failing instruction fails meanwhile (on a launcher stream; on a queued one it
    // waits in the device queue behind the reader).
    std::thread::sleep(Duration::from_millis(20));
    go_tx.send(()).unwrap();
    vm.sync().unwrap();
    match read_u64(&vm, &t) {
        Err(Error::Poisoned { instruction, .. }) => {
            assert!(instruction.starts_with("failing#"), "{instruction}")
        }
        other => panic!("the failed instruction left its output readable: {other:?}"),
    }
    assert_eq!(
        read_u64(&vm, &u).expect("the earlier reader saw a later instruction's failure"),
        6
    );
    drop((t, u, x));
    vm.shutdown().unwrap();
}
