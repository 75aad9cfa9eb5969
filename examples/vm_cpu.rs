//! CPU time the VM's own threads use while it has nothing to do.
//!
//! Reads `/proc/self/task/*/schedstat` (first field: nanoseconds on CPU) before and after
//! each phase and sums it over the VM's threads, recognised by name (`ivm<id>-scheduler`,
//! `ivm<id>-cpu:0-t0`, ...). Two phases, each printed as percent of one core:
//!
//! * `idle`: the VM sits idle for the period, starting right after a sync read returned
//!   (so whatever the VM spends winding down after work counts);
//! * `busy_kernel`: one kernel sleeps for the period and the caller waits for it with a
//!   sync read of its output; the VM threads and the waiting caller are reported
//!   separately.
//!
//! Linux only. VM settings come from [`Config::from_env`] (`IVM_*`, e.g.
//! `IVM_WORKER_POLL_US=200 IVM_SCHEDULER_WINDOW_US=1000` for the many-core windows).
//! Run with `cargo run --release --example vm_cpu [seconds]` (default 1 s per phase).

use std::time::{Duration, Instant};

use ivm::ivm_std::{Config, VirtualMachine};

mod common;
use common::{cpu_between, my_tid, thread_cpu};

fn pct(ns: u64, wall: Duration) -> f64 {
    ns as f64 / wall.as_nanos() as f64 * 100.0
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1.0);
    let period = Duration::from_secs_f64(secs);
    let config = Config::from_env().expect("IVM_* variables parse");
    println!(
        "VM threads' CPU time, {secs} s per phase (worker poll {:?}, scheduler window {:?}, {} hardware threads)",
        config.worker_poll_window,
        config.scheduler_work_window,
        std::thread::available_parallelism().map_or(1, usize::from)
    );
    let vm = VirtualMachine::new(config).expect("VM starts");
    let s = vm.default_stream();
    let t = vm.new_tensor(8).expect("tensor");
    let tid = my_tid();
    let mut out = [0u8; 8];
    // Warm up: every VM thread exists and has run.
    for k in 0..100u64 {
        vm.run(|b| b.call(&s, &[], &[&t], move |c| c.output_u64(0)[0] = k))
            .expect("run");
        vm.read_small(&t, 0, &mut out).expect("read");
    }
    let me = thread_cpu()
        .get(&tid)
        .map(|x| x.0.clone())
        .unwrap_or_default();
    let prefix = {
        let names: Vec<String> = thread_cpu().into_values().map(|x| x.0).collect();
        let sched = names
            .iter()
            .find(|n| n.ends_with("-scheduler"))
            .expect("a thread named ivm<id>-scheduler");
        format!("{}-", sched.trim_end_matches("-scheduler"))
    };

    // (a) idle.
    vm.read_small(&t, 0, &mut out).expect("read");
    let (b0, t0) = (thread_cpu(), Instant::now());
    std::thread::sleep(period);
    let (b1, wall) = (thread_cpu(), t0.elapsed());
    let (vm_ns, _, detail) = cpu_between(&b0, &b1, &prefix, tid);
    println!("\nidle ({:.3} s):", wall.as_secs_f64());
    for (n, ns) in &detail {
        println!(
            "  {n:<16} {:9.1} µs  {:7.3} %",
            *ns as f64 / 1e3,
            pct(*ns, wall)
        );
    }
    println!("FIGURE idle_cpu_pct {:.3} %", pct(vm_ns, wall));

    // (b) one kernel sleeps for the period; the caller waits with a sync read.
    let (b0, t0) = (thread_cpu(), Instant::now());
    vm.run(|b| {
        b.call(&s, &[], &[&t], move |c| {
            std::thread::sleep(period);
            c.output_u64(0)[0] = 7;
        })
    })
    .expect("run");
    vm.read_small(&t, 0, &mut out).expect("read");
    let (b1, wall) = (thread_cpu(), t0.elapsed());
    assert_eq!(u64::from_ne_bytes(out), 7);
    let (vm_ns, caller_ns, detail) = cpu_between(&b0, &b1, &prefix, tid);
    println!("\nbusy_kernel ({:.3} s):", wall.as_secs_f64());
    for (n, ns) in &detail {
        println!(
            "  {n:<16} {:9.1} µs  {:7.3} %",
            *ns as f64 / 1e3,
            pct(*ns, wall)
        );
    }
    println!(
        "  caller ({me})  {:9.1} µs  {:7.3} %",
        caller_ns as f64 / 1e3,
        pct(caller_ns, wall)
    );
    println!("FIGURE busy_kernel_vm_cpu_pct {:.3} %", pct(vm_ns, wall));
    println!(
        "FIGURE busy_kernel_caller_cpu_pct {:.3} %",
        pct(caller_ns, wall)
    );
    println!(
        "FIGURE busy_kernel_cpu_pct {:.3} %  (VM threads + waiting caller)",
        pct(vm_ns + caller_ns, wall)
    );
    vm.shutdown().expect("shutdown");
}
