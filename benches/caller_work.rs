//! The caller's own work while the VM streams instructions for it, against the same work
//! with the VM idle, in one criterion group.
//!
//! One iteration = one fixed compute chunk of the caller (xorshift rounds, ~10 µs).
//!
//! * `idle_vm`: a VM exists but has nothing to do;
//! * `streaming_vm`: before each chunk the caller submits a `run` of 16 small kernels
//!   (each a chunk's worth of work on the worker), untimed (`iter_custom` times only the
//!   chunk), so the VM's threads run next to the caller's work.
//!
//! On 2 cores the ratio of the two is `caller_work_ratio` (target ≥ 0.8; see
//! `examples/perf_report/`). `cargo bench --bench caller_work`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use ivm::ivm_std::{Config, Tensor, VirtualMachine};

fn work_chunk(seed: u64) -> u64 {
    let mut x = seed | 1;
    for _ in 0..4_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    x
}

fn bench_caller_work(c: &mut Criterion) {
    let vm =
        VirtualMachine::new(Config::from_env().expect("IVM_* variables parse")).expect("VM starts");
    let s = vm.default_stream();
    let t: Vec<Tensor> = (0..8).map(|_| vm.new_tensor(8).expect("tensor")).collect();
    let mut group = c.benchmark_group("caller_work");
    group.bench_function("idle_vm", |b| {
        b.iter(|| black_box(work_chunk(black_box(7))))
    });
    let mut i = 0usize;
    group.bench_function("streaming_vm", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                vm.run(|bl| {
                    for _ in 0..16 {
                        bl.call(&s, &[&t[i % 8]], &[&t[(i + 1) % 8]], |k| {
                            let x = k.input_u64(0)[0];
                            k.output_u64(0)[0] = work_chunk(x) & 0xFF;
                        })?;
                        i += 1;
                    }
                    Ok(())
                })
                .expect("run");
                let start = Instant::now();
                black_box(work_chunk(black_box(i as u64)));
                total += start.elapsed();
            }
            vm.sync().expect("sync");
            total
        })
    });
    group.finish();
    drop(t);
    vm.shutdown().expect("shutdown");
}

criterion_group!(benches, bench_caller_work);
criterion_main!(benches);
