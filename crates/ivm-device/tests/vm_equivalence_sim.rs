//! VM ≡ sequential interpreter (`ivm_std::fuzzing`) on the cpu plus two sim devices:
//! random programs with kernels on compute, host-to-device and device-to-host streams of
//! every device, copies between host and devices, lazy-job launches, sync accesses of
//! device tensors, tensors re-homed on other devices, and random (seeded) sim latencies.
//!
//! Each runs on queued sim streams and on launcher ones (`SimConfig::launcher`, the kernel
//! mode cuda's streams have: the programs' kernels enqueue their work from the worker).
//!
//! `IVM_EQUIV_SIM_CASES` overrides the proptest case count (default 512); the VM's
//! configuration honours the `IVM_*` variables (`Config::from_env`).

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm_device::sim::{Latency, SimAdapter, SimConfig, sim_device};
use ivm_graph::fuzzing::launch_graphs;
use ivm_std::fuzzing::{self, HashKernels, Program, Runner, Topology};
use ivm_std::{Config, DebugCounters, DeviceAdapter, Mode};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError, TestRunner};

fn cases() -> u32 {
    std::env::var("IVM_EQUIV_SIM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

/// The sim's kernel modes, by name: queued and launcher streams.
const KERNEL_MODES: [(&str, bool); 2] = [("queued", false), ("launcher", true)];

/// Two sim devices with random latencies drawn from `seed`: short enough for many
/// programs, long enough that events complete well after they are recorded; launcher
/// streams with `launcher`.
fn sim(seed: u64, launcher: bool) -> Arc<SimAdapter> {
    let us = Duration::from_micros;
    SimAdapter::new(SimConfig {
        devices: 2,
        launch_latency: Latency::between(us(1), us(150)),
        kernel_latency: Latency::between(us(1), us(300)),
        copy_latency: Latency::between(us(1), us(150)),
        seed,
        launcher,
        ..SimConfig::default()
    })
}

fn runner(config: Config, sim: &Arc<SimAdapter>) -> Runner {
    let a: Arc<dyn DeviceAdapter> = sim.clone();
    Runner::with_topology(
        config,
        vec![a],
        Topology::with_devices(&[sim_device(0), sim_device(1)]),
        HashKernels,
    )
    .and_then(|r| r.with_launch_graphs(launch_graphs()?))
    .unwrap()
}

fn finish(runner: Runner, sim: &SimAdapter) {
    assert_eq!(runner.shutdown().unwrap(), DebugCounters::default());
    for dev in 0..2 {
        let st = sim.allocator_stats(dev).unwrap();
        assert_eq!(
            (st.use_after_free, st.live_bytes),
            (0, 0),
            "sim:{dev}: {st:?}"
        );
    }
}

#[test]
fn vm_on_cpu_and_two_sim_devices_matches_interpreter_proptest() {
    proptest_on(false);
}

#[test]
fn vm_on_cpu_and_two_launcher_sim_devices_matches_interpreter_proptest() {
    proptest_on(true);
}

fn proptest_on(launcher: bool) {
    fuzzing::silence_planned_panics();
    let sim = sim(0x5eed_0001, launcher);
    let runner = runner(Config::from_env().unwrap(), &sim);
    // A quarter of the cases on launcher streams: the same engine paths but the launch,
    // at about twice a program's cost (each kernel is enqueued from the worker).
    let cases = if launcher {
        cases().div_ceil(4)
    } else {
        cases()
    };
    let mut prop = TestRunner::new(PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let start = Instant::now();
    let totals = Cell::new([0usize; 8]);
    let result = prop.run(&proptest::collection::vec(any::<u8>(), 0..1024), |bytes| {
        let o = runner
            .run(&Program::from_bytes(&bytes))
            .map_err(|m| TestCaseError::fail(m.to_string()))?;
        let mut t = totals.get();
        for (x, v) in t.iter_mut().zip([
            o.kernels,
            o.copies,
            o.launches,
            o.panics,
            o.cross.streams,
            o.cross.devices,
            usize::from(o.cross.streams > 0),
            usize::from(o.cross.devices > 0),
        ]) {
            *x += v;
        }
        totals.set(t);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let [
        kernels,
        copies,
        launches,
        panics,
        cross,
        cross_dev,
        progs,
        progs_dev,
    ] = totals.get();
    println!(
        "{} programs on cpu + 2 sim (launcher: {launcher}) in {:?}: {kernels} kernels, {copies} copies, {launches} \
         launches, {panics} kernel panics (cpu); {cross} cross-stream uses ({cross_dev} \
         cross-device) in {progs} ({progs_dev}) programs",
        cases,
        start.elapsed()
    );
    assert!(
        copies > 0 && launches > 0,
        "the generator made no copy or launch"
    );
    assert!(cross_dev > 0, "no cross-device use");
    finish(runner, &sim);
}

/// Seeded programs in the other configurations: record-event soft sync (no device-side
/// stream wait) and single-thread mode, on both kernel modes (and multi-thread mode with
/// stream waits on launcher streams, which the proptest runs on queued ones).
#[test]
fn seeded_programs_match_without_stream_wait_and_single_thread() {
    fuzzing::silence_planned_panics();
    for (kernels, launcher) in KERNEL_MODES {
        for (name, config) in [
            ("multi/stream-wait", Config::from_env().unwrap()),
            (
                "multi/record-event",
                Config::from_env().unwrap().with_stream_wait(false),
            ),
            (
                "single/stream-wait",
                Config::from_env().unwrap().with_mode(Mode::SingleThread),
            ),
        ] {
            if name == "multi/stream-wait" && !launcher {
                continue;
            }
            let sim = sim(0x5eed_0002, launcher);
            let runner = runner(config, &sim);
            for seed in 0..24 {
                if let Err(m) = runner.run(&Program::from_seed(seed)) {
                    panic!("{kernels} {name}, seed {seed}: {m}");
                }
            }
            finish(runner, &sim);
        }
    }
}

/// Regressions the generator found (minimised), replayed many times on one runner.
#[test]
fn minimised_regressions() {
    use ivm_std::fuzzing::{Delay, KernelOp, Op};
    let kernel = |stream, inputs, outputs| {
        Op::Kernel(KernelOp {
            stream,
            id: 7,
            inputs,
            outputs,
            delay: Delay::Yield,
            panic: false,
        })
    };
    let cases = [
        // A tensor given up with `release_tensor` in the batch that still reads it on
        // another stream: its release was enqueued ahead of the batch, so the sim freed it
        // before the read ("use after free"; with a caching allocator, the block was
        // recycled into the next tensor while the batch still wrote it).
        (
            "release inside the batch that uses the tensor",
            vec![
                Op::Recreate { tensor: 3, home: 2 },
                kernel(3, 0b1000, 0b0010),
                Op::Recreate { tensor: 3, home: 8 },
            ],
        ),
        // sim:1 compute copies t2 into cpu t3 (done at launch); sim:1 h2d reads t3 after a
        // device-side wait (which writes t3 for the engine); a cpu kernel reading t3 ran
        // once that wait was *launched*, before the compute copy completed.
        (
            "device-side wait on a copy stream completes by event",
            vec![
                Op::SyncWrite {
                    tensor: 2,
                    value: 0x6ce1_65b7_3a1e_a375,
                },
                Op::Copy {
                    stream: 7,
                    src: 2,
                    dst: 3,
                },
                Op::Copy {
                    stream: 8,
                    src: 3,
                    dst: 2,
                },
                kernel(0, 0b1000, 0b0001),
            ],
        ),
    ];
    for (kernels, launcher) in KERNEL_MODES {
        let sim = sim(0x5eed_0003, launcher);
        let runner = runner(ivm_std::fuzzing::ci_lane(Config::default()), &sim);
        for (name, ops) in &cases {
            let p = Program { ops: ops.clone() };
            assert_eq!(runner.topology().fit(&p), p, "{name}: not a fitted program");
            for round in 0..40 {
                if let Err(m) = runner.run(&p) {
                    panic!("{kernels} {name}, round {round}: {m}");
                }
            }
        }
        finish(runner, &sim);
    }
}
