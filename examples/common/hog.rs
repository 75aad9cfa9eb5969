//! Busy threads beside a measurement (`--hog N` of the training demo, `perf_report`'s
//! `contended` section): each spins on a flag until stopped, as a data loader, an
//! interpreter or another job would take a core. They are plain threads of this process,
//! placed by the OS on any CPU of the process's original mask (never pinned), started
//! before the measurement and stopped after it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

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
