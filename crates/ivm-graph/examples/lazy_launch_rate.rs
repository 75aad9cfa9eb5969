//! Lazy-job launch rate and launch-to-first-output latency of an empty graph with 4 inputs
//! and 4 outputs (each output copies an input; no compute kernel).
//!
//! ```text
//! cargo run --release -p ivm-graph --example lazy_launch_rate [launches] [latency samples]
//! ```
//!
//! * **rate, reused tensors**: every launch passes the same 8 tensors (a training loop);
//!   the output critical section of run i+1 waits for run i's output ends (same tensors).
//! * **rate, rotating outputs**: outputs rotate over 8 sets, so runs overlap more.
//! * **latency**: one launch at a time on an idle VM; time from the call that submits the
//!   launch to (a) the graph's first output kernel finishing its copy (trace hook), and
//!   (b) a `read_small` of that output returning the value (what eager code sees).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use ivm_graph::{Graph, GraphBuilder, Phase};
use ivm_std::{Config, Tensor, VirtualMachine};

const N: usize = 4;
const BYTES: usize = 64;

fn origin() -> Instant {
    static O: OnceLock<Instant> = OnceLock::new();
    *O.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    origin().elapsed().as_nanos() as u64
}

fn empty_graph(first_out: Arc<AtomicU64>) -> Graph {
    let mut g = GraphBuilder::new("empty4x4");
    for i in 0..N {
        let b = g.input(format!("in{i}"), BYTES);
        g.output(format!("out{i}"), b);
    }
    g.trace(move |e| {
        if e.phase == Phase::End && e.actor == "output/out0" {
            first_out.store(now_ns(), Ordering::Release);
        }
    });
    g.build().expect("graph")
}

fn tensors(vm: &VirtualMachine, n: usize) -> Vec<Tensor> {
    (0..n)
        .map(|i| {
            vm.new_tensor_from(&vm.default_stream(), &[i as u8; BYTES])
                .expect("tensor")
        })
        .collect()
}

fn rate(vm: &VirtualMachine, graph: &Graph, launches: usize, sets: usize) -> f64 {
    let ins = tensors(vm, N);
    let outs: Vec<Vec<Tensor>> = (0..sets).map(|_| tensors(vm, N)).collect();
    let ins: Vec<&Tensor> = ins.iter().collect();
    vm.sync().expect("sync");
    let t0 = Instant::now();
    let mut done = 0;
    while done < launches {
        vm.run(|b| {
            for k in 0..16.min(launches - done) {
                let o: Vec<&Tensor> = outs[(done + k) % sets].iter().collect();
                b.launch_lazy_job(&ins, &o, &[], graph.lazy())?;
            }
            Ok(())
        })
        .expect("launch");
        done += 16.min(launches - done);
    }
    vm.sync().expect("sync");
    launches as f64 / t0.elapsed().as_secs_f64()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let launches: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let samples: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let vm = VirtualMachine::new(Config::from_env().expect("config")).expect("vm");
    let first_out = Arc::new(AtomicU64::new(0));
    let graph = empty_graph(first_out.clone());

    let _ = rate(&vm, &graph, launches / 10, 1); // warm-up
    let reused = rate(&vm, &graph, launches, 1);
    let rotating = rate(&vm, &graph, launches, 8);

    let ins = tensors(&vm, N);
    let outs = tensors(&vm, N);
    let ins: Vec<&Tensor> = ins.iter().collect();
    let outs_r: Vec<&Tensor> = outs.iter().collect();
    let (mut graph_side, mut eager_side) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        vm.sync().expect("sync");
        first_out.store(0, Ordering::Relaxed);
        let t0 = now_ns();
        vm.run(|b| b.launch_lazy_job(&ins, &outs_r, &[], graph.lazy()))
            .expect("launch");
        let mut buf = [0u8; 8];
        vm.read_small(&outs[0], 0, &mut buf).expect("read");
        let t2 = now_ns();
        let t1 = first_out.load(Ordering::Acquire);
        graph_side.push((t1.saturating_sub(t0)) as f64 / 1e3);
        eager_side.push((t2 - t0) as f64 / 1e3);
    }
    vm.sync().expect("sync");
    println!("lazy-job launches of an empty graph ({N} inputs, {N} outputs, {BYTES} B each)");
    println!(
        "  threads available: {:?}",
        std::thread::available_parallelism()
    );
    println!("  rate, reused tensors:     {reused:>10.0} launches/s ({launches} launches)");
    println!("  rate, rotating outputs:   {rotating:>10.0} launches/s ({launches} launches)");
    println!(
        "  launch -> first output copied (graph side): p50 {:.1} us, p90 {:.1} us",
        percentile(&mut graph_side, 0.5),
        percentile(&mut graph_side, 0.9)
    );
    println!(
        "  launch -> sync read of first output returns: p50 {:.1} us, p90 {:.1} us ({samples} samples)",
        percentile(&mut eager_side, 0.5),
        percentile(&mut eager_side, 0.9)
    );
    drop(graph);
    vm.shutdown().expect("shutdown");
}
