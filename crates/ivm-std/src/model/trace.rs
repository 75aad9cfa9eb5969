//! Trace export: what each instruction went through, per thread, as Chrome trace JSON
//! (opens in Perfetto or `chrome://tracing`).
//!
//! With tracing enabled ([`set_enabled`], or `Config::trace` / `IVM_TRACE=1` when a VM
//! starts), the VM records five events per instruction: **receive** (the engine took it
//! from the pending queue), **dispatch** (handed to its stream's thread, or run inline),
//! **compute start** / **compute end** (its body, on the thread that ran it) and **release**
//! (the engine erased it). Each thread writes into its own fixed-size ring
//! ([`heapless::HistoryBuf`], [`RING_EVENTS`] events; the oldest are overwritten), so
//! recording never allocates and threads never contend. The rings are static (zeroed
//! memory the OS maps on first touch); a thread claims one on its first event.
//! With tracing disabled, recording costs one relaxed load and one branch.
//!
//! [`write_chrome_json`] writes every ring's events, oldest first per thread, as one JSON
//! object: compute start/end become a complete (`"ph": "X"`) slice on the thread that ran
//! it, the other three instant (`"ph": "i"`) events on the thread that recorded them; each
//! event carries `args.instr` (the instruction's process-unique id) and `args.phase`.
//!
//! ```
//! ivm_std::trace::set_enabled(true);
//! let vm = ivm_std::VirtualMachine::new(ivm_std::Config::default())?;
//! let t = vm.new_tensor(8)?;
//! vm.run(|b| b.call(&vm.default_stream(), &[], &[&t], |k| k.output_u64(0)[0] = 1))?;
//! vm.sync()?;
//! ivm_std::trace::set_enabled(false);
//! let mut json = Vec::new();
//! ivm_std::trace::write_chrome_json(&mut json)?;
//! assert!(String::from_utf8(json).unwrap().contains("\"traceEvents\""));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::Cell;
use std::io::{self, Write};
use std::sync::Mutex;

use heapless::HistoryBuf;

use crate::model::instruction::Instruction;

/// Events kept per thread (the oldest are overwritten).
pub const RING_EVENTS: usize = 1 << 14;
/// Rings (threads that recorded events since the process started; later threads share
/// rings round-robin, which stays correct, merely interleaved).
pub const RINGS: usize = 64;

/// What happened to an instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The engine took it from the pending queue.
    Receive,
    /// The engine handed it to its stream's thread (or ran it inline).
    Dispatch,
    /// Its body started.
    ComputeStart,
    /// Its body finished.
    ComputeEnd,
    /// The engine released it.
    Release,
}

impl Phase {
    /// The phase's name in the JSON (`args.phase`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Receive => "receive",
            Phase::Dispatch => "dispatch",
            Phase::ComputeStart => "compute_start",
            Phase::ComputeEnd => "compute_end",
            Phase::Release => "release",
        }
    }
}

#[derive(Clone, Copy)]
struct Event {
    ns: u64,
    instr: u64,
    name: &'static str,
    phase: Phase,
}

struct Ring {
    /// The name of the thread that claimed the ring.
    thread: heapless::String<48>,
    events: HistoryBuf<Event, RING_EVENTS>,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Mutex<Ring> = Mutex::new(Ring {
    thread: heapless::String::new(),
    events: HistoryBuf::new(),
});
static RINGS_: [Mutex<Ring>; RINGS] = [EMPTY; RINGS];

/// An on/off switch and counters, not part of any synchronisation protocol: plain std
/// atomics on purpose (a `static`; loom models never trace).
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// See [`ENABLED`].
static NEXT_RING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// This thread's ring index + 1 (0: none claimed yet).
    static MY_RING: Cell<usize> = const { Cell::new(0) };
}

fn origin() -> std::time::Instant {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(std::time::Instant::now)
}

/// Turns recording on or off (process-wide).
pub fn set_enabled(on: bool) {
    if on {
        let _ = origin();
    }
    // Relaxed: a switch; events recorded around the switch may or may not be kept.
    ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether recording is on.
#[inline]
pub fn is_enabled() -> bool {
    // Relaxed: see `set_enabled`.
    ENABLED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Records `phase` of `instr` on this thread's ring, if tracing is on.
#[inline]
pub(crate) fn record(instr: &Instruction, phase: Phase) {
    if is_enabled() {
        record_slow(instr.id as u64, instr.name, phase);
    }
}

#[cold]
fn record_slow(instr: u64, name: &'static str, phase: Phase) {
    let ns = u64::try_from(origin().elapsed().as_nanos()).unwrap_or(u64::MAX);
    let idx = MY_RING.with(|r| {
        if r.get() == 0 {
            // Relaxed: a unique-enough index; the ring's mutex orders its contents.
            let i = NEXT_RING.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % RINGS;
            let mut ring = lock(&RINGS_[i]);
            if ring.thread.is_empty() {
                let cur = std::thread::current();
                let n = cur.name().unwrap_or("thread");
                for c in n.chars() {
                    if ring.thread.push(c).is_err() {
                        break;
                    }
                }
            }
            r.set(i + 1);
        }
        r.get() - 1
    });
    lock(&RINGS_[idx]).events.write(Event {
        ns,
        instr,
        name,
        phase,
    });
}

fn lock(m: &Mutex<Ring>) -> std::sync::MutexGuard<'_, Ring> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Forgets every recorded event (the rings stay claimed).
pub fn clear() {
    for r in &RINGS_ {
        lock(r).events.clear();
    }
}

/// Writes every recorded event as Chrome trace JSON (`{"traceEvents": [...]}`); see the
/// module docs for the layout.
///
/// # Errors
/// Whatever `out` returns.
pub fn write_chrome_json(out: &mut dyn Write) -> io::Result<()> {
    let mut w = io::BufWriter::new(out);
    write!(w, "{{\"displayTimeUnit\":\"ns\",\"traceEvents\":[")?;
    let mut first = true;
    let mut sep = |w: &mut io::BufWriter<&mut dyn Write>| -> io::Result<()> {
        if !std::mem::take(&mut first) {
            w.write_all(b",\n")?;
        }
        Ok(())
    };
    for (tid, r) in RINGS_.iter().enumerate() {
        let ring = lock(r);
        if ring.thread.is_empty() && ring.events.is_empty() {
            continue;
        }
        sep(&mut w)?;
        write!(
            w,
            "{{\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":\"{}\"}}}}",
            escape(&ring.thread)
        )?;
        // Open compute starts, matched with their end on this thread.
        let mut open: Vec<Event> = Vec::new();
        for e in ring.events.oldest_ordered() {
            let us = e.ns as f64 / 1e3;
            match e.phase {
                Phase::ComputeStart => open.push(*e),
                Phase::ComputeEnd => {
                    let start = open
                        .iter()
                        .rposition(|s| s.instr == e.instr)
                        .map(|i| open.swap_remove(i));
                    let (ts, dur) = match start {
                        Some(s) => (s.ns as f64 / 1e3, (e.ns - s.ns) as f64 / 1e3),
                        None => (us, 0.0),
                    };
                    sep(&mut w)?;
                    write!(
                        w,
                        "{{\"ph\":\"X\",\"pid\":1,\"tid\":{tid},\"ts\":{ts:.3},\"dur\":{dur:.3},\"name\":\"{}#{}\",\"cat\":\"compute\",\"args\":{{\"instr\":{},\"phase\":\"compute\",\"start_ns\":{},\"end_ns\":{}}}}}",
                        escape(e.name),
                        e.instr,
                        e.instr,
                        start.map_or(e.ns, |s| s.ns),
                        e.ns
                    )?;
                }
                Phase::Receive | Phase::Dispatch | Phase::Release => {
                    sep(&mut w)?;
                    write!(
                        w,
                        "{{\"ph\":\"i\",\"s\":\"t\",\"pid\":1,\"tid\":{tid},\"ts\":{us:.3},\"name\":\"{} {}#{}\",\"cat\":\"engine\",\"args\":{{\"instr\":{},\"phase\":\"{}\",\"ns\":{}}}}}",
                        e.phase.name(),
                        escape(e.name),
                        e.instr,
                        e.instr,
                        e.phase.name(),
                        e.ns
                    )?;
                }
            }
        }
        // A body still running when the trace was written: an instant at its start.
        for s in open {
            sep(&mut w)?;
            write!(
                w,
                "{{\"ph\":\"i\",\"s\":\"t\",\"pid\":1,\"tid\":{tid},\"ts\":{:.3},\"name\":\"compute_start {}#{}\",\"cat\":\"compute\",\"args\":{{\"instr\":{},\"phase\":\"compute_start\",\"ns\":{}}}}}",
                s.ns as f64 / 1e3,
                escape(s.name),
                s.instr,
                s.instr,
                s.ns
            )?;
        }
    }
    write!(w, "]}}")?;
    w.flush()
}

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o
}
