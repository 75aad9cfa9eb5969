//! The dependency engine alone (ivm-engine, fixed pools): a program decoded from the input
//! runs through the engine with an executor whose choices (which stream runs next, when a
//! "later" instruction completes, whether a waiting caller claims an instruction) come from
//! the input too, and must leave every datum as the sequential interpreter does; barriers,
//! release order, early releases, hangs and leaks are checked as well
//! (`ivm_engine::check`). The seed's top byte also picks fused runs' bound: 1 (fusion
//! off) for half the inputs, 2..=25 for the others (`check_fused`).
//!
//! The planted ordering bugs live in ivm-engine (feature `planted-bugs`): set
//! `IVM_FUZZ_PLANT=drop-edge` (a dropped read→write edge), `IVM_FUZZ_PLANT=out-of-order`
//! (a release before the instruction finished) or `IVM_FUZZ_PLANT=fuse-waiting` (a fused
//! run taking in an instruction that still waits) to run the same target on an engine with
//! that bug planted; the fuzzer must then find a crashing input (within seconds). `cargo
//! test -p ivm-engine --all-features` (`planted_bugs_are_caught`) shows the same in CI.
//!
//! Set `IVM_FUZZ_STATS=1` to print, every 2^12 runs and at exit, the distribution of
//! program lengths and cross-stream uses reached so far.
#![no_main]

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use std::sync::{Once, OnceLock};

use ivm_engine::PlantedBug;
use ivm_engine::check::{Program, check, check_fused, check_planted};
use libfuzzer_sys::fuzz_target;

static RUNS: AtomicUsize = AtomicUsize::new(0);
/// Program lengths reached, by bucket: <8, <32, <128, <512, ≥512 operations.
static LENGTHS: [AtomicUsize; 5] = [const { AtomicUsize::new(0) }; 5];
static LONGEST: AtomicUsize = AtomicUsize::new(0);
static CROSS: AtomicUsize = AtomicUsize::new(0);
/// Registers the exit report once (with `IVM_FUZZ_STATS` set).
static STATS_AT_EXIT: Once = Once::new();

/// The bug `IVM_FUZZ_PLANT` asks for (none when unset).
fn planted() -> PlantedBug {
    static BUG: OnceLock<PlantedBug> = OnceLock::new();
    *BUG.get_or_init(|| match std::env::var("IVM_FUZZ_PLANT").as_deref() {
        Err(_) | Ok("" | "none") => PlantedBug::None,
        Ok("drop-edge") => PlantedBug::DropReadWriteEdge,
        Ok("out-of-order") => PlantedBug::OutOfOrderRelease,
        Ok("fuse-waiting") => PlantedBug::FuseWaiting,
        Ok(other) => {
            panic!("IVM_FUZZ_PLANT={other}: expected drop-edge, out-of-order or fuse-waiting")
        }
    })
}

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// The report `IVM_FUZZ_STATS` asks for (libFuzzer ends with `exit()`, which runs `atexit`
/// handlers).
extern "C" fn print_stats() {
    let l: Vec<usize> = LENGTHS.iter().map(|c| c.load(Relaxed)).collect();
    eprintln!(
        "engine_program: {} runs; ops <8: {}, <32: {}, <128: {}, <512: {}, >=512: {}, \
         longest {}; cross-stream uses {}",
        RUNS.load(Relaxed),
        l[0],
        l[1],
        l[2],
        l[3],
        l[4],
        LONGEST.load(Relaxed),
        CROSS.load(Relaxed)
    );
}

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes seed the executor's choices; the rest is the program.
    let (seed, rest) = data.split_at(data.len().min(8));
    let mut s = [0u8; 8];
    s[..seed.len()].copy_from_slice(seed);
    let program = Program::from_bytes(rest);
    let seed = u64::from_le_bytes(s);
    let top = (seed >> 56) as usize;
    let max_run = if top % 2 == 0 { 1 } else { 2 + top / 2 % 24 };
    let result = match planted() {
        PlantedBug::None if max_run == 1 => check(&program, seed),
        PlantedBug::None => check_fused(&program, seed, max_run),
        bug => check_planted(&program, seed, bug, max_run),
    };
    if let Err(m) = result {
        panic!("engine diverged from the sequential interpreter: {m:?}\n{program:?}");
    }
    let len = program.ops.len();
    LENGTHS[match len {
        0..8 => 0,
        8..32 => 1,
        32..128 => 2,
        128..512 => 3,
        _ => 4,
    }]
    .fetch_add(1, Relaxed);
    LONGEST.fetch_max(len, Relaxed);
    CROSS.fetch_add(program.cross_stream_uses(), Relaxed);
    STATS_AT_EXIT.call_once(|| {
        if std::env::var_os("IVM_FUZZ_STATS").is_some() {
            // SAFETY: registers a plain `extern "C"` function with no preconditions; it
            // only reads atomics and writes to stderr.
            unsafe { atexit(print_stats) };
        }
    });
    let n = RUNS.fetch_add(1, Relaxed) + 1;
    if n.is_multiple_of(1 << 12) && std::env::var_os("IVM_FUZZ_STATS").is_some() {
        print_stats();
    }
});
