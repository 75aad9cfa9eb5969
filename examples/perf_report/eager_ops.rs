//! Section 9 of the report: eager ops, the regime of the training demo's eager mode. One
//! op per `vm.run`, each reading the tensor the op before it wrote (a chain on one
//! stream), steps of 24 ops whose eighth also writes a `loss` tensor, read with
//! `read_small` once the step is submitted (a step's `loss.item()`: it waits for the
//! forward pass while the rest of the step runs on), and each op's kernel
//! touching a working set of `kb` KiB first, as a real kernel does: 0 (the VM's own cost,
//! its data hot in the caches) and 64 KiB (more than this machine's L1 data cache: the
//! VM's data is evicted between ops, as between the demo's matmuls). The same loop of
//! kernels called directly on one thread (`plain`) is the baseline, interleaved round by
//! round with the default VM and a single-thread-mode VM. Reported: ns per op over
//! plain's, the median of the rounds and the spread (max − min) of those differences.
//!
//! Placed as the training demo places its threads (`examples/train/pin.rs`; Linux, two
//! CPUs or more): the plain loop, the single-thread VM's caller and the default VM's
//! worker on one CPU, the default VM's caller on the other (the two vCPUs of a shared host
//! differ in speed at the same moment). The default VM's kernels run on its worker only
//! where its policies leave them there: a run of tiny kernels rests on the caller, and a
//! caller runs a parked worker's queue in its wait; those kernels then run on the caller's
//! CPU. The section prints, per working set, how many of the default VM's instructions
//! ran on the caller, at rest or from the queue. Each working set gets fresh VMs, so that
//! marks left by the other's kernels (a tiny mark holds 20 ms) do not carry over.
//!
//! The flood sections (`throughput`, `fused`) measure the VM with every line of its data
//! hot; this one is what a front end submitting op by op beside real kernels pays.

use std::cell::RefCell;

use super::*;
use ivm::ivm_std::Mode;

/// Ops per step, as the demo's 24.
const OPS_PER_STEP: usize = 24;
/// The op of a step that also writes the loss: the demo's `xent_loss`, the sixth op of its
/// program and the eighth of a step, after the batch's two gathers.
const LOSS_OP: usize = 7;

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
    loss: Tensor,
}

impl Chain {
    fn new(cfg: Config) -> Self {
        let vm = VirtualMachine::new(cfg).expect("VM starts");
        let s = vm
            .stream(StreamId::compute(Device::CPU, 0))
            .expect("stream");
        let t = (0..4).map(|_| vm.new_tensor(8).expect("tensor")).collect();
        let loss = vm.new_tensor(8).expect("tensor");
        Self { vm, s, t, loss }
    }

    /// ns per op of `ops` ops, one per `vm.run`, the loss read after every
    /// [`OPS_PER_STEP`].
    fn ns_per_op(&self, kb: usize, ops: usize) -> f64 {
        let start = Instant::now();
        for i in 0..ops {
            let (a, b) = (&self.t[i % 4], &self.t[(i + 1) % 4]);
            let outs: &[&Tensor] = if i % OPS_PER_STEP == LOSS_OP {
                &[b, &self.loss]
            } else {
                &[b]
            };
            self.vm
                .run(|bl| {
                    bl.call(&self.s, &[a], outs, move |k| {
                        let x = k.input_u64(0)[0];
                        let y = x.wrapping_add(touch(kb, x) & 1);
                        for o in 0..k.num_outputs() {
                            k.output_u64(o)[0] = y;
                        }
                    })
                })
                .expect("run");
            if i % OPS_PER_STEP == OPS_PER_STEP - 1 {
                read8(&self.vm, &self.loss);
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
        if i % OPS_PER_STEP == LOSS_OP {
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
    // `(caller CPU, kernel CPU)`: the VMs' threads are started on the kernel CPU (they
    // inherit the creating thread's mask) and any started later are moved there.
    let pins = pin::cpus().filter(|&(_, kernels)| pin::to(kernels));
    // Where each runs: the plain loop and single-thread mode on the kernel CPU, the
    // default VM's caller on the other. Back on the kernel CPU, the plain loop starts
    // after the default VM's worker has stopped polling it (its poll window is 100 µs).
    let place = |on_caller_cpu: bool| {
        if let Some((caller, kernels)) = pins {
            if on_caller_cpu {
                pin::to(caller);
            } else {
                pin::to(kernels);
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    };
    println!(
        "eager ops (one op per vm.run, a chain on one stream, steps of {OPS_PER_STEP} ops and \
         the loss read after each, each kernel touching its working set first; ns per op \
         over the same kernels called directly, median of {rounds} interleaved rounds and \
         the range of those differences):"
    );
    println!(
        "| working set | plain ns/op | multi-thread over plain | range \
         | single-thread over plain | range |"
    );
    println!("|---|---|---|---|---|---|");
    let mut on_caller = Vec::new();
    for kb in [0usize, 64] {
        if let Some((_, kernels)) = pins {
            pin::to(kernels);
        }
        let multi = Chain::new(config());
        let single = Chain::new(config().with_mode(Mode::SingleThread));
        // Warm: pools, the working sets, the workers' first wake.
        place(false);
        plain_ns_per_op(kb, ops / 4);
        single.ns_per_op(kb, ops / 4);
        place(true);
        multi.ns_per_op(kb, ops / 4);
        if let Some((_, kernels)) = pins {
            pin::adopt(kernels);
        }
        let before = multi.vm.stats().expect("stats");
        let (mut p, mut m, mut s) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            place(false);
            let base = plain_ns_per_op(kb, ops);
            s.push(single.ns_per_op(kb, ops) - base);
            place(true);
            m.push(multi.ns_per_op(kb, ops) - base);
            p.push(base);
        }
        let after = multi.vm.stats().expect("stats");
        on_caller.push((
            kb,
            after.ran_at_rest - before.ran_at_rest,
            after.caller_ran - before.caller_ran,
            rounds * ops,
        ));
        let (p, _) = median_range(p);
        let ((m, m_range), (s, s_range)) = (median_range(m), median_range(s));
        println!("| {kb} KiB | {p:.0} | {m:.0} | {m_range:.0} | {s:.0} | {s_range:.0} |");
        let name = |what: &str| -> &'static str {
            Box::leak(format!("eager_op_{what}_over_plain_ns_ws{kb}").into_boxed_str())
        };
        rep.figure(name("multi"), m, "ns/op", "(report)", None);
        rep.figure(name("single"), s, "ns/op", "(report)", None);
    }
    pin::restore();
    for (kb, rest, queue, all) in on_caller {
        println!(
            "{kb} KiB, the default VM: {rest} of {all} instructions ran at rest on the caller, \
             {queue} from the worker's queue in the caller's wait"
        );
    }
    println!();
}
