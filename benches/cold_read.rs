//! Cold sync reads: a read issued after the VM sat idle for 10 ms (every VM thread parked),
//! against the cost of waking a thread that sleeps on a futex, in one criterion group.
//!
//! * `vm_worker`: `read_small` of 8 bytes with `inline_sync_access` off: the read
//!   runs on the default stream's worker, which the caller wakes (at most one wake on the
//!   critical path: the caller spins, yielding, until the worker finished);
//! * `vm_inline`: the default config: nothing is in flight, the caller runs the read itself
//!   (no wake at all);
//! * `futex_wake`: the baseline: a thread sleeps on a futex; timed from just before the
//!   wake call until the woken thread runs.
//!
//! Each iteration sleeps 10 ms untimed first (`iter_custom`), so keep the measurement time
//! modest: `cargo bench --bench cold_read -- --measurement-time 3 --warm-up-time 1`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ivm::ivm_std::{Config, Tensor, VirtualMachine};

#[path = "../examples/common/mod.rs"]
mod common;
use common::FutexBaseline;

const IDLE: Duration = Duration::from_millis(10);

fn vm(inline: bool) -> (VirtualMachine, Tensor) {
    let config = Config::from_env()
        .expect("IVM_* variables parse")
        .with_inline_sync_access(inline);
    let vm = VirtualMachine::new(config).expect("VM starts");
    let t = vm.new_tensor(8).expect("tensor");
    vm.write_small(&t, 0, &7u64.to_ne_bytes()).expect("write");
    (vm, t)
}

fn bench_cold(c: &mut Criterion) {
    let mut group = c.benchmark_group("cold_read");
    group.sample_size(10);
    for (name, inline) in [("vm_worker", false), ("vm_inline", true)] {
        let (vm, t) = vm(inline);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut out = [0u8; 8];
                for _ in 0..iters {
                    std::thread::sleep(IDLE);
                    let s = Instant::now();
                    vm.read_small(&t, 0, &mut out).expect("read");
                    total += s.elapsed();
                    black_box(out);
                }
                total
            })
        });
        drop(t);
        vm.shutdown().expect("shutdown");
    }
    // The baseline: a futex sleeper; the woken thread stamps the time it runs.
    let base = FutexBaseline::new();
    let mut k = 0u32;
    group.bench_function("futex_wake", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                std::thread::sleep(IDLE);
                k += 1;
                total += base.round(k);
            }
            total
        })
    });
    drop(base);
    group.finish();
}

criterion_group!(benches, bench_cold);
criterion_main!(benches);
