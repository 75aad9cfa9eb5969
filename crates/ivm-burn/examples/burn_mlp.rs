//! The training demo's model with burn: the 11-256-6 MLP on the red-wine data, Adam,
//! the same split and the same batches as `examples/train` (its `data.rs`, compiled in
//! here), written with burn's `nn`, `Autodiff` and `optim` and trained three ways:
//!
//! 1. **ndarray**: burn-ndarray called directly;
//! 2. **router**: burn through `BackendRouter` with burn's own direct channel (ndarray);
//! 3. **ivm**: burn through `BackendRouter` with ivm's channel (every op one instruction).
//!
//! Side by side, one epoch at a time, the order rotated every epoch (as the demo does), so
//! the drift of a shared host hits each alike. Prints steps/s (median and interquartile
//! range over the epochs), the caller's own CPU time per step (Linux), the final loss and
//! test accuracy of each, checks that the
//! losses of the router and of ivm equal burn-ndarray's bit for bit (exits non-zero if
//! not), the VM's counters (how many instructions the caller ran itself while it waited,
//! and how often the VM sensed another thread taking a CPU), and the cost of one tiny op:
//! a chain of additions through each, in one run.
//!
//! ```sh
//! cargo run --release -p ivm-burn --example burn_mlp
//! cargo run --release -p ivm-burn --example burn_mlp -- --epochs 40 --chain 20000
//! ```
//! Flags: `--epochs N` (default 30), `--chain N` ops in the per-op chain (default 20000),
//! `--hidden N` the hidden layer's width (default 256, the demo's): wider layers make each
//! kernel longer while the number of ops per step stays the same.
//! VM mode: `IVM_BURN_MODE=single` runs ivm's single-thread mode instead of multi.

#[path = "../../../examples/train/data.rs"]
#[allow(dead_code)]
mod data;

use std::process::ExitCode;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use ivm_burn::{
    Inner, Ivm, IvmBackend, IvmChannel, IvmClient, IvmSingle, MultiThread, SingleThread, VmMode,
};

const SEED: u64 = 42;
const BATCH: usize = 64;
const LR: f64 = 3e-3;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(features: usize, hidden: usize, classes: usize, device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(features, hidden).init(device),
            out: LinearConfig::new(hidden, classes).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out.forward(self.relu.forward(self.hidden.forward(x)))
    }
}

/// One model being trained on backend `B`, with its optimiser and what it measured.
struct Trainer<B: AutodiffBackend> {
    name: &'static str,
    device: B::Device,
    model: Option<Mlp<B>>,
    optim: burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Mlp<B>, B>,
    loss_fn: CrossEntropyLoss<B>,
    losses: Vec<f32>,
    epoch_secs: Vec<f64>,
    /// The caller's own CPU time per epoch (where the thread's CPU clock can be read).
    caller_cpu_secs: Vec<f64>,
}

/// A trainer on ivm's client of mode `M` that sets the client's fusion before each epoch
/// (the two ivm trainers share one client).
struct Fused<M: VmMode> {
    fuse: bool,
    inner: Trainer<Autodiff<IvmBackend<M>>>,
}

impl<M: VmMode> Fused<M> {
    fn new(name: &'static str, fuse: bool, data: &data::Data, hidden: usize) -> Self {
        Self {
            fuse,
            inner: Trainer::new(name, data, hidden),
        }
    }
}

impl<M: VmMode> Run for Fused<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn epoch(&mut self, data: &data::Data, order: &[u32], steps: usize) {
        client::<M>().set_fusion(self.fuse);
        self.inner.epoch(data, order, steps);
    }
    fn losses(&self) -> &[f32] {
        self.inner.losses()
    }
    fn epoch_secs(&self) -> &[f64] {
        self.inner.epoch_secs()
    }
    fn caller_cpu_secs(&self) -> &[f64] {
        self.inner.caller_cpu_secs()
    }
    fn accuracy(&self, data: &data::Data) -> f64 {
        self.inner.accuracy(data)
    }
}

/// What the side-by-side loop needs of a trainer, whatever its backend.
trait Run {
    fn name(&self) -> &'static str;
    fn epoch(&mut self, data: &data::Data, order: &[u32], steps: usize);
    fn losses(&self) -> &[f32];
    fn epoch_secs(&self) -> &[f64];
    fn caller_cpu_secs(&self) -> &[f64];
    fn accuracy(&self, data: &data::Data) -> f64;
}

impl<B: AutodiffBackend> Trainer<B> {
    fn new(name: &'static str, data: &data::Data, hidden: usize) -> Self {
        let device = B::Device::default();
        // Every backend draws its initial weights from burn-ndarray's generator, seeded
        // the same: the three models start equal.
        B::seed(&device, SEED);
        let model = Mlp::new(data.features, hidden, data.classes, &device);
        // burn draws a parameter's initial value on its first use: one forward pass now,
        // read back, so the draws happen here and not after another backend reseeded.
        let probe = model.forward(Tensor::zeros([1, data.features], &device));
        let _ = probe.into_data();
        Self {
            name,
            loss_fn: CrossEntropyLossConfig::new().init(&device),
            optim: AdamConfig::new().with_epsilon(1e-8).init(),
            device,
            model: Some(model),
            losses: Vec::new(),
            epoch_secs: Vec::new(),
            caller_cpu_secs: Vec::new(),
        }
    }
}

/// The rows `order[start..start + BATCH]` of `split` as burn tensors.
fn batch<B: Backend>(
    split: &data::Split,
    features: usize,
    rows: &[u32],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let mut x = Vec::with_capacity(rows.len() * features);
    let mut y = Vec::with_capacity(rows.len());
    for &r in rows {
        let r = r as usize;
        x.extend_from_slice(&split.x[r * features..(r + 1) * features]);
        y.push(split.y[r] as i64);
    }
    (
        Tensor::from_data(TensorData::new(x, [rows.len(), features]), device),
        Tensor::from_data(TensorData::new(y, [rows.len()]), device),
    )
}

impl<B: AutodiffBackend> Run for Trainer<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn epoch(&mut self, data: &data::Data, order: &[u32], steps: usize) {
        let t0 = Instant::now();
        let cpu0 = caller_cpu();
        for s in 0..steps {
            let rows = &order[s * BATCH..(s + 1) * BATCH];
            let (x, y) = batch::<B>(&data.train, data.features, rows, &self.device);
            let model = self
                .model
                .take()
                .expect("the model is back after every step");
            let loss = self.loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            self.model = Some(self.optim.step(LR, model, grads));
            // The loss is read after the step was submitted (a training loop's `.item()`):
            // a backend that runs ops asynchronously computes while the caller builds the
            // backward pass and the update.
            self.losses.push(loss.into_scalar().elem());
        }
        B::sync(&self.device);
        self.epoch_secs.push(t0.elapsed().as_secs_f64());
        if let (Some(a), Some(b)) = (cpu0, caller_cpu()) {
            self.caller_cpu_secs.push((b - a).as_secs_f64());
        }
    }

    fn losses(&self) -> &[f32] {
        &self.losses
    }

    fn epoch_secs(&self) -> &[f64] {
        &self.epoch_secs
    }

    fn caller_cpu_secs(&self) -> &[f64] {
        &self.caller_cpu_secs
    }

    fn accuracy(&self, data: &data::Data) -> f64 {
        let model = self.model.as_ref().expect("model").valid();
        let rows: Vec<u32> = (0..data.test.rows as u32).collect();
        let (x, y) = batch::<B::InnerBackend>(&data.test, data.features, &rows, &self.device);
        let hits = model
            .forward(x)
            .argmax(1)
            .squeeze::<1>()
            .equal(y)
            .int()
            .sum();
        hits.into_scalar().elem::<i64>() as f64 / data.test.rows as f64
    }
}

/// The calling thread's CPU time so far (Linux): what the caller itself spent, while the
/// VM's workers ran kernels beside it.
fn caller_cpu() -> Option<std::time::Duration> {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer; the clock id names the calling thread.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
            return None;
        }
        Some(std::time::Duration::new(
            u64::try_from(ts.tv_sec).ok()?,
            u32::try_from(ts.tv_nsec).ok()?,
        ))
    }
    #[cfg(not(target_os = "linux"))]
    None
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Microseconds per op of a chain of `n` dependent tiny additions, read at the end.
fn per_op<B: Backend>(n: usize) -> f64 {
    let device = B::Device::default();
    let mut x = Tensor::<B, 1>::from_floats([0.0, 1.0, 2.0, 3.0], &device);
    // One warm-up read, so the client and its threads exist before the clock starts.
    let _ = x.clone().into_data();
    let t0 = Instant::now();
    for _ in 0..n {
        x = x + 1.0;
    }
    let v = x.into_data().to_vec::<f32>().expect("f32");
    let dt = t0.elapsed();
    assert_eq!(v[0], n as f32, "the chain computed {v:?}");
    dt.as_secs_f64() * 1e6 / n as f64
}

/// ivm's client of mode `M` (one per process and mode).
fn client<M: VmMode>() -> IvmClient<M> {
    burn_router::get_client::<IvmChannel<M>>(&Default::default())
}

/// The counters of the VM behind ivm's client of mode `M`.
fn vm_stats<M: VmMode>() -> Option<ivm_std::VmStats> {
    client::<M>().vm().stats().ok()
}

/// The command line's `--epochs`, `--chain` and `--hidden`.
struct Args {
    epochs: usize,
    chain: usize,
    hidden: usize,
}

fn args() -> Result<Args, String> {
    let (mut epochs, mut chain, mut hidden) = (30, 20_000, 256);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: usize = value
            .parse()
            .map_err(|_| format!("{flag} {value}: not a number"))?;
        match flag.as_str() {
            "--epochs" if n > 0 => epochs = n,
            "--chain" if n > 0 => chain = n,
            "--hidden" if n > 0 => hidden = n,
            _ => {
                return Err(format!(
                    "usage: burn_mlp [--epochs N] [--chain N] [--hidden N] (got {flag} {value})"
                ));
            }
        }
    }
    Ok(Args {
        epochs,
        chain,
        hidden,
    })
}

type Direct = burn_router::Router<(Inner, Inner)>;

fn main() -> ExitCode {
    let Args {
        epochs,
        chain,
        hidden,
    } = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let single = std::env::var("IVM_BURN_MODE").is_ok_and(|m| m == "single");
    let data = data::load(SEED, 0.2);
    let steps = data.train.rows / BATCH;
    let mut runs: Vec<Box<dyn Run>> = vec![
        Box::new(Trainer::<Autodiff<Inner>>::new("ndarray", &data, hidden)),
        Box::new(Trainer::<Autodiff<Direct>>::new("router", &data, hidden)),
    ];
    // ivm twice on one client: with its fusion of ReLU's compare-then-fill pairs, and
    // without, switched before each of their epochs.
    for (name, fuse) in [("ivm", true), ("ivm-nofuse", false)] {
        runs.push(if single {
            Box::new(Fused::<SingleThread>::new(name, fuse, &data, hidden))
        } else {
            Box::new(Fused::<MultiThread>::new(name, fuse, &data, hidden))
        });
    }
    println!(
        "burn 0.19.1, MLP {}-{hidden}-{} with Adam (lr {LR}), wine data: {} train rows, \
         batch {BATCH}, {steps} steps/epoch, {epochs} epochs, interleaved; ivm in {} mode",
        data.features,
        data.classes,
        data.train.rows,
        if single {
            "single-thread"
        } else {
            "multi-thread"
        },
    );
    let n = runs.len();
    for e in 0..epochs {
        let order = data::epoch_order(data.train.rows, SEED, e);
        for k in 0..n {
            runs[(e + k) % n].epoch(&data, &order, steps);
        }
    }

    println!(
        "{:<10} {:>12} {:>16} {:>11} {:>9} {:>17}",
        "backend", "steps/s p50", "IQR (p25-p75)", "final loss", "accuracy", "caller CPU µs/step"
    );
    let mut medians = Vec::new();
    for r in &runs {
        let mut rates: Vec<f64> = r.epoch_secs().iter().map(|s| steps as f64 / s).collect();
        rates.sort_by(f64::total_cmp);
        let (p25, p50, p75) = (
            percentile(&rates, 0.25),
            percentile(&rates, 0.5),
            percentile(&rates, 0.75),
        );
        medians.push(p50);
        let mut cpu: Vec<f64> = r
            .caller_cpu_secs()
            .iter()
            .map(|s| s * 1e6 / steps as f64)
            .collect();
        cpu.sort_by(f64::total_cmp);
        let cpu = if cpu.is_empty() {
            "-".to_string()
        } else {
            format!("{:.0}", percentile(&cpu, 0.5))
        };
        println!(
            "{:<10} {:>12.0} {:>16} {:>11.5} {:>8.1}% {:>17}",
            r.name(),
            p50,
            format!("{p25:.0}-{p75:.0}"),
            r.losses().last().copied().unwrap_or(f32::NAN),
            100.0 * r.accuracy(&data),
            cpu,
        );
    }
    println!(
        "ivm / ndarray steps/s (medians): {:.2}; ivm-nofuse / ndarray: {:.2}; router / \
         ndarray: {:.2}",
        medians[2] / medians[0],
        medians[3] / medians[0],
        medians[1] / medians[0]
    );
    println!(
        "caller CPU: the training thread's own CPU time per step (median): a backend's step \
         takes at least that long, whatever runs beside it"
    );

    let mut ok = true;
    let base = runs[0].losses();
    for r in &runs[1..] {
        let same = r.losses().len() == base.len()
            && r.losses()
                .iter()
                .zip(base)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if same {
            println!(
                "{}: {} losses equal ndarray's bit for bit",
                r.name(),
                base.len()
            );
        } else {
            let worst = r
                .losses()
                .iter()
                .zip(base)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!(
                "{}: losses DIFFER from ndarray's (largest difference {worst:e})",
                r.name()
            );
            ok = false;
        }
    }

    // What the VM did for the training: who ran the kernels, and how often it sensed
    // another thread taking a CPU (each sense has callers run the work for a while).
    let fused = if single {
        client::<SingleThread>().fused_pairs()
    } else {
        client::<MultiThread>().fused_pairs()
    };
    println!(
        "ivm: {fused} compare-then-fill pairs (ReLU and its backward pass) ran as one kernel \
         each, in the epochs of `ivm`"
    );
    if single {
        println!("ivm: single-thread mode, every instruction ran on the caller");
    } else if let Some(s) = vm_stats::<MultiThread>() {
        println!(
            "ivm: {} instructions, {} of them run by the caller while it waited; contention \
             sensed: {} stalled workers, {} caller preemptions, {} busy-neighbour looks",
            s.received, s.caller_ran, s.worker_stalled, s.caller_preempted, s.crowded
        );
    }

    // The cost of one op: dependent tiny additions, direct and through ivm, in one run.
    let nd = per_op::<Inner>(chain);
    let routed = per_op::<Direct>(chain);
    let iv = if single {
        per_op::<IvmSingle>(chain)
    } else {
        per_op::<Ivm>(chain)
    };
    println!(
        "per op ({chain} dependent adds on 4 floats): ndarray {nd:.2} µs, router {routed:.2} µs, \
         ivm {iv:.2} µs"
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
