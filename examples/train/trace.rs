//! A small span recorder for the last epoch of each mode, written as a Chrome / Perfetto
//! trace (`{"traceEvents": [...]}`, open it in ui.perfetto.dev or chrome://tracing).
//!
//! It records what the front end can see: each kernel on the thread that runs it (the
//! VM's worker, the graph runtime's actor threads, or the caller in plain mode), every
//! actor of the lazy graph, and on the caller the `run` (build + submit) and the loss
//! read of each step. The gaps between kernels are the VM's (and the graph runtime's)
//! time. Recording is off (one relaxed load per kernel) except while a mode runs its last
//! epoch.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use ivm::graph::{GraphEvent, Phase};

/// Recording on or off. Relaxed everywhere: the spans themselves go through the mutexes,
/// and a span recorded just before or after the switch is harmless.
static ON: AtomicBool = AtomicBool::new(false);
/// The process id spans are filed under (one per mode).
static PID: AtomicU32 = AtomicU32::new(0);
/// Every thread's span buffer, for the readers. A thread records into its own buffer
/// (an uncontended lock, no allocation once its buffer has grown), so recording costs a
/// kernel about two clock reads: a shared buffer behind one lock, with a name allocated
/// per span, made the traced epoch of plain mode 40 % slower than an untraced one and
/// hid the VM's overhead under the recorder's.
static BUFFERS: Mutex<Vec<Arc<Mutex<Vec<Span>>>>> = Mutex::new(Vec::new());
static T0: OnceLock<Instant> = OnceLock::new();

/// This thread's recorder: its name, its buffer, the span names it interned, and the start
/// times of graph actors' firings in flight on it, by (actor, iteration) (an actor's start
/// and end are traced by the thread that fires it).
struct Local {
    thread: Arc<str>,
    spans: Arc<Mutex<Vec<Span>>>,
    names: HashMap<Box<str>, Arc<str>>,
    starts: HashMap<(Arc<str>, u64), f64>,
}

thread_local! {
    static LOCAL: RefCell<Option<Local>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's recorder, registering it on first use.
fn with_local<R>(f: impl FnOnce(&mut Local) -> R) -> R {
    LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        let local = l.get_or_insert_with(|| {
            let spans = Arc::new(Mutex::new(Vec::with_capacity(4096)));
            lock(&BUFFERS).push(Arc::clone(&spans));
            Local {
                thread: thread_name().into(),
                spans,
                names: HashMap::new(),
                starts: HashMap::new(),
            }
        });
        f(local)
    })
}

impl Local {
    /// `name` as a shared string, allocated once per thread and name.
    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(n) = self.names.get(name) {
            return Arc::clone(n);
        }
        let n: Arc<str> = Arc::from(name);
        self.names.insert(name.into(), Arc::clone(&n));
        n
    }
}

/// Every recorded span, of all threads, in no particular order.
fn all_spans() -> Vec<Span> {
    let buffers: Vec<_> = lock(&BUFFERS).clone();
    buffers.iter().flat_map(|b| lock(b).clone()).collect()
}

/// What a span measures (for the summary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cat {
    /// A numeric kernel (an op of the step, or the data loader's gather).
    Kernel,
    /// The lazy-job protocol actors of the graph runtime (ticks, wait, interface copies,
    /// callbacks).
    Protocol,
    /// The caller building and submitting a step (`VirtualMachine::run`).
    Submit,
    /// The caller waiting in the loss read.
    Read,
    /// Host-to-device copies of a batch (between markers on the copy stream).
    Copy,
    /// Collectives across processes (`--data-parallel`), on the collective stream.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Collective,
}

/// One recorded span.
#[derive(Debug, Clone)]
pub struct Span {
    pid: u32,
    thread: Arc<str>,
    name: Arc<str>,
    cat: Cat,
    ts_us: f64,
    dur_us: f64,
}

/// Microseconds since the first trace call.
pub fn now_us() -> f64 {
    T0.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e6
}

/// `t` on the [`now_us`] clock.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn us_at(t: Instant) -> f64 {
    t.saturating_duration_since(*T0.get_or_init(Instant::now))
        .as_secs_f64()
        * 1e6
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts recording spans under process `pid`.
pub fn start(pid: u32) {
    now_us();
    PID.store(pid, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Stops recording.
pub fn stop() {
    ON.store(false, Ordering::Relaxed);
}

fn thread_name() -> String {
    let t = std::thread::current();
    t.name()
        .map_or_else(|| format!("{:?}", t.id()), str::to_string)
}

/// Whether recording is on.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Records a span from `ts_us` to `end_us` (from [`now_us`]) when recording is on.
pub fn record_span(name: &'static str, cat: Cat, ts_us: f64, end_us: f64) {
    if is_on() {
        record(name, cat, ts_us, end_us);
    }
}

fn record(name: &str, cat: Cat, ts_us: f64, end_us: f64) {
    with_local(|l| {
        let span = Span {
            pid: PID.load(Ordering::Relaxed),
            thread: Arc::clone(&l.thread),
            name: l.intern(name),
            cat,
            ts_us,
            dur_us: end_us - ts_us,
        };
        lock(&l.spans).push(span);
    });
}

/// Records, when recording is on, a span that ran on `thread` from `start` to `end` and
/// was measured there by someone else (ivm-ccl reports its collectives' spans).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn record_at(thread: &str, name: String, cat: Cat, start: Instant, end: Instant) {
    if !is_on() {
        return;
    }
    let span = Span {
        pid: PID.load(Ordering::Relaxed),
        thread: thread.into(),
        name: name.into(),
        cat,
        ts_us: us_at(start),
        dur_us: us_at(end) - us_at(start),
    };
    with_local(|l| lock(&l.spans).push(span));
}

/// Runs `f`, recording it as a span when recording is on.
pub fn span<R>(name: &'static str, cat: Cat, f: impl FnOnce() -> R) -> R {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let t = now_us();
    let r = f();
    record(name, cat, t, now_us());
    r
}

/// The lazy graph's trace sink: pairs each actor's start and end into a span.
pub fn graph_event(e: &GraphEvent<'_>) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let t = now_us();
    let start = with_local(|l| {
        let key = (l.intern(e.actor), e.iteration);
        match e.phase {
            Phase::Start => {
                l.starts.insert(key, t);
                None
            }
            Phase::End => l.starts.remove(&key),
        }
    });
    if let Some(s) = start {
        // Compute kernels are named `{index}:{op}`; the rest are protocol actors.
        let cat = if e.actor.contains(':') {
            Cat::Kernel
        } else {
            Cat::Protocol
        };
        record(e.actor, cat, s, t);
    }
}

/// Microseconds per step spent in each category by process `pid`, over `steps` steps.
pub fn per_step(pid: u32, steps: usize) -> HashMap<Cat, f64> {
    let mut out = HashMap::new();
    for s in all_spans().iter().filter(|s| s.pid == pid) {
        *out.entry(s.cat).or_insert(0.0) += s.dur_us;
    }
    for v in out.values_mut() {
        *v /= steps.max(1) as f64;
    }
    out
}

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

/// Every recorded span of process `pid`: (thread, category, start µs, duration µs).
pub fn spans_of(pid: u32) -> Vec<(String, Cat, f64, f64)> {
    all_spans()
        .iter()
        .filter(|s| s.pid == pid)
        .map(|s| (s.thread.to_string(), s.cat, s.ts_us, s.dur_us))
        .collect()
}

/// Writes every recorded span as a Chrome trace; `processes` names each pid.
pub fn write(path: &std::path::Path, processes: &[(u32, &str)]) -> std::io::Result<usize> {
    let mut events = all_spans();
    events.sort_by(|a, b| a.ts_us.total_cmp(&b.ts_us));
    let mut tids: HashMap<(u32, &str), usize> = HashMap::new();
    let mut out = String::from("{\"traceEvents\":[\n");
    for &(pid, name) in processes {
        let _ = writeln!(
            out,
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{pid},\"tid\":0,\"args\":{{\"name\":\"{}\"}}}},",
            escape(name)
        );
    }
    for s in events.iter() {
        let n = tids.len() + 1;
        let tid = *tids.entry((s.pid, &*s.thread)).or_insert_with(|| {
            let _ = writeln!(
                out,
                "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{n},\"args\":{{\"name\":\"{}\"}}}},",
                s.pid,
                escape(&s.thread)
            );
            n
        });
        let cat = match s.cat {
            Cat::Kernel => "kernel",
            Cat::Protocol => "protocol",
            Cat::Submit => "submit",
            Cat::Read => "read",
            Cat::Copy => "copy",
            Cat::Collective => "collective",
        };
        let _ = writeln!(
            out,
            "{{\"ph\":\"X\",\"name\":\"{}\",\"cat\":\"{cat}\",\"pid\":{},\"tid\":{tid},\"ts\":{:.3},\"dur\":{:.3}}},",
            escape(&s.name),
            s.pid,
            s.ts_us,
            s.dur_us
        );
    }
    // A final metadata record so that every real record can end with a comma.
    out.push_str("{\"ph\":\"M\",\"name\":\"trace_end\",\"pid\":0,\"tid\":0,\"args\":{}}\n]}\n");
    std::fs::write(path, out)?;
    Ok(events.len())
}
