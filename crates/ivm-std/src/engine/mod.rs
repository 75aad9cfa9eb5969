//! The VM's engine: ivm-engine's dependency engine over the VM's instructions, plus what
//! only a VM on std has — probes, who drives, statistics, the recycling pool.
//!
//! Order (dependences, edges, dispatch, in-order release, barriers when oldest, the rule
//! for which accesses may run on a caller) is decided in `ivm_engine::Engine` and nowhere
//! else; this module is its [`Executor`]: it says how a dispatched instruction runs
//! (inline on the driver, handed to its waiting caller, a lazy-job protocol step done on
//! the spot, or queued to its stream's worker), runs barriers and takes released
//! instructions back. Run by exactly one thread at a time (ARCHITECTURE.md, "who may drive
//! the engine").

mod at_rest;
pub(crate) mod backpressure;
pub(crate) mod core;
pub(crate) mod device_launch;
pub(crate) mod drive;
pub(crate) mod execute;
pub(crate) mod gate;
pub(crate) mod helping;
pub(crate) mod kernel_clock;
pub(crate) mod neighbours;
pub(crate) mod preemption;
pub(crate) mod scheduler;
mod single;
pub mod stats;
mod submission;
pub(crate) mod worker;

use std::sync::Arc;

use ivm_core::sync::Ordering;
use ivm_engine::{AccessMode, Completion, DispatchCtx, Dispatched, Executor, Growable};

use crate::device::policy::Placement;
use crate::engine::core::{Probe, VmCore};
use crate::engine::drive::Driver;
use crate::model::instruction::{Instruction, Kind, status};
use crate::model::stream::StreamShared;
use crate::util::error::{Diagnostic, LivelyInstruction};
use crate::util::tuning::PRESIZE;

/// An instruction as the dependency engine holds it.
pub(crate) struct Job(pub(crate) Arc<Instruction>);

// SAFETY: the dependences an instruction names are its operand blobs' (each `Blob` owns
// one, on the heap behind the `Arc` the body holds) and the engine's own per-stream
// schedule dependences. The body keeps its blobs until the engine released the
// instruction (`released` clears it, ownership step 4), and never lives inside the `Job`.
// Builders check that every blob belongs to this VM (`vm_id`), so one engine only uses a
// dependence. `stream`/`policy` come from the instruction's immutable stream.
unsafe impl ivm_engine::Instruction for Job {
    type Policy = StreamShared;

    fn stream(&self) -> u32 {
        self.0.stream.index
    }

    fn policy(&self) -> &StreamShared {
        &self.0.stream
    }

    fn is_barrier(&self) -> bool {
        self.0.barrier
    }

    fn stream_sequential(&self) -> bool {
        self.0.stream_sequential
    }

    fn strict_edges(&self) -> bool {
        self.0.strict_edges
    }

    fn for_each_access(&self, f: &mut dyn FnMut(&ivm_engine::Dependence, AccessMode)) {
        // SAFETY: the engine asks only between receive and dispatch, when it owns the body
        // (ownership step 2).
        let body = unsafe { self.0.body() };
        for b in body.outputs.as_slice() {
            f(&b.dep.dep, AccessMode::Write);
        }
        for b in body.inputs.as_slice() {
            f(&b.dep.dep, AccessMode::Read);
        }
    }

    fn is_done(&self) -> bool {
        // Acquire (in `status`): pairs with the executor's Release of DONE; the engine
        // then owns the body again (ownership step 4).
        self.0.status() & status::DONE != 0
    }

    fn awaited(&self) {
        // Relaxed: published by our unlock of the engine (Release) to the finishing
        // worker's mark (Acquire); see `Instruction::is_awaited`.
        self.0.status.fetch_or(status::AWAITED, Ordering::Relaxed);
    }

    /// Never fused: a sync access (its waiter, and the engine's rules for running it on a
    /// caller, want it alone), a barrier, a custom instruction or lazy-job step (a
    /// deferred body completes later, often strict: a run would serialise its completion
    /// behind the run), and what the builder opted out (`set_fusable`).
    fn fusable(&self) -> bool {
        let i = &self.0;
        if i.waiter.is_some() || i.barrier || i.strict_edges {
            return false;
        }
        // SAFETY: the engine asks before it hands the instruction to an executor, when it
        // owns the body (ownership step 2).
        let body = unsafe { i.body() };
        body.fusable && body.deferred.is_none()
    }
}

/// What the dependency engine asks of a VM stream: the stream's policy decides.
impl ivm_engine::StreamPolicy for StreamShared {
    fn completion(&self) -> Completion {
        if self.policy.done_at_launch() {
            Completion::AtLaunch
        } else {
            Completion::Later
        }
    }

    fn strict_same_stream_edges(&self) -> bool {
        self.policy.strict_same_stream_edges()
    }

    fn may_run_on_caller(&self) -> bool {
        !self.dev.is_async()
    }

    /// Done at launch and in dispatch order (the engine's default), and not a stream that
    /// dispatches in build order: that is the collective stream, where each instruction
    /// meets every rank, and a run would hold its earlier members' releases behind a
    /// rendezvous.
    fn may_fuse(&self) -> bool {
        self.policy.done_at_launch()
            && !self.policy.strict_same_stream_edges()
            && !self.policy.dispatch_in_build_order()
    }
}

type Core = ivm_engine::Engine<Job, Growable>;

/// Live-object counts (see [`crate::VirtualMachine::debug_counters`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DebugCounters {
    /// Lively instructions held by the engine plus instructions received but not handled.
    pub instructions: usize,
    /// Accesses not yet erased.
    pub accesses: usize,
    /// Edges not yet removed.
    pub edges: usize,
    /// Instructions in flight (pending + not released), as `flying_instruction_count`.
    pub flying: usize,
}

/// The engine. See the module docs.
pub(crate) struct Engine {
    pub(crate) core: Core,
    probes: Vec<Probe>,
    /// User probes at the start of the last poll round (`run_probes`), for diagnostics.
    user_probes: usize,
    /// Who runs the current steps (`drive/`): probes and user barriers are the
    /// scheduler thread's.
    driver: Driver,
    /// Set by a step when a non-scheduler driver met work reserved to the scheduler thread
    /// (a submitted probe, a user barrier at the front).
    needs_scheduler: bool,
    /// Ready small sync accesses may run inline in the driver (`Config::inline_sync_access`).
    inline_small: bool,
    /// Small sync accesses run inline since the last step's end (published by `step`).
    inline_runs: usize,
    /// Instructions released by this step, handed to the VM's pool at its end.
    recycled: Vec<Arc<Instruction>>,
    /// Fused runs handed over since the last step's end (published by `step`).
    fused: stats::FusedCount,
}

impl Engine {
    pub(crate) fn new(pending_window: usize) -> Self {
        let mut core = Core::new();
        core.presize(PRESIZE, 2 * PRESIZE, 4 * PRESIZE);
        core.set_pending_window(pending_window);
        Self {
            core,
            probes: Vec::new(),
            user_probes: 0,
            driver: Driver::Scheduler,
            needs_scheduler: false,
            inline_small: false,
            inline_runs: 0,
            recycled: Vec::with_capacity(PRESIZE as usize),
            fused: stats::FusedCount::default(),
        }
    }

    /// The engine `config` asks for: its pending window, and fused runs of at most
    /// `max_fused_run` instructions when `fusion` is on.
    pub(crate) fn for_config(config: &crate::Config) -> Self {
        let mut e = Self::new(config.pending_window);
        e.core.set_max_run(if config.fusion {
            config.max_fused_run
        } else {
            1
        });
        e
    }

    /// Takes a received instruction (drained from the VM's pending queue).
    pub(crate) fn receive(&mut self, instr: Arc<Instruction>) {
        crate::model::trace::record(&instr, crate::model::trace::Phase::Receive);
        if self.core.submit(Job(instr)).is_err() {
            // Growable pools never refuse; a stream index past u32 range cannot exist.
            unreachable!("ivm: the growable engine refused an instruction");
        }
    }

    /// Nothing pending, nothing lively, no probe.
    pub(crate) fn is_idle(&self) -> bool {
        self.core.is_idle() && self.probes.is_empty()
    }

    /// Whether a `step` now could make progress without new input (ready work, pending
    /// work, a barrier at the front, a done instruction at a running front, probes).
    pub(crate) fn has_work(&self) -> bool {
        self.core.has_work() || !self.probes.is_empty()
    }

    pub(crate) fn has_probes(&self) -> bool {
        !self.probes.is_empty()
    }

    /// Who runs the next steps, and whether ready small sync accesses may run inline.
    pub(crate) fn set_driver(&mut self, driver: Driver, inline_small: bool) {
        self.driver = driver;
        self.inline_small = inline_small;
    }

    /// The last step met work reserved to the scheduler thread (see `needs_scheduler`).
    pub(crate) fn needs_scheduler(&self) -> bool {
        self.needs_scheduler
    }

    pub(crate) fn counters(&self) -> (usize, usize, usize) {
        (
            self.core.instructions(),
            self.core.accesses(),
            self.core.edges(),
        )
    }

    /// One scheduling step. Returns whether anything changed.
    pub(crate) fn step(&mut self, shared: &VmCore) -> bool {
        self.needs_scheduler = false;
        if shared.probes_submitted() {
            if self.driver == Driver::Scheduler {
                for p in shared.take_probes() {
                    self.probes.push(p);
                }
            } else {
                self.needs_scheduler = true;
            }
        }
        #[cfg(feature = "fuzzing")]
        self.core.plant(shared.planted());
        let mut exec = Exec {
            shared,
            driver: self.driver,
            inline_small: self.inline_small,
            inline_runs: &mut self.inline_runs,
            recycled: &mut self.recycled,
            needs_scheduler: &mut self.needs_scheduler,
            released: 0,
            run: None,
            fused: &mut self.fused,
        };
        let p = match self.core.step(&mut exec) {
            Ok(p) => p,
            Err(stalled) => unreachable!("ivm: the growable engine stalled: {stalled}"),
        };
        // The engine ends every run within one dispatch; nothing is left collected.
        debug_assert!(exec.run.is_none(), "ivm: a fused run left open");
        exec.hand_over_run();
        let released = exec.released;
        let mut progress = p.any();
        progress |= self.run_probes();
        if released > 0 {
            shared.after_release(released);
        }
        if self.inline_runs > 0 {
            shared
                .cell()
                .count_inline(std::mem::take(&mut self.inline_runs));
        }
        if self.fused.runs > 0 {
            shared.stats().fused(std::mem::take(&mut self.fused));
        }
        if !self.recycled.is_empty() {
            shared.pool().give_back(&mut self.recycled);
        }
        if progress {
            shared.publish_counters(self.counters());
            self.publish_stats(shared.stats());
        }
        progress
    }

    // ---- probes ------------------------------------------------------------------------

    fn run_probes(&mut self) -> bool {
        if self.probes.is_empty() || self.driver != Driver::Scheduler {
            return false;
        }
        let mut probes = std::mem::take(&mut self.probes);
        let before = probes.len();
        // For a diagnostic asked in this round (it sees `self.probes` empty).
        self.user_probes = probes
            .iter()
            .filter(|p| matches!(p, Probe::User(_)))
            .count();
        probes.retain_mut(|p| match p {
            Probe::User(f) => !f(),
            Probe::Diagnose(slot) => {
                slot.fulfil(self.diagnostic());
                false
            }
            Probe::Dag(slot) => {
                slot.fulfil(self.dag());
                false
            }
        });
        let any = probes.len() != before;
        // Probes added while running (none today) would be in `self.probes`.
        probes.append(&mut self.probes);
        self.probes = probes;
        any
    }

    /// Lists lively instructions, oldest first (at most 64).
    pub(crate) fn diagnostic(&self) -> Diagnostic {
        const MAX: usize = 64;
        let mut d = Diagnostic {
            pending: self.core.pending_len(),
            probes: self.user_probes,
            ..Diagnostic::default()
        };
        for l in self.core.lively() {
            if l.state() == ivm_engine::NodeState::Pending {
                continue;
            }
            if d.lively.len() == MAX {
                d.truncated += 1;
                continue;
            }
            let instr = &l.instr().0;
            // Relaxed: diagnostic bits.
            let st = instr.status.load(Ordering::Relaxed);
            d.lively.push(LivelyInstruction {
                name: instr.label(),
                stream: instr.stream.id.to_string(),
                dispatched: st & status::DISPATCHED != 0,
                launched: st & status::LAUNCHED != 0,
                done: st & status::DONE != 0,
                in_edges: l.sources().map(|s| s.0.label()).collect(),
            });
        }
        d
    }
}

/// The engine's hooks for one step: how a dispatched instruction runs, barriers, and
/// taking released instructions back.
struct Exec<'a> {
    shared: &'a VmCore,
    driver: Driver,
    inline_small: bool,
    inline_runs: &'a mut usize,
    recycled: &'a mut Vec<Arc<Instruction>>,
    needs_scheduler: &'a mut bool,
    released: usize,
    /// The fused run being collected for its stream's worker.
    run: Option<OpenRun>,
    fused: &'a mut stats::FusedCount,
}

/// A fused run collected at dispatch: its members are linked through `Body::fused_next`,
/// and the first is queued to the stream's worker at the last member's dispatch.
struct OpenRun {
    head: Arc<Instruction>,
    tail: Arc<Instruction>,
    /// Every member's wake may be left to its waiting caller (`DEFER_WAKE`).
    defer: bool,
    /// A waiting caller may run every member (`worker::caller_may_run`).
    caller_runs: bool,
    len: usize,
}

impl Executor<Job> for Exec<'_> {
    fn dispatch(&mut self, job: &Job, ctx: &DispatchCtx<'_, Job>) -> Dispatched {
        let instr = &job.0;
        // Relaxed: diagnostic bit; the hand-over below carries the ordering. The bits read
        // back were set before the pending-queue push that brought it here
        // (Release/Acquire): `DEFER_WAKE` below.
        let bits = instr.status.fetch_or(status::DISPATCHED, Ordering::Relaxed);
        crate::model::trace::record(instr, crate::model::trace::Phase::Dispatch);
        if ctx.run_index() == 0 {
            // A new run (or none): whatever was collected is complete.
            self.hand_over_run();
        }
        if self.inline_small && can_run_inline(ctx, instr) {
            // The driver runs it now (see `can_run_inline`): no hand-over, no wake.
            crate::engine::execute::execute(instr);
            *self.inline_runs += 1;
            return Dispatched::Handed;
        }
        if self.can_hand_to_caller(ctx, instr) {
            // Its waiting caller drives the engine right now: it runs the instruction
            // after letting go of the engine (`sync_access::sync_callback`); the engine
            // holds later instructions of the stream until its release.
            // Relaxed: read by this very thread.
            instr.status.fetch_or(status::CLAIMED, Ordering::Relaxed);
            return Dispatched::Claimed;
        }
        if can_run_protocol_inline(ctx, instr) {
            // A lazy-job protocol step the driver does now, without blocking (see
            // `can_run_protocol_inline`): no hand-over to the stream's thread, no wake.
            crate::engine::execute::execute_as(instr, false);
            return Dispatched::Handed;
        }
        match (&instr.stream.thread, instr.stream.policy.placement()) {
            (Some(thread), Placement::SharedWorker | Placement::OwnWorker) => {
                // A wake its waiting caller may owe (`thread_ctx.rs`): only where that
                // caller may run it.
                // SAFETY: the engine owns the body until it hands the instruction to an
                // executor (ownership step 2); this is that hand-over, not yet done.
                let caller_runs =
                    crate::engine::worker::caller_may_run(instr, unsafe { instr.body() });
                let defer = bits & status::DEFER_WAKE != 0 && caller_runs;
                if ctx.run_index() > 0 || ctx.run_continues() {
                    self.collect_run(instr, defer, caller_runs, ctx.run_continues());
                } else {
                    thread.submit(instr, defer, caller_runs, self.driver.is_caller());
                }
            }
            // Single-thread mode, or a stream that lives on the scheduler.
            _ => crate::engine::execute::execute(instr),
        }
        Dispatched::Handed
    }

    fn run_barrier(&mut self, job: &Job) -> bool {
        let instr = &job.0;
        // SAFETY: the engine owns a barrier's body until it runs it (ownership step 2).
        let user = matches!(unsafe { instr.body() }.kind, Kind::Barrier(_));
        if self.driver != Driver::Scheduler && user {
            // A user callback runs on the scheduler thread.
            *self.needs_scheduler = true;
            return false;
        }
        // Relaxed: diagnostic bit.
        instr.status.fetch_or(status::DISPATCHED, Ordering::Relaxed);
        crate::model::trace::record(instr, crate::model::trace::Phase::Dispatch);
        crate::engine::execute::execute(instr);
        if user {
            // SAFETY: the barrier ran on this thread, which owns `failure` again.
            if let Some(f) = instr.failure.with(|p| unsafe { (*p).clone() }) {
                self.shared.note_barrier_failure(f);
            }
        }
        true
    }

    fn released(&mut self, job: Job) {
        let instr = job.0;
        crate::model::trace::record(&instr, crate::model::trace::Phase::Release);
        // Planted bug only (`OutOfOrderRelease`): released before it finished, so its
        // executor still owns the body; leave it alone.
        #[cfg(feature = "fuzzing")]
        let premature = self.shared.planted() == ivm_engine::PlantedBug::OutOfOrderRelease
            && instr.status() & status::DONE == 0;
        #[cfg(not(feature = "fuzzing"))]
        let premature = false;
        if !premature {
            // SAFETY: the executor set DONE (the engine read it with Acquire through
            // `is_done`, or a barrier ran here), so the engine owns the body again
            // (ownership step 4).
            unsafe { instr.body_mut() }.release();
        }
        self.shared.instruction_released();
        self.released += 1;
        if !premature {
            // Back to the VM's pool at the end of the step (when nobody else holds it).
            self.recycled.push(instr);
        }
    }
}

impl Exec<'_> {
    /// Adds `instr`, a fused run's member bound for its stream's worker, to the run being
    /// collected; at its last member (`!continues`), queues the run to the worker as one
    /// item: one push, at most one wake, and the worker runs the members back to back.
    fn collect_run(
        &mut self,
        instr: &Arc<Instruction>,
        defer: bool,
        caller_runs: bool,
        continues: bool,
    ) {
        match &mut self.run {
            None => {
                self.run = Some(OpenRun {
                    head: instr.clone(),
                    tail: instr.clone(),
                    defer,
                    caller_runs,
                    len: 1,
                });
            }
            Some(run) => {
                // SAFETY: the tail was dispatched but not handed to an executor yet (only
                // the head is queued, at the run's end), so the engine still owns its body
                // (ownership step 2).
                unsafe { run.tail.body_mut() }.fused_next = Some(instr.clone());
                run.tail = instr.clone();
                run.defer &= defer;
                run.caller_runs &= caller_runs;
                run.len += 1;
            }
        }
        if !continues {
            self.hand_over_run();
        }
    }

    /// Queues the collected run, if any, to its stream's worker.
    fn hand_over_run(&mut self) {
        let Some(run) = self.run.take() else { return };
        if run.len > 1 {
            self.fused.runs += 1;
            self.fused.instructions += run.len;
            self.fused.longest = self.fused.longest.max(run.len);
        }
        drop(run.tail);
        match &run.head.stream.thread {
            Some(thread) => thread.submit(
                &run.head,
                run.defer,
                run.caller_runs,
                self.driver.is_caller(),
            ),
            // Only members bound for a worker are collected.
            None => unreachable!("ivm: a fused run without a worker"),
        }
    }

    /// Whether `instr` (just dispatched) is a sync callback
    /// (`access[_mut]`) that its waiting caller may run itself: that
    /// caller is the thread driving the engine now, inside the submission of this very
    /// instruction (its [`Claim`](crate::engine::drive::Claim): it runs it as soon as the submission
    /// returns, before it waits), on a worker's stream, and the access is one
    /// [`sole_host_access`] allows. As for an inline small access, every other accessor
    /// of the tensor is ordered by an edge from or to it. Unlike it, the callback is user
    /// code and may take long, so it runs after the caller let go of the engine, not
    /// inside this step; meanwhile the engine holds later instructions of its stream
    /// ([`Dispatched::Claimed`]), so that stream order holds although the stream's worker
    /// does not run it.
    fn can_hand_to_caller(&self, ctx: &DispatchCtx<'_, Job>, instr: &Instruction) -> bool {
        matches!(self.driver, Driver::Caller(claim) if claim.is(instr))
            && instr.stream.thread.is_some()
            && sole_host_access(ctx, instr, true)
    }
}

/// Whether `instr` (just dispatched) may run in the driving thread instead of on its
/// stream's thread: a small sync access (8-odd bytes copied, no user code) that
/// [`sole_host_access`] allows.
///
/// Why this stays correct when another thread submits a write to the same tensor at that
/// moment: the engine is held by this driver, so that write is handled either before this
/// access (then the access has an edge from it: not [`DispatchCtx::sole_access`], no
/// inline) or after it (then the write has an edge from this access, which is released
/// only after it ran; a same-stream successor prescheduled by this dispatch is dispatched
/// only after `execute` returned). Every other accessor of the tensor is ordered by an
/// edge, and a released source has finished (its DONE was read with Acquire).
fn can_run_inline(ctx: &DispatchCtx<'_, Job>, instr: &Instruction) -> bool {
    sole_host_access(ctx, instr, false)
}

/// Whether `instr` is a sync access — a small one, or a callback if `callback` — with its
/// waiter, on a stream whose work may run on a caller (a synchronous device), over
/// host-visible memory, that the engine's rule allows ([`DispatchCtx::sole_access`]: every
/// source **released** — done, not merely dispatched, OneFlow #7607 — and nothing else
/// dispatched and unreleased on its stream).
fn sole_host_access(ctx: &DispatchCtx<'_, Job>, instr: &Instruction, callback: bool) -> bool {
    use ivm_engine::StreamPolicy as _;
    if instr.waiter.is_none() || !instr.stream.may_run_on_caller() || !ctx.sole_access() {
        return false;
    }
    // SAFETY: the engine owns the body until it hands the instruction to an executor
    // (ownership step 2); this is that hand-over, not yet done.
    let body = unsafe { instr.body() };
    let operand = match (&body.kind, callback) {
        (Kind::SmallRead { .. }, false) | (Kind::Read(_), true) => body.inputs.as_slice().first(),
        (Kind::SmallWrite { .. }, false) | (Kind::Write(_), true) => {
            body.outputs.as_slice().first()
        }
        _ => return false,
    };
    body.deferred.is_none() && operand.is_some_and(|b| b.mem.host_ptr().is_some())
}

/// Whether `instr` (just dispatched) is a lazy-job protocol step — a critical-section begin
/// or end, or a launch: a deferred body on a critical-section or launcher stream — that the
/// driving thread may run itself: every other instruction of its stream that is dispatched
/// and unreleased has already run its body (`BODY_RAN`, or `DONE` for a step without
/// deferred body; read with Acquire: so the stream's own thread runs nothing of it now,
/// nothing is queued there, and stream order holds — which is all that a prescheduled
/// same-stream edge asks for; edges from other streams and strict ones are satisfied only
/// at their source's release, before it was ready), and its body would not block (every
/// buffer it pushes to has room). The body is the VM's own code (pushes to the graph's
/// buffers, a callback registration), never user code.
///
/// Each of these steps on its stream's thread would cost a wake-up when that thread
/// sleeps — tens of microseconds on a small VM, per step of every launch.
fn can_run_protocol_inline(ctx: &DispatchCtx<'_, Job>, instr: &Instruction) -> bool {
    if instr.stream.policy.placement() != Placement::OwnWorker {
        return false;
    }
    let all_ran = ctx.others_on_stream().all(|j| {
        // Acquire: pairs with the Release in `execute::run_deferred` (or the
        // executor's Release of DONE, for a step without deferred body).
        j.0.status.load(Ordering::Acquire) & (status::BODY_RAN | status::DONE) != 0
    });
    if !all_ran {
        return false;
    }
    // SAFETY: the engine owns the body until it hands the instruction to an executor
    // (ownership step 2); this is that hand-over, not yet done.
    let body = unsafe { instr.body() };
    body.deferred
        .as_ref()
        .is_some_and(crate::model::instruction::Deferred::runs_without_blocking)
}

#[cfg(test)]
mod tests;

mod surface;
