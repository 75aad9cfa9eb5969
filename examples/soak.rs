//! Soak: everything at once for a while, counted.
//!
//! `cargo run --release --example soak -- --minutes 30` (or `--seconds N`; `--report S`
//! sets the report period, default 60 s or a quarter of the run if shorter). Five loads run
//! side by side on a 2-core machine:
//!
//! * **equivalence**: random programs (`ivm_std::fuzzing`) on a multi-thread and a
//!   single-thread VM, each compared with the sequential interpreter;
//! * **stream + read**: one thread streams increments of a counter over two streams (every
//!   instruction a cross-stream use) while another reads it with `read_small` and
//!   checks it never goes backwards nor past what was submitted;
//! * **lazy**: launches of a `y = x + 1` graph through critical sections, each output read
//!   back and checked;
//! * **shutdown under load**: every cycle a fresh VM, three submitters (`run`, sync reads,
//!   lazy launches) and a shutdown racing them; every submission must end `Ok` or
//!   `Err(ShutDown)`, and the two must add up;
//! * the long-lived VMs' live-object counters are printed with every report and must be
//!   zero once their loads have stopped.
//!
//! Every report prints operations per second by load, errors by kind and live objects. The
//! process exits non-zero on any mismatch or unexpected error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ivm::graph::fuzzing::launch_graphs;
use ivm::graph::{Graph, GraphBuilder};
use ivm::ivm_std::fuzzing::{Program, Runner};
use ivm::ivm_std::{
    Config, Device, Error, StreamId, Tensor, VirtualMachine, fuzzing::silence_planned_panics,
};

/// Operations completed, per load.
#[derive(Default)]
struct Ops {
    programs: AtomicU64,
    instructions: AtomicU64,
    reads: AtomicU64,
    launches: AtomicU64,
    shutdown_cycles: AtomicU64,
    refused: AtomicU64,
}

/// Errors by kind (the message's first words), and whether any is fatal.
#[derive(Default)]
struct Errors {
    by_kind: Mutex<BTreeMap<String, u64>>,
    fatal: AtomicBool,
}

impl Errors {
    fn fail(&self, kind: &str, detail: impl std::fmt::Display) {
        eprintln!("soak: {kind}: {detail}");
        *self
            .by_kind
            .lock()
            .unwrap()
            .entry(kind.to_string())
            .or_default() += 1;
        self.fatal.store(true, Relaxed);
    }
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> Result<u64, Error> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn plus_one() -> Graph {
    let mut g = GraphBuilder::new("soak_plus_one");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("add", &[x], &[y], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    g.output("y", y);
    g.threads(1);
    g.build().expect("graph builds")
}

/// Random programs against the interpreter until `stop`.
fn equivalence(config: Config, seed0: u64, stop: &AtomicBool, ops: &Ops, errs: &Errors) {
    let runner = match Runner::new(config).and_then(|r| r.with_launch_graphs(launch_graphs()?)) {
        Ok(r) => r,
        Err(e) => return errs.fail("runner start", e),
    };
    let mut seed = seed0;
    while !stop.load(Relaxed) {
        seed += 1;
        match runner.run(&Program::from_seed(seed)) {
            Ok(_) => {
                ops.programs.fetch_add(1, Relaxed);
            }
            Err(m) => errs.fail("equivalence mismatch", format!("seed {seed}: {m}")),
        }
    }
}

/// One thread streams increments over two streams; this thread reads concurrently.
fn stream_and_read(
    vm: &Arc<VirtualMachine>,
    stop: &Arc<AtomicBool>,
    ops: &Arc<Ops>,
    errs: &Errors,
) {
    let c = vm.new_tensor(8).expect("tensor");
    let submitted = Arc::new(AtomicU64::new(0));
    let streamer = {
        let (vm, c, stop, ops, submitted) = (
            vm.clone(),
            c.clone(),
            stop.clone(),
            ops.clone(),
            submitted.clone(),
        );
        thread::spawn(move || -> Result<(), Error> {
            let s = [
                vm.default_stream(),
                vm.stream(StreamId::compute(Device::CPU, 1))?,
            ];
            let mut batches = 0u64;
            while !stop.load(Relaxed) {
                vm.run(|b| {
                    for j in 0..32 {
                        b.call(&s[j % 2], &[], &[&c], |k| k.output_u64(0)[0] += 1)?;
                    }
                    Ok(())
                })?;
                submitted.fetch_add(32, Relaxed);
                ops.instructions.fetch_add(32, Relaxed);
                batches += 1;
                if batches.is_multiple_of(32) {
                    // Keep the lead bounded (about 1000 instructions), so that the reader
                    // and the other loads are not queued behind a whole backpressure
                    // window.
                    read_u64(&vm, &c)?;
                }
            }
            vm.sync()
        })
    };
    let mut last = 0;
    while !stop.load(Relaxed) {
        // Read the bound first: everything it counts was submitted before the read.
        let bound = submitted.load(Relaxed);
        match read_u64(vm, &c) {
            Ok(v) if v < last || v < bound => errs.fail(
                "stream read mismatch",
                format!("read {v} after {last}, with {bound} submitted before the read"),
            ),
            Ok(v) => last = v,
            Err(e) => errs.fail("stream read error", e),
        }
        ops.reads.fetch_add(1, Relaxed);
    }
    match streamer.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => errs.fail("streamer error", e),
        Err(_) => errs.fail("streamer panicked", ""),
    }
    match read_u64(vm, &c) {
        Ok(v) if v != submitted.load(Relaxed) => {
            errs.fail("stream final mismatch", format!("{v} of {submitted:?}"))
        }
        Ok(_) => {}
        Err(e) => errs.fail("stream final read", e),
    }
}

/// Lazy launches of `y = x + 1`, each checked.
fn lazy(vm: &VirtualMachine, stop: &AtomicBool, ops: &Ops, errs: &Errors) {
    let graph = plus_one();
    let (x, y) = (vm.new_tensor(8).expect("x"), vm.new_tensor(8).expect("y"));
    let s = vm.default_stream();
    let mut i = 0u64;
    while !stop.load(Relaxed) {
        i += 1;
        let r = vm
            .run(|b| {
                b.call(&s, &[], &[&x], move |k| k.output_u64(0)[0] = i)?;
                b.launch_lazy_job(&[&x], &[&y], &[], graph.lazy())
            })
            .and_then(|()| read_u64(vm, &y));
        match r {
            Ok(v) if v == i + 1 => {
                ops.launches.fetch_add(1, Relaxed);
            }
            Ok(v) => errs.fail(
                "lazy mismatch",
                format!("launch {i}: y = {v}, want {}", i + 1),
            ),
            Err(e) => errs.fail("lazy error", e),
        }
    }
}

/// Fresh VMs shut down while three threads submit to them.
fn shutdown_cycles(stop: &AtomicBool, ops: &Ops, errs: &Errors) {
    let mut cycle = 0u64;
    while !stop.load(Relaxed) {
        cycle += 1;
        // A graph serves one VM: a fresh one per VM.
        let graph = Arc::new(plus_one());
        let config = if cycle.is_multiple_of(3) {
            Config::single_thread()
        } else {
            Config::default()
        };
        let vm = Arc::new(VirtualMachine::new(config).expect("VM starts"));
        let (submitted, finished) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let refused = Arc::new(AtomicU64::new(0));
        let unexpected = Arc::new(Mutex::new(Vec::<String>::new()));
        let workers: Vec<_> = (0..3)
            .map(|w| {
                let (vm, graph) = (vm.clone(), graph.clone());
                let (submitted, finished, refused, unexpected) = (
                    submitted.clone(),
                    finished.clone(),
                    refused.clone(),
                    unexpected.clone(),
                );
                thread::spawn(move || {
                    let (t, y) = match (vm.new_tensor(8), vm.new_tensor(8)) {
                        (Ok(t), Ok(y)) => (t, y),
                        _ => return, // shut down before the first submission
                    };
                    let s = vm.default_stream();
                    for step in 0.. {
                        submitted.fetch_add(1, Relaxed);
                        let r = match (w + step) % 3 {
                            0 => vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] += 1)),
                            1 => read_u64(&vm, &t).map(drop),
                            _ => vm.run(|b| b.launch_lazy_job(&[&t], &[&y], &[], graph.lazy())),
                        };
                        match r {
                            Ok(()) => {
                                finished.fetch_add(1, Relaxed);
                            }
                            Err(Error::ShutDown) => {
                                refused.fetch_add(1, Relaxed);
                                return;
                            }
                            Err(e) => {
                                unexpected.lock().unwrap().push(e.to_string());
                                return;
                            }
                        }
                    }
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(1 + cycle % 7));
        if let Err(e) = vm.shutdown() {
            errs.fail("shutdown error", e);
        }
        for w in workers {
            if w.join().is_err() {
                errs.fail("shutdown submitter panicked", "");
            }
        }
        for e in unexpected.lock().unwrap().iter() {
            errs.fail("shutdown: unexpected error", e);
        }
        let (s, f, r) = (
            submitted.load(Relaxed),
            finished.load(Relaxed),
            refused.load(Relaxed),
        );
        if f + r + unexpected.lock().unwrap().len() as u64 != s {
            errs.fail(
                "shutdown count",
                format!("{f} ran + {r} refused != {s} submitted"),
            );
        }
        ops.instructions.fetch_add(f, Relaxed);
        ops.refused.fetch_add(r, Relaxed);
        ops.shutdown_cycles.fetch_add(1, Relaxed);
    }
}

fn parse_args() -> (Duration, Duration) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut run = Duration::from_secs(60);
    let mut report = None;
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).and_then(|v| v.parse::<f64>().ok());
        match (args[i].as_str(), value()) {
            ("--minutes", Some(v)) => run = Duration::from_secs_f64(v * 60.0),
            ("--seconds", Some(v)) => run = Duration::from_secs_f64(v),
            ("--report", Some(v)) => report = Some(Duration::from_secs_f64(v)),
            (a, _) => {
                eprintln!("usage: soak [--minutes M | --seconds S] [--report S]  (got {a})");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    let report = report.unwrap_or_else(|| (run / 4).min(Duration::from_secs(60)));
    (run, report.max(Duration::from_millis(100)))
}

fn main() {
    let (run, report) = parse_args();
    silence_planned_panics();
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(Ops::default());
    let errs = Arc::new(Errors::default());
    let vm = Arc::new(VirtualMachine::new(Config::default()).expect("VM starts"));
    println!("soak: {run:?}, a report every {report:?}");

    let mut loads = Vec::new();
    for (i, config) in [Config::default(), Config::single_thread()]
        .into_iter()
        .enumerate()
    {
        let (stop, ops, errs) = (stop.clone(), ops.clone(), errs.clone());
        loads.push(thread::spawn(move || {
            equivalence(config, (i as u64) << 40, &stop, &ops, &errs)
        }));
    }
    {
        let (vm, stop, ops, errs) = (vm.clone(), stop.clone(), ops.clone(), errs.clone());
        loads.push(thread::spawn(move || {
            stream_and_read(&vm, &stop, &ops, &errs)
        }));
    }
    {
        let (vm, stop, ops, errs) = (vm.clone(), stop.clone(), ops.clone(), errs.clone());
        loads.push(thread::spawn(move || lazy(&vm, &stop, &ops, &errs)));
    }
    {
        let (stop, ops, errs) = (stop.clone(), ops.clone(), errs.clone());
        loads.push(thread::spawn(move || shutdown_cycles(&stop, &ops, &errs)));
    }

    let start = Instant::now();
    let mut last = (start, [0u64; 6]);
    let snapshot = |o: &Ops| {
        [
            &o.programs,
            &o.instructions,
            &o.reads,
            &o.launches,
            &o.shutdown_cycles,
            &o.refused,
        ]
        .map(|a| a.load(Relaxed))
    };
    while start.elapsed() < run && !errs.fatal.load(Relaxed) {
        thread::sleep(report.min(run.saturating_sub(start.elapsed())));
        let now = (Instant::now(), snapshot(&ops));
        let secs = now.0.duration_since(last.0).as_secs_f64().max(1e-9);
        let rate = |k: usize| (now.1[k] - last.1[k]) as f64 / secs;
        let live = vm.debug_counters();
        println!(
            "[{:>6.0} s] per second: {:.0} programs, {:.0} instructions, {:.0} reads, {:.0} launches, \
             {:.1} shutdown cycles ({:.0} submissions refused); errors {:?}; live: {} instructions, \
             {} accesses, {} edges, {} flying",
            start.elapsed().as_secs_f64(),
            rate(0),
            rate(1),
            rate(2),
            rate(3),
            rate(4),
            rate(5),
            errs.by_kind.lock().unwrap(),
            live.instructions,
            live.accesses,
            live.edges,
            live.flying,
        );
        last = now;
    }
    stop.store(true, Relaxed);
    for l in loads {
        if l.join().is_err() {
            errs.fail("load panicked", "");
        }
    }
    if let Err(e) = vm.sync() {
        errs.fail("final sync", e);
    }
    let live = vm.debug_counters();
    let t = snapshot(&ops);
    println!(
        "soak: {:.0} s: {} programs, {} instructions, {} reads, {} launches, {} shutdown cycles \
         ({} refused); errors {:?}; live after the loads stopped: {live:?}",
        start.elapsed().as_secs_f64(),
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
        t[5],
        errs.by_kind.lock().unwrap()
    );
    if live.instructions != 0 || live.accesses != 0 || live.edges != 0 {
        errs.fail("live objects after the loads stopped", format!("{live:?}"));
    }
    if errs.fatal.load(Relaxed) {
        std::process::exit(1);
    }
}
