//! VM ≡ sequential interpreter over random programs (`ivm_std::fuzzing`) with their
//! lazy-job launches, served by this crate's graph runtime (`ivm_graph::fuzzing`), in
//! both VM modes. Needs the `fuzzing` feature (enabled by the workspace under `cargo test
//! --workspace`; alone: `cargo test -p ivm-graph --features fuzzing`).
//!
//! `IVM_EQUIV_CASES` overrides the proptest case count (default 256).

use std::time::Instant;

use ivm_graph::fuzzing::launch_graphs;
use ivm_std::fuzzing::{self, Outcome, Program, Runner};
use ivm_std::{Config, DebugCounters, Error};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError, TestRunner};

fn cases() -> u32 {
    std::env::var("IVM_EQUIV_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// Runs `cases()` proptest programs (kernel panics included) on a runner with the launch
/// graphs; returns the summed counts.
fn proptest_programs(config: Config) -> Outcome {
    fuzzing::silence_planned_panics();
    let runner = Runner::new(config)
        .and_then(|r| r.with_launch_graphs(launch_graphs()?))
        .unwrap();
    let mut prop = TestRunner::new(PropConfig {
        cases: cases(),
        failure_persistence: None,
        ..PropConfig::default()
    });
    let start = Instant::now();
    let total = std::cell::Cell::new(Outcome::default());
    let result = prop.run(&proptest::collection::vec(any::<u8>(), 0..1024), |bytes| {
        let o = runner
            .run(&Program::from_bytes(&bytes))
            .map_err(|m| TestCaseError::fail(m.to_string()))?;
        let t = total.get();
        total.set(Outcome {
            kernels: t.kernels + o.kernels,
            panics: t.panics + o.panics,
            launches: t.launches + o.launches,
            ..t
        });
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let t = total.get();
    println!(
        "{} programs ({} kernels, {} kernel panics, {} lazy-job launches) in {:?}",
        cases(),
        t.kernels,
        t.panics,
        t.launches,
        start.elapsed()
    );
    assert_eq!(runner.shutdown().unwrap(), DebugCounters::default());
    t
}

#[test]
fn launches_match_the_interpreter_multi_thread() {
    let t = proptest_programs(Config::default());
    assert!(t.launches > 0, "the generator made no launch");
    assert!(t.panics > 0, "the generator never planned a kernel panic");
}

#[test]
fn launches_match_the_interpreter_single_thread() {
    assert!(proptest_programs(Config::single_thread()).launches > 0);
}

/// A graph runtime whose graphs do not have `LaunchOp`'s interfaces is refused, naming
/// the graph.
#[test]
fn launch_graphs_with_the_wrong_interface_are_refused() {
    struct Wrong(ivm_std::LazyGraph);
    impl fuzzing::LaunchGraphs for Wrong {
        fn lazy(&self, _: usize) -> &ivm_std::LazyGraph {
            &self.0
        }
    }
    let g = ivm_std::LazyGraph::builder("too_small")
        .input("a", 4)
        .build()
        .unwrap();
    let err = Runner::new(Config::default())
        .unwrap()
        .with_launch_graphs(Wrong(g))
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("too_small")),
        "{err}"
    );
}
