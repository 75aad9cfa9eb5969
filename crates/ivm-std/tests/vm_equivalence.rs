//! VM ≡ sequential interpreter over random programs (`ivm_std::fuzzing`, without lazy-job
//! launches: ivm-graph's `vm_equivalence_lazy` has them), and the planted bugs that show
//! the generator has teeth. Needs the `fuzzing` feature (enabled by the
//! workspace under `cargo test --workspace`; alone: `cargo test -p ivm-std --features
//! fuzzing --test vm_equivalence`).
//!
//! `IVM_EQUIV_CASES` overrides the proptest case count (default 256); `IVM_FUSION` and
//! `IVM_RUN_AT_REST` (`1` / `0`) those settings (`fuzzing::ci_lane`), except in the tests
//! that name them.

use std::cell::Cell;
use std::time::Instant;

use ivm_std::fuzzing::{
    self, Delay, HashKernels, KernelOp, Observed, Op, PlantedBug, Program, Runner,
};
use ivm_std::{Config, DebugCounters, Mode};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError, TestRunner};

/// The planted-bug budget (ARCHITECTURE.md, "Testing and CI": caught within 10 000 cases).
const PLANTED_BUDGET: u64 = 10_000;

fn cases() -> u32 {
    std::env::var("IVM_EQUIV_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn vm_matches_interpreter_proptest_with_kernel_panics() {
    fuzzing::silence_planned_panics();
    // No launch graphs: ivm-std has no graph runtime, so the runner leaves launches out
    // (ivm-graph's `vm_equivalence_lazy` runs these programs with them).
    let runner = Runner::new(fuzzing::ci_lane(Config::default())).unwrap();
    assert_eq!(runner.vm().config().mode, Mode::MultiThread);
    let mut prop = TestRunner::new(PropConfig {
        cases: cases(),
        failure_persistence: None,
        ..PropConfig::default()
    });
    let start = Instant::now();
    let (kernels, syncs, panics) = (Cell::new(0), Cell::new(0), Cell::new(0));
    let (copies, launches) = (Cell::new(0), Cell::new(0));
    let result = prop.run(&proptest::collection::vec(any::<u8>(), 0..1024), |bytes| {
        let program = Program::from_bytes(&bytes);
        let o = runner
            .run(&program)
            .map_err(|m| TestCaseError::fail(m.to_string()))?;
        kernels.set(kernels.get() + o.kernels);
        syncs.set(syncs.get() + o.syncs);
        panics.set(panics.get() + o.panics);
        copies.set(copies.get() + o.copies);
        launches.set(launches.get() + o.launches);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "{} programs ({} kernels, {} sync accesses, {} kernel panics, {} copies, {} lazy-job \
         launches) in {:?}",
        cases(),
        kernels.get(),
        syncs.get(),
        panics.get(),
        copies.get(),
        launches.get(),
        start.elapsed()
    );
    assert!(
        panics.get() > 0,
        "the generator never planned a kernel panic"
    );
    assert!(copies.get() > 0, "the generator made no copy");
    assert_eq!(launches.get(), 0, "a runner without launch graphs launched");
    assert_eq!(runner.shutdown().unwrap(), DebugCounters::default());
}

/// Poison semantics, by hand: a panicking kernel poisons its output; a kernel reading it
/// refuses to run and passes the same failure on; sync accesses see it; a recreated
/// tensor is clean again.
#[test]
fn poison_propagates_like_the_interpreter_says() {
    fuzzing::silence_planned_panics();
    let kernel = |stream, inputs, outputs, panic| {
        Op::Kernel(KernelOp {
            stream,
            id: 7,
            inputs,
            outputs,
            delay: Delay::Spin(20),
            panic,
        })
    };
    let p = Program {
        ops: vec![
            kernel(1, 0b0000, 0b0001, true),  // #0 panics writing t0
            kernel(3, 0b0001, 0b0010, false), // #1 t0 -> t1: refused, t1 poisoned
            kernel(0, 0b0100, 0b1000, false), // #2 t2 -> t3: fine
            Op::SyncRead { tensor: 1 },       // #3 poisoned by #0
            Op::SyncWrite {
                tensor: 0,
                value: 5,
            }, // #4 refused
            Op::Recreate { tensor: 1, home: 2 },
            kernel(2, 0b1000, 0b0010, false), // #6 t3 -> t1: fine again
            Op::SyncRead { tensor: 1 },       // #7
        ],
    };
    let expected = fuzzing::interpret(&p, &HashKernels);
    let poisoned = Observed::Poisoned(format!("{} in op #0", fuzzing::PANIC_MARKER));
    assert_eq!(expected.syncs[0], (3, poisoned.clone()));
    assert_eq!(expected.syncs[1], (4, poisoned.clone()));
    assert!(matches!(expected.syncs[2], (7, Observed::Value(_))));
    assert_eq!(expected.finals[0], poisoned);
    assert_eq!(expected.finals[1], expected.syncs[2].1);
    assert!(matches!(expected.finals[3], Observed::Value(v) if v != 0));
    if let Err(m) = fuzzing::check(&p, fuzzing::ci_lane(Config::default())) {
        panic!("{m}");
    }
}

#[test]
fn seeded_programs_match_on_fresh_vms() {
    fuzzing::silence_planned_panics();
    for seed in 0..8 {
        let p = Program::from_seed(seed);
        if let Err(m) = fuzzing::check(&p, fuzzing::ci_lane(Config::default())) {
            panic!("seed {seed}: {m}");
        }
    }
}

/// Both fusion settings, whatever the lane's; with fusion on, runs do form.
#[test]
fn seeded_programs_match_with_fusion_on_and_off() {
    fuzzing::silence_planned_panics();
    for fusion in [true, false] {
        let runner = Runner::new(Config::default().with_fusion(fusion)).unwrap();
        for seed in 200..248 {
            if let Err(m) = runner.run(&Program::from_seed(seed)) {
                panic!("fusion {fusion}, seed {seed}: {m}");
            }
        }
        let fused = runner.vm().stats().unwrap().fused_runs;
        assert_eq!(fused > 0, fusion, "fusion {fusion}: {fused} fused runs");
        assert_eq!(runner.shutdown().unwrap(), DebugCounters::default());
    }
}

/// Single-thread mode, with runs at rest (`Config::run_at_rest`) on and off: the programs
/// must take that path (when on) and agree with the interpreter either way.
#[test]
fn single_thread_mode_matches_too() {
    fuzzing::silence_planned_panics();
    for at_rest in [true, false] {
        let config = fuzzing::ci_lane(Config::single_thread()).with_run_at_rest(at_rest);
        let runner = Runner::new(config).unwrap();
        for seed in 100..132 {
            if let Err(m) = runner.run(&Program::from_seed(seed)) {
                panic!("at rest {at_rest}, seed {seed}: {m}");
            }
        }
        let ran = runner.vm().stats().unwrap().ran_at_rest;
        assert_eq!(ran > 0, at_rest, "at rest {at_rest}: {ran} ran at rest");
        assert_eq!(runner.shutdown().unwrap(), DebugCounters::default());
    }
}

/// Runs the programs of seeds `first..` on a VM with `bug` planted until one differs;
/// returns how many programs that took.
fn cases_to_catch(bug: PlantedBug, first: u64, verbose: bool) -> u64 {
    fuzzing::silence_planned_panics();
    let runner = Runner::with_planted_bug(fuzzing::ci_lane(Config::default()), bug).unwrap();
    let start = Instant::now();
    for case in 1..=PLANTED_BUDGET {
        let program = Program::from_seed(first + case).without_panics();
        if let Err(m) = runner.run(&program) {
            if !verbose {
                runner.shutdown().unwrap();
                return case;
            }
            println!(
                "planted {bug:?} caught after {case} program(s) in {:?}:\n{m}",
                start.elapsed()
            );
            // The VM keeps serving after the mismatch; shut it down cleanly.
            runner.shutdown().unwrap();
            return case;
        }
    }
    panic!("planted {bug:?} not caught within {PLANTED_BUDGET} programs");
}

#[test]
fn planted_dropped_read_write_edge_is_caught() {
    let n = cases_to_catch(PlantedBug::DropReadWriteEdge, 0, true);
    assert!(n <= PLANTED_BUDGET);
}

#[test]
fn planted_out_of_order_release_is_caught() {
    let n = cases_to_catch(PlantedBug::OutOfOrderRelease, 0, true);
    assert!(n <= PLANTED_BUDGET);
}

/// How many programs each planted bug takes to be caught, over 40 disjoint seed ranges:
/// `cargo test -p ivm-std --features fuzzing --test vm_equivalence -- --ignored --nocapture`.
#[test]
#[ignore = "statistics, ~seconds; run by hand"]
fn planted_catch_statistics() {
    for bug in [PlantedBug::DropReadWriteEdge, PlantedBug::OutOfOrderRelease] {
        let mut n: Vec<u64> = (0..40)
            .map(|k| cases_to_catch(bug, k * 1_000_000, false))
            .collect();
        n.sort_unstable();
        println!(
            "{bug:?}: programs to catch over 40 seed ranges: min {} median {} p90 {} max {}",
            n[0], n[20], n[36], n[39]
        );
    }
}
