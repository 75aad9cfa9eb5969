//! The scheduler learns of device completions through event callbacks, never by polling:
//! while a 1 s sim kernel runs, the VM's threads and the waiting caller use almost no CPU.
//! (`examples/idle_cpu.rs` prints the per-thread figures.)
#![cfg(target_os = "linux")]

use std::sync::Arc;
use std::time::Duration;

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::{Config, DeviceAdapter, StreamId, StreamType, VirtualMachine};

/// CPU nanoseconds of this process's threads whose name starts with `prefix`.
fn cpu_of(prefix: &str) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let name = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if name.starts_with(prefix) {
            total += std::fs::read_to_string(e.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

fn self_cpu() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn vm_threads_sleep_while_a_one_second_sim_kernel_runs() {
    if std::fs::read_to_string("/proc/thread-self/schedstat").is_err() {
        eprintln!("no schedstat: skipped");
        return;
    }
    // The spin windows of a many-core machine: they must not turn into polling either.
    let cfg = Config::default()
        .with_worker_poll_window(Duration::from_micros(200))
        .with_scheduler_work_window(Duration::from_millis(1));
    let sim: Arc<dyn DeviceAdapter> = SimAdapter::new(SimConfig::default());
    let vm = VirtualMachine::with_adapters(cfg, vec![sim]).unwrap();
    let prefix = format!("ivm{}-", vm_id(&vm));
    let s1 = vm.stream(StreamId::compute(sim_device(0), 1)).unwrap();
    let d2h = vm
        .stream(StreamId {
            device: sim_device(0),
            stream_type: StreamType::DeviceToHost,
            thread_id: 1,
        })
        .unwrap();
    let (x, h) = (vm.new_tensor_on(&s1, 8).unwrap(), vm.new_tensor(8).unwrap());
    let mut out = [0u8; 8];
    vm.run(|b| b.copy(&d2h, &x, &h)).unwrap();
    vm.read_small(&h, 0, &mut out).unwrap();
    vm.read_small(&x, 0, &mut out).unwrap();
    for round in 0..2u64 {
        let (vm0, me0) = (cpu_of(&prefix), self_cpu());
        vm.run(|b| {
            b.call(&s1, &[], &[&x], move |k| {
                std::thread::sleep(Duration::from_secs(1));
                k.output_u64(0)[0] = 9 + round;
            })?;
            if round == 0 {
                b.copy(&d2h, &x, &h)?;
            }
            Ok(())
        })
        .unwrap();
        let t = if round == 0 { &h } else { &x };
        vm.read_small(t, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 9 + round);
        let (vm_ms, me_ms) = (
            (cpu_of(&prefix) - vm0) as f64 / 1e6,
            (self_cpu() - me0) as f64 / 1e6,
        );
        eprintln!("round {round}: VM threads {vm_ms:.3} ms CPU, caller {me_ms:.3} ms CPU");
        // Polling through a 1 s wait would cost hundreds of ms; parking costs well under 1.
        assert!(vm_ms < 100.0, "VM threads used {vm_ms:.1} ms CPU");
        assert!(me_ms < 100.0, "the waiting caller used {me_ms:.1} ms CPU");
    }
    drop((x, h));
    vm.shutdown().unwrap();
}

/// The VM's id, from its `Debug` output (thread names are `ivm{id}-...`).
fn vm_id(vm: &VirtualMachine) -> usize {
    let d = format!("{vm:?}");
    let start = d.find("id: ").unwrap() + 4;
    d[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}
