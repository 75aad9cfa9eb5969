//! Custom instructions through the public API only (`InstructionsBuilder::custom`,
//! `InstructionPolicy`, `Done`), in both modes: completion later from another thread
//! orders every later user of its operands (same stream and others); failing, dropping
//! the handle unfired, panicking in `launch` and breaking a `completes_during_launch`
//! promise each give an error naming the instruction, never a hang.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ivm_std::{
    Config, Done, Error, InstructionPolicy, KernelCtx, StreamId, Tensor, VirtualMachine,
};

fn modes() -> [Config; 2] {
    [
        Config::default().with_timeout_period(Duration::from_secs(20)),
        Config::single_thread().with_timeout_period(Duration::from_secs(20)),
    ]
}

fn read(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

/// Writes 1 into its output during launch and completes 30 ms later on another thread,
/// setting `completed` just before.
struct LateIo {
    completed: Arc<AtomicBool>,
}

impl InstructionPolicy for LateIo {
    fn launch(self: Box<Self>, k: &mut KernelCtx<'_>, done: Done) {
        k.output_u64(0)[0] = 1;
        let completed = self.completed;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            completed.store(true, Ordering::SeqCst);
            done.complete().unwrap();
        });
    }
}

#[test]
fn later_users_of_its_operands_wait_for_its_completion_on_every_stream() {
    for config in modes() {
        let mode = config.mode;
        let vm = VirtualMachine::new(config).unwrap();
        let s = vm.default_stream();
        let other = vm
            .stream(StreamId::compute(ivm_std::Device::CPU, 1))
            .unwrap();
        let (t, same, cross) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        for _ in 0..3 {
            let completed = Arc::new(AtomicBool::new(false));
            let (c1, c2) = (completed.clone(), completed.clone());
            vm.run(|b| {
                b.custom(&s, &[], &[&t], LateIo { completed })?;
                // Records whether the custom instruction had completed when it ran.
                b.call(&s, &[&t], &[&same], move |k| {
                    k.output_u64(0)[0] = u64::from(c1.load(Ordering::SeqCst));
                })?;
                b.call(&other, &[&t], &[&cross], move |k| {
                    k.output_u64(0)[0] = u64::from(c2.load(Ordering::SeqCst));
                })
            })
            .unwrap();
            assert_eq!(read(&vm, &same).unwrap(), 1, "{mode:?}: same-stream reader");
            assert_eq!(
                read(&vm, &cross).unwrap(),
                1,
                "{mode:?}: other-stream reader"
            );
            assert_eq!(read(&vm, &t).unwrap(), 1, "{mode:?}");
        }
        vm.shutdown().unwrap();
        let c = vm.debug_counters();
        assert_eq!((c.instructions, c.flying), (0, 0), "{mode:?}");
    }
}

#[test]
fn a_policy_completing_during_launch_is_prescheduled_and_completes() {
    struct Now;
    impl InstructionPolicy for Now {
        fn launch(self: Box<Self>, k: &mut KernelCtx<'_>, done: Done) {
            k.output_u64(0)[0] = 5;
            // Fired inside `launch`: takes effect when it returns.
            done.complete().unwrap();
        }
        fn completes_during_launch(&self) -> bool {
            true
        }
    }
    for config in modes() {
        let vm = VirtualMachine::new(config).unwrap();
        let (s, t, u) = (
            vm.default_stream(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        for _ in 0..50 {
            vm.run(|b| {
                b.custom(&s, &[], &[&t], Now)?;
                b.call(&s, &[&t], &[&u], |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x + 1;
                })
            })
            .unwrap();
        }
        assert_eq!(read(&vm, &u).unwrap(), 6);
        vm.shutdown().unwrap();
    }
}

/// Runs one custom instruction named `name` writing `t`, then reads `t`: the read's error.
fn failure_of(
    vm: &VirtualMachine,
    name: &'static str,
    policy: impl InstructionPolicy,
) -> (Error, String) {
    let t = vm.new_tensor(8).unwrap();
    vm.run(|b| b.custom_named(name, &vm.default_stream(), &[], &[&t], policy))
        .unwrap();
    let e = read(vm, &t).expect_err("the custom instruction failed");
    let text = e.to_string();
    assert!(
        text.contains(name),
        "the error names the instruction: {text}"
    );
    (e, text)
}

#[test]
fn fail_drop_panic_and_a_broken_promise_each_fail_the_instruction_by_name() {
    for config in modes() {
        let mode = config.mode;
        let vm = VirtualMachine::new(config).unwrap();

        let (_, text) = failure_of(&vm, "io_fail", |_: &mut KernelCtx<'_>, done: Done| {
            std::thread::spawn(move || done.fail("the disk said no").unwrap());
        });
        assert!(text.contains("the disk said no"), "{mode:?}: {text}");

        let (_, text) = failure_of(&vm, "io_drop", |_: &mut KernelCtx<'_>, done: Done| {
            std::thread::spawn(move || drop(done));
        });
        assert!(
            text.contains("dropped without being fired"),
            "{mode:?}: {text}"
        );

        let (_, text) = failure_of(&vm, "io_panic", |_: &mut KernelCtx<'_>, _d: Done| {
            panic!("launch went wrong")
        });
        assert!(text.contains("launch went wrong"), "{mode:?}: {text}");

        /// Promises to complete during launch, then keeps its handle.
        struct Liar(Arc<Mutex<Option<Done>>>);
        impl InstructionPolicy for Liar {
            fn launch(self: Box<Self>, _: &mut KernelCtx<'_>, done: Done) {
                *self.0.lock().unwrap() = Some(done);
            }
            fn completes_during_launch(&self) -> bool {
                true
            }
        }
        let kept = Arc::new(Mutex::new(None));
        let (_, text) = failure_of(&vm, "io_liar", Liar(kept.clone()));
        assert!(
            text.contains("promised to complete during launch"),
            "{mode:?}: {text}"
        );
        let late = kept.lock().unwrap().take().expect("the handle was kept");
        assert!(
            matches!(late.complete(), Err(Error::InvalidArgument(m)) if m.contains("io_liar")),
            "{mode:?}: firing it later is refused, naming the instruction"
        );

        // The VM still works, and drained.
        let t = vm.new_tensor(8).unwrap();
        vm.write_small(&t, 0, &9u64.to_ne_bytes()).unwrap();
        assert_eq!(read(&vm, &t).unwrap(), 9);
        vm.shutdown().unwrap();
        let c = vm.debug_counters();
        assert_eq!((c.instructions, c.flying), (0, 0), "{mode:?}");
    }
}

#[test]
fn a_custom_instruction_on_a_poisoned_input_does_not_launch() {
    for config in modes() {
        let vm = VirtualMachine::new(config).unwrap();
        let s = vm.default_stream();
        let (t, u) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
        let launched = Arc::new(AtomicUsize::new(0));
        let l = launched.clone();
        vm.run(|b| {
            b.call_named("poisoner", &s, &[], &[&t], |_| panic!("on purpose"))?;
            b.custom(
                &s,
                &[&t],
                &[&u],
                move |_: &mut KernelCtx<'_>, done: Done| {
                    l.fetch_add(1, Ordering::SeqCst);
                    done.complete().unwrap();
                },
            )
        })
        .unwrap();
        let text = read(&vm, &u).unwrap_err().to_string();
        assert!(text.contains("poisoner"), "{text}");
        assert_eq!(launched.load(Ordering::SeqCst), 0);
        vm.shutdown().unwrap();
    }
}

#[test]
fn firing_after_the_vm_is_gone_is_harmless_and_says_so() {
    let kept: Arc<Mutex<Option<Done>>> = Arc::new(Mutex::new(None));
    {
        // A VM whose custom instruction completes only after everything else is gone:
        // shutdown waits for it, so it is fired from a thread that outlives the VM's
        // handle, after a read already observed it.
        let vm = VirtualMachine::new(Config::default()).unwrap();
        let t = vm.new_tensor(8).unwrap();
        let k = kept.clone();
        vm.run(|b| {
            b.custom(
                &vm.default_stream(),
                &[],
                &[&t],
                move |_: &mut KernelCtx<'_>, d: Done| {
                    *k.lock().unwrap() = Some(d);
                },
            )
        })
        .unwrap();
        // Complete it so that shutdown can drain, through a second handle-less path:
        // take the handle back and fire it while the VM lives.
        let d = loop {
            if let Some(d) = kept.lock().unwrap().take() {
                break d;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            d.instruction().starts_with("custom#"),
            "{}",
            d.instruction()
        );
        d.complete().unwrap();
        vm.shutdown().unwrap();
    }
    // A handle of a VM that no longer exists: built from a fresh VM dropped before firing.
    let late: Arc<Mutex<Option<Done>>> = Arc::new(Mutex::new(None));
    let vm = VirtualMachine::new(
        Config::single_thread().with_timeout_period(Duration::from_millis(200)),
    )
    .unwrap();
    let t = vm.new_tensor(8).unwrap();
    let l = late.clone();
    vm.run(|b| {
        b.custom(
            &vm.default_stream(),
            &[],
            &[&t],
            move |_: &mut KernelCtx<'_>, d: Done| {
                *l.lock().unwrap() = Some(d);
            },
        )
    })
    .unwrap();
    let d = late
        .lock()
        .unwrap()
        .take()
        .expect("launched by the run's drive");
    // Shutdown cannot drain an instruction nobody completes: it reports it.
    assert!(matches!(vm.shutdown(), Err(Error::Timeout(_))));
    drop((t, vm));
    assert!(matches!(d.complete(), Err(Error::ShutDown)));
}
