//! Who drives the engine (multi-thread mode): an ownership token over the engine that the
//! scheduler thread, a submitting caller or a worker that just finished an instruction
//! takes, so that the common paths need no scheduler thread at all.
//!
//! # Why
//!
//! On a machine with few cores every hop between threads costs: a sleeping thread takes
//! 35–50 µs to wake, and three spinning threads on two cores starve each other. With one
//! scheduler thread owning the engine, a sync read took three hand-overs (caller →
//! scheduler → worker → caller) and every cross-stream edge waited for the scheduler to
//! release its source. Here whoever has input for the engine runs the engine steps
//! itself when nobody else is:
//!
//! * a **caller** that submits instructions (`run`, sync accesses, `sync`) takes the
//!   engine if it is free, handles what it submitted, dispatches it (a ready small access
//!   may even run inline, see `engine/mod.rs`) and releases what is done;
//! * a **worker** that finished an instruction takes the engine if it is free and releases
//!   it at once, readying and dispatching its successors (also on other streams: no
//!   scheduler round trip on a cross-stream edge);
//! * a **caller waiting** for a result (a sync access) is a *helper* (`helping::Helping`) while
//!   it spins: it drives whenever input is marked, so a worker with more instructions
//!   queued leaves its releases to it (`helping::Owed`) and any producer skips waking the
//!   scheduler ([`EngineToken::unpark`]);
//! * a **submitting caller**, from its push to its drive, may be left a worker's release
//!   for one kernel (`helping::Helping::submitting`), since it drives the engine right after;
//! * **whoever drives next** may be left a worker's release that nothing waits for (no
//!   successor on another stream or behind a strict edge, no barrier, no submitter
//!   waiting for backpressure: `helping::Owed::leave_unless_awaited`), behind long
//!   kernels, until that worker's queue runs dry;
//! * a **lazy-job completion** on a graph runtime's thread drives the engine right there
//!   when nobody holds it and no helper spins ([`EngineToken::complete_outside`]);
//! * the **scheduler thread** is the driver of last resort: probes, user barriers (their
//!   callbacks run on the scheduler thread), device completions that
//!   arrive while nobody drives, shutdown, and hand-overs from a driver that ran out of its
//!   step budget. It sleeps through ivm-core's `Parking` protocol otherwise.
//!
//! Exactly one thread at a time holds the engine; nobody ever blocks on it (try-lock only).
//!
//! The pieces: the token over the engine and its protocol ([`token`], checked by
//! `tests/loom_wake_path.rs`), where single-thread callers sleep ([`single_waits`]), and
//! here the engine's cell and the drive entry points of [`VmCore`] (`after_push`,
//! `completed`, `help`, `drive_as`, `try_direct`).

mod single_waits;
mod token;

pub use single_waits::SingleWaits;
pub use token::EngineToken;
pub(crate) use token::{mark_graph_thread, take_completion_marked};

use ivm_core::sync::{AtomicUsize, Ordering, UnsafeCell};

use crate::engine::Engine;
use crate::engine::core::{ReentryGuard, VmCore};

/// Which kind of thread drives the engine (some work is reserved to the scheduler thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Driver {
    /// The scheduler thread: may do everything (probes, user barriers).
    Scheduler,
    /// A caller submitting work (`run`, sync accesses, `sync`), with the one instruction
    /// the engine may hand back to it to run itself, if any.
    Caller(Claim),
    /// A worker thread, after it finished an instruction.
    Worker,
}

impl Driver {
    /// A caller that will run nothing the engine hands it.
    pub(crate) const CALLER: Driver = Driver::Caller(Claim::NONE);

    /// Whether the driving thread is a caller (not a worker or the scheduler).
    pub(crate) fn is_caller(self) -> bool {
        matches!(self, Driver::Caller(_))
    }
}

/// The sync callback a caller is submitting, passed down its submission's drive: the only
/// instruction the engine may hand to that caller (`status::CLAIMED`), since the caller
/// runs it right after its submission returns (`sync_callback`). Compared by address; the
/// caller keeps the instruction alive for as long as it drives with the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim(usize);

impl Claim {
    /// No instruction: the caller runs nothing the engine hands it.
    pub(crate) const NONE: Claim = Claim(0);

    /// A claim on `instr`.
    pub(crate) fn of(instr: &crate::model::instruction::Instruction) -> Self {
        Claim(std::ptr::from_ref(instr) as usize)
    }

    /// Whether this is a claim on `instr`.
    pub(crate) fn is(self, instr: &crate::model::instruction::Instruction) -> bool {
        self != Claim::NONE && self.0 == std::ptr::from_ref(instr) as usize
    }
}

impl Driver {
    /// Engine steps with progress a driver may run before it hands over to the scheduler
    /// thread (each step handles at most `pending_window` received instructions).
    fn step_budget(self) -> u32 {
        match self {
            Driver::Scheduler | Driver::Caller(_) => 64,
            Driver::Worker => 16,
        }
    }
}

/// The engine of a multi-thread VM, guarded by the `LOCKED` bit of the VM's [`EngineToken`].
/// `None` after the scheduler thread took it out at shutdown.
pub(crate) struct EngineCell {
    engine: UnsafeCell<Option<Engine>>,
    /// Small sync accesses run inline by a driver, ever (diagnostics and tests).
    inline_runs: AtomicUsize,
    /// Small sync accesses done directly by their caller (`try_direct`), ever.
    direct_runs: AtomicUsize,
}

// SAFETY: the engine inside is touched only by the thread holding `LOCKED` (one at a
// time; each hand-over is a Release unlock read by an Acquire lock), and `Engine: Send`.
unsafe impl Sync for EngineCell {}
// SAFETY: as above.
unsafe impl Send for EngineCell {}

impl EngineCell {
    pub(crate) fn new(engine: Option<Engine>) -> Self {
        Self {
            engine: UnsafeCell::new(engine),
            inline_runs: AtomicUsize::new(0),
            direct_runs: AtomicUsize::new(0),
        }
    }

    /// The engine ran `n` more small sync accesses inline.
    pub(crate) fn count_inline(&self, n: usize) {
        // Relaxed: a statistic.
        self.inline_runs.fetch_add(n, Ordering::Relaxed);
    }

    /// Small sync accesses run inline so far.
    pub(crate) fn inline_runs(&self) -> usize {
        // Relaxed: a statistic.
        self.inline_runs.load(Ordering::Relaxed)
    }

    /// Small sync accesses done directly by their caller so far.
    pub(crate) fn direct_runs(&self) -> usize {
        // Relaxed: a statistic.
        self.direct_runs.load(Ordering::Relaxed)
    }

    fn count_direct(&self) {
        // Relaxed: a statistic.
        self.direct_runs.fetch_add(1, Ordering::Relaxed);
    }

    /// The engine.
    ///
    /// # Safety
    /// The caller holds `LOCKED` of this VM's [`EngineToken`] and no other reference obtained
    /// from this function is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get(&self) -> &mut Option<Engine> {
        // SAFETY: exclusive by the caller's contract (the engine token).
        self.engine.with_mut(|p| unsafe { &mut *p })
    }
}

/// How a drive ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DriveEnd {
    /// The engine is clean and let go.
    Unlocked,
    /// Handed over to the scheduler thread (budget, probe, user barrier, shutdown).
    HandedOver,
}

impl VmCore {
    /// Multi-thread mode, after instructions were pushed to the pending queue: makes sure
    /// the engine sees them — by driving it here when nobody holds it and `may_drive`, by
    /// a mark for the holder, or by waking the scheduler. `claim`: the instruction the
    /// engine may hand back to this caller if it drives ([`Claim`]). `want`: a holder is
    /// asked to hand the engine over ([`EngineToken::acquire_or_want`]) — when what was
    /// pushed goes to a worker with work queued, whose time driving would be taken from
    /// that work; else a held engine is only marked (a worker with nothing queued may as
    /// well drive, and a hand-over costs both threads a transfer of the engine's data).
    pub(crate) fn after_push(&self, may_drive: bool, claim: Claim, want: bool) {
        if !may_drive {
            self.token().unpark();
            return;
        }
        if !want {
            if self.token().acquire_or_mark() {
                self.drive_as(Driver::Caller(claim));
            }
            return;
        }
        // Waits for a holder to hand the engine back for a few microseconds at most (a
        // holder hands it over at its next step boundary).
        let start = std::time::Instant::now();
        let mut looks = 0u32;
        let keep_waiting = || {
            looks = looks.wrapping_add(1);
            !looks.is_multiple_of(32) || start.elapsed() < crate::util::tuning::HAND_BACK_PATIENCE
        };
        if self.token().acquire_or_want(keep_waiting) {
            self.drive_as(Driver::Caller(claim));
        }
    }

    /// A worker finished an instruction (its `DONE` is published): the engine must release
    /// it. Drives here when nobody holds the engine.
    pub(crate) fn completed(&self) {
        if self.token().acquire_or_mark() {
            self.drive_as(Driver::Worker);
        }
    }

    /// A caller waiting for something the engine must do (a ring entry's release): drives
    /// if nobody holds the engine.
    pub(crate) fn help(&self) {
        if self.token().try_lock() {
            self.drive_as(Driver::CALLER);
        }
    }

    /// Drives the engine, which this thread (a caller or a worker) holds (`LOCKED`),
    /// until it is clean or the driver's step budget is spent, then lets go (see the
    /// module docs). The scheduler thread has its own loop (`scheduler.rs`).
    pub(crate) fn drive_as(&self, who: Driver) -> DriveEnd {
        debug_assert!(
            who != Driver::Scheduler,
            "ivm: the scheduler drives in its own loop"
        );
        // SAFETY: we hold LOCKED (our caller took it); the reference ends before we let go.
        let Some(engine) = (unsafe { self.cell().get() }).as_mut() else {
            // Shut down: the scheduler took the engine out and keeps the word locked.
            return DriveEnd::Unlocked;
        };
        let _reentry = matches!(who, Driver::Caller(_)).then(|| ReentryGuard::enter(self.id()));
        engine.set_driver(who, self.config().inline_sync_access);
        let budget = who.step_budget();
        let mut steps = 0u32;
        loop {
            self.drain_pending(engine);
            let progress = engine.step(self);
            if engine.needs_scheduler() || self.stop_requested() {
                self.token().unlock_to_scheduler();
                return DriveEnd::HandedOver;
            }
            if progress {
                steps += 1;
                if steps >= budget {
                    self.token().unlock_to_scheduler();
                    return DriveEnd::HandedOver;
                }
                // A submitting caller waits for the engine: it drives from here on.
                if self.token().hand_over() {
                    return DriveEnd::Unlocked;
                }
                if engine.has_work() || !self.pending().is_empty() {
                    continue;
                }
                // Nothing left that a step could do: let go without one more (empty)
                // step. What arrives meanwhile is marked, and the unlock sees the mark.
            }
            if self.token().unlock() {
                return DriveEnd::Unlocked;
            }
        }
    }

    /// The fast path of a small sync access (`Config::inline_sync_access`): takes the
    /// engine if nobody holds it, brings it to rest (drains the pending queue, steps until
    /// no progress, at most a few steps), and if it is then idle — nothing lively, nothing
    /// received, no probe — runs `f` (the access) right there, holding the engine, and
    /// returns `true`. Then lets go like any driver (driving on if input was marked
    /// meanwhile). `f` returns whether it did the access itself (counted as direct); the
    /// express lane (`model/express.rs`) hands it to a polling worker instead, or declines.
    ///
    /// Why `f` may touch the tensor's memory: with the engine idle every instruction ever
    /// received is released (its body finished: DONE was read with Acquire), and while we
    /// hold the engine nothing can be dispatched, so no body accesses any tensor. A write
    /// submitted by another thread at the same moment waits in the pending queue and is
    /// handled (and ordered after this access) once we let go. The access itself is a
    /// plain copy, no user code, done here or by the stream's polling worker while we wait.
    /// `tests/inline_access_stress.rs` checks it under load.
    pub(crate) fn try_direct(&self, f: impl FnOnce() -> bool) -> bool {
        if self.single_thread() {
            // Single-thread mode: the caller drives anyway.
            let Some(mut engine) = self.try_engine() else {
                return false;
            };
            let _reentry = ReentryGuard::enter(self.id());
            self.step_to_rest(&mut engine);
            let rest = engine.is_idle() && self.pending().is_empty();
            if rest && f() {
                self.cell().count_direct();
            }
            return rest;
        }
        match self.engine_at_rest(None, f) {
            Some(true) => {
                self.cell().count_direct();
                true
            }
            Some(false) => true,
            None => false,
        }
    }

    /// Multi-thread mode: takes the engine token if nobody holds it (after which `pass`,
    /// the caller's shutdown pass if it took one, is let go: holding the token orders
    /// what follows with shutdown, whose drive needs it), brings the engine to rest (drains
    /// the pending queue, steps until no progress, at most a few steps), and if it is then
    /// idle — nothing lively, nothing received, no probe — runs `f` right there, holding
    /// the token. Then lets go like any driver (driving on if input was marked
    /// meanwhile). `None`: the token was held, or the engine was not at rest.
    pub(crate) fn engine_at_rest<R>(
        &self,
        pass: Option<crate::engine::gate::Pass<'_>>,
        f: impl FnOnce() -> R,
    ) -> Option<R> {
        const REST_STEPS: u32 = 8;
        if !self.token().try_lock() {
            return None;
        }
        drop(pass);
        let (ran, needs_scheduler) = {
            // SAFETY: we hold the engine token; the reference ends in this block.
            let Some(engine) = (unsafe { self.cell().get() }).as_mut() else {
                // Shut down: the scheduler keeps the token; never reached (callers are
                // refused first), and nothing to let go.
                return None;
            };
            let _reentry = ReentryGuard::enter(self.id());
            engine.set_driver(Driver::CALLER, self.config().inline_sync_access);
            let at_rest = |engine: &Engine| engine.is_idle() && self.pending().is_empty();
            for _ in 0..REST_STEPS {
                if at_rest(engine) {
                    break;
                }
                self.drain_pending(engine);
                if !engine.step(self) {
                    break;
                }
            }
            let needs_scheduler = engine.needs_scheduler();
            let rest = at_rest(engine) && !needs_scheduler;
            (rest.then(f), needs_scheduler)
        };
        // Let go like any driver (we took on every input marked before our lock).
        if needs_scheduler || self.stop_requested() {
            self.token().unlock_to_scheduler();
        } else if !self.token().unlock() {
            self.drive_as(Driver::CALLER);
        }
        ran
    }

    /// Holder of the engine: moves everything on the pending queue into the engine. An
    /// `Inconsistent` end needs no retry: that producer marks the word after its push
    /// completes (module docs), so some driver drains it then.
    pub(crate) fn drain_pending(&self, engine: &mut Engine) {
        let mut consumer = self.pending().consume();
        let _ = consumer.drain(|i| engine.receive(i));
    }
}
