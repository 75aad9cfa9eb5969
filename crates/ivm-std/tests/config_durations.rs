//! `Config`'s durations never panic: a `timeout_period` too long for the clock (up to
//! `Duration::MAX`) means "no deadline" in the calls that derive a deadline from it
//! (`sync`, `shutdown`, the VM's drop, the waits), in either mode; a poll window past
//! `MAX_POLL_WINDOW` is a configuration error.

use std::time::Duration;

use ivm_std::{Config, Error, MAX_POLL_WINDOW, VirtualMachine};

/// One VM's whole life with `config`: a kernel, every kind of wait, `sync`, then
/// `shutdown` (and a second VM with the same configuration dropped without it).
fn live_and_die(config: &Config) {
    config.validate().unwrap();
    let vm = VirtualMachine::new(config.clone()).unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 41))
        .unwrap();
    let mut out = [0u8; 8];
    vm.read_small(&t, 0, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 41);
    vm.write_small(&t, 0, &42u64.to_ne_bytes()).unwrap();
    vm.read_small_timeout(&t, 0, &mut out, Duration::MAX)
        .unwrap();
    assert_eq!(u64::from_ne_bytes(out), 42);
    assert_eq!(vm.access_async(&t, |b| b[0]).wait().unwrap(), 42);
    vm.sync().unwrap();
    vm.sync_timeout(Duration::MAX).unwrap();
    vm.sync_async().wait().unwrap();
    vm.shutdown().unwrap();
    drop(vm);

    let vm = VirtualMachine::new(config.clone()).unwrap();
    let t = vm.new_tensor_from(&vm.default_stream(), &[7u8; 8]).unwrap();
    vm.read_small(&t, 0, &mut out).unwrap();
    assert_eq!(out, [7u8; 8]);
    drop(t);
    drop(vm);
}

#[test]
fn a_timeout_period_too_long_for_the_clock_means_no_deadline() {
    for config in [Config::default(), Config::single_thread()] {
        live_and_die(&config.with_timeout_period(Duration::MAX));
    }
}

#[test]
fn poll_windows_past_the_maximum_are_config_errors() {
    for config in [Config::default(), Config::single_thread()] {
        for too_long in [MAX_POLL_WINDOW + Duration::from_nanos(1), Duration::MAX] {
            for c in [
                config.clone().with_worker_poll_window(too_long),
                config.clone().with_scheduler_work_window(too_long),
            ] {
                assert!(matches!(c.validate(), Err(Error::Config(_))), "{c:?}");
                let r = VirtualMachine::new(c);
                assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
            }
        }
    }
    let huge = u64::MAX.to_string();
    for var in ["IVM_WORKER_POLL_US", "IVM_SCHEDULER_WINDOW_US"] {
        let r = Config::from_lookup(|k| (k == var).then(|| huge.clone()));
        assert!(matches!(r, Err(Error::Config(_))), "{var}: {r:?}");
    }
}
