//! Custom instructions (`InstructionsBuilder::custom`) on an asynchronous device: the
//! sim, whose kernels run in its queue. The policy's launch runs in the device's stream
//! order (it sees what the kernels before it wrote), its handle completes it later from
//! another thread, and what follows reads its output; a poisoned operand is announced to
//! the policy instead of a launch; a device that refuses the launch fails the instruction
//! with an error naming it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ivm_device::sim::{SimAdapter, SimConfig, SimFaults, sim_device};
use ivm_std::{Config, Done, Error, InstructionPolicy, KernelCtx, Mode, StreamId, VirtualMachine};

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

#[test]
fn a_custom_instruction_runs_in_device_order_and_completes_later() {
    for mode in [Mode::MultiThread, Mode::SingleThread] {
        let sim = SimAdapter::new(SimConfig::random(1, 0xc0ffee));
        let vm = vm(&sim, mode);
        let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
        let (t, u, v) = (
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
        );
        for round in 0..20u64 {
            vm.run(|b| {
                b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = round)?;
                b.custom(&s, &[&t], &[&u], |k: &mut KernelCtx<'_>, done: Done| {
                    // In device order: the kernel before it has written `t`.
                    k.output_u64(0)[0] = 2 * k.input_u64(0)[0] + 1;
                    assert!(
                        k.device_stream().is_none(),
                        "a queued device lends no stream"
                    );
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(1));
                        done.complete().unwrap();
                    });
                })?;
                b.call(&s, &[&u], &[&v], |k| {
                    k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
                })
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

#[test]
fn a_poisoned_operand_is_announced_instead_of_a_launch() {
    let sim = SimAdapter::new(SimConfig::random(1, 7));
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

#[test]
fn a_device_that_refuses_the_launch_fails_the_instruction() {
    let sim = SimAdapter::new(SimConfig {
        faults: SimFaults {
            seed: 3,
            kernel_launch_fail: 1,
            ..SimFaults::NONE
        },
        ..SimConfig::default()
    });
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
            move |_k: &mut KernelCtx<'_>, done: Done| {
                l2.store(true, Ordering::Relaxed);
                let _ = done.complete();
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
