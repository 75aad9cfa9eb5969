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
//!   may even run inline, see `engine.rs`) and releases what is done;
//! * a **worker** that finished an instruction takes the engine if it is free and releases
//!   it at once, readying and dispatching its successors (also on other streams: no
//!   scheduler round trip on a cross-stream edge);
//! * a **caller waiting** for a result (a sync access) is a *helper* ([`Helping`]) while
//!   it spins: it drives whenever input is marked, so a worker with more instructions
//!   queued leaves its releases to it ([`Owed`]) and any producer skips waking the
//!   scheduler ([`EngineToken::unpark`]);
//! * a **lazy-job completion** on a graph runtime's thread drives the engine right there
//!   when nobody holds it and no helper spins ([`EngineToken::complete_outside`]);
//! * the **scheduler thread** is the driver of last resort: probes, user barriers (their
//!   callbacks run on the scheduler thread), device completions that
//!   arrive while nobody drives, shutdown, and hand-overs from a driver that ran out of its
//!   step budget. It sleeps through ivm-core's [`Parking`] protocol otherwise.
//!
//! Exactly one thread at a time holds the engine; nobody ever blocks on it (try-lock only).
//!
//! # The state word
//!
//! [`EngineToken::state`] holds a [`TokenWord`] with three named bits: `LOCKED` (somebody
//! holds the engine), `DIRTY` (input was published that the engine may not have seen) and
//! `WANTED` (a submitting caller waits for the engine to be handed over, below).
//! Every write to it is a read-modify-write, so its modification order is a single chain and the Release/Acquire
//! pairs below form release sequences that no plain store breaks.
//!
//! * **Producer** (pushed to the pending queue, set `DONE` on an instruction, submitted a
//!   probe, requested shutdown) publishes its input first, then either
//!   [`acquire_or_mark`](EngineToken::acquire_or_mark) — takes the engine if it is free (Acquire),
//!   or sets `DIRTY` on a held engine (Release) — or [`unpark`](EngineToken::unpark) — sets
//!   `DIRTY` (Release) and wakes the scheduler if nobody holds the engine.
//! * **Holder**: after taking the engine it drains the pending queue and steps the engine
//!   until it makes no progress, then [`unlock`](EngineToken::unlock)s: a compare-exchange
//!   `LOCKED → 0` (Release: publishes the engine's state to the next holder). If it fails,
//!   `DIRTY` was set meanwhile: the holder clears it with an Acquire swap (which
//!   synchronises with the producer's Release) and drives again.
//!
//! **No input is ever lost.** Take a producer's marking RMW *P* and the holder's unlock
//! attempt *U*. If *P* comes first in the word's modification order, *U* fails (it expects
//! `LOCKED` without `DIRTY`) and the holder drives again after an Acquire that reads *P*'s
//! release sequence, so it sees the input. If *U* comes first, *P* reads an unlocked word:
//! with `acquire_or_mark` the producer takes the engine itself (or a third thread took it
//! after *P*: then its Acquire read *P*'s `DIRTY` and it drains everything), with `unpark`
//! the producer wakes the scheduler, whose park re-checks the word (the store-load
//! argument of [`Parking`]: both sides do an RMW on the parking word, so either the
//! scheduler sees `DIRTY` on an unlocked word or the producer sees it parked and wakes it).
//! A half-done push to the pending queue (`Inconsistent`) needs no spinning: its producer
//! marks the word *after* its push completes, so some driver drains it then.
//!
//! **The hand-back.** A submitting caller that finds the engine held may instead ask for it
//! ([`acquire_or_want`](EngineToken::acquire_or_want)): it marks `DIRTY | WANTED` and spins
//! a few microseconds; the holder, at its next step boundary or when it would let go,
//! [`hand_over`](EngineToken::hand_over)s (clears only `LOCKED`, Release) and the caller
//! takes the engine (Acquire). A caller leaves only from a locked word (the holder then sees
//! its mark) or after withdrawing its want by compare-exchange on a locked word, so a
//! hand-over always finds its taker. ARCHITECTURE.md, "Who may drive the engine", says why.
//!
//! A driver that must stop before the engine is clean (step budget spent, a probe or user
//! barrier needs the scheduler thread, shutdown) hands over with
//! [`unlock_to_scheduler`](EngineToken::unlock_to_scheduler): it leaves `DIRTY` set on an
//! unlocked word and unparks the scheduler, which is then responsible.
//!
//! The loom model `tests/loom_wake_path.rs` checks this protocol with a caller, a worker
//! and the scheduler racing for the engine.

use ivm_core::parking::{Park, Parking};
use ivm_core::sync::{AtomicU32, AtomicUsize, Ordering, UnsafeCell};
use ivm_core::wait::{Instant, Wait};

use crate::engine::Engine;
use crate::engine::core::{ReentryGuard, VmCore};
use crate::engine::helping::Helpers;
use crate::util::futex::FutexWait;

thread_local! {
    /// This thread runs a graph runtime's actors (see [`EngineToken::complete_outside`]).
    static GRAPH_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as a graph runtime's thread: lazy-job completions on it may
/// drive the engine ([`EngineToken::complete_outside`]).
pub(crate) fn mark_graph_thread() {
    GRAPH_THREAD.with(|g| g.set(true));
}

/// A value of the token's state word: three named bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TokenWord(u32);

impl TokenWord {
    /// Nobody holds the engine and no input is marked.
    const FREE: TokenWord = TokenWord(0);
    /// Somebody holds the engine.
    const LOCKED: TokenWord = TokenWord(1);
    /// Input was published that the engine may not have seen.
    const DIRTY: TokenWord = TokenWord(2);
    /// A submitting caller waits for the holder to hand the engine over
    /// ([`EngineToken::acquire_or_want`]).
    const WANTED: TokenWord = TokenWord(4);

    /// Whether somebody holds the engine.
    fn locked(self) -> bool {
        self.0 & Self::LOCKED.0 != 0
    }

    /// Whether input is marked.
    fn dirty(self) -> bool {
        self.0 & Self::DIRTY.0 != 0
    }

    /// Whether a caller waits for the hand-over.
    fn wanted(self) -> bool {
        self.0 & Self::WANTED.0 != 0
    }

    /// This word with the bits of `other` set too.
    fn with(self, other: TokenWord) -> TokenWord {
        TokenWord(self.0 | other.0)
    }

    /// This word with the bits of `other` clear.
    fn without(self, other: TokenWord) -> TokenWord {
        TokenWord(self.0 & !other.0)
    }
}

/// The token's state word ([`TokenWord`] values in an atomic). Every write is a
/// read-modify-write (see the module docs); each method takes the ordering its call site
/// chooses and says why.
struct TokenState(AtomicU32);

impl TokenState {
    fn new() -> Self {
        Self(AtomicU32::new(TokenWord::FREE.0))
    }

    #[inline]
    fn load(&self, order: Ordering) -> TokenWord {
        TokenWord(self.0.load(order))
    }

    /// Sets the bits of `bits`; returns the previous word.
    #[inline]
    fn fetch_or(&self, bits: TokenWord, order: Ordering) -> TokenWord {
        TokenWord(self.0.fetch_or(bits.0, order))
    }

    #[inline]
    fn swap(&self, new: TokenWord, order: Ordering) -> TokenWord {
        TokenWord(self.0.swap(new.0, order))
    }

    #[inline]
    fn compare_exchange(
        &self,
        current: TokenWord,
        new: TokenWord,
        success: Ordering,
        failure: Ordering,
    ) -> Result<TokenWord, TokenWord> {
        self.0
            .compare_exchange(current.0, new.0, success, failure)
            .map(TokenWord)
            .map_err(TokenWord)
    }

    #[inline]
    fn compare_exchange_weak(
        &self,
        current: TokenWord,
        new: TokenWord,
        success: Ordering,
        failure: Ordering,
    ) -> Result<TokenWord, TokenWord> {
        self.0
            .compare_exchange_weak(current.0, new.0, success, failure)
            .map(TokenWord)
            .map_err(TokenWord)
    }
}

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

/// The engine token: who owns the VM's engine (the [`TokenWord`] bits), plus the
/// scheduler's parking spot and the helpers and single-thread waiters it wakes.
/// Shared with every stream's device side (completions call [`EngineToken::unpark`]).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_wake_path.rs`.
pub struct EngineToken {
    state: TokenState,
    parking: Parking<FutexWait>,
    /// Callers spinning in a wait that drive the engine when they see input marked
    /// ([`Helping`]): while one is registered, a producer need not wake the scheduler.
    pub(crate) helpers: Helpers,
    /// The VM, for completions that drive the engine on their own thread
    /// ([`complete_outside`](Self::complete_outside)); set once the VM exists.
    vm: std::sync::OnceLock<VmLink>,
    /// Single-thread mode: [`unpark`](Self::unpark) announces input through
    /// [`waits`](Self::waits) instead of the single-consumer parking spot, so that every
    /// waiting caller sees it.
    single: bool,
    /// Single-thread mode: where waiting callers sleep (see [`SingleWaits`]).
    pub(crate) waits: SingleWaits,
}

/// What [`EngineToken::complete_outside`] needs of its VM: its id and mode without touching the
/// VM itself (no reference count on a device's callback thread), and a weak handle for
/// the graph threads that drive it.
struct VmLink {
    id: usize,
    single_thread: bool,
    shared: std::sync::Weak<VmCore>,
}

impl std::fmt::Debug for EngineToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineToken")
            // Relaxed: a diagnostic snapshot.
            .field("state", &self.state.load(Ordering::Relaxed))
            .field("parking", &self.parking)
            .finish()
    }
}

impl Default for EngineToken {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineToken {
    /// An unlocked, clean word; the scheduler running.
    pub fn new() -> Self {
        Self::for_mode(false)
    }

    /// [`new`](Self::new), or for a single-thread VM (`single`): then producers announce
    /// input to [`SingleWaits`].
    pub(crate) fn for_mode(single: bool) -> Self {
        Self {
            state: TokenState::new(),
            parking: Parking::new(),
            helpers: Helpers::new(),
            vm: std::sync::OnceLock::new(),
            single,
            waits: SingleWaits::new(),
        }
    }

    /// Links the word to its VM (once, right after the VM is created).
    pub(crate) fn set_vm(&self, vm: &std::sync::Arc<VmCore>) {
        let _ = self.vm.set(VmLink {
            id: vm.id,
            single_thread: vm.single_thread(),
            shared: std::sync::Arc::downgrade(vm),
        });
    }

    /// Producer, **after** publishing its input (a completion, a probe, shutdown, a push
    /// by a thread that must not drive): marks the engine dirty and wakes the scheduler if
    /// nobody holds the engine (a holder sees the mark before it lets go). Returns whether
    /// it made a wake call.
    pub fn unpark(&self) -> bool {
        if self.single {
            // Single-thread mode: nobody holds the engine while sleeping; wake every
            // waiting caller (one of them drives).
            return self.waits.notify().1;
        }
        // Release: publishes the producer's input to the holder's Acquire (its failed
        // unlock's swap, or the next `try_lock`) that reads this RMW's release sequence.
        let old = self.state.fetch_or(TokenWord::DIRTY, Ordering::Release);
        if old.locked() {
            return false;
        }
        if self.helpers.spinning() {
            // A registered helper sees the mark (while it spins, or when it leaves: the
            // fences of `Helpers`) and drives; it hands over to the scheduler if the input
            // needs it (a probe, shutdown). No wake-up here.
            return false;
        }
        self.parking.unpark()
    }

    /// A lazy-job instruction completed (its `DONE` published), on whatever thread
    /// finished it:
    /// * on a VM thread, or inside a caller's engine step or claimed callback: marks the
    ///   word (that thread drives, or holds the engine, right after);
    /// * on a graph runtime's thread ([`mark_graph_thread`]): marks it; then, if nobody
    ///   holds the engine and no helper spins, drives the engine right there (as a worker
    ///   does after an instruction) instead of waking the scheduler thread, which would
    ///   cost the completion a wake-up (tens of microseconds on a small VM);
    /// * anywhere else (a user thread dropping a graph, a device's callback thread, which
    ///   must stay short), in single-thread mode, or once the VM is gone:
    ///   [`unpark`](Self::unpark).
    pub(crate) fn complete_outside(&self) {
        let Some(link) = self.vm.get().filter(|l| !l.single_thread) else {
            self.unpark();
            return;
        };
        if !GRAPH_THREAD.with(std::cell::Cell::get) {
            if crate::engine::core::inside(link.id) {
                // Release (in `mark`): as in `unpark`.
                self.mark();
            } else {
                self.unpark();
            }
            return;
        }
        let Some(vm) = link.shared.upgrade() else {
            self.unpark();
            return;
        };
        // Release (in `mark`): as in `unpark`.
        if !self.mark() || self.helpers.spinning() {
            // Held: the holder sees the mark. A helper: it drives (see `unpark`).
            return;
        }
        if self.try_lock() {
            vm.drive_as(Driver::Worker);
        }
        // Else somebody took the engine after our mark: they see our input.
    }

    /// Consumer side of the parking spot (the scheduler thread in multi-thread mode, the
    /// engine-lock holder in single-thread mode): see [`Parking::park`].
    pub fn park(&self, has_input: impl FnMut() -> bool, deadline: Option<Instant>) -> Park {
        self.parking.park(has_input, deadline)
    }

    /// Producer, after publishing its input: takes the engine if nobody holds it (returns
    /// `true`: the caller must now drive, see [`VmCore::drive`]), or leaves a `DIRTY` mark
    /// for the holder (returns `false`: the holder will see the input).
    pub fn acquire_or_mark(&self) -> bool {
        self.acquire_or(|s| s.with(TokenWord::DIRTY)).is_ok()
    }

    /// Takes the engine if nobody holds it (`Ok`), else writes `mark(word)` over the held
    /// word and returns the word it replaced (`Err`): the loop of
    /// [`acquire_or_mark`](Self::acquire_or_mark) and [`acquire_or_want`](Self::acquire_or_want).
    #[inline]
    fn acquire_or(&self, mark: impl Fn(TokenWord) -> TokenWord) -> Result<(), TokenWord> {
        // Relaxed: only a first guess; the RMWs below decide.
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            if !s.locked() {
                // Acquire: pairs with the previous holder's Release unlock (the engine's
                // state) and with every marking RMW in the release sequences we read (the
                // input published before them). Clearing DIRTY is fine: we drain all input.
                match self.state.compare_exchange_weak(
                    s,
                    TokenWord::LOCKED,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Ok(()),
                    Err(x) => s = x,
                }
            } else {
                // Release: as in `unpark`. A CAS that writes the value it read is still an
                // RMW, so it extends the release sequence the holder's Acquire reads.
                match self.state.compare_exchange_weak(
                    s,
                    mark(s),
                    Ordering::Release,
                    Ordering::Relaxed,
                ) {
                    Ok(prev) => return Err(prev),
                    Err(x) => s = x,
                }
            }
        }
    }

    /// A submitting caller, after publishing its input: takes the engine if nobody holds
    /// it (returns `true`: drive it, see [`VmCore::drive`]); else marks the word and asks
    /// the holder to hand the engine over (`WANTED`), and spins while `keep_waiting()`
    /// for the hand-over ([`hand_over`](Self::hand_over)): `true` once it got the engine,
    /// `false` when it need not drive (somebody took the engine after its mark, or it
    /// gave up and withdrew the want, leaving its mark to the holder as
    /// [`acquire_or_mark`](Self::acquire_or_mark) does). When another caller already
    /// waits for the hand-over, it only marks: that one drains this input too.
    ///
    /// Why: a worker that finished an instruction and took the engine to release it
    /// would otherwise receive and dispatch everything a busy caller submits meanwhile,
    /// on the critical path, instead of running its next kernel (ARCHITECTURE.md, "Who
    /// may drive the engine", the hand-back).
    ///
    /// Nothing is lost: the caller leaves only after reading a *locked* word (a holder
    /// then sees its mark when it lets go, or an acquisition after the mark drains it), or
    /// after its own compare-exchange withdrew the want from a locked word; an unlocked
    /// word it takes. `tests/loom_wake_path.rs` (`wake_path_caller_wants`) checks it.
    pub fn acquire_or_want(&self, keep_waiting: impl FnMut() -> bool) -> bool {
        self.acquire_or_want_impl(keep_waiting, true)
    }

    /// [`acquire_or_want`](Self::acquire_or_want) that gives up without withdrawing its
    /// want: a planted bug for the loom model `tests/loom_wake_path.rs` (a holder may hand
    /// the engine to a caller that left, and nobody drives the input).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_acquire_or_want_without_withdraw(
        &self,
        keep_waiting: impl FnMut() -> bool,
    ) -> bool {
        self.acquire_or_want_impl(keep_waiting, false)
    }

    /// [`acquire_or_want`](Self::acquire_or_want); `withdraw: false` only for the planted
    /// bug.
    #[inline]
    fn acquire_or_want_impl(&self, mut keep_waiting: impl FnMut() -> bool, withdraw: bool) -> bool {
        // Mark, and want the engine unless another caller already does (it drains our
        // input too).
        match self.acquire_or(|s| {
            if s.wanted() {
                s.with(TokenWord::DIRTY)
            } else {
                s.with(TokenWord::DIRTY).with(TokenWord::WANTED)
            }
        }) {
            Ok(()) => return true,
            Err(prev) if prev.wanted() => return false,
            Err(_) => {}
        }
        // Waiting for the hand-over.
        loop {
            // Relaxed: `try_lock` and the withdrawal decide with their own RMWs.
            let s = self.state.load(Ordering::Relaxed);
            if !s.locked() {
                // Handed over (or let go). `try_lock`'s Acquire pairs with the holder's
                // Release hand-over (the engine's state) and the marks in its release
                // sequence.
                if self.try_lock() {
                    return true;
                }
                continue;
            }
            if !s.wanted() {
                // The want was cleared on a locked word: by an acquisition or a holder's
                // re-drive after our mark (both read it and drain our input), or by a
                // second caller's withdrawal (then our mark is still there for the holder).
                return false;
            }
            if !keep_waiting() {
                if !withdraw {
                    return false;
                }
                // Withdraw the want; our mark stays for the holder. Relaxed: an RMW, so it
                // continues the release sequence of our marking RMW; it publishes nothing
                // new. Fails if the word changed (a hand-over: then we take the engine).
                if self
                    .state
                    .compare_exchange(
                        s,
                        s.without(TokenWord::WANTED),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    return false;
                }
                continue;
            }
            ivm_core::sync::spin_loop();
        }
    }

    /// Holder, at a step boundary: if a caller waits for the engine
    /// ([`acquire_or_want`](Self::acquire_or_want)), lets go of it, leaving the marks for
    /// that caller, which takes it and drives (it never leaves an unlocked word), and
    /// returns `true`; else keeps it and returns `false`.
    pub fn hand_over(&self) -> bool {
        // Release: publishes the engine's state (and the input we leave unhandled) to
        // the wanting caller's Acquire when it takes the engine.
        self.hand_over_impl(Ordering::Release)
    }

    /// [`hand_over`](Self::hand_over) with a Relaxed compare-exchange: a planted bug for
    /// the loom model `tests/loom_wake_path.rs` (the caller that takes the engine does not
    /// see the state the holder left).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_hand_over_relaxed(&self) -> bool {
        self.hand_over_impl(Ordering::Relaxed)
    }

    /// [`hand_over`](Self::hand_over) with its ordering (`Release`; `Relaxed` only for the
    /// planted bug).
    #[inline]
    fn hand_over_impl(&self, order: Ordering) -> bool {
        // Relaxed: a first guess; the CAS decides.
        let mut s = self.state.load(Ordering::Relaxed);
        while s.wanted() {
            debug_assert!(s.locked(), "ivm: hand-over of an engine we do not hold");
            match self.state.compare_exchange_weak(
                s,
                s.without(TokenWord::LOCKED),
                order,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(x) => s = x,
            }
        }
        false
    }

    /// Producer, after publishing its input: marks the word and returns whether nobody
    /// held the engine. Then the caller **owes** a drive: it must take the engine and drive
    /// it, unless it sees [`dirty_unlocked`](Self::dirty_unlocked) turn false first
    /// (every write that clears `DIRTY` is a lock acquisition after our mark, which
    /// synchronises with it and drains all input). See [`Owed`].
    pub fn mark(&self) -> bool {
        // Release: as in `unpark`.
        !self
            .state
            .fetch_or(TokenWord::DIRTY, Ordering::Release)
            .locked()
    }

    /// Takes the engine if nobody holds it.
    pub fn try_lock(&self) -> bool {
        // Relaxed: only a first guess; the CAS decides.
        let mut s = self.state.load(Ordering::Relaxed);
        while !s.locked() {
            // Acquire: as in `acquire_or_mark`.
            match self.state.compare_exchange_weak(
                s,
                TokenWord::LOCKED,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(x) => s = x,
            }
        }
        false
    }

    /// Holder, when the engine made no progress: lets go of the engine and returns `true`,
    /// unless input was marked meanwhile: then it hands the engine over to a caller that
    /// wants it ([`hand_over`](Self::hand_over), returns `true`), or clears the mark, keeps
    /// the engine and returns `false` (drive again).
    pub fn unlock(&self) -> bool {
        // Release: publishes the engine's state to the next holder's Acquire.
        if self
            .state
            .compare_exchange(
                TokenWord::LOCKED,
                TokenWord::FREE,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            return true;
        }
        if self.hand_over() {
            return true;
        }
        // Acquire: synchronises with the marking RMWs (their input is visible to us now).
        // A want set since `hand_over` looked is cleared too: its caller sees that and
        // leaves its input to us.
        let prev = self.state.swap(TokenWord::LOCKED, Ordering::Acquire);
        debug_assert!(
            prev.locked() && prev.dirty(),
            "ivm: unlock of an engine we do not hold"
        );
        false
    }

    /// [`unlock`](Self::unlock) that lets go even when input was marked (a plain store):
    /// a planted bug for the loom model `tests/loom_wake_path.rs`.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_unlock_ignoring_marks(&self) -> bool {
        self.state.swap(TokenWord::FREE, Ordering::Release);
        true
    }

    /// Holder that must stop before the engine is clean: lets go, leaves the word `DIRTY`
    /// and wakes the scheduler thread, which takes over.
    pub fn unlock_to_scheduler(&self) {
        // Release: publishes the engine's state (and the input we leave unhandled) to the
        // scheduler's Acquire when it takes the engine.
        self.state.swap(TokenWord::DIRTY, Ordering::Release);
        self.parking.unpark();
    }

    /// Whether input is marked on an engine nobody holds (the scheduler's park re-check).
    /// `false` on a word a holder handed over (`DIRTY | WANTED`): its wanting caller takes
    /// it (it never leaves an unlocked word), so nobody else owes a drive for it.
    pub fn dirty_unlocked(&self) -> bool {
        // Relaxed: nothing is read through this answer. `true` only keeps the scheduler
        // awake, and it then takes the engine with `try_lock`'s Acquire before it looks at
        // anything. `false` lets it sleep, which is safe because of the parking protocol,
        // not this load: a producer marks DIRTY before it unparks, and an unpark that came
        // before the scheduler's park announcement synchronises with that announcement
        // (its RMWs are Release/Acquire), so the mark happens-before this load, which
        // then cannot read an older value (coherence). `.ci/ordering_mutants.sh` found
        // that no model needs more; `loom_wake_path.rs` checks the protocol.
        self.state.load(Ordering::Relaxed) == TokenWord::DIRTY
    }
}

/// Single-thread mode: where callers wait for the engine, for device or lazy-job
/// completions, for instructions pushed by other threads and for each other's progress —
/// without holding the engine while they sleep (a graph kernel on another thread may
/// need to drive it meanwhile).
///
/// An event count: one word, a counter (bits 2..) bumped by every announcement
/// ([`notify`](Self::notify)), a `SLEEPING` bit set by callers about to sleep and a
/// `WANTED` bit set by callers that found the engine held. A waiter reads the count
/// ([`snapshot`](Self::snapshot)) **before** it looks at anything (the engine, its own
/// result), and sleeps only while the count is unchanged ([`wait`](Self::wait)). Every
/// write to the word is a read-modify-write, so its modification order is one chain: a
/// notification after the snapshot changes the count (the wait returns at once, or the
/// notifier sees `SLEEPING` and wakes every sleeper); one before it is read by the
/// snapshot's Acquire, so what the notifier published before it is visible to the
/// waiter's checks.
///
/// Announced: pushes that find the pending queue empty, device and lazy-job completions
/// ([`EngineToken::unpark`]), every engine step that made progress, and a release of the engine
/// that a waiter asked for ([`want_engine`](Self::want_engine),
/// [`released`](Self::released)). A release nobody asked for is not announced, so that
/// two callers waiting for the same slow graph do not wake each other in turn.
pub struct SingleWaits {
    word: AtomicU32,
}

impl Default for SingleWaits {
    fn default() -> Self {
        Self::new()
    }
}

/// A caller sleeps on [`SingleWaits`].
const SLEEPING: u32 = 1;
/// A caller found the engine held and wants its release announced.
const WANTED: u32 = 2;
/// One announcement (the count lives above the two flags).
const BUMP: u32 = 4;
const FLAGS: u32 = SLEEPING | WANTED;

impl SingleWaits {
    /// A count of zero, nobody sleeping.
    pub fn new() -> Self {
        Self {
            word: AtomicU32::new(0),
        }
    }

    /// The count now; take it before looking at anything the wait is for.
    pub fn snapshot(&self) -> u32 {
        // Acquire: pairs with the Release bumps this load reads (or follows in their
        // release sequence): what the notifiers published is visible to the checks after.
        self.word.load(Ordering::Acquire) & !FLAGS
    }

    /// Announces input or progress, **after** publishing it: bumps the count and wakes
    /// every sleeper if one announced itself. Returns the count it replaced and whether it
    /// made a wake call.
    pub fn notify(&self) -> (u32, bool) {
        // AcqRel: Release publishes the notifier's input to waiters whose snapshot or
        // announcement reads this bump (Acquire keeps the word's RMWs a chain of
        // synchronisation, as in `released`).
        let old = self.word.fetch_add(BUMP, Ordering::AcqRel);
        if old & SLEEPING == 0 {
            return (old & !FLAGS, false);
        }
        // Relaxed: clearing the bit needs no ordering; a sleeper that announced itself
        // after our bump sees a changed word (or is woken below) and re-checks.
        self.word.fetch_and(!SLEEPING, Ordering::Relaxed);
        FutexWait::wake_all(&self.word);
        (old & !FLAGS, true)
    }

    /// [`notify`](Self::notify) by a waiter that took `seen` as its snapshot: moves `seen`
    /// past its own bump when nobody else bumped since, so that its own announcement does
    /// not end its next wait (another one's does: then `seen` stays behind).
    pub fn notify_own(&self, seen: &mut u32) {
        let (old, _) = self.notify();
        if old == *seen {
            *seen = old.wrapping_add(BUMP) & !FLAGS;
        }
    }

    /// A caller found the engine held: asks the holder to announce its release. The
    /// caller must try to take the engine once more **after** this: a holder that let go
    /// before this request did so before the retry (this RMW reads its `released` RMW, or
    /// a later one), and one that lets go after it sees the request.
    pub fn want_engine(&self) {
        // AcqRel: Acquire synchronises with the `released` RMWs before it (their unlocks
        // happen before our retry); Release keeps the chain for later ones.
        self.word.fetch_or(WANTED, Ordering::AcqRel);
    }

    /// The holder let go of the engine (**after** unlocking it): announces that if a
    /// caller asked ([`want_engine`](Self::want_engine)). `seen`: the holder's own
    /// snapshot, as in [`notify_own`](Self::notify_own).
    pub fn released(&self, seen: Option<&mut u32>) {
        // AcqRel: Release orders our unlock before a requester's Acquire that reads this
        // RMW (then its retry finds the engine free).
        let old = self.word.fetch_and(!WANTED, Ordering::AcqRel);
        if old & WANTED != 0 {
            match seen {
                Some(seen) => self.notify_own(seen),
                None => {
                    self.notify();
                }
            }
        }
    }

    /// Sleeps until the count differs from `seen` (a notification after the snapshot),
    /// `deadline` or a spurious wake-up; the caller re-checks everything after.
    pub fn wait(&self, seen: u32, deadline: Instant) {
        self.wait_until(seen, Some(deadline));
    }

    /// [`wait`](Self::wait) without a deadline: loom models only, where a lost
    /// notification must show as a deadlock (under loom a deadline returns at once).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn wait_forever(&self, seen: u32) {
        self.wait_until(seen, None);
    }

    fn wait_until(&self, seen: u32, deadline: Option<Instant>) {
        // Relaxed: the RMW only puts the announcement in the word's single modification
        // order (a later bump sees it and wakes us; an earlier one changed the count we
        // read, and we return). Nothing is read through it: every caller takes a fresh
        // `snapshot` (Acquire) before it checks anything again.
        let now = self.word.fetch_or(SLEEPING, Ordering::Relaxed) | SLEEPING;
        if now & !FLAGS != seen {
            return;
        }
        let _ = FutexWait::wait(&self.word, now, deadline);
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
    /// Released instructions for reuse (both modes).
    pub(crate) pool: crate::model::pool::InstrPool,
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
            pool: crate::model::pool::InstrPool::default(),
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
            self.parking.unpark();
            return;
        }
        if !want {
            if self.parking.acquire_or_mark() {
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
        if self.parking.acquire_or_want(keep_waiting) {
            self.drive_as(Driver::Caller(claim));
        }
    }

    /// A worker finished an instruction (its `DONE` is published): the engine must release
    /// it. Drives here when nobody holds the engine.
    pub(crate) fn completed(&self) {
        if self.parking.acquire_or_mark() {
            self.drive_as(Driver::Worker);
        }
    }

    /// A caller waiting for something the engine must do (a ring entry's release): drives
    /// if nobody holds the engine.
    pub(crate) fn help(&self) {
        if self.parking.try_lock() {
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
        let Some(engine) = (unsafe { self.cell.get() }).as_mut() else {
            // Shut down: the scheduler took the engine out and keeps the word locked.
            return DriveEnd::Unlocked;
        };
        let _reentry = matches!(who, Driver::Caller(_)).then(|| ReentryGuard::enter(self.id));
        engine.set_driver(who, self.config.inline_sync_access);
        let budget = who.step_budget();
        let mut steps = 0u32;
        loop {
            self.drain_pending(engine);
            let progress = engine.step(self);
            if engine.needs_scheduler() || self.stop_requested() {
                self.parking.unlock_to_scheduler();
                return DriveEnd::HandedOver;
            }
            if progress {
                steps += 1;
                if steps >= budget {
                    self.parking.unlock_to_scheduler();
                    return DriveEnd::HandedOver;
                }
                // A submitting caller waits for the engine: it drives from here on.
                if self.parking.hand_over() {
                    return DriveEnd::Unlocked;
                }
                continue;
            }
            if self.parking.unlock() {
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
        const REST_STEPS: u32 = 8;
        if self.single_thread() {
            // Single-thread mode: the caller drives anyway.
            let Some(mut engine) = self.try_engine() else {
                return false;
            };
            let _reentry = ReentryGuard::enter(self.id);
            for _ in 0..REST_STEPS {
                self.drain_pending(&mut engine);
                if !engine.step(self) {
                    break;
                }
                // A caller waiting on another thread may be done now.
                self.parking.waits.notify();
            }
            let rest = engine.is_idle() && self.pending.is_empty();
            if rest && f() {
                self.cell.count_direct();
            }
            return rest;
        }
        if !self.parking.try_lock() {
            return false;
        }
        let (rest, needs_scheduler) = {
            // SAFETY: we hold the engine token; the reference ends in this block.
            let Some(engine) = (unsafe { self.cell.get() }).as_mut() else {
                // Shut down: the scheduler keeps the token; never reached (callers are
                // refused first), and nothing to let go.
                return false;
            };
            let _reentry = ReentryGuard::enter(self.id);
            engine.set_driver(Driver::CALLER, self.config.inline_sync_access);
            for _ in 0..REST_STEPS {
                self.drain_pending(engine);
                if !engine.step(self) {
                    break;
                }
            }
            let needs_scheduler = engine.needs_scheduler();
            let rest = engine.is_idle() && self.pending.is_empty() && !needs_scheduler;
            if rest && f() {
                self.cell.count_direct();
            }
            (rest, needs_scheduler)
        };
        // Let go like any driver (we took on every input marked before our lock).
        if needs_scheduler || self.stop_requested() {
            self.parking.unlock_to_scheduler();
        } else if !self.parking.unlock() {
            self.drive_as(Driver::CALLER);
        }
        rest
    }

    /// Holder of the engine: moves everything on the pending queue into the engine. An
    /// `Inconsistent` end needs no retry: that producer marks the word after its push
    /// completes (module docs), so some driver drains it then.
    pub(crate) fn drain_pending(&self, engine: &mut Engine) {
        let mut consumer = self.pending.consume();
        let _ = consumer.drain(|i| engine.receive(i));
    }
}

impl crate::model::stream::CompletionSink for EngineToken {
    fn unpark(&self) -> bool {
        EngineToken::unpark(self)
    }

    fn complete_outside(&self) {
        EngineToken::complete_outside(self);
    }
}
