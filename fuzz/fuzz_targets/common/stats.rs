//! Coverage counters of the VM equivalence targets: programs run, and how many of them
//! crossed streams or devices (soft sync), copied or launched lazy jobs. With
//! `IVM_FUZZ_STATS` set they are printed to stderr when the process exits (libFuzzer ends
//! with `exit()`, which runs `atexit` handlers).

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ivm_std::fuzzing::Outcome;

// Relaxed throughout: independent statistics counters, read once at exit.
static PROGRAMS: AtomicU64 = AtomicU64::new(0);
static KERNELS: AtomicU64 = AtomicU64::new(0);
static COPIES: AtomicU64 = AtomicU64::new(0);
static COPY_PROGRAMS: AtomicU64 = AtomicU64::new(0);
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static LAUNCH_PROGRAMS: AtomicU64 = AtomicU64::new(0);
static CROSS_STREAM: AtomicU64 = AtomicU64::new(0);
static CROSS_STREAM_PROGRAMS: AtomicU64 = AtomicU64::new(0);
static CROSS_DEVICE: AtomicU64 = AtomicU64::new(0);
static CROSS_DEVICE_PROGRAMS: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

extern "C" fn print_stats() {
    let g = |c: &AtomicU64| c.load(Relaxed);
    eprintln!(
        "ivm-fuzz stats: {} programs, {} kernels; {} copies in {} programs; {} launches in {} \
         programs; {} cross-stream uses in {} programs; {} cross-device uses in {} programs",
        g(&PROGRAMS),
        g(&KERNELS),
        g(&COPIES),
        g(&COPY_PROGRAMS),
        g(&LAUNCHES),
        g(&LAUNCH_PROGRAMS),
        g(&CROSS_STREAM),
        g(&CROSS_STREAM_PROGRAMS),
        g(&CROSS_DEVICE),
        g(&CROSS_DEVICE_PROGRAMS),
    );
}

/// Counts one run; registers the exit report on first use when `IVM_FUZZ_STATS` is set.
pub fn record(o: &Outcome) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("IVM_FUZZ_STATS").is_some() {
            // SAFETY: registers a plain `extern "C"` function with no preconditions; it
            // only reads atomics and writes to stderr.
            unsafe { atexit(print_stats) };
        }
    });
    let add = |c: &AtomicU64, n: usize| {
        c.fetch_add(n as u64, Relaxed);
    };
    add(&PROGRAMS, 1);
    add(&KERNELS, o.kernels);
    add(&COPIES, o.copies);
    add(&COPY_PROGRAMS, usize::from(o.copies > 0));
    add(&LAUNCHES, o.launches);
    add(&LAUNCH_PROGRAMS, usize::from(o.launches > 0));
    add(&CROSS_STREAM, o.cross.streams);
    add(&CROSS_STREAM_PROGRAMS, usize::from(o.cross.streams > 0));
    add(&CROSS_DEVICE, o.cross.devices);
    add(&CROSS_DEVICE_PROGRAMS, usize::from(o.cross.devices > 0));
}
