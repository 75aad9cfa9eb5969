//! Submission into a VM's engine ([`VmCore::receive_list`], [`VmCore::receive_one`]):
//! through the shutdown gate, past backpressure (a submitter waits while too many
//! instructions are in flight, woken from [`VmCore::after_release`]), onto the pending
//! queue, then to whoever drives next. The life of an instruction, step 2, in
//! ARCHITECTURE.md.

use std::sync::Arc;
use std::time::Duration;

use ivm_core::sync::Ordering;
use ivm_core::wait::Wait;

use crate::engine::core::{VmCore, inside};
use crate::engine::drive::Claim;
use crate::model::instruction::Instruction;
use crate::model::thread_ctx::ThreadCtx;
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;

impl VmCore {
    /// Hands `list` to the scheduler (emptying it); wakes it on the empty edge. With
    /// `backpressure`, first waits while too many instructions are in flight.
    pub(crate) fn receive_list(
        &self,
        list: &mut Vec<Arc<Instruction>>,
        backpressure: bool,
    ) -> Result<()> {
        if list.is_empty() {
            return Ok(());
        }
        let token = match self.enter() {
            Ok(t) => t,
            Err(e) => {
                list.clear();
                return Err(e);
            }
        };
        if backpressure
            && !self.single_thread()
            && self.flying() > self.config().high_water_mark
            && let Err(e) = self.wait_backpressure()
        {
            list.clear();
            return Err(e);
        }
        // From here to its drive the submission never waits for anything: a worker that
        // finishes an instruction meanwhile may leave the release to it for one kernel
        // (`helping::Helping::submitting`), if any worker runs long kernels (only those do;
        // registering costs two RMWs and a fence). Not around the backpressure wait
        // above, nor the user's `run` closure: either may outlast any kernel.
        // Relaxed: a hint; a worker that misses the registration releases itself.
        // A VM thread (a kernel dropping a tensor) does not drive here: not a submitter.
        let _submitting =
            (!self.single_thread() && self.long_kernels_somewhere() && !inside(self.id()))
                .then(|| crate::engine::helping::Helping::submitting(self));
        self.count_in_flight(list.len());
        // One chain: the submission reaches the engine in one piece (see `pending`).
        let want = busy_worker(&list[0]);
        let wake = self.pending().push_chain(list.drain(..));
        self.pushed_claiming(wake, Claim::NONE, want);
        drop(token);
        Ok(())
    }

    /// [`receive_list`](Self::receive_list) for a `run`'s instructions (with
    /// backpressure), then, beside a busy thread, the catch-up
    /// ([`catch_up_when_contended`](Self::catch_up_when_contended)): only here, since the
    /// timed doors promise their deadline and the async reads and writes not to block
    /// (`run_async`, a `run` with a completion, comes here too). After the push and
    /// outside the shutdown gate: the run's own work is submitted whatever the caught-up
    /// kernels or the wait hook then do (a panic included), and shutdown's drain never
    /// waits for user code.
    pub(crate) fn receive_run(&self, list: &mut Vec<Arc<Instruction>>) -> Result<()> {
        // The count before the push: the work already in flight is what may be run.
        let bound = (!self.single_thread()
            && !list.is_empty()
            && self.flying() > self.config().contended_high_water_mark)
            .then(|| list[0].id);
        self.receive_list(list, true)?;
        if let Some(bound) = bound {
            self.catch_up_when_contended(bound);
        }
        Ok(())
    }

    /// After pushes to the pending queue (`was_empty`: one of them found it empty): the
    /// engine must see them. Single-thread mode: the caller drives next; wake a parked
    /// driver on the empty edge. Multi-thread mode: drive here if nobody holds the engine
    /// and this is not a VM thread, else mark it / wake the scheduler (`drive/`).
    pub(crate) fn pushed(&self, was_empty: bool) {
        self.pushed_claiming(was_empty, Claim::NONE, false);
    }

    /// [`pushed`](Self::pushed), by a caller that runs `claim` itself if the engine hands
    /// it over while this caller drives ([`Claim`]).
    /// `want`: see [`after_push`](Self::after_push).
    fn pushed_claiming(&self, was_empty: bool, claim: Claim, want: bool) {
        if self.single_thread() {
            if was_empty {
                self.token().unpark();
            }
        } else {
            self.after_push(!inside(self.id()), claim, want);
        }
    }

    pub(crate) fn receive_one(&self, instr: Arc<Instruction>, backpressure: bool) -> Result<()> {
        self.receive_one_claiming(instr, backpressure, false)
    }

    /// [`receive_one`](Self::receive_one) for a sync callback whose caller runs it itself
    /// if the engine, driven by this caller inside this call, hands it over (it is then
    /// marked `status::CLAIMED` when this returns): `claim`.
    pub(crate) fn receive_one_claiming(
        &self,
        instr: Arc<Instruction>,
        backpressure: bool,
        claim: bool,
    ) -> Result<()> {
        let token = self.enter()?;
        if backpressure && !self.single_thread() && self.flying() > self.config().high_water_mark {
            self.wait_backpressure()?;
        }
        // The caller keeps its own handle on `instr`, so the address stays its own while
        // it drives with the claim.
        let claim = if claim {
            Claim::of(&instr)
        } else {
            Claim::NONE
        };
        let want = busy_worker(&instr);
        let was_empty = self.push_counted(instr);
        self.pushed_claiming(was_empty, claim, want);
        drop(token);
        Ok(())
    }

    /// Backpressure while the VM's callers lose their CPU to other threads, or while a
    /// worker's instructions are tiny (`Config::contended_high_water_mark`;
    /// ARCHITECTURE.md, "When another thread takes a core"): their workers then doze, and a
    /// caller's pushes leave the wakes to the dozes' deadlines, so what a woken worker
    /// would run beside the caller, on the CPU the busy thread leaves (or for more CPU
    /// than the instructions take), the submitting caller runs itself, between its own
    /// calls. Only what was built before this submission (ids below `bound`, whichever
    /// thread built it; the submission's own instructions run after `run` returns, as
    /// always), and only from the queues of sleeping workers marked contended, in order,
    /// what a waiting caller may run (`worker::caller_runs_built_before`), inside the wait
    /// hook.
    fn catch_up_when_contended(&self, bound: usize) {
        // The hint first: no lock and, most of the time, no clock on a quiet machine.
        if inside(self.id())
            || !(self.callers_contended_until.holds_or_clear()
                || self.tiny_kernels_until.holds_or_clear())
        {
            return;
        }
        let workers = self.with_workers(|all| {
            let mut mine: heapless::Vec<Arc<ThreadCtx>, CATCH_UP_WORKERS> = heapless::Vec::new();
            // Only contended workers: their wakes are left to their dozes' deadlines. Any
            // other parked worker with a queue was notified and is about to run it; taking
            // its head would only race it (and could start, on this thread, a kernel that
            // waits for what this caller does next).
            let dozing = |c: &&Arc<ThreadCtx>| {
                c.is_parked() && !c.queue.is_empty() && crate::engine::preemption::is_contended(c)
            };
            for c in all.iter().filter(dozing) {
                if mine.push(c.clone()).is_err() {
                    break;
                }
            }
            mine
        });
        if workers.is_empty() {
            return;
        }
        // Inside the embedder's wait hook, as a wait: a kernel may need what the caller
        // holds between its calls (a front end's global lock, `WaitHook`'s example).
        let _hook = self.wait_scope();
        for ctx in &workers {
            crate::engine::worker::caller_runs_built_before(self, ctx, bound);
        }
    }

    /// Blocks until fewer than the low-water mark are in flight.
    fn wait_backpressure(&self) -> Result<()> {
        let _hook = self.wait_scope();
        let low = self.config().low_water_mark;
        // Counted, then a SeqCst fence (`Backpressure::announce`): store buffering with
        // `after_release` (which decrements `flying`, fences, then reads the waiters) and
        // with a worker's mark (`VmCore::backpressured`): one of us sees the other.
        let waiting = self.backpressure().announce();
        // A worker may have left a release for whoever drives next (an unawaited debt,
        // `helping::Owed::leave_unless_awaited`) before it could see us: pay it, since
        // we wait for releases. One it marks after our count sees us and pays itself.
        // As after a push: drives here, or has the scheduler thread drive for a VM thread.
        if self.token().dirty_unlocked() {
            self.after_push(!inside(self.id()), Claim::NONE, false);
        }
        let period = self.config().timeout_period;
        let mut last = self.progress();
        let mut period_end = FutexWait::now().saturating_add(period);
        let r = loop {
            // Before the count (Acquire inside: a bump we read comes with its decrement).
            let seq = waiting.seq();
            if self.flying() < low {
                break Ok(());
            }
            let slice = FutexWait::now().saturating_add(Duration::from_millis(10));
            waiting.sleep(seq, Some(slice.min(period_end)));
            if FutexWait::now() >= period_end {
                let now = self.progress();
                if now == last {
                    break Err(Error::Timeout(self.diagnostic()));
                }
                last = now;
                period_end = FutexWait::now().saturating_add(period);
            }
        };
        drop(waiting);
        r
    }

    /// Engine, after releasing (its decrements of `flying` done): wakes backpressured
    /// submitters below the low-water mark (`Backpressure::after_release`).
    pub(crate) fn after_release(&self, _released: usize) {
        self.backpressure()
            .after_release(|| self.flying() < self.config().low_water_mark);
    }
}

/// Whether `instr` goes to a worker that has work queued and runs long kernels (hints
/// for the hand-back, [`VmCore::after_push`]): with short kernels the engine's work is
/// the bottleneck, and splitting it between the worker and the caller is faster than
/// handing the engine back and forth (`perf_report`'s `instr_per_s_single` halved).
fn busy_worker(instr: &Instruction) -> bool {
    instr.stream.thread.as_deref().is_some_and(|w| {
        // Relaxed: a hint.
        w.long_kernels.load(Ordering::Relaxed) && !w.queue.is_empty()
    })
}

/// The most workers one catch-up runs the queues of (`catch_up_when_contended`): the
/// first ones of the VM, looked up under one lock, without allocating.
const CATCH_UP_WORKERS: usize = 8;
