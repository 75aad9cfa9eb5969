//! Random instruction programs run by a real multi-thread `ivm_std::VirtualMachine` must
//! give exactly the results of the sequential interpreter (`ivm_std::fuzzing`): every
//! sync read and write, every final tensor value, the barrier order. Programs include
//! copies and lazy-job launches of the runner's two small graphs (launches mutate their
//! parameters).
//!
//! Kernel panics are stripped (`Program::without_panics`): libFuzzer aborts on any panic,
//! so the poison paths are covered by the proptest in `crates/ivm-std/tests`. One VM
//! (scheduler + three worker threads) is reused across runs; each run gets fresh tensors.
//! `IVM_FUZZ_STATS=1` prints coverage counters (program lengths, cross-stream uses, ...)
//! every 1024 programs and at exit; `IVM_FUSION` (`1` / `0`) sets fusion
//! (`fuzzing::ci_lane`).
#![no_main]

#[path = "common/stats.rs"]
mod stats;

use std::sync::OnceLock;

use ivm_std::Config;
use ivm_std::fuzzing::{Program, Runner};
use ivm_graph::fuzzing::launch_graphs;
use libfuzzer_sys::fuzz_target;

static RUNNER: OnceLock<Runner> = OnceLock::new();

fuzz_target!(|program: Program| {
    let runner = RUNNER.get_or_init(|| {
        Runner::new(ivm_std::fuzzing::ci_lane(Config::default()))
            .and_then(|r| r.with_launch_graphs(launch_graphs()?))
            .expect("start the VM")
    });
    let program = program.without_panics();
    match runner.run(&program) {
        Ok(o) => stats::record(&program, &o),
        Err(mismatch) => panic!("{mismatch}"),
    }
});
