//! Sync small-memory read round trip on an otherwise idle VM, against crossbeam-channel
//! request/response baselines, all in one criterion group (one run, comparable figures).
//!
//! * `vm_inline`: `read_small` of 8 bytes, multi-thread mode, default config:
//!   nothing is in flight, so the caller runs the read itself (`inline_sync_access`);
//! * `vm_skip`: the same with `inline_sync_access` off, so the read is done by the default
//!   stream's worker: through its express lane while it polls (nothing in flight: no
//!   instruction), else as an instruction (which its caller runs itself if the worker
//!   sleeps); notify-skip on (`skip_blocking_threshold` = 2, the default: the caller
//!   spins from the start), which only the instruction path uses;
//! * `vm_no_skip`: the worker path with notify-skip off (`skip_blocking_threshold` = 0:
//!   on the instruction path the caller first blocks on its notifier until the worker
//!   starts the read);
//! * `spin_pingpong`: the floor: a two-thread round trip through one atomic, both sides
//!   spinning with a spin-loop hint;
//! * `channel_polling`: the caller sends a request over a crossbeam channel to a worker that
//!   polls with `try_recv` and answers 8 bytes over a second channel (`recv` in the caller);
//! * `channel_blocking`: the same with a worker that waits in a blocking `recv`.
//!
//! The VM's other settings come from [`Config::from_env`] (`IVM_*` variables; on a machine
//! with fewer than 4 hardware threads the spin windows default to zero). Every fixture is
//! created just before its benchmark and stopped right after, so no polling thread of one
//! scenario steals a core from the next.
//!
//! After the criterion group, `main` times each scenario once more itself (interleaved
//! rounds, per-call `Instant` samples) and prints p50s and one `RATIO` line per VM
//! variant against each baseline. Run with
//! `cargo bench --bench sync_read -- --measurement-time 2 --warm-up-time 1`.

use std::hint::black_box;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use crossbeam_channel::{Receiver, Sender, TryRecvError, bounded};
use ivm::ivm_std::{Config, Tensor, VirtualMachine};

/// One round-trip scenario: `round_trip` does one request and returns its 8 bytes.
trait Scenario {
    fn round_trip(&mut self) -> [u8; 8];
}

/// A VM with one 8-byte tensor holding a known value.
struct VmRead {
    vm: VirtualMachine,
    tensor: Tensor,
}

impl VmRead {
    fn new(skip: bool, inline: bool) -> Self {
        let mut config = Config::from_env().expect("IVM_* variables parse");
        config.skip_blocking_threshold = if skip { 2 } else { 0 };
        config.inline_sync_access = inline;
        let vm = VirtualMachine::new(config).expect("VM starts");
        let s = vm.default_stream();
        let tensor = vm.new_tensor(8).expect("tensor");
        vm.run(|b| b.call(&s, &[], &[&tensor], |k| k.output_u64(0)[0] = 0x1234_5678))
            .expect("run");
        vm.sync().expect("sync");
        let mut me = Self { vm, tensor };
        assert_eq!(u64::from_ne_bytes(me.round_trip()), 0x1234_5678);
        me
    }
}

impl Scenario for VmRead {
    fn round_trip(&mut self) -> [u8; 8] {
        let mut out = [0u8; 8];
        self.vm
            .read_small(&self.tensor, 0, &mut out)
            .expect("sync read");
        out
    }
}

impl Drop for VmRead {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

/// A worker thread answering 8-byte read requests over crossbeam channels.
struct ChannelRead {
    requests: Option<Sender<usize>>,
    responses: Receiver<[u8; 8]>,
    worker: Option<JoinHandle<()>>,
}

impl ChannelRead {
    fn new(polling: bool) -> Self {
        let (req_tx, req_rx) = bounded::<usize>(1);
        let (resp_tx, resp_rx) = bounded::<[u8; 8]>(1);
        let name = if polling {
            "chan-polling"
        } else {
            "chan-blocking"
        };
        let worker = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // The "tensor" the worker owns.
                let data = [0x1234_5678u64; 2];
                loop {
                    let offset = if polling {
                        match req_rx.try_recv() {
                            Ok(o) => o,
                            Err(TryRecvError::Empty) => {
                                std::hint::spin_loop();
                                continue;
                            }
                            Err(TryRecvError::Disconnected) => return,
                        }
                    } else {
                        match req_rx.recv() {
                            Ok(o) => o,
                            Err(_) => return,
                        }
                    };
                    if resp_tx.send(data[offset].to_ne_bytes()).is_err() {
                        return;
                    }
                }
            })
            .expect("spawn worker");
        Self {
            requests: Some(req_tx),
            responses: resp_rx,
            worker: Some(worker),
        }
    }
}

impl Scenario for ChannelRead {
    fn round_trip(&mut self) -> [u8; 8] {
        self.requests
            .as_ref()
            .expect("worker alive")
            .send(black_box(0))
            .expect("worker alive");
        self.responses.recv().expect("worker alive")
    }
}

impl Drop for ChannelRead {
    fn drop(&mut self) {
        // Disconnects the request channel: the worker returns.
        drop(self.requests.take());
        if let Some(w) = self.worker.take() {
            w.join().expect("worker exits cleanly");
        }
    }
}

/// Two threads passing a token through one atomic, both spinning (the floor).
struct SpinPingPong {
    flag: std::sync::Arc<std::sync::atomic::AtomicU64>,
    round: u64,
    peer: Option<JoinHandle<()>>,
}

impl SpinPingPong {
    /// The peer answers odd values with the next even one; `u64::MAX` stops it.
    fn new() -> Self {
        use std::sync::atomic::Ordering::{Acquire, Release};
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let f = flag.clone();
        let peer = std::thread::Builder::new()
            .name("spin-peer".into())
            .spawn(move || {
                let mut seen = 0;
                loop {
                    let v = f.load(Acquire);
                    if v == u64::MAX {
                        return;
                    }
                    if v != seen && v % 2 == 1 {
                        seen = v + 1;
                        f.store(seen, Release);
                    } else {
                        std::hint::spin_loop();
                    }
                }
            })
            .expect("spawn peer");
        Self {
            flag,
            round: 0,
            peer: Some(peer),
        }
    }
}

impl Scenario for SpinPingPong {
    fn round_trip(&mut self) -> [u8; 8] {
        use std::sync::atomic::Ordering::{Acquire, Release};
        self.round += 2;
        self.flag.store(self.round - 1, Release);
        while self.flag.load(Acquire) != self.round {
            std::hint::spin_loop();
        }
        self.round.to_ne_bytes()
    }
}

impl Drop for SpinPingPong {
    fn drop(&mut self) {
        self.flag
            .store(u64::MAX, std::sync::atomic::Ordering::Release);
        if let Some(p) = self.peer.take() {
            p.join().expect("peer exits cleanly");
        }
    }
}

const NAMES: [&str; 6] = [
    "vm_inline",
    "vm_skip",
    "vm_no_skip",
    "spin_pingpong",
    "channel_polling",
    "channel_blocking",
];

/// Scenarios before this index are VM variants; the rest are baselines.
const VM_VARIANTS: usize = 3;

fn make(name: &str) -> Box<dyn Scenario> {
    match name {
        "vm_inline" => Box::new(VmRead::new(true, true)),
        "vm_skip" => Box::new(VmRead::new(true, false)),
        "vm_no_skip" => Box::new(VmRead::new(false, false)),
        "spin_pingpong" => Box::new(SpinPingPong::new()),
        "channel_polling" => Box::new(ChannelRead::new(true)),
        "channel_blocking" => Box::new(ChannelRead::new(false)),
        _ => unreachable!("unknown scenario {name}"),
    }
}

fn bench_sync_read(c: &mut Criterion) {
    let mut group = c.benchmark_group("sync_read");
    for name in NAMES {
        // The fixture lives only while its own benchmark runs (criterion runs a benchmark
        // to completion inside `bench_function`; a filtered-out one never calls us).
        let mut fixture: Option<Box<dyn Scenario>> = None;
        group.bench_function(name, |b| {
            let s = fixture.get_or_insert_with(|| make(name));
            b.iter(|| black_box(s.round_trip()));
        });
        drop(fixture);
    }
    group.finish();
}

criterion_group!(benches, bench_sync_read);

/// p50 of `n` round trips, each timed on its own.
fn p50(s: &mut dyn Scenario, n: usize) -> Duration {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        black_box(s.round_trip());
        samples.push(t.elapsed());
    }
    samples.sort_unstable();
    samples[n / 2]
}

/// Own quick timing, after criterion: 3 interleaved rounds of 5 000 round trips per
/// scenario (one fixture alive at a time), the median of the rounds' p50s.
fn ratio_summary() {
    const ROUNDS: usize = 3;
    const N: usize = 5_000;
    let mut p50s: Vec<Vec<Duration>> = vec![Vec::with_capacity(ROUNDS); NAMES.len()];
    for _ in 0..ROUNDS {
        for (i, name) in NAMES.iter().enumerate() {
            let mut s = make(name);
            p50(s.as_mut(), 500); // warm-up
            p50s[i].push(p50(s.as_mut(), N));
        }
    }
    let med: Vec<f64> = p50s
        .iter_mut()
        .map(|r| {
            r.sort_unstable();
            r[ROUNDS / 2].as_secs_f64() * 1e6
        })
        .collect();
    println!("\nsync_read own timing (median over {ROUNDS} rounds of the p50 of {N} calls):");
    for (name, us) in NAMES.iter().zip(&med) {
        println!("  {name:<17} p50 {us:8.2} µs");
    }
    for (v, vm) in med.iter().enumerate().take(VM_VARIANTS) {
        for (b, base) in med.iter().enumerate().skip(VM_VARIANTS) {
            println!("RATIO {}/{} {:.2}", NAMES[v], NAMES[b], vm / base);
        }
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // `cargo bench` passes `--bench`; `cargo test --benches` does not (criterion then runs
    // each benchmark once as a test): skip the summary there.
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--list") {
        ratio_summary();
    }
}
