//! Training a real model through ivm: a two-layer MLP classifier on the red-wine quality
//! dataset (`linfa-datasets`, shipped inside the crate), trained three ways with the same
//! seeds and the same `ndarray` kernels:
//!
//! 1. **plain**: the kernels called directly in one thread, no VM — the baseline;
//! 2. **eager**: every op (gather, matmul, bias add, ReLU, softmax cross-entropy, their
//!    gradients, Adam) is an ivm instruction naming what it reads and writes; the loss is
//!    read after every step with `read_small` (the `.item()` of a training loop);
//! 3. **lazy**: forward, backward and update are one compiled graph (`ivm::graph`, ivm-graph)
//!    launched every step through critical sections (inputs: the batch; outputs: the
//!    loss; parameters: weights and optimiser state), the loss read every step.
//!
//! The per-step losses (and the final weights) of every mode must be bit-identical; the
//! example checks it and exits non-zero if not. A logistic-regression baseline is trained
//! the same way (plain) and its test accuracy reported beside the MLP's.
//!
//! ```sh
//! cargo run --release --example train                       # all three modes
//! cargo run --release --example train -- --epochs 1 --runs 1 --quiet  # what CI runs
//! cargo run --release --example train -- --mode eager --device sim:20
//! ```
//!
//! The modes run side by side (`runs.rs`): each trains its own copy of the model, one
//! epoch at a time, round-robin, the order rotated every epoch, so that the drift of a
//! shared host hits every mode alike. `--runs N` (default 20) such runs, every one with the
//! same losses. The table reports, per mode, the median and interquartile range of the
//! ratio of each epoch's time to plain's same epoch, over all epochs of all runs; the
//! core-to-core round trip printed with it says how much each hand-over between threads
//! costs on the machine at that moment. Every mode's kernels run on one CPU and the host
//! code driving a VM on another (`pin.rs`; Linux, with two CPUs or more): on a shared host
//! two vCPUs differ in speed at the same moment, and a mode whose kernels ran on the other
//! one than plain's would be measured against a different machine. `--no-pin` leaves
//! placement to the OS.
//!
//! Flags: `--epochs N`, `--batch-size N`, `--hidden N`, `--lr X`, `--seed N`, `--runs N`,
//! `--device cpu|sim:<launch latency µs>`, `--mode all|plain|eager|lazy`, `--quiet`,
//! `--trace PATH` (default: `ivm-train-trace.json` in the temp directory) or `--no-trace`,
//! `--no-pin`,
//! `--data-parallel` (under `mpirun`, built with `--features mpi`: `dp.rs`).
//!
//! The last epoch of every mode is recorded as spans (kernels on the threads that ran
//! them, the graph runtime's actors, the caller's submit and loss read) and written as one
//! Chrome/Perfetto trace, with a per-step breakdown of where the time went.
//! VM settings come from the `IVM_*` environment variables (`Config::from_env`);
//! `IVM_GRAPH_ON_CALLER=1` makes the lazy mode's graph run on the caller that waits for its
//! loss (`GraphBuilder::run_on_caller`).

mod data;
#[cfg(feature = "mpi")]
mod dp;
mod kernels;
mod modes;
mod pin;
mod plots;
mod program;
mod runs;
mod trace;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ivm::ivm_device::sim::{Latency, SimAdapter, SimConfig};
use ivm::ivm_std::{Config, Device, Stream, StreamId, StreamType, VirtualMachine};

use kernels::Adam;
use modes::{Plain, TrainRows, Trainer, Weights};
use program::Program;

/// Where the VM runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DeviceArg {
    Cpu,
    /// The simulated accelerator with this launch latency.
    Sim(Duration),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    Eager,
    /// Eager on the sim device with the batch copies on the compute stream (no overlap).
    EagerOneStream,
    Lazy,
}

impl Mode {
    /// The trace's process id of this mode.
    fn pid(self) -> u32 {
        match self {
            Mode::Plain => 1,
            Mode::Eager => 2,
            Mode::Lazy => 3,
            Mode::EagerOneStream => 4,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Eager => "eager",
            Mode::Lazy => "lazy",
            Mode::EagerOneStream => "eager-1s",
        }
    }
}

#[derive(Debug, Clone)]
struct Args {
    epochs: usize,
    batch: usize,
    hidden: usize,
    lr: f32,
    seed: u64,
    device: DeviceArg,
    modes: Vec<Mode>,
    quiet: bool,
    trace: Option<std::path::PathBuf>,
    runs: usize,
    /// Every mode's kernels on one CPU, the caller on another (`pin.rs`); `--no-pin`
    /// leaves placement to the OS.
    pin: bool,
    /// `--data-parallel`: train over MPI ranks (`dp.rs`).
    data_parallel: bool,
}

const USAGE: &str = "usage: train [--epochs N] [--batch-size N] [--hidden N] [--lr X] [--seed N] [--runs N] \
[--device cpu|sim:<latency_us>] [--mode all|plain|eager|lazy] [--quiet] [--trace PATH | --no-trace] [--no-pin] \
[--data-parallel (under mpirun; build with --features mpi)]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        epochs: 150,
        batch: 64,
        hidden: 256,
        lr: 3e-3,
        seed: 42,
        device: DeviceArg::Cpu,
        modes: vec![Mode::Plain, Mode::Eager, Mode::Lazy],
        quiet: false,
        trace: Some(std::env::temp_dir().join("ivm-train-trace.json")),
        runs: 20,
        pin: true,
        data_parallel: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (flag, None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
        }
        match flag.as_str() {
            "--epochs" => a.epochs = num(&flag, value(&flag)?)?,
            "--batch-size" => a.batch = num(&flag, value(&flag)?)?,
            "--hidden" => a.hidden = num(&flag, value(&flag)?)?,
            "--lr" => a.lr = num(&flag, value(&flag)?)?,
            "--seed" => a.seed = num(&flag, value(&flag)?)?,
            "--runs" => a.runs = num(&flag, value(&flag)?)?,
            "--quiet" | "-q" => a.quiet = true,
            "--data-parallel" => a.data_parallel = true,
            "--trace" => a.trace = Some(value(&flag)?.into()),
            "--no-trace" => a.trace = None,
            "--no-pin" => a.pin = false,
            "--device" => {
                let v = value(&flag)?;
                a.device = match v.as_str() {
                    "cpu" => DeviceArg::Cpu,
                    s if s.starts_with("sim") => {
                        let us = s
                            .strip_prefix("sim:")
                            .map(|n| num::<u64>("--device sim:<latency_us>", n.to_string()))
                            .transpose()?
                            .unwrap_or(5);
                        DeviceArg::Sim(Duration::from_micros(us))
                    }
                    _ => return Err(format!("--device: `{v}`: expected cpu or sim:<latency_us>")),
                }
            }
            "--mode" => {
                let v = value(&flag)?;
                a.modes = match v.as_str() {
                    "all" => vec![Mode::Plain, Mode::Eager, Mode::Lazy],
                    "plain" => vec![Mode::Plain],
                    "eager" => vec![Mode::Eager],
                    "lazy" => vec![Mode::Lazy],
                    _ => return Err(format!("--mode: `{v}`: expected all, plain, eager or lazy")),
                }
            }
            "--help" | "-h" => return Err(USAGE.to_string()),
            _ => return Err(format!("unknown flag `{flag}`\n{USAGE}")),
        }
    }
    if a.epochs == 0 || a.batch == 0 || a.hidden == 0 || a.runs == 0 {
        return Err("--epochs, --batch-size, --hidden and --runs must be positive".into());
    }
    Ok(a)
}

/// What one training run produced.
struct Run {
    mode: Mode,
    losses: Vec<f32>,
    /// Wall time of the training loop only.
    elapsed: Duration,
    /// Wall time of the last epoch (the traced one, in the first run).
    last_epoch: Duration,
    /// Wall time of every untraced epoch, in order.
    epochs: Vec<Duration>,
    weights: Weights,
    accuracy: f64,
    read_lat: Vec<Duration>,
}

struct Setup<'a> {
    args: &'a Args,
    rows: TrainRows,
    test: &'a data::Split,
    steps_per_epoch: usize,
}

fn progress(args: &Args, label: &str, total: u64) -> ProgressBar {
    let visible = !args.quiet && std::io::stdout().is_terminal();
    let pb = if visible {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) = ProgressStyle::with_template("{prefix:>14} [{bar:25}] {pos:>6}/{len} {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(label.to_string());
    pb
}

fn train(
    setup: &Setup<'_>,
    mode: Mode,
    label: &str,
    prog: &Program,
    trainer: &mut dyn Trainer,
    trace_pid: Option<u32>,
) -> ivm::ivm_std::Result<Run> {
    let a = setup.args;
    let spe = setup.steps_per_epoch;
    let pb = progress(a, label, (a.epochs * spe) as u64);
    let mut losses = Vec::with_capacity(a.epochs * spe);
    let t0 = Instant::now();
    let mut last_epoch = Duration::ZERO;
    let mut epochs = Vec::with_capacity(a.epochs);
    let rows = setup.rows.y.len();
    let mut next_order: Arc<[u32]> = data::epoch_order(rows, a.seed, 0).into();
    for epoch in 0..a.epochs {
        let last = epoch + 1 == a.epochs;
        if let (true, Some(pid)) = (last, trace_pid) {
            trainer.sync()?;
            trace::start(pid);
        }
        let order = next_order;
        next_order = data::epoch_order(rows, a.seed, epoch + 1).into();
        let next = (!last).then_some(&next_order);
        last_epoch = runs::epoch(setup, prog, trainer, &order, next, &mut losses)?;
        if !(last && trace_pid.is_some()) {
            // The traced epoch pays for its trace: left out of the epoch statistics.
            epochs.push(last_epoch);
        }
        if last && trace_pid.is_some() {
            trainer.sync()?;
            trace::stop();
        }
        pb.inc(spe as u64);
        let tail = &losses[losses.len() - spe..];
        pb.set_message(format!(
            "epoch {:>3} loss {:.4} {:>6.0} steps/s",
            epoch + 1,
            tail.iter().sum::<f32>() / spe as f32,
            losses.len() as f64 / t0.elapsed().as_secs_f64()
        ));
    }
    let elapsed = t0.elapsed();
    pb.finish_and_clear();
    let weights = trainer.weights()?;
    let accuracy = program::accuracy(&prog.layers, &weights, &setup.test.x, &setup.test.y);
    Ok(Run {
        mode,
        losses,
        elapsed,
        last_epoch,
        epochs,
        weights,
        accuracy,
        read_lat: trainer.read_latencies().to_vec(),
    })
}

/// A VM for `device`: its compute stream, and (for the sim) its host-to-device stream.
fn new_vm(device: DeviceArg) -> ivm::ivm_std::Result<(VirtualMachine, Stream, Option<Stream>)> {
    let config = Config::from_env()?;
    match device {
        DeviceArg::Cpu => {
            let vm = VirtualMachine::new(config)?;
            // The kernels on a compute stream of their own (its own worker), not on the
            // default stream, where sync accesses run: the loss read then waits only for
            // the kernel that wrote the loss (the VM tracks that dependency), not for
            // the whole backward pass queued behind it on the same in-order stream. The
            // host reads the loss and queues the next step while the worker still runs
            // this step's backward pass and update.
            let s = vm.stream(StreamId {
                device: Device::CPU,
                stream_type: StreamType::Compute,
                thread_id: 1,
            })?;
            Ok((vm, s, None))
        }
        DeviceArg::Sim(latency) => {
            let sim = SimAdapter::new(SimConfig {
                devices: 1,
                launch_latency: Latency::fixed(latency),
                kernel_latency: Latency::ZERO,
                copy_latency: Latency::fixed(latency),
                seed: 7,
                ..SimConfig::default()
            });
            let vm = VirtualMachine::with_adapters(config, vec![sim])?;
            let dev = Device {
                kind: ivm_device::sim::SIM,
                index: 0,
            };
            let s = vm.stream(StreamId::default_for(dev))?;
            // The h2d stream on a worker of its own: soft sync then orders compute after
            // a copy with an event recorded on the h2d stream right behind that copy (a
            // record instruction on the h2d stream), not behind whatever the h2d queue
            // holds when the copy completes (a stream wait from the shared worker).
            let h2d = vm.stream(StreamId {
                device: dev,
                stream_type: StreamType::HostToDevice,
                thread_id: 1,
            })?;
            Ok((vm, s, Some(h2d)))
        }
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The per-step breakdown of each mode's last epoch, from the trace.
fn where_time_goes(runs: &[Run], spe: usize) {
    println!();
    println!("where the last epoch's time goes, µs per step (from the trace):");
    println!(
        "| mode     | wall | kernels | graph protocol | h2d copies | caller run (build+submit) | caller waits in read | wall - kernels |"
    );
    println!(
        "|----------|-----:|--------:|---------------:|-----------:|--------------------------:|---------------------:|---------------:|"
    );
    for r in runs {
        let c = trace::per_step(r.mode.pid(), spe);
        let get = |k| c.get(&k).copied().unwrap_or(0.0);
        let wall = r.last_epoch.as_secs_f64() * 1e6 / spe as f64;
        let kernels = get(trace::Cat::Kernel);
        println!(
            "| {:<8} | {wall:>4.0} | {kernels:>7.1} | {:>14.1} | {:>10.1} | {:>25.1} | {:>20.1} | {:>14.1} |",
            r.mode.name(),
            get(trace::Cat::Protocol),
            get(trace::Cat::Copy),
            get(trace::Cat::Submit),
            get(trace::Cat::Read),
            wall - kernels
        );
    }
}

/// The round trip of one cache line between two threads spinning on it (each waits for the
/// other's store): the least any hand-over between the VM's threads costs on this machine
/// right now. Spinning yields now and then, so two threads sharing a CPU still finish.
fn core_round_trip() -> Duration {
    use std::sync::atomic::{AtomicU32, Ordering};
    const N: u32 = 5_000;
    fn wait_for(flag: &AtomicU32, v: u32) {
        let mut spins = 0u32;
        // Acquire: pairs with the other thread's Release store (a real hand-over).
        while flag.load(Ordering::Acquire) != v {
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
    let flag = Arc::new(AtomicU32::new(0));
    let peer = flag.clone();
    let h = std::thread::spawn(move || {
        for i in 0..N {
            wait_for(&peer, 2 * i + 1);
            peer.store(2 * i + 2, Ordering::Release);
        }
    });
    wait_for(&flag, 0);
    let t0 = Instant::now();
    for i in 0..N {
        flag.store(2 * i + 1, Ordering::Release);
        wait_for(&flag, 2 * i + 2);
    }
    let e = t0.elapsed();
    let _ = h.join();
    e / N
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Compares every run's losses and weights with the first run's, bit for bit.
fn check_determinism(runs: &[Run]) -> Result<String, String> {
    let Some(reference) = runs.first() else {
        return Ok("no run".into());
    };
    if runs.len() < 2 {
        return Ok(format!(
            "only {} ran: nothing to compare (use --mode all)",
            reference.mode.name()
        ));
    }
    for r in &runs[1..] {
        if r.losses.len() != reference.losses.len() {
            return Err(format!(
                "{} ran {} steps, {} ran {}",
                r.mode.name(),
                r.losses.len(),
                reference.mode.name(),
                reference.losses.len()
            ));
        }
        if let Some((i, (a, b))) = reference
            .losses
            .iter()
            .zip(&r.losses)
            .enumerate()
            .find(|(_, (a, b))| a.to_bits() != b.to_bits())
        {
            return Err(format!(
                "step {i}: {} loss {a:e} ({:#010x}) but {} loss {b:e} ({:#010x})",
                reference.mode.name(),
                a.to_bits(),
                r.mode.name(),
                b.to_bits()
            ));
        }
        let same = reference
            .weights
            .iter()
            .zip(&r.weights)
            .all(|((wa, ba), (wb, bb))| {
                let eq = |x: &[f32], y: &[f32]| {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
                };
                eq(wa, wb) && eq(ba, bb)
            });
        if !same {
            return Err(format!(
                "the final weights of {} and {} differ",
                reference.mode.name(),
                r.mode.name()
            ));
        }
    }
    let names: Vec<_> = runs.iter().map(|r| r.mode.name()).collect();
    Ok(format!(
        "per-step losses ({} steps) and final weights bit-identical across {}",
        reference.losses.len(),
        names.join(", ")
    ))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match real_main(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("train: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn real_main(args: &Args) -> ivm::ivm_std::Result<ExitCode> {
    let t_load = Instant::now();
    let data = data::load(args.seed, 0.2);
    let load_time = t_load.elapsed();
    let features = data.features;
    let classes = data.classes;
    let steps_per_epoch = data.train.rows / args.batch;
    if steps_per_epoch == 0 {
        eprintln!(
            "--batch-size {} is larger than the {} training rows",
            args.batch, data.train.rows
        );
        return Ok(ExitCode::from(2));
    }
    let adam = Adam {
        lr: args.lr,
        ..Adam::default()
    };
    if args.data_parallel {
        #[cfg(feature = "mpi")]
        return dp::run(args, &data, adam);
        #[cfg(not(feature = "mpi"))]
        {
            eprintln!(
                "--data-parallel needs MPI: cargo build --release --example train --features mpi, \
                 then mpirun -np 2 target/release/examples/train --data-parallel"
            );
            return Ok(ExitCode::from(2));
        }
    }
    let mlp = Arc::new(Program::classifier(
        &[features, args.hidden, classes],
        args.batch,
        adam,
        args.seed,
    ));
    let logreg = Arc::new(Program::classifier(
        &[features, classes],
        args.batch,
        adam,
        args.seed,
    ));
    let device = match args.device {
        DeviceArg::Cpu => "cpu".to_string(),
        DeviceArg::Sim(l) => format!("sim (launch and copy latency {} µs)", l.as_micros()),
    };
    println!(
        "winequality (red): {} train / {} test rows, {features} features, {classes} classes \
         (quality {}..={}), loaded in {:.0} ms",
        data.train.rows,
        data.test.rows,
        data.min_quality,
        data.min_quality + classes - 1,
        load_time.as_secs_f64() * 1e3
    );
    println!(
        "model: MLP {features}-{}-{classes} ({} parameters), Adam lr {}, batch {}, {} epochs x {} \
         steps, {} ops per step, device {device}",
        args.hidden,
        mlp.num_params(),
        args.lr,
        args.batch,
        args.epochs,
        steps_per_epoch,
        mlp.ops.len() + 2,
    );
    let setup = Setup {
        args,
        rows: TrainRows {
            x: Arc::new(data.train.x.clone()),
            y: Arc::new(data.train.y.clone()),
            width: features,
        },
        test: &data.test,
        steps_per_epoch,
    };

    let mut modes = args.modes.clone();
    if matches!(args.device, DeviceArg::Sim(_)) && modes.contains(&Mode::Eager) {
        let at = modes
            .iter()
            .position(|&m| m == Mode::Eager)
            .map_or(0, |i| i + 1);
        modes.insert(at, Mode::EagerOneStream);
    }
    // `--runs` interleaved runs (`runs.rs`); every run must repeat the first's losses.
    let pb = progress(args, "interleaved runs", args.runs as u64);
    let mut all: Vec<Vec<Run>> = Vec::with_capacity(args.runs);
    for r in 0..args.runs {
        let run = runs::interleaved(&setup, &modes, &mlp, r == 0 && args.trace.is_some())?;
        if let Some(first) = all.first() {
            for (a, b) in first.iter().zip(&run) {
                if !same_bits(&a.losses, &b.losses) {
                    return Err(ivm::ivm_std::Error::Config(format!(
                        "determinism: run {r} of {} produced different losses than run 0",
                        b.mode.name()
                    )));
                }
            }
        }
        all.push(run);
        pb.inc(1);
    }
    pb.finish_and_clear();
    // Run 0's runs (losses, weights, trace), with every run's epoch times and reads.
    let mut runs: Vec<Run> = all[0]
        .iter()
        .map(|r| Run {
            mode: r.mode,
            losses: r.losses.clone(),
            elapsed: r.elapsed,
            last_epoch: r.last_epoch,
            epochs: Vec::new(),
            weights: r.weights.clone(),
            accuracy: r.accuracy,
            read_lat: Vec::new(),
        })
        .collect();
    for run in &all {
        for (agg, r) in runs.iter_mut().zip(run) {
            agg.epochs.extend_from_slice(&r.epochs);
            agg.read_lat.extend_from_slice(&r.read_lat);
        }
    }
    let mut lr_plain = Plain::new(logreg.clone(), setup.rows.clone());
    let baseline = train(
        &setup,
        Mode::Plain,
        "logreg plain",
        &logreg,
        &mut lr_plain,
        None,
    )?;

    let spe = setup.steps_per_epoch;
    // Steps per second of the median epoch, over all runs.
    let median_rate = |r: &Run| {
        let mut e = r.epochs.clone();
        e.sort_unstable();
        e.get(e.len() / 2)
            .map_or(r.losses.len() as f64 / r.elapsed.as_secs_f64(), |m| {
                spe as f64 / m.as_secs_f64()
            })
    };
    println!();
    println!(
        "| model  | mode     | steps | median-epoch steps/s | vs plain: median | interquartile range | epochs | final loss | test acc |"
    );
    println!(
        "|--------|----------|------:|---------------------:|-----------------:|--------------------:|-------:|-----------:|---------:|"
    );
    let row = |model: &str, r: &Run, spread: Option<runs::Spread>| {
        let pct = |x: f64| format!("{:+.1} %", (x - 1.0) * 100.0);
        let (vs, iqr, n) = match spread {
            Some(s) if r.mode != Mode::Plain => (
                pct(s.median),
                format!("{} .. {}", pct(s.q1), pct(s.q3)),
                s.n.to_string(),
            ),
            _ => ("-".into(), "-".into(), r.epochs.len().to_string()),
        };
        let last = &r.losses[r.losses.len() - spe..];
        println!(
            "| {model:<6} | {:<8} | {:>5} | {:>20.0} | {vs:>16} | {iqr:>19} | {n:>6} | {:>10.4} | {:>7.1} % |",
            r.mode.name(),
            r.losses.len(),
            median_rate(r),
            last.iter().sum::<f32>() / spe as f32,
            r.accuracy * 100.0
        );
    };
    for r in &runs {
        row("mlp", r, runs::Spread::of(runs::ratios(&all, r.mode)));
    }
    row("logreg", &baseline, None);
    println!();
    println!(
        "\"vs plain\": the VM's share, as the ratio of each epoch's wall time to plain's same \
         epoch of the same run (modes interleaved epoch by epoch, order rotated), over {} \
         run(s): median and interquartile range; {}.",
        args.runs,
        match args.pin.then(pin::cpus).flatten() {
            Some((caller, kernels)) => format!(
                "every mode's kernels on CPU {kernels}, the caller driving a VM on CPU {caller}"
            ),
            None => "threads placed by the OS".to_string(),
        }
    );
    let rate_of = |m: Mode| runs.iter().find(|r| r.mode == m).map(median_rate);
    if let (Some(two), Some(one)) = (rate_of(Mode::Eager), rate_of(Mode::EagerOneStream)) {
        println!(
            "sim: batches copied from the host on an h2d stream overlapping compute (eager) vs on \
             the compute stream (eager-1s): {:.2}x the steps/s",
            two / one
        );
    }

    let with_reads: Vec<&Run> = runs.iter().filter(|r| !r.read_lat.is_empty()).collect();
    if !with_reads.is_empty() {
        println!();
        println!("read_small of the loss, per step (waits for the kernel that wrote it):");
        println!("| mode     | reads | p50 (µs) | p90 (µs) | p99 (µs) | max (µs) |");
        println!("|----------|------:|---------:|---------:|---------:|---------:|");
        for r in with_reads {
            let mut l = r.read_lat.clone();
            l.sort_unstable();
            println!(
                "| {:<8} | {:>5} | {:>8.1} | {:>8.1} | {:>8.1} | {:>8.1} |",
                r.mode.name(),
                l.len(),
                percentile(&l, 0.5),
                percentile(&l, 0.9),
                percentile(&l, 0.99),
                percentile(&l, 1.0)
            );
        }
    }
    println!();
    if args.device == DeviceArg::Cpu {
        println!(
            "core-to-core round trip of a cache line, now: {:.2} µs (every hand-over between \
             the VM's threads pays a few; on a shared VM it varies with where the host puts \
             the vCPUs)",
            core_round_trip().as_secs_f64() * 1e6
        );
    }
    if let Some(mlp_run) = runs.first() {
        let verdict = if mlp_run.accuracy >= baseline.accuracy {
            "at least"
        } else {
            "BELOW"
        };
        println!(
            "accuracy: MLP {:.1} % vs logistic regression {:.1} % ({verdict} the baseline)",
            mlp_run.accuracy * 100.0,
            baseline.accuracy * 100.0
        );
    }
    if let Some(path) = &args.trace {
        where_time_goes(&runs, setup.steps_per_epoch);
        let procs: Vec<(u32, &str)> = runs.iter().map(|r| (r.mode.pid(), r.mode.name())).collect();
        match trace::write(path, &procs) {
            Ok(n) => println!(
                "trace of the last epoch ({n} spans, Chrome/Perfetto JSON): {}",
                path.display()
            ),
            Err(e) => println!("trace: could not write {}: {e}", path.display()),
        }
        // The pictures, next to the trace.
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        let (loss_path, timeline_path) =
            (dir.join("train-loss.svg"), dir.join("train-timeline.svg"));
        let mut series: Vec<(String, &[f32])> = runs
            .iter()
            .map(|r| (format!("mlp {}", r.mode.name()), r.losses.as_slice()))
            .collect();
        series.push(("logistic regression".into(), baseline.losses.as_slice()));
        let named: Vec<(&str, &[f32])> = series.iter().map(|(n, l)| (n.as_str(), *l)).collect();
        match plots::loss(&loss_path, &named) {
            Ok(()) => println!("loss per step (SVG): {}", loss_path.display()),
            Err(e) => println!("plot: could not write {}: {e}", loss_path.display()),
        }
        let lanes: Vec<(&str, plots::Spans)> = runs
            .iter()
            .map(|r| (r.mode.name(), trace::spans_of(r.mode.pid())))
            .collect();
        match plots::timeline(&timeline_path, &lanes, 3, setup.steps_per_epoch) {
            Ok(()) => println!(
                "timeline of the last steps (SVG): {}",
                timeline_path.display()
            ),
            Err(e) => println!("plot: could not write {}: {e}", timeline_path.display()),
        }
    }
    match check_determinism(&runs) {
        Ok(msg) => {
            println!("determinism: OK: {msg}");
            Ok(ExitCode::SUCCESS)
        }
        Err(msg) => {
            eprintln!();
            eprintln!("determinism: FAILED: {msg}");
            eprintln!("the modes ran the same kernels on the same data and must agree bit for bit");
            Ok(ExitCode::FAILURE)
        }
    }
}
