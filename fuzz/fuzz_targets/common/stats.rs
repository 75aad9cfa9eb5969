//! Coverage counters of the VM equivalence targets: programs run, their lengths, and how
//! many of them crossed streams or devices (soft sync), copied or launched lazy jobs. With
//! `IVM_FUZZ_STATS` set they are printed to stderr every [`EVERY`] programs and when the
//! process exits (libFuzzer ends with `exit()`, which runs `atexit` handlers).

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use ivm_std::fuzzing::{MAX_OPS, Outcome, Program};

/// Programs between two periodic reports.
const EVERY: u64 = 1 << 10;
/// Upper bounds (exclusive) of the program-length buckets, in ops; the last bucket is
/// `LENGTH_BOUNDS[3]..=MAX_OPS`.
const LENGTH_BOUNDS: [usize; 4] = [10, 30, 60, 100];

// Relaxed throughout: independent statistics counters, read once at exit.
static PROGRAMS: AtomicU64 = AtomicU64::new(0);
static LENGTHS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
static LONGEST: AtomicU64 = AtomicU64::new(0);
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
    let l: Vec<u64> = LENGTHS.iter().map(g).collect();
    let b = LENGTH_BOUNDS;
    eprintln!(
        "ivm-fuzz stats: {} programs, {} kernels; ops <{}: {}, <{}: {}, <{}: {}, <{}: {}, \
         {}..={MAX_OPS}: {}, longest {}; {} copies in {} programs; {} launches in {} \
         programs; {} cross-stream uses in {} programs; {} cross-device uses in {} programs",
        g(&PROGRAMS),
        g(&KERNELS),
        b[0],
        l[0],
        b[1],
        l[1],
        b[2],
        l[2],
        b[3],
        l[3],
        b[3],
        l[4],
        g(&LONGEST),
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

/// Counts one run of `program`; registers the exit report on first use when
/// `IVM_FUZZ_STATS` is set.
pub fn record(program: &Program, o: &Outcome) {
    static ONCE: Once = Once::new();
    static ENABLED: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        if std::env::var_os("IVM_FUZZ_STATS").is_some() {
            ENABLED.store(true, Relaxed);
            // SAFETY: registers a plain `extern "C"` function with no preconditions; it
            // only reads atomics and writes to stderr.
            unsafe { atexit(print_stats) };
        }
    });
    let add = |c: &AtomicU64, n: usize| {
        c.fetch_add(n as u64, Relaxed);
    };
    let len = program.ops.len();
    add(
        &LENGTHS[LENGTH_BOUNDS.iter().take_while(|&&b| len >= b).count()],
        1,
    );
    LONGEST.fetch_max(len as u64, Relaxed);
    add(&KERNELS, o.kernels);
    add(&COPIES, o.copies);
    add(&COPY_PROGRAMS, usize::from(o.copies > 0));
    add(&LAUNCHES, o.launches);
    add(&LAUNCH_PROGRAMS, usize::from(o.launches > 0));
    add(&CROSS_STREAM, o.cross.streams);
    add(&CROSS_STREAM_PROGRAMS, usize::from(o.cross.streams > 0));
    add(&CROSS_DEVICE, o.cross.devices);
    add(&CROSS_DEVICE_PROGRAMS, usize::from(o.cross.devices > 0));
    if PROGRAMS.fetch_add(1, Relaxed) % EVERY == EVERY - 1 && ENABLED.load(Relaxed) {
        print_stats();
    }
}
