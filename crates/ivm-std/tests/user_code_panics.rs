//! Code the user hands to the VM may panic, through the public API only, in both modes.
//!
//! A kernel, an [`InstructionPolicy`], a [`WaitHook`], a [`DropSink`] or a closure's
//! captures that panic fail the work they belong to (its outputs poisoned, the panic's
//! message in the error); they never kill a VM thread, never leave a read returning bytes
//! that no kernel wrote, and the VM keeps serving: every test ends by running a kernel and
//! reading its output, then shutting down cleanly.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use ivm_std::{
    Captures, Config, Done, DropSink, Error, ForeignHooks, KernelCtx, Mode, Tensor, VirtualMachine,
    WaitHook,
};

const MODES: [Mode; 2] = [Mode::MultiThread, Mode::SingleThread];

fn vm(mode: Mode) -> VirtualMachine {
    VirtualMachine::new(
        Config::default()
            .with_mode(mode)
            .with_timeout_period(Duration::from_secs(10)),
    )
    .unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

/// The VM still runs kernels and reads their results.
fn still_serves(vm: &VirtualMachine, mode: Mode) {
    let t = vm.new_tensor(8).unwrap();
    vm.run(|b| b.call(&vm.default_stream(), &[], &[&t], |k| k.output_u64(0)[0] = 5))
        .unwrap();
    assert_eq!(read_u64(vm, &t).unwrap(), 5, "{mode:?}: the VM goes on");
    vm.sync().unwrap();
}

/// `r` is the poison of a failed instruction whose message contains `cause`.
fn assert_poisoned_by<T: std::fmt::Debug>(mode: Mode, r: ivm_std::Result<T>, cause: &str) {
    match r {
        Err(Error::Poisoned { message, .. }) | Err(Error::KernelPanicked { message, .. })
            if message.contains(cause) => {}
        other => panic!("{mode:?}: expected the poison of `{cause}`, got {other:?}"),
    }
}

#[test]
fn a_launch_that_panics_after_handing_its_done_away_fails_the_instruction() {
    for mode in MODES {
        let vm = vm(mode);
        let (s, t) = (vm.default_stream(), vm.new_tensor(8).unwrap());
        let (tx, rx) = mpsc::channel();
        let (go, wait_go) = mpsc::channel::<()>();
        vm.run(|b| {
            b.custom(&s, &[], &[&t], move |k: &mut KernelCtx<'_>, done: Done| {
                k.output_u64(0)[0] = 77;
                // Fires once the test has read the result (after the launch returned).
                std::thread::spawn(move || {
                    let _ = wait_go.recv();
                    tx.send(done.complete()).unwrap();
                });
                panic!("launch failed");
            })
        })
        .unwrap();
        assert_poisoned_by(mode, read_u64(&vm, &t), "launch failed");
        go.send(()).unwrap();
        let late = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            matches!(late, Err(Error::InvalidArgument(ref m)) if m.contains("panicked")),
            "{mode:?}: the late handle is told the instruction already failed: {late:?}"
        );
        assert_poisoned_by(mode, read_u64(&vm, &t), "launch failed");
        still_serves(&vm, mode);
        vm.shutdown().unwrap();
    }
}

#[test]
fn a_done_fired_after_the_vm_is_gone_says_shut_down() {
    for mode in MODES {
        let vm = VirtualMachine::new(
            Config::default()
                .with_mode(mode)
                .with_timeout_period(Duration::from_millis(200)),
        )
        .unwrap();
        let (s, t) = (vm.default_stream(), vm.new_tensor(8).unwrap());
        let (tx, rx) = mpsc::channel();
        vm.run(|b| {
            b.custom(&s, &[], &[&t], move |_: &mut KernelCtx<'_>, done: Done| {
                tx.send(done).unwrap();
            })
        })
        .unwrap();
        // Single-thread mode launches it while shutdown drains; multi-thread mode on the
        // stream's worker. Either way shutdown gives up waiting for the handle.
        let r = vm.shutdown();
        assert!(matches!(r, Err(Error::Timeout(_))), "{mode:?}: {r:?}");
        let done = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        drop(vm);
        let r = done.complete();
        assert!(matches!(r, Err(Error::ShutDown)), "{mode:?}: {r:?}");
    }
}

/// Counts its calls; panics on the calls whose number (from 1) `panic_on` holds.
struct CountingHook {
    before: AtomicUsize,
    after: AtomicUsize,
    panic_before_on: usize,
    panic_after_on: usize,
}

impl WaitHook for CountingHook {
    fn before_wait(&self) {
        let n = self.before.fetch_add(1, Ordering::Relaxed) + 1;
        assert!(n != self.panic_before_on, "before_wait panics (call {n})");
    }
    fn after_wait(&self) {
        let n = self.after.fetch_add(1, Ordering::Relaxed) + 1;
        assert!(n != self.panic_after_on, "after_wait panics (call {n})");
    }
}

/// A read that has to wait: the kernel before it takes a while.
fn slow_write_then_read(vm: &VirtualMachine, t: &Tensor, v: u64) -> ivm_std::Result<u64> {
    vm.run(|b| {
        b.call(&vm.default_stream(), &[], &[t], move |k| {
            std::thread::sleep(Duration::from_millis(20));
            k.output_u64(0)[0] = v;
        })
    })?;
    read_u64(vm, t)
}

#[test]
fn a_wait_hook_that_panicked_once_is_still_called_around_every_wait() {
    for (panic_before_on, panic_after_on) in [(1, 0), (0, 1)] {
        for mode in MODES {
            let hook = Arc::new(CountingHook {
                before: AtomicUsize::new(0),
                after: AtomicUsize::new(0),
                panic_before_on,
                panic_after_on,
            });
            let vm = vm(mode);
            vm.set_foreign_hooks(ForeignHooks::default().with_wait_hook(hook.clone()))
                .unwrap();
            let t = vm.new_tensor(8).unwrap();
            // The hook's panic reaches the call whose wait it announced, once the wait is
            // over; the read itself completed.
            let first = catch_unwind(AssertUnwindSafe(|| slow_write_then_read(&vm, &t, 1)));
            assert!(
                first.is_err(),
                "{mode:?}: the hook's panic reaches its call"
            );
            let calls = hook.before.load(Ordering::Relaxed);
            assert_eq!(calls, hook.after.load(Ordering::Relaxed), "{mode:?}: pairs");
            for v in 2..5 {
                assert_eq!(slow_write_then_read(&vm, &t, v).unwrap(), v, "{mode:?}");
            }
            let later = hook.before.load(Ordering::Relaxed) - calls;
            assert!(
                later >= 3,
                "{mode:?} ({panic_before_on}, {panic_after_on}): the hook is still called \
                 around each of three waits: {later} calls"
            );
            assert_eq!(
                hook.before.load(Ordering::Relaxed),
                hook.after.load(Ordering::Relaxed),
                "{mode:?}: pairs"
            );
            still_serves(&vm, mode);
            vm.shutdown().unwrap();
        }
    }
}

struct PanicSink {
    calls: AtomicUsize,
}

impl DropSink for PanicSink {
    fn send(&self, _captures: Captures) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        panic!("the sink panics");
    }
}

/// A kernel fails (poisoning `p`); a kernel reading `p` into `q` never runs, and its
/// closure captures `keep` (dropped unrun, on whatever the VM does with unrun captures).
fn poisoned_chain<K: Send + 'static>(vm: &VirtualMachine, mode: Mode, keep: K) {
    let s = vm.default_stream();
    let (p, q) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    vm.run(|b| {
        b.call(&s, &[], &[&p], |_| panic!("poisoner"))?;
        b.call(&s, &[&p], &[&q], move |k| {
            let _keep = &keep;
            k.output_u64(0)[0] = 9;
        })
    })
    .unwrap();
    assert_poisoned_by(mode, read_u64(vm, &q), "poisoner");
    vm.sync().unwrap();
}

#[test]
fn a_panicking_drop_sink_does_not_stop_the_vm() {
    for mode in MODES {
        let vm = vm(mode);
        let sink = Arc::new(PanicSink {
            calls: AtomicUsize::new(0),
        });
        vm.set_foreign_hooks(ForeignHooks::default().with_drop_sink(sink.clone()))
            .unwrap();
        poisoned_chain(&vm, mode, [0u64; 2]);
        assert!(sink.calls.load(Ordering::Relaxed) >= 1, "{mode:?}");
        still_serves(&vm, mode);
        vm.shutdown().unwrap();
        drop(vm);
    }
}

/// Panics when dropped.
struct PanicOnDrop;

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("a capture's drop panics");
        }
    }
}

#[test]
fn captures_whose_drop_panics_do_not_stop_the_vm() {
    for mode in MODES {
        let vm = vm(mode);
        // Unrun: dropped by the VM, no sink.
        poisoned_chain(&vm, mode, PanicOnDrop);
        // Unrun and boxed (too big to be stored inline).
        poisoned_chain(&vm, mode, (PanicOnDrop, [0u64; 32]));
        // Run: the drop at the end of the kernel is the kernel's own panic.
        let t = vm.new_tensor(8).unwrap();
        let keep = PanicOnDrop;
        vm.run(|b| {
            b.call(&vm.default_stream(), &[], &[&t], move |k| {
                let _keep = keep;
                k.output_u64(0)[0] = 1;
            })
        })
        .unwrap();
        assert_poisoned_by(mode, read_u64(&vm, &t), "a capture's drop panics");
        // A callback access, unrun (poisoned tensor) and run.
        let p = vm.new_tensor(8).unwrap();
        vm.run(|b| b.call(&vm.default_stream(), &[], &[&p], |_| panic!("poisoner")))
            .unwrap();
        let keep = PanicOnDrop;
        let r = vm.access(&p, move |_| {
            let _keep = &keep;
        });
        assert_poisoned_by(mode, r, "poisoner");
        still_serves(&vm, mode);
        vm.shutdown().unwrap();
    }
}

/// A barrier's callback that panics has no outputs to poison and no caller waiting: the
/// next `sync` reports it (the first one, once), naming the barrier and the message;
/// the VM goes on, and the `sync` after that is `Ok`. Before, the panic was only printed.
#[test]
fn a_panicking_barrier_is_reported_by_the_next_sync() {
    for mode in MODES {
        let vm = vm(mode);
        let ran = Arc::new(AtomicUsize::new(0));
        let r2 = ran.clone();
        vm.run(|b| {
            b.barrier(|| panic!("barrier one broke"))?;
            b.barrier(|| panic!("barrier two broke"))?;
            b.barrier(move || {
                r2.fetch_add(1, Ordering::Relaxed);
            })
        })
        .unwrap();
        match vm.sync() {
            Err(Error::KernelPanicked {
                instruction,
                message,
            }) => {
                assert!(
                    instruction.starts_with("barrier"),
                    "{mode:?}: {instruction}"
                );
                assert!(message.contains("barrier one broke"), "{mode:?}: {message}");
            }
            other => panic!("{mode:?}: expected the barrier's panic, got {other:?}"),
        }
        assert_eq!(
            ran.load(Ordering::Relaxed),
            1,
            "{mode:?}: later barriers ran"
        );
        vm.sync().unwrap();
        still_serves(&vm, mode);
    }
}
