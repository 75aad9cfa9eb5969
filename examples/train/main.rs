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
//! `--device cpu|sim:<launch latency µs>`, `--mode all|plain|eager|lazy` (or a list:
//! `plain,eager`), `--quiet`,
//! `--trace PATH` (default: `ivm-train-trace.json` in the temp directory) or `--no-trace`,
//! `--no-pin`, `--hog N` (N busy threads of this process beside every mode, started
//! before the first epoch and stopped after the last: a machine where other work takes a
//! core),
//! `--data-parallel` (under `mpirun`, built with `--features mpi`: `dp.rs`).
//!
//! The last epoch of every mode is recorded as spans (kernels on the threads that ran
//! them, the graph runtime's actors, the caller's submit and loss read) and written as one
//! Chrome/Perfetto trace, with a per-step breakdown of where the time went.
//! VM settings come from the `IVM_*` environment variables (`Config::from_env`);
//! The lazy mode's caller runs the graph's ready work while it waits for the loss
//! (`GraphBuilder::run_on_caller`); `IVM_GRAPH_ON_CALLER=0` leaves it to the graph's thread.

mod args;
mod data;
#[cfg(feature = "mpi")]
mod dp;
#[path = "../common/hog.rs"]
mod hog;
mod kernels;
mod modes;
mod pin;
mod plots;
mod program;
mod report;
mod runs;
mod trace;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ivm::ivm_device::sim::{Latency, SimAdapter, SimConfig};
use ivm::ivm_std::{Config, Device, Stream, StreamId, StreamType, VirtualMachine};

use args::{Args, DeviceArg, Mode, parse_args};
use kernels::Adam;
use modes::{Plain, TrainRows, Trainer, Weights};
use program::Program;
use report::{check_determinism, core_round_trip, percentile, same_bits, where_time_goes};

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
    /// Its VM's counters (`VmStats`): fusion and contention; zero for plain mode.
    counters: runs::Counters,
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
        counters: runs::Counters::default(),
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

/// A VM for `device`: its compute stream, and (for a device) its host-to-device stream.
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
        DeviceArg::Sim(latency) | DeviceArg::SimLauncher(latency) => {
            let launcher = matches!(device, DeviceArg::SimLauncher(_));
            let sim = SimAdapter::new(SimConfig {
                devices: 1,
                launch_latency: Latency::fixed(latency),
                kernel_latency: Latency::ZERO,
                copy_latency: Latency::fixed(latency),
                seed: 7,
                // As cuda's streams are: kernels enqueue their work from the worker, and
                // the memory is device-only.
                launcher,
                host_visible: !launcher,
                ..SimConfig::default()
            });
            let vm = VirtualMachine::with_adapters(config, vec![sim])?;
            device_streams(
                vm,
                Device {
                    kind: ivm_device::sim::SIM,
                    index: 0,
                },
            )
        }
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => {
            let vm = VirtualMachine::with_adapters(
                config,
                vec![ivm::ivm_device::cuda::CudaAdapter::new()?],
            )?;
            device_streams(vm, ivm::ivm_device::cuda::cuda_device(0))
        }
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => Err(ivm::Error::InvalidArgument(
            "--device cuda: build the demo with `--features cuda`".into(),
        )),
    }
}

/// `vm`'s compute stream on `dev` and its host-to-device stream.
fn device_streams(
    vm: VirtualMachine,
    dev: Device,
) -> ivm::ivm_std::Result<(VirtualMachine, Stream, Option<Stream>)> {
    let s = vm.stream(StreamId::default_for(dev))?;
    // The h2d stream on a worker of its own: soft sync then orders compute after a copy
    // with an event recorded on the h2d stream right behind that copy (a record
    // instruction on the h2d stream), not behind whatever the h2d queue holds when the
    // copy completes (a stream wait from the shared worker).
    let h2d = vm.stream(StreamId {
        device: dev,
        stream_type: StreamType::HostToDevice,
        thread_id: 1,
    })?;
    Ok((vm, s, Some(h2d)))
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
        DeviceArg::SimLauncher(l) => format!(
            "sim, launcher streams, device-only memory (launch and copy latency {} µs)",
            l.as_micros()
        ),
        DeviceArg::Cuda => "cuda:0".to_string(),
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
    if args.device != DeviceArg::Cpu && modes.contains(&Mode::Eager) {
        let at = modes
            .iter()
            .position(|&m| m == Mode::Eager)
            .map_or(0, |i| i + 1);
        modes.insert(at, Mode::EagerOneStream);
    }
    // Busy threads beside every mode, started before the pinning (they keep the process's
    // whole mask) and stopped when `_hog` drops, after the last run.
    let _hog = hog::Hog::start(args.hog);
    if args.hog > 0 {
        println!("beside {} busy thread(s) of this process (--hog)", args.hog);
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
            counters: runs::Counters::default(),
        })
        .collect();
    for run in &all {
        for (agg, r) in runs.iter_mut().zip(run) {
            agg.epochs.extend_from_slice(&r.epochs);
            agg.read_lat.extend_from_slice(&r.read_lat);
            agg.counters.add(&r.counters);
        }
    }
    for r in &runs {
        if r.mode != Mode::Plain {
            println!("{}: {}", r.mode.name(), r.counters);
        } else if let Some(busy) = r.counters.busy_share() {
            // Plain's kernels run on the kernel CPU: where the busy threads were meanwhile.
            println!("plain: busy threads on the caller's CPU {busy:.0} % of its epochs");
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
