//! The demo's command line: its flags, the device and the modes it trains.

use std::time::Duration;

/// Where the VM runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum DeviceArg {
    Cpu,
    /// The simulated accelerator with this launch latency.
    Sim(Duration),
    /// The simulated accelerator as cuda's streams are: launcher streams and device-only
    /// memory, with this launch latency (the cuda code path, without a GPU).
    SimLauncher(Duration),
    /// The first CUDA GPU (the demo built with `--features cuda`).
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Plain,
    Eager,
    /// Eager on the sim device with the batch copies on the compute stream (no overlap).
    EagerOneStream,
    Lazy,
}

impl Mode {
    /// The trace's process id of this mode.
    pub(crate) fn pid(self) -> u32 {
        match self {
            Mode::Plain => 1,
            Mode::Eager => 2,
            Mode::Lazy => 3,
            Mode::EagerOneStream => 4,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Eager => "eager",
            Mode::Lazy => "lazy",
            Mode::EagerOneStream => "eager-1s",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) epochs: usize,
    pub(crate) batch: usize,
    pub(crate) hidden: usize,
    pub(crate) lr: f32,
    pub(crate) seed: u64,
    pub(crate) device: DeviceArg,
    pub(crate) modes: Vec<Mode>,
    pub(crate) quiet: bool,
    pub(crate) trace: Option<std::path::PathBuf>,
    pub(crate) runs: usize,
    /// Every mode's kernels on one CPU, the caller on another (`pin.rs`); `--no-pin`
    /// leaves placement to the OS.
    pub(crate) pin: bool,
    /// `--data-parallel`: train over MPI ranks (`dp.rs`).
    pub(crate) data_parallel: bool,
    /// `--bucket-kib N`: with `--data-parallel`, the reduced buffers travel in buckets of
    /// at most N KiB, one all-gather each (`dp.rs`; 0: one per buffer).
    pub(crate) bucket_kib: usize,
    /// `--hog N`: N busy threads beside every mode, from before the first epoch to after
    /// the last (`../common/hog.rs`).
    pub(crate) hog: usize,
}

const USAGE: &str = "usage: train [--epochs N] [--batch-size N] [--hidden N] [--lr X] [--seed N] [--runs N] \
[--device cpu|sim:<latency_us>|sim-launcher:<latency_us>|cuda] [--mode all|plain|eager|lazy[,...]] [--quiet] [--trace PATH | --no-trace] [--no-pin] [--hog N] \
[--data-parallel (under mpirun; build with --features mpi)] [--bucket-kib N (data parallel; default 64)]";

pub(crate) fn parse_args() -> Result<Args, String> {
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
        bucket_kib: 64,
        hog: 0,
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
            "--bucket-kib" => a.bucket_kib = num(&flag, value(&flag)?)?,
            "--trace" => a.trace = Some(value(&flag)?.into()),
            "--no-trace" => a.trace = None,
            "--no-pin" => a.pin = false,
            "--hog" => a.hog = num(&flag, value(&flag)?)?,
            "--device" => {
                let v = value(&flag)?;
                let latency = |prefix: &str| -> Result<Duration, String> {
                    let us = v
                        .strip_prefix(prefix)
                        .and_then(|rest| rest.strip_prefix(':'))
                        .map(|n| num::<u64>(&format!("--device {prefix}:<latency_us>"), n.into()))
                        .transpose()?
                        .unwrap_or(5);
                    Ok(Duration::from_micros(us))
                };
                a.device = match v.as_str() {
                    "cpu" => DeviceArg::Cpu,
                    "cuda" => DeviceArg::Cuda,
                    s if s.starts_with("sim-launcher") => {
                        DeviceArg::SimLauncher(latency("sim-launcher")?)
                    }
                    s if s.starts_with("sim") => DeviceArg::Sim(latency("sim")?),
                    _ => {
                        return Err(format!(
                            "--device: `{v}`: expected cpu, sim:<latency_us>, \
                             sim-launcher:<latency_us> or cuda"
                        ));
                    }
                }
            }
            "--mode" => {
                let v = value(&flag)?;
                a.modes = Vec::new();
                for m in v.split(',') {
                    let m = match m {
                        "all" => vec![Mode::Plain, Mode::Eager, Mode::Lazy],
                        "plain" => vec![Mode::Plain],
                        "eager" => vec![Mode::Eager],
                        "lazy" => vec![Mode::Lazy],
                        _ => {
                            return Err(format!(
                                "--mode `{v}`: `{m}` is not all, plain, eager or lazy \
                                 (a list: `plain,eager`)"
                            ));
                        }
                    };
                    for m in m {
                        if !a.modes.contains(&m) {
                            a.modes.push(m);
                        }
                    }
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
