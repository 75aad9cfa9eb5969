//! The VM on the sim adapter: cross-stream soft sync, release on the producer stream,
//! asynchronous completions, sticky failures, bad input. The scenarios that launch kernels
//! run on queued sim streams and on launcher ones (`SimConfig::launcher`, the kernel mode
//! cuda's streams have), as `queued::<test>` and `launcher::<test>`, each in every VM
//! configuration (multi- and single-thread, stream waits or recorded events).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::{
    Config, DebugCounters, DeviceAdapter, DeviceKind, Error, StreamId, StreamType, Tensor,
    VirtualMachine,
};

use common::host;

kernel_modes!(
    host_read_after_a_slow_kernel_on_another_stream_sees_its_write,
    a_tensor_dropped_while_another_stream_reads_it_is_freed_after_the_read,
    pipelines_over_two_sim_devices_and_the_cpu_compute_the_sequential_result,
    an_async_kernel_failure_is_sticky_until_the_host_observes_it,
    many_cross_stream_uses_with_random_latencies,
);

/// A sim of `config` with launcher streams (`launcher`) or queued ones.
fn sim(mut config: SimConfig, launcher: bool) -> Arc<SimAdapter> {
    config.launcher = launcher;
    SimAdapter::new(config)
}

fn configs() -> Vec<(&'static str, Config)> {
    let mut v = Vec::new();
    for (mode, base) in [
        ("multi", Config::default()),
        ("single", Config::single_thread()),
    ] {
        for wait in [true, false] {
            let name = match (mode, wait) {
                ("multi", true) => "multi/stream-wait",
                ("multi", false) => "multi/record-event",
                (_, true) => "single/stream-wait",
                (_, false) => "single/record-event",
            };
            v.push((
                name,
                base.clone()
                    .with_stream_wait(wait)
                    .with_timeout_period(Duration::from_secs(20))
                    // The sim's allocator itself (poisoning, use-after-free counting) sees
                    // every free; `alloc_cache.rs` runs these scenarios through the cache.
                    .with_caching_allocator(false),
            ));
        }
    }
    v
}

fn vm_with(cfg: Config, sim: &Arc<SimAdapter>) -> VirtualMachine {
    let a: Arc<dyn DeviceAdapter> = sim.clone();
    VirtualMachine::with_adapters(cfg, vec![a]).unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

/// OneFlow's prescheduling bug (#7607): a host read issued right after a slow kernel that
/// writes the tensor on another stream must see the written value.
fn host_read_after_a_slow_kernel_on_another_stream_sees_its_write(launcher: bool) {
    for (name, cfg) in configs() {
        let sim = sim(SimConfig::random(1, 11), launcher);
        let vm = vm_with(cfg, &sim);
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        let x = vm.new_tensor_on(&s1, 8).unwrap();
        for round in 1..=3u64 {
            vm.run(|b| {
                b.call_named(
                    "slow_write",
                    &s1,
                    &[],
                    &[&x],
                    host(move |k| {
                        std::thread::sleep(Duration::from_millis(50));
                        k.output_u64(0)[0] = 1000 + round;
                    }),
                )
            })
            .unwrap();
            assert_eq!(read_u64(&vm, &x).unwrap(), 1000 + round, "{name}");
        }
        // The same through a device-to-host copy (an event-completed instruction) and a
        // host read of the cpu tensor it writes.
        let d2h = vm
            .stream(StreamId {
                device: sim_device(0),
                stream_type: StreamType::DeviceToHost,
                thread_id: 2,
            })
            .unwrap();
        let h = vm.new_tensor(8).unwrap();
        vm.run(|b| {
            b.call_named(
                "slow_write",
                &s1,
                &[],
                &[&x],
                host(|k| {
                    std::thread::sleep(Duration::from_millis(50));
                    k.output_u64(0)[0] = 77;
                }),
            )?;
            b.copy(&d2h, &x, &h)
        })
        .unwrap();
        assert_eq!(read_u64(&vm, &h).unwrap(), 77, "{name}");
        drop((x, h));
        vm.sync().unwrap();
        let st = sim.allocator_stats(0).unwrap();
        assert_eq!((st.use_after_free, st.live_bytes), (0, 0), "{name}: {st:?}");
        drained(&vm);
    }
}

/// PyTorch's `record_stream` problem: a tensor dropped while another stream still reads it
/// is released on its producer stream after a soft sync, so the (poisoning) allocator frees
/// it only after the read.
fn a_tensor_dropped_while_another_stream_reads_it_is_freed_after_the_read(launcher: bool) {
    for (name, cfg) in configs() {
        let sim = sim(SimConfig::random(1, 23), launcher);
        let vm = vm_with(cfg, &sim);
        let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        let y = vm.new_tensor_on(&s1, 8).unwrap();
        for round in 0..3u64 {
            let x = vm.new_tensor_on(&s0, 8).unwrap();
            vm.run(|b| {
                b.call(
                    &s0,
                    &[],
                    &[&x],
                    host(move |k| k.output_u64(0)[0] = 40 + round),
                )?;
                b.call_named(
                    "slow_read",
                    &s1,
                    &[&x],
                    &[&y],
                    host(|k| {
                        std::thread::sleep(Duration::from_millis(50));
                        k.output_u64(0)[0] = k.input_u64(0)[0] + 2;
                    }),
                )
            })
            .unwrap();
            drop(x); // while `slow_read` still sleeps on s1
            assert_eq!(read_u64(&vm, &y).unwrap(), 42 + round, "{name}");
        }
        vm.sync().unwrap();
        let st = sim.allocator_stats(0).unwrap();
        assert_eq!(st.use_after_free, 0, "{name}: {st:?}");
        assert_eq!(
            st.frees, 3,
            "{name}: every dropped tensor was freed: {st:?}"
        );
        drop(y);
        drained(&vm);
        assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0, "{name}");
    }
}

/// Host-to-device, compute and device-to-host streams on two sim devices plus the cpu,
/// with random latencies: every result equals the sequential computation.
fn pipelines_over_two_sim_devices_and_the_cpu_compute_the_sequential_result(launcher: bool) {
    for (name, cfg) in configs() {
        let sim = sim(SimConfig::random(2, 5), launcher);
        let vm = vm_with(cfg, &sim);
        let mut want = Vec::new();
        let mut outs = Vec::new();
        for dev in 0..2u32 {
            let d = sim_device(dev);
            let id = |t, th| StreamId {
                device: d,
                stream_type: t,
                thread_id: th,
            };
            let h2d = vm.stream(id(StreamType::HostToDevice, 0)).unwrap();
            let c0 = vm.stream(id(StreamType::Compute, 0)).unwrap();
            let c1 = vm.stream(id(StreamType::Compute, 1)).unwrap();
            let d2h = vm.stream(id(StreamType::DeviceToHost, 1)).unwrap();
            let host_in = vm.new_tensor(16).unwrap();
            let host_out = vm.new_tensor(16).unwrap();
            let (a, b) = (
                vm.new_tensor_on(&c0, 16).unwrap(),
                vm.new_tensor_on(&c1, 16).unwrap(),
            );
            let mut x = u64::from(dev) + 3;
            for i in 0..6u64 {
                let cpu = vm.default_stream();
                vm.run(|bl| {
                    bl.call(&cpu, &[], &[&host_in], move |k| {
                        k.output_u64(0)[0] = x;
                        k.output_u64(0)[1] = i;
                    })?;
                    bl.copy(&h2d, &host_in, &a)?;
                    bl.call(
                        &c0,
                        &[],
                        &[&a],
                        host(|k| {
                            let w = k.output_u64(0);
                            w[0] = w[0].wrapping_mul(31).wrapping_add(w[1]);
                        }),
                    )?;
                    bl.call(
                        &c1,
                        &[&a],
                        &[&b],
                        host(|k| {
                            let v = k.input_u64(0)[0];
                            k.output_u64(0)[0] = v ^ 0x5555;
                            k.output_u64(0)[1] = v;
                        }),
                    )?;
                    bl.copy(&d2h, &b, &host_out)
                })
                .unwrap();
                let y = x.wrapping_mul(31).wrapping_add(i);
                x = y ^ 0x5555;
                let mut buf = [0u8; 16];
                vm.read_small(&host_out, 0, &mut buf).unwrap();
                assert_eq!(
                    u64::from_ne_bytes(buf[..8].try_into().unwrap()),
                    x,
                    "{name} dev {dev} round {i}"
                );
                assert_eq!(u64::from_ne_bytes(buf[8..].try_into().unwrap()), y);
            }
            want.push(x);
            outs.push((host_out, a, b, host_in));
        }
        // Sync reads straight from device tensors, on each device's default stream.
        for (dev, (_, _, b, _)) in outs.iter().enumerate() {
            assert_eq!(read_u64(&vm, b).unwrap(), want[dev], "{name}");
        }
        // Sync writes, then reads, of a device tensor.
        let t = &outs[1].1;
        vm.write_small(t, 0, &99u64.to_ne_bytes()).unwrap();
        assert_eq!(read_u64(&vm, t).unwrap(), 99);
        let got = vm.access(t, |bytes| bytes[0]).unwrap();
        assert_eq!(got, 99);
        drop(outs);
        vm.sync().unwrap();
        for dev in 0..2 {
            let st = sim.allocator_stats(dev).unwrap();
            assert_eq!((st.use_after_free, st.live_bytes), (0, 0), "{name}: {st:?}");
        }
        drained(&vm);
    }
}

/// A kernel that fails on an asynchronous stream after its instruction was done at launch
/// poisons, stickily, the outputs launched on that stream until a host-observed completion
/// returns the error.
fn an_async_kernel_failure_is_sticky_until_the_host_observes_it(launcher: bool) {
    for (name, cfg) in configs() {
        let sim = sim(SimConfig::random(1, 3), launcher);
        let vm = vm_with(cfg, &sim);
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        let (a, b, c) = (
            vm.new_tensor_on(&s1, 8).unwrap(),
            vm.new_tensor_on(&s1, 8).unwrap(),
            vm.new_tensor_on(&s1, 8).unwrap(),
        );
        vm.run(|bl| {
            // On a launcher stream the kernel's host work fails on the device.
            bl.call_named("boom", &s1, &[], &[&a], host(|_| panic!("device fault")))?;
            // Independent of `a`, but launched on the same stream after the failure.
            bl.call_named("after", &s1, &[], &[&b], host(|k| k.output_u64(0)[0] = 1))
        })
        .unwrap();
        for t in [&a, &b] {
            match read_u64(&vm, t) {
                Err(Error::Poisoned {
                    instruction,
                    message,
                }) => {
                    assert!(instruction.starts_with("boom#"), "{name}: {instruction}");
                    assert!(message.contains("device fault"), "{name}: {message}");
                }
                other => panic!("{name}: expected Poisoned, got {other:?}"),
            }
        }
        // The host observes the stream (sync): the error is reported once, then cleared.
        assert!(matches!(vm.sync(), Err(Error::Poisoned { .. })), "{name}");
        vm.sync().unwrap();
        vm.run(|bl| bl.call(&s1, &[], &[&c], host(|k| k.output_u64(0)[0] = 5)))
            .unwrap();
        assert_eq!(
            read_u64(&vm, &c).unwrap(),
            5,
            "{name}: the stream works again"
        );
        drop((a, b, c));
        drained(&vm);
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let sim = SimAdapter::new(SimConfig::random(2, 9));
    let vm = vm_with(Config::default(), &sim);
    let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
    let s1 = vm.stream(StreamId::default_for(sim_device(1))).unwrap();
    let (a8, a16) = (
        vm.new_tensor_on(&s0, 8).unwrap(),
        vm.new_tensor_on(&s0, 16).unwrap(),
    );
    let b8 = vm.new_tensor_on(&s1, 8).unwrap();
    let h8 = vm.new_tensor(8).unwrap();
    // Copies between mismatched sizes.
    assert!(matches!(
        vm.run(|b| b.copy(&s0, &a8, &a16)),
        Err(Error::SizeMismatch { src: 8, dst: 16 })
    ));
    // A copy on a stream that cannot reach a tensor (a cpu stream and a sim tensor; sim
    // streams do reach other sim devices: peer copies, see `d2d_copy.rs`), a kernel on a
    // tensor of another device.
    assert!(matches!(
        vm.run(|b| b.copy(&vm.default_stream(), &a8, &h8)),
        Err(Error::DeviceMismatch(_))
    ));
    assert!(matches!(
        vm.run(|b| b.copy(&vm.default_stream(), &b8, &h8)),
        Err(Error::DeviceMismatch(_))
    ));
    assert!(matches!(
        vm.run(|b| b.call(&vm.default_stream(), &[&a8], &[&h8], |_| {})),
        Err(Error::DeviceMismatch(_))
    ));
    // Streams of a device that does not exist, or whose kind has no adapter.
    assert!(matches!(
        vm.stream(StreamId::default_for(sim_device(2))),
        Err(Error::UnsupportedStream(_))
    ));
    let cuda0 = ivm_std::Device {
        kind: DeviceKind::named("cuda"),
        index: 0,
    };
    assert!(matches!(
        vm.stream(StreamId::default_for(cuda0)),
        Err(Error::UnsupportedStream(_))
    ));
    // A tensor of a device the VM has no adapter for (it came from another VM).
    let plain = VirtualMachine::new(Config::default()).unwrap();
    assert!(matches!(
        plain.stream(StreamId::default_for(sim_device(0))),
        Err(Error::UnsupportedStream(_))
    ));
    assert!(matches!(
        plain.read_small(&a8, 0, &mut [0u8; 8]),
        Err(Error::ForeignObject(_))
    ));
    assert!(matches!(
        plain.run(|b| b.copy(&plain.default_stream(), &a8, &h8)),
        Err(Error::ForeignObject(_))
    ));
    // Waiting on an event of another device.
    let (d0, d1) = (
        sim.create_stream(0, StreamType::Compute).unwrap(),
        sim.create_stream(1, StreamType::Compute).unwrap(),
    );
    let e1 = d1.record_event().unwrap();
    assert!(matches!(
        d0.wait_event(&*e1),
        Err(Error::ForeignEvent { .. })
    ));
    // Two adapters of one kind, or a second cpu adapter.
    let again: Vec<Arc<dyn DeviceAdapter>> = vec![sim.clone(), sim.clone()];
    assert!(matches!(
        VirtualMachine::with_adapters(Config::default(), again),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        VirtualMachine::with_adapters(
            Config::default(),
            vec![Arc::new(ivm_std::CpuAdapter::new())]
        ),
        Err(Error::Config(_))
    ));
    // Small accesses of unsupported sizes on a device tensor.
    assert!(matches!(
        vm.read_small(&a16, 0, &mut [0u8; 3]),
        Err(Error::UnsupportedSize(3))
    ));
    drop((a8, a16, b8, h8));
    drained(&vm);
    drained(&plain);
}

/// Tensors created from host data on a device, many small sync accesses, and a flood of
/// cross-stream work: nothing is lost, nothing is freed early.
fn many_cross_stream_uses_with_random_latencies(launcher: bool) {
    let sim = sim(SimConfig::random(1, 99), launcher);
    let vm = vm_with(Config::default(), &sim);
    let d = sim_device(0);
    let streams: Vec<_> = (0..3)
        .map(|t| vm.stream(StreamId::compute(d, t)).unwrap())
        .collect();
    let t = vm
        .new_tensor_from(&streams[2], &5u64.to_ne_bytes())
        .unwrap();
    let mut want = 5u64;
    let t0 = Instant::now();
    for i in 0..60u64 {
        let s = &streams[(i % 3) as usize];
        vm.run(|b| {
            b.call(
                s,
                &[],
                &[&t],
                host(move |k| {
                    let w = &mut k.output_u64(0)[0];
                    *w = w.wrapping_mul(7).wrapping_add(i);
                }),
            )
        })
        .unwrap();
        want = want.wrapping_mul(7).wrapping_add(i);
        if i % 10 == 9 {
            assert_eq!(read_u64(&vm, &t).unwrap(), want);
        }
    }
    assert_eq!(read_u64(&vm, &t).unwrap(), want);
    assert!(t0.elapsed() < Duration::from_secs(30));
    drop(t);
    vm.sync().unwrap();
    assert_eq!(sim.allocator_stats(0).unwrap().use_after_free, 0);
    drained(&vm);
}

/// Sizes no host can back (the sim's memory is host memory) are `OutOfMemory`, never a
/// panic or an abort, through the bare allocator and through the VM (with and without its
/// caching allocator); a refused request does not count against the device's capacity.
#[test]
fn impossible_sim_allocations_are_out_of_memory() {
    let mut sizes = vec![usize::MAX, usize::MAX / 2, isize::MAX as usize + 1];
    if usize::BITS >= 64 {
        // A PiB: beyond any machine's address space (overcommit cannot fake it).
        sizes.push(1usize << (usize::BITS - 14));
    }
    let sim = SimAdapter::new(SimConfig::default());
    let a = sim.allocator(0).unwrap();
    for &n in &sizes {
        match a.allocate(n) {
            Err(Error::OutOfMemory { nbytes, .. }) => assert_eq!(nbytes, n),
            other => panic!("allocate({n}): expected OutOfMemory, got {other:?}"),
        }
    }
    assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0);
    assert_eq!(sim.allocator_stats(0).unwrap().allocations, 0);
    for caching_allocator in [false, true] {
        let vm = vm_with(
            Config::default().with_caching_allocator(caching_allocator),
            &sim,
        );
        let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
        for &n in &sizes {
            match vm.new_tensor_on(&s0, n) {
                Err(Error::OutOfMemory { nbytes, .. }) => assert_eq!(nbytes, n),
                other => panic!("new_tensor_on({n}): expected OutOfMemory, got {other:?}"),
            }
        }
        let t = vm.new_tensor_from(&s0, &5u64.to_ne_bytes()).unwrap();
        assert_eq!(read_u64(&vm, &t).unwrap(), 5);
        drop(t);
        drained(&vm);
    }
}

/// On a launcher stream a kernel's body runs on the worker, ahead of the device: touching
/// its operands' bytes there would race with the work queued before it, so it fails the
/// kernel (naming `on_host`), and the stream goes on.
#[test]
fn a_launcher_kernel_that_touches_bytes_on_the_worker_fails() {
    for (name, cfg) in configs() {
        let sim = sim(SimConfig::random(1, 17), true);
        let vm = vm_with(cfg, &sim);
        let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
        let (t, u) = (
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
        );
        vm.run(|b| b.call_named("direct", &s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
            .unwrap();
        match read_u64(&vm, &t) {
            Err(Error::Poisoned {
                instruction,
                message,
            }) => {
                assert!(instruction.starts_with("direct#"), "{name}: {instruction}");
                assert!(message.contains("on_host"), "{name}: {message}");
            }
            other => panic!("{name}: a launcher kernel touched its bytes: {other:?}"),
        }
        vm.run(|b| b.call(&s, &[], &[&u], host(|k| k.output_u64(0)[0] = 2)))
            .unwrap();
        assert_eq!(read_u64(&vm, &u).unwrap(), 2, "{name}");
        drop((t, u));
        drained(&vm);
    }
}
