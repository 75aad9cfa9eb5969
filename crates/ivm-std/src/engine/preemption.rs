//! Whether the machine takes this thread's CPU away: a thread that spins or polls reads
//! its clock every few steps, and a gap between two looks far longer than the steps take
//! means it was descheduled — another thread (of this process or another) wants its CPU.
//!
//! Spinning is only worth it while the threads involved each have a CPU. Where they do
//! not, a polling worker keeps its CPU from whoever preempted it (the caller it waits
//! for, or a busy neighbour that the kernel then runs for a whole slice when the worker
//! yields), and a parked one is woken with the scheduler's wake-up preference. So a
//! worker that sees itself preempted parks at once when idle, for a while
//! ([`CONTENDED_HOLD`]), and a spinning caller stops spinning and sleeps; a caller whose
//! worker sleeps runs the worker's queue itself (`worker::caller_runs`): under
//! contention the VM degrades to the caller doing the work. Kernels are never moved to
//! the submitting caller at dispatch: `run` returns before its kernels run, and a kernel
//! may wait for what its caller does next
//! (`engine::tests::a_contended_worker_still_runs_kernels_after_run_returns`).
//!
//! A waiting caller also watches the workers it waits for: when no instruction was
//! released for a while ([`CALLER_STALL`](crate::util::tuning::CALLER_STALL)), a worker
//! that is not parked and got less than half of that time on a CPU (its thread's CPU
//! clock, read from the caller) is waiting for a CPU, not computing: it is marked
//! contended ([`WorkerWatch`]): it then parks as soon as it is idle, so that callers
//! waiting for its queue run it themselves.

use std::time::{Duration, Instant};

use ivm_core::sync::Ordering;

use crate::engine::core::VmCore;
use crate::model::thread_ctx::ThreadCtx;
use crate::util::tuning::{
    CONTENDED_HOLD, PREEMPTED_GAP, QUIET_NEIGHBOURS_HOLD, SAME_CPU_HOLD, STALLED_WORKER_HOLD,
};

/// Marks the worker of `ctx` contended for `hold` from now.
pub(crate) fn mark_contended(ctx: &ThreadCtx, hold: Duration) {
    ctx.contended_until.hold_for(hold);
}

/// A worker whose instructions are tiny (`kernel_clock.rs`, `Config::tiny_kernel_ns`) is
/// marked contended for `hold` (the worker's own mark: [`CONTENDED_HOLD`]), as one that
/// shares its CPU: it stops polling, a caller's pushes leave its wake to its doze's
/// deadline, and its callers run its queue, at their waits and, through the VM's hint
/// here, at their next submissions (`VmCore::catch_up_when_contended`). Handing an instruction to a thread on another
/// core costs more CPU than running it where it was built (ARCHITECTURE.md, "When
/// another thread takes a core"). A `run` of such kernels with nothing else in flight runs
/// them itself (`ThreadCtx::tiny_until`, `engine/at_rest.rs`), and keeps the tiny mark
/// (not the contended one) while they stay tiny. The worker does not extend a mark: it
/// lapses, and is renewed only if what the worker runs next is still tiny.
pub(crate) fn mark_tiny_kernels(ctx: &ThreadCtx, shared: &VmCore, hold: Duration) {
    // Marked already: no write to the lines every submission reads (the mark is renewed
    // when it has lapsed and the worker finds its instructions tiny again).
    let now = crate::util::now_us();
    if ctx.contended_until.holds_at(now)
        && ctx.tiny_until.holds_at(now)
        && shared.tiny_kernels_until.holds_at(now)
    {
        return;
    }
    mark_contended(ctx, hold);
    ctx.tiny_until.hold_for(hold);
    shared.tiny_kernels_until.hold_for(hold);
    // Relaxed: a statistic.
    shared
        .stats()
        .tiny_kernel_marks
        .fetch_add(1, Ordering::Relaxed);
}

/// Whether the worker of `ctx` counts as sharing its CPU now.
pub(crate) fn is_contended(ctx: &ThreadCtx) -> bool {
    ctx.contended_until.holds()
}

/// The one CPU the calling thread may run on, when its affinity mask allows exactly one
/// (Linux, not under Miri): `mpirun` binds each rank so, as does `taskset -c N`.
fn sole_cpu() -> Option<usize> {
    sole_cpu_of(0)
}

/// [`sole_cpu`] of thread `tid` of this process (0: the calling thread).
fn sole_cpu_of(tid: usize) -> Option<usize> {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        let tid = libc::pid_t::try_from(tid).ok()?;
        // SAFETY: `cpu_set_t` is plain data; all-zero (the empty set) is a valid value.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `tid` is 0 (the calling thread) or a thread id; `set` is a valid
        // out-pointer of the size passed. A thread that is gone fails the call.
        if unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            != 0
        {
            return None;
        }
        // SAFETY: `set` is initialised (zeroed, then filled by the kernel); the index is
        // below `CPU_SETSIZE`, the set's size in bits.
        let cpus = (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) });
        let mut cpus = cpus.take(2);
        match (cpus.next(), cpus.next()) {
            (Some(c), None) => Some(c),
            _ => None,
        }
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    {
        let _ = tid;
        None
    }
}

/// The calling thread (a worker) records in `ctx` the one CPU it may run on, if its
/// affinity allows one only ([`sense_caller`] compares it with its caller's).
pub(crate) fn note_sole_cpu(ctx: &ThreadCtx) {
    // Relaxed: a hint read by callers (`sense_caller`), for the marks it sets.
    ctx.sole_cpu
        .store(sole_cpu().map_or(0, |c| c + 1), Ordering::Relaxed);
}

/// The involuntary context switches of the calling thread so far (Linux, not under Miri):
/// the times the kernel switched it out while it could have run on.
fn involuntary_switches() -> Option<i64> {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        // SAFETY: `rusage` is plain data; all-zero is a valid value to be overwritten.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a valid out-pointer; RUSAGE_THREAD is the calling thread.
        if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
            return None;
        }
        // `c_long` is 32 bits on some Linux targets.
        #[allow(clippy::useless_conversion)]
        Some(i64::from(ru.ru_nivcsw))
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    None
}

/// The time the calling thread has spent runnable but waiting for a CPU (Linux's
/// `/proc/thread-self/schedstat`, its second field; not under Miri): what another thread
/// on its CPU costs it, measured by the kernel's scheduler.
fn run_delay() -> Option<Duration> {
    // A short path on the stack: a look does not allocate.
    let mut buf = [0u8; 96];
    let n = crate::engine::neighbours::read_start("/proc/thread-self/schedstat", &mut buf)?;
    parse_run_delay(&buf[..n])
}

/// The run delay in a `schedstat` line (`<on-CPU ns> <run delay ns> <timeslices>`).
fn parse_run_delay(line: &[u8]) -> Option<Duration> {
    let ns = core::str::from_utf8(line)
        .ok()?
        .split_ascii_whitespace()
        .nth(1)?;
    ns.parse().ok().map(Duration::from_nanos)
}

/// What a caller's look reads about the CPU it runs on: the kernel's run delay where the
/// kernel keeps it, else the count of involuntary switches.
#[derive(Debug, Clone, Copy)]
enum CpuEvidence {
    Waited(Duration),
    Switches(i64),
}

impl CpuEvidence {
    fn now() -> Option<Self> {
        run_delay()
            .map(Self::Waited)
            .or_else(|| involuntary_switches().map(Self::Switches))
    }
}

/// A caller thread's view of whether other threads take its CPU, over windows of at
/// least [`CALLER_WINDOW`] between its calls into a VM: the time it spent runnable but
/// waiting for its CPU, at least a [`RUN_DELAY_SHARE`]th of the window
/// ([`waited_for_cpu`]). Where the kernel keeps no run delay, its involuntary context
/// switches: [`MIN_SWITCHES`] or more in a window, at least one per [`SWITCH_SPACING`]
/// ([`shares_cpu`]). A sleeping caller is switched out voluntarily and is not runnable,
/// so idle time is no evidence either way.
///
/// Switches alone mislead on a quiet machine: the VM's own threads and the kernel's wake
/// on the caller's CPU for a few microseconds at a time, several times a millisecond in
/// the training demo's eager mode (9 switches and 40 µs waited in 10 ms), where a busy
/// neighbour takes whole slices (1-4 ms waited in 10 ms).
///
/// Then the VM's own threads are one too many for the CPUs: each worker of the VM is
/// marked contended (it stops polling, dozes when idle, and hands its queue to a
/// waiting caller between instructions), and pushes that a caller may run leave a
/// dozing worker's wake to its deadline (`ThreadCtx::callers_contended_until`). The
/// caller runs the work at its next wait, as single-thread mode would, and the CPU the
/// workers leave idle is there for the busy thread, which the OS then tends to move
/// there.
#[derive(Debug, Clone, Copy)]
struct CallerSense {
    /// The last look: when, and what it read.
    last: Option<(Instant, CpuEvidence)>,
    calls: u32,
}

/// The shortest window [`CallerSense`] judges: several of a busy neighbour's scheduler
/// slices (a few milliseconds each), so that a kernel thread's passing preemption is not
/// taken for one.
const CALLER_WINDOW: Duration = Duration::from_millis(10);

/// A caller that waited for its CPU at least this fraction (one in ...) of a window
/// shares it: a busy neighbour's slice is milliseconds of a 10 ms window, the VM's own
/// threads' wakes on the caller's CPU tens of microseconds.
const RUN_DELAY_SHARE: u32 = 10;

/// Whether waiting `waited` for a CPU over a window of `wall` means a runnable thread
/// keeps taking the caller's CPU ([`CallerSense`]).
fn waited_for_cpu(waited: Duration, wall: Duration) -> bool {
    waited.saturating_mul(RUN_DELAY_SHARE) >= wall
}

/// Within a window, the most time per involuntary switch that still counts as sharing
/// the CPU (a busy neighbour's scheduler slice is a few milliseconds), and the fewest
/// switches that do.
const SWITCH_SPACING: Duration = Duration::from_millis(4);
const MIN_SWITCHES: i64 = 3;

/// Whether `switches` involuntary switches over a window of `wall` mean a runnable thread
/// keeps taking turns with the caller ([`CallerSense`], where the kernel keeps no run
/// delay).
fn shares_cpu(switches: i64, wall: Duration) -> bool {
    switches >= MIN_SWITCHES
        && wall < SWITCH_SPACING.saturating_mul(u32::try_from(switches).unwrap_or(u32::MAX))
}

thread_local! {
    static CALLER_SENSE: std::cell::Cell<CallerSense> =
        const { std::cell::Cell::new(CallerSense { last: None, calls: 0 }) };
}

/// A caller enters `shared` (a submission, a wait): every 8th call, once a window has
/// passed, looks at how long it waited for its CPU ([`CallerSense`]) and marks the VM's
/// workers and their pushes as above when it shares its CPU (counted as a caller
/// preemption).
///
/// At the same looks it compares the one CPU its affinity allows, if it allows one only,
/// with each worker's ([`note_sole_cpu`]): a worker bound to the caller's very CPU (a
/// process that `mpirun` or `taskset` bound to one CPU: every thread inherits the mask)
/// can only ever run when the caller does not, so it is marked the same way, for
/// [`SAME_CPU_HOLD`] from each look. Threads pinned to distinct CPUs are not.
pub(crate) fn sense_caller(shared: &VmCore) {
    let looked = CALLER_SENSE
        .try_with(|c| {
            let mut s = c.get();
            let looked = s.look();
            c.set(s);
            looked
        })
        .ok()
        .flatten();
    let Some(contended) = looked else {
        return;
    };
    let mine = sole_cpu().map_or(0, |c| c + 1);
    // Relaxed: statistics.
    if contended {
        shared
            .stats()
            .caller_preempted
            .fetch_add(1, Ordering::Relaxed);
    }
    if look_neighbours(shared) {
        shared.stats().crowded.fetch_add(1, Ordering::Relaxed);
    }
    if !contended && mine == 0 {
        return;
    }
    let mut same_cpu = false;
    shared.with_workers(|all| {
        for ctx in all {
            if contended {
                mark_contended(ctx, CONTENDED_HOLD);
                ctx.callers_contended_until.hold_for(CONTENDED_HOLD);
            }
            // Relaxed: a hint (see `note_sole_cpu`). A match is read again from the
            // worker's affinity: a worker re-bound since it noted its own (a program that
            // moves its threads, as the demo does after its first epoch) would keep
            // matching until its next note, which an idle worker may not make for long.
            if mine != 0
                && ctx.sole_cpu.load(Ordering::Relaxed) == mine
                && still_bound_to(ctx, mine)
            {
                same_cpu = true;
                mark_contended(ctx, SAME_CPU_HOLD);
                ctx.callers_contended_until.hold_for(SAME_CPU_HOLD);
                ctx.same_cpu_until.hold_for(SAME_CPU_HOLD);
            }
        }
    });
    if same_cpu {
        shared.callers_contended_until.hold_for(SAME_CPU_HOLD);
    }
}

/// Whether the worker of `ctx`, which noted `cpu` (one more than a CPU) as the one its
/// affinity allows, still allows that one only (its noted value is refreshed either way).
fn still_bound_to(ctx: &ThreadCtx, cpu: usize) -> bool {
    // Relaxed: written once, as the worker starts.
    let tid = ctx.tid.load(Ordering::Relaxed);
    if tid == 0 {
        return true;
    }
    let now = sole_cpu_of(tid).map_or(0, |c| c + 1);
    // Relaxed: a hint (see `note_sole_cpu`).
    ctx.sole_cpu.store(now, Ordering::Relaxed);
    now == cpu
}

/// A caller's look at the threads beside its VM's (`neighbours.rs`): when a busy
/// neighbour leaves the VM's threads too few CPUs, every worker is marked contended, and
/// its callers too, for three looks' time. Whether they were.
fn look_neighbours(shared: &VmCore) -> bool {
    use crate::engine::neighbours::{LOOK_EVERY, cpus_online, crowded, current_tid};
    // On the stack: a look allocates nothing (`neighbours.rs`).
    let mut own = heapless::Vec::<usize, 64>::new();
    let _ = own.push(current_tid());
    // Relaxed: a hint, written once as the scheduler starts.
    let _ = own.push(shared.scheduler_tid.load(Ordering::Relaxed));
    // Relaxed: each id is written once, as its worker starts.
    let (workers, parked, fits) = shared.with_workers(|all| {
        let fits = all
            .iter()
            .all(|c| own.push(c.tid.load(Ordering::Relaxed)).is_ok());
        (
            all.len(),
            all.iter().filter(|c| c.is_parked()).count(),
            fits,
        )
    });
    // A VM of more threads than `own` holds is not looked at.
    if workers == 0 || !fits {
        return false;
    }
    let cpus = cpus_online();
    // Another caller of this VM looking now: this one need not.
    let mut neighbours = match shared.neighbours().try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return false,
    };
    let busy = neighbours.look(Instant::now(), &own, parked, cpus);
    let warm = neighbours.warm();
    drop(neighbours);
    match busy {
        Some(0) if warm => shared
            .neighbours_quiet_until
            .hold_for(QUIET_NEIGHBOURS_HOLD),
        Some(0) | None => {}
        Some(_) => shared.neighbours_quiet_until.clear(),
    }
    if !busy.is_some_and(|b| crowded(b, workers, cpus)) {
        return false;
    }
    shared.callers_contended_until.hold_for(3 * LOOK_EVERY);
    shared.with_workers(|all| {
        for ctx in all {
            mark_contended(ctx, 3 * LOOK_EVERY);
            ctx.callers_contended_until.hold_for(3 * LOOK_EVERY);
        }
    });
    true
}

impl CallerSense {
    /// One call into a VM: `None` between looks (every 8th call, a window apart, and the
    /// first call), else whether this window showed the caller sharing its CPU.
    fn look(&mut self) -> Option<bool> {
        self.calls = self.calls.wrapping_add(1);
        if self.last.is_some() && !self.calls.is_multiple_of(8) {
            return None;
        }
        let now = Instant::now();
        let last = self.last;
        if last.is_some_and(|(since, _)| now.duration_since(since) < CALLER_WINDOW) {
            return None;
        }
        let seen = CpuEvidence::now();
        self.last = seen.map(|e| (now, e));
        let wall = |since: Instant| now.duration_since(since);
        Some(match (last, seen) {
            (Some((since, CpuEvidence::Waited(w0))), Some(CpuEvidence::Waited(w))) => {
                waited_for_cpu(w.saturating_sub(w0), wall(since))
            }
            (Some((since, CpuEvidence::Switches(n0))), Some(CpuEvidence::Switches(n))) => {
                shares_cpu(n.saturating_sub(n0), wall(since))
            }
            _ => false,
        })
    }
}

/// The calling thread (a worker, as it starts) makes its CPU-time clock known (Linux;
/// not under Miri, which has no thread CPU clocks: the watch then marks nobody).
pub(crate) fn register_cpu_clock(ctx: &ThreadCtx) {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        let mut id: libc::clockid_t = 0;
        // SAFETY: `pthread_self` is the calling thread, alive; `id` is a valid out-pointer.
        let r = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if r == 0 {
            // A thread's CPU clock id is negative: kept as its 32 bits, plus one.
            let bits = u32::from_ne_bytes(id.to_ne_bytes()) as usize;
            // Relaxed: a hint, read by callers that watch this worker.
            ctx.cpu_clock.store(bits + 1, Ordering::Relaxed);
        }
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    let _ = ctx;
}

/// The time of the clock `id` (a thread's CPU-time clock), if it can be read.
#[cfg(all(target_os = "linux", not(miri)))]
fn read_clock(id: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; a clock that does not exist (a thread that has
    // exited) is an error return (EINVAL), not undefined behaviour.
    if unsafe { libc::clock_gettime(id, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(
        u64::try_from(ts.tv_sec).ok()?,
        u32::try_from(ts.tv_nsec).ok()?,
    ))
}

/// The CPU time the calling thread has used (Linux, not under Miri).
fn own_cpu_time() -> Option<Duration> {
    #[cfg(all(target_os = "linux", not(miri)))]
    return read_clock(libc::CLOCK_THREAD_CPUTIME_ID);
    #[cfg(not(all(target_os = "linux", not(miri))))]
    None
}

/// How much of the wall time a worker running instructions had a CPU for: measured over
/// windows of at least [`SHARE_WINDOW`] while it runs (restarted when it sleeps), so a
/// worker that shares its CPU with a busy neighbour finds out while it is busy, not only
/// when it polls. The progress of the thread a caller waits for is what decides whether
/// waiting for it can be faster than doing its work. A window short of CPU time counts
/// only if the kernel also switched the worker out against its will in it: a kernel that
/// sleeps or blocks (on a device call, on I/O) gives its CPU away, nobody takes it.
#[derive(Debug, Default)]
pub(crate) struct CpuShare {
    /// When the window began: wall clock, this thread's CPU time and its involuntary
    /// switches (where known).
    start: Option<(Instant, Duration, Option<i64>)>,
    steps: u32,
}

/// The shortest window [`CpuShare`] judges: long enough to span a scheduler slice of a
/// busy neighbour (a few milliseconds), short enough to notice one soon.
const SHARE_WINDOW: Duration = Duration::from_millis(2);

/// Whether a window of `wall` in which the worker ran `cpu` means another thread took its
/// CPU: less than three quarters of it on a CPU, and (where the count is known) switched
/// out against its will at least once.
fn lost_cpu(cpu: Duration, wall: Duration, switched_out: Option<bool>) -> bool {
    cpu < wall * 3 / 4 && switched_out != Some(false)
}

impl CpuShare {
    /// The worker slept: the next window starts with its next instruction.
    pub(crate) fn restart(&mut self) {
        self.start = None;
        self.steps = 0;
    }

    /// After an instruction: every 32nd looks at the clock; a window in which another
    /// thread took the worker's CPU ([`lost_cpu`]) marks the worker of `ctx` contended
    /// (for [`CONTENDED_HOLD`]). Whether it did.
    pub(crate) fn ran(&mut self, ctx: &ThreadCtx) -> bool {
        self.steps = self.steps.wrapping_add(1);
        if !self.steps.is_multiple_of(32) && self.start.is_some() {
            return false;
        }
        let now = Instant::now();
        let Some((since, cpu0, switches0)) = self.start else {
            self.start = own_cpu_time().map(|c| (now, c, involuntary_switches()));
            return false;
        };
        let wall = now.duration_since(since);
        if wall < SHARE_WINDOW {
            return false;
        }
        let Some(cpu) = own_cpu_time() else {
            self.start = None;
            return false;
        };
        let switches = involuntary_switches();
        self.start = Some((now, cpu, switches));
        let switched_out = switches0.zip(switches).map(|(a, b)| b > a);
        let shared_cpu = lost_cpu(cpu.saturating_sub(cpu0), wall, switched_out);
        if shared_cpu {
            mark_contended(ctx, CONTENDED_HOLD);
        }
        shared_cpu
    }
}

/// The CPU time the worker of `ctx` has used, if its clock is known.
fn cpu_time(ctx: &ThreadCtx) -> Option<Duration> {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        // Relaxed: a hint (see `register_cpu_clock`).
        let v = ctx.cpu_clock.load(Ordering::Relaxed);
        let bits = u32::try_from(v.checked_sub(1)?).ok()?;
        read_clock(libc::clockid_t::from_ne_bytes(bits.to_ne_bytes()))
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    {
        let _ = ctx;
        None
    }
}

/// Workers watched by a waiting caller (see the module docs): their CPU time when the
/// watch began.
const WATCHED: usize = 8;

/// Whether the worker of `ctx`, which hardly ran lately, is runnable (waiting for a CPU)
/// rather than blocked; unknown counts as runnable, the clocks' verdict.
fn waits_for_cpu(ctx: &ThreadCtx) -> bool {
    // Relaxed: written once, as the worker starts.
    let tid = ctx.tid.load(Ordering::Relaxed);
    tid == 0 || crate::engine::neighbours::thread_runnable(tid) != Some(false)
}

pub(crate) struct WorkerWatch {
    since: Instant,
    cpu: [Option<Duration>; WATCHED],
}

impl WorkerWatch {
    /// Starts watching the VM's first workers (reads their CPU clocks: a system call
    /// each, so only when a wait is about to spin).
    pub(crate) fn start(shared: &VmCore) -> Self {
        let mut cpu = [None; WATCHED];
        for (k, c) in cpu.iter_mut().enumerate() {
            let Some(ctx) = shared.worker(k) else { break };
            *c = cpu_time(&ctx);
        }
        Self {
            since: Instant::now(),
            cpu,
        }
    }

    /// Nothing was released since the watch began: marks each watched worker that is
    /// awake, runnable now and got less than half of that time on a CPU as contended, and
    /// counts it. Whether any was; the watch starts over. A worker blocked now (a kernel
    /// that sleeps, waits on a device call or on I/O) is off its CPU by its own doing,
    /// not waiting for one: it is not marked. Its state is read only for a worker the
    /// clocks already accuse (a `/proc` read, microseconds), where it can be read.
    pub(crate) fn stalled(&mut self, shared: &VmCore) -> bool {
        let now = Instant::now();
        let wall = now.duration_since(self.since);
        let mut any = false;
        for k in 0..WATCHED {
            let Some(ctx) = shared.worker(k) else { break };
            let (before, after) = (self.cpu[k], cpu_time(&ctx));
            if let (Some(b), Some(a)) = (before, after)
                && !ctx.is_parked()
                && a.saturating_sub(b) < wall / 2
                && waits_for_cpu(&ctx)
            {
                mark_contended(&ctx, STALLED_WORKER_HOLD);
                any = true;
            }
            self.cpu[k] = after;
        }
        self.since = now;
        if any {
            // Relaxed: a statistic.
            shared
                .stats()
                .worker_stalled
                .fetch_add(1, Ordering::Relaxed);
        }
        any
    }
}

/// One thread's view of whether it shares its CPU (see the module docs). Plain data,
/// owned by the thread that looks.
#[derive(Debug, Default)]
pub(crate) struct PreemptionSense {
    /// The last look of the current spin, if it has had one.
    last: Option<Instant>,
    /// Until when this thread counts its CPU as shared.
    contended_until: Option<Instant>,
}

impl PreemptionSense {
    /// A new spin starts: the gap to the look before it (work, sleep) is no evidence.
    pub(crate) fn restart(&mut self) {
        self.last = None;
    }

    /// A look at the clock during a spin, at `now`: whether the thread was descheduled
    /// since the previous look.
    pub(crate) fn look(&mut self, now: Instant) -> bool {
        let jumped = self
            .last
            .is_some_and(|l| now.saturating_duration_since(l) >= PREEMPTED_GAP);
        self.last = Some(now);
        if jumped {
            self.contended_until = Some(now + CONTENDED_HOLD);
        }
        jumped
    }

    /// Whether the thread saw itself preempted within the last [`CONTENDED_HOLD`].
    pub(crate) fn contended(&self, now: Instant) -> bool {
        self.contended_until.is_some_and(|u| now < u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_shares_its_cpu_when_it_waits_for_it_a_tenth_of_the_window() {
        let (ms, us) = (Duration::from_millis, Duration::from_micros);
        // A busy neighbour's slices.
        assert!(waited_for_cpu(ms(1), ms(10)));
        assert!(waited_for_cpu(ms(4), ms(10)));
        // The VM's own threads waking on the caller's CPU, many times but briefly.
        assert!(!waited_for_cpu(us(40), ms(10)));
        assert!(!waited_for_cpu(us(999), ms(10)));
        assert!(!waited_for_cpu(Duration::ZERO, ms(10)));
    }

    #[test]
    fn a_worker_loses_its_cpu_when_short_of_it_and_switched_out() {
        let ms = Duration::from_millis;
        // A busy neighbour's slices: little CPU, switched out.
        assert!(lost_cpu(ms(1), ms(4), Some(true)));
        // Where the switches are not counted, the CPU time decides.
        assert!(lost_cpu(ms(1), ms(4), None));
        // A kernel that slept: little CPU, but nobody took it.
        assert!(!lost_cpu(ms(1), ms(4), Some(false)));
        // Switched out, but briefly: it had its CPU.
        assert!(!lost_cpu(ms(4), ms(4), Some(true)));
        assert!(!lost_cpu(ms(3), ms(4), Some(true)));
    }

    #[test]
    fn a_schedstat_line_gives_its_second_field() {
        assert_eq!(
            parse_run_delay(b"656474 1500 1\n"),
            Some(Duration::from_nanos(1500))
        );
        assert_eq!(parse_run_delay(b"656474"), None);
        assert_eq!(parse_run_delay(b""), None);
        assert_eq!(parse_run_delay(b"1 x 2"), None);
    }

    #[test]
    fn this_threads_run_delay_is_read_where_the_kernel_keeps_it() {
        // Miri's isolation refuses file system access: not even asked there.
        if !cfg!(miri) && std::path::Path::new("/proc/thread-self/schedstat").exists() {
            let a = run_delay().expect("run delay");
            let b = run_delay().expect("run delay");
            assert!(b >= a, "the run delay only grows");
        }
    }

    #[test]
    fn a_caller_shares_its_cpu_when_switched_out_often_and_repeatedly() {
        let ms = Duration::from_millis;
        // A busy neighbour's slices: a few milliseconds each.
        assert!(shares_cpu(3, ms(10)));
        assert!(shares_cpu(30, ms(100)));
        // Too few switches, whatever the window.
        assert!(!shares_cpu(2, ms(1)));
        assert!(!shares_cpu(0, ms(10)));
        // As many, spread over a long window (a kernel thread now and then).
        assert!(!shares_cpu(3, ms(12)));
        assert!(!shares_cpu(30, ms(1_000)));
    }

    #[test]
    fn a_gap_between_looks_marks_the_thread_contended_for_a_while() {
        let mut p = PreemptionSense::default();
        let t0 = Instant::now();
        assert!(!p.look(t0), "the first look has nothing to compare with");
        assert!(!p.look(t0 + Duration::from_micros(3)));
        assert!(!p.contended(t0 + Duration::from_micros(3)));
        let late = t0 + Duration::from_micros(3) + PREEMPTED_GAP;
        assert!(p.look(late));
        assert!(p.contended(late));
        let after = late + CONTENDED_HOLD;
        assert!(!p.contended(after));
    }

    /// A worker's CPU clock is readable from another thread and advances while it
    /// computes (Linux; the id is negative, which a plain conversion to `usize` lost).
    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn a_workers_cpu_clock_is_read_from_another_thread() {
        let ctx = std::sync::Arc::new(ThreadCtx::new("t".into()));
        let c2 = ctx.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            register_cpu_clock(&c2);
            tx.send(()).unwrap();
            let _ = wait.recv();
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
            tx.send(()).unwrap();
            let _ = wait.recv();
        });
        rx.recv().unwrap();
        let before = cpu_time(&ctx).expect("the worker's clock is known");
        go.send(()).unwrap();
        rx.recv().unwrap();
        let after = cpu_time(&ctx).expect("the worker's clock is known");
        assert!(after > before, "{before:?} -> {after:?}");
        go.send(()).unwrap();
        h.join().unwrap();
    }

    #[test]
    fn a_restart_forgets_the_look_before_it() {
        let mut p = PreemptionSense::default();
        let t0 = Instant::now();
        p.look(t0);
        p.restart();
        assert!(!p.look(t0 + 10 * PREEMPTED_GAP), "work or sleep in between");
        assert!(!p.contended(t0 + 10 * PREEMPTED_GAP));
    }
}
