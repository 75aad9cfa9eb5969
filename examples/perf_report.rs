//! Every performance figure of issue 6, measured once, each against its baseline in the
//! same run (absolute numbers drift with the machine and its load; ratios much less).
//!
//! Prints a markdown table, then one line per figure: `RATIO <name> <value>` for ratios
//! and `FIGURE <name> <value> <unit>` for the rest. Runs in under a minute:
//! `cargo run --release --example perf_report` (`-- --quick` for a shorter smoke run;
//! `-- warm cold inline throughput allocs cpu caller` to run only some sections).
//! VM settings come from [`Config::from_env`] (`IVM_*`), with the overrides each scenario
//! states.
//!
//! | figure | what |
//! |---|---|
//! | `warm_read_vs_spin_floor` | p50 of 20 000 back-to-back 8-byte `read_small` done by the worker (`inline_sync_access` off; worker within its poll window, woken by a kernel every 500 reads; nothing in flight, so through its express lane, `model/express.rs`), over the p50 of a two-thread spin ping-pong round trip, interleaved in 4 chunks |
//! | `warm_read_p99_us` | p99 of those reads |
//! | `warm_read_vs_channel_polling` | (extra) the same p50 over a crossbeam request/response round trip with a polling worker, same chunks |
//! | `cold_read_vs_futex_wake` | p50 of a read after the VM sat idle 10 ms (every VM thread parked; default config: nothing is in flight, so the caller runs the read itself, no wake), over the p50 of a futex wake (from just before the wake call to the woken thread running) after 10 ms asleep; 200 interleaved samples each. `cold_read_worker_vs_futex_wake` reports the same with `inline_sync_access` off (the worker path: the read is queued to the sleeping worker, and its caller runs it without waking it) |
//! | `inline_read_ns` | p50 of back-to-back reads with nothing in flight, run inline by the caller (default config) |
//! | `instr_per_s` | instructions each reading one and writing another of 8 tensors on one stream, `run` batches of 64, until `sync()` returns |
//! | `instr_vs_channel_bound` | `instr_per_s` over one worker running boxed 32-byte closures sent over a crossbeam channel, same count, same run |
//! | `instr_per_s_single` | as `instr_per_s` with one instruction per `run` |
//! | `allocs_per_read` | allocations per steady-state sync read/write (process-wide counting allocator) |
//! | `allocs_per_instr` | allocations per steady-state pooled instruction: `call` with a plain fn and with a 64-byte closure, touch, release, sync access, `sync()` |
//! | `idle_cpu_pct` | CPU of the VM's threads (`/proc/self/task/*/schedstat`) over 5 s idle, % of one core |
//! | `busy_kernel_cpu_pct` | the same plus the waiting caller, over a 5 s kernel that sleeps |
//! | `caller_work_ratio` | the caller's compute rate while the VM streams instructions for it, over its rate with the VM idle |

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded};
use ivm::ivm_std::{Config, Device, Stream, StreamId, Tensor, VirtualMachine};

mod common;
use common::{FutexBaseline, cpu_between, my_tid, thread_cpu};

// ---- counting allocator ------------------------------------------------------------------

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to `System`, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs_during(f: impl FnOnce()) -> usize {
    ALLOCS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCS.load(Ordering::SeqCst)
}

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

// ---- 1. warm reads -------------------------------------------------------------------------

fn warm_reads(rep: &mut Report, quick: bool) {
    let per_chunk = if quick { 1_000 } else { 5_000 };
    let cfg = config().with_inline_sync_access(false);
    let (vm, t) = vm_with_value(cfg, 0xABCD);
    // The worker sleeps after the ping-pongs between chunks; a read that finds it asleep
    // runs on its caller and leaves it asleep (ARCHITECTURE.md, "A wake left to the waiting
    // caller"). A kernel first wakes it, so that the reads measure the worker path, with
    // the worker within its poll window.
    // `sync()` would not do: a waiting caller runs the kernel itself while the worker is
    // still waking, and the worker, woken to an empty queue, sleeps again at once. So the
    // kernel raises a flag that this thread spins on, outside the VM.
    let s = vm.default_stream();
    let ran = Arc::new(AtomicBool::new(false));
    let wake_worker = || {
        ran.store(false, Ordering::Relaxed);
        let r = ran.clone();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |k| {
                k.output_u64(0)[0] = 0xABCD;
                // Release: the kernel's write before the flag (read below with Acquire).
                r.store(true, Ordering::Release);
            })
        })
        .expect("run");
        while !ran.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
    };
    wake_worker();
    for _ in 0..2_000 {
        black_box(read8(&vm, &t));
    }
    let ran_before = vm.stats().map_or(0, |s| s.caller_ran);
    let express_before = vm.debug_express_accesses();
    let (mut spin, mut warm, mut chan) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..4 {
        spin.extend(spin_pingpong(per_chunk));
        for k in 0..per_chunk {
            // Re-woken every 500 reads: a worker that went to sleep meanwhile (its caller
            // descheduled past the poll window) stays asleep while callers run its work,
            // and the rest of the chunk would time the caller, not the worker path.
            if k % 500 == 0 {
                wake_worker();
            }
            let s = Instant::now();
            black_box(read8(&vm, &t));
            warm.push(s.elapsed());
        }
        chan.extend(channel_pingpong(per_chunk));
    }
    let inline_before = vm.debug_inline_accesses();
    let inline_before = inline_before.0 + inline_before.1;
    let express = vm.debug_express_accesses() - express_before;
    // Measured reads that found the worker asleep anyway and ran on their caller.
    let on_caller = vm.stats().map_or(0, |s| s.caller_ran) - ran_before;
    let chan50 = pct(&mut chan, 0.5);
    let spin50 = pct(&mut spin, 0.5);
    let warm50 = pct(&mut warm, 0.5);
    let warm99 = pct(&mut warm, 0.99);
    assert_eq!(
        inline_before, 0,
        "inline accesses with inline_sync_access off"
    );
    vm.shutdown().expect("shutdown");
    println!(
        "warm reads: p50 {:.3} µs, p99 {:.2} µs; spin ping-pong p50 {:.3} µs; crossbeam request/response with a polling worker p50 {:.3} µs ({} samples each; {express} of the reads went through the worker's express lane, {on_caller} found the worker asleep and ran on their caller)",
        us(warm50),
        us(warm99),
        us(spin50),
        us(chan50),
        warm.len()
    );
    let r = warm50.as_secs_f64() / spin50.as_secs_f64();
    rep.ratio("warm_read_vs_spin_floor", r, "≤ 2.5", r <= 2.5);
    rep.figure(
        "warm_read_p99_us",
        us(warm99),
        "µs",
        "≤ 20",
        Some(us(warm99) <= 20.0),
    );
    rep.figure("spin_pingpong_p50_us", us(spin50), "µs", "(baseline)", None);
    let rc = warm50.as_secs_f64() / chan50.as_secs_f64();
    rep.ratio("warm_read_vs_channel_polling", rc, "(report)", rc <= 2.5);
}

/// `n` request/response round trips over two crossbeam channels with a worker that polls
/// (`try_recv` + spin-loop hint), answering 8 bytes (issue 3's baseline).
fn channel_pingpong(n: usize) -> Vec<Duration> {
    let (req_tx, req_rx) = bounded::<usize>(1);
    let (resp_tx, resp_rx) = bounded::<u64>(1);
    let worker = std::thread::spawn(move || {
        let data = [0xABCDu64; 2];
        loop {
            match req_rx.try_recv() {
                Ok(i) => {
                    if resp_tx.send(data[i]).is_err() {
                        return;
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            }
        }
    });
    let mut samples = Vec::with_capacity(n);
    for k in 0..n + 100 {
        let s = Instant::now();
        req_tx.send(black_box(0)).expect("worker");
        black_box(resp_rx.recv().expect("worker"));
        if k >= 100 {
            samples.push(s.elapsed());
        }
    }
    drop(req_tx);
    worker.join().expect("worker");
    samples
}

// ---- 2. cold reads -------------------------------------------------------------------------

fn cold_reads(rep: &mut Report, quick: bool) {
    let n = if quick { 40 } else { 200 };
    let idle = Duration::from_millis(10);
    let worker = config().with_inline_sync_access(false);
    let (vm, t) = vm_with_value(worker, 7);
    let ran0 = vm.stats().map_or(0, |s| s.caller_ran);
    let (vm_in, t_in) = vm_with_value(config(), 7);
    let (d0, i0) = vm_in.debug_inline_accesses();
    let base = FutexBaseline::new();
    let (mut cold, mut cold_inline, mut wake) = (Vec::new(), Vec::new(), Vec::new());
    for k in 1..=n as u32 {
        std::thread::sleep(idle);
        let s = Instant::now();
        black_box(read8(&vm, &t));
        cold.push(s.elapsed());
        std::thread::sleep(idle);
        wake.push(base.round(k));
        std::thread::sleep(idle);
        let s = Instant::now();
        black_box(read8(&vm_in, &t_in));
        cold_inline.push(s.elapsed());
    }
    drop(base);
    let on_caller = vm.stats().map_or(0, |s| s.caller_ran) - ran0;
    let (d1, i1) = vm_in.debug_inline_accesses();
    let inline_runs = (d1 - d0) + (i1 - i0);
    let c50 = pct(&mut cold, 0.5);
    let w50 = pct(&mut wake, 0.5);
    let i50 = pct(&mut cold_inline, 0.5);
    println!(
        "cold reads after {idle:?} idle: default config (inline: {inline_runs} of {n} ran in the caller, no wake) p50 {:.1} µs (p90 {:.1}); worker path ({on_caller} of {n} run by their caller, the worker left asleep) p50 {:.1} µs (p90 {:.1}); futex wake p50 {:.1} µs (p90 {:.1}); {n} samples each",
        us(i50),
        us(pct(&mut cold_inline, 0.9)),
        us(c50),
        us(pct(&mut cold, 0.9)),
        us(w50),
        us(pct(&mut wake, 0.9)),
    );
    vm.shutdown().expect("shutdown");
    vm_in.shutdown().expect("shutdown");
    // The headline: the default configuration, where a cold read finds nothing in flight
    // and runs in the caller (zero wakes on the critical path).
    let r = i50.as_secs_f64() / w50.as_secs_f64();
    rep.ratio("cold_read_vs_futex_wake", r, "≤ 1.2", r <= 1.2);
    let rw = c50.as_secs_f64() / w50.as_secs_f64();
    rep.ratio(
        "cold_read_worker_vs_futex_wake",
        rw,
        "(report: inline off, queued to the sleeping worker)",
        rw <= 1.2,
    );
    rep.figure("futex_wake_p50_us", us(w50), "µs", "(baseline)", None);
}

// ---- 3. inline reads -----------------------------------------------------------------------

fn inline_reads(rep: &mut Report, quick: bool) {
    let n = if quick { 5_000 } else { 20_000 };
    let (vm, t) = vm_with_value(config(), 3);
    for _ in 0..1_000 {
        black_box(read8(&vm, &t));
    }
    let (d0, i0) = vm.debug_inline_accesses();
    let mut s = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        black_box(read8(&vm, &t));
        s.push(t0.elapsed());
    }
    let (d1, i1) = vm.debug_inline_accesses();
    let inline = (d1 - d0) + (i1 - i0);
    vm.shutdown().expect("shutdown");
    let p50 = pct(&mut s, 0.5).as_nanos() as f64;
    println!("inline reads: p50 {p50:.0} ns; {inline} of {n} ran inline");
    rep.figure(
        "inline_read_ns",
        p50,
        "ns",
        "< 1000 (stretch)",
        Some(p50 < 1000.0),
    );
}

// ---- 4. throughput -------------------------------------------------------------------------

const TENSORS: usize = 8;

struct Chain {
    vm: VirtualMachine,
    streams: Vec<Stream>,
    t: Vec<Tensor>,
}

impl Chain {
    fn new(streams: u32) -> Self {
        let vm = VirtualMachine::new(config()).expect("VM starts");
        let streams = (0..streams)
            .map(|i| {
                vm.stream(StreamId::compute(Device::CPU, i))
                    .expect("stream")
            })
            .collect();
        let t = (0..TENSORS)
            .map(|_| vm.new_tensor(8).expect("tensor"))
            .collect();
        Self { vm, streams, t }
    }

    /// `n` instructions (instruction `i` reads tensor `i % 8`, writes `(i + 1) % 8`, on
    /// stream `i % streams`) in `run`s of `batch`, until `sync()`; instructions/s.
    fn rate(&self, n: usize, batch: usize) -> f64 {
        let start = Instant::now();
        let mut i = 0usize;
        while i < n {
            self.vm
                .run(|b| {
                    for _ in 0..batch.min(n - i) {
                        let s = &self.streams[i % self.streams.len()];
                        b.call(
                            s,
                            &[&self.t[i % TENSORS]],
                            &[&self.t[(i + 1) % TENSORS]],
                            |_k| {},
                        )?;
                        i += 1;
                    }
                    Ok(())
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
        n as f64 / start.elapsed().as_secs_f64()
    }

    /// Fan-out/fan-in groups: a source writes `a`; four kernels on alternating streams
    /// read it and write `b[k]`; a sink reads the four and writes `c`. Instructions/s.
    fn fan_rate(&self, groups: usize) -> f64 {
        let (a, b, c) = (&self.t[0], &self.t[1..5], &self.t[5]);
        let start = Instant::now();
        for g in 0..groups {
            self.vm
                .run(|bl| {
                    let s0 = &self.streams[0];
                    bl.call(s0, &[c], &[a], move |k| k.output_u64(0)[0] = g as u64)?;
                    for (k, bk) in b.iter().enumerate() {
                        let s = &self.streams[k % self.streams.len()];
                        bl.call(s, &[a], &[bk], |kc| {
                            let x = kc.input_u64(0)[0];
                            kc.output_u64(0)[0] = x + 1;
                        })?;
                    }
                    let s1 = &self.streams[1 % self.streams.len()];
                    bl.call(s1, &[&b[0], &b[1], &b[2], &b[3]], &[c], |kc| {
                        let sum = (0..4).map(|i| kc.input_u64(i)[0]).sum::<u64>();
                        kc.output_u64(0)[0] = sum;
                    })
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
        (groups * 6) as f64 / start.elapsed().as_secs_f64()
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

/// One worker running `n` boxed closures capturing 32 bytes, sent over an unbounded
/// crossbeam channel, then one answering closure; closures/s.
fn channel_bound(n: usize) -> f64 {
    type Job = Box<dyn FnOnce() + Send>;
    let (jobs, rx) = unbounded::<Job>();
    let (done_tx, done_rx) = bounded::<()>(1);
    let worker = std::thread::spawn(move || {
        for job in rx {
            job();
        }
    });
    let start = Instant::now();
    for i in 0..n as u64 {
        let captured = [i, i ^ 1, i ^ 2, i ^ 3];
        jobs.send(Box::new(move || {
            black_box(captured);
        }))
        .expect("worker");
    }
    let d = done_tx.clone();
    jobs.send(Box::new(move || d.send(()).expect("caller")))
        .expect("worker");
    done_rx.recv().expect("answer");
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(jobs);
    worker.join().expect("worker");
    rate
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    v[v.len() / 2]
}

fn throughput(rep: &mut Report, quick: bool) {
    let n = if quick { 20_000 } else { 200_000 };
    let rounds = if quick { 1 } else { 3 };
    let one = Chain::new(1);
    let two = Chain::new(2);
    one.rate(4_096, 64);
    two.rate(4_096, 64);
    let (mut vm1, mut chan, mut single, mut chain2, mut fan) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        vm1.push(one.rate(n, 64));
        chan.push(channel_bound(n));
        single.push(one.rate(n / 4, 1));
        chain2.push(two.rate(n / 4, 64));
        fan.push(two.fan_rate(n / 24));
    }
    drop((one, two));
    let (vm1, chan, single, chain2, fan) = (
        median(vm1),
        median(chan),
        median(single),
        median(chain2),
        median(fan),
    );
    println!(
        "throughput (median of {rounds}): one stream {vm1:.0}/s, channel bound {chan:.0}/s, one per run {single:.0}/s, two-stream chain {chain2:.0}/s, fan-out/fan-in {fan:.0}/s"
    );
    rep.figure(
        "instr_per_s",
        vm1,
        "instr/s",
        "≥ 2 000 000",
        Some(vm1 >= 2e6),
    );
    let r = vm1 / chan;
    rep.ratio("instr_vs_channel_bound", r, "≥ 0.25", r >= 0.25);
    rep.figure(
        "instr_per_s_single",
        single,
        "instr/s",
        "≥ 500 000",
        Some(single >= 5e5),
    );
    rep.figure(
        "channel_bound_per_s",
        chan,
        "closures/s",
        "(baseline)",
        None,
    );
    rep.figure(
        "two_stream_chain_per_s",
        chain2,
        "instr/s",
        "(report)",
        None,
    );
    rep.figure("fan_out_fan_in_per_s", fan, "instr/s", "(report)", None);
}

// ---- 5. allocations ------------------------------------------------------------------------

/// Makes sure every thread of `vm` has started (a thread allocates its own bookkeeping
/// when it first runs, which with callers driving the engine can be late).
fn start_threads(vm: &VirtualMachine) {
    let t = vm.new_tensor(8).expect("tensor");
    let s = vm.default_stream();
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
        .expect("run");
    vm.sync().expect("sync");
    vm.blocking_run_probe(|| true).expect("probe");
}

fn allocations(rep: &mut Report) {
    // Sync reads/writes: multi-thread (worker path and inline) and single-thread mode.
    let mut reads = 0;
    let mut per_read_total = 0;
    for cfg in [
        config().with_inline_sync_access(false),
        config(),
        Config::single_thread(),
    ] {
        let vm = VirtualMachine::new(cfg).expect("VM starts");
        let t = vm.new_tensor(16).expect("tensor");
        start_threads(&vm);
        let mut buf = [0u8; 8];
        for i in 0..500u64 {
            vm.write_small(&t, 0, &i.to_ne_bytes()).expect("write");
            vm.read_small(&t, 0, &mut buf).expect("read");
        }
        let n = allocs_during(|| {
            for i in 0..2_000u64 {
                vm.write_small(&t, 0, &i.to_ne_bytes()).expect("write");
                vm.read_small(&t, 0, &mut buf).expect("read");
            }
        });
        per_read_total += n;
        reads += 4_000;
        drop(t);
        vm.shutdown().expect("shutdown");
    }
    // Pooled instructions: call (plain fn, 64-byte closure), touch, release, sync access,
    // sync().
    fn plain(k: &mut ivm::ivm_std::KernelCtx<'_>) {
        k.output_u64(0)[0] += 1;
    }
    let vm = VirtualMachine::new(config()).expect("VM starts");
    let s = vm.default_stream();
    let t: Vec<Tensor> = (0..4).map(|_| vm.new_tensor(8).expect("tensor")).collect();
    let mut instrs = 0;
    let round = |vm: &VirtualMachine, spare: &mut Vec<Tensor>, count: bool| {
        let mut n = 0;
        vm.run(|b| {
            for i in 0..32u64 {
                b.call(&s, &[&t[0]], &[&t[1]], plain)?;
                let cap = [i; 8];
                b.call(&s, &[&t[1]], &[&t[2]], move |k| {
                    k.output_u64(0)[0] = cap.iter().sum::<u64>();
                })?;
                b.touch_tensors(&s, &[&t[2], &t[3]])?;
                n += 3;
            }
            if let Some(x) = spare.pop() {
                b.release_tensor(x)?;
                n += 1;
            }
            Ok(())
        })
        .expect("run");
        let mut buf = [0u8; 8];
        vm.read_small(&t[2], 0, &mut buf).expect("read");
        vm.sync().expect("sync");
        if count { n + 2 } else { 0 }
    };
    let mut spare: Vec<Tensor> = (0..600)
        .map(|_| vm.new_tensor(8).expect("tensor"))
        .collect();
    start_threads(&vm);
    for _ in 0..300 {
        round(&vm, &mut spare, false);
    }
    let per_instr_total = allocs_during(|| {
        for _ in 0..200 {
            instrs += round(&vm, &mut spare, true);
        }
    });
    drop(spare);
    drop(t);
    vm.shutdown().expect("shutdown");
    let per_read = per_read_total as f64 / reads as f64;
    let per_instr = per_instr_total as f64 / instrs as f64;
    println!(
        "allocations: {per_read_total} in {reads} sync accesses, {per_instr_total} in {instrs} pooled instructions"
    );
    rep.figure(
        "allocs_per_read",
        per_read,
        "",
        "= 0",
        Some(per_read == 0.0),
    );
    rep.figure(
        "allocs_per_instr",
        per_instr,
        "",
        "= 0",
        Some(per_instr == 0.0),
    );
}

// ---- 6. CPU use ----------------------------------------------------------------------------

fn vm_prefix() -> String {
    // The newest VM's threads are named `ivm<id>-...` (`comm` keeps 15 bytes: the suffix
    // may be cut, the prefix is not).
    let id = thread_cpu()
        .into_values()
        .filter_map(|(n, _)| {
            n.strip_prefix("ivm")?
                .split('-')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
        .expect("a VM thread");
    format!("ivm{id}-")
}

fn cpu_use(rep: &mut Report, quick: bool) {
    if std::fs::read_dir("/proc/self/task").is_err() {
        println!("cpu use: /proc/self/task unavailable, skipped");
        return;
    }
    let period = if quick {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    };
    let (vm, t) = vm_with_value(config(), 1);
    let s = vm.default_stream();
    for k in 0..100u64 {
        vm.run(|b| b.call(&s, &[], &[&t], move |c| c.output_u64(0)[0] = k))
            .expect("run");
        black_box(read8(&vm, &t));
    }
    start_threads(&vm);
    let prefix = vm_prefix();
    let tid = my_tid();
    // Idle (starting right after a read: winding down counts).
    black_box(read8(&vm, &t));
    let (a, t0) = (thread_cpu(), Instant::now());
    std::thread::sleep(period);
    let (b, wall) = (thread_cpu(), t0.elapsed());
    let (idle_ns, _, _) = cpu_between(&a, &b, &prefix, tid);
    let idle = idle_ns as f64 / wall.as_nanos() as f64 * 100.0;
    // One kernel sleeps for the period; the caller waits for it with a sync read.
    let (a, t0) = (thread_cpu(), Instant::now());
    vm.run(|bl| {
        bl.call(&s, &[], &[&t], move |c| {
            std::thread::sleep(period);
            c.output_u64(0)[0] = 9;
        })
    })
    .expect("run");
    assert_eq!(read8(&vm, &t), 9);
    let (b, wall) = (thread_cpu(), t0.elapsed());
    let (vm_ns, me_ns, _) = cpu_between(&a, &b, &prefix, tid);
    // The kernel itself sleeps (no CPU); whatever the VM threads used is overhead.
    let busy = (vm_ns + me_ns) as f64 / wall.as_nanos() as f64 * 100.0;
    println!(
        "cpu: idle {idle:.4} % over {:.1} s; busy kernel {busy:.4} % (VM threads {:.1} µs, caller {:.1} µs)",
        period.as_secs_f64(),
        vm_ns as f64 / 1e3,
        me_ns as f64 / 1e3
    );
    vm.shutdown().expect("shutdown");
    rep.figure("idle_cpu_pct", idle, "%", "≤ 0.5", Some(idle <= 0.5));
    rep.figure("busy_kernel_cpu_pct", busy, "%", "≤ 2", Some(busy <= 2.0));
}

// ---- 7. caller work ------------------------------------------------------------------------

/// A fixed compute loop (`rounds` xorshift steps; 4 000 ≈ 10 µs): the caller's own work.
fn work_chunk(seed: u64, rounds: u32) -> u64 {
    let mut x = seed | 1;
    for _ in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    x
}

/// Work chunks per second of time spent in them, over `dur`; with `vm`, a `run` of 16
/// kernels, each 1/16 of a chunk's work, is submitted before each chunk, so the VM's
/// worker is about as busy as the caller (the VM streams them meanwhile).
fn work_rate(vm: Option<&Chain>, dur: Duration) -> (f64, f64) {
    let start = Instant::now();
    let (mut chunks, mut in_work) = (0u64, Duration::ZERO);
    let mut acc = 0u64;
    let mut i = 0usize;
    while start.elapsed() < dur {
        if let Some(c) = vm {
            c.vm.run(|b| {
                for _ in 0..16 {
                    b.call(
                        &c.streams[0],
                        &[&c.t[i % TENSORS]],
                        &[&c.t[(i + 1) % TENSORS]],
                        |k| {
                            let x = k.input_u64(0)[0];
                            k.output_u64(0)[0] = work_chunk(x, 250) & 0xFF;
                        },
                    )?;
                    i += 1;
                }
                Ok(())
            })
            .expect("run");
        }
        let t = Instant::now();
        acc = acc.wrapping_add(work_chunk(chunks, 4_000));
        in_work += t.elapsed();
        chunks += 1;
    }
    black_box(acc);
    if let Some(c) = vm {
        c.vm.sync().expect("sync");
    }
    (
        chunks as f64 / in_work.as_secs_f64(),
        in_work.as_secs_f64() / start.elapsed().as_secs_f64(),
    )
}

fn caller_work(rep: &mut Report, quick: bool) {
    let dur = if quick {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(1)
    };
    let c = Chain::new(1);
    c.rate(4_096, 64);
    let (mut idle, mut busy, mut share) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        idle.push(work_rate(None, dur).0);
        let (r, f) = work_rate(Some(&c), dur);
        busy.push(r);
        share.push(f);
    }
    let (idle, busy, share) = (median(idle), median(busy), median(share));
    drop(c);
    let r = busy / idle;
    println!(
        "caller work: {busy:.0} chunks/s with the VM streaming ({:.0} % of the caller's wall time in its own work), {idle:.0} chunks/s with the VM idle",
        share * 100.0
    );
    rep.ratio("caller_work_ratio", r, "≥ 0.8", r >= 0.8);
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
    // Sections named on the command line (`warm cold inline throughput allocs cpu caller`)
    // run alone; none named: all.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
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
