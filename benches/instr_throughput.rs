//! No-op instruction throughput against a boxed-closure channel bound, in one criterion
//! group (one run, comparable figures).
//!
//! One iteration = [`PER_ITER`] instructions submitted in `run` batches of [`BATCH`], then
//! `sync()` (timed until it returns). Each instruction is a no-op kernel that reads tensor
//! `i % 8` and writes tensor `(i + 1) % 8` of 8 one-word tensors, so every instruction
//! reads the previous one's output:
//!
//! * `vm_one_stream`: all on the default stream (worker thread 0);
//! * `vm_one_per_run`: as `vm_one_stream` with one instruction per `run`;
//! * `vm_two_stream_chain`: instruction `i` on stream `i % 2` (compute streams on worker
//!   threads 0 and 1), so each one reads the previous one's output *on the other stream*;
//! * `vm_fan_out_fan_in`: groups of 6: a source on stream 0 writes `a`, four kernels on
//!   alternating streams read `a` and write `b[k]`, a sink on stream 1 reads the four and
//!   writes `c` (which the next group's source reads);
//! * `channel_closures`: the bound: [`PER_ITER`] boxed closures capturing 32 bytes sent
//!   over an unbounded crossbeam channel to one worker (blocking `recv`), then a last
//!   closure that answers on a second channel (the "sync").
//!
//! Throughput is reported in elements (instructions or closures) per second. After the
//! criterion group, `main` times each scenario itself (interleaved rounds) and prints
//! instructions/s and `RATIO` lines against the channel bound. VM settings come from
//! [`Config::from_env`] (`IVM_*`). Run with
//! `cargo bench --bench instr_throughput -- --measurement-time 2 --warm-up-time 1`.

use std::hint::black_box;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use ivm::ivm_std::{Config, Device, Stream, StreamId, Tensor, VirtualMachine};

/// Instructions per `run`.
const BATCH: usize = 64;
/// Instructions per timed iteration (then one `sync()`).
const PER_ITER: usize = 64 * BATCH;
/// Tensors the instructions cycle through.
const TENSORS: usize = 8;

trait Scenario {
    /// Submits [`PER_ITER`] items and waits until all have run.
    fn iteration(&mut self);
}

struct VmChain {
    vm: VirtualMachine,
    streams: Vec<Stream>,
    tensors: Vec<Tensor>,
    /// Instructions per `run`.
    batch: usize,
    /// Fan-out/fan-in groups instead of a chain.
    fan: bool,
}

impl VmChain {
    fn new(two_streams: bool, batch: usize, fan: bool) -> Self {
        let vm = VirtualMachine::new(Config::from_env().expect("IVM_* variables parse"))
            .expect("VM starts");
        let mut streams = vec![vm.default_stream()];
        if two_streams {
            streams.push(
                vm.stream(StreamId::compute(Device::CPU, 1))
                    .expect("second stream"),
            );
        }
        let tensors = (0..TENSORS)
            .map(|_| vm.new_tensor(8).expect("tensor"))
            .collect();
        Self {
            vm,
            streams,
            tensors,
            batch,
            fan,
        }
    }

    /// [`PER_ITER`] instructions as fan-out/fan-in groups of 6.
    fn fan_iteration(&mut self) {
        let t = &self.tensors;
        let (a, b, c) = (&t[0], &t[1..5], &t[5]);
        let s = &self.streams;
        for g in 0..PER_ITER / 6 {
            self.vm
                .run(|bl| {
                    bl.call(&s[0], &[c], &[a], move |k| k.output_u64(0)[0] = g as u64)?;
                    for (k, bk) in b.iter().enumerate() {
                        bl.call(&s[k % s.len()], &[a], &[bk], |kc| {
                            let x = kc.input_u64(0)[0];
                            kc.output_u64(0)[0] = x + 1;
                        })?;
                    }
                    bl.call(&s[1 % s.len()], &[&b[0], &b[1], &b[2], &b[3]], &[c], |kc| {
                        let sum = (0..4).map(|i| kc.input_u64(i)[0]).sum::<u64>();
                        kc.output_u64(0)[0] = sum;
                    })
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
    }
}

impl Scenario for VmChain {
    fn iteration(&mut self) {
        if self.fan {
            return self.fan_iteration();
        }
        let (streams, t, batch) = (&self.streams, &self.tensors, self.batch);
        let mut i = 0usize;
        for _ in 0..PER_ITER / batch {
            self.vm
                .run(|b| {
                    for _ in 0..batch {
                        let s = &streams[i % streams.len()];
                        b.call(s, &[&t[i % TENSORS]], &[&t[(i + 1) % TENSORS]], |_k| {})?;
                        i += 1;
                    }
                    Ok(())
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
    }
}

impl Drop for VmChain {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct ChannelClosures {
    jobs: Option<Sender<Job>>,
    done_tx: Sender<()>,
    done_rx: Receiver<()>,
    worker: Option<JoinHandle<()>>,
}

impl ChannelClosures {
    fn new() -> Self {
        let (jobs, rx) = unbounded::<Job>();
        let (done_tx, done_rx) = bounded(1);
        let worker = std::thread::Builder::new()
            .name("chan-closures".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("spawn worker");
        Self {
            jobs: Some(jobs),
            done_tx,
            done_rx,
            worker: Some(worker),
        }
    }
}

impl Scenario for ChannelClosures {
    fn iteration(&mut self) {
        let jobs = self.jobs.as_ref().expect("worker alive");
        for i in 0..PER_ITER as u64 {
            // 32 captured bytes, like a small kernel closure's arguments.
            let captured = [i, i ^ 1, i ^ 2, i ^ 3];
            jobs.send(Box::new(move || {
                black_box(captured);
            }))
            .expect("worker alive");
        }
        let done = self.done_tx.clone();
        jobs.send(Box::new(move || done.send(()).expect("caller waits")))
            .expect("worker alive");
        self.done_rx.recv().expect("worker answers");
    }
}

impl Drop for ChannelClosures {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            w.join().expect("worker exits cleanly");
        }
    }
}

const NAMES: [&str; 5] = [
    "vm_one_stream",
    "vm_one_per_run",
    "vm_two_stream_chain",
    "vm_fan_out_fan_in",
    "channel_closures",
];

/// The baseline's index in [`NAMES`].
const BOUND: usize = NAMES.len() - 1;

fn make(name: &str) -> Box<dyn Scenario> {
    match name {
        "vm_one_stream" => Box::new(VmChain::new(false, BATCH, false)),
        "vm_one_per_run" => Box::new(VmChain::new(false, 1, false)),
        "vm_two_stream_chain" => Box::new(VmChain::new(true, BATCH, false)),
        "vm_fan_out_fan_in" => Box::new(VmChain::new(true, BATCH, true)),
        "channel_closures" => Box::new(ChannelClosures::new()),
        _ => unreachable!("unknown scenario {name}"),
    }
}

fn bench_instr(c: &mut Criterion) {
    let mut group = c.benchmark_group("instr_throughput");
    group.throughput(Throughput::Elements(PER_ITER as u64));
    group.sample_size(20);
    for name in NAMES {
        // Alive only while its own benchmark runs.
        let mut fixture: Option<Box<dyn Scenario>> = None;
        group.bench_function(name, |b| {
            let s = fixture.get_or_insert_with(|| make(name));
            b.iter(|| s.iteration());
        });
        drop(fixture);
    }
    group.finish();
}

criterion_group!(benches, bench_instr);

/// Items per second over `iters` iterations.
fn rate(s: &mut dyn Scenario, iters: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..iters {
        s.iteration();
    }
    (iters * PER_ITER) as f64 / t.elapsed().as_secs_f64()
}

/// Own quick timing after criterion: 3 interleaved rounds of ~0.3 s per scenario, the
/// median rate.
fn ratio_summary() {
    const ROUNDS: usize = 3;
    let mut rates: Vec<Vec<f64>> = vec![Vec::with_capacity(ROUNDS); NAMES.len()];
    for _ in 0..ROUNDS {
        for (i, name) in NAMES.iter().enumerate() {
            let mut s = make(name);
            // Warm-up, and size the timed part to ~0.3 s.
            let t = Instant::now();
            s.iteration();
            let one = t.elapsed().max(Duration::from_micros(1));
            let iters = (Duration::from_millis(300).as_secs_f64() / one.as_secs_f64())
                .clamp(3.0, 2_000.0) as usize;
            rates[i].push(rate(s.as_mut(), iters));
        }
    }
    let med: Vec<f64> = rates
        .iter_mut()
        .map(|r| {
            r.sort_unstable_by(f64::total_cmp);
            r[ROUNDS / 2]
        })
        .collect();
    println!(
        "\ninstr_throughput own timing (median of {ROUNDS} rounds; {PER_ITER} per iteration, run batches of {BATCH}, until sync):"
    );
    for (name, r) in NAMES.iter().zip(&med) {
        println!("  {name:<20} {:10.0} /s", r);
    }
    let bound = med[BOUND];
    for (v, r) in med.iter().enumerate().take(BOUND) {
        println!("RATIO {}/{} {:.3}", NAMES[v], NAMES[BOUND], r / bound);
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // See benches/sync_read.rs: only under `cargo bench`.
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--list") {
        ratio_summary();
    }
}
