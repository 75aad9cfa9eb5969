//! What the demo prints after training: where the last epoch's time went (from the trace),
//! the core-to-core round trip, percentiles of the loss reads, and the check that every
//! mode computed bit-identical losses and weights.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Run, trace};

pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The per-step breakdown of each mode's last epoch, from the trace.
pub(crate) fn where_time_goes(runs: &[Run], spe: usize) {
    println!();
    println!("where the last epoch's time goes, µs per step (from the trace):");
    println!(
        "| mode     | wall | kernels | graph protocol | h2d copies | caller run (build+submit) | caller waits in read | wall - kernels |"
    );
    println!(
        "|----------|-----:|--------:|---------------:|-----------:|--------------------------:|---------------------:|---------------:|"
    );
    for r in runs {
        let c = trace::per_step(r.mode.pid(), spe);
        let get = |k| c.get(&k).copied().unwrap_or(0.0);
        let wall = r.last_epoch.as_secs_f64() * 1e6 / spe as f64;
        let kernels = get(trace::Cat::Kernel);
        println!(
            "| {:<8} | {wall:>4.0} | {kernels:>7.1} | {:>14.1} | {:>10.1} | {:>25.1} | {:>20.1} | {:>14.1} |",
            r.mode.name(),
            get(trace::Cat::Protocol),
            get(trace::Cat::Copy),
            get(trace::Cat::Submit),
            get(trace::Cat::Read),
            wall - kernels
        );
    }
}

/// The round trip of one cache line between two threads spinning on it (each waits for the
/// other's store): the least any hand-over between the VM's threads costs on this machine
/// right now. Spinning yields now and then, so two threads sharing a CPU still finish.
pub(crate) fn core_round_trip() -> Duration {
    use std::sync::atomic::{AtomicU32, Ordering};
    const N: u32 = 5_000;
    fn wait_for(flag: &AtomicU32, v: u32) {
        let mut spins = 0u32;
        // Acquire: pairs with the other thread's Release store (a real hand-over).
        while flag.load(Ordering::Acquire) != v {
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
    let flag = Arc::new(AtomicU32::new(0));
    let peer = flag.clone();
    let h = std::thread::spawn(move || {
        for i in 0..N {
            wait_for(&peer, 2 * i + 1);
            peer.store(2 * i + 2, Ordering::Release);
        }
    });
    wait_for(&flag, 0);
    let t0 = Instant::now();
    for i in 0..N {
        flag.store(2 * i + 1, Ordering::Release);
        wait_for(&flag, 2 * i + 2);
    }
    let e = t0.elapsed();
    let _ = h.join();
    e / N
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Compares every run's losses and weights with the first run's, bit for bit.
pub(crate) fn check_determinism(runs: &[Run]) -> Result<String, String> {
    let Some(reference) = runs.first() else {
        return Ok("no run".into());
    };
    if runs.len() < 2 {
        return Ok(format!(
            "only {} ran: nothing to compare (use --mode all)",
            reference.mode.name()
        ));
    }
    for r in &runs[1..] {
        if r.losses.len() != reference.losses.len() {
            return Err(format!(
                "{} ran {} steps, {} ran {}",
                r.mode.name(),
                r.losses.len(),
                reference.mode.name(),
                reference.losses.len()
            ));
        }
        if let Some((i, (a, b))) = reference
            .losses
            .iter()
            .zip(&r.losses)
            .enumerate()
            .find(|(_, (a, b))| a.to_bits() != b.to_bits())
        {
            return Err(format!(
                "step {i}: {} loss {a:e} ({:#010x}) but {} loss {b:e} ({:#010x})",
                reference.mode.name(),
                a.to_bits(),
                r.mode.name(),
                b.to_bits()
            ));
        }
        let same = reference
            .weights
            .iter()
            .zip(&r.weights)
            .all(|((wa, ba), (wb, bb))| {
                let eq = |x: &[f32], y: &[f32]| {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
                };
                eq(wa, wb) && eq(ba, bb)
            });
        if !same {
            return Err(format!(
                "the final weights of {} and {} differ",
                reference.mode.name(),
                r.mode.name()
            ));
        }
    }
    let names: Vec<_> = runs.iter().map(|r| r.mode.name()).collect();
    Ok(format!(
        "per-step losses ({} steps) and final weights bit-identical across {}",
        reference.losses.len(),
        names.join(", ")
    ))
}
