//! One-shot completion of an instruction that completes later ([`Completion::Later`]),
//! fired from wherever its work ends — another thread, an interrupt handler, a foreign
//! runtime's callback — with one compare-and-swap: no allocation, no lock, no waiting, so
//! it is safe in an interrupt handler that preempts the engine's owner.
//!
//! A [`CompletionCell`] lives where the instruction's state lives (a `static` slot on a
//! microcontroller, the instruction itself elsewhere). The executor [`arm`]s it when it
//! starts the work and hands the [`Completer`] to whoever finishes it; the instruction's
//! [`Instruction::is_done`] is [`CompletionCell::state`]`().is_done()`; after the release
//! the owner [`reset`]s it for the next instruction. Every misuse has a defined answer,
//! never a hang and never a use after free (the cell outlives its completers by borrow):
//!
//! | event | answer |
//! |---|---|
//! | fired once (by the [`Completer`] or by [`CompletionCell::fire`]) | `Ok`; the instruction is done, succeeded or failed as told |
//! | fired again | [`FireError::AlreadyFired`] (the first answer stands) |
//! | a [`Completer`] of an earlier arming fired or dropped (the cell was fired directly, reset and armed again) | [`FireError::AlreadyFired`]; the later arming is untouched |
//! | fired while nothing is armed | [`FireError::NotArmed`] |
//! | the [`Completer`] dropped unfired | the instruction is done and failed ([`CellState::Abandoned`]) |
//! | fired after [`close`](CompletionCell::close) (shutdown) | [`FireError::ShutDown`]; an instruction armed at the close is done and failed ([`CellState::Closed`]) |
//!
//! Memory order: a fire is a Release, [`state`](CompletionCell::state) an Acquire, so
//! whatever the work wrote before the fire (a DMA transfer's bytes) is visible to the
//! engine's owner once it sees the instruction done — and so to every instruction the
//! engine orders after it.
//!
//! [`Completion::Later`]: crate::Completion::Later
//! [`Instruction::is_done`]: crate::Instruction::is_done
//! [`arm`]: CompletionCell::arm
//! [`reset`]: CompletionCell::reset

use core::fmt;

use ivm_core::sync::{AtomicU32, Ordering};

// The word: a state in the low `STATE_BITS` bits, and above them an epoch that every arm
// advances, so that a `Completer` of an earlier arming can never complete (or abandon) a
// later one, even after the cell was fired directly, reset and armed again.
const STATE_BITS: u32 = 3;
const STATE_MASK: u32 = (1 << STATE_BITS) - 1;

fn state_of(word: u32) -> u32 {
    word & STATE_MASK
}

/// `word`'s epoch with state `state`.
fn with_state(word: u32, state: u32) -> u32 {
    (word & !STATE_MASK) | state
}

/// Nothing armed (new, or reset after a release).
const IDLE: u32 = 0;
/// An instruction waits for one fire.
const ARMED: u32 = 1;
/// Fired: the work succeeded.
const DONE: u32 = 2;
/// Fired: the work failed.
const FAILED: u32 = 3;
/// The completer was dropped unfired: the work is lost, the instruction failed.
const ABANDONED: u32 = 4;
/// Shut down: every later arm and fire is refused.
const CLOSED: u32 = 5;

/// Where a [`CompletionCell`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    /// Nothing armed.
    Idle,
    /// Armed, not fired yet: the instruction is not done.
    Armed,
    /// Fired: done, succeeded.
    Done,
    /// Fired: done, failed.
    Failed,
    /// The completer was dropped unfired: done, failed.
    Abandoned,
    /// Closed (shutdown): done, failed if it was armed; refuses every later arm and fire.
    Closed,
}

impl CellState {
    /// Whether an instruction waiting on the cell is done: fired, abandoned or closed.
    pub const fn is_done(self) -> bool {
        !matches!(self, Self::Idle | Self::Armed)
    }

    /// Whether it is done and succeeded.
    pub const fn succeeded(self) -> bool {
        matches!(self, Self::Done)
    }

    fn of(word: u32) -> Self {
        match state_of(word) {
            IDLE => Self::Idle,
            ARMED => Self::Armed,
            DONE => Self::Done,
            FAILED => Self::Failed,
            ABANDONED => Self::Abandoned,
            _ => Self::Closed,
        }
    }
}

/// Why a fire was refused (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FireError {
    /// Nothing is armed: the cell is idle (never armed, or reset after the release).
    NotArmed,
    /// It was fired (or its completer dropped) before; the first answer stands.
    AlreadyFired,
    /// The cell was closed (shutdown).
    ShutDown,
}

impl fmt::Display for FireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotArmed => "completion fired while no instruction was armed",
            Self::AlreadyFired => "completion fired twice (the first answer stands)",
            Self::ShutDown => "completion fired after shutdown",
        })
    }
}

/// Why [`CompletionCell::arm`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArmError {
    /// Armed or fired and not reset yet: an instruction still uses the cell.
    Busy,
    /// The cell was closed (shutdown).
    ShutDown,
}

impl fmt::Display for ArmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Busy => "completion cell armed while an instruction still uses it",
            Self::ShutDown => "completion cell armed after shutdown",
        })
    }
}

/// The completion state of one instruction that completes later: one atomic word. See the
/// [module docs](self).
///
/// # Examples
///
/// ```
/// use ivm_engine::{CellState, CompletionCell, FireError};
///
/// static DMA_DONE: CompletionCell = CompletionCell::new();
///
/// // The executor starts the work and hands the completer to whoever finishes it (here,
/// // what an interrupt handler would do, inline).
/// let completer = DMA_DONE.arm().unwrap();
/// assert!(!DMA_DONE.state().is_done());
/// completer.fire(true).unwrap();
/// assert_eq!(DMA_DONE.state(), CellState::Done);
/// // A second fire is refused; the first answer stands.
/// assert_eq!(DMA_DONE.fire(false), Err(FireError::AlreadyFired));
/// // After the engine released the instruction, the cell serves the next one.
/// assert_eq!(DMA_DONE.reset(), Ok(CellState::Done));
/// // A completer dropped unfired fails its instruction.
/// drop(DMA_DONE.arm().unwrap());
/// assert_eq!(DMA_DONE.state(), CellState::Abandoned);
/// ```
pub struct CompletionCell {
    state: AtomicU32,
}

impl Default for CompletionCell {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for CompletionCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CompletionCell")
            .field(&self.state())
            .finish()
    }
}

impl CompletionCell {
    /// An idle cell.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            state: AtomicU32::new(IDLE),
        }
    }

    /// An idle cell.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            state: AtomicU32::new(IDLE),
        }
    }

    /// Arms the cell for one instruction and returns the handle that completes it.
    ///
    /// # Errors
    /// [`ArmError::Busy`] when an instruction still uses the cell (armed, or fired and not
    /// [`reset`](Self::reset)); [`ArmError::ShutDown`] after [`close`](Self::close).
    pub fn arm(&self) -> Result<Completer<'_>, ArmError> {
        // Relaxed: arming publishes nothing (the executor's descriptor is published by
        // however it hands the work over: a queue push, a register write); the owner
        // that arms is the one that reset, so it reads its own write.
        let mut now = self.state.load(Ordering::Relaxed);
        loop {
            match state_of(now) {
                IDLE => {}
                CLOSED => return Err(ArmError::ShutDown),
                _ => return Err(ArmError::Busy),
            }
            // The next epoch (wrapping: 2^29 armings apart, two completers never meet).
            let armed = with_state(now.wrapping_add(1 << STATE_BITS), ARMED);
            match self
                .state
                .compare_exchange_weak(now, armed, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Ok(Completer {
                        cell: Some(self),
                        armed,
                    });
                }
                // A concurrent `close` (or a spurious failure): look again.
                Err(seen) => now = seen,
            }
        }
    }

    /// Arms the cell without a handle, for work whose finisher reaches the cell itself (an
    /// interrupt handler through a `static`) and fires it with [`fire`](Self::fire). There
    /// is then no completer whose drop could report lost work: [`close`](Self::close) at
    /// shutdown is what fails an instruction whose work never reports.
    ///
    /// # Errors
    /// As [`arm`](Self::arm).
    pub fn arm_detached(&self) -> Result<(), ArmError> {
        self.arm().map(|mut c| {
            // Detached: the completer's drop must not abandon the armed instruction.
            c.cell = None;
        })
    }

    /// Fires the armed instruction: done, succeeded if `ok`. The handle-free form, for
    /// code that reaches the cell itself (an interrupt handler through a `static`).
    ///
    /// # Errors
    /// See [`FireError`]: nothing armed, fired before, or closed. A refused fire changes
    /// nothing.
    pub fn fire(&self, ok: bool) -> Result<(), FireError> {
        let to = if ok { DONE } else { FAILED };
        // Relaxed: only the state is looked at; the compare-and-swap below publishes.
        let mut now = self.state.load(Ordering::Relaxed);
        loop {
            if state_of(now) != ARMED {
                return Err(refusal(now));
            }
            match self.finish(now, to) {
                Ok(()) => return Ok(()),
                Err(seen) => now = seen,
            }
        }
    }

    /// `armed` (the ARMED word of one arming) → the same epoch with state `to`, or the
    /// word found instead.
    fn finish(&self, armed: u32, to: u32) -> Result<(), u32> {
        // Release on success: publishes everything the work wrote before the fire to the
        // owner's Acquire in `state` (and so to the instructions ordered after this one).
        // Relaxed on failure: a refused fire reads the state only to name the refusal.
        self.state
            .compare_exchange(
                armed,
                with_state(armed, to),
                Ordering::Release,
                Ordering::Relaxed,
            )
            .map(|_| ())
    }

    /// Where the cell stands. An instruction waiting on it is done when
    /// `state().is_done()`.
    pub fn state(&self) -> CellState {
        // Acquire: pairs with the Release of the fire (or of the abandoning drop), so the
        // work's writes are visible once the instruction is seen done.
        CellState::of(self.state.load(Ordering::Acquire))
    }

    /// Makes a fired (or abandoned) cell idle again, for the next instruction, and returns
    /// how the last one ended. Call it after the engine released the instruction.
    ///
    /// # Errors
    /// The current state, unchanged, when there is nothing to reset: still armed (its
    /// instruction is not done), idle, or closed.
    pub fn reset(&self) -> Result<CellState, CellState> {
        // Acquire: as in `state`, for a caller that did not look before resetting.
        let now = self.state.load(Ordering::Acquire);
        if !matches!(state_of(now), DONE | FAILED | ABANDONED) {
            return Err(CellState::of(now));
        }
        // A compare-and-swap, not a store: a `close` racing the reset wins and stays.
        // Relaxed: completers stop at their fire, so only a close can change the word
        // now, and the owner reads nothing through it.
        match self.state.compare_exchange(
            now,
            with_state(now, IDLE),
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => Ok(CellState::of(now)),
            Err(seen) => Err(CellState::of(seen)),
        }
    }

    /// Shuts the cell: every later arm and fire is refused. Returns the state it had; an
    /// instruction armed then is done and failed from now on (it reads
    /// [`CellState::Closed`]), so the engine can release it instead of waiting forever.
    /// Stop the work first (the DMA channel, the foreign runtime): the engine then lets
    /// later instructions touch what that work may still be writing.
    pub fn close(&self) -> CellState {
        // Acquire: pairs with the Release of a fire that won the race, so the owner that
        // sees `Done` here sees the work's writes. Nothing is published to a refused
        // fire (it reads only the state), so no Release half.
        CellState::of(self.state.swap(CLOSED, Ordering::Acquire))
    }
}

/// The right to complete one armed instruction, exactly once (see the [module docs](self)).
/// Dropped unfired, it fails the instruction. It borrows its cell, so it cannot outlive
/// it; a `Completer<'static>` (of a `static` cell) can be handed to an interrupt handler.
#[must_use = "a completer dropped unfired fails its instruction"]
pub struct Completer<'a> {
    /// `None` once fired.
    cell: Option<&'a CompletionCell>,
    /// The word its arming wrote (ARMED, with that arming's epoch).
    armed: u32,
}

impl fmt::Debug for Completer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("cell", &self.cell)
            .finish()
    }
}

impl Completer<'_> {
    /// Completes the instruction: done, succeeded if `ok`.
    ///
    /// # Errors
    /// [`FireError::ShutDown`] when the cell was closed meanwhile, or
    /// [`FireError::AlreadyFired`] when someone fired the cell directly before.
    pub fn fire(mut self, ok: bool) -> Result<(), FireError> {
        let cell = self
            .cell
            .take()
            .expect("a completer fires once (it is consumed)");
        cell.finish(self.armed, if ok { DONE } else { FAILED })
            .map_err(|seen| {
                if state_of(seen) != CLOSED && seen & !STATE_MASK != self.armed & !STATE_MASK {
                    // Armed again since: this completer's instruction was completed before.
                    FireError::AlreadyFired
                } else {
                    refusal(seen)
                }
            })
    }
}

impl Drop for Completer<'_> {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            // Dropped unfired: the work will never report; fail the instruction so the
            // engine can release it. Refused (closed, fired through the cell, or armed
            // again since): the state already says done, or belongs to a later arming.
            let _ = cell.finish(self.armed, ABANDONED);
        }
    }
}

/// Why a fire that found `word` instead of an armed cell is refused.
fn refusal(word: u32) -> FireError {
    match state_of(word) {
        IDLE => FireError::NotArmed,
        CLOSED => FireError::ShutDown,
        _ => FireError::AlreadyFired,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_misuse_has_its_answer() {
        let cell = CompletionCell::new();
        assert_eq!(cell.fire(true), Err(FireError::NotArmed));
        assert_eq!(cell.reset(), Err(CellState::Idle));
        let c = cell.arm().unwrap();
        assert_eq!(cell.arm().err(), Some(ArmError::Busy));
        assert_eq!(cell.reset(), Err(CellState::Armed));
        assert!(!cell.state().is_done());
        c.fire(false).unwrap();
        assert_eq!(cell.state(), CellState::Failed);
        assert!(cell.state().is_done() && !cell.state().succeeded());
        assert_eq!(cell.fire(true), Err(FireError::AlreadyFired));
        assert_eq!(cell.arm().err(), Some(ArmError::Busy));
        assert_eq!(cell.reset(), Ok(CellState::Failed));

        // Fired through the cell: the completer's own fire is then refused, and its drop
        // changes nothing.
        let c = cell.arm().unwrap();
        cell.fire(true).unwrap();
        assert_eq!(c.fire(false), Err(FireError::AlreadyFired));
        assert_eq!(cell.reset(), Ok(CellState::Done));

        // Dropped unfired: done, failed; a late fire is refused.
        drop(cell.arm().unwrap());
        assert_eq!(cell.state(), CellState::Abandoned);
        assert_eq!(cell.fire(true), Err(FireError::AlreadyFired));
        assert_eq!(cell.reset(), Ok(CellState::Abandoned));

        // Closed while armed: done (failed); every later fire and arm is refused.
        let c = cell.arm().unwrap();
        assert_eq!(cell.close(), CellState::Armed);
        assert!(cell.state().is_done() && !cell.state().succeeded());
        assert_eq!(c.fire(true), Err(FireError::ShutDown));
        assert_eq!(cell.fire(true), Err(FireError::ShutDown));
        assert_eq!(cell.arm().err(), Some(ArmError::ShutDown));
        assert_eq!(cell.reset(), Err(CellState::Closed));
        assert_eq!(cell.close(), CellState::Closed);
    }

    /// A completer of an earlier arming never completes or abandons a later one, even
    /// after the cell was fired directly, reset and armed again.
    #[test]
    fn a_stale_completer_leaves_a_later_arming_alone() {
        let cell = CompletionCell::new();
        let stale = cell.arm().unwrap();
        let stale_too = {
            cell.fire(true).unwrap();
            assert_eq!(cell.reset(), Ok(CellState::Done));
            let c = cell.arm().unwrap();
            cell.fire(true).unwrap();
            cell.reset().unwrap();
            c
        };
        cell.arm_detached().unwrap();
        assert_eq!(stale.fire(false), Err(FireError::AlreadyFired));
        drop(stale_too);
        assert_eq!(cell.state(), CellState::Armed);
        cell.fire(true).unwrap();
        assert_eq!(cell.reset(), Ok(CellState::Done));
    }

    /// Many threads race to fire one armed cell: exactly one wins, the rest are told it
    /// was fired already; the winner's answer is the cell's.
    #[test]
    fn exactly_one_of_racing_fires_wins() {
        for round in 0..if cfg!(miri) { 5 } else { 50 } {
            let cell = &CompletionCell::new();
            let c = cell.arm().unwrap();
            let wins = std::thread::scope(|s| {
                let racers: std::vec::Vec<_> = (0..4)
                    .map(|i| s.spawn(move || cell.fire(i % 2 == 0)))
                    .collect();
                let mine = c.fire(round % 2 == 0);
                let mut results: std::vec::Vec<_> =
                    racers.into_iter().map(|h| h.join().unwrap()).collect();
                results.push(mine);
                assert!(
                    results
                        .iter()
                        .all(|r| matches!(r, Ok(()) | Err(FireError::AlreadyFired)))
                );
                results.iter().filter(|r| r.is_ok()).count()
            });
            assert_eq!(wins, 1);
            assert!(cell.state().is_done());
        }
    }
}
