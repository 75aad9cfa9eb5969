//! The engine-facing core of a VM's shared state ([`VmCore`]): the state itself (the
//! pending queue, the engine and its token, the shutdown gate, the counters), probes,
//! diagnostics, the workers to close at exit, and the reentrancy guard. Workers, the
//! scheduler and every driver hold this and nothing above it. Its fields are private:
//! the rest of the crate uses the methods here, and the engine's drivers a few more
//! (`pending`, `cell`). Its other methods are spread by concept: submission and
//! backpressure in `submission.rs`, single-thread driving in `single.rs`, who drives in
//! multi-thread mode in `drive/`.

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ivm_core::counter::BlockingCounter;
use ivm_core::mpsc::MpscQueue;
use ivm_core::notifier::Timed;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering};
use ivm_core::wait::Wait;

use crate::engine::Engine;
use crate::model::instruction::{Instruction, PendingTag};
use crate::model::thread_ctx::ThreadCtx;
use crate::util::config::Config;
use crate::util::error::{Diagnostic, Error, Failure, Result};
use crate::util::futex::FutexWait;
use crate::util::hooks::{ForeignHooks, WaitHook};
use crate::util::lock;

thread_local! {
    /// The id of the VM whose thread, kernel, callback or engine step this thread is in
    /// (0: none). Keyed by VM id: blocking calls into *that* VM would deadlock.
    static CURRENT_VM: Cell<usize> = const { Cell::new(0) };
    /// The VMs entered further out on this thread than `CURRENT_VM`, innermost last: a
    /// kernel of VM A that drives VM B (single-thread B runs its kernels right there) is
    /// still inside A, and a blocking call into A from B's kernel would deadlock too.
    /// Touched only when VMs nest.
    static OUTER_VMS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// The id of the VM whose [`WaitHook`] this thread is inside (0: none): a wait
    /// nested in a wait of the same VM does not call the hook again.
    static IN_WAIT_HOOK: Cell<usize> = const { Cell::new(0) };
}

/// While alive, the calling thread waits for (or, in single-thread mode, runs) its VM's
/// work: the VM's [`WaitHook`] was told before, and is told after on drop (see
/// [`VmCore::wait_scope`]).
///
/// The hook is user code. A panic in `before_wait` is held while the wait goes on (the
/// VM's work is in flight: a callback may borrow the caller's stack), `after_wait` is
/// still called, and the first panic resumes on the calling thread when the scope ends,
/// unless the thread is already unwinding. Either way this thread's hook state is
/// restored, so that the next wait calls the hook again.
pub(crate) struct WaitScope {
    hook: Option<(Arc<dyn WaitHook>, usize)>,
    panicked: Option<Box<dyn std::any::Any + Send>>,
}

impl Drop for WaitScope {
    fn drop(&mut self) {
        let Some((hook, prev)) = self.hook.take() else {
            return;
        };
        let after = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook.after_wait()));
        IN_WAIT_HOOK.with(|c| c.set(prev));
        let payload = match (self.panicked.take(), after) {
            (Some(first), later) => {
                if let Err(p) = later {
                    crate::util::panics::drop_payload(p);
                }
                first
            }
            (None, Err(p)) => p,
            (None, Ok(())) => return,
        };
        if std::thread::panicking() {
            crate::util::panics::drop_payload(payload);
        } else {
            std::panic::resume_unwind(payload);
        }
    }
}

/// Marks the current thread as running on behalf of a VM until dropped.
pub(crate) struct ReentryGuard {
    prev: usize,
    /// `prev` was another VM, kept on `OUTER_VMS` until this guard drops.
    nested: bool,
}

impl ReentryGuard {
    pub(crate) fn enter(vm: usize) -> Self {
        let prev = CURRENT_VM.with(|c| c.replace(vm));
        let nested = prev != 0 && prev != vm;
        if nested {
            OUTER_VMS.with(|o| o.borrow_mut().push(prev));
        }
        Self { prev, nested }
    }
}

impl Drop for ReentryGuard {
    fn drop(&mut self) {
        if self.nested {
            OUTER_VMS.with(|o| o.borrow_mut().pop());
        }
        CURRENT_VM.with(|c| c.set(self.prev));
    }
}

/// Whether this thread is inside `vm`: its thread, kernel, callback or engine step, at
/// any depth of nesting with other VMs.
pub(crate) fn inside(vm: usize) -> bool {
    let current = CURRENT_VM.with(Cell::get);
    current == vm || (current != 0 && OUTER_VMS.with(|o| o.borrow().contains(&vm)))
}

/// A closure polled on the scheduler thread (or by the engine's owner).
pub(crate) enum Probe {
    /// Polled until it returns true.
    User(Box<dyn FnMut() -> bool + Send>),
    /// Fills the slot with a diagnostic of the engine, once.
    Diagnose(Arc<DiagSlot>),
    /// Fills the slot with a dump of the lively DAG, once (`stats.rs`).
    Dag(Arc<crate::engine::stats::DagSlot>),
}

pub(crate) struct DiagSlot {
    done: BlockingCounter<FutexWait>,
    value: Mutex<Option<Diagnostic>>,
}

impl DiagSlot {
    pub(crate) fn fulfil(&self, d: Diagnostic) {
        *lock(&self.value) = Some(d);
        // Release: publishes the stored diagnostic to the waiting caller.
        self.done.decrease();
    }
}

/// Id generators, not part of any synchronisation protocol: plain std atomics on purpose
/// (loom atomics cannot live in a `static`). Use with Relaxed.
pub(crate) static NEXT_VM_ID: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(1);
/// See [`NEXT_VM_ID`].
pub(crate) static NEXT_BLOB_ID: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(1);

/// The engine-facing half of a VM's shared state: what every driver (a caller, a worker,
/// the scheduler, a graph thread) needs to submit, drive and account — the pending queue,
/// the engine and its token, the shutdown gate, the counters, the probes. The registry of
/// streams and adapters and the doors' state sit above it, in
/// [`VmShared`](crate::runtime::shared::VmShared), which holds this core; nothing here
/// names them (ARCHITECTURE.md, "The module map").
pub(crate) struct VmCore {
    id: usize,
    config: Config,
    /// A bug planted in the engine for the equivalence fuzzer's own tests (feature
    /// `fuzzing`; set only by `fuzzing::Runner::with_planted_bug`, never by `Config`).
    #[cfg(feature = "fuzzing")]
    planted: ivm_engine::PlantedBug,
    /// Received instructions, for the engine's driver. A submission of several
    /// instructions is pushed as one chain (`push_chain`), so that it reaches the engine
    /// in one piece: two lists pushed element by element would interleave, and two lazy
    /// launches of one graph from two threads would then put their critical-section
    /// begins on the critical-section stream in another order than their launches (run
    /// k's outputs copied into run k+1's tensors, "end record was already initialised").
    pending: MpscQueue<Instruction, PendingTag>,
    /// Shared with every stream's device side: completion callbacks unpark through it.
    parking: Arc<crate::engine::drive::EngineToken>,
    /// The shutdown gate: callers inside a submission, and whether shutdown has begun.
    gate: crate::engine::gate::Gate,
    stop: AtomicBool,
    flying: AtomicUsize,
    /// Released instructions, ever (progress detection for timeouts: see
    /// [`progress`](Self::progress)).
    finished: AtomicUsize,
    /// Finished instructions whose release a worker left for whoever drives next (an
    /// unawaited debt, `helping::Owed::leave_unless_awaited`), ever: progress too, though
    /// not released yet. On a line of its own: the worker bumps it per such instruction
    /// while callers write `flying` for every submission.
    kept: crossbeam_utils::CachePadded<AtomicUsize>,
    /// Workers whose `ThreadCtx::long_kernels` hint is set: a submission registers as a
    /// [submitting](crate::engine::helping::Helping::submitting) caller only when some worker may
    /// leave it a release (a hint, Relaxed: nothing is published through it).
    long_kernel_workers: AtomicUsize,
    /// Submitters waiting for backpressure and the word they sleep on (`backpressure.rs`).
    backpressure: crate::engine::backpressure::Backpressure,
    probes: Mutex<Vec<Probe>>,
    probes_flag: AtomicBool,
    live: [AtomicUsize; 3],
    /// Every worker thread's context, so that the scheduler can close them at exit (the
    /// runtime spawns them and keeps their handles); `None` once closed.
    workers: Mutex<Option<Vec<Arc<ThreadCtx>>>>,
    /// Multi-thread mode: the engine, driven by whoever holds the token in `parking`
    /// (`drive/`). Empty in single-thread mode.
    cell: crate::engine::drive::EngineCell,
    /// Single-thread mode: the engine, driven by callers.
    engine: Option<Mutex<Engine>>,
    /// Released instructions for reuse (both modes): builders take from it on any
    /// thread, the engine's driver gives back to it.
    pool: crate::model::pool::InstrPool,
    /// Fork policy: where the VM was created (see `util/fork.rs`).
    birth: crate::util::fork::Birth,
    /// Introspection counters (see `stats.rs`).
    stats: crate::engine::stats::StatsCells,
    /// What the callers' looks saw of the threads beside the VM's
    /// (`engine/neighbours.rs`).
    neighbours: Mutex<crate::engine::neighbours::Neighbours>,
    /// A hint: the scheduler thread's id, once it runs (`engine/neighbours.rs`).
    pub(crate) scheduler_tid: AtomicUsize,
    /// A hint: until when the VM's callers count as losing their CPU to threads that are
    /// not the VM's: a busy neighbour (`engine/neighbours.rs`), or workers bound to the
    /// caller's one CPU (`engine/preemption.rs`), which also set each worker's
    /// `ThreadCtx::callers_contended_until`. Not a caller's own wait for its CPU
    /// (`CallerSense`): under a flood the VM's own threads cause that. Read without a lock
    /// by a submission's catch-up (`engine/submission.rs`).
    pub(crate) callers_contended_until: crate::util::HintUntil,
    /// A hint: until when the VM's callers count the machine as quiet: a look at the
    /// threads beside the VM's, after enough looks to tell, found no busy one
    /// (`engine/neighbours.rs`); a look that finds one, or a lazy graph that stops
    /// making progress while a caller waits for it, ends it. A waiting caller then leaves
    /// its lazy graphs' ready work to their threads (`vm_lazy::HelpGate`).
    pub(crate) neighbours_quiet_until: crate::util::HintUntil,
    /// A hint: until when a worker of this VM counts its instructions as tiny
    /// (`preemption::mark_tiny_kernels`): submissions then catch up with its queue, as
    /// while the callers share their CPUs. Read without a lock by that catch-up.
    pub(crate) tiny_kernels_until: crate::util::HintUntil,
    /// An embedding runtime's hooks (`util/hooks.rs`), installed at most once.
    foreign: OnceLock<ForeignHooks>,
    /// 1 until the scheduler thread exits (it decreases it last): shutdown waits on it
    /// with a bound, where a join would block for as long as the engine stays lively.
    scheduler_running: BlockingCounter<FutexWait>,
    /// The user's `VirtualMachine` handle is dropped: work still in flight (a custom
    /// instruction's `Done` held elsewhere) is abandoned, though VM threads that gave up
    /// waiting for it may still hold this core.
    handle_dropped: AtomicBool,
    /// Device work that drains gave up on, shared with every stream's device side:
    /// diagnostics name it while it stays uncompleted (`device/given_up.rs`).
    given_up: Arc<crate::device::given_up::GivenUpWork>,
    /// The first user barrier callback that panicked since the last `sync` reported one:
    /// a barrier has no outputs to poison and no caller waiting, so `sync` says it.
    barrier_failure: Mutex<Option<Failure>>,
    /// What the layers above add to every diagnostic (the lazy graphs' states), set once
    /// by the first use of the lazy door; called on the thread that builds the diagnostic.
    diagnostic_extra: OnceLock<DiagnosticExtra>,
}

/// See [`VmCore::set_diagnostic_extra`].
pub(crate) type DiagnosticExtra = Box<dyn Fn() -> Vec<String> + Send + Sync>;

impl VmCore {
    /// A core for a VM with id `id`: an empty engine (in the token's cell, or behind the
    /// single-thread mutex), no work, no workers.
    pub(crate) fn new(
        id: usize,
        config: Config,
        parking: Arc<crate::engine::drive::EngineToken>,
        #[cfg(feature = "fuzzing")] planted: ivm_engine::PlantedBug,
    ) -> Self {
        let single = config.mode == crate::Mode::SingleThread;
        Self {
            id,
            #[cfg(feature = "fuzzing")]
            planted,
            engine: single.then(|| Mutex::new(Engine::for_config(&config))),
            cell: crate::engine::drive::EngineCell::new(
                (!single).then(|| Engine::for_config(&config)),
            ),
            pool: crate::model::pool::InstrPool::default(),
            pending: MpscQueue::new(),
            parking,
            gate: crate::engine::gate::Gate::new(),
            stop: AtomicBool::new(false),
            flying: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            kept: crossbeam_utils::CachePadded::new(AtomicUsize::new(0)),
            long_kernel_workers: AtomicUsize::new(0),
            backpressure: crate::engine::backpressure::Backpressure::new(),
            probes: Mutex::new(Vec::new()),
            probes_flag: AtomicBool::new(false),
            live: [
                AtomicUsize::new(0),
                AtomicUsize::new(0),
                AtomicUsize::new(0),
            ],
            workers: Mutex::new(Some(Vec::new())),
            birth: crate::util::fork::Birth::now(),
            stats: crate::engine::stats::StatsCells::new(),
            neighbours: Mutex::new(Default::default()),
            scheduler_tid: AtomicUsize::new(0),
            callers_contended_until: crate::util::HintUntil::default(),
            neighbours_quiet_until: crate::util::HintUntil::default(),
            tiny_kernels_until: crate::util::HintUntil::default(),
            foreign: OnceLock::new(),
            scheduler_running: BlockingCounter::new(1),
            handle_dropped: AtomicBool::new(false),
            given_up: Arc::default(),
            barrier_failure: Mutex::new(None),
            diagnostic_extra: OnceLock::new(),
            config,
        }
    }
}

/// What the doors, the runtime and the VM handle reach: the VM's identity, its
/// configuration, the engine token, the instruction pool, the counters, and the steps of
/// shutdown. The fields stay behind it, so that each protocol's word is written from
/// one place.
impl VmCore {
    pub(crate) fn id(&self) -> usize {
        self.id
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The bug planted for the equivalence fuzzer's own tests (see the field).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn planted(&self) -> ivm_engine::PlantedBug {
        self.planted
    }

    /// The engine token: who drives, the parking word, and the sink device completions
    /// unpark through (`drive/token.rs`).
    pub(crate) fn token(&self) -> &Arc<crate::engine::drive::EngineToken> {
        &self.parking
    }

    /// The device work that drains gave up on (`device/given_up.rs`), for the streams'
    /// device sides.
    pub(crate) fn given_up(&self) -> &Arc<crate::device::given_up::GivenUpWork> {
        &self.given_up
    }

    /// A user barrier's callback failed (panicked): kept for the next `sync`, unless an
    /// earlier one is kept already.
    pub(crate) fn note_barrier_failure(&self, f: Failure) {
        lock(&self.barrier_failure).get_or_insert(f);
    }

    /// The barrier failure kept for `sync`, cleared.
    pub(crate) fn take_barrier_failure(&self) -> Option<Failure> {
        lock(&self.barrier_failure).take()
    }

    /// Where instructions are taken from and recycled to.
    pub(crate) fn pool(&self) -> &crate::model::pool::InstrPool {
        &self.pool
    }

    /// Fork policy: where the VM was created (see `util/fork.rs`).
    pub(crate) fn birth(&self) -> &crate::util::fork::Birth {
        &self.birth
    }

    /// Introspection counters (see `stats.rs`).
    pub(crate) fn stats(&self) -> &crate::engine::stats::StatsCells {
        &self.stats
    }

    /// What the callers' looks saw of the threads beside the VM's
    /// (`engine/neighbours.rs`).
    pub(crate) fn neighbours(&self) -> &Mutex<crate::engine::neighbours::Neighbours> {
        &self.neighbours
    }

    /// Installs an embedding runtime's hooks; [`Error::Config`] if some were before.
    pub(crate) fn set_foreign_hooks(&self, hooks: ForeignHooks) -> Result<()> {
        self.foreign
            .set(hooks)
            .map_err(|_| Error::Config("foreign hooks are installed once per VM".into()))
    }

    /// Counts `instr` in flight and pushes it to the pending queue alone; whether the
    /// queue was empty. The caller holds a gate pass and calls [`pushed`](Self::pushed)
    /// after its last push.
    pub(crate) fn push_counted(&self, instr: Arc<Instruction>) -> bool {
        self.count_in_flight(1);
        self.pending.push(instr)
    }

    /// `n` instructions about to be pushed (or handed to an engine directly).
    pub(crate) fn count_in_flight(&self, n: usize) {
        // Relaxed: a count; the instructions themselves are published by the pushes.
        self.flying.fetch_add(n, Ordering::Relaxed);
    }

    /// Engine: one instruction released.
    pub(crate) fn instruction_released(&self) {
        // Relaxed: counts; the instruction's effects were published through DONE.
        self.flying.fetch_sub(1, Ordering::Relaxed);
        self.finished.fetch_add(1, Ordering::Relaxed);
    }

    /// One instruction ran at rest ([`run_at_rest`](Self::run_at_rest)): received and
    /// released at once, never in flight.
    pub(crate) fn count_at_rest(&self) {
        // Relaxed: counts, as in `instruction_released`.
        self.finished.fetch_add(1, Ordering::Relaxed);
        self.stats().ran_at_rest.fetch_add(1, Ordering::Relaxed);
    }

    /// Released instructions, ever.
    pub(crate) fn released(&self) -> usize {
        // Relaxed: a statistic.
        self.finished.load(Ordering::Relaxed)
    }

    /// The live engine objects the engine's driver last published
    /// ([`publish_counters`](Self::publish_counters)): instructions, accesses, edges.
    pub(crate) fn live_counts(&self) -> (usize, usize, usize) {
        // Relaxed: diagnostic snapshots.
        (
            self.live[0].load(Ordering::Relaxed),
            self.live[1].load(Ordering::Relaxed),
            self.live[2].load(Ordering::Relaxed),
        )
    }

    /// Small sync accesses run without a worker, ever: `(direct, inline)` (see
    /// `EngineCell`).
    pub(crate) fn inline_accesses(&self) -> (usize, usize) {
        (self.cell.direct_runs(), self.cell.inline_runs())
    }

    /// A worker's `ThreadCtx::long_kernels` hint turned on (`long`) or off.
    pub(crate) fn count_long_kernel_worker(&self, long: bool) {
        // Relaxed: a hint (see `long_kernel_workers`).
        if long {
            self.long_kernel_workers.fetch_add(1, Ordering::Relaxed);
        } else {
            self.long_kernel_workers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether some worker runs long kernels (a hint: see `long_kernel_workers`).
    pub(crate) fn long_kernels_somewhere(&self) -> bool {
        // Relaxed: a hint; a worker that misses a registration releases itself.
        self.long_kernel_workers.load(Ordering::Relaxed) > 0
    }

    /// Shutdown, first step: no submission gets through the gate after this.
    pub(crate) fn close_gate(&self) {
        self.gate.close();
    }

    /// Shutdown, after [`close_gate`](Self::close_gate): waits until every submission
    /// that got in has pushed (`gate.rs`).
    pub(crate) fn wait_gate_empty(&self) {
        self.gate.wait_until_empty(std::thread::yield_now);
    }

    /// Shutdown: tells the scheduler to exit once the engine is idle, and wakes it.
    pub(crate) fn request_stop(&self) {
        // Release: pairs with `stop_requested`'s Acquire (see there).
        self.stop.store(true, Ordering::Release);
        self.parking.unpark();
    }

    /// The scheduler thread's last act before it exits.
    pub(super) fn scheduler_exited(&self) {
        // Release inside: publishes everything the scheduler did to shutdown's Acquire
        // wait (`wait_scheduler_exit`), which then joins the thread.
        self.scheduler_running.decrease();
    }

    /// Waits until the scheduler thread exits or `deadline` passes; whether it exited.
    pub(crate) fn wait_scheduler_exit(&self, deadline: ivm_core::wait::Instant) -> bool {
        // Acquire inside: pairs with the Release decrease of `scheduler_exited`.
        matches!(
            self.scheduler_running.timed_wait_until_zero(deadline),
            Ok(Timed::Notified)
        )
    }
}

/// What the engine's drivers reach (`drive/`, `single.rs`, `submission.rs`, the
/// scheduler): the queues and the engine's two homes.
impl VmCore {
    /// Whether no received instruction waits in the pending queue (a snapshot).
    pub(crate) fn nothing_pending(&self) -> bool {
        self.pending.is_empty()
    }

    /// Received instructions, for the engine's driver (see the field).
    pub(super) fn pending(&self) -> &MpscQueue<Instruction, PendingTag> {
        &self.pending
    }

    /// Multi-thread mode: the engine's cell, driven by the token's holder.
    pub(super) fn cell(&self) -> &crate::engine::drive::EngineCell {
        &self.cell
    }

    /// Single-thread mode: the engine, driven by callers; `None` in multi-thread mode.
    pub(super) fn single_engine(&self) -> Option<&Mutex<Engine>> {
        self.engine.as_ref()
    }

    /// Submitters waiting for backpressure (`backpressure.rs`).
    pub(super) fn backpressure(&self) -> &crate::engine::backpressure::Backpressure {
        &self.backpressure
    }
}

impl VmCore {
    pub(crate) fn single_thread(&self) -> bool {
        self.engine.is_some()
    }

    /// After a worker's mark: whether a submitter waits for backpressure (it does not
    /// drive while it waits, so a release it waits for must not be left for later).
    /// `Backpressure::waiting`'s fence orders the mark before the count; `wait_backpressure`
    /// counts itself, fences, then looks for a mark (store buffering: one of us sees the
    /// other).
    pub(crate) fn backpressured(&self) -> bool {
        self.backpressure.waiting()
    }

    /// A count that moves whenever an instruction finished (released, or finished with its
    /// release left for later): what the stall detectors of the waits compare with itself
    /// (`timeout_period` without a change is a stall). Releases alone would stand still
    /// while a worker runs a long queue whose releases it leaves for later.
    pub(crate) fn progress(&self) -> usize {
        // Relaxed: counters compared with themselves; no data is read through them.
        self.finished
            .load(Ordering::Relaxed)
            .wrapping_add(self.kept.load(Ordering::Relaxed))
    }

    /// A worker finished an instruction and left its release for later (see `kept`).
    pub(crate) fn count_kept(&self) {
        // Relaxed: a progress count (see `progress`).
        self.kept.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn flying(&self) -> usize {
        // Relaxed: a heuristic (notify-skip, backpressure re-checks), never a proof.
        self.flying.load(Ordering::Relaxed)
    }

    /// Enters the shutdown gate for one submission (see `gate.rs`).
    pub(crate) fn enter(&self) -> Result<crate::engine::gate::Pass<'_>> {
        self.birth.check()?;
        self.gate.enter().ok_or(Error::ShutDown)
    }

    pub(crate) fn is_shut(&self) -> bool {
        self.gate.is_closed()
    }

    /// The `VirtualMachine` handle's drop ends here (its shutdown done or given up).
    pub(crate) fn mark_handle_dropped(&self) {
        // Relaxed: nothing is published through it; a reader that happens-after the drop
        // (a `Done` sent to another thread afterwards) sees it by coherence.
        self.handle_dropped.store(true, Ordering::Relaxed);
    }

    /// Whether the user's handle to this VM is gone (see `mark_handle_dropped`).
    pub(crate) fn is_handle_dropped(&self) -> bool {
        self.handle_dropped.load(Ordering::Relaxed)
    }

    /// Rejects calls from this VM's own threads/kernels/callbacks and after shutdown.
    pub(crate) fn check_caller(&self) -> Result<()> {
        self.birth.check()?;
        if inside(self.id) {
            return Err(Error::Reentrant);
        }
        if self.is_shut() {
            return Err(Error::ShutDown);
        }
        Ok(())
    }

    pub(crate) fn publish_counters(&self, (i, a, e): (usize, usize, usize)) {
        // Relaxed: diagnostic snapshots.
        self.live[0].store(i, Ordering::Relaxed);
        self.live[1].store(a, Ordering::Relaxed);
        self.live[2].store(e, Ordering::Relaxed);
    }

    /// Whether a probe may be waiting (a hint: the probes themselves are taken under
    /// the mutex, [`take_probes`](Self::take_probes)).
    ///
    /// Relaxed is enough, on both sides: a reader that sees the flag a submitter set
    /// after its unlock cannot then take the mutex before that unlock. Had it locked
    /// first, its unlock would happen before the submitter's lock, hence before the
    /// flag's store, and its load (sequenced before its lock) could not read that store.
    /// So a set flag always finds the probe that set it, and the mutex publishes it. (The
    /// scheduler asleep is woken by `submit_probe`'s unpark, whose own Release/Acquire
    /// makes the flag visible to its look after the wake.) Weakening the Release/Acquire
    /// pair this used to have to Relaxed passed every model (`.ci/ordering_mutants.sh`).
    pub(crate) fn probes_submitted(&self) -> bool {
        self.probes_flag.load(Ordering::Relaxed)
    }

    pub(crate) fn take_probes(&self) -> Vec<Probe> {
        let mut g = lock(&self.probes);
        // Relaxed: the mutex orders the vector; the flag is only a hint to look.
        self.probes_flag.store(false, Ordering::Relaxed);
        std::mem::take(&mut *g)
    }

    pub(crate) fn submit_probe(&self, p: Probe) {
        lock(&self.probes).push(p);
        // Relaxed: after our unlock, so whoever sees it set finds the probe under the
        // mutex (see `probes_submitted`).
        self.probes_flag.store(true, Ordering::Relaxed);
        self.parking.unpark();
    }

    pub(crate) fn stop_requested(&self) -> bool {
        // Acquire: pairs with `request_stop`'s Release store, made by shutdown after
        // the gate emptied (`Gate::wait_until_empty`, Acquire), so every push of a caller
        // that got through the gate happens before a load that sees the flag: the
        // scheduler's look at the pending queue after it (`scheduler_loop`'s exit check)
        // finds those pushes, and it never exits with one undrained. No loom model runs
        // shutdown against the scheduler: weakened to Relaxed, this and its Release
        // survive the ordering mutants (`docs/checking.md`, "Loom").
        self.stop.load(Ordering::Acquire)
    }

    /// A diagnostic of the engine (asks the scheduler; bounded wait).
    pub(crate) fn diagnostic(&self) -> Diagnostic {
        self.completed_diagnostic(self.engine_diagnostic())
    }

    /// The engine's diagnostic `d` with what the core knows beside the engine: device
    /// work given up on, and what the layers above add (the lazy graphs' states).
    pub(crate) fn completed_diagnostic(&self, mut d: Diagnostic) -> Diagnostic {
        // Device work no lively instruction holds any more: first, as it is what the
        // rest waits behind.
        let given_up = self.given_up.still_stuck();
        d.lively.splice(0..0, given_up);
        if let Some(extra) = self.diagnostic_extra.get() {
            // User code (a graph's probe): a call into this VM from it is refused, as
            // from a kernel, where it would wait and time out into this again.
            let _reentry = ReentryGuard::enter(self.id);
            d.graphs = extra();
        }
        d
    }

    /// Installs what the layers above add to every diagnostic (`Diagnostic::graphs`);
    /// only the first call counts (the lazy door's state is created once).
    pub(crate) fn set_diagnostic_extra(&self, extra: DiagnosticExtra) {
        let _ = self.diagnostic_extra.set(extra);
    }

    /// The engine's lively instructions (asks the scheduler; bounded wait).
    fn engine_diagnostic(&self) -> Diagnostic {
        if self.single_thread() {
            return match self.try_engine() {
                Some(e) => e.diagnostic(),
                None => Diagnostic {
                    scheduler_unresponsive: true,
                    ..Diagnostic::default()
                },
            };
        }
        let slot = Arc::new(DiagSlot {
            done: BlockingCounter::new(1),
            value: Mutex::new(None),
        });
        self.submit_probe(Probe::Diagnose(slot.clone()));
        let _hook = self.wait_scope();
        let wait = self.config.timeout_period.min(Duration::from_secs(2));
        let deadline = FutexWait::now().saturating_add(wait);
        match slot.done.timed_wait_until_zero(deadline) {
            Ok(Timed::Notified) => lock(&slot.value).take().unwrap_or_default(),
            _ => Diagnostic {
                scheduler_unresponsive: true,
                ..Diagnostic::default()
            },
        }
    }

    /// Tells the VM's [`WaitHook`], if any, that the calling thread starts to wait; the
    /// returned scope tells it the wait is over when dropped. A no-op inside a scope of
    /// the same VM on this thread.
    pub(crate) fn wait_scope(&self) -> WaitScope {
        let Some(hook) = self.foreign.get().and_then(|h| h.wait.clone()) else {
            return WaitScope {
                hook: None,
                panicked: None,
            };
        };
        let prev = IN_WAIT_HOOK.with(|c| c.replace(self.id));
        if prev == self.id {
            return WaitScope {
                hook: None,
                panicked: None,
            };
        }
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook.before_wait())).err();
        WaitScope {
            hook: Some((hook, prev)),
            panicked,
        }
    }

    /// Where unrun closures' captures go instead of being dropped on a VM thread, if the
    /// embedder installed a [`DropSink`](crate::DropSink).
    pub(crate) fn drop_sink(&self) -> Option<&Arc<dyn crate::DropSink>> {
        self.foreign.get().and_then(|h| h.drops.as_ref())
    }

    /// A worker thread about to be spawned: the scheduler closes it at exit.
    /// [`Error::ShutDown`] once it has ([`close_workers`](Self::close_workers)): the
    /// thread must not be spawned, nobody would close it.
    pub(crate) fn register_worker(&self, ctx: &Arc<ThreadCtx>) -> Result<()> {
        match lock(&self.workers).as_mut() {
            Some(w) => {
                w.push(ctx.clone());
                Ok(())
            }
            None => Err(Error::ShutDown),
        }
    }

    /// The `k`-th registered worker's context, while the workers run (a caller that runs
    /// queued work itself walks them: `worker::caller_runs_any`).
    pub(crate) fn worker(&self, k: usize) -> Option<Arc<ThreadCtx>> {
        lock(&self.workers).as_ref()?.get(k).cloned()
    }

    /// The registered workers' contexts, under one lock (none after the scheduler's exit).
    pub(crate) fn with_workers<R>(&self, f: impl FnOnce(&[Arc<ThreadCtx>]) -> R) -> R {
        f(lock(&self.workers).as_deref().unwrap_or(&[]))
    }

    /// Scheduler exit: closes every worker's notifier (they drain and exit), and every
    /// later [`register_worker`](Self::register_worker) fails.
    pub(crate) fn close_workers(&self) {
        for c in lock(&self.workers).take().into_iter().flatten() {
            c.close();
        }
    }
}
