//! The VM demo: a loop of kernels over a few tensors on two streams with a sync read each
//! iteration, then a batch phase.
//!
//! 1. **Loop**: a tiny integer "particle" update over three 8-lane tensors — on stream 0
//!    `vel += f(pos, step)`, on stream 1 `pos += vel`, on stream 0 `energy = Σ pos` — then
//!    `read_small(energy)` (8 bytes), checked against the same update done
//!    sequentially in the caller. Prints the iteration latency (`run` of 3 kernels + the
//!    read, which waits for them) and the read's own latency, as percentiles. The first
//!    200 iterations are traced (`ivm_std::trace`) and written as Chrome trace JSON
//!    (Perfetto) to `$IVM_TRACE_OUT` or the temp directory's `ivm_vm_demo_trace.json`.
//! 2. **Warm reads**: back-to-back 8-byte sync reads of a ready tensor (nothing in flight:
//!    with the default `inline_sync_access` the caller does them itself).
//! 3. **Batch**: 100 000 no-op instructions in `run` batches of 64, alternating the two
//!    streams, each reading the previous one's output, timed until `sync()` returns.
//!
//! After the read phases it prints where the time went per thread (CPU, time spent
//! runnable but waiting for a CPU, context switches), from `/proc/self/task` (Linux).
//! VM settings come from [`Config::from_env`] (`IVM_*` variables). Runs in a few seconds:
//! `cargo run --release --example vm_demo`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ivm::ivm_std::{Config, Device, StreamId, Tensor, VirtualMachine};

const LANES: usize = 8;
const LOOP_ITERS: usize = 5_000;
const LOOP_BUDGET: Duration = Duration::from_secs(3);
/// Loop iterations recorded in the trace (`IVM_TRACE_OUT` names the file; default: the
/// temp directory's `ivm_vm_demo_trace.json`).
const TRACE_ITERS: u64 = 200;
const WARM_READS: usize = 20_000;
const WARM_BUDGET: Duration = Duration::from_secs(2);
const BATCH_INSTRS: usize = 100_000;
const BATCH: usize = 64;

/// The velocity update, shared by the kernel and the sequential check.
fn accel(pos: u64, lane: usize, step: u64) -> u64 {
    (pos >> 7) ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ lane as u64
}

/// Sequential model of the loop's state.
struct Model {
    pos: [u64; LANES],
    vel: [u64; LANES],
}

impl Model {
    fn step(&mut self, step: u64) -> u64 {
        for j in 0..LANES {
            self.vel[j] = self.vel[j].wrapping_add(accel(self.pos[j], j, step));
        }
        for j in 0..LANES {
            self.pos[j] = self.pos[j].wrapping_add(self.vel[j]);
        }
        self.pos.iter().fold(0u64, |a, &p| a.wrapping_add(p))
    }
}

fn percentiles(label: &str, samples: &mut [Duration]) {
    samples.sort_unstable();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "| {label} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
        samples.len(),
        us(at(0.50)),
        us(at(0.90)),
        us(at(0.99)),
        us(*samples.last().expect("samples"))
    );
}

/// Per-thread scheduler statistics: (name, ns on CPU, ns runnable but waiting for a CPU,
/// voluntary switches, involuntary switches).
type ThreadStats = HashMap<u32, (String, [u64; 4])>;

fn thread_stats() -> ThreadStats {
    let mut m = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return m;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let p = e.path();
        let name = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let sched = std::fs::read_to_string(p.join("schedstat")).unwrap_or_default();
        let mut f = sched
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap_or(0));
        let (cpu, wait) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let vol = field("voluntary_ctxt_switches:");
        let invol = field("nonvoluntary_ctxt_switches:");
        m.insert(tid, (name.trim().to_string(), [cpu, wait, vol, invol]));
    }
    m
}

fn print_thread_stats(label: &str, before: &ThreadStats, after: &ThreadStats, wall: Duration) {
    println!("\nthreads during {label} ({:.2} s):", wall.as_secs_f64());
    println!(
        "| thread | CPU ms | runnable, waiting for a CPU, ms | voluntary / involuntary switches |"
    );
    println!("|---|---|---|---|");
    let mut rows: Vec<_> = after
        .iter()
        .map(|(tid, (name, a))| {
            let b = before.get(tid).map_or([0; 4], |x| x.1);
            (name.clone(), [0, 1, 2, 3].map(|i| a[i] - b[i]))
        })
        .filter(|(_, d)| d[0] > 0)
        .collect();
    rows.sort();
    for (name, d) in rows {
        println!(
            "| {name} | {:.1} | {:.1} | {} / {} |",
            d[0] as f64 / 1e6,
            d[1] as f64 / 1e6,
            d[2],
            d[3]
        );
    }
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out).expect("sync read");
    u64::from_ne_bytes(out)
}

fn main() {
    let config = Config::from_env().expect("IVM_* variables parse");
    println!(
        "ivm VM demo: multi-thread mode, worker poll window {:?}, scheduler work window {:?}, skip threshold {}, {} hardware threads\n",
        config.worker_poll_window,
        config.scheduler_work_window,
        config.skip_blocking_threshold,
        std::thread::available_parallelism().map_or(1, usize::from)
    );
    let vm = VirtualMachine::new(config).expect("VM starts");
    let s0 = vm.default_stream();
    let s1 = vm
        .stream(StreamId::compute(Device::CPU, 1))
        .expect("second stream");
    let pos = vm.new_tensor(8 * LANES).expect("tensor");
    let vel = vm.new_tensor(8 * LANES).expect("tensor");
    let energy = vm.new_tensor(8).expect("tensor");
    let mut model = Model {
        pos: [0; LANES],
        vel: [0; LANES],
    };

    // 1. The loop (its first iterations traced).
    ivm::ivm_std::trace::set_enabled(true);
    let mut iter_lat = Vec::with_capacity(LOOP_ITERS);
    let mut read_lat = Vec::with_capacity(LOOP_ITERS);
    let start = Instant::now();
    let (st0, t0) = (thread_stats(), Instant::now());
    for step in 0..LOOP_ITERS as u64 {
        if start.elapsed() > LOOP_BUDGET {
            break;
        }
        if step == TRACE_ITERS {
            ivm::ivm_std::trace::set_enabled(false);
        }
        let t_iter = Instant::now();
        vm.run(|b| {
            b.call_named("update_vel", &s0, &[&pos], &[&vel], move |k| {
                let p: [u64; LANES] = k.input_u64(0)[..LANES].try_into().expect("8 lanes");
                for (j, v) in k.output_u64(0).iter_mut().enumerate() {
                    *v = v.wrapping_add(accel(p[j], j, step));
                }
            })?;
            b.call_named("update_pos", &s1, &[&vel], &[&pos], |k| {
                let v: [u64; LANES] = k.input_u64(0)[..LANES].try_into().expect("8 lanes");
                for (j, p) in k.output_u64(0).iter_mut().enumerate() {
                    *p = p.wrapping_add(v[j]);
                }
            })?;
            b.call_named("energy", &s0, &[&pos], &[&energy], |k| {
                let e = k.input_u64(0).iter().fold(0u64, |a, &p| a.wrapping_add(p));
                k.output_u64(0)[0] = e;
            })
        })
        .expect("run");
        let t_read = Instant::now();
        let e = read_u64(&vm, &energy);
        read_lat.push(t_read.elapsed());
        iter_lat.push(t_iter.elapsed());
        assert_eq!(e, model.step(step), "VM and sequential model disagree");
    }
    let loop_wall = t0.elapsed();
    let st1 = thread_stats();
    let iters = iter_lat.len();
    ivm::ivm_std::trace::set_enabled(false);
    let trace_path = std::env::var_os("IVM_TRACE_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("ivm_vm_demo_trace.json"));
    match std::fs::File::create(&trace_path)
        .and_then(|mut f| ivm::ivm_std::trace::write_chrome_json(&mut f))
    {
        Ok(()) => println!(
            "trace of the first {TRACE_ITERS} iterations (Chrome trace JSON, opens in Perfetto): {}\n",
            trace_path.display()
        ),
        Err(e) => println!(
            "could not write the trace to {}: {e}\n",
            trace_path.display()
        ),
    }

    // 2. Warm reads of a ready tensor.
    let expected = read_u64(&vm, &energy);
    let mut warm = Vec::with_capacity(WARM_READS);
    let start = Instant::now();
    let (st2, t2) = (thread_stats(), Instant::now());
    for _ in 0..WARM_READS {
        if start.elapsed() > WARM_BUDGET {
            break;
        }
        let t = Instant::now();
        let e = read_u64(&vm, &energy);
        warm.push(t.elapsed());
        assert_eq!(e, expected);
    }
    let warm_wall = t2.elapsed();
    let st3 = thread_stats();

    println!(
        "{iters} iterations (3 kernels on 2 streams + 1 sync read each) in {:.2} s, all equal to the sequential model\n",
        loop_wall.as_secs_f64()
    );
    println!("| latency | samples | p50 µs | p90 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|---|");
    percentiles("iteration: run 3 kernels + sync read", &mut iter_lat);
    percentiles("sync read after the kernels", &mut read_lat);
    percentiles("sync read of a ready tensor", &mut warm);
    print_thread_stats("the loop", &st0, &st1, loop_wall);
    print_thread_stats("the ready-tensor reads", &st2, &st3, warm_wall);

    // 3. Batch throughput.
    let chain: Vec<Tensor> = (0..8).map(|_| vm.new_tensor(8).expect("tensor")).collect();
    let streams = [&s0, &s1];
    let t = Instant::now();
    let mut i = 0usize;
    while i < BATCH_INSTRS {
        vm.run(|b| {
            for _ in 0..BATCH {
                b.call(
                    streams[i % 2],
                    &[&chain[i % 8]],
                    &[&chain[(i + 1) % 8]],
                    |_k| {},
                )?;
                i += 1;
            }
            Ok(())
        })
        .expect("run");
    }
    vm.sync().expect("sync");
    let wall = t.elapsed();
    println!(
        "\nbatch: {BATCH_INSTRS} no-op instructions (two-stream chain, run batches of {BATCH}) in {:.3} s until sync(): {:.0} instructions/s",
        wall.as_secs_f64(),
        BATCH_INSTRS as f64 / wall.as_secs_f64()
    );
    vm.shutdown().expect("shutdown");
    let c = vm.debug_counters();
    assert_eq!(
        (c.instructions, c.accesses, c.edges, c.flying),
        (0, 0, 0, 0),
        "nothing left in the engine after shutdown"
    );
}
