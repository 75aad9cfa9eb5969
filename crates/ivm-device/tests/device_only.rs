//! Device-only memory through the doors: the sim with `host_visible: false` behaves like a
//! discrete GPU (no host pointer), and every door that hands bytes to host code — small
//! reads and writes, sync callbacks (`access`, `access_mut`), lazy-job interfaces and
//! parameters — stages through host memory with the device's own copies. Each scenario
//! runs the same work on cpu tensors and on device-only sim tensors and compares the
//! results bit for bit. Each runs on queued sim streams (`queued::<test>`) and on launcher
//! ones (`SimConfig::launcher`, the kernel mode cuda's streams have), in multi-thread
//! (`launcher::<test>`) and single-thread mode (`launcher_single::<test>`).

mod common;

use std::sync::Arc;

use common::host;
use ivm_device::sim::sim_device;
use ivm_device::{SimAdapter, SimConfig};
use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{
    Config, DebugCounters, DeviceAdapter, Error, Mode, Stream, StreamId, Tensor, VirtualMachine,
};

kernel_and_vm_modes!(
    [
        sim_memory_is_device_only_and_host_kernels_on_it_fail_cleanly,
        sync_callbacks_stage_device_only_memory,
        lazy_interfaces_and_parameters_stage_device_only_memory,
        graph_failures_reach_device_only_tensors,
        empty_device_only_tensors_need_no_staging,
        async_accesses_stage_device_only_memory,
        a_failed_copy_in_runs_no_callback,
        an_async_write_resolves_after_its_copy_back,
    ],
    []
);

/// A VM in `mode` with one device-only sim device (random latencies from `seed`; launcher
/// streams with `launcher`), and its compute stream.
fn vm(seed: u64, launcher: bool, mode: Mode) -> (VirtualMachine, Stream) {
    let sim: Arc<dyn DeviceAdapter> = SimAdapter::new(SimConfig {
        host_visible: false,
        launcher,
        ..SimConfig::random(1, seed)
    });
    let vm = VirtualMachine::with_adapters(Config::default().with_mode(mode), vec![sim]).unwrap();
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    (vm, s)
}

fn read(vm: &VirtualMachine, t: &Tensor) -> Result<Vec<u8>, Error> {
    let mut b = vec![0u8; t.nbytes()];
    // Small reads take at most 16 bytes at a time.
    for (i, chunk) in b.chunks_mut(16).enumerate() {
        vm.read_small(t, i * 16, chunk)?;
    }
    Ok(b)
}

fn u64s(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes_of(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

fn assert_drained(vm: VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

fn sim_memory_is_device_only_and_host_kernels_on_it_fail_cleanly(launcher: bool, mode: Mode) {
    let (vm, s) = vm(1, launcher, mode);
    let t = vm.new_tensor_from(&s, &bytes_of(&[5, 6])).unwrap();
    assert_eq!(u64s(&read(&vm, &t).unwrap()), [5, 6]);
    // A host kernel cannot touch device-only memory: the instruction fails, naming it,
    // and the VM goes on.
    // (On a launcher stream the host work the kernel enqueues fails on the device.)
    vm.run(|b| b.call(&s, &[], &[&t], host(|k| k.output_u64(0)[0] = 1)))
        .unwrap();
    let err = read(&vm, &t).unwrap_err();
    assert!(matches!(&err, Error::Poisoned { .. }), "{err}");
    let t2 = vm.new_tensor_from(&s, &bytes_of(&[7])).unwrap();
    assert_eq!(u64s(&read(&vm, &t2).unwrap()), [7]);
    drop((t, t2));
    assert_drained(vm);
}

/// `access` and `access_mut` on a device-only tensor: the callback sees the device's bytes
/// and its writes land on the device, in stream order with the copies around it.
fn sync_callbacks_stage_device_only_memory(launcher: bool, mode: Mode) {
    for seed in [1u64, 2, 3] {
        let (vm, s) = vm(seed, launcher, mode);
        let cpu = vm.default_stream();
        let mut results = Vec::new();
        for stream in [&cpu, &s] {
            let t = vm
                .new_tensor_from(stream, &bytes_of(&[1, 2, 3, 4]))
                .unwrap();
            let src = vm
                .new_tensor_from(&cpu, &bytes_of(&[10, 20, 30, 40]))
                .unwrap();
            let mut seen = Vec::new();
            for round in 0..20u64 {
                // An eager copy into the tensor, then a read-modify-write through the
                // callback, then a read through the callback.
                vm.run(|b| b.copy(stream, &src, &t)).unwrap();
                vm.access_mut(&t, move |b: &mut [u8]| {
                    for (i, w) in b.chunks_mut(8).enumerate() {
                        let v = u64::from_ne_bytes(w.try_into().unwrap());
                        w.copy_from_slice(&(v * 3 + round + i as u64).to_ne_bytes());
                    }
                })
                .unwrap();
                vm.run(|b| b.copy(stream, &t, &src)).unwrap();
                seen.push(vm.access(&t, |b: &[u8]| u64s(b)).unwrap());
            }
            seen.push(u64s(&read(&vm, &src).unwrap()));
            results.push(seen);
        }
        assert_eq!(
            results[0], results[1],
            "seed {seed}: cpu and device-only sim differ"
        );
        assert_drained(vm);
    }
}

/// y = x * w + i (per word), w += x: a graph with an input, an output and a parameter.
fn graph() -> Graph {
    let mut g = GraphBuilder::new("device_only_affine");
    let x = g.input("x", 32);
    let w = g.param("w", 32);
    let y = g.blob("y", 32);
    g.param_kernel("fwd", &[x], &[y], move |k| {
        for i in 0..4 {
            let xv = k.input_u64(0)[i];
            let v = xv.wrapping_mul(k.param_u64(w)[i]).wrapping_add(i as u64);
            k.output_u64(0)[i] = v;
            k.param_u64_mut(w)[i] = k.param_u64(w)[i].wrapping_add(xv);
        }
    });
    g.output("y", y);
    g.build().unwrap()
}

/// Lazy launches whose input, output and parameter are device-only sim tensors give the
/// cpu tensors' results, with eager copies and small writes between launches.
fn lazy_interfaces_and_parameters_stage_device_only_memory(launcher: bool, mode: Mode) {
    for seed in [1u64, 2, 3] {
        let (vm, s) = vm(seed, launcher, mode);
        let cpu = vm.default_stream();
        let g = graph();
        let mut results = Vec::new();
        for stream in [&cpu, &s] {
            let x = vm
                .new_tensor_from(stream, &bytes_of(&[1, 2, 3, 4]))
                .unwrap();
            let w = vm
                .new_tensor_from(stream, &bytes_of(&[5, 6, 7, 8]))
                .unwrap();
            let y = vm.new_tensor_on(stream, 32).unwrap();
            let acc = vm.new_tensor_on(&cpu, 32).unwrap();
            let mut seen = Vec::new();
            for round in 0..15u64 {
                vm.write_small(&x, 8, &round.to_ne_bytes()).unwrap();
                vm.run(|b| {
                    b.launch_lazy_job(&[&x], &[&y], &[&w], g.lazy())?;
                    // Eager work on the output right after the launch: copied to the cpu,
                    // then fed back as the next input (copies run on the device's stream).
                    b.copy(stream, &y, &acc)?;
                    b.copy(stream, &acc, &x)
                })
                .unwrap();
                if round % 5 == 4 {
                    seen.push(u64s(&read(&vm, &y).unwrap()));
                }
            }
            for t in [&x, &w, &y, &acc] {
                seen.push(u64s(&read(&vm, t).unwrap()));
            }
            results.push(seen);
        }
        assert_eq!(
            results[0], results[1],
            "seed {seed}: cpu and device-only sim differ"
        );
        assert_drained(vm);
    }
}

/// The async forms stage too: a write, a callback and a read, each completed, give the
/// cpu tensor's results.
fn async_accesses_stage_device_only_memory(launcher: bool, mode: Mode) {
    let (vm, s) = vm(4, launcher, mode);
    let cpu = vm.default_stream();
    let mut results = Vec::new();
    for stream in [&cpu, &s] {
        let t = vm.new_tensor_on(stream, 24).unwrap();
        vm.write_small_async(&t, 8, &9u64.to_ne_bytes())
            .wait()
            .unwrap();
        let sum = vm
            .access_async(&t, |b: &[u8]| u64s(b).iter().sum::<u64>())
            .wait()
            .unwrap();
        let mut out = [0u8; 8];
        vm.read_small_async(&t, 8, &mut out)
            .wait_timeout(std::time::Duration::from_secs(30))
            .unwrap();
        results.push((sum, u64::from_ne_bytes(out), u64s(&read(&vm, &t).unwrap())));
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0].0, 9);
    assert_drained(vm);
}

/// A graph kernel that panics poisons a device-only output and parameter like cpu ones
/// (through the copy back), an invalid output is never touched, and the graph and the
/// device keep serving.
fn graph_failures_reach_device_only_tensors(launcher: bool, mode: Mode) {
    let (vm, s) = vm(5, launcher, mode);
    let mut g = GraphBuilder::new("device_only_boom");
    let x = g.input("x", 8);
    let w = g.param("w", 8);
    let y = g.blob("y", 8);
    g.param_kernel("boom", &[x], &[y], move |k| {
        let v = k.input_u64(0)[0];
        if v == 13 {
            panic!("unlucky input");
        }
        k.output_u64(0)[0] = v + k.param_u64(w)[0];
        k.param_u64_mut(w)[0] += 1;
    });
    g.output("y", y);
    g.output_with("unused", y, false);
    let graph = g.build().unwrap();
    let cpu = vm.default_stream();
    for stream in [&cpu, &s] {
        let x = vm.new_tensor_from(stream, &13u64.to_ne_bytes()).unwrap();
        let w = vm.new_tensor_from(stream, &100u64.to_ne_bytes()).unwrap();
        let (y, unused) = (
            vm.new_tensor_on(stream, 8).unwrap(),
            vm.new_tensor_from(stream, &7u64.to_ne_bytes()).unwrap(),
        );
        vm.run(|b| b.launch_lazy_job(&[&x], &[&y, &unused], &[&w], graph.lazy()))
            .unwrap();
        for t in [&y, &w] {
            match read(&vm, t) {
                Err(Error::Poisoned { message, .. }) => {
                    assert!(message.contains("unlucky input"), "{message}")
                }
                other => panic!("expected the graph's failure, got {other:?}"),
            }
        }
        assert_eq!(u64s(&read(&vm, &unused).unwrap()), [7]);
        // Fresh tensors: the next run succeeds.
        let (x2, w2, y2) = (
            vm.new_tensor_from(stream, &1u64.to_ne_bytes()).unwrap(),
            vm.new_tensor_from(stream, &100u64.to_ne_bytes()).unwrap(),
            vm.new_tensor_on(stream, 8).unwrap(),
        );
        vm.run(|b| b.launch_lazy_job(&[&x2], &[&y2, &unused], &[&w2], graph.lazy()))
            .unwrap();
        assert_eq!(u64s(&read(&vm, &y2).unwrap()), [101]);
        assert_eq!(u64s(&read(&vm, &w2).unwrap()), [101]);
    }
    drop(graph);
    assert_drained(vm);
}

/// An empty device-only tensor has no bytes to stage: callbacks see an empty slice, and
/// nothing fails on the device's stream (a failure there would poison later work).
fn empty_device_only_tensors_need_no_staging(launcher: bool, mode: Mode) {
    let (vm, s) = vm(6, launcher, mode);
    let empty = vm.new_tensor_on(&s, 0).unwrap();
    assert_eq!(vm.access(&empty, |b: &[u8]| b.len()).unwrap(), 0);
    vm.access_mut(&empty, |b: &mut [u8]| assert!(b.is_empty()))
        .unwrap();
    assert_eq!(
        vm.access_async(&empty, |b: &[u8]| b.len()).wait().unwrap(),
        0
    );
    // The device's default stream is healthy afterwards.
    let t = vm.new_tensor_from(&s, &bytes_of(&[3])).unwrap();
    let cpu = vm.new_tensor_on(&vm.default_stream(), 8).unwrap();
    vm.run(|b| b.copy(&s, &t, &cpu)).unwrap();
    assert_eq!(u64s(&read(&vm, &cpu).unwrap()), [3]);
    drop((empty, t, cpu));
    assert_drained(vm);
}

/// A copy-in that fails on the device: no callback runs on the zeroed staging copy it
/// leaves (a write would copy those zeros back to the device as the tensor's bytes), each
/// door reports the failure, and the VM goes on once the device is healed.
fn a_failed_copy_in_runs_no_callback(launcher: bool, mode: Mode) {
    use ivm_device::sim::SimFaults;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let sim = SimAdapter::new(SimConfig {
        host_visible: false,
        launcher,
        faults: SimFaults {
            seed: 1,
            copy_fail: 1,
            ..SimFaults::NONE
        },
        ..SimConfig::random(1, 6)
    });
    let adapter: Arc<dyn DeviceAdapter> = sim.clone();
    let vm =
        VirtualMachine::with_adapters(Config::default().with_mode(mode), vec![adapter]).unwrap();
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let tensor = || vm.new_tensor_on(&s, 16).unwrap();
    let r = {
        let ran = ran.clone();
        vm.access_mut(&tensor(), move |b: &mut [u8]| {
            ran.fetch_add(1, SeqCst);
            b[0] = 7;
        })
    };
    assert!(r.is_err(), "access_mut after a failed copy-in: {r:?}");
    let r = {
        let ran = ran.clone();
        vm.access(&tensor(), move |_: &[u8]| ran.fetch_add(1, SeqCst))
    };
    assert!(r.is_err(), "access after a failed copy-in: {r:?}");
    let r = {
        let ran = ran.clone();
        vm.access_async(&tensor(), move |_: &[u8]| ran.fetch_add(1, SeqCst))
            .wait()
    };
    assert!(r.is_err(), "access_async after a failed copy-in: {r:?}");
    let written = tensor();
    let r = vm.write_small_async(&written, 0, &[1u8; 8]).wait();
    assert!(
        r.is_err(),
        "write_small_async after a failed copy-in: {r:?}"
    );
    assert_eq!(ran.load(SeqCst), 0, "a callback ran on a failed copy-in");
    assert!(sim.fault_stats().copy_fail > 0);

    sim.heal();
    // The tensor whose staged write failed stays failed; the device serves new work.
    assert!(read(&vm, &written).is_err());
    let _ = vm.sync();
    let t = vm.new_tensor_from(&s, &bytes_of(&[3, 4])).unwrap();
    vm.access_mut(&t, |b: &mut [u8]| b[0] += 1).unwrap();
    assert_eq!(u64s(&read(&vm, &t).unwrap()), [4, 4]);
    assert_drained(vm);
}

/// An async write to device-only memory resolves once its copy back reached the device,
/// not when the staging copy was written: whenever its completion says `Ok`, the bytes
/// are on the device; when a copy failed, the completion says so and the tensor is
/// poisoned. Seeds with failed copies in and out, and none.
fn an_async_write_resolves_after_its_copy_back(launcher: bool, mode: Mode) {
    use ivm_device::sim::SimFaults;
    let (mut ok, mut failed) = (0, 0);
    for seed in 0..24 {
        let sim = SimAdapter::new(SimConfig {
            host_visible: false,
            launcher,
            faults: SimFaults {
                seed,
                copy_fail: 2,
                ..SimFaults::NONE
            },
            ..SimConfig::random(1, seed)
        });
        let adapter: Arc<dyn DeviceAdapter> = sim.clone();
        let vm = VirtualMachine::with_adapters(Config::default().with_mode(mode), vec![adapter])
            .unwrap();
        let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
        let t = vm.new_tensor_on(&s, 16).unwrap();
        let r = vm.write_small_async(&t, 0, &7u64.to_ne_bytes()).wait();
        sim.heal();
        // A device error still pending is reported once, to one observer.
        let got = read(&vm, &t).or_else(|_| read(&vm, &t));
        match r {
            Ok(()) => {
                ok += 1;
                assert_eq!(u64s(&got.unwrap()), [7, 0], "seed {seed}");
            }
            Err(_) => {
                failed += 1;
                assert!(got.is_err(), "seed {seed}: a failed write left {got:?}");
            }
        }
        let _ = vm.sync();
        drop(t);
        assert_drained(vm);
    }
    assert!(
        ok > 0 && failed > 0,
        "{ok} writes succeeded, {failed} failed"
    );
}
