//! Every tuning constant of the VM in one place: spin and poll windows, pool sizes, ring
//! capacities. The user-facing knobs are in `Config`; these are the ones measured once and
//! fixed (each says where it is used and why it has its value).

use std::time::Duration;

// Spinning and yielding while another thread works (the engine token, `engine/drive/`).
/// How long a worker leaves the release of a finished sync access to its caller (who
/// usually comes back and drives the engine within a microsecond) before it drives the
/// engine itself.
pub(crate) const RELEASE_DEFER: Duration = Duration::from_micros(20);

/// How long a submitting caller that found the engine held spins for the holder to hand
/// it over (`EngineToken::acquire_or_want`) before it leaves its input to the holder. A
/// holder hands over at its next step boundary, usually within a microsecond or two.
pub(crate) const HAND_BACK_PATIENCE: Duration = Duration::from_micros(5);

/// A worker whose instructions take at least this long on average (nanoseconds, each
/// counted at most four times this: `kernel_clock.rs`) runs long kernels: the engine's
/// work per instruction (receive, dispatch, release) is then worth moving off that
/// worker, so submitting callers ask it to hand the engine back. The tiny threshold's
/// default, [`TINY_KERNEL_NS`]: kernels under it are cheaper on their callers, kernels over
/// it keep the worker for themselves (at 1 µs, a worker running sub-microsecond kernels
/// one per `run` did the engine's work beside each: `perf_report eager`,
/// docs/perf-2026-12-07.md).
pub(crate) const LONG_KERNEL_NS: u64 = TINY_KERNEL_NS;

/// The default of `Config::tiny_kernel_ns`: a worker whose instructions take less than
/// this on average (nanoseconds, the body's run as the worker times it) runs tiny kernels:
/// handing each to it costs more CPU than running it on its caller (the measurements:
/// `perf_report fused`'s CPU per instruction, docs/perf-2026-12-07.md). Well under the
/// training demo's kernels.
pub(crate) const TINY_KERNEL_NS: u64 = 300;

/// Timed instructions a worker's average needs before it may count as tiny: the average
/// starts at zero and follows a workload within about this many samples.
pub(crate) const TINY_KERNEL_SAMPLES: u32 = 16;

/// How long a caller whose instruction is running (or about to run) on a worker spins,
/// yielding its CPU, before it falls back to the blocking-then-busy wait. Long enough to
/// cover a worker that was just woken (35–50 µs on a 2-vCPU VM) so that its completion
/// never needs a second wake; yielding, so that on a core shared with that worker the
/// worker runs.
pub(crate) const CALLER_YIELD_SPIN: Duration = Duration::from_micros(300);

/// How long a thread waiting for another *running* thread spins with a spin-loop hint only
/// before it starts yielding its CPU (a `sched_yield` costs about as much as a whole
/// hand-over between two running threads, so yielding early only adds latency; yielding
/// later lets a thread that shares the core run).
pub(crate) const PURE_SPIN: Duration = Duration::from_micros(10);

/// How long an idle worker polls its queue with spin-loop hints only, before it backs off
/// to yielding for the rest of its poll window: short, since it does not know whether
/// anyone is about to hand it work (a caller doing back-to-back sync accesses comes back
/// within a microsecond), and on two cores a spinning worker keeps that caller off a CPU.
pub(crate) const WORKER_PURE_SPIN: Duration = Duration::from_micros(2);

/// A caller waiting behind other instructions keeps spinning (yielding) only while some
/// instruction was released within this long. Sleeping costs the instruction's finisher a
/// futex wake on its critical path (about 30 µs of syscall on this KVM, seen as a gap
/// before the next kernel in the training demo's trace) and the caller as much again to
/// wake, so a kernel of up to this long in front is spun through; a longer one is long
/// work, and the caller sleeps having spent at most this much. At 50 µs, the demo with
/// `--hidden 1024` (forward matmuls of 45–60 µs) paid the wake every step: eager +18 to
/// +23 % against +3 to +11 % at 200 µs (interleaved runs; 100 µs was in between).
pub(crate) const CALLER_STALL: Duration = Duration::from_micros(200);

/// ... and at most this long in all before it sleeps.
pub(crate) const CALLER_PROGRESS_SPIN: Duration = Duration::from_millis(1);

/// How long a waiting caller in multi-thread mode watches a lazy graph that offers to run
/// on it (`LazyGraph::set_caller_helper`) make no progress before it runs the graph's
/// ready work itself, on a machine counted as quiet (`doors/lazy/vm_lazy.rs`,
/// `HelpGate`). Shorter than `CALLER_STALL`, after which the caller stops spinning;
/// longer than a sleeping graph thread takes to wake and start.
pub(crate) const GRAPH_HELP_PATIENCE: Duration = Duration::from_micros(50);

/// How long a look that found no busy thread beside the VM's (`engine/neighbours.rs`)
/// keeps the machine counted as quiet (`VmCore::neighbours_quiet_until`). Long against the
/// looks' spacing (`LOOK_EVERY`, and a VM whose callers call rarely looks rarely): a
/// look that finds a busy thread ends it at once.
pub(crate) const QUIET_NEIGHBOURS_HOLD: Duration = Duration::from_secs(1);

// Sensing a shared CPU (`engine/preemption.rs`).
/// A gap between two looks at the clock of a spinning thread at least this long means the
/// thread was descheduled: the looks are a few spin or yield steps apart (well under
/// 50 µs even when every step yields), while the kernel takes a CPU from a thread for a
/// tick or a scheduling slice (a millisecond or more).
pub(crate) const PREEMPTED_GAP: Duration = Duration::from_micros(200);

/// How long a thread that saw itself preempted counts its CPU as shared: it polls no more
/// (a worker parks at once when idle, a caller sleeps instead of spinning) until this long
/// after the last preemption it saw. Long against a slice, so that a busy neighbour keeps
/// it in that mode; short enough that a one-off preemption on a quiet machine costs a few
/// wake-ups only.
pub(crate) const CONTENDED_HOLD: Duration = Duration::from_millis(20);

/// How long a worker that a waiting caller found awake but off its CPU stays marked
/// contended: callers run its stream's kernels themselves meanwhile. Each detection costs
/// the caller a stall (and the wait for the worker to be scheduled: up to a scheduling
/// slice), so the hold is long against that; a wrong detection on a quiet machine costs
/// this long of synchronous execution, which is the floor the VM degrades to anyway.
pub(crate) const STALLED_WORKER_HOLD: Duration = Duration::from_millis(100);

/// How long a worker bound to its caller's one CPU counts as sharing it, from each look of
/// the caller's (`engine/preemption.rs`, `sense_caller`, a window apart): long against
/// that window, so the mark holds while the binding does; a binding that changes is seen
/// within this long.
pub(crate) const SAME_CPU_HOLD: Duration = Duration::from_millis(100);

/// How long a contended worker first sleeps before it looks at its queue on its own
/// (`model/thread_ctx.rs`, "A worker that wakes itself"): the longest a push nobody waits
/// for may wait to start while the worker shares its CPU and its callers leave it work.
/// Short against the slices a busy neighbour takes (milliseconds), long against a wake's
/// cost (a few microseconds).
pub(crate) const WORKER_DOZE: Duration = Duration::from_micros(500);

/// The longest doze of a contended worker bound to its callers' one CPU: each doze that
/// ends at its deadline with nothing queued (its callers ran everything) doubles the next,
/// up to this; a doze that finds work, or a wake, starts again at [`WORKER_DOZE`]. At a fixed 500 µs, three
/// workers per rank of two ranks bound to one CPU each woke about 12 000 times a second
/// between them, each wake taking the CPU from the caller that ran their work.
pub(crate) const WORKER_DOZE_MAX: Duration = Duration::from_millis(8);

/// How long an idle worker (one that does not share its CPU) sleeps per doze after its
/// poll window, before it looks at its queue on its own (ARCHITECTURE.md, "An idle worker
/// dozes first"): the longest a caller's push nobody waits for may wait to start in that
/// stretch. Comparable to what a wake-up of a sleeping thread takes to reach it on a small
/// VM (tens of microseconds), long against the wake's own cost to the pusher.
pub(crate) const IDLE_DOZE: Duration = Duration::from_micros(100);

/// A caller's push that makes this many instructions queued together to a worker in an
/// idle doze wakes it (`ThreadCtx::submit`): fewer are left to the caller's next wait (an
/// op then a read, whose caller runs the op and empties the queue again), more are a
/// stream of work the worker should start on while the caller submits the rest (without
/// it, the training demo's first step after each pause between epochs ran on its caller
/// after all its submissions: docs/perf-2026-12-07.md).
pub(crate) const IDLE_BURST: usize = 4;

/// How many idle dozes a worker takes after its poll window before it sleeps without a
/// deadline: `IDLE_DOZES * IDLE_DOZE` of idle after its last work, at a few timer
/// wake-ups per millisecond; after that, an idle VM costs nothing.
pub(crate) const IDLE_DOZES: u32 = 20;

/// How long a worker dozes no more when idle after a push left to its deadline had to
/// wait for it (its caller did not wait for it): pushes wake the worker meanwhile.
pub(crate) const IDLE_DOZE_OFF: Duration = Duration::from_millis(100);

// The instruction pool (`pool.rs`).
/// Most released instructions a VM keeps for reuse.
pub(crate) const POOL_MAX: usize = 4096;

/// Most released instructions still shared by their executor that the engine keeps
/// retrying to pool (see `InstrPool::give_back`).
pub(crate) const RETRY_MAX: usize = 256;

/// Instructions the pool makes at once the first time it runs dry (so that a steady state
/// with fewer lively instructions never allocates, whatever the timing).
pub(crate) const PREFILL: usize = 256;

// The engine wrapper (`engine/mod.rs`).
/// Lively instructions the engine's pools are sized for up front (a steady state below
/// this allocates nothing, deterministically).
pub(crate) const PRESIZE: u32 = 256;

// The scheduler thread (`scheduler.rs`).
/// How often registered probes are polled when the scheduler has no work window.
pub(crate) const PROBE_POLL: Duration = Duration::from_micros(100);

// Sync small accesses (`sync_access.rs`).
/// How long the engine's holder spins (spin-loop hints only) for a polling worker to take
/// a small access it posted to the worker's express lane (`express.rs`): a worker polling
/// on another CPU takes it well within this.
pub(crate) const EXPRESS_PURE_SPIN: Duration = Duration::from_micros(1);

/// ... and how long in all, yielding its CPU between looks after the spin (a worker that
/// shares the poster's CPU runs then), before it withdraws the access and takes the
/// instruction path. Longer means the worker is not running, and the holder keeps every
/// other submitter waiting meanwhile. Measured: with 5 µs of spinning and no yield, a
/// worker sharing the caller's vCPU missed 1 164–2 135 of 20 000 back-to-back reads in
/// some runs of `perf_report warm`, each then costing about 25 µs.
pub(crate) const EXPRESS_PATIENCE: Duration = Duration::from_micros(20);

/// Most reusable instructions per ring slot (`Config::sync_ring_capacity` ≤ this).
pub const RING_MAX: usize = 16;

/// Ring slots per thread (one per (VM, stream, kind) recently used; oldest evicted).
pub(crate) const SLOTS: usize = 8;
