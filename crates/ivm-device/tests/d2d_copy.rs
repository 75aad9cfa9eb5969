//! Device-to-device copies with soft sync, on the sim adapter: between two sim devices
//! (peer copies) on either device's copy streams or compute streams, and between two
//! streams of one device; each after a slow writer on another stream and before a reader
//! on a third, with and without the caching allocator, in both modes and both soft-sync
//! flavours. Bad input is an error.

use std::sync::Arc;
use std::time::Duration;

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::{Config, DeviceAdapter, Error, Stream, StreamId, StreamType, Tensor, VirtualMachine};

fn configs() -> Vec<(String, Config)> {
    let mut v = Vec::new();
    for (mode, base) in [
        ("multi", Config::default()),
        ("single", Config::single_thread()),
    ] {
        for wait in [true, false] {
            for cache in [true, false] {
                v.push((
                    format!("{mode}/stream_wait={wait}/cache={cache}"),
                    base.clone()
                        .with_stream_wait(wait)
                        .with_caching_allocator(cache)
                        .with_timeout_period(Duration::from_secs(20)),
                ));
            }
        }
    }
    v
}

fn vm_with(cfg: Config, sim: &Arc<SimAdapter>) -> VirtualMachine {
    let a: Arc<dyn DeviceAdapter> = sim.clone();
    VirtualMachine::with_adapters(cfg, vec![a]).unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

fn stream(vm: &VirtualMachine, dev: u32, stream_type: StreamType, thread_id: u32) -> Stream {
    vm.stream(StreamId {
        device: sim_device(dev),
        stream_type,
        thread_id,
    })
    .unwrap()
}

/// Slow writer on `w`, copy `src -> dst` on `c`, reader of `dst` on `r`, a host read of
/// the reader's output; the source is dropped right after the copy (its release must wait
/// for the copy).
fn chain(vm: &VirtualMachine, w: &Stream, c: &Stream, r: &Stream, name: &str, round: u64) {
    let src = vm.new_tensor_on(w, 8).unwrap();
    let dst = vm.new_tensor_on(r, 8).unwrap();
    let out = vm.new_tensor_on(r, 8).unwrap();
    vm.run(|b| {
        b.call_named("slow_write", w, &[], &[&src], move |k| {
            std::thread::sleep(Duration::from_millis(20));
            k.output_u64(0)[0] = 1000 + round;
        })?;
        b.copy(c, &src, &dst)?;
        b.call_named("read", r, &[&dst], &[&out], |k| {
            k.output_u64(0)[0] = k.input_u64(0)[0] * 2;
        })
    })
    .unwrap();
    drop(src);
    assert_eq!(read_u64(vm, &out), 2 * (1000 + round), "{name}");
    assert_eq!(read_u64(vm, &dst), 1000 + round, "{name}");
}

#[test]
fn copies_between_two_sim_devices_are_ordered_by_soft_sync() {
    for (name, cfg) in configs() {
        let sim = SimAdapter::new(SimConfig::random(2, 31));
        let vm = vm_with(cfg, &sim);
        let w0 = stream(&vm, 0, StreamType::Compute, 0);
        let r1 = stream(&vm, 1, StreamType::Compute, 0);
        let routes = [
            ("sim:1 h2d", stream(&vm, 1, StreamType::HostToDevice, 1)),
            ("sim:0 d2h", stream(&vm, 0, StreamType::DeviceToHost, 2)),
            ("sim:0 compute", stream(&vm, 0, StreamType::Compute, 3)),
            ("sim:1 compute", stream(&vm, 1, StreamType::Compute, 4)),
        ];
        for (round, (route, c)) in routes.iter().enumerate() {
            chain(&vm, &w0, c, &r1, &format!("{name}: {route}"), round as u64);
            // And back, sim:1 -> sim:0.
            chain(
                &vm,
                &r1,
                c,
                &w0,
                &format!("{name}: {route} back"),
                10 + round as u64,
            );
        }
        vm.shrink_all_mem().unwrap();
        for dev in 0..2 {
            let st = sim.allocator_stats(dev).unwrap();
            assert_eq!((st.use_after_free, st.live_bytes), (0, 0), "{name}: {st:?}");
        }
        vm.shutdown().unwrap();
    }
}

#[test]
fn copies_between_two_streams_of_one_device_are_ordered_by_soft_sync() {
    for (name, cfg) in configs() {
        let sim = SimAdapter::new(SimConfig::random(1, 37));
        let vm = vm_with(cfg, &sim);
        let w = stream(&vm, 0, StreamType::Compute, 0);
        let r = stream(&vm, 0, StreamType::Compute, 1);
        let routes = [
            ("d2h stream", stream(&vm, 0, StreamType::DeviceToHost, 2)),
            ("h2d stream", stream(&vm, 0, StreamType::HostToDevice, 3)),
            ("compute stream of the writer", w.clone()),
            ("compute stream of the reader", r.clone()),
        ];
        for (round, (route, c)) in routes.iter().enumerate() {
            chain(&vm, &w, c, &r, &format!("{name}: {route}"), round as u64);
        }
        vm.shrink_all_mem().unwrap();
        let st = sim.allocator_stats(0).unwrap();
        assert_eq!((st.use_after_free, st.live_bytes), (0, 0), "{name}: {st:?}");
        vm.shutdown().unwrap();
    }
}

#[test]
fn bad_copies_are_errors_not_panics() {
    let sim = SimAdapter::new(SimConfig::random(2, 41));
    let vm = vm_with(Config::default(), &sim);
    let s0 = stream(&vm, 0, StreamType::DeviceToHost, 1);
    let s1 = stream(&vm, 1, StreamType::HostToDevice, 1);
    let (a8, a16) = (
        vm.new_tensor_on(&s0, 8).unwrap(),
        vm.new_tensor_on(&s0, 16).unwrap(),
    );
    let b16 = vm.new_tensor_on(&s1, 16).unwrap();
    // Mismatched sizes, within a device and across devices.
    assert!(matches!(
        vm.run(|b| b.copy(&s0, &a8, &a16)),
        Err(Error::SizeMismatch { src: 8, dst: 16 })
    ));
    assert!(matches!(
        vm.run(|b| b.copy(&s1, &b16, &a8)),
        Err(Error::SizeMismatch { src: 16, dst: 8 })
    ));
    // A tensor onto itself.
    assert!(matches!(
        vm.run(|b| b.copy(&s0, &a8, &a8)),
        Err(Error::AliasedOperand)
    ));
    // A cpu stream cannot reach device memory.
    assert!(matches!(
        vm.run(|b| b.copy(&vm.default_stream(), &a16, &b16)),
        Err(Error::DeviceMismatch(_))
    ));
    // A tensor of another VM.
    let sim2 = SimAdapter::new(SimConfig::default());
    let vm2 = vm_with(Config::default(), &sim2);
    let t2 = vm2
        .new_tensor_on(&stream(&vm2, 0, StreamType::Compute, 0), 16)
        .unwrap();
    assert!(matches!(
        vm.run(|b| b.copy(&s0, &a16, &t2)),
        Err(Error::ForeignObject(_))
    ));
    // Nothing was submitted by the failed runs; the VM still works.
    vm.run(|b| b.copy(&s1, &a16, &b16)).unwrap();
    vm.sync().unwrap();
    vm.shutdown().unwrap();
    assert_eq!(sim.allocator_stats(0).unwrap().use_after_free, 0);
}
