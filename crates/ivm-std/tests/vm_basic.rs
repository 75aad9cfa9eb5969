//! The VM's public doors, in multi-thread and single-thread mode.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ivm_std::{Config, DebugCounters, Device, Error, StreamId, VirtualMachine};

fn modes() -> [Config; 2] {
    [Config::default(), Config::single_thread()]
}

fn read_u64(vm: &VirtualMachine, t: &ivm_std::Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

fn assert_drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(
        vm.debug_counters(),
        DebugCounters::default(),
        "live engine objects after shutdown"
    );
}

#[test]
fn chain_across_streams_sees_every_write() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s0 = vm.default_stream();
        let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
        let a = vm.new_tensor(8).unwrap();
        let b = vm.new_tensor(8).unwrap();
        for i in 0..200u64 {
            let (src, dst, s) = if i % 2 == 0 {
                (&a, &b, &s0)
            } else {
                (&b, &a, &s1)
            };
            vm.run(|bl| {
                bl.call(s, &[src], &[dst], move |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x.wrapping_mul(31).wrapping_add(i);
                })
            })
            .unwrap();
        }
        let mut x = 0u64;
        for i in 0..200u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert_eq!(read_u64(&vm, &a), x);
        drop((a, b));
        assert_drained(&vm);
    }
}

#[test]
fn sync_write_then_read_round_trips_every_size() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let t = vm.new_tensor(32).unwrap();
        for len in [1usize, 2, 4, 8, 16] {
            let data: Vec<u8> = (0..len as u8).map(|x| x + 7).collect();
            vm.write_small(&t, 8, &data).unwrap();
            let mut out = vec![0u8; len];
            vm.read_small(&t, 8, &mut out).unwrap();
            assert_eq!(out, data);
        }
        assert!(matches!(
            vm.read_small(&t, 0, &mut [0u8; 3]),
            Err(Error::UnsupportedSize(3))
        ));
        assert!(matches!(
            vm.write_small(&t, 0, &[0u8; 32]),
            Err(Error::UnsupportedSize(32))
        ));
        assert!(matches!(
            vm.read_small(&t, 30, &mut [0u8; 4]),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            vm.read_small(&t, usize::MAX, &mut [0u8; 4]),
            Err(Error::OutOfBounds { .. })
        ));
        drop(t);
        assert_drained(&vm);
    }
}

#[test]
fn kernel_panic_poisons_outputs_and_vm_keeps_serving() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s = vm.default_stream();
        let (a, b, c) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.run(|bl| {
            bl.call_named("boom", &s, &[], &[&a], |_| panic!("kernel exploded"))?;
            bl.call_named("downstream", &s, &[&a], &[&b], |k| k.output_u64(0)[0] = 1)?;
            bl.call_named("independent", &s, &[], &[&c], |k| k.output_u64(0)[0] = 5)
        })
        .unwrap();
        for t in [&a, &b] {
            match vm.read_small(t, 0, &mut [0u8; 8]) {
                Err(Error::Poisoned {
                    instruction,
                    message,
                }) => {
                    assert!(instruction.starts_with("boom#"), "{instruction}");
                    assert!(message.contains("kernel exploded"), "{message}");
                }
                other => panic!("expected Poisoned, got {other:?}"),
            }
        }
        assert_eq!(read_u64(&vm, &c), 5, "the VM keeps serving other work");
        let r = vm.access(&c, |_| -> u8 { panic!("callback exploded") });
        assert!(matches!(r, Err(Error::KernelPanicked { .. })), "{r:?}");
        assert_eq!(vm.access(&c, |b| b[0]).unwrap(), 5);
        drop((a, b, c));
        assert_drained(&vm);
    }
}

#[test]
fn reentrant_calls_are_errors() {
    for cfg in modes() {
        let vm = Arc::new(VirtualMachine::new(cfg).unwrap());
        let s = vm.default_stream();
        let t = vm.new_tensor(8).unwrap();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let (vm2, seen2, t2) = (vm.clone(), seen.clone(), t.clone());
        vm.run(|bl| {
            bl.call(&s, &[], &[], move |_| {
                let mut v = seen2.lock().unwrap();
                v.push(format!("{:?}", vm2.run(|_| Ok(()))));
                v.push(format!("{:?}", vm2.sync()));
                v.push(format!("{:?}", vm2.read_small(&t2, 0, &mut [0u8; 8])));
                v.push(format!("{:?}", vm2.shutdown()));
            })
        })
        .unwrap();
        vm.sync().unwrap();
        let v = seen.lock().unwrap().clone();
        assert_eq!(v.len(), 4);
        for r in &v {
            assert_eq!(r, "Err(Reentrant)");
        }
        // The kernel held a VM handle and a tensor; both are gone once it is released.
        drop(t);
        vm.shutdown().unwrap();
        assert_eq!(vm.debug_counters(), DebugCounters::default());
    }
}

#[test]
fn use_after_shutdown_is_an_error() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let t = vm.new_tensor(8).unwrap();
        vm.shutdown().unwrap();
        vm.shutdown().unwrap();
        assert!(matches!(vm.run(|_| Ok(())), Err(Error::ShutDown)));
        assert!(matches!(vm.sync(), Err(Error::ShutDown)));
        assert!(matches!(
            vm.read_small(&t, 0, &mut [0u8; 8]),
            Err(Error::ShutDown)
        ));
        assert!(matches!(vm.new_tensor(8), Err(Error::ShutDown)));
        drop(t); // dropping after shutdown enqueues nothing and does not panic
        assert_eq!(vm.debug_counters(), DebugCounters::default());
    }
}

#[test]
fn barrier_runs_after_earlier_work() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s = vm.default_stream();
        let log: Arc<Mutex<Vec<&'static str>>> = Arc::default();
        let (l1, l2, l3) = (log.clone(), log.clone(), log.clone());
        vm.run(|bl| {
            bl.call(&s, &[], &[], move |_| {
                std::thread::sleep(Duration::from_millis(20));
                l1.lock().unwrap().push("kernel");
            })?;
            bl.barrier(move || l2.lock().unwrap().push("barrier"))?;
            bl.call(&s, &[], &[], move |_| l3.lock().unwrap().push("after"))
        })
        .unwrap();
        vm.sync().unwrap();
        let v = log.lock().unwrap().clone();
        let pos = |x| v.iter().position(|y| *y == x).unwrap();
        assert!(pos("kernel") < pos("barrier"), "{v:?}");
        assert_drained(&vm);
    }
}

#[test]
fn probes_callbacks_and_tensor_drop() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let n = Arc::new(Mutex::new(0));
        let n2 = n.clone();
        vm.blocking_run_probe(move || {
            let mut g = n2.lock().unwrap();
            *g += 1;
            *g >= 3
        })
        .unwrap();
        assert_eq!(*n.lock().unwrap(), 3);
        let t = vm.new_tensor(16).unwrap();
        vm.run(|bl| bl.access_blob_by_callback_mut(&t, |b| b[3] = 9))
            .unwrap();
        assert_eq!(vm.access(&t, |b| b[3]).unwrap(), 9);
        vm.access_mut(&t, |b| b[3] = 10).unwrap();
        let seen = Arc::new(Mutex::new(0u8));
        let s2 = seen.clone();
        vm.run(|bl| {
            bl.access_blob_by_callback(&t, move |b| *s2.lock().unwrap() = b[3])?;
            bl.release_tensor(t.clone())
        })
        .unwrap();
        drop(t);
        vm.sync().unwrap();
        assert_eq!(*seen.lock().unwrap(), 10);
        assert_drained(&vm);
    }
}

#[test]
fn bad_operands_are_errors() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let other = VirtualMachine::new(Config::single_thread()).unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    let foreign = other.new_tensor(8).unwrap();
    assert!(matches!(
        vm.run(|b| b.call(&s, &[&t], &[&t], |_| {})),
        Err(Error::AliasedOperand)
    ));
    assert!(matches!(
        vm.run(|b| b.call(&s, &[], &[&t, &t], |_| {})),
        Err(Error::AliasedOperand)
    ));
    assert!(matches!(
        vm.run(|b| b.call(&s, &[&foreign], &[], |_| {})),
        Err(Error::ForeignObject(_))
    ));
    assert!(matches!(
        vm.read_small(&foreign, 0, &mut [0u8; 8]),
        Err(Error::ForeignObject(_))
    ));
    let os = other.default_stream();
    assert!(matches!(
        vm.run(|b| b.call(&os, &[], &[], |_| {})),
        Err(Error::ForeignObject(_))
    ));
    let gpu = Device {
        kind: ivm_std::DeviceKind::named("cuda"),
        index: 0,
    };
    assert!(matches!(
        vm.stream(StreamId::compute(gpu, 0)),
        Err(Error::UnsupportedStream(_))
    ));
    // An error inside the closure submits nothing.
    let r: Result<(), Error> = vm.run(|b| {
        b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 99)?;
        Err(Error::AliasedOperand)
    });
    assert!(r.is_err());
    assert_eq!(read_u64(&vm, &t), 0);
    drop((t, foreign));
    assert_drained(&vm);
    assert_drained(&other);
}

#[test]
fn timeout_reports_a_diagnostic() {
    let cfg = Config::default().with_timeout_period(Duration::from_millis(100));
    let vm = VirtualMachine::new(cfg).unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    use std::sync::atomic::{AtomicBool, Ordering};
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    vm.run(|b| {
        b.call_named("sleepy", &s, &[], &[&t], move |_| {
            // Relaxed: a signal only, it publishes no data.
            flag.store(true, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(600))
        })
    })
    .unwrap();
    // The worker runs it: a read that found it still queued to a sleeping worker would run
    // it itself (`worker::caller_runs`; seen in release builds), and a caller busy running
    // a kernel is progress, not a timeout.
    while !started.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_micros(100));
    }
    match vm.read_small(&t, 0, &mut [0u8; 8]) {
        Err(Error::Timeout(d)) => {
            let text = d.to_string();
            assert!(text.contains("sleepy#"), "{text}");
            assert!(text.contains("read_small#"), "{text}");
            let sleepy = d
                .lively
                .iter()
                .find(|i| i.name.starts_with("sleepy#"))
                .unwrap();
            assert!(
                sleepy.dispatched && sleepy.launched && !sleepy.done,
                "{sleepy:?}"
            );
            let read = d
                .lively
                .iter()
                .find(|i| i.name.starts_with("read_small#"))
                .unwrap();
            // Same stream: an edge from `sleepy` exists only if the engine handled the
            // read before it dispatched `sleepy`; otherwise the read was dispatched behind
            // it on the in-order stream (no edge needed). Which one depends on timing: the
            // caller that ran `sleepy` usually dispatched it itself already.
            assert!(
                read.in_edges.len() == 1 || (read.in_edges.is_empty() && read.dispatched),
                "{read:?}"
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The abandoned instruction completes later; the VM keeps working.
    std::thread::sleep(Duration::from_millis(700));
    vm.sync().unwrap();
    assert_eq!(read_u64(&vm, &t), 0);
    drop(t);
    assert_drained(&vm);
}

#[test]
fn backpressure_bounds_flying_instructions() {
    let cfg = Config::default()
        .with_high_water_mark(64)
        .with_low_water_mark(32);
    let vm = VirtualMachine::new(cfg).unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(8).unwrap();
    let mut max = 0;
    for _ in 0..2000 {
        vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] += 1))
            .unwrap();
        max = max.max(vm.flying_instruction_count());
    }
    assert!(max <= 65 + 1, "flying reached {max}");
    assert_eq!(read_u64(&vm, &t), 2000);
    drop(t);
    assert_drained(&vm);
}

#[test]
fn config_from_env_reads_ivm_variables() {
    // Only checks the parsing entry point; the table of variables is on `Config`.
    let c = Config::from_lookup(|k| (k == "IVM_SKIP_THRESHOLD").then(|| "0".to_string())).unwrap();
    assert_eq!(c.skip_blocking_threshold, 0);
    let vm = VirtualMachine::new(c).unwrap();
    let t = vm.new_tensor(8).unwrap();
    vm.write_small(&t, 0, &7u64.to_ne_bytes()).unwrap();
    assert_eq!(read_u64(&vm, &t), 7);
}

/// A sync callback on a tensor nobody else is using runs on the calling thread (the VM
/// hands it over instead of waking the stream's worker), and sees and makes the same
/// effects as anywhere else.
#[test]
fn sync_callback_on_an_idle_stream_runs_on_the_caller() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let t = vm
        .new_tensor_from(&vm.default_stream(), &7u64.to_ne_bytes())
        .unwrap();
    let me = std::thread::current().id();
    let (ran_on, seen) = vm
        .access_mut(&t, |b| {
            let v = u64::from_ne_bytes(b[..8].try_into().unwrap());
            b[..8].copy_from_slice(&(v + 1).to_ne_bytes());
            (std::thread::current().id(), v)
        })
        .unwrap();
    assert_eq!(ran_on, me);
    assert_eq!(seen, 7);
    assert_eq!(read_u64(&vm, &t), 8);
    // Inside it, the VM refuses reentrant calls as it does on a worker.
    let vm2 = Arc::new(vm);
    let inner = vm2.clone();
    let r = vm2.access(&t, move |_| inner.sync().err()).unwrap();
    assert!(matches!(r, Some(Error::Reentrant)), "{r:?}");
    assert_drained(&vm2);
}

/// A sync callback submitted while a kernel still writes its tensor waits for it, then
/// runs (wherever the VM runs it) and sees the kernel's write — also when it becomes
/// ready while its caller helps the engine in its wait.
#[test]
fn sync_callback_behind_a_running_kernel() {
    for cfg in modes() {
        let cfg = cfg.with_timeout_period(Duration::from_secs(10));
        let vm = VirtualMachine::new(cfg).unwrap();
        let s = vm.default_stream();
        let t = vm.new_tensor(8).unwrap();
        for i in 0..20u64 {
            vm.run(|b| {
                b.call(&s, &[], &[&t], move |k| {
                    std::thread::sleep(Duration::from_millis(1));
                    k.output_u64(0)[0] = i;
                })
            })
            .unwrap();
            let v = vm
                .access_mut(&t, |b| {
                    let v = u64::from_ne_bytes(b[..8].try_into().unwrap());
                    b[..8].copy_from_slice(&(v * 10).to_ne_bytes());
                    v
                })
                .unwrap();
            assert_eq!(v, i);
            assert_eq!(read_u64(&vm, &t), i * 10);
        }
        assert_drained(&vm);
    }
}

/// A sync callback whose source (on another stream) finishes while its caller waits,
/// with more work queued behind the source on that stream's worker (which then leaves
/// the source's release to the waiting caller): the callback runs once, after the
/// source, and its caller gets the result.
#[test]
fn sync_callback_readied_by_its_helping_caller() {
    let spin = |d: Duration| {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < d {
            std::hint::spin_loop();
        }
    };
    let cfg = Config::default().with_timeout_period(Duration::from_secs(10));
    let vm = VirtualMachine::new(cfg).unwrap();
    let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
    let (t, other) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    for i in 0..50u64 {
        vm.run(|b| {
            // The writer, then more work queued behind it on the same worker, so that the
            // worker leaves the writer's release to the spinning caller.
            b.call(&s1, &[], &[&t], move |k| {
                spin(Duration::from_micros(20));
                k.output_u64(0)[0] = i;
            })?;
            b.call(&s1, &[], &[&other], move |_| {
                spin(Duration::from_micros(200))
            })
        })
        .unwrap();
        let v = vm
            .access(&t, |b| u64::from_ne_bytes(b[..8].try_into().unwrap()))
            .unwrap();
        assert_eq!(v, i);
    }
    assert_drained(&vm);
}

/// While a sync callback that the VM handed to its caller runs on the caller's thread,
/// later instructions of the same stream — one writing the same tensor, one touching
/// another tensor — wait for it: stream order holds as if the stream's worker ran it.
#[test]
fn stream_order_holds_around_a_callback_run_by_its_caller() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let vm = Arc::new(VirtualMachine::new(Config::default()).unwrap());
    let s = vm.default_stream();
    let t = vm.new_tensor_from(&s, &1u64.to_ne_bytes()).unwrap();
    let other = vm.new_tensor(8).unwrap();
    let in_callback = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(Mutex::new(Vec::new()));
    let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
    let submitter = {
        let (vm, t, other, s) = (vm.clone(), t.clone(), other.clone(), s.clone());
        let (flag, overlaps) = (in_callback.clone(), overlaps.clone());
        std::thread::spawn(move || {
            entered_rx.recv().unwrap();
            let (f1, o1, f2, o2) = (flag.clone(), overlaps.clone(), flag, overlaps);
            vm.run(|b| {
                b.call(&s, &[], &[&t], move |k| {
                    o1.lock().unwrap().push(f1.load(Ordering::SeqCst));
                    k.output_u64(0)[0] = 100;
                })?;
                b.call(&s, &[], &[&other], move |_| {
                    o2.lock().unwrap().push(f2.load(Ordering::SeqCst));
                })
            })
            .unwrap();
        })
    };
    let flag = in_callback.clone();
    let seen = vm
        .access_mut(&t, move |b| {
            flag.store(true, Ordering::SeqCst);
            entered_tx.send(()).unwrap();
            // Long enough for the other thread to submit and for a worker to run both.
            std::thread::sleep(Duration::from_millis(30));
            let v = u64::from_ne_bytes(b[..8].try_into().unwrap());
            b[..8].copy_from_slice(&(v + 1).to_ne_bytes());
            flag.store(false, Ordering::SeqCst);
            v
        })
        .unwrap();
    submitter.join().unwrap();
    vm.sync().unwrap();
    assert_eq!(seen, 1);
    assert_eq!(
        read_u64(&vm, &t),
        100,
        "the later write must come after the callback"
    );
    assert_eq!(
        *overlaps.lock().unwrap(),
        vec![false, false],
        "ran during the callback"
    );
    let vm = Arc::try_unwrap(vm).unwrap_or_else(|_| panic!("vm still shared"));
    assert_drained(&vm);
}
