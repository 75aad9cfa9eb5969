//! A worker thread's context: the queue of instructions the engine dispatched to it and
//! the notifier it sleeps on. Streams hold their thread's context; the thread that runs it
//! is in `worker.rs`.
//!
//! # The consumer role
//!
//! Whoever runs the queue's instructions holds its consumer role (`MpscQueue::try_consume`):
//! the worker while it runs or polls, and — while the worker sleeps — a caller about to
//! wait that runs the queued instructions itself (`worker::caller_runs`). One holder at a
//! time, so the queue's instructions never run concurrently or out of order. The worker
//! lets go of the role before it sleeps and takes it back ([`take_role`](ThreadCtx::take_role))
//! after a wake; a caller lets go through [`let_go`](ThreadCtx::let_go), which wakes the
//! worker if anything is left queued. No wake is lost (the loom model
//! `tests/loom_caller_runs.rs`): a push that finds the queue empty notifies the worker;
//! if that worker then finds the role taken it sleeps again (after polling for it for its
//! poll window: retrying is what a spurious wake does), and of the caller's re-check
//! after letting go and the worker's retry after its wake, at least one sees the other
//! (a SeqCst fence on each side, the store-buffering pattern): either the worker takes
//! the role, or the caller sees the queue non-empty and notifies.
//!
//! # A wake left to the waiting caller
//!
//! A sync access whose caller is about to wait for it, and would run it itself while the
//! worker sleeps, is marked `DEFER_WAKE`. The push that queues it onto an empty queue then
//! need not wake the worker (a futex wake costs the pushing thread 15–20 µs of syscall on a
//! small VM, for a worker the caller then beats to the instruction anyway): the caller owes
//! that wake instead. It pays it by running the queue itself (its `let_go` wakes the worker
//! if anything is left), or, before it stops looking and blocks, through
//! [`withdraw_defer`]. The pusher's [`skip_wake`] and the caller's [`withdraw_defer`] are
//! read-modify-writes of the instruction's status word, so one of them comes first in its
//! modification order: either the push skips the wake and the caller, blocking later,
//! sees that and wakes the worker; or the caller withdrew first and the push wakes the
//! worker itself. (The loom model `tests/loom_caller_runs.rs` (its second model).)

//!
//! # A worker that wakes itself
//!
//! A worker that shares its CPU (`engine/preemption.rs`) sleeps with a deadline
//! ([`doze`]) while idle: a push that a caller may run, made while a caller waits for the
//! VM (`hand_over.rs`'s count), while the VM's callers lose their CPU to other threads
//! (`ThreadCtx::callers_contended_until`), or by a caller to a worker that shares its CPU,
//! then leaves the worker's wake to that deadline
//! ([`leave_wake_to_deadline`]). The wake would cost the pusher a
//! system call and hand the work to a thread that may not get a CPU for a whole slice; the
//! caller that waits for the work runs it itself, and work nobody waits for starts by the
//! deadline. The worker's offer and its end ([`doze`], [`wake_from_doze`]) and the
//! pusher's look ([`leave_wake_to_deadline`], after its push) are read-modify-writes of one
//! flag: if the pusher's comes first, the worker's end of the doze reads from it and its
//! next drain sees the push; if the worker's end comes first, the pusher reads it and
//! wakes the worker. (The third model of `tests/loom_caller_runs.rs` checks the
//! hand-over, the fourth this.)

use std::sync::Arc;

use ivm_core::mpsc::{Consumer, Linked, MpscQueue};
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicU32, AtomicUsize, Ordering, fence};
use ivm_core::wait::Wait;

use crate::model::express::ExpressLane;
use crate::model::hand_over::HandOver;
use crate::model::instruction::{Instruction, WorkerTag, status};
use crate::util::futex::FutexWait;

/// One worker thread's context: its queue of dispatched instructions and its notifier.
pub(crate) struct ThreadCtx {
    pub(crate) name: String,
    pub(crate) queue: MpscQueue<Instruction, WorkerTag>,
    pub(crate) notifier: Notifier<FutexWait>,
    /// A hint, not part of any protocol: set while the worker sleeps on its notifier (and
    /// until it runs again after a wake). Waiters spin with spin-loop hints only while it
    /// is clear (the worker is running), and yield their CPU otherwise.
    pub(crate) parked: AtomicBool,
    /// A hint, not part of any protocol: the worker's recent instructions ran long
    /// (sampled, see `worker.rs`). A submitting caller then asks a driving worker to hand
    /// the engine back (`VmCore::after_push`): its time is the kernels'.
    pub(crate) long_kernels: AtomicBool,
    /// Small accesses handed straight to this worker while it polls (`express.rs`).
    pub(crate) express: ExpressLane,
    /// How many of them the worker did (a statistic, written by the worker only).
    pub(crate) express_served: AtomicUsize,
    /// A hint: the id of the worker's CPU-time clock plus one (0: unknown), set by the
    /// worker when it starts, so that a waiting caller can tell a worker that runs from
    /// one that waits for a CPU (`engine/preemption.rs`).
    pub(crate) cpu_clock: AtomicUsize,
    /// A hint: until when (`engine/preemption.rs`'s clock, in microseconds) the worker
    /// counts as sharing its CPU; callers then run its stream's kernels themselves.
    pub(crate) contended_until: crate::util::HintUntil,
    /// A hint: until when the worker's instructions count as tiny
    /// (`preemption::mark_tiny_kernels`); a `run` of them may then run at rest on its
    /// caller (`VmCore::run_at_rest`).
    pub(crate) tiny_until: crate::util::HintUntil,
    /// The callers waiting for this queue, and whether the worker handed it to them
    /// (`hand_over.rs`).
    pub(crate) hand: HandOver,
    /// Set while the worker sleeps with a deadline (module docs, "A worker that wakes
    /// itself").
    pub(crate) dozing: AtomicBool,
    /// A hint, not part of any protocol: the worker's doze is an idle one (it does not
    /// share its CPU): a caller's own pushes leave its wake to the deadline.
    pub(crate) idle_doze: AtomicBool,
    /// A hint, not part of any protocol: how many pushes left their wake to an idle
    /// doze's deadline. The worker keeps dozing (not sleeping for good) while it grows:
    /// its callers are active although they run its work themselves.
    pub(crate) left_to_idle_doze: AtomicUsize,
    /// A hint, not part of any protocol: how many instructions callers queued together
    /// to the worker in its current idle doze (from the push that found the queue empty;
    /// cleared as it parks); the `IDLE_BURST`-th wakes it ([`submit`](Self::submit)).
    pub(crate) idle_pushes: AtomicUsize,
    /// A hint: until when the VM's callers count as losing their CPU to
    /// other threads (`engine/preemption.rs`, `CallerSense`): pushes a caller may run
    /// leave a dozing worker's wake to its deadline even while no caller waits.
    pub(crate) callers_contended_until: crate::util::HintUntil,
    /// A hint: one more than the one CPU the worker's affinity allows, or 0 when it allows
    /// several (`engine/preemption.rs`, `note_sole_cpu`): a caller bound to the same CPU
    /// marks the worker contended.
    pub(crate) sole_cpu: AtomicUsize,
    /// A hint: until when a caller bound to the same one CPU as the worker counts it as
    /// sharing that CPU (`engine/preemption.rs`, `sense_caller`): the worker can then never
    /// run beside its callers, so its dozes grow (`worker.rs`, `next_contended_doze`).
    pub(crate) same_cpu_until: crate::util::HintUntil,
    /// A hint: the worker thread's id (`engine/neighbours.rs`), 0 until it starts.
    pub(crate) tid: AtomicUsize,
}

impl std::fmt::Debug for ThreadCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadCtx")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ThreadCtx {
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            queue: MpscQueue::new(),
            notifier: Notifier::new(),
            parked: AtomicBool::new(false),
            long_kernels: AtomicBool::new(false),
            express: ExpressLane::new(),
            express_served: AtomicUsize::new(0),
            cpu_clock: AtomicUsize::new(0),
            contended_until: crate::util::HintUntil::default(),
            tiny_until: crate::util::HintUntil::default(),
            hand: HandOver::new(),
            dozing: AtomicBool::new(false),
            idle_doze: AtomicBool::new(false),
            left_to_idle_doze: AtomicUsize::new(0),
            idle_pushes: AtomicUsize::new(0),
            callers_contended_until: crate::util::HintUntil::default(),
            sole_cpu: AtomicUsize::new(0),
            same_cpu_until: crate::util::HintUntil::default(),
            tid: AtomicUsize::new(0),
        }
    }

    /// Whether the VM's callers count as losing their CPU now (see the field).
    #[cfg(test)]
    pub(crate) fn callers_contended(&self) -> bool {
        self.callers_contended_until.holds()
    }

    /// Whether the worker sleeps (or was woken and has not run yet): a hint.
    pub(crate) fn is_parked(&self) -> bool {
        // Relaxed: a hint; nothing is read through it.
        self.parked.load(Ordering::Relaxed)
    }

    /// Worker, after a wake: takes the consumer role back, or `None` while a caller holds
    /// it (then the worker retries for its poll window and sleeps again: the caller's
    /// [`let_go`](Self::let_go) wakes it if anything is left).
    pub(crate) fn take_role(&self) -> Option<Consumer<'_, Instruction, WorkerTag>> {
        take_role(&self.queue)
    }

    /// A caller that held the consumer role (and ran queued instructions) lets go: then,
    /// if anything is queued, wakes the worker (see [`let_go`]).
    pub(crate) fn let_go(&self, consumer: Consumer<'_, Instruction, WorkerTag>) {
        let_go(consumer, &self.notifier);
    }

    /// [`let_go`](Self::let_go) by a caller that leaves what is still queued to the worker's
    /// doze, if it dozes ([`let_go_to_doze`]).
    pub(crate) fn let_go_to_doze(&self, consumer: Consumer<'_, Instruction, WorkerTag>) {
        let_go_to_doze(consumer, &self.dozing, &self.notifier);
    }

    /// Hands `instr` to this worker (engine side). Wakes the worker only on the
    /// empty-to-non-empty edge (a worker that is draining or polling reaches it anyway),
    /// and not then either when a caller may run the instruction (`caller_runs`: its
    /// stream allows it and its body is not deferred) and either its waiting caller took
    /// the wake on itself (`may_defer`, [`skip_wake`]) or the worker dozes and a caller
    /// waits or the callers share their CPUs, or the pusher is a caller submitting to an
    /// idle worker or to one that shares its CPU ([`leave_wake_to_deadline`]).
    /// `by_caller`: the pushing thread is a caller
    /// (`Driver::Caller`), not a worker or the scheduler.
    pub(crate) fn submit(
        &self,
        instr: &Arc<Instruction>,
        may_defer: bool,
        caller_runs: bool,
        by_caller: bool,
    ) {
        if self.queue.push(instr.clone()) {
            if may_defer && skip_wake(&instr.status) {
                return;
            }
            // Only while a caller waits (`hand_over.rs`'s count): it runs what a parked
            // worker has queued. A chain across streams that nobody waits for yet would
            // otherwise start each hop at a doze's deadline. Or while the callers lose
            // their CPU to other threads: a woken worker would be one more thread for
            // too few CPUs, and the caller runs the queue at its next wait
            // (`engine/preemption.rs`, `CallerSense`). Or when a caller submits to a
            // worker in an idle doze (ARCHITECTURE.md, "An idle worker dozes first"):
            // a caller that waits for the work next runs it itself, without paying a
            // wake first; work nobody waits for starts by the doze's deadline.
            // Relaxed: `idle_doze` is a hint; `leave_wake_to_deadline` decides.
            // Or when the worker itself shares its CPU (ARCHITECTURE.md, "When another
            // thread takes a core"): woken, it would take turns with whoever shares it,
            // while the caller runs the work at its next wait.
            // The clock is read last and once.
            let idle = by_caller && self.idle_doze.load(Ordering::Relaxed);
            let contended = || {
                let now = crate::util::now_us();
                self.callers_contended_until.holds_at(now)
                    || by_caller && self.contended_until.holds_at(now)
            };
            if caller_runs
                && (self.hand.has_waiters() || idle || contended())
                && leave_wake_to_deadline(&self.dozing)
            {
                if idle {
                    // Relaxed: hints (see the fields). The queue was empty: this push
                    // starts a new count of instructions queued together.
                    self.left_to_idle_doze.fetch_add(1, Ordering::Relaxed);
                    self.idle_pushes.store(1, Ordering::Relaxed);
                }
                return;
            }
            // Err(Closed) only after shutdown closed us, when the engine is idle: the
            // push above cannot happen then.
            let _ = self.notifier.notify();
        } else if by_caller && self.idle_doze.load(Ordering::Relaxed) && self.idle_burst() {
            // The queue held work already, left to an idle doze's deadline by the pushes
            // before: callers that queue `IDLE_BURST` instructions together to an idle
            // worker are starting a stream of work, not an op and a read (whose caller
            // runs the op and empties the queue again), and the worker's wake then
            // overlaps their submissions instead of following their wait. A wake is
            // always allowed: the worker looks at its queue. Relaxed: `idle_doze` is a
            // hint.
            let _ = self.notifier.notify();
        }
    }

    /// Counts a caller's push onto work already queued to the worker in an idle doze:
    /// whether it makes `IDLE_BURST` instructions queued together (it wakes the worker).
    fn idle_burst(&self) -> bool {
        // Relaxed: a hint; a stale or lost count costs one wake more or less.
        self.idle_pushes.fetch_add(1, Ordering::Relaxed) + 1 == crate::util::tuning::IDLE_BURST
    }

    /// Wakes the worker (a caller that owes it a wake: [`withdraw_defer`]).
    pub(crate) fn wake(&self) {
        // Err(Closed): shutdown; the worker drains on its way out.
        let _ = self.notifier.notify();
    }

    /// Test hook: pops one dispatched instruction (no worker thread may run for `self`).
    #[cfg(test)]
    pub(crate) fn try_pop(&self) -> Option<Arc<Instruction>> {
        // SAFETY: tests that call this run no worker for this context, so this is the
        // only consumer.
        unsafe { self.queue.try_pop_unchecked() }.item()
    }

    /// Shutdown: the worker drains what is left and exits.
    pub(crate) fn close(&self) {
        self.notifier.close();
    }
}

/// The worker's side of the role protocol (module docs), after a wake: takes the consumer
/// role of `queue`, or `None` while another thread holds it.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`.
pub fn take_role<T: Linked<Tag>, Tag>(queue: &MpscQueue<T, Tag>) -> Option<Consumer<'_, T, Tag>> {
    // SeqCst fence before the role's compare-exchange: pairs with the fence in `let_go`
    // (between the caller's release of the role and its look at the queue). The wake that
    // brought us here happens after the push that notified us; if `let_go`'s fence comes
    // first in the fences' total order, our compare-exchange sees the role free; if ours
    // comes first, the caller's look at the queue sees that push (module docs).
    fence(Ordering::SeqCst);
    queue.try_consume()
}

/// The worker's side of a doze (module docs, "A worker that wakes itself"), before it
/// sleeps with a deadline: from now on a push may leave its wake to that deadline.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`.
pub fn doze(flag: &AtomicBool) {
    // A swap, not a store: loom 0.7 lets another thread's read-modify-write miss a plain
    // store before it. Relaxed: the pusher that reads it only skips a wake.
    flag.swap(true, Ordering::Relaxed);
}

/// The worker's side of a doze, after its wake (deadline or notification), before it
/// drains: pushes that skipped the wake before this are seen by that drain.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`.
pub fn wake_from_doze(flag: &AtomicBool) {
    // Acquire: reading a pusher's Release read-modify-write (which came after its push)
    // makes the push visible to our next drain; a pusher whose read-modify-write comes
    // after ours reads `false` and wakes us.
    flag.swap(false, Ordering::AcqRel);
}

/// The pusher's side of a doze (module docs), after a push that found the queue empty:
/// whether the worker dozes, so that its deadline wakes it.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`.
pub fn leave_wake_to_deadline(flag: &AtomicBool) -> bool {
    // A read-modify-write, not a load: it reads the latest value of the flag (module
    // docs). Release: publishes our push to the worker whose `wake_from_doze` reads it.
    flag.fetch_or(false, Ordering::AcqRel)
}

/// [`leave_wake_to_deadline`] as a plain load: a planted bug for the loom model (it may
/// read a doze that already ended, whose drain missed the push: nobody wakes the worker
/// when it then sleeps without a deadline).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_leave_wake_by_load(flag: &AtomicBool) -> bool {
    flag.load(Ordering::Relaxed)
}

/// The pusher's side of a deferred wake (module docs), after a push that found the queue
/// empty: whether the instruction whose status word is `word` still has a caller that owes
/// the wake (`DEFER_WAKE`); records that the wake was skipped either way.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs` (its second model).
pub fn skip_wake(word: &AtomicU32) -> bool {
    // AcqRel: the Release half publishes the push before this RMW to the caller whose
    // `withdraw_defer` reads it (that caller then wakes the worker, which must see the
    // push); the single modification order of the word decides who wakes the worker.
    word.fetch_or(status::WAKE_SKIPPED, Ordering::AcqRel) & status::DEFER_WAKE != 0
}

/// The caller's side of a deferred wake (module docs), before it stops running its
/// worker's queue itself and blocks: withdraws its offer to owe the wake, and returns
/// whether a push already skipped it (the caller must then wake the worker).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs` (its second model).
pub fn withdraw_defer(word: &AtomicU32) -> bool {
    // AcqRel: the Acquire half reads the pusher's Release RMW (its push happens before the
    // wake we then send); see `skip_wake`.
    word.fetch_and(!status::DEFER_WAKE, Ordering::AcqRel) & status::WAKE_SKIPPED != 0
}

/// [`skip_wake`] as a plain load of the caller's offer: a planted bug for the loom model
/// (the caller may withdraw between the load and the skip, and nobody wakes the worker).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_skip_wake_by_load(word: &AtomicU32) -> bool {
    word.load(Ordering::Acquire) & status::DEFER_WAKE != 0
}

/// The flag values of a deferred wake, for the loom model.
#[cfg(loom)]
#[doc(hidden)]
pub const DEFER_WAKE: u32 = status::DEFER_WAKE;

/// The caller's side of the role protocol (module docs): lets go of the consumer role,
/// then wakes the queue's worker through `notifier` if anything is queued (the worker may
/// have found the role taken after a push woke it, and gone back to sleep).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`.
pub fn let_go<T: Linked<Tag>, Tag, W: Wait>(
    consumer: Consumer<'_, T, Tag>,
    notifier: &Notifier<W>,
) {
    let queue = consumer.queue();
    // Release (in the guard's drop): publishes our pops to the role's next holder.
    drop(consumer);
    // SeqCst fence before the look at the queue: pairs with the fence in `take_role`.
    fence(Ordering::SeqCst);
    if !queue.is_empty() {
        // Err(Closed): shutdown; the worker drains on its way out.
        let _ = notifier.notify();
    }
}

/// [`let_go`] that leaves the wake to the deadline of the worker's doze when it dozes
/// (`dozing`, [`leave_wake_to_deadline`]): the worker, at the doze's end, takes the role and
/// drains what is left, or finds it taken and its holder's let-go looks again. Only for
/// work a caller may run, left while the worker shares its CPU: a caller then runs it at
/// its next wait, or the worker by its deadline.
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_caller_runs.rs`
/// (its fifth model).
pub fn let_go_to_doze<T: Linked<Tag>, Tag, W: Wait>(
    consumer: Consumer<'_, T, Tag>,
    dozing: &AtomicBool,
    notifier: &Notifier<W>,
) {
    let queue = consumer.queue();
    // Release (in the guard's drop): publishes our pops to the role's next holder.
    drop(consumer);
    // SeqCst fence before the look at the queue: pairs with the fence in `take_role`.
    fence(Ordering::SeqCst);
    if !queue.is_empty() && !leave_wake_to_deadline(dozing) {
        // Err(Closed): shutdown; the worker drains on its way out.
        let _ = notifier.notify();
    }
}

/// [`let_go_to_doze`] that leaves the wake whether or not the worker dozes: a planted bug
/// for the loom model (a worker that slept without a deadline, having found the role
/// taken, is never woken for what is left).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_let_go_to_any_sleep<T: Linked<Tag>, Tag>(consumer: Consumer<'_, T, Tag>) {
    drop(consumer);
}

/// [`let_go`] without its re-check of the queue: a planted bug for the loom model
/// `tests/loom_caller_runs.rs` (a push that woke the worker while the caller held the
/// role is left with nobody to run it).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_let_go_without_recheck<T: Linked<Tag>, Tag, W: Wait>(
    consumer: Consumer<'_, T, Tag>,
    _notifier: &Notifier<W>,
) {
    drop(consumer);
}

/// [`let_go`] with its re-check before the release of the role: a planted bug for the
/// loom model (the worker, woken by a push after the re-check, finds the role still taken
/// and sleeps; nobody looks at the queue again).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_let_go_recheck_first<T: Linked<Tag>, Tag, W: Wait>(
    consumer: Consumer<'_, T, Tag>,
    notifier: &Notifier<W>,
) {
    if !consumer.queue().is_empty() {
        let _ = notifier.notify();
    }
    drop(consumer);
}

/// [`let_go`] without its SeqCst fence: a planted bug for the loom model (the caller's
/// look at the queue may miss a push whose woken worker found the role still taken).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_let_go_without_fence<T: Linked<Tag>, Tag, W: Wait>(
    consumer: Consumer<'_, T, Tag>,
    notifier: &Notifier<W>,
) {
    let queue = consumer.queue();
    drop(consumer);
    if !queue.is_empty() {
        let _ = notifier.notify();
    }
}

/// [`take_role`] without its SeqCst fence: a planted bug for the loom model (the worker
/// may find the role taken while the caller's look at the queue missed the push that
/// woke the worker).
#[cfg(loom)]
#[doc(hidden)]
pub fn planted_take_role_without_fence<T: Linked<Tag>, Tag>(
    queue: &MpscQueue<T, Tag>,
) -> Option<Consumer<'_, T, Tag>> {
    queue.try_consume()
}
