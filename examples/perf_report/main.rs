//! Every performance figure the README holds to a target, measured once, each against its baseline in the
//! same run (absolute numbers drift with the machine and its load; ratios much less).
//!
//! Prints a markdown table, then one line per figure: `RATIO <name> <value>` for ratios
//! and `FIGURE <name> <value> <unit>` for the rest. Runs in under a minute:
//! `cargo run --release --example perf_report` (`-- --quick` for a shorter smoke run;
//! `-- warm cold inline throughput allocs cpu caller contended fused eager` to run only some
//! sections;
//! `-- --device sim|sim-launcher|cuda` adds the device section, `device.rs`, on that device;
//! cuda needs `--features cuda`).
//! VM settings come from [`Config::from_env`] (`IVM_*`), with the overrides each scenario
//! states.
//!
//! | figure | what |
//! |---|---|
//! | `warm_read_vs_spin_floor` | p50 of 20 000 back-to-back 8-byte `read_small` done by the worker (`inline_sync_access` off; worker within its poll window, woken by a kernel every 500 reads; nothing in flight, so through its express lane, `model/express.rs`), over the p50 of a two-thread spin ping-pong round trip, interleaved in 4 chunks |
//! | `warm_read_p99_us` | p99 of those reads |
//! | `warm_read_vs_channel_polling` | (extra) the same p50 over a crossbeam request/response round trip with a polling worker, same chunks |
//! | `cold_read_vs_futex_wake` | p50 of a read after the VM sat idle 10 ms (every VM thread parked; default config: nothing is in flight, so the caller runs the read itself, no wake), over the p50 of a futex wake (from just before the wake call to the woken thread running) after 10 ms asleep; 200 interleaved samples each. `cold_read_worker_vs_futex_wake` reports the same with `inline_sync_access` off (the worker path: the read is queued to the sleeping worker, and its caller runs it without waking it) |
//! | `op_read_p50_us`, `op_read_vs_single_thread` | p50 of one op (a kernel writing a tensor) then a read of it, back to back, default config; over the same in single-thread mode; interleaved chunks. With `_hog1`: target ≤ 3 µs |
//! | `idle_op_read_vs_single_thread` | p50 of one op (a kernel writing a tensor) then a read of it, after the VM sat idle 1 ms, default config, over the same in single-thread mode; 400 interleaved samples each. `idle_op_read_p50_us` is the default config's p50 |
//! | `inline_read_ns` | p50 of back-to-back reads with nothing in flight, run inline by the caller (default config) |
//! | `instr_per_s` | instructions each reading one and writing another of 8 tensors on one stream, `run` batches of 64, until `sync()` returns |
//! | `instr_vs_channel_bound` | `instr_per_s` over one worker running boxed 32-byte closures sent over a crossbeam channel, same count, same run |
//! | `instr_per_s_single` | as `instr_per_s` with one instruction per `run` |
//! | `allocs_per_read` | allocations per steady-state sync read/write (process-wide counting allocator) |
//! | `allocs_per_instr` | allocations per steady-state pooled instruction: `call` with a plain fn and with a 64-byte closure, touch, release, sync access, `sync()` |
//! | `idle_cpu_pct` | CPU of the VM's threads (`/proc/self/task/*/schedstat`) over 5 s idle, % of one core |
//! | `busy_kernel_cpu_pct` | the same plus the waiting caller, over a 5 s kernel that sleeps |
//! | `caller_work_ratio` | the caller's compute rate while the VM streams instructions for it, over its rate with the VM idle |
//! | `*_hog1`, `*_hog2` | section `contended`: `warm_read_*`, `instr_per_s`, `instr_vs_channel_bound` and `caller_work_ratio` again (quick sizes), beside one and two busy threads of this process (`examples/common/hog.rs`); the baselines run beside the same threads |
//! | `fused_k<k>_<ops>_{on,off}_per_s` | a `vm.run` of `k` (1, 4, 24, 100) independent or dependent ops on one stream, repeated until `sync()`, fusion on and off (`Config::fusion`) and single-thread mode, interleaved; the section's table adds spreads, the ratios to the channel bound and the process's CPU time per instruction |
//! | `fused_k24_<ops>_{on_cpu_ns,single_per_s,single_cpu_ns}` | runs of 24: the process's CPU ns per instruction with fusion on, and single-thread mode's rate and CPU ns per instruction (the reference of one thread) |
//! | `fused_k24_<ops>_on_vs_channel_bound` | runs of 24 with fusion on over the channel bound measured between them |
//! | `fused_k1_<ops>_on_vs_off` | single-instruction runs, fusion on over off |
//! | `eager_op_{multi,single}_over_plain_ns_ws{0,64}` | section `eager` (`eager_ops.rs`): one op per `vm.run`, a chain on one stream, steps of 24 ops whose eighth also writes a loss read after the step, each kernel touching a 0 or 64 KiB working set first; ns per op over the same kernels called directly, default and single-thread mode, interleaved |

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded};
use ivm::ivm_std::{Config, Device, Stream, StreamId, Tensor, VirtualMachine};

#[path = "../common/mod.rs"]
mod common;
// The counting global allocator, shared with ivm-std's `alloc_counts` test.
#[path = "../../crates/ivm-std/tests/common/counting_alloc.rs"]
mod counting_alloc;
mod device;
mod eager_ops;
mod fused;
// Where the eager section places its threads, as the training demo does.
#[allow(dead_code)]
#[path = "../train/pin.rs"]
mod pin;
mod reads;
mod resources;
mod throughput;

use common::{FutexBaseline, cpu_between, my_tid, thread_cpu};
use counting_alloc::allocs_during;
use eager_ops::eager_ops;
use fused::fused_runs;
use reads::{cold_reads, inline_reads, warm_reads};
use resources::{allocations, cpu_use};
use throughput::{caller_work, throughput};

// ---- helpers -----------------------------------------------------------------------------

fn pct(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn config() -> Config {
    Config::from_env().expect("IVM_* variables parse")
}

fn read8(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out).expect("sync read");
    u64::from_ne_bytes(out)
}

/// A VM with one 8-byte tensor holding `v`.
fn vm_with_value(cfg: Config, v: u64) -> (VirtualMachine, Tensor) {
    let vm = VirtualMachine::new(cfg).expect("VM starts");
    let s = vm.default_stream();
    let t = vm.new_tensor(8).expect("tensor");
    vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = v))
        .expect("run");
    vm.sync().expect("sync");
    assert_eq!(read8(&vm, &t), v);
    (vm, t)
}

/// `n` round trips of a two-thread ping-pong through one atomic, spinning with a spin-loop
/// hint on both sides.
fn spin_pingpong(n: usize) -> Vec<Duration> {
    let flag = Arc::new(AtomicU64::new(0));
    let f2 = flag.clone();
    let n2 = n as u64 + 100;
    let peer = std::thread::spawn(move || {
        for i in 0..n2 {
            while f2.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            f2.store(2 * i + 2, Ordering::Release);
        }
    });
    let mut samples = Vec::with_capacity(n);
    for i in 0..n2 {
        let t = Instant::now();
        flag.store(2 * i + 1, Ordering::Release);
        while flag.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
        if i >= 100 {
            samples.push(t.elapsed());
        }
    }
    peer.join().expect("peer");
    samples
}

// ---- results -----------------------------------------------------------------------------

struct Row {
    name: &'static str,
    value: f64,
    unit: &'static str,
    target: &'static str,
    met: Option<bool>,
    ratio: bool,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
}

impl Report {
    fn ratio(&mut self, name: &'static str, value: f64, target: &'static str, met: bool) {
        self.rows.push(Row {
            name,
            value,
            unit: "",
            target,
            met: Some(met),
            ratio: true,
        });
    }
    fn figure(
        &mut self,
        name: &'static str,
        value: f64,
        unit: &'static str,
        target: &'static str,
        met: Option<bool>,
    ) {
        self.rows.push(Row {
            name,
            value,
            unit,
            target,
            met,
            ratio: false,
        });
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let cfg = config();
    println!(
        "ivm perf report: {cores} hardware threads; worker poll window {:?}, scheduler window {:?}, skip threshold {}{}\n",
        cfg.worker_poll_window,
        cfg.scheduler_work_window,
        cfg.skip_blocking_threshold,
        if quick { " (quick)" } else { "" }
    );
    // Sections named on the command line (`warm cold inline throughput allocs cpu caller
    // contended fused eager`) run alone; none named: all.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = args
        .iter()
        .position(|a| a == "--device")
        .map(|i| args.get(i + 1).cloned().unwrap_or_default());
    let only: Vec<String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| !a.starts_with("--") && (*i == 0 || args[i - 1] != "--device"))
        .map(|(_, a)| a.clone())
        .collect();
    let run = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let start = Instant::now();
    let mut rep = Report::default();
    if run("warm") {
        warm_reads(&mut rep, quick);
    }
    if run("cold") {
        cold_reads(&mut rep, quick);
    }
    if run("inline") {
        inline_reads(&mut rep, quick);
    }
    if run("throughput") {
        throughput(&mut rep, quick);
    }
    if run("allocs") {
        allocations(&mut rep);
    }
    if run("cpu") {
        cpu_use(&mut rep, quick);
    }
    if run("caller") {
        caller_work(&mut rep, quick);
    }
    if run("contended") {
        contended(&mut rep);
    }
    if run("fused") {
        fused_runs(&mut rep, quick);
    }
    if run("eager") {
        eager_ops(&mut rep, quick);
    }
    if let Some(name) = &device
        && run("device")
        && let Err(m) = device::device_figures(&mut rep, quick, name)
    {
        eprintln!("perf_report: device {name}: {m}");
        std::process::exit(2);
    }
    println!("\n| figure | value | unit | target | met |\n|---|---|---|---|---|");
    for r in &rep.rows {
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        println!(
            "| `{}` | {} | {} | {} | {} |",
            r.name,
            fmt(r.value),
            r.unit,
            r.target,
            met
        );
    }
    println!();
    for r in &rep.rows {
        if r.ratio {
            println!("RATIO {} {}", r.name, fmt(r.value));
        } else {
            let unit = if r.unit.is_empty() { "count" } else { r.unit };
            println!("FIGURE {} {} {}", r.name, fmt(r.value), unit);
        }
    }
    println!("\n(total {:.1} s)", start.elapsed().as_secs_f64());
}

/// The quiet sections' main figures again, beside one and then two busy threads: the
/// figures keep their names with `_hog1` / `_hog2` appended, and the contended targets.
fn contended(rep: &mut Report) {
    for n in [1usize, 2] {
        let _hog = common::hog::Hog::start(n);
        println!("-- contended: beside {n} busy thread(s)");
        let mut sub = Report::default();
        warm_reads(&mut sub, true);
        throughput(&mut sub, true);
        caller_work(&mut sub, true);
        for r in sub.rows {
            let (target, met) = match (n, r.name) {
                (1, "warm_read_p99_us") => ("≤ 50", Some(r.value <= 50.0)),
                (1, "instr_per_s") => ("≥ 1.5 M", Some(r.value >= 1.5e6)),
                (1, "caller_work_ratio") => ("≥ 0.8", Some(r.value >= 0.8)),
                (1, "op_read_p50_us") => ("≤ 3", Some(r.value <= 3.0)),
                _ => ("(report)", None),
            };
            let name: &'static str = Box::leak(format!("{}_hog{n}", r.name).into_boxed_str());
            rep.rows.push(Row {
                name,
                target,
                met,
                ..r
            });
        }
    }
}

fn fmt(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}
