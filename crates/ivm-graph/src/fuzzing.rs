//! The equivalence fuzzer's lazy graphs (feature `fuzzing`): [`launch_graphs`] builds,
//! with ivm-graph's runtime, the two graphs that [`LaunchOp`](ivm_std::fuzzing::LaunchOp) documents,
//! for [`Runner::with_launch_graphs`].
//!
//! ```
//! use ivm_std::Config;
//! use ivm_std::fuzzing::{Program, Runner};
//! use ivm_graph::fuzzing::launch_graphs;
//!
//! let runner = Runner::new(Config::default())?.with_launch_graphs(launch_graphs()?)?;
//! for seed in 0..4 {
//!     if let Err(mismatch) = runner.run(&Program::from_seed(seed)) {
//!         panic!("{mismatch}");
//!     }
//! }
//! # Ok::<(), ivm_std::Error>(())
//! ```

use ivm_std::Result;
#[cfg(doc)]
use ivm_std::fuzzing::Runner;
use ivm_std::fuzzing::{LaunchGraphs, launch_mix};
use ivm_std::lazy::LazyGraph;

use crate::{Graph, GraphBuilder};

/// The two graphs of [`LaunchOp`](ivm_std::fuzzing::LaunchOp), each on its own graph runtime.
#[derive(Debug)]
pub struct FuzzGraphs([Graph; 2]);

impl LaunchGraphs for FuzzGraphs {
    fn lazy(&self, index: usize) -> &LazyGraph {
        self.0[index].lazy()
    }
}

/// Builds the fuzzer's two lazy graphs (`fuzz_a`, `fuzz_b`; see `LaunchOp`); `fuzz_a`'s
/// ready work also runs on the VM's waiting callers ([`GraphBuilder::run_on_caller`]).
///
/// # Errors
/// The graph runtime's build errors (threads that cannot start).
pub fn launch_graphs() -> Result<FuzzGraphs> {
    build().map(FuzzGraphs)
}

fn build() -> Result<[Graph; 2]> {
    let m = launch_mix;
    let mut a = GraphBuilder::new("fuzz_a");
    let x = a.input("a", 8);
    let w = a.param("w", 8);
    let h = a.blob("h", 8);
    let (o0, o1) = (a.blob("o0", 8), a.blob("o1", 8));
    a.param_kernel("fwd", &[x], &[h], move |k| {
        let v = m(m(k.input_u64(0)[0], k.param_u64(w)[0]), 1);
        k.output_u64(0)[0] = v;
    });
    a.kernel("out", &[h], &[o0, o1], move |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v;
        k.output_u64(1)[0] = m(v, 2);
    });
    a.param_kernel("upd", &[h], &[], move |k| {
        let v = k.input_u64(0)[0];
        let p = &mut k.param_u64_mut(w)[0];
        *p = m(*p, v);
    });
    a.output("o0", o0);
    a.output("o1", o1);
    // `fuzz_a` runs on its waiting callers (`run_on_caller`), `fuzz_b` on its thread only:
    // a caller that fires `fwd` and `out` stops once the outputs are out and leaves `upd`
    // to the graph's thread, which must not block on the actors the caller holds.
    a.run_on_caller(true);

    let mut b = GraphBuilder::new("fuzz_b");
    let b0 = b.input("b0", 8);
    let b1 = b.input("b1", 8);
    b.input_with("unused", 8, false);
    let w = b.param("w", 8);
    let q = b.blob("q", 8);
    b.param_kernel("fwd_upd", &[b0, b1], &[q], move |k| {
        let (x, y) = (k.input_u64(0)[0], k.input_u64(1)[0]);
        let p = k.param_u64(w)[0];
        k.output_u64(0)[0] = m(m(x, y), p);
        k.param_u64_mut(w)[0] = m(p, m(x, 7));
    });
    b.output("q", q);
    Ok([a.build()?, b.build()?])
}
