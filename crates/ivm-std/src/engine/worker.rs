//! Worker threads: one per thread context, running the instructions the engine hands them.
//!
//! A worker drains its queue, runs each instruction, marks it done and has the engine
//! release it (driving the engine itself when nobody holds it, see `drive/`); then it
//! keeps polling for the configured window (`worker_poll_window`) and only then blocks on
//! its notifier. The engine notifies only when its push found the
//! queue empty (the MPSC was-empty protocol), and the notifier makes no wake call when the
//! worker is not asleep.
//!
//! The worker holds its queue's consumer role while it runs and polls, and lets go of it
//! while it sleeps: a caller about to wait for queued work may then run it itself
//! ([`caller_runs`]; the role hand-over is in `thread_ctx.rs`). While it polls, its
//! express lane is open: the engine's holder may hand it a small access directly when the
//! engine is at rest (`model/express.rs`).

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm_core::mpsc::{Consumer, DrainEnd, Pop};
use ivm_core::notifier::Closed;
use ivm_core::sync::Ordering;

use crate::engine::core::{ReentryGuard, VmCore};
use crate::model::instruction::{Body, Instruction, WorkerTag};
use crate::model::thread_ctx::ThreadCtx;

/// The body of a worker thread.
pub(crate) fn worker_loop(ctx: Arc<ThreadCtx>, shared: Arc<VmCore>) {
    let _reentry = ReentryGuard::enter(shared.id());
    // Should this thread unwind (bodies are caught in `execute`; this is for the loop
    // itself), its express lane must not stay open: a poster would wait on it in vain.
    struct CloseLane<'a>(&'a ThreadCtx);
    impl Drop for CloseLane<'_> {
        fn drop(&mut self) {
            self.0.express.close();
        }
    }
    let _lane = CloseLane(&ctx);
    crate::engine::preemption::register_cpu_clock(&ctx);
    crate::engine::preemption::note_sole_cpu(&ctx);
    // Relaxed: a hint for callers' looks at the threads beside the VM's (`neighbours.rs`),
    // written once.
    ctx.tid
        .store(crate::engine::neighbours::current_tid(), Ordering::Relaxed);
    let mut w = Worker::new(&ctx, &shared);
    let closing = loop {
        let Some(mut consumer) = w.take_role_or_poll() else {
            // A caller still runs our queue; its `let_go` wakes us if anything is left.
            // While this worker shares its CPU it dozes, as after its own work, so that
            // the callers' pushes leave its wake to the deadline (`ThreadCtx::submit`):
            // asleep without one, every push of the caller that runs its queue would
            // pay a futex wake and a context switch.
            let doze = crate::engine::preemption::is_contended(&ctx).then_some(w.contended_doze);
            match w.park(doze, false) {
                Ok(_) => continue,
                Err(closed) => break closed,
            }
        };
        // Polling from now on: the engine's holder may hand us small accesses directly
        // (`model/express.rs`); closed again before we sleep.
        ctx.express.open();
        let hand_over = w.run_until_idle(&mut consumer);
        if let Err(closed) = w.let_go_and_sleep(consumer, hand_over) {
            break closed;
        }
    };
    let _ = closing;
    // Shutdown: take the role (a caller may hold it for the length of a kernel) and
    // drain what is left.
    let mut consumer = loop {
        if let Some(c) = ctx.take_role() {
            break c;
        }
        std::thread::yield_now();
    };
    consumer.drain_until_empty(|i| w.run(i));
    w.owed.settle(&shared, true);
}

/// A worker thread's state between its steps: what it owes the engine, how long its
/// kernels run, how long it has been idle, and whether it shares its CPU.
struct Worker<'a> {
    ctx: &'a ThreadCtx,
    shared: &'a VmCore,
    counters: Arc<crate::engine::stats::ThreadCounters>,
    poll: Duration,
    /// A release this worker owes the engine (see `helping::Owed`).
    owed: crate::engine::helping::Owed,
    /// Whether our instructions run long (`kernel_clock.rs`).
    clock: crate::engine::kernel_clock::KernelClock,
    /// When the current idle stretch began, its poll steps, its length at the last look
    /// and the poll window it gets.
    idle_since: Option<Instant>,
    idle_steps: u32,
    idle_for: Duration,
    poll_now: Duration,
    /// Whether another thread takes this worker's CPU (`preemption.rs`): then it polls no
    /// more, so that the caller runs its work instead of waiting for it to be scheduled.
    preemption: crate::engine::preemption::PreemptionSense,
    /// How much of a CPU this worker gets while it runs instructions (`preemption.rs`).
    share: crate::engine::preemption::CpuShare,
    /// Polling backs off to `yield_now` (few cores: do not starve the caller).
    backoff: ivm_core::sync::Backoff,
    /// Idle dozes left before the worker sleeps without a deadline (ARCHITECTURE.md, "An
    /// idle worker dozes first"): refilled when work runs.
    idle_dozes_left: u32,
    /// The last sleep was an idle doze that ended at its deadline: an idle stretch that
    /// finds nothing then dozes again at once, without polling.
    idle_doze_timed_out: bool,
    /// Until when the worker dozes no more when idle: a push left to an idle doze's
    /// deadline waited for it (nobody ran it meanwhile), so pushes wake it again.
    idle_dozes_off_until: Option<Instant>,
    /// `ThreadCtx::left_to_idle_doze` at the last look.
    left_seen: usize,
    /// How long the next doze of this worker while contended lasts ([`next_contended_doze`]).
    contended_doze: Duration,
    /// When the worker last noted its affinity (`preemption::note_sole_cpu`): again before
    /// a sleep at most every `SAME_CPU_HOLD / 2`, since others may re-bind it.
    sole_cpu_noted: Instant,
}

impl<'a> Worker<'a> {
    fn new(ctx: &'a ThreadCtx, shared: &'a VmCore) -> Self {
        let poll = shared.config().worker_poll_window;
        Self {
            ctx,
            shared,
            counters: shared.stats().thread(&ctx.name),
            poll,
            owed: crate::engine::helping::Owed::default(),
            clock: crate::engine::kernel_clock::KernelClock::default(),
            idle_since: None,
            idle_steps: 0,
            idle_for: Duration::ZERO,
            poll_now: poll,
            preemption: crate::engine::preemption::PreemptionSense::default(),
            share: crate::engine::preemption::CpuShare::default(),
            backoff: ivm_core::sync::Backoff::new(),
            idle_dozes_left: 0,
            idle_doze_timed_out: false,
            idle_dozes_off_until: None,
            left_seen: 0,
            contended_doze: crate::util::tuning::WORKER_DOZE,
            sole_cpu_noted: Instant::now(),
        }
    }

    /// Counts `k` small accesses served through the express lane.
    fn served(&self, k: usize) {
        // Relaxed: a statistic, written by this thread only.
        let n = self.ctx.express_served.load(Ordering::Relaxed);
        self.ctx.express_served.store(n + k, Ordering::Relaxed);
    }

    /// One instruction; `fused_more`: the next member of its fused run comes right after it.
    fn run_one(&mut self, instr: Arc<Instruction>, fused_more: bool) {
        let (ctx, shared, owed) = (self.ctx, self.shared, &self.owed);
        // Before running anything (it may take long), settle what we owe, unless nothing
        // waits for it (an unawaited debt: whoever drives next pays it); or a helper
        // spins: it takes care of it (`helping::Helping`); or a caller is still
        // submitting and the debt has its grace left: it may wait for this one kernel
        // (`helping::Helping::submitting`). The last two checks come after the mark
        // (fence, then load).
        if owed.is_owed() {
            // The grace is used up by this instruction whoever keeps the debt.
            let grace = owed.take_grace();
            let kept = owed.is_unawaited()
                || shared.helper_spinning()
                || (grace && shared.submitter_active());
            if !kept {
                owed.settle(shared, true);
            }
        }
        let sync_access = instr.waiter.is_some();
        // Some instructions are timed (at random: `kernel_clock.rs`): whether kernels run
        // long on average (`ThreadCtx::long_kernels`), or tiny.
        let t0 = self.clock.start();
        // Asked before it runs, as the queue's rule (a deferred body is not a caller's).
        let callers_may_run = t0.is_some() && queued_caller_may_run(&instr);
        crate::engine::execute::execute(&instr);
        if let Some(t0) = t0 {
            let long = self.clock.timed(t0);
            // Relaxed: hints.
            if ctx.long_kernels.load(Ordering::Relaxed) != long {
                ctx.long_kernels.store(long, Ordering::Relaxed);
                shared.count_long_kernel_worker(long);
            }
            // Tiny ones are cheaper on their callers (only where a caller may run them).
            if callers_may_run && self.clock.is_tiny(shared.config().tiny_kernel_ns) {
                crate::engine::preemption::mark_tiny_kernels(
                    ctx,
                    shared,
                    crate::util::tuning::CONTENDED_HOLD,
                );
            }
        }
        let more = fused_more || !ctx.queue.is_empty();
        // Our reference goes before any release (the engine recycles what only it holds),
        // except to the one rule that asks the instruction first (and then lets it go).
        // After DONE (Release inside `execute`): the engine must release it.
        if sync_access {
            // Its caller is about to come back and drive the engine anyway (usually
            // within a microsecond): leave the release to it, so the engine's data stays
            // in the caller's cache; settled below if nobody takes the engine soon.
            drop(instr);
            owed.mark(shared, true, false);
        } else if more && shared.helper_spinning() {
            // More to run, and a caller spins waiting: it releases this one while we run
            // the next (checked again after the mark, before the next instruction).
            drop(instr);
            owed.mark(shared, false, false);
        } else if fused_more
            || more
                // Relaxed: a hint.
                && ctx.long_kernels.load(Ordering::Relaxed)
        {
            // More to run, behind long kernels. If nothing waits for this release, it
            // waits for whoever drives next (usually the caller submitting its next
            // instruction) or until our queue runs dry (`helping::Owed`: an unawaited
            // debt). Otherwise a caller is submitting: its push drives the engine, likely
            // before our next kernel ends; if not, we pay before the one after (checked
            // again after the mark, before the next instruction), or, should our queue
            // run dry first, after polling for `RELEASE_DEFER` (a patient debt). Only
            // behind long kernels: with short ones the engine's work is the bottleneck,
            // and the submitting caller would do all of it (`perf_report`'s
            // `instr_per_s` fell 1-16 % when every worker deferred). A fused run's member
            // but the last is left the same way whatever its kernels' length: the run's
            // last member releases them all in one step, unless one is awaited (a reader
            // on another stream, a barrier, a backpressured submitter).
            // A body that completed another instruction here (a custom instruction's
            // `Done`, a lazy record) only marked the engine for it: that release may be
            // awaited although ours is not. (Taken here only: a flag left by an earlier
            // instruction makes this decision pay once more, never less.)
            let completed_other = crate::engine::drive::take_completion_marked();
            owed.leave_unless_awaited(shared, instr, completed_other, || shared.submitter_active());
        } else {
            drop(instr);
            // Releases it here (readying its successors, on any stream) when nobody
            // holds the engine, else marks it for the holder (`drive/token.rs`).
            shared.completed();
            owed.discharged();
        }
    }

    /// A queued item: an instruction, or the first member of a fused run, whose members
    /// run here back to back, each as if it had been queued alone (taking its successor's
    /// link before it runs: once done, the engine may release it and clear its body).
    fn run(&mut self, instr: Arc<Instruction>) {
        let mut next = Some(instr);
        while let Some(instr) = next.take() {
            next = crate::engine::execute::take_fused_next(&instr);
            self.run_one(instr, next.is_some());
        }
    }

    /// Runs the queue (and the express lane) until it stays empty past the poll window,
    /// settling what it owes (`false`), or until a caller waits for it while this worker
    /// shares its CPU (`true`: it hands the queue over, `model/hand_over.rs`).
    fn run_until_idle(&mut self, consumer: &mut Consumer<'a, Instruction, WorkerTag>) -> bool {
        loop {
            let Some((mut ran, end)) = self.drain(consumer) else {
                return true;
            };
            // A small access posted to our lane counts as work run.
            if self.ctx.express.serve() {
                self.served(1);
                ran = true;
            }
            if ran {
                if std::mem::take(&mut self.idle_doze_timed_out) && !self.ctx.hand.has_waiters() {
                    // A push waited for our deadline and no caller waits for it: its
                    // caller did not wait for it. Wake-ups on push for a while.
                    self.idle_dozes_off_until =
                        Some(Instant::now() + crate::util::tuning::IDLE_DOZE_OFF);
                }
                self.idle_dozes_left = self.idle_dozes();
                self.restart_idle();
                continue;
            }
            if !end.may_sleep() {
                // A push is half done: its producer may not wake us. Never sleep here.
                self.backoff.spin();
                continue;
            }
            self.owed.settle(self.shared, false);
            // Polls even right after a wake that found nothing (a caller ran it): a
            // worker that slept again at once would be asleep at the next submission,
            // which its caller, reaching its wait before the woken worker runs, would
            // then run itself again, step after step (as in `take_role_or_poll`).
            if self.poll_once() {
                continue;
            }
            if self.owed.is_owed() {
                // Never sleep owing a release.
                self.owed.settle(self.shared, true);
                continue;
            }
            return false;
        }
    }

    /// Pops and runs what is queued: whether anything ran and why it stopped, or `None`
    /// when it stopped to hand the queue to a waiting caller ([`hand_to_callers`]).
    fn drain(
        &mut self,
        consumer: &mut Consumer<'a, Instruction, WorkerTag>,
    ) -> Option<(bool, DrainEnd)> {
        let mut ran = false;
        loop {
            match consumer.try_pop() {
                Pop::Item(i) => {
                    ran = true;
                    self.run(i);
                    if self.share.ran(self.ctx) {
                        // Relaxed: a statistic.
                        self.counters.cpu_shared.fetch_add(1, Ordering::Relaxed);
                    }
                    if hand_to_callers(self.ctx, consumer) {
                        return None;
                    }
                }
                Pop::Empty => return Some((ran, DrainEnd::Empty)),
                Pop::Inconsistent => return Some((ran, DrainEnd::Inconsistent)),
            }
        }
    }

    /// One idle step: whether the worker keeps polling (it spun or yielded once). Spin-loop
    /// hints first (the next instruction of a busy caller comes within microseconds), then
    /// back off to `yield_now` (few cores: do not starve anyone), reading the clock every
    /// 16 steps only.
    fn poll_once(&mut self) -> bool {
        let since = match self.idle_since {
            Some(t) => t,
            None => {
                // An idle stretch begins: poll as the last preemption seen allows.
                let now = Instant::now();
                self.poll_now = poll_window(self.ctx, self.poll);
                self.idle_since = Some(now);
                now
            }
        };
        self.idle_steps = self.idle_steps.wrapping_add(1);
        if self.idle_steps.is_multiple_of(16) {
            let now = Instant::now();
            if self.preemption.look(now) {
                // Relaxed: a statistic.
                self.counters.preempted.fetch_add(1, Ordering::Relaxed);
                crate::engine::preemption::mark_contended(
                    self.ctx,
                    crate::util::tuning::CONTENDED_HOLD,
                );
            }
            self.idle_for = now.duration_since(since);
            self.poll_now = poll_window(self.ctx, self.poll);
        }
        if self.idle_for >= self.poll_now || self.idle_doze_timed_out {
            return false;
        }
        if self.idle_for < crate::util::tuning::WORKER_PURE_SPIN {
            ivm_core::sync::spin_loop();
        } else {
            self.backoff.snooze();
        }
        true
    }

    /// Takes the queue's consumer role; while a caller holds it (it runs our queue), polls
    /// for it for the poll window ([`poll_window`]: not at all while this worker shares
    /// its CPU) before giving up. A woken worker that parked again at once would stay
    /// parked after the caller let go with nothing left, and at the next submission the
    /// caller, reaching its wait before the woken worker runs, would take the role again:
    /// on a quiet machine every step's kernels ran on the caller (ARCHITECTURE.md, "Who
    /// may drive the engine").
    fn take_role_or_poll(&mut self) -> Option<Consumer<'a, Instruction, WorkerTag>> {
        let window = poll_window(self.ctx, self.poll);
        let start = Instant::now();
        let mut held = false;
        loop {
            if let Some(c) = self.ctx.take_role() {
                if held {
                    // A caller ran our queue: work goes on, so poll as after work (else
                    // the caller, having run everything, would find us dozing at its
                    // next submission, and run that too, step after step).
                    self.idle_doze_timed_out = false;
                    self.idle_dozes_left = self.idle_dozes();
                }
                self.backoff.reset();
                return Some(c);
            }
            held = true;
            if start.elapsed() >= window {
                self.backoff.reset();
                return None;
            }
            self.backoff.snooze();
        }
    }

    /// Work ran, or the worker woke: a new idle stretch starts from nothing.
    fn restart_idle(&mut self) {
        self.idle_since = None;
        self.preemption.restart();
        (self.idle_steps, self.idle_for) = (0, Duration::ZERO);
        self.backoff.reset();
    }

    /// Lets go of the role and sleeps, after [`run_until_idle`](Self::run_until_idle);
    /// `hand_over`: its answer. `Err` once shutdown closed the notifier.
    fn let_go_and_sleep(
        &mut self,
        consumer: Consumer<'a, Instruction, WorkerTag>,
        hand_over: bool,
    ) -> Result<(), Closed> {
        let ctx = self.ctx;
        // Let go of the role before sleeping, so that a waiting caller may run what the
        // engine queues meanwhile (`caller_runs`). The express lane closes first (doing
        // what is posted to it): a sleeping worker serves nobody.
        self.served(ctx.express.close());
        self.share.restart();
        if hand_over {
            // Instructions are queued, a caller waits for them, and this worker shares its
            // CPU: the callers run them (`model/hand_over.rs`), who wake us when they stop
            // waiting. A wake pending from an earlier push is for what they now run.
            self.owed.settle(self.shared, true);
            ctx.notifier.clear();
            // Relaxed: a statistic.
            self.counters.handed_over.fetch_add(1, Ordering::Relaxed);
            if ctx.hand.hand_over(consumer) {
                // Nobody waits any more: run on.
                return Ok(());
            }
        } else {
            // No re-check is needed: the last drain found the queue empty while we held
            // the role, so the next push finds it empty and notifies (or, while we doze,
            // leaves the wake to our deadline).
            drop(consumer);
        }
        if self.sole_cpu_noted.elapsed() >= crate::util::tuning::SAME_CPU_HOLD / 2 {
            crate::engine::preemption::note_sole_cpu(ctx);
            self.sole_cpu_noted = Instant::now();
        }
        // How long it sleeps at most (`None`: until woken), and whether that is an idle doze.
        let (doze, idle_doze) = if hand_over {
            (None, false)
        } else if crate::engine::preemption::is_contended(ctx) {
            (Some(self.contended_doze), false)
        } else if self.idle_dozes_left > 0
            && self
                .idle_dozes_off_until
                .is_none_or(|until| Instant::now() >= until)
        {
            self.idle_dozes_left -= 1;
            (Some(crate::util::tuning::IDLE_DOZE), true)
        } else {
            (None, false)
        };
        let notified = self.park(doze, idle_doze)?;
        if doze.is_some() && !idle_doze {
            // Only a worker bound to its callers' very CPU: one that shares its CPU with
            // other threads may find it free between their slices, and run beside the
            // caller then (with the doze growing, `--hog 1` lost about five points).
            let grow = !notified && ctx.queue.is_empty() && ctx.same_cpu_until.holds();
            self.contended_doze = next_contended_doze(self.contended_doze, grow);
        }
        self.restart_idle();
        self.idle_doze_timed_out = idle_doze && !notified;
        // Relaxed: a hint (see the field).
        let left = ctx.left_to_idle_doze.load(Ordering::Relaxed);
        if notified || left != self.left_seen {
            // Woken for work, or callers pushed (and ran) work meanwhile: the VM is in
            // use, so the next idle stretches doze first again.
            self.left_seen = left;
            self.idle_dozes_left = self.idle_dozes();
        }
        Ok(())
    }

    /// How many idle dozes an idle stretch gets: none when the worker does not poll (a
    /// configuration that asks for no CPU use while idle).
    fn idle_dozes(&self) -> u32 {
        if self.poll.is_zero() {
            0
        } else {
            crate::util::tuning::IDLE_DOZES
        }
    }

    /// Sleeps on the notifier (the role let go): whether a notification (not a deadline)
    /// woke it; `Err` once shutdown closed it. `doze`: it sleeps that long at most, and
    /// pushes that a caller may run may leave its wake to that deadline (`thread_ctx.rs`,
    /// "A worker that wakes itself"); `idle_doze`: the doze of a worker that is idle, not
    /// one that shares its CPU (then only a caller's own pushes leave the wake).
    fn park(&self, doze: Option<Duration>, idle_doze: bool) -> Result<bool, Closed> {
        let ctx = self.ctx;
        // Relaxed: hints (see `ThreadCtx::parked`, `ThreadCtx::idle_doze`).
        ctx.parked.store(true, Ordering::Relaxed);
        ctx.idle_pushes.store(0, Ordering::Relaxed);
        ctx.idle_doze.store(idle_doze, Ordering::Relaxed);
        let woken = if let Some(d) = doze {
            crate::model::thread_ctx::doze(&ctx.dozing);
            let deadline =
                <crate::util::futex::FutexWait as ivm_core::wait::Wait>::now().saturating_add(d);
            let r = ctx.notifier.timed_wait_and_clear(deadline);
            crate::model::thread_ctx::wake_from_doze(&ctx.dozing);
            r.map(|t| t == ivm_core::notifier::Timed::Notified)
        } else {
            ctx.notifier.wait_and_clear().map(|()| true)
        };
        ctx.idle_doze.store(false, Ordering::Relaxed);
        ctx.parked.store(false, Ordering::Relaxed);
        self.counters.record(true, matches!(woken, Ok(true)));
        woken
    }
}

/// The doze after a contended one of `last`: twice as long (up to `WORKER_DOZE_MAX`) when
/// `grow` (it ended at its deadline with nothing queued, the callers having run what was
/// pushed meanwhile, and the worker is bound to their CPU: waking sooner only takes it from
/// them), else `WORKER_DOZE` again.
pub(crate) fn next_contended_doze(last: Duration, grow: bool) -> Duration {
    use crate::util::tuning::{WORKER_DOZE, WORKER_DOZE_MAX};
    if grow {
        last.saturating_mul(2).clamp(WORKER_DOZE, WORKER_DOZE_MAX)
    } else {
        WORKER_DOZE
    }
}

/// How long the worker of `ctx` polls when idle: `window`, or not at all while it counts
/// as sharing its CPU (`preemption.rs`: seen by itself or by a waiting caller), so that it
/// parks, lets go of its queue, and its callers run the work.
fn poll_window(ctx: &ThreadCtx, window: std::time::Duration) -> std::time::Duration {
    if crate::engine::preemption::is_contended(ctx) {
        std::time::Duration::ZERO
    } else {
        window
    }
}

/// Whether the worker of `ctx`, between two instructions, hands its queue to the callers
/// waiting for it (`model/hand_over.rs`): a caller waits, the worker counts as sharing its
/// CPU (`preemption.rs`), and the next queued instruction is one a caller may run
/// ([`caller_may_run`]). A head no caller may run (a custom instruction on a compute
/// stream, a lazy-job step) would come straight back: the caller that took the role would
/// let go and wake us, a futex wake and a context switch per instruction on a machine
/// short of CPUs.
fn hand_to_callers(ctx: &ThreadCtx, consumer: &Consumer<'_, Instruction, WorkerTag>) -> bool {
    // The clock read of `is_contended` last: a waiting caller and an empty queue after
    // every instruction of a warm read.
    ctx.hand.has_waiters()
        && consumer.peek().is_some_and(queued_caller_may_run)
        && crate::engine::preemption::is_contended(ctx)
}

/// Whether a waiting caller may run `instr`, queued to a worker (see [`caller_runs`]), whose
/// body is `body`: its stream allows it (`StreamPolicy::caller_may_run`) and the body is not
/// deferred (a deferred body completes later, through the stream's own protocol); or its
/// stream allows it while its thread shares its CPU
/// (`StreamPolicy::caller_may_run_when_contended`), deferred bodies included (a custom
/// instruction, a collective: the caller runs its launch as that thread would), and the
/// thread does. Also the engine's rule for a wake left to the caller (`Exec::dispatch`).
pub(crate) fn caller_may_run(instr: &Instruction, body: &Body) -> bool {
    let policy = &instr.stream.policy;
    (policy.caller_may_run() && body.deferred.is_none())
        || (policy.caller_may_run_when_contended()
            && instr
                .stream
                .thread
                .as_deref()
                .is_some_and(crate::engine::preemption::is_contended))
}

/// [`caller_may_run`] for the head of a queue whose consumer role the calling thread (a
/// caller running the queue, or its worker) holds.
fn queued_caller_may_run(instr: &Instruction) -> bool {
    // SAFETY: the calling thread holds the queue's consumer role, so `instr` (queued) is
    // the executor's, which is this thread until it lets go; nobody mutates the body
    // meanwhile (ownership step 3), and this borrow ends before it runs.
    caller_may_run(instr, unsafe { instr.body() })
}

/// A caller about to wait for work queued to the worker of `ctx` runs it itself while
/// that worker sleeps (ARCHITECTURE.md, "Who may drive the engine"): it takes the queue's
/// consumer role (only one holder at a time: nothing of the queue runs concurrently or
/// out of order), runs the queued instructions in order, as the worker would, until
/// `enough()` holds, the queue is empty, or the next one's stream does not allow it
/// ([`caller_may_run`]); lets go of the role (waking the worker if anything is left,
/// `ThreadCtx::let_go`); then has the engine release what it ran. Returns whether it ran
/// anything. Nothing is done while the worker is awake (it runs its queue itself) or the
/// queue is empty (the instruction waited for is running, or not dispatched yet: the
/// caller waits as before).
pub(crate) fn caller_runs(
    shared: &VmCore,
    ctx: &ThreadCtx,
    mut enough: impl FnMut() -> bool,
) -> bool {
    caller_runs_while(shared, ctx, None, |_| !enough())
}

/// [`caller_runs`] for a caller that has submitted nothing to wait for yet (a small read
/// about to take its fast path, `doors/sync_access.rs`; a submission that catches up on
/// a busy machine, `engine/submission.rs`): runs only instructions built before id
/// `bound` (`instruction::peek_next_id` as the caller looked, or the submission's first),
/// and at most as many as were in flight then, so that work other threads keep
/// submitting meanwhile stays with the worker and the call returns in bounded time.
pub(crate) fn caller_runs_built_before(shared: &VmCore, ctx: &ThreadCtx, bound: usize) -> bool {
    let mut left = shared.flying();
    caller_runs_while(shared, ctx, None, |instr| {
        if left == 0 || !run_built_before(instr, bound) {
            return false;
        }
        left -= 1;
        true
    })
}

/// Whether the queued `head` and every member of the fused run it heads were built before
/// id `bound`: a run dispatched after a submission may end in that submission's own
/// instructions (members are consecutive in the order received, ids in the order built).
pub(super) fn run_built_before(head: &Instruction, bound: usize) -> bool {
    let mut m = head;
    loop {
        if m.id >= bound {
            return false;
        }
        // SAFETY: called under the queue's consumer role (`caller_runs_while`'s `take`),
        // so the queued run's bodies are the executor's, this thread's, and nobody mutates
        // them meanwhile (ownership step 3); the borrow ends before anything runs.
        match unsafe { m.body() }.fused_next.as_deref() {
            Some(next) => m = next,
            None => return true,
        }
    }
}

/// [`caller_runs`], taking the queue's head only while `take(head)` holds; and, given
/// `stop_once` still clear, stopping after the first instruction the engine marked
/// awaited with more queued behind it (setting it; see [`WaitingCaller`]).
fn caller_runs_while(
    shared: &VmCore,
    ctx: &ThreadCtx,
    stop_once: Option<&Cell<bool>>,
    mut take: impl FnMut(&Instruction) -> bool,
) -> bool {
    if !ctx.is_parked() || ctx.queue.is_empty() || crate::engine::core::inside(shared.id()) {
        // The worker runs its queue itself; or nothing is queued (what we wait for runs,
        // or is not dispatched yet); or this is a thread of the VM (a worker waiting for
        // backpressure, a kernel): it runs nobody else's queue.
        return false;
    }
    let Some(mut consumer) = ctx.queue.try_consume() else {
        return false;
    };
    // Our `let_go` looks after the queue now, should the worker have handed it over.
    ctx.hand.taken();
    let mut ran = 0usize;
    {
        // User code runs here as on a worker: a call into this VM from it is refused.
        let _reentry = ReentryGuard::enter(shared.id());
        loop {
            if !consumer
                .peek()
                .is_some_and(|i| queued_caller_may_run(i) && take(i))
            {
                break;
            }
            let Some(instr) = consumer.try_pop().item() else {
                break;
            };
            let (n, awaited) = crate::engine::execute::execute_run(&instr);
            ran += n;
            drop(instr);
            // Asked after it ran (the engine marks it when a successor arrives), and only
            // with more queued: a stop with nothing left would spend the wait's one stop.
            if let Some(s) = stop_once.filter(|s| !s.get() && awaited)
                && consumer.peek().is_some()
            {
                s.set(true);
                break;
            }
        }
    }
    // What is left, if a caller may run it, goes to the worker's doze while the worker or
    // the callers share their CPUs (as a caller's push would, `ThreadCtx::submit`): the
    // caller runs it at its next wait, or the worker by its deadline. Woken now, the worker
    // would take turns with this caller for a CPU to run it.
    let leave_to_doze = consumer.peek().is_some_and(queued_caller_may_run) && {
        let now = crate::util::now_us();
        ctx.callers_contended_until.holds_at(now) || ctx.contended_until.holds_at(now)
    };
    if leave_to_doze {
        ctx.let_go_to_doze(consumer);
    } else {
        ctx.let_go(consumer);
    }
    if ran > 0 {
        shared.stats().caller_ran(ran);
        // After DONE (Release inside `execute`): the engine must release them. Drives
        // here when nobody holds the engine, else marks it for the holder.
        shared.after_push(true, crate::engine::drive::Claim::NONE, false);
    }
    ran > 0
}

/// [`caller_runs`] on each worker of the VM in turn, until `enough()`: for a caller that
/// waits for everything received before its wait (`sync`, `sync_async`, `run_async`'s
/// completion), which every queued instruction may be part of.
pub(crate) fn caller_runs_any(shared: &VmCore, mut enough: impl FnMut() -> bool) -> bool {
    let mut ran = false;
    let mut k = 0;
    while !enough() {
        let Some(ctx) = shared.worker(k) else { break };
        ran |= caller_runs(shared, &ctx, &mut enough);
        k += 1;
    }
    ran
}

/// Wakes each worker of `shared` that sleeps with work queued. A wait with a deadline of
/// its own runs nothing itself (`doors/completion.rs`, `wait_deadline`), so work that a
/// caller's push left to a doze's deadline (a worker that shares its CPU; up to
/// `WORKER_DOZE_MAX` for one bound to the caller's CPU) would start only then. Best
/// effort: a worker between its look at the queue and its park is not seen as parked,
/// and its doze's deadline still stands.
pub(crate) fn wake_sleepers_with_work(shared: &VmCore) {
    shared.with_workers(|all| {
        for ctx in all {
            if ctx.is_parked() && !ctx.queue.is_empty() {
                ctx.wake();
            }
        }
    });
}

/// The workers of a VM, as a caller waiting for one of its instructions sees them: it is
/// counted among the callers waiting for each of their queues (`model/hand_over.rs`) and
/// runs what a sleeping one has queued ([`caller_runs`]), whichever stream its own
/// instruction is on: what that instruction waits for may be queued on another stream's
/// worker. Counted out (waking a worker that handed its queue over) when dropped.
///
/// Running a queue, it stops once after an instruction the engine marked awaited
/// (`status::AWAITED`: work on another stream waits for its release, or a barrier does)
/// with more queued behind it. Its `enough` cannot turn true while the loop holds the
/// releases back: a caller waiting for a read on another stream of what the queue's
/// first instruction writes would run the whole queue before its read (the training
/// demo's first step after an idle pause: the forward and the backward pass on the
/// caller, then the loss). Stopping there releases it; the wait looks again, and the
/// worker, woken by the let-go (or by its doze's deadline while it shares its CPU), runs
/// the rest meanwhile. Once per wait: with a barrier pending every instruction counts as
/// awaited.
pub(crate) struct WaitingCaller {
    workers: [Option<Arc<ThreadCtx>>; WAITED_WORKERS],
    stopped: Cell<bool>,
}

/// The workers a waiting caller looks after (the first ones of its VM).
const WAITED_WORKERS: usize = 8;

impl WaitingCaller {
    /// The caller starts waiting (looks the VM's workers up once: one lock).
    pub(crate) fn enter(shared: &VmCore) -> Self {
        let mut workers: [Option<Arc<ThreadCtx>>; WAITED_WORKERS] = Default::default();
        shared.with_workers(|all| {
            for (w, ctx) in workers.iter_mut().zip(all) {
                ctx.hand.enter();
                *w = Some(ctx.clone());
            }
        });
        Self {
            workers,
            stopped: Cell::new(false),
        }
    }

    /// [`caller_runs`] on `first` (the worker of the instruction waited for, if any), then
    /// on every other worker, until `enough()`; whether it ran anything.
    pub(crate) fn run(
        &self,
        shared: &VmCore,
        first: Option<&ThreadCtx>,
        mut enough: impl FnMut() -> bool,
    ) -> bool {
        let stop = Some(&self.stopped);
        let mut ran = first.is_some_and(|w| caller_runs_while(shared, w, stop, |_| !enough()));
        for w in self.workers.iter().flatten() {
            if enough() {
                break;
            }
            if first.is_some_and(|f| std::ptr::eq(f, &**w)) {
                continue;
            }
            ran |= caller_runs_while(shared, w, stop, |_| !enough());
        }
        ran
    }
}

impl Drop for WaitingCaller {
    fn drop(&mut self) {
        for w in self.workers.iter().flatten() {
            w.hand.leave(&w.notifier);
        }
    }
}
