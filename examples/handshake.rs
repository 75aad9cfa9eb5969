//! The blocking-then-busy handshake between two threads, measured.
//!
//! A "caller" thread asks a "worker" thread to do a tiny job (write 8 bytes) and waits for
//! it the way ivm's sync small-memory access does: a [`BlockingThenBusy`] per request, the
//! worker notifying it when it starts and decreasing it when it has finished, the caller
//! blocking and then spinning. Three ways of waiting are measured back to back:
//!
//! * `skip + polling worker`: the notify-skip fast path (the caller spins from the start,
//!   the worker makes no wake call) with a worker that polls for new requests;
//! * `no skip + polling worker`: the caller sleeps on the notifier until the worker starts;
//! * `sleeping worker`: the worker blocks on its own notifier between requests, so every
//!   round trip pays for waking it.
//!
//! Run with `cargo run --release --example handshake [rounds]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ivm::ivm_core::btb::BlockingThenBusy;
use ivm::ivm_core::notifier::Notifier;
use ivm::ivm_std::futex::FutexWait;

/// What the caller and the worker share.
struct Shared {
    /// Requests for the worker ("there is a job"); the worker sleeps on it when idle.
    requests: Notifier<FutexWait>,
    /// The caller's handshake for the current job.
    btb: BlockingThenBusy<FutexWait>,
    /// The job's result (the "8 bytes of a tensor").
    result: AtomicU64,
    /// Whether the worker polls for requests instead of sleeping between them.
    poll: AtomicBool,
}

fn worker(shared: &Shared) {
    let mut job = 0u64;
    loop {
        if shared.poll.load(Ordering::Relaxed) {
            // Poll for the next request (a VM worker does this for ~200 µs, then sleeps).
            while shared.requests.pending() == 0 && !shared.requests.is_closed() {
                std::hint::spin_loop();
            }
        }
        if shared.requests.wait_and_clear().is_err() {
            return; // closed: the demo is over
        }
        job += 1;
        let _ = shared.btb.notify(); // started
        // Relaxed: the BTB's decrease() (Release) publishes it to the caller's Acquire.
        shared
            .result
            .store(job.wrapping_mul(0x9E37_79B9_7F4A_7C15), Ordering::Relaxed);
        shared.btb.decrease(); // finished
    }
}

fn measure(shared: &Shared, rounds: usize, skip: bool, expected_job: &mut u64) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        shared.requests.notify().expect("worker alive");
        if skip {
            shared.btb.skip_blocking();
        }
        shared
            .btb
            .wait_until_done(Duration::from_secs(5), || true)
            .expect("the worker answers within 5 s");
        let value = shared.result.load(Ordering::Relaxed);
        samples.push(start.elapsed());
        *expected_job += 1;
        assert_eq!(value, expected_job.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        shared.btb.reset();
    }
    samples
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000);
    let shared = Arc::new(Shared {
        requests: Notifier::new(),
        btb: BlockingThenBusy::new(),
        result: AtomicU64::new(0),
        poll: AtomicBool::new(true),
    });
    let handle = {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || worker(&shared))
    };

    let mut job = 0u64;
    println!("blocking-then-busy handshake, {rounds} round trips each (futex wait backend)\n");
    println!("| mode | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    let modes: [(&str, bool, bool, usize); 3] = [
        ("skip + polling worker", true, true, rounds),
        ("no skip + polling worker", false, true, rounds),
        ("sleeping worker", false, false, rounds.min(2_000)),
    ];
    for (name, skip, poll, n) in modes {
        shared.poll.store(poll, Ordering::Relaxed);
        // Warm up (and let the worker pick up the new polling mode).
        measure(&shared, 100, skip, &mut job);
        let mut samples = measure(&shared, n, skip, &mut job);
        samples.sort_unstable();
        println!(
            "| {name} | {:.2} µs | {:.2} µs | {:.2} µs | {:.2} µs |",
            percentile(&samples, 0.50).as_secs_f64() * 1e6,
            percentile(&samples, 0.90).as_secs_f64() * 1e6,
            percentile(&samples, 0.99).as_secs_f64() * 1e6,
            samples.last().unwrap().as_secs_f64() * 1e6,
        );
    }
    shared.requests.close();
    handle.join().unwrap();
}
