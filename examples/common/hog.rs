//! Busy threads beside a measurement (`--hog N` of the training demo, `perf_report`'s
//! `contended` section): each spins on a flag until stopped, as a data loader, an
//! interpreter or another job would take a core. They are plain threads of this process,
//! placed by the OS on any CPU of the process's original mask (never pinned), started
//! before the measurement and stopped after it. They count where the OS runs them
//! ([`on_cpu`]), so that a measurement can say whose CPU they shared.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

/// The CPUs whose share of the busy threads' time is counted ([`on_cpu`]).
const COUNTED_CPUS: usize = 8;

/// Samples of the CPU each busy thread was running on, per CPU (one every 2^16 spins).
static ON_CPU: [AtomicU64; COUNTED_CPUS] = [const { AtomicU64::new(0) }; COUNTED_CPUS];

/// How many samples found a busy thread on each CPU so far (CPUs past the first eight
/// are not counted): where the OS put them, read around a measurement.
#[allow(dead_code)] // perf_report does not read it.
pub fn on_cpu() -> [u64; COUNTED_CPUS] {
    // Relaxed: counters read after the fact.
    std::array::from_fn(|c| ON_CPU[c].load(Ordering::Relaxed))
}

/// The CPU the calling thread runs on, if known.
fn current_cpu() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `sched_getcpu` has no preconditions.
        usize::try_from(unsafe { libc::sched_getcpu() }).ok()
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// `n` busy threads until dropped.
pub struct Hog {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<u64>>,
}

impl Hog {
    /// Starts `n` busy threads (none for 0).
    pub fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|k| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("hog{k}"))
                    .spawn(move || {
                        let mut spins = 0u64;
                        // Relaxed: only the flag's eventual value matters.
                        while !stop.load(Ordering::Relaxed) {
                            spins = spins.wrapping_add(1);
                            if spins.is_multiple_of(1 << 16)
                                && let Some(c) = current_cpu().filter(|&c| c < COUNTED_CPUS)
                            {
                                // Relaxed: a statistic.
                                ON_CPU[c].fetch_add(1, Ordering::Relaxed);
                            }
                            std::hint::spin_loop();
                        }
                        spins
                    })
                    .expect("spawn a hog thread")
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
