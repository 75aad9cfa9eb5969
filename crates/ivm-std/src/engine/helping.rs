//! Who releases what a worker finished, and how a waiting caller spins: a worker's debt
//! to the engine ([`Owed`]), a spinning caller registered as a *helper* that pays such debts
//! ([`Helping`], [`Helpers`], checked by `tests/loom_helpers.rs`), and the two spin loops
//! of a caller waiting for a result ([`spin_yield_until`], [`spin_while_progress`]). The
//! token they drive through is `drive/token.rs`'s.

use core::time::Duration;

use ivm_core::sync::{AtomicUsize, Ordering, fence};

use crate::engine::core::VmCore;
use crate::engine::drive::Driver;
use crate::util::tuning::{CALLER_PROGRESS_SPIN, CALLER_STALL, PURE_SPIN, RELEASE_DEFER};

/// A release a worker owes the engine: it finished an instruction, marked the word
/// ([`EngineToken::mark`](crate::engine::drive::EngineToken::mark)) instead of driving, and found nobody holding the engine. Two reasons
/// to leave a release to somebody else:
///
/// * **a finished sync access** (*patient* debt): its caller is about to come back and
///   drive the engine anyway (usually within a microsecond), so the engine's data stays
///   in the caller's cache;
/// * **a caller is helping** ([`Helping`]) while this worker has more instructions queued:
///   the helper, spinning on another core, releases the instruction while the worker runs
///   the next one, so the engine's steps leave the critical path (on a chain of short CPU
///   kernels they were a third of a microsecond per instruction, mostly cache misses on
///   engine data last touched by the caller).
///
/// * **a caller is submitting** ([`Helping::submitting`]: between its push and its drive, a few
///   microseconds of VM code that never waits) while this worker runs long kernels and has
///   more queued: the submission drives the engine right after, so the release may wait
///   for it, for the length of the worker's next kernel at most (the debt's *grace*).
/// * **nothing waits for the release** ([`leave_unless_awaited`](Self::leave_unless_awaited)),
///   while this worker runs long kernels and has more queued: the engine holds nothing
///   back behind it (no successor on another stream or behind a strict edge, no barrier:
///   `ivm_engine::Instruction::awaited`) and no submitter waits for backpressure. Work
///   that comes to need the release later arrives through a submission, whose drive
///   releases it; so the debt may wait for whichever thread drives next (on a busy VM the
///   submitting caller, which drives for every `run`) until this worker's queue runs
///   dry. An *unawaited* debt.
///
/// Nothing is lost while it waits: the first thread that takes the engine after the mark
/// drains every input, and the only write that clears `DIRTY` on an unlocked word is such
/// an acquisition. So the debt is gone as soon as the word no longer reads "dirty,
/// unlocked". Otherwise the worker pays it (drives) before it runs the next instruction
/// unless the debt is unawaited, a helper spins, or (once) a submitter is still inside its
/// submission; before it sleeps; when idle and nobody helps; and for a patient debt after
/// about [`RELEASE_DEFER`] of polling.
#[derive(Debug, Default)]
pub(crate) struct Owed {
    owed: std::cell::Cell<bool>,
    /// Only finished sync accesses are owed (their callers come back to drive).
    patient: std::cell::Cell<bool>,
    /// The debt was left to a submitting caller ([`Helping::submitting`]) and no instruction has
    /// run since: the worker may run one more before it pays.
    grace: std::cell::Cell<bool>,
    /// Every release owed is unawaited ([`leave_unless_awaited`](Self::leave_unless_awaited)):
    /// the debt may outlast any number of instructions (paid when the queue runs dry).
    unawaited: std::cell::Cell<bool>,
    /// `settle(false)` calls since the mark (the clock is read only from the 64th on).
    steps: std::cell::Cell<u32>,
    since: std::cell::Cell<Option<std::time::Instant>>,
}

impl Owed {
    /// After a finished instruction the worker does not release itself: mark the word;
    /// owe a drive if nobody held it. `patient`: a finished sync access (see above).
    /// `grace`: left to a submitting caller (a new debt may outlast one more kernel; one
    /// already owed keeps the grace it has left, so no release waits longer than that).
    pub(crate) fn mark(&self, shared: &VmCore, patient: bool, grace: bool) {
        self.forget_if_taken(shared);
        if shared.token().mark() {
            // Kept by this rule's bounds from now on, whatever was owed before.
            self.unawaited.set(false);
            if !self.owed.get() {
                self.open(patient, grace, false);
            } else if !patient {
                self.patient.set(false);
            }
        }
    }

    /// A new debt (nothing was owed) with these properties.
    fn open(&self, patient: bool, grace: bool, unawaited: bool) {
        self.owed.set(true);
        self.patient.set(patient);
        self.grace.set(grace);
        self.unawaited.set(unawaited);
        self.steps.set(0);
        self.since.set(None);
    }

    /// After a finished instruction `instr`, with more queued and long kernels: marks the
    /// word; if nobody held the engine, keeps the debt as *unawaited* unless the engine
    /// told `instr` that something waits for its release (`Instruction::is_awaited`), a
    /// submitter waits for backpressure, or `completed_other`: the body completed another
    /// instruction on this thread and only marked the word for it
    /// (`EngineToken::complete_outside`), whose release may be awaited. In those cases a
    /// new debt is left to a caller that is `submitting()` (for one kernel, as
    /// [`mark`](Self::mark) with a grace) or paid here; one joining an older debt is paid
    /// before the next instruction unless that debt's own rule keeps it.
    ///
    /// Why nothing is lost: a holder that told `instr` did so before its unlock, which our
    /// mark (Acquire) read if it found the word unlocked; a holder that tells it after our
    /// mark took the engine after it, so it sees `instr` done and releases it in the same
    /// step (the debt is then gone: the word no longer reads "dirty, unlocked"). A
    /// submitter about to wait for backpressure counts itself, fences, and drives if it
    /// finds the word "dirty, unlocked"; we mark, fence ([`VmCore::backpressured`]) and
    /// read its count: one of us sees the other (store buffering).
    pub(crate) fn leave_unless_awaited(
        &self,
        shared: &VmCore,
        instr: std::sync::Arc<crate::model::instruction::Instruction>,
        completed_other: bool,
        submitting: impl FnOnce() -> bool,
    ) {
        self.forget_if_taken(shared);
        let marked = shared.token().mark();
        let awaited = marked && (completed_other || instr.is_awaited());
        // Let go before any release (the engine recycles what only it holds).
        drop(instr);
        if !marked {
            // A holder drains our mark before it lets go; a debt already owed stays as it
            // is (`settle` finds it gone).
            return;
        }
        let awaited = awaited || shared.backpressured();
        if self.owed.get() {
            // An older debt keeps its own rule's bounds; this release joins it.
            self.patient.set(false);
            if awaited {
                self.unawaited.set(false);
            } else if self.unawaited.get() {
                shared.count_kept();
            }
            return;
        }
        if !awaited {
            self.open(false, false, true);
            shared.count_kept();
        } else if submitting() {
            // As `mark(patient: true, grace: true)` for a new debt.
            self.open(true, true, false);
        } else if shared.token().try_lock() {
            // Else somebody took the engine after our mark: it sees our input.
            shared.drive_as(Driver::Worker);
        }
    }

    /// Before a new mark: a debt the word no longer reads "dirty, unlocked" for is gone
    /// (somebody took the engine after our mark, as in [`settle`](Self::settle)), so the
    /// new mark starts a debt of its own rule instead of joining the old one's (a debt
    /// left to a helper that has since released it would otherwise make the next
    /// unawaited release be paid at once).
    fn forget_if_taken(&self, shared: &VmCore) {
        if self.owed.get() && !shared.token().dirty_unlocked() {
            self.discharged();
        }
    }

    /// Whether the debt is unawaited: the worker may run its next instruction owing it.
    pub(crate) fn is_unawaited(&self) -> bool {
        self.owed.get() && self.unawaited.get()
    }

    /// Whether the debt may outlast the instruction about to run (its grace, used up by
    /// asking).
    pub(crate) fn take_grace(&self) -> bool {
        self.grace.replace(false)
    }

    /// A drive attempt (`VmCore::completed`) took care of everything marked so far.
    pub(crate) fn discharged(&self) {
        self.owed.set(false);
        self.unawaited.set(false);
    }

    pub(crate) fn is_owed(&self) -> bool {
        self.owed.get()
    }

    /// Pays the debt if it is still there and `force`, or nobody helps and it is not
    /// patient, or it is overdue ([`RELEASE_DEFER`]; a polling worker calls this every
    /// step, so the clock is read only now and then).
    pub(crate) fn settle(&self, shared: &VmCore, force: bool) {
        if !self.owed.get() {
            return;
        }
        if !shared.token().dirty_unlocked() {
            // Somebody took the engine after our mark: it saw our input.
            self.discharged();
            return;
        }
        let overdue = force || (!self.patient.get() && !shared.helper_spinning()) || {
            let steps = self.steps.get().wrapping_add(1);
            self.steps.set(steps);
            match self.since.get() {
                None if steps >= 64 => {
                    self.since.set(Some(std::time::Instant::now()));
                    false
                }
                Some(since) if steps.is_multiple_of(16) => since.elapsed() >= RELEASE_DEFER,
                _ => false,
            }
        };
        if overdue {
            self.discharged();
            // If this fails, somebody took the engine after our mark: it sees our input.
            if shared.token().try_lock() {
                shared.drive_as(Driver::Worker);
            }
        }
    }
}

/// A caller spinning in a wait, registered as a *helper*: while it is registered, a
/// worker that has more instructions queued leaves the release of the one it finished to
/// the helper ([`Owed`]), which drives the engine whenever the word reads "dirty,
/// unlocked" ([`poll`](Self::poll)) and once more when it stops spinning (on drop).
///
/// Nothing is left unreleased when the helper leaves: the worker's mark (an RMW on the
/// wake word) and the helper's deregistration (an RMW on `helpers`) are each followed by a
/// SeqCst fence and a load of the other word, so at least one of them sees the other (the
/// store-buffering pattern): either the worker sees no helper and pays its debt before it
/// runs on, or the leaving helper sees the mark and drives. The counter and its fences
/// live in [`Helpers`]; the loom model `tests/loom_helpers.rs` checks the protocol.
///
/// A submitting caller registers the same way in a count of its own
/// ([`submitting`](Self::submitting)).
pub(crate) struct Helping<'a> {
    shared: &'a VmCore,
    /// The count this registration is in: `helpers`, or `submitters`.
    count: &'a Helpers,
}

impl<'a> Helping<'a> {
    /// Registers a helper (multi-thread mode, a caller outside any VM thread).
    pub(crate) fn enter(shared: &'a VmCore) -> Self {
        Self::register(shared, &shared.token().helpers)
    }

    /// Registers a caller inside a submission, from its push to its drive
    /// (`VmCore::receive_list`, after any backpressure wait; never around the user's `run`
    /// closure), in the `submitters` count: a worker that finishes an instruction
    /// meanwhile, with long kernels and more queued, may leave its release to this caller
    /// for the length of one kernel ([`Owed`]'s grace) instead of driving the engine
    /// between its kernels: the submission drives the engine right after, and leaving
    /// polls once more, with the same fences as a helper (a worker that saw the submitter
    /// registered after its mark is seen by the leaving submitter's poll). The window is
    /// VM code that never waits, so a kernel that itself waits for work on another stream
    /// cannot wait for a release left to a submitter that is blocked somewhere. Producers
    /// never count on a submitter (they count on helpers only, see
    /// `EngineToken::unpark`).
    pub(crate) fn submitting(shared: &'a VmCore) -> Self {
        Self::register(shared, &shared.token().submitters)
    }

    fn register(shared: &'a VmCore, count: &'a Helpers) -> Self {
        count.enter();
        Self { shared, count }
    }

    /// Drives the engine if a worker left it input and nobody holds it.
    #[inline]
    pub(crate) fn poll(&self) {
        if self.shared.token().dirty_unlocked() {
            self.shared.help();
        }
    }
}

impl Drop for Helping<'_> {
    fn drop(&mut self) {
        // Deregister (RMW, then SeqCst fence), then the load of the wake word in `poll`:
        // pairs with the worker's mark, fence and load of the count (type docs).
        self.count.leave();
        self.poll();
    }
}

/// The number of registered helpers ([`Helping`]) with the fences of its protocol: a
/// worker that marked the wake word checks [`spinning`](Self::spinning) before it runs on
/// owing a release; a helper [`leave`](Self::leave)s, then reads the wake word once more.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_helpers.rs`.
pub struct Helpers {
    count: AtomicUsize,
}

impl std::fmt::Debug for Helpers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helpers")
            // Relaxed: a diagnostic snapshot.
            .field("count", &self.count.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for Helpers {
    fn default() -> Self {
        Self::new()
    }
}

impl Helpers {
    /// No helper registered.
    pub fn new() -> Self {
        Self {
            count: AtomicUsize::new(0),
        }
    }

    /// A helper registers (before its first poll of the wake word).
    pub fn enter(&self) {
        // Relaxed: nothing is published through it. A worker that misses the increment
        // merely drives itself; the fences of `spinning` / `leave` order what matters.
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// A helper deregisters; the caller then reads the wake word once more (and drives if
    /// it reads "dirty, unlocked").
    pub fn leave(&self) {
        // Relaxed RMW, then a SeqCst fence before the caller's load of the wake word:
        // pairs with the SeqCst fence in `spinning` (between the worker's marking RMW on
        // the wake word and its load of the count). Of the two fences, the later one in
        // their single total order makes its thread see the other thread's RMW: either
        // the worker reads the count without this helper and pays its debt, or this
        // helper's poll reads the worker's mark and drives.
        self.count.fetch_sub(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Worker, after its marking RMW on the wake word ([`EngineToken::mark`](crate::engine::drive::EngineToken::mark)): whether a helper
    /// is registered, i.e. will see the mark (then the worker may run on owing the
    /// release).
    pub fn spinning(&self) -> bool {
        // SeqCst fence after the worker's marking RMW, before this load: pairs with the
        // SeqCst fence in `leave` (between the helper's decrement and its load of the
        // wake word); see there.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        self.count.load(Ordering::Relaxed) > 0
    }

    /// [`leave`](Self::leave) without its fence: a planted bug for the loom model
    /// `tests/loom_helpers.rs` (the helper's poll may miss a mark whose worker saw it
    /// registered).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_leave_without_fence(&self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }

    /// [`spinning`](Self::spinning) without its fence: a planted bug for the loom model
    /// `tests/loom_helpers.rs` (the worker may read a stale count after the helper's
    /// last poll missed its mark).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_spinning_without_fence(&self) -> bool {
        self.count.load(Ordering::Relaxed) > 0
    }
}

impl VmCore {
    /// Whether a caller is registered as a helper (see [`Helping`], [`Helpers::spinning`]:
    /// a SeqCst fence orders the worker's preceding mark before the load).
    pub(crate) fn helper_spinning(&self) -> bool {
        self.token().helpers.spinning()
    }

    /// Whether a caller is inside a submission ([`Helping::submitting`]; a SeqCst fence orders the
    /// worker's preceding mark before the load, as in [`helper_spinning`](Self::helper_spinning)).
    pub(crate) fn submitter_active(&self) -> bool {
        self.token().submitters.spinning()
    }
}

thread_local! {
    /// Whether this caller thread's CPU is shared (`preemption.rs`): kept across calls, so
    /// that a caller that saw itself preempted does not spin again for a while.
    static CALLER_SENSE: std::cell::RefCell<crate::engine::preemption::PreemptionSense> =
        std::cell::RefCell::default();
}

/// Whether the calling thread saw itself preempted lately ([`CALLER_SENSE`]), without
/// starting a new spin's looks (unlike [`caller_contended`]).
pub(crate) fn caller_preempted_lately(now: std::time::Instant) -> bool {
    CALLER_SENSE.with(|s| s.borrow().contended(now))
}

/// The calling thread's look at the clock during a spin (see [`CALLER_SENSE`]): whether it
/// was descheduled since its last look (counted in the VM's stats).
pub(crate) fn caller_look(shared: &VmCore, now: std::time::Instant) -> bool {
    let jumped = CALLER_SENSE.with(|s| s.borrow_mut().look(now));
    if jumped {
        // Relaxed: a statistic.
        shared
            .stats()
            .caller_preempted
            .fetch_add(1, ivm_core::sync::Ordering::Relaxed);
    }
    jumped
}

/// Whether the calling thread saw itself preempted lately: spinning cannot help then (the
/// thread it waits for may need this CPU, and the caller loses it anyway), so it sleeps
/// at once. A new spin starts its looks afresh.
pub(crate) fn caller_contended(now: std::time::Instant) -> bool {
    CALLER_SENSE.with(|s| {
        let mut s = s.borrow_mut();
        s.restart();
        s.contended(now)
    })
}

/// Spins until `done()`, for at most `budget`: with spin-loop hints for up to
/// [`PURE_SPIN`] while `peer_running()` (the thread it waits for is running), else with
/// `yield_now` (a thread that was just woken is not running yet, and may need this very
/// core). Gives up at once when the caller's CPU is shared (`preemption.rs`): it was
/// descheduled during this spin or lately. Returns whether `done()` held.
pub(crate) fn spin_yield_until(
    shared: &VmCore,
    mut done: impl FnMut() -> bool,
    budget: Duration,
    peer_running: impl Fn() -> bool,
) -> bool {
    let start = std::time::Instant::now();
    if caller_contended(start) {
        return done();
    }
    let mut watch = crate::engine::preemption::WorkerWatch::start(shared);
    let mut elapsed = Duration::ZERO;
    let mut steps = 0u32;
    loop {
        if done() {
            return true;
        }
        steps = steps.wrapping_add(1);
        if steps.is_multiple_of(32) {
            let now = std::time::Instant::now();
            elapsed = now.duration_since(start);
            if caller_look(shared, now) {
                return false;
            }
            if elapsed >= budget {
                // A worker that was awake all this time but hardly ran waits for a CPU:
                // the next kernels of its stream run on their caller.
                watch.stalled(shared);
                return false;
            }
        }
        if elapsed < PURE_SPIN && peer_running() {
            ivm_core::sync::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Spins (yielding) until `done()` while the VM makes progress: gives up after
/// [`CALLER_STALL`] without any release, or after [`CALLER_PROGRESS_SPIN`]. Returns whether
/// `done()` held. The threads the caller waits for are known to be running while releases
/// keep coming, so spinning then costs little and saves the wake at the end; a long kernel
/// in front stops the releases and the caller goes to sleep after [`CALLER_STALL`].
///
/// `elsewhere()` counts progress the engine does not see (a lazy graph's kernels: no
/// instruction finishes while a graph computes): `None` when there is nothing to count.
/// It is asked once when the spinning starts (the baseline) and then only when the
/// releases stall; a count that moved since it was last asked counts as a release.
///
/// A caller whose CPU is shared (`preemption.rs`: it was descheduled during this spin or
/// lately) does not spin: it sleeps, and is woken with the scheduler's wake-up preference.
///
/// The caller is a [`Helping`] helper meanwhile: it releases what workers finish, so they
/// run their next instructions without driving the engine.
pub(crate) fn spin_while_progress(
    shared: &VmCore,
    mut done: impl FnMut() -> bool,
    mut elsewhere: impl FnMut() -> Option<u64>,
) -> bool {
    let helping = Helping::enter(shared);
    for _ in 0..64 {
        if done() {
            return true;
        }
        helping.poll();
        ivm_core::sync::spin_loop();
    }
    let start = std::time::Instant::now();
    if caller_contended(start) {
        // Spinning cannot help (see `caller_contended`).
        return false;
    }
    let mut last_change = start;
    let mut last = shared.progress();
    let mut last_elsewhere = elsewhere();
    let mut watch = crate::engine::preemption::WorkerWatch::start(shared);
    loop {
        if done() {
            return true;
        }
        let now = std::time::Instant::now();
        let f = shared.progress();
        if f != last {
            last = f;
            last_change = now;
        } else if now.duration_since(last_change) >= CALLER_STALL {
            // A worker awake but off its CPU all this time waits for one: the next
            // kernels of its stream run on their caller (`preemption.rs`).
            watch.stalled(shared);
            let e = elsewhere();
            if e.is_none() || e == last_elsewhere {
                return false;
            }
            last_elsewhere = e;
            last_change = now;
            // Progress elsewhere: look at `done` again before the budget can end the
            // spin (a thread preempted past the budget would otherwise give up on a
            // wait that its last look showed moving).
            continue;
        }
        if caller_look(shared, now) {
            // This thread was just descheduled: sleep. (A look that saw a gap also saw a
            // stall above, and asked `elsewhere` first.)
            return false;
        }
        if now.duration_since(start) >= CALLER_PROGRESS_SPIN {
            // The budget is spent: sleep, having noted a worker that hardly ran.
            watch.stalled(shared);
            return false;
        }
        helping.poll();
        if now.duration_since(last_change) < PURE_SPIN {
            // Releases keep coming: the threads we wait for run on other cores, and a
            // `sched_yield` would only delay noticing `done` (by about a microsecond).
            for _ in 0..32 {
                if done() {
                    return true;
                }
                ivm_core::sync::spin_loop();
            }
        } else {
            // Nothing released lately: a thread we wait for may need this core.
            std::thread::yield_now();
        }
    }
}
