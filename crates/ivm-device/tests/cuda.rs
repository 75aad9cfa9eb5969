//! The cuda adapter. Without a GPU only `creating_the_adapter_never_panics` runs; the rest
//! is `#[ignore]`d and runs where a GPU exists:
//! `cargo test -p ivm-device --features cuda --test cuda -- --ignored`.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use ivm_device::cuda::{CudaAdapter, cuda_device};
use ivm_std::{
    Config, DeviceAdapter, DeviceMemory, Error, HostMemory, StreamId, StreamType, Tensor,
    VirtualMachine,
};

#[test]
fn creating_the_adapter_never_panics() {
    match CudaAdapter::new() {
        Ok(a) => assert!(a.device_count() > 0),
        Err(Error::Device(m)) => eprintln!("no CUDA here: {m}"),
        Err(e) => panic!("unexpected error {e:?}"),
    }
}

fn vm(stream_wait: bool) -> VirtualMachine {
    let a: Arc<dyn DeviceAdapter> = CudaAdapter::new().expect("a CUDA device");
    let cfg = Config::default()
        .with_stream_wait(stream_wait)
        .with_timeout_period(Duration::from_secs(20));
    VirtualMachine::with_adapters(cfg, vec![a]).unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_and_small_accesses_round_trip() {
    let vm = vm(true);
    let d = cuda_device(0);
    let h2d = vm
        .stream(StreamId {
            device: d,
            stream_type: StreamType::HostToDevice,
            thread_id: 0,
        })
        .unwrap();
    let d2h = vm
        .stream(StreamId {
            device: d,
            stream_type: StreamType::DeviceToHost,
            thread_id: 1,
        })
        .unwrap();
    let c = vm.stream(StreamId::default_for(d)).unwrap();
    let host = vm
        .new_tensor_from(&vm.default_stream(), &42u64.to_ne_bytes())
        .unwrap();
    let back = vm.new_tensor(8).unwrap();
    let dev = vm.new_tensor_on(&c, 8).unwrap();
    vm.run(|b| {
        b.copy(&h2d, &host, &dev)?;
        b.copy(&d2h, &dev, &back)
    })
    .unwrap();
    assert_eq!(read_u64(&vm, &back), 42);
    assert_eq!(read_u64(&vm, &dev), 42);
    vm.write_small(&dev, 0, &7u64.to_ne_bytes()).unwrap();
    assert_eq!(read_u64(&vm, &dev), 7);
    let init = vm.new_tensor_from(&c, &9u64.to_ne_bytes()).unwrap();
    assert_eq!(read_u64(&vm, &init), 9);
    drop((host, back, dev, init));
    vm.shutdown().unwrap();
}

/// OneFlow's prescheduling regression on a real GPU: a host read right after a slow
/// "kernel" (a host function that blocks the stream 50 ms, then a copy) on another stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_read_after_a_slow_kernel_on_another_stream() {
    for wait in [true, false] {
        let vm = vm(wait);
        let s1 = vm.stream(StreamId::compute(cuda_device(0), 1)).unwrap();
        let x = vm.new_tensor_on(&s1, 8).unwrap();
        for round in 1..=3u64 {
            vm.run(|b| {
                b.call(&s1, &[], &[&x], move |k| {
                    let s = k.device_stream().expect("cuda kernels get their stream");
                    s.launch_host(Box::new(|| std::thread::sleep(Duration::from_millis(50))))
                        .unwrap();
                    let src: Arc<dyn DeviceMemory> =
                        Arc::new(HostMemory::from_bytes(&(100 + round).to_ne_bytes()));
                    // SAFETY: `src` is ours; the VM orders the output.
                    unsafe { s.copy(&src, 0, k.output_memory(0), 0, 8) }.unwrap();
                })
            })
            .unwrap();
            assert_eq!(read_u64(&vm, &x), 100 + round, "stream_wait={wait}");
        }
        drop(x);
        vm.shutdown().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_complete_through_callbacks_and_foreign_events_are_errors() {
    let a = CudaAdapter::new().unwrap();
    let s = a.create_stream(0, StreamType::Compute).unwrap();
    s.launch_host(Box::new(|| std::thread::sleep(Duration::from_millis(30))))
        .unwrap();
    let e = s.record_event().unwrap();
    assert!(!e.query());
    let hit = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h2 = hit.clone();
    e.on_complete(Box::new(move || {
        h2.store(true, std::sync::atomic::Ordering::SeqCst)
    }));
    e.synchronize().unwrap();
    assert!(e.query());
    s.synchronize().unwrap();
    assert!(hit.load(std::sync::atomic::Ordering::SeqCst));
    let cpu = ivm_std::CpuAdapter::new()
        .create_stream(0, StreamType::Compute)
        .unwrap();
    let ec = cpu.record_event().unwrap();
    assert!(matches!(
        s.wait_event(&*ec),
        Err(Error::ForeignEvent { .. })
    ));
    let big = a.allocator(0).unwrap().allocate(16).unwrap();
    let small = a.allocator(0).unwrap().allocate(8).unwrap();
    // SAFETY: nothing else touches these.
    assert!(matches!(
        unsafe { s.copy(&big, 0, &small, 0, 16) },
        Err(Error::OutOfBounds { .. })
    ));
}
