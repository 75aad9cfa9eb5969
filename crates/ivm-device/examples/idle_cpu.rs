//! CPU time the VM's threads use while a 1 s sim kernel runs (Linux: per-thread
//! `/proc/self/task/*/schedstat`).
//!
//! Two waits on the kernel's result: a device-to-host copy (done when its event completes,
//! whose callback unparks the scheduler) followed by a sync read of the host tensor, and a
//! sync read of the device tensor itself (released by a host closure queued after the
//! copy through the stream's pinned buffer). Neither should burn CPU while the device
//! works: the scheduler parks, workers block on their notifiers, the caller sleeps.
//!
//! `cargo run --release -p ivm-device --example idle_cpu`

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::{Config, DeviceAdapter, StreamId, StreamType, VirtualMachine};

/// (thread name, CPU ns) of every thread of this process.
fn threads() -> HashMap<String, (String, u64)> {
    let mut m = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return m;
    };
    for e in dir.flatten() {
        let p = e.path();
        let name = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let ns = std::fs::read_to_string(p.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        m.insert(
            e.file_name().to_string_lossy().into_owned(),
            (name.trim().to_string(), ns),
        );
    }
    m
}

fn self_cpu() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn report(label: &str, before: &HashMap<String, (String, u64)>, caller: u64, wall: Duration) {
    let after = threads();
    let (mut vm, mut sim) = (0u64, 0u64);
    let mut rows = Vec::new();
    for (tid, (name, ns)) in &after {
        let d = ns - before.get(tid).map_or(0, |b| b.1);
        if name.starts_with("ivm") {
            vm += d;
            rows.push(format!("    {name:<16} {:>8.3} ms", d as f64 / 1e6));
        } else if name.starts_with("sim") {
            sim += d;
        }
    }
    rows.sort();
    let caller = self_cpu() - caller;
    println!("{label}: wall {:.3} s", wall.as_secs_f64());
    for r in rows {
        println!("{r}");
    }
    println!(
        "  VM threads {:.3} ms, sim device threads {:.3} ms, caller {:.3} ms",
        vm as f64 / 1e6,
        sim as f64 / 1e6,
        caller as f64 / 1e6
    );
}

fn main() -> ivm_std::Result<()> {
    let sim = SimAdapter::new(SimConfig::default());
    let a: Arc<dyn DeviceAdapter> = sim;
    let cfg = Config::from_env()?;
    println!(
        "config: worker poll {:?}, scheduler window {:?}",
        cfg.worker_poll_window, cfg.scheduler_work_window
    );
    let vm = VirtualMachine::with_adapters(cfg, vec![a])?;
    let s1 = vm.stream(StreamId::compute(sim_device(0), 1))?;
    let d2h = vm.stream(StreamId {
        device: sim_device(0),
        stream_type: StreamType::DeviceToHost,
        thread_id: 1,
    })?;
    let x = vm.new_tensor_on(&s1, 8)?;
    let h = vm.new_tensor(8)?;
    let mut out = [0u8; 8];
    // Warm up: every thread and stream exists before measuring.
    vm.run(|b| {
        b.call(&s1, &[], &[&x], |k| k.output_u64(0)[0] = 1)?;
        b.copy(&d2h, &x, &h)
    })?;
    vm.read_small(&h, 0, &mut out)?;
    vm.read_small(&x, 0, &mut out)?;

    for (round, label) in [
        (0u64, "1 s kernel, d2h copy, sync read of the host tensor"),
        (1, "1 s kernel, sync read of the device tensor"),
    ] {
        let before = threads();
        let caller = self_cpu();
        let t0 = Instant::now();
        vm.run(|b| {
            b.call_named("one_second", &s1, &[], &[&x], move |k| {
                std::thread::sleep(Duration::from_secs(1));
                k.output_u64(0)[0] = 100 + round;
            })?;
            if round == 0 {
                b.copy(&d2h, &x, &h)?;
            }
            Ok(())
        })?;
        let t = if round == 0 { &h } else { &x };
        vm.read_small(t, 0, &mut out)?;
        assert_eq!(u64::from_ne_bytes(out), 100 + round);
        report(label, &before, caller, t0.elapsed());
    }
    drop((x, h));
    vm.shutdown()
}
