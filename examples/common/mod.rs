//! Measurement helpers shared by the examples and benches that compare ivm with a
//! baseline (`perf_report`, `vm_cpu`, `benches/cold_read.rs`): a thread sleeping on a
//! futex (the cost of one wake-up) and per-thread CPU time from `/proc`.
//!
//! Included with `mod common;` (benches: `#[path = "../examples/common/mod.rs"]`); each
//! user takes what it needs, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod hog;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ivm::ivm_core::sync::AtomicU32 as WaitWord;
use ivm::ivm_core::wait::Wait;
use ivm::ivm_std::futex::FutexWait;

/// A thread that sleeps on a futex; each round, the waker records the time just before
/// its wake call, the woken thread the time it runs.
pub struct FutexBaseline {
    word: Arc<WaitWord>,
    woke_at: Arc<AtomicU64>,
    origin: Instant,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FutexBaseline {
    pub fn new() -> Self {
        let word = Arc::new(WaitWord::new(0));
        let woke_at = Arc::new(AtomicU64::new(0));
        let origin = Instant::now();
        let (w, a) = (word.clone(), woke_at.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = 0;
            loop {
                // Acquire: pairs with the waker's Release store of the round number.
                while w.load(Ordering::Acquire) == seen {
                    FutexWait::wait(&w, seen, None);
                }
                let now = origin.elapsed().as_nanos() as u64;
                seen = w.load(Ordering::Acquire);
                if seen == u32::MAX {
                    return;
                }
                // Release: pairs with the waker's Acquire load of the time stamp.
                a.store(now, Ordering::Release);
            }
        });
        Self {
            word,
            woke_at,
            origin,
            thread: Some(thread),
        }
    }

    /// Round `k` (1, 2, ...): one wake of the sleeping thread; the time from just before
    /// the wake call to it running.
    pub fn round(&self, k: u32) -> Duration {
        self.woke_at.store(0, Ordering::Release);
        let before = self.origin.elapsed().as_nanos() as u64;
        self.word.store(k, Ordering::Release);
        FutexWait::wake_one(&self.word);
        // Like the VM caller: spin, yielding the CPU, until the other side ran.
        let at = loop {
            let at = self.woke_at.load(Ordering::Acquire);
            if at != 0 {
                break at;
            }
            std::thread::yield_now();
        };
        Duration::from_nanos(at.saturating_sub(before))
    }
}

impl Drop for FutexBaseline {
    fn drop(&mut self) {
        self.word.store(u32::MAX, Ordering::Release);
        FutexWait::wake_one(&self.word);
        if let Some(t) = self.thread.take() {
            t.join().expect("futex thread");
        }
    }
}

/// Per-thread (name, ns on CPU) of this process, keyed by thread id: the first field of
/// `/proc/self/task/*/schedstat`. Empty where `/proc` is not there.
pub fn thread_cpu() -> HashMap<u32, (String, u64)> {
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
        let ns = std::fs::read_to_string(p.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(ns) = ns {
            m.insert(tid, (name.trim().to_string(), ns));
        }
    }
    m
}

/// This thread's id (its task in `/proc/self/task`: `/proc/thread-self` links to
/// `<pid>/task/<tid>`); 0 where `/proc` is not there.
pub fn my_tid() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// CPU ns used between the snapshots `before` and `after` by threads whose name starts
/// with `prefix`, and by thread `tid`; plus the former per thread, sorted by name.
pub fn cpu_between(
    before: &HashMap<u32, (String, u64)>,
    after: &HashMap<u32, (String, u64)>,
    prefix: &str,
    tid: u32,
) -> (u64, u64, Vec<(String, u64)>) {
    let (mut vm, mut me, mut detail) = (0, 0, Vec::new());
    for (t, (name, ns)) in after {
        let d = ns.saturating_sub(before.get(t).map_or(0, |b| b.1));
        if *t == tid {
            me += d;
        } else if name.starts_with(prefix) {
            vm += d;
            detail.push((name.clone(), d));
        }
    }
    detail.sort();
    (vm, me, detail)
}
