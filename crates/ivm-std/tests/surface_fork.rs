//! Fork policy: an inherited VM refuses every entry point in the child.

use std::time::Duration;

use ivm_std::{Config, Error, StreamId, VirtualMachine};

/// What the child checks; returns the exit code (0: all good).
fn child(vm: &VirtualMachine, x: ivm_std::Tensor) -> i32 {
    if !vm.is_forked() {
        return 10;
    }
    let mut out = [0u8; 8];
    let forked = |r: Result<(), Error>| matches!(r, Err(Error::Forked));
    let checks = [
        forked(vm.run(|_| Ok(()))),
        forked(vm.sync()),
        forked(vm.read_small(&x, 0, &mut out)),
        forked(vm.write_small(&x, 0, &out)),
        forked(vm.read_small_timeout(&x, 0, &mut out, Duration::from_secs(1))),
        forked(vm.sync_timeout(Duration::from_secs(1))),
        forked(vm.access(&x, |_| ())),
        forked(vm.access_async(&x, |_| ()).wait()),
        forked(vm.sync_async().wait()),
        forked(
            vm.stream(StreamId::compute(ivm_std::Device::CPU, 3))
                .map(|_| ()),
        ),
        forked(vm.new_tensor(8).map(|_| ())),
        forked(vm.blocking_run_probe(|| true)),
        forked(vm.stats().map(|_| ())),
        forked(vm.dump_dag().map(|_| ())),
        forked(vm.shutdown()),
    ];
    if let Some(i) = checks.iter().position(|ok| !ok) {
        return 20 + i as i32;
    }
    // Dropping the inherited tensor and VM must neither hang nor touch the parent's threads.
    drop(x);
    // A VM created in the child works.
    let fresh = match VirtualMachine::new(Config::single_thread()) {
        Ok(v) => v,
        Err(_) => return 11,
    };
    let y = fresh.new_tensor(8).unwrap();
    fresh.write_small(&y, 0, &4u64.to_ne_bytes()).unwrap();
    fresh.read_small(&y, 0, &mut out).unwrap();
    if u64::from_ne_bytes(out) != 4 {
        return 12;
    }
    0
}

#[test]
fn forked_child_gets_forked_errors_and_parent_keeps_working() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x = vm.new_tensor(8).unwrap();
    vm.write_small(&x, 0, &1u64.to_ne_bytes()).unwrap();
    assert!(!vm.is_forked());
    // SAFETY: the child only runs `child` (which uses no lock the parent's other threads
    // may hold, beyond the allocator, which glibc makes fork-safe) and then `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let vm = vm;
            let code = child(&vm, x.clone());
            drop(vm);
            code
        }))
        .unwrap_or(99);
        // SAFETY: ends the child at once, without running the parent's atexit handlers or
        // destructors of the test harness.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid);
    assert!(
        libc::WIFEXITED(status),
        "child did not exit normally: {status}"
    );
    assert_eq!(libc::WEXITSTATUS(status), 0, "child check failed");
    // The parent's VM is untouched.
    let mut out = [0u8; 8];
    vm.read_small(&x, 0, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 1);
    assert_eq!(vm.creator_pid(), std::process::id());
    vm.shutdown().unwrap();
}
