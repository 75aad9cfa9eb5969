//! The engine token: one word that says who owns the VM's engine, and the protocol by
//! which producers, holders and a caller asking for a hand-back use it (the module docs
//! of [`drive`](super) say who drives and why).
//!
//! ## The state word
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
use ivm_core::sync::{AtomicU32, Ordering};
use ivm_core::wait::Instant;

use super::{Driver, SingleWaits};
use crate::engine::core::VmCore;
use crate::engine::helping::Helpers;
use crate::util::futex::FutexWait;

thread_local! {
    /// This thread runs a graph runtime's actors (see [`EngineToken::complete_outside`]).
    static GRAPH_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// A completion on this VM thread only marked the word, counting on the thread to
    /// drive right after ([`EngineToken::complete_outside`]); taken by a worker about to
    /// leave a release for later ([`take_completion_marked`]).
    static COMPLETION_MARKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a completion on this thread was left to it (marked, not driven) since the last
/// call: a worker must then drive after its instruction, whatever its own instruction's
/// release could wait for (`helping::Owed::leave_unless_awaited`). Clears the flag.
pub(crate) fn take_completion_marked() -> bool {
    COMPLETION_MARKED.with(|m| m.replace(false))
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

/// The engine token: who owns the VM's engine (the [`TokenWord`] bits), plus the
/// scheduler's parking spot and the helpers and single-thread waiters it wakes.
/// Shared with every stream's device side (completions call [`EngineToken::unpark`]).
///
/// Crate-internal; re-exported (hidden) under `cfg(loom)` for `tests/loom_wake_path.rs`.
pub struct EngineToken {
    state: TokenState,
    parking: Parking<FutexWait>,
    /// Callers spinning in a wait that drive the engine when they see input marked
    /// ([`Helping`](crate::engine::helping::Helping)): while one is registered, a producer
    /// need not wake the scheduler.
    pub(crate) helpers: Helpers,
    /// Callers between their push and their drive
    /// ([`Helping::submitting`](crate::engine::helping::Helping::submitting)): a worker may
    /// leave them a release for the length of one kernel. Producers do not count on them.
    pub(crate) submitters: Helpers,
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
            submitters: Helpers::new(),
            vm: std::sync::OnceLock::new(),
            single,
            waits: SingleWaits::new(),
        }
    }

    /// Links the word to its VM (once, right after the VM is created).
    pub(crate) fn set_vm(&self, vm: &std::sync::Arc<VmCore>) {
        let _ = self.vm.set(VmLink {
            id: vm.id(),
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
    ///   word (that thread drives, or holds the engine, right after; a worker about to
    ///   leave its own release for later learns from [`take_completion_marked`] that it
    ///   must not);
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
                // Release (in `mark`): as in `unpark`. This thread drives (or holds the
                // engine) right after; a worker checks this flag to be sure it does.
                self.mark();
                COMPLETION_MARKED.with(|m| m.set(true));
            } else {
                self.unpark();
            }
            return;
        }
        // Release (in `mark`): as in `unpark`.
        if !self.mark() || self.helpers.spinning() {
            // Held: the holder sees the mark. A helper: it drives (see `unpark`). Both
            // before the VM's reference count is touched: a waiting caller usually spins.
            return;
        }
        let Some(vm) = link.shared.upgrade() else {
            self.unpark();
            return;
        };
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
    /// synchronises with it and drains all input). See [`Owed`](crate::engine::helping::Owed).
    pub fn mark(&self) -> bool {
        // Release: as in `unpark`. Acquire: a mark that finds the word unlocked reads the
        // last holder's unlock (Release), so the marker sees what that holder wrote, such
        // as an instruction's `AWAITED` bit (`Owed::leave_unless_awaited`).
        !self
            .state
            .fetch_or(TokenWord::DIRTY, Ordering::AcqRel)
            .locked()
    }

    /// [`mark`](Self::mark) with Release only: a planted bug for the loom model
    /// `tests/loom_awaited.rs` (the marker may miss an `AWAITED` bit the last holder set).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn planted_mark_release(&self) -> bool {
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

impl crate::model::stream::CompletionSink for EngineToken {
    fn unpark(&self) -> bool {
        EngineToken::unpark(self)
    }

    fn complete_outside(&self) {
        EngineToken::complete_outside(self);
    }
}
