//! Stress: sync reads from several threads while another thread streams instructions;
//! shutdown under load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use ivm_std::{Config, DebugCounters, Device, Error, StreamId, VirtualMachine};

fn stream_and_read(cfg: Config, instructions: u64, readers: usize) {
    let vm = Arc::new(VirtualMachine::new(cfg).unwrap());
    let s0 = vm.default_stream();
    let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
    let counter = vm.new_tensor(8).unwrap();
    let mirror = vm.new_tensor(8).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    thread::scope(|sc| {
        for _ in 0..readers {
            let (vm, counter, stop, reads) =
                (vm.clone(), counter.clone(), stop.clone(), reads.clone());
            sc.spawn(move || {
                let mut last = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut b = [0u8; 8];
                    vm.read_small(&counter, 0, &mut b).unwrap();
                    let v = u64::from_ne_bytes(b);
                    assert!(v >= last, "counter went backwards: {v} after {last}");
                    last = v;
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let (vm2, c2, m2) = (vm.clone(), counter.clone(), mirror.clone());
        sc.spawn(move || {
            let mut sent = 0;
            while sent < instructions {
                vm2.run(|b| {
                    for _ in 0..64 {
                        b.call(&s0, &[], &[&c2], |k| k.output_u64(0)[0] += 1)?;
                        b.call(&s1, &[&c2], &[&m2], |k| {
                            let v = k.input_u64(0)[0];
                            k.output_u64(0)[0] = v;
                        })?;
                    }
                    Ok(())
                })
                .unwrap();
                sent += 128;
            }
            vm2.sync().unwrap();
            stop.store(true, Ordering::Relaxed);
        });
    });
    let mut b = [0u8; 8];
    vm.read_small(&mirror, 0, &mut b).unwrap();
    let expected = instructions.div_ceil(128) * 64;
    assert_eq!(u64::from_ne_bytes(b), expected);
    assert!(reads.load(Ordering::Relaxed) > 0);
    drop((counter, mirror));
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

/// `IVM_*` variables apply (see `Config::from_env`).
fn env_config() -> Config {
    Config::from_env().unwrap()
}

#[test]
fn four_readers_while_streaming_100k_instructions() {
    stream_and_read(env_config(), 100_000, 4);
}

#[test]
fn four_readers_while_streaming_100k_instructions_no_spin_windows() {
    // Threads park at once when idle (the setting that suits an overloaded 2-core box).
    let cfg = env_config()
        .with_scheduler_work_window(std::time::Duration::ZERO)
        .with_worker_poll_window(std::time::Duration::ZERO);
    for _ in 0..3 {
        stream_and_read(cfg.clone(), 100_000, 4);
    }
}

#[test]
fn four_readers_with_tight_backpressure() {
    let cfg = Config::default()
        .with_high_water_mark(256)
        .with_low_water_mark(128);
    stream_and_read(cfg, 20_000, 4);
}

#[test]
fn single_thread_mode_under_concurrent_callers() {
    stream_and_read(Config::single_thread(), 10_000, 2);
}

#[test]
fn shutdown_under_load_runs_or_refuses_everything() {
    for _ in 0..3 {
        let vm = Arc::new(VirtualMachine::new(Config::default()).unwrap());
        let s = vm.default_stream();
        let ran = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        thread::scope(|sc| {
            for _ in 0..3 {
                let (vm, s, ran, accepted) = (vm.clone(), s.clone(), ran.clone(), accepted.clone());
                sc.spawn(move || {
                    let t = match vm.new_tensor(8) {
                        Ok(t) => t,
                        Err(Error::ShutDown) => return,
                        Err(e) => panic!("{e}"),
                    };
                    loop {
                        let r2 = ran.clone();
                        let r = vm.run(|b| {
                            b.call(&s, &[], &[&t], move |k| {
                                k.output_u64(0)[0] += 1;
                                r2.fetch_add(1, Ordering::Relaxed);
                            })
                        });
                        match r {
                            Ok(()) => {
                                accepted.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(Error::ShutDown) => break,
                            Err(e) => panic!("{e}"),
                        }
                        match vm.read_small(&t, 0, &mut [0u8; 8]) {
                            Ok(()) | Err(Error::ShutDown) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                });
            }
            thread::sleep(std::time::Duration::from_millis(50));
            vm.shutdown().unwrap();
        });
        assert_eq!(
            ran.load(Ordering::Relaxed),
            accepted.load(Ordering::Relaxed),
            "every accepted instruction ran"
        );
        assert_eq!(vm.debug_counters(), DebugCounters::default());
    }
}
