//! The ivm dependency engine on a microcontroller (a Cortex-M4; QEMU's `mps2-an386` board).
//!
//! What it shows:
//!
//! * **ivm-engine without an allocator**: an `Engine` over [`Fixed`] pools, a local of
//!   `main`. Its instruction pool holds fewer instructions than the program has, so the
//!   front end meets [`Full`] and drives the engine until releases make room.
//! * **Two streams with different completions**: a *compute* stream whose instructions are
//!   done when the executor has run them in `dispatch` ([`Completion::AtLaunch`]), and a
//!   *DMA* stream whose instructions complete later ([`Completion::Later`]): `dispatch`
//!   only starts a transfer, and a simulated DMA channel in the SysTick interrupt handler
//!   performs it a tick later. Both streams work on the same buffers; the engine orders
//!   every read-after-write, write-after-read and write-after-write between them, and a
//!   DMA transfer that reads what the previous transfer wrote is started before that one
//!   finished (the channel is in order, so the engine preschedules it).
//! * **ivm-core's lock-free MPSC queue from thread mode to an interrupt**, with intrusive
//!   nodes in `static`s: the main loop pushes transfer requests that the handler pops
//!   (when the handler preempts a push half done it sees `Pop::Inconsistent` and retries
//!   at the next tick instead of spinning).
//! * **Completion from the interrupt with ivm-engine's [`CompletionCell`]**: the executor
//!   arms the transfer's cell at dispatch, the handler fires it after the copy (one
//!   compare-and-swap, Release), and the instruction is done when the main loop sees the
//!   cell fired (Acquire) — so the engine orders every later reader after the copy. The
//!   executor resets the cell when the engine releases the instruction, and the slot is
//!   reused then (the handler popped it from the request queue before firing).
//! * **Sleeping instead of spinning**: when a step makes no progress, the main loop sleeps
//!   in `WFE` through ivm-core's [`WfeWait`] until the handler has fired a completion,
//!   with a deadline on a clock the SysTick handler advances (a missing completion fails
//!   the run instead of hanging it).
//!
//! At the end the buffers are compared with a sequential run of the same program on plain
//! arrays; the report goes out through semihosting and QEMU exits with status 0 only when
//! everything matches (1 otherwise, and on a panic or a hard fault).
//!
//! Run it with `cargo run --release` in this directory (`.cargo/config.toml` names the
//! target and QEMU as the runner). The engine's rules are in ivm-engine's crate docs and
//! in ARCHITECTURE.md ("ivm-engine: the dependency engine").
#![no_std]
#![no_main]

use core::cell::Cell;
use core::panic::PanicInfo;
use core::ptr::NonNull;
use core::sync::atomic::AtomicU32;
use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use core::time::Duration;

use cortex_m::peripheral::syst::SystClkSource;
use cortex_m_rt::{ExceptionFrame, entry, exception};
use cortex_m_semihosting::{debug, hprintln};
use ivm_core::mpsc::{self, MpscQueue, Pop};
use ivm_core::wait::{Clock, Instant, Wait, WaitResult, WfeWait};
use ivm_engine::{
    AccessMode, CellState, Completion, CompletionCell, Dependence, DispatchCtx, Dispatched,
    Engine, Executor, Fixed, Full, Instruction, StreamPolicy, run_until_idle,
};

// ---- the board ------------------------------------------------------------------------

/// SysTick period in core cycles: 1 ms at the mps2-an386's 25 MHz core clock.
const TICK_CYCLES: u32 = 25_000;
/// SysTick period in nanoseconds.
const TICK_NANOS: u64 = 1_000_000;

/// SysTick interrupts taken (the clock of [`Ticks`]).
static TICKS: AtomicU32 = AtomicU32::new(0);

/// The clock [`WfeWait`] measures deadlines on: SysTick interrupts taken, in nanoseconds.
struct Ticks;

impl Clock for Ticks {
    fn now() -> Instant {
        Instant::from_nanos(u64::from(TICKS.load(Relaxed)) * TICK_NANOS)
    }
}

/// The main loop's wait backend: `WFE`, woken by the SysTick handler.
type Sleep = WfeWait<Ticks>;

// ---- the data -------------------------------------------------------------------------

/// Words per buffer.
const WORDS: usize = 8;
/// Buffers.
const BUFFERS: usize = 6;
const IN0: usize = 0;
const IN1: usize = 1;
const WORK0: usize = 2;
const WORK1: usize = 3;
const OUT: usize = 4;
const ACC: usize = 5;

/// The buffers. Atomics (relaxed) because thread mode and the SysTick handler both touch
/// them; the engine's order, published through the request queue's and the completion
/// cells' release/acquire, decides who touches which buffer when.
static DATA: [[AtomicU32; WORDS]; BUFFERS] =
    [const { [const { AtomicU32::new(0) }; WORDS] }; BUFFERS];

/// One dependence per buffer: its scheduling identity for the engine.
static DEPS: [Dependence; BUFFERS] = [const { Dependence::new() }; BUFFERS];

/// What an instruction does, element-wise over `WORDS` words (wrapping arithmetic).
#[derive(Debug, Clone, Copy)]
enum Op {
    /// `dst[i] := base + step * i` (compute stream).
    Fill { dst: usize, base: u32, step: u32 },
    /// `buf[i] *= k`, in place (compute stream).
    Scale { buf: usize, k: u32 },
    /// `dst[i] := a[i] + b[i]` (compute stream).
    Add { a: usize, b: usize, dst: usize },
    /// `dst := src`, by the DMA channel (DMA stream: done when the handler has copied).
    Dma { src: usize, dst: usize },
}

const fn fill(dst: usize, base: u32, step: u32) -> Op {
    Op::Fill { dst, base, step }
}
const fn scale(buf: usize, k: u32) -> Op {
    Op::Scale { buf, k }
}
const fn add(a: usize, b: usize, dst: usize) -> Op {
    Op::Add { a, b, dst }
}
const fn dma(src: usize, dst: usize) -> Op {
    Op::Dma { src, dst }
}

/// The program the front end submits, in this order. The comments name the edges the
/// engine must respect across the two streams (C: compute, D: DMA).
#[rustfmt::skip]
const PROGRAM: [Op; 18] = [
    fill(IN0, 1, 3),        //  0 C
    fill(IN1, 2, 5),        //  1 C
    dma(IN0, WORK0),        //  2 D  after 0
    dma(IN1, WORK1),        //  3 D  after 1
    scale(WORK0, 2),        //  4 C  after 2's copy landed
    add(WORK0, WORK1, OUT), //  5 C  after 4 and 3
    dma(OUT, ACC),          //  6 D  after 5
    fill(IN0, 100, 7),      //  7 C  not before 2 has read IN0
    dma(IN0, WORK0),        //  8 D  after 7; WORK0 not before 5 read it
    add(ACC, WORK0, OUT),   //  9 C  after 6 and 8; OUT not before 6 read it
    scale(IN1, 3),          // 10 C  not before 3 has read IN1
    dma(IN1, WORK1),        // 11 D  after 10; WORK1 not before 5 read it
    add(OUT, WORK1, ACC),   // 12 C  after 9 and 11
    dma(ACC, OUT),          // 13 D  after 12
    scale(OUT, 5),          // 14 C  after 13
    add(OUT, IN0, WORK1),   // 15 C  after 14
    dma(WORK1, ACC),        // 16 D  after 15; ACC not before 13 read it
    dma(ACC, IN1),          // 17 D  reads what 16 writes: the in-order stream preschedules it
];

/// Word storage an [`Op`] runs on: the shared buffers, or plain arrays for the reference.
trait Memory {
    fn get(&self, buf: usize, i: usize) -> u32;
    fn set(&mut self, buf: usize, i: usize, value: u32);
}

/// The shared buffers, [`DATA`].
struct Shared;

impl Memory for Shared {
    fn get(&self, buf: usize, i: usize) -> u32 {
        DATA[buf][i].load(Relaxed)
    }
    fn set(&mut self, buf: usize, i: usize, value: u32) {
        DATA[buf][i].store(value, Relaxed);
    }
}

/// Plain arrays: the sequential reference.
impl Memory for [[u32; WORDS]; BUFFERS] {
    fn get(&self, buf: usize, i: usize) -> u32 {
        self[buf][i]
    }
    fn set(&mut self, buf: usize, i: usize, value: u32) {
        self[buf][i] = value;
    }
}

/// Runs `op` on `mem` at once (a DMA transfer too: the reference copies directly).
fn apply(op: Op, mem: &mut impl Memory) {
    for i in 0..WORDS {
        match op {
            Op::Fill { dst, base, step } => {
                let index = u32::try_from(i).unwrap_or(u32::MAX);
                mem.set(dst, i, base.wrapping_add(step.wrapping_mul(index)));
            }
            Op::Scale { buf, k } => mem.set(buf, i, mem.get(buf, i).wrapping_mul(k)),
            Op::Add { a, b, dst } => mem.set(dst, i, mem.get(a, i).wrapping_add(mem.get(b, i))),
            Op::Dma { src, dst } => mem.set(dst, i, mem.get(src, i)),
        }
    }
}

// ---- the DMA channel: transfer slots, the request queue, completion cells ------------

/// A DMA transfer descriptor. It sits in [`REQUESTS`] from its dispatch until the handler
/// takes it; the handler then copies and fires its cell; the main loop reuses it once the
/// engine released its instruction.
struct DmaSlot {
    /// Hook of the request queue (thread mode → handler).
    request: mpsc::Links<DmaSlot>,
    src: AtomicU32,
    dst: AtomicU32,
    /// Transfer number, in dispatch order: completions must come back in this order.
    seq: AtomicU32,
    /// Armed at dispatch, fired by the handler, reset at release; read by `is_done`.
    done: CompletionCell,
}

impl DmaSlot {
    const fn new() -> Self {
        Self {
            request: mpsc::Links::new(),
            src: AtomicU32::new(0),
            dst: AtomicU32::new(0),
            seq: AtomicU32::new(0),
            done: CompletionCell::new(),
        }
    }
}

/// Tag of the request hook.
enum Request {}

// SAFETY: slots live in a `static` (never move, never freed), so a `&'static` handle turned
// into a pointer and back is the same handle; `links` projects the request hook without
// creating a reference.
unsafe impl mpsc::Linked<Request> for DmaSlot {
    type Handle = &'static DmaSlot;
    fn into_ptr(slot: &'static DmaSlot) -> NonNull<DmaSlot> {
        NonNull::from(slot)
    }
    unsafe fn from_ptr(ptr: NonNull<DmaSlot>) -> &'static DmaSlot {
        // SAFETY: `ptr` came from `into_ptr` of a `&'static DmaSlot`.
        unsafe { ptr.as_ref() }
    }
    unsafe fn links(ptr: NonNull<DmaSlot>) -> NonNull<mpsc::Links<DmaSlot>> {
        // SAFETY: `ptr` points to a live `DmaSlot`, so the field address is non-null.
        unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).request) }
    }
}

/// Transfer slots: as many as the engine holds instructions, so a dispatch always finds
/// one (a slot is taken at dispatch and given back at release).
const SLOTS: usize = 8;
static SLOT: [DmaSlot; SLOTS] = [const { DmaSlot::new() }; SLOTS];

/// Started transfers, oldest first: the DMA channel's queue (consumer: the handler).
static REQUESTS: MpscQueue<DmaSlot, Request> = MpscQueue::new();
/// Completions fired by the handler: the word the main loop sleeps on.
static EVENTS: AtomicU32 = AtomicU32::new(0);
/// The transfer number the handler's next completion must carry.
static NEXT_DONE: AtomicU32 = AtomicU32::new(0);
/// Completions the handler fired out of dispatch order, or that its cell refused.
static BAD_FIRES: AtomicU32 = AtomicU32::new(0);
/// Ticks on which the handler found a request push half done (it retried a tick later).
static HALF_PUSHES: AtomicU32 = AtomicU32::new(0);

/// The SysTick handler: the clock tick, and a DMA channel that performs one transfer per
/// tick, oldest request first.
#[exception]
fn SysTick() {
    TICKS.fetch_add(1, Relaxed);
    // Only this handler consumes the request queue, so the consumer role is always free.
    let Some(mut channel) = REQUESTS.try_consume() else {
        return;
    };
    match channel.try_pop() {
        Pop::Item(slot) => {
            // The pop (Acquire) sees what the main loop wrote before its push: the
            // descriptor and the source buffer.
            let src = slot.src.load(Relaxed) as usize;
            let dst = slot.dst.load(Relaxed) as usize;
            for (to, from) in DATA[dst].iter().zip(&DATA[src]) {
                to.store(from.load(Relaxed), Relaxed);
            }
            // Only this handler touches NEXT_DONE: Relaxed.
            let seq = NEXT_DONE.fetch_add(1, Relaxed);
            // The fire (Release) publishes the copy to the main loop's `is_done` (Acquire).
            if slot.seq.load(Relaxed) != seq || slot.done.fire(true).is_err() {
                BAD_FIRES.fetch_add(1, Relaxed);
            }
            // Changed before the wake, as the wait protocol asks. The return from this
            // handler wakes a `WFE` too; the SEV makes the wake explicit.
            EVENTS.fetch_add(1, Release);
            Sleep::wake_one(&EVENTS);
        }
        Pop::Empty => {}
        // This handler preempted the main loop between the two stores of a push: the node
        // is on its way, but the main loop cannot finish the push while we run. Never
        // spin here; take it at the next tick.
        Pop::Inconsistent => {
            HALF_PUSHES.fetch_add(1, Relaxed);
        }
    }
}

// ---- the instructions and the executor ------------------------------------------------

/// What the engine asks of a stream.
struct Stream {
    completion: Completion,
}

impl StreamPolicy for Stream {
    fn completion(&self) -> Completion {
        self.completion
    }
}

const COMPUTE_STREAM: u32 = 0;
const DMA_STREAM: u32 = 1;
static COMPUTE: Stream = Stream {
    completion: Completion::AtLaunch,
};
static DMA: Stream = Stream {
    completion: Completion::Later,
};

/// An instruction: an [`Op`] and its completion state.
struct Instr {
    op: Op,
    /// Compute: set when the executor ran it.
    ran: Cell<bool>,
    /// DMA: its transfer slot, from dispatch to release.
    slot: Cell<Option<usize>>,
}

impl Instr {
    fn new(op: Op) -> Self {
        Self {
            op,
            ran: Cell::new(false),
            slot: Cell::new(None),
        }
    }
}

// SAFETY: every dependence named is one of the `static` `DEPS` (alive and in place for the
// whole run), only the one engine of `main` uses them, and `stream`/`policy` depend on the
// op alone.
unsafe impl Instruction for Instr {
    type Policy = Stream;

    fn stream(&self) -> u32 {
        match self.op {
            Op::Dma { .. } => DMA_STREAM,
            _ => COMPUTE_STREAM,
        }
    }

    fn policy(&self) -> &Stream {
        match self.op {
            Op::Dma { .. } => &DMA,
            _ => &COMPUTE,
        }
    }

    fn for_each_access(&self, f: &mut dyn FnMut(&Dependence, AccessMode)) {
        match self.op {
            Op::Fill { dst, .. } => f(&DEPS[dst], AccessMode::Write),
            // In place: a write (it waits for every access since the last write, so it is
            // ordered after the last write too).
            Op::Scale { buf, .. } => f(&DEPS[buf], AccessMode::Write),
            Op::Add { a, b, dst } => {
                f(&DEPS[dst], AccessMode::Write);
                f(&DEPS[a], AccessMode::Read);
                f(&DEPS[b], AccessMode::Read);
            }
            Op::Dma { src, dst } => {
                f(&DEPS[dst], AccessMode::Write);
                f(&DEPS[src], AccessMode::Read);
            }
        }
    }

    fn is_done(&self) -> bool {
        match self.slot.get() {
            // Fired by the handler (Acquire inside `state`: the copy is visible).
            Some(s) => SLOT[s].done.state().is_done(),
            None => self.ran.get(),
        }
    }
}

/// Runs compute instructions at dispatch; starts DMA transfers.
struct Mcu {
    /// Free transfer slots, one bit each.
    free: u32,
    next_seq: u32,
    computed: u32,
    transfers: u32,
    released: u32,
    /// Transfers released as fired successfully.
    completions: u32,
}

impl Executor<Instr> for Mcu {
    fn dispatch(&mut self, instr: &Instr, _ctx: &DispatchCtx<'_, Instr>) -> Dispatched {
        match instr.op {
            Op::Dma { src, dst } => {
                let s = self.free.trailing_zeros() as usize;
                assert!(
                    s < SLOTS,
                    "more DMA transfers in flight than the engine holds"
                );
                self.free &= !(1 << s);
                let slot = &SLOT[s];
                slot.src.store(src as u32, Relaxed);
                slot.dst.store(dst as u32, Relaxed);
                slot.seq.store(self.next_seq, Relaxed);
                // The handler fires it through the `static` slot: no completer handle.
                slot.done
                    .arm_detached()
                    .expect("a slot is reset at its release, before its reuse");
                self.next_seq += 1;
                self.transfers += 1;
                instr.slot.set(Some(s));
                // The push (Release) publishes the descriptor and the source data.
                REQUESTS.push(slot);
            }
            op => {
                apply(op, &mut Shared);
                instr.ran.set(true);
                self.computed += 1;
            }
        }
        Dispatched::Handed
    }

    fn run_barrier(&mut self, _instr: &Instr) -> bool {
        true
    }

    fn released(&mut self, instr: Instr) {
        self.released += 1;
        if let Some(s) = instr.slot.get() {
            match SLOT[s].done.reset() {
                Ok(CellState::Done) => self.completions += 1,
                other => panic!("transfer slot {s} released as {other:?}"),
            }
            self.free |= 1 << s;
        }
    }
}

// ---- the main loop --------------------------------------------------------------------

/// The main loop's sleep.
struct Waiter {
    /// [`EVENTS`] as read at the end of the last wait: a completion fired since then has
    /// changed it.
    seen: u32,
    sleeps: u32,
}

impl Waiter {
    /// A step made no progress: everything runnable ran, the rest waits for transfers.
    /// Sleeps until the handler fires a completion; not at all if it fired one since the
    /// last wait (the steps since may have run before that fire).
    fn wait(&mut self) {
        // Acquire: pairs with the handler's Release increment, which follows its fire, so
        // the steps after this wait see every cell fired before the value read here.
        if EVENTS.load(Acquire) == self.seen {
            self.sleeps += 1;
            let deadline = Ticks::now().saturating_add(Duration::from_secs(1));
            let woke = Sleep::wait(&EVENTS, self.seen, Some(deadline));
            assert_eq!(woke, WaitResult::Woken, "no DMA completion for 1 s");
        }
        self.seen = EVENTS.load(Acquire);
    }
}

/// The engine: at most `SLOTS` instructions received and not released, two streams.
type McuEngine = Engine<Instr, Fixed<SLOTS, 32, 64, 2>>;

#[entry]
fn main() -> ! {
    let mut core = cortex_m::Peripherals::take().expect("taken once");
    core.SYST.set_clock_source(SystClkSource::Core);
    core.SYST.set_reload(TICK_CYCLES - 1);
    core.SYST.clear_current();
    core.SYST.enable_counter();
    core.SYST.enable_interrupt();

    let mut engine = McuEngine::new();
    let mut mcu = Mcu {
        free: (1 << SLOTS) - 1,
        next_seq: 0,
        computed: 0,
        transfers: 0,
        released: 0,
        completions: 0,
    };
    let mut waiter = Waiter {
        seen: EVENTS.load(Acquire),
        sleeps: 0,
    };

    // The front end: submit the program; when the pools are full, drive the engine until
    // releases make room.
    let mut full = 0u32;
    for op in PROGRAM {
        let mut instr = Instr::new(op);
        while let Err(Full(back)) = engine.submit(instr) {
            instr = back;
            full += 1;
            let progress = engine
                .step(&mut mcu)
                .expect("the pools fit every instruction");
            if !progress.any() {
                waiter.wait();
            }
        }
    }
    run_until_idle(&mut engine, &mut mcu, || waiter.wait())
        .expect("the pools fit every instruction");

    core.SYST.disable_interrupt();
    core.SYST.disable_counter();

    // The sequential reference: the same program on plain arrays, one op after the other.
    let mut expected = [[0u32; WORDS]; BUFFERS];
    for op in PROGRAM {
        apply(op, &mut expected);
    }
    let mismatches = (0..BUFFERS)
        .flat_map(|b| (0..WORDS).map(move |i| (b, i)))
        .filter(|&(b, i)| Shared.get(b, i) != expected[b][i])
        .count();
    let checksum = (0..WORDS).fold(0u32, |sum, i| sum.wrapping_add(Shared.get(OUT, i)));
    let dma_ops = PROGRAM
        .iter()
        .filter(|op| matches!(op, Op::Dma { .. }))
        .count();
    let ok = mismatches == 0
        && engine.is_idle()
        && mcu.released as usize == PROGRAM.len()
        && mcu.computed as usize + dma_ops == PROGRAM.len()
        && mcu.transfers as usize == dma_ops
        && mcu.completions == mcu.transfers
        && EVENTS.load(Relaxed) == mcu.transfers
        && BAD_FIRES.load(Relaxed) == 0
        && REQUESTS.is_empty()
        && SLOT.iter().all(|s| s.done.state() == CellState::Idle);

    hprintln!("ivm-engine on a Cortex-M4 (QEMU mps2-an386)");
    hprintln!(
        "  instructions: {} submitted, {} released: {} compute (run at dispatch), {} DMA",
        PROGRAM.len(),
        mcu.released,
        mcu.computed,
        mcu.transfers
    );
    hprintln!(
        "  DMA completions fired by the handler through CompletionCells: {} ({})",
        mcu.completions,
        if BAD_FIRES.load(Relaxed) != 0 {
            "OUT OF ORDER OR REFUSED"
        } else {
            "in order"
        }
    );
    hprintln!(
        "  interrupts: {} SysTick; WFE sleeps: {}; submits refused (pools full): {}; request pushes found half done: {}",
        TICKS.load(Relaxed),
        waiter.sleeps,
        full,
        HALF_PUSHES.load(Relaxed)
    );
    hprintln!(
        "  OUT checksum {:#010x}; buffers vs sequential reference: {} of {} words differ",
        checksum,
        mismatches,
        BUFFERS * WORDS
    );
    if ok {
        hprintln!("ok");
        debug::exit(debug::EXIT_SUCCESS);
    } else {
        hprintln!("FAILED");
        debug::exit(debug::EXIT_FAILURE);
    }
    loop {
        cortex_m::asm::wfe();
    }
}

/// Reports the panic and makes QEMU exit with a failure status.
#[panic_handler]
fn panic(info: &PanicInfo) -> ! {
    hprintln!("{}", info);
    debug::exit(debug::EXIT_FAILURE);
    loop {
        cortex_m::asm::wfe();
    }
}

/// Reports a hard fault and makes QEMU exit with a failure status.
///
/// # Safety
///
/// Called by the hardware only (cortex-m-rt's signature for this handler).
#[exception]
unsafe fn HardFault(frame: &ExceptionFrame) -> ! {
    hprintln!("hard fault: {:?}", frame);
    debug::exit(debug::EXIT_FAILURE);
    loop {
        cortex_m::asm::wfe();
    }
}
