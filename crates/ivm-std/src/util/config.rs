//! VM configuration, with defaults and `IVM_*` environment overrides.

use std::time::Duration;

use crate::util::error::{Error, Result};

/// How the VM runs its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// One scheduler thread plus worker threads (the default).
    #[default]
    MultiThread,
    /// The whole engine runs in the calling thread, inside `run`, `sync*` and friends: no VM
    /// threads at all (tests, forked children, embedded use).
    SingleThread,
}

/// Configuration of a [`VirtualMachine`](crate::VirtualMachine).
///
/// Every field has an `IVM_*` environment variable read by [`Config::from_env`]:
///
/// | variable | field | default |
/// |---|---|---|
/// | `IVM_MODE` (`multi` / `single`) | [`mode`](Self::mode) | `multi` |
/// | `IVM_WORKER_POLL_US` | [`worker_poll_window`](Self::worker_poll_window) | 200 (100 below 4 cores) |
/// | `IVM_SCHEDULER_WINDOW_US` | [`scheduler_work_window`](Self::scheduler_work_window) | 1000 (0 below 4 cores) |
/// | `IVM_HIGH_WATER` | [`high_water_mark`](Self::high_water_mark) | 65536 |
/// | `IVM_LOW_WATER` | [`low_water_mark`](Self::low_water_mark) | 32768 |
/// | `IVM_CONTENDED_HIGH_WATER` | [`contended_high_water_mark`](Self::contended_high_water_mark) | 16 |
/// | `IVM_SKIP_THRESHOLD` | [`skip_blocking_threshold`](Self::skip_blocking_threshold) | 2 |
/// | `IVM_TIMEOUT_MS` | [`timeout_period`](Self::timeout_period) | 30000 |
/// | `IVM_PENDING_WINDOW` | [`pending_window`](Self::pending_window) | 256 |
/// | `IVM_RING` | [`sync_ring_capacity`](Self::sync_ring_capacity) | 8 |
/// | `IVM_STREAM_WAIT` (`1` / `0`) | [`stream_wait`](Self::stream_wait) | `1` |
/// | `IVM_INLINE_SYNC` (`1` / `0`) | [`inline_sync_access`](Self::inline_sync_access) | `1` |
/// | `IVM_TRACE` (`1` / `0`) | [`trace`](Self::trace) | `0` |
/// | `IVM_CACHING_ALLOC` (`1` / `0`) | [`caching_allocator`](Self::caching_allocator) | `1` |
/// | `IVM_FUSION` (`1` / `0`) | [`fusion`](Self::fusion) | `0` |
/// | `IVM_MAX_FUSED_RUN` | [`max_fused_run`](Self::max_fused_run) | 32 |
/// | `IVM_RUN_AT_REST` (`1` / `0`) | [`run_at_rest`](Self::run_at_rest) | `1` |
/// | `IVM_TINY_KERNEL_NS` | [`tiny_kernel_ns`](Self::tiny_kernel_ns) | 300 |
///
/// `Config` is `#[non_exhaustive]`: start from [`Config::default`] (or
/// [`Config::single_thread`], [`Config::from_env`]) and change what you need with the
/// `with_*` setters or by assigning fields, so that a field added later breaks nobody:
///
/// ```
/// use std::time::Duration;
/// use ivm_std::{Config, Mode};
///
/// let config = Config::default()
///     .with_mode(Mode::SingleThread)
///     .with_timeout_period(Duration::from_secs(5));
/// assert_eq!(config.mode, Mode::SingleThread);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Multi-thread (scheduler + workers) or single-thread mode.
    pub mode: Mode,
    /// How long a worker keeps polling its queue after running something before it blocks
    /// on its notifier. At most [`MAX_POLL_WINDOW`] ([`validate`](Self::validate)): a
    /// polling worker notices shutdown only when its window ends.
    pub worker_poll_window: Duration,
    /// How long the scheduler keeps working (polling for input and completions) after its
    /// last progress before it parks. At most [`MAX_POLL_WINDOW`].
    pub scheduler_work_window: Duration,
    /// When more instructions than this are in flight, `run` blocks (backpressure) ...
    pub high_water_mark: usize,
    /// ... until fewer than this are in flight.
    pub low_water_mark: usize,
    /// Backpressure on a busy machine. While busy neighbours take the VM's CPUs
    /// (ARCHITECTURE.md, "When another thread takes a core": its workers then doze and a
    /// caller's pushes leave their wakes to the dozes' deadlines), a
    /// [`run`](crate::VirtualMachine::run) (or `run_async`) that finds more than this many
    /// instructions in flight submits its own, then runs, on its thread and inside the
    /// wait hook, what sleeping contended workers have queued before it (whichever thread built it,
    /// in queue order, on the streams a waiting caller may run), rather than leave it to a
    /// worker that would take turns with the caller on the CPU left. Its own kernels still
    /// run after it returns, and the timed doors and the async reads and writes never do
    /// this (`run_async` does, as a `run`); but a queued kernel that waits for something
    /// its caller does later would then hold up the `run` that caught up with it, for
    /// ever: for such work, `usize::MAX` turns this off.
    pub contended_high_water_mark: usize,
    /// A sync access skips the blocking phase of its wait (notify-skip) when fewer than this
    /// many instructions are in flight right after it was received.
    pub skip_blocking_threshold: usize,
    /// A blocking wait fails with [`Error::Timeout`] when no instruction at all finished
    /// during one whole period. Any positive value: one too long for the clock (up to
    /// `Duration::MAX`) makes every deadline derived from it a year away, so it means "no
    /// timeout". A waiting caller that runs a sleeping worker's queued kernels itself
    /// (ARCHITECTURE.md, "Who may drive the engine") is progress: it returns when they
    /// end, however long they take.
    pub timeout_period: Duration,
    /// How many received instructions the engine handles per step before it dispatches and
    /// releases (keeps latency bounded under a flood).
    pub pending_window: usize,
    /// Reusable sync-access instructions kept per (thread, VM, stream, kind); at most
    /// [`RING_MAX`](crate::RING_MAX). Default 8: a caller returns before the engine
    /// releases its instruction, so a few entries are still held when the next access
    /// starts (4 allocated now and then on a loaded 2-core machine).
    pub sync_ring_capacity: usize,
    /// Soft sync may order two streams of one device on the device (record an event on
    /// one, make the other wait for it). When `false`, soft sync only records events that
    /// the scheduler observes on the host (OneFlow's `ONEFLOW_VM_ENABLE_STREAM_WAIT=0`).
    pub stream_wait: bool,
    /// A small sync access (`read_small` / `write_small`) whose
    /// instruction is ready when the engine handles it — every producer of the tensor
    /// released, nothing else dispatched on the stream, a synchronous device, host-visible
    /// memory — runs in the thread that drives the engine (usually the caller itself)
    /// instead of being handed to the stream's worker: no thread wake at all. `false`
    /// hands it to the worker: with nothing in flight and the worker polling, through the
    /// worker's express lane (no instruction; ARCHITECTURE.md, "The express lane"), else
    /// as an instruction, which a caller waiting for it still runs itself while the worker
    /// sleeps (a stream policy that allows it). The benchmarks use this to time the
    /// worker path.
    pub inline_sync_access: bool,
    /// Turns on [`crate::model::trace`] recording (process-wide) when the VM starts.
    pub trace: bool,
    /// Every stream allocates its tensors through a caching allocator with size-class bins
    /// ([`crate::device::alloc_cache`]): memory freed on a stream is reused by later tensors of
    /// that stream without going back to the device allocator. `false`: tensors are
    /// allocated and freed by the device allocator directly.
    pub caching_allocator: bool,
    /// Instruction fusion (ARCHITECTURE.md, "Fused runs"): consecutive ready instructions
    /// of one worker stream are dispatched as one run, queued to the worker as one item and
    /// run back to back, each still done, poisoned, traced and released on its own.
    /// Nothing observable changes but the cost per instruction. An instruction opts out
    /// with [`InstructionsBuilder::set_fusable`](crate::InstructionsBuilder::set_fusable).
    /// Off by default (ARCHITECTURE.md, "Fused runs", says why).
    pub fusion: bool,
    /// The longest fused run, in instructions (1..=[`MAX_FUSED_RUN`]): bounds how long one
    /// hand-over holds a worker and how long a run's first member may wait for its
    /// release.
    pub max_fused_run: usize,
    /// Single-thread mode: a [`run`](crate::VirtualMachine::run) whose instructions would
    /// all run to completion on the caller the moment they were dispatched (kernels and
    /// copies on a synchronous device's stream, no sync access, barrier or custom
    /// instruction) runs them as it returns without the dependency engine, when nothing
    /// else is in flight: the engine would find no dependence to order and run them in
    /// build order on the same thread. Nothing observable changes but the cost per
    /// instruction ([`VmStats::ran_at_rest`](crate::VmStats::ran_at_rest) counts them).
    ///
    /// Multi-thread mode: the same, for kernels a caller may run on streams whose worker
    /// found them tiny ([`tiny_kernel_ns`](Self::tiny_kernel_ns)), or whose callers the VM
    /// counts as short of CPUs beside busy threads (ARCHITECTURE.md, "When another thread
    /// takes a core"): such a `run` runs its
    /// kernels on its caller before it returns, as single-thread mode does, where it would
    /// otherwise return before they started. Meanwhile the engine waits for them: a kernel
    /// that waits for something its caller does after `run` returns, or for a lock held by
    /// a thread that waits for the VM outside the wait hook ([`WaitHook`]), would wait for
    /// ever. Turn this off (or `tiny_kernel_ns`) for such a workload.
    ///
    /// [`WaitHook`]: crate::WaitHook
    pub run_at_rest: bool,
    /// Multi-thread mode: a worker whose instructions take less than this on average
    /// (nanoseconds, as it times a random sample of them) leaves them to its callers, as a
    /// worker that shares its CPU does (ARCHITECTURE.md, "When another thread takes a
    /// core"): handing such work to another core costs more CPU than running it. It stops
    /// polling for a while, a caller's pushes leave its wake to its doze's deadline (work
    /// nobody waits for starts up to 0.5 ms late), and the callers run its queue at their
    /// waits and, past [`contended_high_water_mark`](Self::contended_high_water_mark) in
    /// flight, at their submissions ([`VmStats::tiny_kernel_marks`] counts the marks); with
    /// nothing else in flight a `run` of them runs them itself
    /// ([`run_at_rest`](Self::run_at_rest)). Only on streams whose policy lets a caller
    /// run them. 0 turns this off, which a workload needs whose short kernels wait for
    /// something their caller does later.
    ///
    /// [`VmStats::tiny_kernel_marks`]: crate::VmStats::tiny_kernel_marks
    pub tiny_kernel_ns: u64,
}

/// The largest [`Config::max_fused_run`].
pub const MAX_FUSED_RUN: usize = 1024;

/// Setters: each returns the configuration with one field changed.
impl Config {
    /// This configuration with [`mode`](Self::mode) set to `mode`.
    #[must_use]
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// This configuration with [`worker_poll_window`](Self::worker_poll_window) set to `worker_poll_window`.
    #[must_use]
    pub fn with_worker_poll_window(mut self, worker_poll_window: Duration) -> Self {
        self.worker_poll_window = worker_poll_window;
        self
    }

    /// This configuration with [`scheduler_work_window`](Self::scheduler_work_window) set to `scheduler_work_window`.
    #[must_use]
    pub fn with_scheduler_work_window(mut self, scheduler_work_window: Duration) -> Self {
        self.scheduler_work_window = scheduler_work_window;
        self
    }

    /// This configuration with [`high_water_mark`](Self::high_water_mark) set to `high_water_mark`.
    #[must_use]
    pub fn with_high_water_mark(mut self, high_water_mark: usize) -> Self {
        self.high_water_mark = high_water_mark;
        self
    }

    /// This configuration with [`low_water_mark`](Self::low_water_mark) set to `low_water_mark`.
    #[must_use]
    pub fn with_low_water_mark(mut self, low_water_mark: usize) -> Self {
        self.low_water_mark = low_water_mark;
        self
    }

    /// This configuration with [`contended_high_water_mark`](Self::contended_high_water_mark)
    /// set to `contended_high_water_mark`.
    #[must_use]
    pub fn with_contended_high_water_mark(mut self, contended_high_water_mark: usize) -> Self {
        self.contended_high_water_mark = contended_high_water_mark;
        self
    }

    /// This configuration with [`skip_blocking_threshold`](Self::skip_blocking_threshold) set to `skip_blocking_threshold`.
    #[must_use]
    pub fn with_skip_blocking_threshold(mut self, skip_blocking_threshold: usize) -> Self {
        self.skip_blocking_threshold = skip_blocking_threshold;
        self
    }

    /// This configuration with [`timeout_period`](Self::timeout_period) set to `timeout_period`.
    #[must_use]
    pub fn with_timeout_period(mut self, timeout_period: Duration) -> Self {
        self.timeout_period = timeout_period;
        self
    }

    /// This configuration with [`pending_window`](Self::pending_window) set to `pending_window`.
    #[must_use]
    pub fn with_pending_window(mut self, pending_window: usize) -> Self {
        self.pending_window = pending_window;
        self
    }

    /// This configuration with [`sync_ring_capacity`](Self::sync_ring_capacity) set to `sync_ring_capacity`.
    #[must_use]
    pub fn with_sync_ring_capacity(mut self, sync_ring_capacity: usize) -> Self {
        self.sync_ring_capacity = sync_ring_capacity;
        self
    }

    /// This configuration with [`stream_wait`](Self::stream_wait) set to `stream_wait`.
    #[must_use]
    pub fn with_stream_wait(mut self, stream_wait: bool) -> Self {
        self.stream_wait = stream_wait;
        self
    }

    /// This configuration with [`inline_sync_access`](Self::inline_sync_access) set to `inline_sync_access`.
    #[must_use]
    pub fn with_inline_sync_access(mut self, inline_sync_access: bool) -> Self {
        self.inline_sync_access = inline_sync_access;
        self
    }

    /// This configuration with [`trace`](Self::trace) set to `trace`.
    #[must_use]
    pub fn with_trace(mut self, trace: bool) -> Self {
        self.trace = trace;
        self
    }

    /// This configuration with [`caching_allocator`](Self::caching_allocator) set to `caching_allocator`.
    #[must_use]
    pub fn with_caching_allocator(mut self, caching_allocator: bool) -> Self {
        self.caching_allocator = caching_allocator;
        self
    }

    /// This configuration with [`fusion`](Self::fusion) set to `fusion`.
    #[must_use]
    pub fn with_fusion(mut self, fusion: bool) -> Self {
        self.fusion = fusion;
        self
    }

    /// This configuration with [`max_fused_run`](Self::max_fused_run) set to `max_fused_run`.
    #[must_use]
    pub fn with_max_fused_run(mut self, max_fused_run: usize) -> Self {
        self.max_fused_run = max_fused_run;
        self
    }

    /// This configuration with [`run_at_rest`](Self::run_at_rest) set to `run_at_rest`.
    #[must_use]
    pub fn with_run_at_rest(mut self, run_at_rest: bool) -> Self {
        self.run_at_rest = run_at_rest;
        self
    }

    /// This configuration with [`tiny_kernel_ns`](Self::tiny_kernel_ns) set to
    /// `tiny_kernel_ns` (0: off).
    #[must_use]
    pub fn with_tiny_kernel_ns(mut self, tiny_kernel_ns: u64) -> Self {
        self.tiny_kernel_ns = tiny_kernel_ns;
        self
    }
}

/// The longest [`Config::worker_poll_window`] and [`Config::scheduler_work_window`]: a
/// window is a spin that trades a core for wake-up latency, worth microseconds to
/// milliseconds; a longer one only burns the core (and delays shutdown by up to a
/// worker's window).
pub const MAX_POLL_WINDOW: Duration = Duration::from_secs(1);

/// Hardware threads below which the default scheduler window is zero and the default worker
/// poll window shorter (see [`Config::default`]).
pub const SPIN_WINDOW_MIN_CORES: usize = 4;

impl Default for Config {
    /// The defaults. The windows are the original design's (200 µs worker poll, 1 ms
    /// scheduler window) on machines with at least [`SPIN_WINDOW_MIN_CORES`] hardware threads.
    /// Below, the scheduler window is zero (callers and workers drive the engine
    /// themselves, see `engine/drive/`, so the scheduler thread has nothing to poll for) and the
    /// worker polls for 100 µs, yielding its CPU after a few spins: measured on a loaded
    /// 2-vCPU machine, a zero poll window made every cross-thread hand-over a futex wake
    /// (a two-stream chain ran at ≈65 K instructions/s, ≈860 K/s with the window), while
    /// pure-spin windows on three threads (caller, scheduler, worker) starved the caller.
    fn default() -> Self {
        let many_cores =
            std::thread::available_parallelism().map_or(1, usize::from) >= SPIN_WINDOW_MIN_CORES;
        let (poll, window) = if many_cores {
            (Duration::from_micros(200), Duration::from_millis(1))
        } else {
            (Duration::from_micros(100), Duration::ZERO)
        };
        Self {
            mode: Mode::MultiThread,
            worker_poll_window: poll,
            scheduler_work_window: window,
            high_water_mark: 65536,
            low_water_mark: 32768,
            contended_high_water_mark: 16,
            skip_blocking_threshold: 2,
            timeout_period: Duration::from_secs(30),
            pending_window: 256,
            sync_ring_capacity: 8,
            stream_wait: true,
            inline_sync_access: true,
            trace: false,
            caching_allocator: true,
            fusion: false,
            max_fused_run: 32,
            run_at_rest: true,
            tiny_kernel_ns: crate::util::tuning::TINY_KERNEL_NS,
        }
    }
}

impl Config {
    /// The single-thread configuration (defaults otherwise).
    pub fn single_thread() -> Self {
        Self {
            mode: Mode::SingleThread,
            ..Self::default()
        }
    }

    /// The defaults, overridden by every `IVM_*` variable that is set (see the table on
    /// [`Config`]). An unparsable value is an [`Error::Config`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`], reading variables through `get` (testable without
    /// touching the process environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut c = Self::default();
        if let Some(v) = get("IVM_MODE") {
            c.mode = match v.trim().to_ascii_lowercase().as_str() {
                "multi" | "multi-thread" | "multithread" => Mode::MultiThread,
                "single" | "single-thread" | "singlethread" => Mode::SingleThread,
                _ => {
                    return Err(Error::Config(format!(
                        "IVM_MODE={v:?}: expected `multi` or `single`"
                    )));
                }
            };
        }
        let num = |k: &str| -> Result<Option<u64>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|e| Error::Config(format!("{k}={v:?}: {e}"))),
            }
        };
        if let Some(v) = num("IVM_WORKER_POLL_US")? {
            c.worker_poll_window = Duration::from_micros(v);
        }
        if let Some(v) = num("IVM_SCHEDULER_WINDOW_US")? {
            c.scheduler_work_window = Duration::from_micros(v);
        }
        if let Some(v) = num("IVM_HIGH_WATER")? {
            c.high_water_mark = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_LOW_WATER")? {
            c.low_water_mark = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_CONTENDED_HIGH_WATER")? {
            c.contended_high_water_mark = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_SKIP_THRESHOLD")? {
            c.skip_blocking_threshold = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_TIMEOUT_MS")? {
            c.timeout_period = Duration::from_millis(v);
        }
        if let Some(v) = num("IVM_PENDING_WINDOW")? {
            c.pending_window = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_RING")? {
            c.sync_ring_capacity = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_STREAM_WAIT")? {
            c.stream_wait = match v {
                0 => false,
                1 => true,
                _ => {
                    return Err(Error::Config(format!(
                        "IVM_STREAM_WAIT={v}: expected 0 or 1"
                    )));
                }
            };
        }
        let flag = |k: &str, v: u64| match v {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Error::Config(format!("{k}={v}: expected 0 or 1"))),
        };
        if let Some(v) = num("IVM_INLINE_SYNC")? {
            c.inline_sync_access = flag("IVM_INLINE_SYNC", v)?;
        }
        if let Some(v) = num("IVM_TRACE")? {
            c.trace = flag("IVM_TRACE", v)?;
        }
        if let Some(v) = num("IVM_CACHING_ALLOC")? {
            c.caching_allocator = flag("IVM_CACHING_ALLOC", v)?;
        }
        if let Some(v) = num("IVM_FUSION")? {
            c.fusion = flag("IVM_FUSION", v)?;
        }
        if let Some(v) = num("IVM_MAX_FUSED_RUN")? {
            c.max_fused_run = usize::try_from(v).unwrap_or(usize::MAX);
        }
        if let Some(v) = num("IVM_RUN_AT_REST")? {
            c.run_at_rest = flag("IVM_RUN_AT_REST", v)?;
        }
        if let Some(v) = num("IVM_TINY_KERNEL_NS")? {
            c.tiny_kernel_ns = v;
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the invariants between fields.
    pub fn validate(&self) -> Result<()> {
        if self.low_water_mark == 0 || self.low_water_mark > self.high_water_mark {
            return Err(Error::Config(format!(
                "need 0 < low_water_mark ({}) <= high_water_mark ({})",
                self.low_water_mark, self.high_water_mark
            )));
        }
        if self.pending_window == 0 {
            return Err(Error::Config("pending_window must be at least 1".into()));
        }
        if self.timeout_period.is_zero() {
            return Err(Error::Config("timeout_period must be positive".into()));
        }
        for (name, window) in [
            ("worker_poll_window", self.worker_poll_window),
            ("scheduler_work_window", self.scheduler_work_window),
        ] {
            if window > MAX_POLL_WINDOW {
                return Err(Error::Config(format!(
                    "{name} ({window:?}) must be at most {MAX_POLL_WINDOW:?}"
                )));
            }
        }
        if self.sync_ring_capacity == 0 || self.sync_ring_capacity > crate::util::tuning::RING_MAX {
            return Err(Error::Config(format!(
                "sync_ring_capacity must be in 1..={}",
                crate::util::tuning::RING_MAX
            )));
        }
        if self.max_fused_run == 0 || self.max_fused_run > MAX_FUSED_RUN {
            return Err(Error::Config(format!(
                "max_fused_run must be in 1..={MAX_FUSED_RUN}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides() {
        let c = Config::from_lookup(|k| match k {
            "IVM_MODE" => Some("single".into()),
            "IVM_WORKER_POLL_US" => Some("50".into()),
            "IVM_TIMEOUT_MS" => Some("1500".into()),
            "IVM_TINY_KERNEL_NS" => Some("0".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.mode, Mode::SingleThread);
        assert_eq!(c.worker_poll_window, Duration::from_micros(50));
        assert_eq!(c.timeout_period, Duration::from_millis(1500));
        assert_eq!(c.tiny_kernel_ns, 0);
        assert_eq!(Config::default().tiny_kernel_ns, 300);
        assert_eq!(c.high_water_mark, Config::default().high_water_mark);
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(matches!(
            Config::from_lookup(|k| (k == "IVM_MODE").then(|| "x".into())),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            Config::from_lookup(|k| (k == "IVM_HIGH_WATER").then(|| "-1".into())),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            Config::from_lookup(|k| (k == "IVM_LOW_WATER").then(|| "0".into())),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            Config::from_lookup(|k| (k == "IVM_FUSION").then(|| "2".into())),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            Config::from_lookup(|k| (k == "IVM_MAX_FUSED_RUN").then(|| "0".into())),
            Err(Error::Config(_))
        ));
        let c = Config::from_lookup(|k| match k {
            "IVM_FUSION" => Some("1".into()),
            "IVM_MAX_FUSED_RUN" => Some("7".into()),
            _ => None,
        })
        .unwrap();
        assert!(c.fusion && c.max_fused_run == 7);
    }
}
