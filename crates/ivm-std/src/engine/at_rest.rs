//! Runs at rest ([`Config::run_at_rest`](crate::Config::run_at_rest)): a `run` whose
//! instructions would all run to completion on the caller the moment the engine dispatched
//! them, with nothing else in flight, runs them right there without the dependency engine
//! (ARCHITECTURE.md, "Runs at rest"). Single-thread mode: every plain kernel of a
//! synchronous device. Multi-thread mode: kernels a caller may run, on streams whose
//! worker found them tiny (`preemption::mark_tiny_kernels`), whose hand-over to another
//! core costs more than running them, or whose worker's callers count as short of CPUs
//! beside busy neighbours (`ThreadCtx::callers_contended_until`), where the caller runs
//! the work anyway (ARCHITECTURE.md, "When another thread takes a core").

use std::sync::Arc;

use crate::engine::core::{ReentryGuard, VmCore, WaitScope};
use crate::model::instruction::Instruction;
use crate::model::trace::{Phase, record};

/// Whether `instr` completes on whichever thread runs it, the moment it runs: a plain
/// instruction (no sync access's waiter, no barrier, no strict edge, no deferred body) on
/// a synchronous device's stream, done at launch. What both modes ask first.
fn completes_where_run(instr: &Instruction) -> bool {
    if instr.waiter.is_some() || instr.barrier || instr.strict_edges {
        return false;
    }
    let s = &instr.stream;
    if s.dev.is_async() || !s.policy.done_at_launch() {
        return false;
    }
    // SAFETY: the builder still owns the body (ownership step 1): the instruction is in
    // its list, not yet pushed anywhere.
    unsafe { instr.body() }.deferred.is_none()
}

/// Single-thread mode: whether the engine, dispatching `instr` with nothing else lively,
/// would have it run to completion right there on the driving thread: it completes where
/// run ([`completes_where_run`]), on a stream without a thread of its own. Anything else
/// keeps the engine's path.
fn runs_at_rest(instr: &Instruction) -> bool {
    instr.stream.thread.is_none() && completes_where_run(instr)
}

/// Multi-thread mode: whether `instr` may run at rest on its caller: it completes where
/// run ([`completes_where_run`]), a caller may run it (`StreamPolicy::caller_may_run`),
/// and its stream's worker found its instructions tiny (`ThreadCtx::tiny_until`) or
/// leaves them to its callers (`ThreadCtx::callers_contended_until`): at `now`
/// (`util::now_us`) in a judged run, else as last seen (a mark found expired is cleared
/// by the next judged run).
fn runs_at_rest_on_caller(instr: &Instruction, now: Option<usize>) -> bool {
    let s = &instr.stream;
    let Some(t) = s.thread.as_ref() else {
        return false;
    };
    s.policy.caller_may_run()
        && completes_where_run(instr)
        && match now {
            Some(now) => {
                t.tiny_until.holds_or_clear_at(now)
                    || t.callers_contended_until.holds_or_clear_at(now)
            }
            None => t.tiny_until.is_set() || t.callers_contended_until.is_set(),
        }
}

/// One run at rest on a caller in this many, on average, is judged ([`judge`]): timed,
/// and its marks checked against the clock: three clock reads (two cost a fifth of a
/// one-instruction `run` at rest, `perf record`, 2026-12-07); the marks are hints, held
/// for 20 ms. Drawn at random, never by a fixed period: a front end repeating a pattern
/// of runs over several streams would otherwise always judge the same one.
const JUDGE_ONE_IN: u32 = 8;

std::thread_local! {
    /// This thread's draw of the judged runs.
    static JUDGE_DRAW: std::cell::Cell<crate::util::OneIn> =
        const { std::cell::Cell::new(crate::util::OneIn::new()) };
}

/// Whether this thread's next run at rest is judged: one in [`JUDGE_ONE_IN`].
fn judged() -> bool {
    JUDGE_DRAW.with(|c| {
        let mut d = c.get();
        let judged = d.draw(JUDGE_ONE_IN);
        c.set(d);
        judged
    })
}

/// A run at rest that took longer than this many times `Config::tiny_kernel_ns` an
/// instruction, plus [`SLOW_SLACK_NS`], was not of tiny kernels.
const SLOW_FACTOR: u64 = 4;

/// Nanoseconds a run at rest may take beyond its kernels' tiny budget before it counts as
/// slow: room for a timer interrupt or a page fault. Small against the kernels it must
/// catch (a one-instruction run of 300 ns kernels is slow past 6.2 µs): a run slowed by
/// an interrupt that ends a mark in error only costs the worker's timing of the next
/// instructions until it marks them again, while kernels that grew to microseconds and
/// were judged fast would stay on their callers, each `run` blocked while they run.
const SLOW_SLACK_NS: u64 = 5_000;

/// After a run at rest on the caller (multi-thread mode) whose kernels took `took` and
/// ended at `end` (`util::now_us`): kernels that turned out slow end their streams' tiny
/// marks, so that the next `run` goes to the workers again, which time their kernels
/// anew; tiny ones keep the marks (and the VM's hint) from lapsing, which would send the
/// next thousands of instructions to the worker until it had timed enough of them again.
/// A run admitted by a contention mark alone sets no tiny mark.
fn judge(vm: &VmCore, list: &[Arc<Instruction>], took: std::time::Duration, end: usize) {
    let len = u64::try_from(list.len()).unwrap_or(u64::MAX);
    let budget_ns = vm
        .config()
        .tiny_kernel_ns
        .saturating_mul(len)
        .saturating_mul(SLOW_FACTOR)
        .saturating_add(SLOW_SLACK_NS);
    let slow = took.as_nanos() > u128::from(budget_ns);
    let hold = crate::util::tuning::CONTENDED_HOLD;
    let mut last: Option<&Arc<crate::model::thread_ctx::ThreadCtx>> = None;
    for t in list.iter().filter_map(|i| i.stream.thread.as_ref()) {
        if last.is_some_and(|l| Arc::ptr_eq(l, t)) {
            continue;
        }
        last = Some(t);
        if slow {
            t.tiny_until.clear();
        } else if t.tiny_until.is_set() {
            t.tiny_until.renew_at(end, hold);
        }
    }
    if !slow && vm.tiny_kernels_until.is_set() {
        vm.tiny_kernels_until.renew_at(end, hold);
    }
}

impl VmCore {
    /// [`Config::run_at_rest`](crate::Config::run_at_rest): runs the instructions of one
    /// `run` (`list`, in build order) here and now, without the dependency engine, where
    /// this mode allows it (the module docs). Returns whether they ran (the list is then
    /// empty, else untouched), and the wait hook's scope if one was opened: the caller
    /// closes it once the run's work is done or submitted, so that a hook that panics
    /// (re-raised as the scope closes) unwinds with nothing lost and no engine held.
    pub(crate) fn run_at_rest(
        &self,
        list: &mut Vec<Arc<Instruction>>,
    ) -> (bool, Option<WaitScope>) {
        if list.is_empty() || !self.config().run_at_rest {
            return (false, None);
        }
        if self.single_thread() {
            self.run_at_rest_single(list)
        } else {
            self.run_at_rest_on_caller(list)
        }
    }

    /// Single-thread mode: runs the instructions of one `run` (`list`, in build order) here
    /// and now, without the dependency engine, when the engine is at rest — nothing lively,
    /// nothing received, no probe — and every one of them would run to completion on this
    /// thread the moment the engine dispatched it (see [`runs_at_rest`]). Returns whether
    /// they ran; the list is then empty, else untouched.
    ///
    /// Why nothing observable changes: with the engine idle every instruction ever
    /// received is released, and while this thread holds the engine nothing is dispatched,
    /// so each instruction of the list would have no edge into it and would be dispatched,
    /// run and released in build order by this very thread's `drive`. It runs the same
    /// `execute` (poison, panics, `landed`, trace), in that order, under the same guards
    /// (the wait hook's scope, the reentrancy guard) and counts each as received and
    /// released.
    /// What waits in the pending queue (a tensor's release since the last call) is handled
    /// first, as `drive` would; a submission from another thread meanwhile waits there and
    /// is handled after these, as if this `run` had driven first; a tensor release a kernel
    /// pushes follows the list, as it would. What is saved is the engine's work per instruction:
    /// its handling, edges, dispatch and release (`docs/perf-2026-12-05.md`).
    fn run_at_rest_single(&self, list: &mut Vec<Arc<Instruction>>) -> (bool, Option<WaitScope>) {
        if !list.iter().all(|i| runs_at_rest(i)) {
            return (false, None);
        }
        // The shutdown gate, as for any submission; a refusal is reported by `receive_list`.
        let Ok(pass) = self.enter() else {
            return (false, None);
        };
        let Some(mut engine) = self.try_engine() else {
            return (false, None);
        };
        // Holding the engine orders this run with shutdown, whose drive needs it: the pass
        // is not kept while kernels run (shutdown waits for passes without a bound).
        drop(pass);
        let _reentry = ReentryGuard::enter(self.id());
        // The wait hook's scope before anything runs on this thread, pending work included
        // (`util/hooks.rs`); not opened for a run that goes on to the engine's path at once.
        let mut hook = None;
        if !self.pending().is_empty() {
            hook = Some(self.wait_scope());
            // Older submissions first, as `drive` would handle them: usually the releases
            // of tensors dropped since the last call, done at once.
            self.step_to_rest(&mut engine);
        }
        if !engine.is_idle() || !self.pending().is_empty() {
            return (false, hook);
        }
        let hook = hook.unwrap_or_else(|| self.wait_scope());
        self.run_here(list);
        // Before the engine is let go: shutdown, which needs it, empties the pool for good.
        self.pool().give_back(list);
        list.clear();
        drop(engine);
        (true, Some(hook))
    }

    /// Multi-thread mode: runs `list` here when a worker marked its kernels tiny
    /// (`VmCore::tiny_kernels_until`) or a look found busy neighbours leaving the VM too
    /// few CPUs (`VmCore::callers_contended_until`), every instruction of it may
    /// ([`runs_at_rest_on_caller`]) and the engine, taken with the engine token, is at
    /// rest: as single-thread mode's run at rest, holding the token instead of the engine's
    /// mutex, so that nothing is dispatched meanwhile (`VmCore::engine_at_rest`). The
    /// kernels run on this thread rather than on their stream's worker, as a caller that
    /// catches up with a worker's queue runs them (`worker::caller_runs`), and inside the
    /// wait hook's scope, as there. One run in [`JUDGE_ONE_IN`] is timed ([`judge`]): the
    /// worker, which no longer sees these kernels, does not time them.
    fn run_at_rest_on_caller(&self, list: &mut Vec<Arc<Instruction>>) -> (bool, Option<WaitScope>) {
        // The VM's hints first: no clock read unless some worker marked its kernels tiny
        // or a look found the callers short of CPUs. Not a caller's own wait for its CPU
        // (`CallerSense`, which marks the workers only): a flood's own threads trip that.
        if !self.tiny_kernels_until.is_set() && !self.callers_contended_until.is_set() {
            return (false, None);
        }
        let start = judged().then(crate::util::now_us);
        if start.is_some_and(|now| {
            !self.tiny_kernels_until.holds_or_clear_at(now)
                && !self.callers_contended_until.holds_or_clear_at(now)
        }) || !list.iter().all(|i| runs_at_rest_on_caller(i, start))
        {
            return (false, None);
        }
        // The shutdown gate, as for any submission; a refusal is reported by `receive_list`.
        let Ok(pass) = self.enter() else {
            return (false, None);
        };
        // The wait hook's scope opens only once the run goes ahead (`wait_scope` catches a
        // panic of the hook's `before_wait`); it is closed by our caller, with no token
        // held. The list goes back to the pool while the token is held: once it is let
        // go, shutdown may empty the pool for good (`InstrPool::clear`).
        let hook = self.engine_at_rest(Some(pass), || {
            let hook = self.wait_scope();
            // The kernels alone are timed (not the token, the rest steps, the hook).
            let t0 = start.map(|s| (s, std::time::Instant::now()));
            self.run_here(list);
            if let Some((start, t0)) = t0 {
                // The end on the hints' clock from the start read before the token: a few
                // microseconds early at most, for a mark held 20 ms.
                let took = t0.elapsed();
                let took_us = usize::try_from(took.as_micros()).unwrap_or(usize::MAX);
                judge(self, list, took, start.saturating_add(took_us));
            }
            self.pool().give_back(list);
            list.clear();
            hook
        });
        (hook.is_some(), hook)
    }

    /// Runs `list` on this thread, in order, as the engine's dispatch would, each counted
    /// as received and released. The caller holds the engine, at rest.
    fn run_here(&self, list: &[Arc<Instruction>]) {
        for instr in list.iter() {
            record(instr, Phase::Receive);
            record(instr, Phase::Dispatch);
            crate::engine::execute::execute(instr);
            record(instr, Phase::Release);
            // SAFETY: the instruction never left this thread: it was built here (step 1),
            // reached neither the pending queue nor the engine, and `execute` ran it here
            // and set DONE (step 3: a synchronous device, no deferred body, see
            // `completes_where_run`), so this thread owns the body as the engine would at
            // its release (step 4); nobody else holds a reference into it.
            unsafe { instr.body_mut() }.release();
            // Counted one by one, as the engine releases them: progress that a caller
            // waiting for the engine on another thread measures its period by.
            self.count_at_rest();
        }
    }
}
