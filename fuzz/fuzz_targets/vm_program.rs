//! Random instruction programs run by a real multi-thread `ivm_std::VirtualMachine` must
//! give exactly the results of the sequential interpreter (`ivm_std::fuzzing`): every
//! sync read and write, every final tensor value, the barrier order.
//!
//! Kernel panics are stripped (`Program::without_panics`): libFuzzer aborts on any panic,
//! so the poison paths are covered by the proptest in `crates/ivm-std/tests`. One VM
//! (scheduler + three worker threads) is reused across runs; each run gets fresh tensors.
#![no_main]

use std::sync::OnceLock;

use ivm_std::Config;
use ivm_std::fuzzing::{Program, Runner};
use libfuzzer_sys::fuzz_target;

static RUNNER: OnceLock<Runner> = OnceLock::new();

fuzz_target!(|program: Program| {
    let runner = RUNNER.get_or_init(|| Runner::new(Config::default()).expect("start the VM"));
    if let Err(mismatch) = runner.run(&program.without_panics()) {
        panic!("{mismatch}");
    }
});
