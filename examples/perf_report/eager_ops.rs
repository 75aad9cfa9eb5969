//! Section 9 of the report: eager ops, the regime of the training demo's eager mode. One
//! op per `vm.run`, each reading the tensor the op before it wrote (a chain on one
//! stream), a `read_small` every 24 ops (a step's `loss.item()`), and each op's kernel
//! touching a working set of `kb` KiB first, as a real kernel does: 0 (the VM's own cost,
//! its data hot in the caches) and 64 KiB (more than this machine's L1 data cache: the
//! VM's data is evicted between ops, as between the demo's matmuls). The same loop of
//! kernels called directly on one thread (`plain`) is the baseline, interleaved round by
//! round with the default VM and a single-thread-mode VM. Reported: ns per op over
//! plain's, the median of the rounds and the spread (max − min) of those differences.
//!
//! The flood sections (`throughput`, `fused`) measure the VM with every line of its data
//! hot; this one is what a front end submitting op by op beside real kernels pays.

use std::cell::RefCell;

use super::*;
use ivm::ivm_std::Mode;

/// Ops per read, as the demo's 24 ops per step.
const OPS_PER_READ: usize = 24;

thread_local! {
    /// The working set a kernel touches, per thread (a worker's or the caller's).
    static WORKING_SET: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// A kernel's work: writes one word in each cache line of `kb` KiB of this thread's working
/// set, folded into `x`.
fn touch(kb: usize, x: u64) -> u64 {
    WORKING_SET.with(|w| {
        let mut w = w.borrow_mut();
        let words = kb * 1024 / 8;
        if w.len() < words {
            w.resize(words, 0);
        }
        let mut acc = x;
        for v in w[..words].iter_mut().step_by(8) {
            *v = v.wrapping_add(acc);
            acc ^= *v;
        }
        black_box(acc)
    })
}

struct Chain {
    vm: VirtualMachine,
    s: Stream,
    t: Vec<Tensor>,
}

impl Chain {
    fn new(cfg: Config) -> Self {
        let vm = VirtualMachine::new(cfg).expect("VM starts");
        let s = vm
            .stream(StreamId::compute(Device::CPU, 0))
            .expect("stream");
        let t = (0..4).map(|_| vm.new_tensor(8).expect("tensor")).collect();
        Self { vm, s, t }
    }

    /// ns per op of `ops` ops, one per `vm.run`, a read every [`OPS_PER_READ`].
    fn ns_per_op(&self, kb: usize, ops: usize) -> f64 {
        let start = Instant::now();
        for i in 0..ops {
            let (a, b) = (&self.t[i % 4], &self.t[(i + 1) % 4]);
            self.vm
                .run(|bl| {
                    bl.call(&self.s, &[a], &[b], move |k| {
                        let x = k.input_u64(0)[0];
                        k.output_u64(0)[0] = x.wrapping_add(touch(kb, x) & 1);
                    })
                })
                .expect("run");
            if i % OPS_PER_READ == OPS_PER_READ - 1 {
                read8(&self.vm, b);
            }
        }
        self.vm.sync().expect("sync");
        start.elapsed().as_nanos() as f64 / ops as f64
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

/// The same kernels called directly on this thread: ns per op.
fn plain_ns_per_op(kb: usize, ops: usize) -> f64 {
    let start = Instant::now();
    let mut x = 0u64;
    for i in 0..ops {
        x = x.wrapping_add(touch(kb, x) & 1);
        if i % OPS_PER_READ == OPS_PER_READ - 1 {
            x = black_box(x);
        }
    }
    black_box(x);
    start.elapsed().as_nanos() as f64 / ops as f64
}

/// Median and spread (max − min) of `v`.
fn median_range(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_unstable_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1] - v[0])
}

pub(super) fn eager_ops(rep: &mut Report, quick: bool) {
    let ops = if quick { 4_800 } else { 24_000 };
    let rounds = if quick { 3 } else { 7 };
    let multi = Chain::new(config());
    let single = Chain::new(config().with_mode(Mode::SingleThread));
    println!(
        "eager ops (one op per vm.run, a chain on one stream, a read every {OPS_PER_READ} ops, \
         each kernel touching its working set first; ns per op over the same kernels called \
         directly, median of {rounds} interleaved rounds and the range of those differences):"
    );
    println!(
        "| working set | plain ns/op | multi-thread over plain | range | single-thread over plain | range |"
    );
    println!("|---|---|---|---|---|---|");
    for kb in [0usize, 64] {
        // Warm: pools, the working sets, the workers' first wake.
        for c in [&multi, &single] {
            c.ns_per_op(kb, ops / 4);
        }
        plain_ns_per_op(kb, ops / 4);
        let (mut p, mut m, mut s) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let base = plain_ns_per_op(kb, ops);
            m.push(multi.ns_per_op(kb, ops) - base);
            s.push(single.ns_per_op(kb, ops) - base);
            p.push(base);
        }
        let (p, _) = median_range(p);
        let ((m, m_range), (s, s_range)) = (median_range(m), median_range(s));
        println!("| {kb} KiB | {p:.0} | {m:.0} | {m_range:.0} | {s:.0} | {s_range:.0} |");
        let name = |what: &str| -> &'static str {
            Box::leak(format!("eager_op_{what}_over_plain_ns_ws{kb}").into_boxed_str())
        };
        rep.figure(name("multi"), m, "ns/op", "(report)", None);
        rep.figure(name("single"), s, "ns/op", "(report)", None);
    }
    println!();
}
