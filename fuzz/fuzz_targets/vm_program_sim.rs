//! The VM equivalence target (`vm_program`) on the cpu plus two sim devices: kernels on
//! compute, host-to-device and device-to-host streams of every device, copies between
//! the host and the devices, lazy-job launches, sync accesses of device tensors, with
//! random (seeded) sim latencies. Results must equal the sequential interpreter. Each
//! program runs twice: on queued sim streams, and on launcher ones (`SimConfig::launcher`,
//! the kernel mode cuda's streams have: kernels enqueue their work from the worker).
//!
//! Kernel panics are stripped (libFuzzer aborts on any panic). `IVM_FUZZ_STATS=1` prints,
//! every 1024 programs and at exit, the program lengths reached and how many programs
//! crossed streams and devices.
#![no_main]

#[path = "common/stats.rs"]
mod stats;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ivm_device::sim::{Latency, SimAdapter, SimConfig, sim_device};
use ivm_std::fuzzing::{HashKernels, Program, Runner, Topology};
use ivm_graph::fuzzing::launch_graphs;
use ivm_std::{Config, DeviceAdapter};
use libfuzzer_sys::fuzz_target;

/// The runners on queued and on launcher sim streams.
static RUNNERS: OnceLock<[Runner; 2]> = OnceLock::new();

fn runner(launcher: bool) -> Runner {
    let us = Duration::from_micros;
    let sim: Arc<dyn DeviceAdapter> = SimAdapter::new(SimConfig {
        devices: 2,
        launch_latency: Latency::between(us(0), us(40)),
        kernel_latency: Latency::between(us(0), us(80)),
        copy_latency: Latency::between(us(0), us(40)),
        seed: 0x1d_5eed,
        launcher,
        ..SimConfig::default()
    });
    Runner::with_topology(
        ivm_std::fuzzing::ci_lane(Config::default()),
        vec![sim],
        Topology::with_devices(&[sim_device(0), sim_device(1)]),
        HashKernels,
    )
    .and_then(|r| r.with_launch_graphs(launch_graphs()?))
    .expect("start the VM")
}

fuzz_target!(|program: Program| {
    let runners = RUNNERS.get_or_init(|| [runner(false), runner(true)]);
    let program = program.without_panics();
    for (runner, mode) in runners.iter().zip(["queued", "launcher"]) {
        match runner.run(&program) {
            // Counted once: both runs fit the program to the same topology.
            Ok(o) if mode == "queued" => stats::record(&program, &o),
            Ok(_) => {}
            Err(mismatch) => panic!("{mode} sim streams: {mismatch}"),
        }
    }
});
