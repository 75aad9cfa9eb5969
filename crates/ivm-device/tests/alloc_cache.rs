//! The caching allocator per stream (`ivm_std::alloc_cache`) on the sim adapter: reuse in
//! stream order with the zero fill ordered before the new owner and after the old one,
//! out of memory as an error naming the request and the stream (after returning cached
//! blocks), `shrink_all_mem`, stats, and the `Config` knob.

use std::sync::Arc;
use std::time::Duration;

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::alloc_cache::{CachingAllocator, size_class};
use ivm_std::{
    Config, DeviceAdapter, DeviceAllocator, DeviceStream, Error, StreamId, StreamType, Tensor,
    VirtualMachine,
};

fn configs() -> Vec<(&'static str, Config)> {
    let base = Config::default().with_timeout_period(Duration::from_secs(20));
    let mut v = Vec::new();
    for (name, mode) in [
        ("multi", base.clone()),
        (
            "single",
            base.clone().with_mode(ivm_std::Mode::SingleThread),
        ),
    ] {
        for wait in [true, false] {
            v.push((name, mode.clone().with_stream_wait(wait)));
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

/// PyTorch's `record_stream` scenario through the cache: a tensor dropped while another
/// stream still reads it goes back to its home stream's bins after a soft sync; the next
/// tensor of that stream reuses the block at once, and its zero fill (stream order) comes
/// after the slow read on the other stream and before its own first kernel.
#[test]
fn a_block_reused_while_another_stream_still_reads_it_is_filled_after_the_read() {
    for (name, cfg) in configs() {
        let sim = SimAdapter::new(SimConfig::random(1, 5));
        let vm = vm_with(cfg, &sim);
        let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        let y = vm.new_tensor_on(&s1, 8).unwrap();
        let mut fresh = Vec::new();
        for round in 0..4u64 {
            let x = vm.new_tensor_on(&s0, 8).unwrap();
            vm.run(|b| {
                b.call(&s0, &[], &[&x], move |k| {
                    assert_eq!(k.output_u64(0)[0], 0, "a reused block is zero-filled first");
                    k.output_u64(0)[0] = 40 + round;
                })?;
                b.call_named("slow_read", &s1, &[&x], &[&y], |k| {
                    std::thread::sleep(Duration::from_millis(30));
                    k.output_u64(0)[0] = k.input_u64(0)[0] + 2;
                })
            })
            .unwrap();
            drop(x);
            // Allocated while the slow read may still run: its zero fill must wait.
            let z = vm.new_tensor_on(&s0, 8).unwrap();
            fresh.push(z);
            assert_eq!(read_u64(&vm, &y), 42 + round, "{name}: round {round}");
            // Every release has run: the next round's `x` is served from the bins.
            vm.sync().unwrap();
        }
        for z in &fresh {
            assert_eq!(read_u64(&vm, z), 0, "{name}: a reused block reads as zeros");
        }
        let st = vm.cache_stats();
        assert!(st.hits >= 3, "{name}: {st:?}");
        drop((y, fresh));
        let returned = vm.shrink_all_mem().unwrap();
        assert_eq!(returned, vm.cache_stats().returned_bytes, "{name}");
        let st = sim.allocator_stats(0).unwrap();
        assert_eq!((st.use_after_free, st.live_bytes), (0, 0), "{name}: {st:?}");
        assert_eq!(vm.cache_stats().cached_bytes, 0);
        vm.shutdown().unwrap();
    }
}

/// `new_tensor_from` on a reused block: the data is written in stream order, after the
/// previous owner's queued kernel, and other streams see it (soft sync from the home
/// stream).
#[test]
fn initial_data_on_a_reused_block_lands_after_the_old_owner_and_is_seen_elsewhere() {
    for (name, cfg) in configs() {
        let sim = SimAdapter::new(SimConfig::random(1, 8));
        let vm = vm_with(cfg, &sim);
        let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        for round in 0..3u64 {
            let old = vm.new_tensor_on(&s0, 8).unwrap();
            vm.run(|b| {
                b.call_named("slow_old_owner", &s0, &[], &[&old], |k| {
                    std::thread::sleep(Duration::from_millis(100));
                    k.output_u64(0)[0] = 0xdead;
                })
            })
            .unwrap();
            drop(old);
            // Until the release has launched (the block is in s0's bins), while the old
            // owner's kernel is still queued on the device; an empty `run` drives the
            // engine in single-thread mode.
            let t0 = std::time::Instant::now();
            while vm.stream_cache_stats(&s0).unwrap().unwrap().cached_blocks == 0 {
                assert!(t0.elapsed() < Duration::from_secs(10), "{name}: no release");
                vm.run(|_| Ok(())).unwrap();
                std::thread::sleep(Duration::from_micros(200));
            }
            let t = vm
                .new_tensor_from(&s0, &(100 + round).to_ne_bytes())
                .unwrap();
            let out = vm.new_tensor_on(&s1, 8).unwrap();
            vm.run(|b| {
                b.call(&s1, &[&t], &[&out], |k| {
                    k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
                })
            })
            .unwrap();
            assert_eq!(read_u64(&vm, &out), 101 + round, "{name}");
            assert_eq!(read_u64(&vm, &t), 100 + round, "{name}");
        }
        assert!(vm.cache_stats().hits >= 2, "{name}");
        vm.shutdown().unwrap();
        let st = sim.allocator_stats(0).unwrap();
        assert_eq!(
            (st.use_after_free, st.live_bytes),
            (0, 0),
            "{name}: shutdown returns the cache"
        );
    }
}

/// Size classes: requests of one class share blocks; other classes do not.
#[test]
fn blocks_are_binned_by_size_class() {
    let sim = SimAdapter::new(SimConfig::default());
    let vm = vm_with(Config::default(), &sim);
    let s = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
    assert_eq!(size_class(1000), size_class(1024));
    drop(vm.new_tensor_on(&s, 1000).unwrap());
    vm.sync().unwrap();
    let st = vm.stream_cache_stats(&s).unwrap().unwrap();
    assert_eq!((st.cached_blocks, st.cached_bytes), (1, 1024));
    let a = vm.new_tensor_on(&s, 1024).unwrap(); // same class: a hit
    assert_eq!(a.nbytes(), 1024);
    let b = vm.new_tensor_on(&s, 2000).unwrap(); // another class: a miss
    let st = vm.stream_cache_stats(&s).unwrap().unwrap();
    assert_eq!((st.hits, st.misses, st.cached_blocks), (1, 2, 0));
    assert_eq!(read_u64(&vm, &a), 0);
    drop((a, b));
    assert_eq!(vm.shrink_all_mem().unwrap(), 1024 + size_class(2000));
    assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0);
    // Another VM's stream is an error, not a panic.
    let other = VirtualMachine::new(Config::default()).unwrap();
    assert!(matches!(
        other.stream_cache_stats(&s),
        Err(Error::ForeignObject(_))
    ));
}

/// Out of memory is an error that names the request and the stream; with blocks cached
/// on the device the VM returns them first and the retry succeeds.
#[test]
fn out_of_memory_is_an_error_naming_the_request_and_the_stream() {
    for (name, cfg) in configs() {
        let sim = SimAdapter::new(SimConfig::random(1, 3));
        sim.set_memory_capacity(0, Some(4096)).unwrap();
        let vm = vm_with(cfg, &sim);
        let s0 = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
        let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
        let big = vm.new_tensor_on(&s0, 3000).unwrap(); // class 3072
        match vm.new_tensor_on(&s1, 2000) {
            Err(Error::OutOfMemory {
                nbytes,
                stream,
                detail,
            }) => {
                assert_eq!(nbytes, 2000, "{name}");
                assert!(stream.contains("sim:0"), "{name}: {stream}");
                assert!(stream.contains(&s1.id().to_string()), "{name}: {stream}");
                assert!(detail.contains("4096"), "{name}: {detail}");
                let msg = Error::OutOfMemory {
                    nbytes,
                    stream,
                    detail,
                }
                .to_string();
                assert!(msg.contains("2000 bytes"), "{name}: {msg}");
            }
            other => panic!("{name}: expected OutOfMemory, got {other:?}"),
        }
        // Freed into s0's bins: the device still counts it, but a request on s1 gets it
        // back (the VM returns cached blocks and retries).
        drop(big);
        vm.sync().unwrap();
        assert_eq!(vm.cache_stats().cached_bytes, 3072, "{name}");
        let t = vm.new_tensor_on(&s1, 2000).unwrap();
        assert_eq!(vm.cache_stats().cached_bytes, 0, "{name}");
        vm.run(|b| b.call(&s1, &[], &[&t], |k| k.output_u64(0)[0] = 5))
            .unwrap();
        assert_eq!(read_u64(&vm, &t), 5, "{name}");
        // A request beyond the capacity, with nothing cached: the error, no abort.
        assert!(
            matches!(
                vm.new_tensor_on(&s0, 1 << 20),
                Err(Error::OutOfMemory { nbytes, .. }) if nbytes == 1 << 20
            ),
            "{name}"
        );
        drop(t);
        vm.shutdown().unwrap();
        assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0, "{name}");
    }
}

/// `shrink_all_mem` waits for busy streams (it does not fail), and is an error from
/// inside the VM and after shutdown.
#[test]
fn shrink_waits_for_busy_streams_and_refuses_misuse() {
    let sim = SimAdapter::new(SimConfig::random(1, 4));
    let vm = Arc::new(vm_with(Config::default(), &sim));
    let s = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
    let x = vm.new_tensor_on(&s, 64).unwrap();
    vm.run(|b| {
        b.call_named("slow", &s, &[], &[&x], |k| {
            std::thread::sleep(Duration::from_millis(50));
            k.output_u64(0)[0] = 1;
        })
    })
    .unwrap();
    drop(x); // released after the slow kernel
    assert_eq!(vm.shrink_all_mem().unwrap(), 256, "waited for the release");
    assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0);
    // From a barrier (a VM thread): reentrant.
    let (vm2, got) = (vm.clone(), Arc::new(std::sync::Mutex::new(None)));
    let g2 = got.clone();
    vm.run(|b| {
        b.barrier(move || {
            *g2.lock().unwrap() = Some(vm2.shrink_all_mem());
        })
    })
    .unwrap();
    vm.sync().unwrap();
    assert!(matches!(
        got.lock().unwrap().take(),
        Some(Err(Error::Reentrant))
    ));
    vm.shutdown().unwrap();
    assert!(matches!(vm.shrink_all_mem(), Err(Error::ShutDown)));
}

/// With the knob off, frees go straight to the device allocator.
#[test]
fn the_config_knob_turns_the_cache_off() {
    let sim = SimAdapter::new(SimConfig::default());
    let vm = vm_with(Config::default().with_caching_allocator(false), &sim);
    let s = vm.stream(StreamId::default_for(sim_device(0))).unwrap();
    drop(vm.new_tensor_on(&s, 100).unwrap());
    vm.sync().unwrap();
    assert_eq!(vm.stream_cache_stats(&s).unwrap(), None);
    assert_eq!(vm.cache_stats(), Default::default());
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!((st.frees, st.live_bytes), (1, 0));
    assert!(matches!(
        Config::from_lookup(|k| (k == "IVM_CACHING_ALLOC").then(|| "0".into())),
        Ok(Config {
            caching_allocator: false,
            ..
        })
    ));
    assert!(matches!(
        Config::from_lookup(|k| (k == "IVM_CACHING_ALLOC").then(|| "2".into())),
        Err(Error::Config(_))
    ));
}

/// The cache on its own, over the sim allocator: `allocate` keeps the trait's promise
/// (zeroed, ready for every stream) by zeroing in stream order and waiting.
#[test]
fn the_bare_cache_zeroes_reused_blocks_in_stream_order() {
    let sim = SimAdapter::new(SimConfig::random(1, 6));
    let stream: Arc<dyn DeviceStream> = sim.create_stream(0, StreamType::Compute).unwrap();
    let cache = CachingAllocator::new(sim.allocator(0).unwrap(), stream.clone(), "sim:0/test");
    let a = cache.allocate(64).unwrap();
    let p = a.host_ptr().unwrap();
    let a2 = a.clone();
    stream
        .launch_host(Box::new(move || {
            std::thread::sleep(Duration::from_millis(20));
            let p = a2.host_ptr().unwrap();
            // SAFETY: stream order: the only access to the block now.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0xab, 64) };
        }))
        .unwrap();
    cache.free_on(&a, &*stream).unwrap();
    let b = cache.allocate(64).unwrap();
    assert_eq!(b.host_ptr(), Some(p), "reused");
    // SAFETY: `allocate` returned after the stream zeroed the block; nothing touches it.
    let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), 64) };
    assert!(bytes.iter().all(|&x| x == 0));
    // Freed on another stream: back to the device allocator, in that stream's order.
    let other = sim.create_stream(0, StreamType::Compute).unwrap();
    cache.free_on(&b, &*other).unwrap();
    other.synchronize().unwrap();
    assert_eq!(sim.allocator_stats(0).unwrap().live_bytes, 0);
    // A block of another device is refused, not panicked on.
    let sim2 = SimAdapter::new(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    let s1 = sim2.create_stream(1, StreamType::Compute).unwrap();
    let c1 = CachingAllocator::new(sim2.allocator(1).unwrap(), s1.clone(), "sim:1/test");
    let c = cache.allocate(8).unwrap();
    assert!(matches!(
        c1.free_on(&c, &*s1),
        Err(Error::DeviceMismatch(_))
    ));
}
