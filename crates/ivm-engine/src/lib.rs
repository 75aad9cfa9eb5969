//! ivm-engine: the dependency engine of the ivm instruction virtual machine — `no_std`, no
//! `alloc` required.
//!
//! A front end submits *instructions*. Each names the [`Dependence`]s it reads and writes
//! and the stream it runs on. The engine decides the order and nothing else:
//!
//! 1. **handle** (a bounded window per [`step`](Engine::step)): per dependence, a write gets
//!    an edge from every access since the last write, a read an edge from the last write;
//!    a stream-sequential instruction also writes its stream's schedule dependence. An
//!    instruction without blocking in-edges is *ready*.
//! 2. **dispatch**: a ready instruction goes to its stream's running list and to the
//!    [`Executor`], which runs it (on the driving thread, a worker, a device queue, a DMA
//!    engine...). Its same-stream successors are *prescheduled*: an in-order stream runs
//!    them after it anyway, so they no longer wait for it.
//! 3. **release**, in order per stream: from the front of each running list, every
//!    instruction that [is done](Instruction::is_done) and has no in-edge left leaves the
//!    engine; its accesses are erased and its out-edges removed (readying successors).
//! 4. **barriers** consume no dependences; one runs when it is the oldest lively
//!    instruction.
//!
//! What a stream does with its instructions (done at launch or completed later by an
//! event, whether a same-stream edge is satisfied by dispatch order) is asked of its
//! [`StreamPolicy`], never decided by stream type.
//!
//! The engine is single-owner (`&mut self`): one thread drives it at a time. ivm-std's
//! engine token decides who that is on std; on a microcontroller it is the main loop, with
//! completions arriving from interrupts through ivm-core's lock-free queue. Storage is a
//! type parameter ([`pool`]): [`Fixed`] pools sized by const generics need no allocator,
//! and capacity exhausted is an error value ([`Full`], [`Stalled`]).
//!
//! # Features
//!
//! * `alloc`: [`Growable`] storage over `Vec`, for runtimes with an allocator (ivm-std
//!   uses it). Off by default: the crate needs no allocator.
//! * `check`: the [`check`] module — random programs run on the engine and checked
//!   against a sequential interpreter (the fuzz target's and the tests' oracle). Implies
//!   `alloc`.
//! * `planted-bugs`: `PlantedBug` and [`Engine::plant`], ordering bugs planted on
//!   purpose so that tests can show a checker catches them. Never in production.
//!
//! # Examples
//!
//! A chain `a := 1; b := a + 1` over one stream, run to completion with
//! [`run_until_idle`]:
//!
//! ```
//! use core::cell::Cell;
//! use ivm_engine::{AccessMode, Dependence, Dispatched, DispatchCtx, Engine, Executor,
//!                  Fixed, Instruction, StreamPolicy, run_until_idle};
//!
//! struct Cpu;
//! impl StreamPolicy for Cpu {}
//!
//! /// An instruction: `dst := f(src)`, done when it ran.
//! struct Job<'a> {
//!     src: Option<(&'a Dependence, &'a Cell<u32>)>,
//!     dst: (&'a Dependence, &'a Cell<u32>),
//!     f: fn(u32) -> u32,
//!     done: Cell<bool>,
//! }
//! // SAFETY: the dependences outlive the engine (they are declared before it) and are used
//! // by this engine only; `for_each_access` always names the same ones.
//! unsafe impl Instruction for Job<'_> {
//!     type Policy = Cpu;
//!     fn stream(&self) -> u32 { 0 }
//!     fn policy(&self) -> &Cpu { &Cpu }
//!     fn for_each_access(&self, f: &mut dyn FnMut(&Dependence, AccessMode)) {
//!         f(self.dst.0, AccessMode::Write);
//!         if let Some((d, _)) = self.src { f(d, AccessMode::Read) }
//!     }
//!     fn is_done(&self) -> bool { self.done.get() }
//! }
//!
//! /// Runs every dispatched job at once, on the driving thread.
//! struct Inline;
//! impl<'a> Executor<Job<'a>> for Inline {
//!     fn dispatch(&mut self, job: &Job<'a>, _: &DispatchCtx<'_, Job<'a>>) -> Dispatched {
//!         let x = job.src.map_or(0, |(_, v)| v.get());
//!         job.dst.1.set((job.f)(x));
//!         job.done.set(true);
//!         Dispatched::Handed
//!     }
//!     fn run_barrier(&mut self, _: &Job<'a>) -> bool { true }
//!     fn released(&mut self, _: Job<'a>) {}
//! }
//!
//! let (a, b) = (Dependence::new(), Dependence::new());
//! let (va, vb) = (Cell::new(0), Cell::new(0));
//! let mut engine: Engine<Job<'_>, Fixed<4, 8, 8, 1>> = Engine::new();
//! engine.submit(Job { src: None, dst: (&a, &va), f: |_| 1, done: Cell::new(false) }).ok().unwrap();
//! engine.submit(Job { src: Some((&a, &va)), dst: (&b, &vb), f: |x| x + 1, done: Cell::new(false) }).ok().unwrap();
//! run_until_idle(&mut engine, &mut Inline, || unreachable!("nothing waits")).unwrap();
//! assert_eq!(vb.get(), 2);
//! ```
#![no_std]
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(any(feature = "alloc", test))]
extern crate alloc;
#[cfg(test)]
extern crate std;

#[cfg(any(feature = "check", test))]
#[cfg_attr(docsrs, doc(cfg(feature = "check")))]
pub mod check;
pub mod completer;
mod dependence;
mod engine;
pub mod pool;

pub use completer::{ArmError, CellState, Completer, CompletionCell, FireError};
pub use dependence::{AccessMode, Dependence};
#[cfg(feature = "planted-bugs")]
#[cfg_attr(docsrs, doc(cfg(feature = "planted-bugs")))]
pub use engine::PlantedBug;
pub use engine::{DispatchCtx, Engine, Lively, NodeState, OutEdge, Progress};
#[cfg(feature = "alloc")]
#[cfg_attr(docsrs, doc(cfg(feature = "alloc")))]
pub use pool::Growable;
pub use pool::{Fixed, Slots, Storage};

/// What the engine asks of a stream. Every method has the answer of a plain in-order
/// stream whose instructions are done once they ran.
pub trait StreamPolicy {
    /// How an instruction of this stream completes. The engine itself only asks
    /// [`Instruction::is_done`]; this says to executors (and readers) what makes it true.
    fn completion(&self) -> Completion {
        Completion::AtLaunch
    }

    /// Whether an edge between two instructions of this stream must wait for its source's
    /// **release**. `false` (an in-order stream): the stream runs instructions in dispatch
    /// order, so an edge from a dispatched same-stream source is satisfied at once
    /// (prescheduling), and none is made at all from an already dispatched source. `true`:
    /// instructions of the stream act on their data outside dispatch order (ivm's
    /// critical sections, whose tensors the graph runtime touches between a begin and its
    /// end), so data edges between them are kept until the source is released. Edges
    /// through the stream's schedule dependence are never strict.
    fn strict_same_stream_edges(&self) -> bool {
        false
    }

    /// Whether an instruction of this stream may run on a thread other than the stream's
    /// own — the driving thread or a waiting caller — when the engine finds it alone and
    /// with every source released ([`DispatchCtx::sole_access`]). True for synchronous
    /// streams (the host CPU), false where the stream's work must be issued by its own
    /// thread or queue (an asynchronous device, a DMA channel).
    fn may_run_on_caller(&self) -> bool {
        false
    }

    /// Whether consecutive instructions of this stream may be dispatched as one fused run
    /// ([`Engine::set_max_run`], [`DispatchCtx::run_continues`]): the executor then hands
    /// the run over as one unit, run back to back in stream order. Default: only where an
    /// instruction is done once it ran and same-stream edges are satisfied by dispatch
    /// order — a stream whose instructions complete later, or act outside dispatch order,
    /// has each one's completion to wait for, which a run would serialise behind its
    /// first member.
    fn may_fuse(&self) -> bool {
        self.completion() == Completion::AtLaunch && !self.strict_same_stream_edges()
    }
}

/// How an instruction completes (see [`StreamPolicy::completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Done once its body returned (an in-order queue orders the rest).
    AtLaunch,
    /// Done later, when an event fires (a device event, an interrupt, a foreign runtime):
    /// [`Instruction::is_done`] turns true from another thread or an interrupt handler —
    /// for instance through a [`CompletionCell`] that whoever finishes the work fires once.
    Later,
}

/// An instruction as the engine sees it. The engine stores one `I` per received
/// instruction and hands it back to the [`Executor`] at release.
///
/// # Safety
///
/// The engine keeps pointers to the [`Dependence`]s that `for_each_access` names, and uses
/// them until it releases the instruction (or is dropped). Implementing this trait
/// promises that:
///
/// * every dependence named by `for_each_access` stays alive and does not move from the
///   moment the instruction is [submitted](Engine::submit) until the engine released it
///   (handed it to [`Executor::released`]) or was dropped — so it never lives inside the
///   instruction value itself, which the engine moves;
/// * a dependence is named only by instructions of one engine (its access list lives in
///   that engine's pool);
/// * `stream` and `policy` always give the same answer for one instruction, and
///   instructions with the same `stream` have equivalent policies.
pub unsafe trait Instruction {
    /// The policy type of its stream.
    type Policy: StreamPolicy + ?Sized;

    /// The stream's index: dense, small (it indexes the engine's stream pool).
    fn stream(&self) -> u32;

    /// The stream's policy (asked when the engine first meets the stream).
    fn policy(&self) -> &Self::Policy;

    /// A barrier: consumes no dependences, runs when it is the oldest lively instruction
    /// ([`Executor::run_barrier`]), orders only the instructions received before it.
    fn is_barrier(&self) -> bool {
        false
    }

    /// Writes its stream's schedule dependence: it comes after every earlier
    /// stream-sequential instruction of the stream (and those after it).
    fn stream_sequential(&self) -> bool {
        false
    }

    /// Never prescheduled, in either direction: a same-stream edge from or to this
    /// instruction is satisfied by its source's release, not by the source's dispatch, as
    /// on a stream whose policy has [`StreamPolicy::strict_same_stream_edges`]. For an
    /// instruction on an otherwise in-order stream that completes later than its stream
    /// moves on (an I/O request, a foreign runtime's event), whose same-stream readers
    /// must not start before it is done. Default `false`: the stream policy decides.
    fn strict_edges(&self) -> bool {
        false
    }

    /// Calls `f` once per operand, writes and reads in any order. Called once, when the
    /// engine handles the instruction (and once before, to count them).
    fn for_each_access(&self, f: &mut dyn FnMut(&Dependence, AccessMode));

    /// Whether the instruction has finished: its effects are visible to whoever runs
    /// next (an `Acquire` read where another thread or an interrupt completes it).
    fn is_done(&self) -> bool;

    /// The engine holds something back until this dispatched instruction is released: a
    /// successor on another stream or behind a strict edge, or a barrier (told to every
    /// running instruction when a barrier arrives, and at dispatch while any barrier is
    /// pending: an over-approximation). Whoever finishes it should then have it released
    /// promptly rather than leave the release to whichever thread steps the engine next
    /// (ivm-std's workers leave it when nothing is held back). Called by the engine's owner, only between the
    /// instruction's dispatch and its release, possibly more than once; an instruction
    /// never told may still be awaited by work received later (whose receiver steps the
    /// engine). Default: nothing.
    fn awaited(&self) {}

    /// Whether this instruction may be a member of a fused run (see
    /// [`StreamPolicy::may_fuse`]); `false` keeps it a run of its own, and ends the run
    /// before it. Default `true`: the stream's policy and the engine's run length
    /// ([`Engine::set_max_run`], off by default) decide.
    fn fusable(&self) -> bool {
        true
    }
}

/// What an [`Executor`] did with a dispatched instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatched {
    /// It runs (or ran) in stream order: on the driving thread, a worker, a device queue.
    Handed,
    /// It runs outside stream order — handed to a waiting caller who runs it after leaving
    /// the engine — so later instructions of its stream are held back until its release.
    Claimed,
}

/// The engine's hooks into whatever runs instructions.
pub trait Executor<I> {
    /// `instr` was just dispatched: run it, or hand it to whoever runs its stream. `ctx`
    /// says what the engine knows about it (sources released, alone on its stream, the
    /// other running instructions of its stream, its place in a fused run: where
    /// [`DispatchCtx::run_continues`], the next call dispatches the run's next member,
    /// unless this one is claimed, which ends the run).
    fn dispatch(&mut self, instr: &I, ctx: &DispatchCtx<'_, I>) -> Dispatched;

    /// The barrier `instr` is the oldest lively instruction: run it now and return `true`
    /// (the engine then releases it), or return `false` to leave it (and every barrier
    /// after it) for a later step.
    fn run_barrier(&mut self, instr: &I) -> bool;

    /// The engine is done with `instr`: its accesses are erased and its successors no
    /// longer wait for it.
    fn released(&mut self, instr: I);
}

/// [`Engine::submit`] refused an instruction: a pool is full, or its stream index is past
/// the stream pool's capacity. The instruction comes back.
pub struct Full<I>(pub I);

impl<I> core::fmt::Debug for Full<I> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Full(..)")
    }
}

impl<I> core::fmt::Display for Full<I> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("ivm-engine: instruction pool or stream pool full")
    }
}

/// [`Engine::step`] cannot go on: the oldest received instruction needs more accesses or
/// edges than the pools can ever give while nothing is lively to be released. Raise the
/// pools' capacity ([`Fixed`]'s parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stalled {
    /// Accesses the instruction needs.
    pub accesses: usize,
    /// Edges it may need.
    pub edges: usize,
}

impl core::fmt::Display for Stalled {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "ivm-engine: an instruction needs {} accesses and up to {} edges, more than the pools hold",
            self.accesses, self.edges
        )
    }
}

/// Drives `engine` until it is idle: steps while they make progress and calls `wait` when
/// a step made none (an instruction is running elsewhere: a DMA transfer, a device queue)
/// — on a microcontroller `wait` sleeps until the next interrupt (`WFE`).
///
/// A single-thread executor loop: everything runs on the calling thread except what the
/// executor hands elsewhere.
///
/// # Errors
/// [`Stalled`] when a received instruction can never fit the pools.
pub fn run_until_idle<I: Instruction, S: Storage<I>, X: Executor<I>>(
    engine: &mut Engine<I, S>,
    executor: &mut X,
    mut wait: impl FnMut(),
) -> Result<(), Stalled> {
    loop {
        let p = engine.step(executor)?;
        if engine.is_idle() {
            return Ok(());
        }
        if !p.any() {
            wait();
        }
    }
}
