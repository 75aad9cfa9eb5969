//! Per-call timeouts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ivm_std::{Config, Error, Tensor, VirtualMachine};

/// Blocks `x`'s stream until the returned gate is opened.
fn block(vm: &VirtualMachine, x: &Tensor) -> Arc<AtomicBool> {
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    let s = vm.default_stream();
    vm.run(|b| {
        b.call_named("gate", &s, &[], &[x], move |k| {
            while !g.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            k.output_u64(0)[0] = 9;
        })
    })
    .unwrap();
    gate
}

#[test]
fn read_times_out_with_the_diagnostic_then_recovers() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x = vm.new_tensor(8).unwrap();
    let gate = block(&vm, &x);
    let mut out = [0u8; 8];
    let t0 = Instant::now();
    let r = vm.read_small_timeout(&x, 0, &mut out, Duration::from_millis(50));
    let waited = t0.elapsed();
    let Err(Error::Timeout(d)) = r else {
        panic!("expected a timeout, got {r:?}")
    };
    assert!(waited >= Duration::from_millis(50), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(
        d.lively.iter().any(|i| i.name.starts_with("gate#")),
        "the diagnostic names the blocking instruction:\n{d}"
    );
    // Writes and `sync` time out the same way.
    assert!(matches!(
        vm.write_small_timeout(&x, 0, &[1u8; 8], Duration::from_millis(20)),
        Err(Error::Timeout(_))
    ));
    assert!(matches!(
        vm.sync_timeout(Duration::from_millis(20)),
        Err(Error::Timeout(_))
    ));
    gate.store(true, Ordering::Release);
    // The abandoned write still runs after the gate (in order): 9, then 1s.
    vm.read_small_timeout(&x, 0, &mut out, Duration::from_secs(30))
        .unwrap();
    assert_eq!(out, [1u8; 8]);
    vm.sync_timeout(Duration::from_secs(30)).unwrap();
    vm.write_small_timeout(&x, 4, &[2u8; 4], Duration::from_secs(30))
        .unwrap();
    let mut half = [0u8; 4];
    vm.read_small_timeout(&x, 4, &mut half, Duration::from_secs(30))
        .unwrap();
    assert_eq!(half, [2u8; 4]);
}

#[test]
fn zero_timeout_and_bad_input_are_errors() {
    for config in [Config::default(), Config::single_thread()] {
        let vm = VirtualMachine::new(config).unwrap();
        let x = vm.new_tensor(8).unwrap();
        let mut out = [0u8; 8];
        assert!(matches!(
            vm.read_small_timeout(&x, 0, &mut out, Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            vm.write_small_timeout(&x, 0, &[0; 8], Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            vm.sync_timeout(Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        let mut three = [0u8; 3];
        assert!(matches!(
            vm.read_small_timeout(&x, 0, &mut three, Duration::from_secs(1)),
            Err(Error::UnsupportedSize(3))
        ));
        assert!(matches!(
            vm.read_small_timeout(&x, 4, &mut out, Duration::from_secs(1)),
            Err(Error::OutOfBounds { .. })
        ));
        vm.write_small_timeout(&x, 0, &7u64.to_ne_bytes(), Duration::MAX)
            .unwrap();
        vm.read_small_timeout(&x, 0, &mut out, Duration::from_secs(30))
            .unwrap();
        assert_eq!(u64::from_ne_bytes(out), 7);
        vm.shutdown().unwrap();
        assert!(matches!(
            vm.read_small_timeout(&x, 0, &mut out, Duration::from_secs(1)),
            Err(Error::ShutDown)
        ));
    }
}

#[test]
fn timeout_from_a_kernel_is_reentrant() {
    let vm = Arc::new(VirtualMachine::new(Config::default()).unwrap());
    let x = vm.new_tensor(8).unwrap();
    let (vm2, x2) = (vm.clone(), x.clone());
    let r = vm
        .access(&x, move |_| {
            let mut out = [0u8; 8];
            vm2.read_small_timeout(&x2, 0, &mut out, Duration::from_secs(1))
        })
        .unwrap();
    assert!(matches!(r, Err(Error::Reentrant)));
}

/// A wait with a deadline of its own never runs queued work itself (a waiting caller
/// otherwise runs what is queued to a sleeping worker): the kernel could outlast the
/// deadline. Here the kernel waits for a gate the caller opens only after its timed read
/// returned; run by the caller, it would hang the caller (a watchdog opens the gate after a
/// while instead, and the test fails naming the thread).
#[test]
fn a_timed_wait_never_runs_the_kernel_it_waits_behind() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x = vm.new_tensor(8).unwrap();
    let me = std::thread::current().id();
    for round in 0..20 {
        // Long enough for the worker's poll window to end: it parks.
        std::thread::sleep(Duration::from_millis(30));
        let gate = Arc::new(AtomicBool::new(false));
        let ran_on = Arc::new(std::sync::Mutex::new(None));
        let (g, r) = (gate.clone(), ran_on.clone());
        let s = vm.default_stream();
        vm.run(|b| {
            b.call_named("gate", &s, &[], &[&x], move |_| {
                *r.lock().unwrap() = Some(std::thread::current().id());
                while !g.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        })
        .unwrap();
        let watchdog = {
            let g = gate.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                g.store(true, Ordering::Release);
            })
        };
        let mut out = [0u8; 8];
        let r = vm.read_small_timeout(&x, 0, &mut out, Duration::from_millis(5));
        gate.store(true, Ordering::Release);
        watchdog.join().unwrap();
        vm.sync().unwrap();
        assert_ne!(
            *ran_on.lock().unwrap(),
            Some(me),
            "round {round}: the timed read ran the kernel it waited behind ({r:?})"
        );
    }
}

/// A probe that never turns true fails its wait with `Timeout` after a period in which no
/// instruction finished, as every blocking wait; the diagnostic counts it, the VM
/// withdraws it (never called again), and a later `shutdown` does not wait for it. Before,
/// the wait had no timeout at all and `shutdown` timed out behind the probe.
#[test]
fn a_probe_that_never_turns_true_times_out_and_is_withdrawn() {
    for config in [Config::default(), Config::single_thread()] {
        let vm =
            VirtualMachine::new(config.with_timeout_period(Duration::from_millis(200))).unwrap();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c2 = calls.clone();
        let t0 = Instant::now();
        let r = vm.blocking_run_probe(move || {
            c2.fetch_add(1, Ordering::Relaxed);
            false
        });
        let Err(Error::Timeout(d)) = r else {
            panic!("expected a timeout, got {r:?}")
        };
        assert!(
            t0.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(d.probes, 1, "{d}");
        assert!(d.to_string().contains("1 probe(s) polled"), "{d}");
        let polled = calls.load(Ordering::Relaxed);
        assert!(polled > 0);
        // Withdrawn: the VM goes on without it, and stops calling it.
        let x = vm.new_tensor(8).unwrap();
        let s = vm.default_stream();
        vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 3))
            .unwrap();
        vm.sync().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let after = calls.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            calls.load(Ordering::Relaxed),
            after,
            "called after its withdrawal"
        );
        vm.blocking_run_probe(|| true).unwrap();
        drop(x);
        vm.shutdown().unwrap();
    }
}
