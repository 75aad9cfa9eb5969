//! Equivalence checking (feature `check`): random programs run through the engine, with
//! an executor that completes instructions in a random but legal order, must leave every
//! datum exactly as a sequential interpreter does. The engine's fuzz target
//! (`fuzz/fuzz_targets/engine_program.rs`) and its tests use it; with the feature
//! `planted-bugs` it shows that a broken engine is caught.
//!
//! A program is decoded from bytes (so libFuzzer's inputs and a seeded generator give the
//! same kind of program): up to 8 data words, 4 streams — two in-order, one strict (whose
//! instructions may act in any order, like ivm's critical sections), one whose
//! instructions complete later — and kernels `w ← mix(w, id, reads)` that do not commute,
//! plus barriers. The executor runs a random stream's next instruction (any of them on
//! the strict stream), completes "later" instructions some ticks after they ran, and
//! sometimes lets a waiting "caller" run an instruction the engine allows
//! ([`DispatchCtx::sole_access`](crate::DispatchCtx::sole_access)), claimed out of
//! stream order.
//!
//! It also checks the engine's promises directly: a barrier runs only when everything
//! before it was released; nothing is released before it is done; each stream releases
//! in dispatch order; nothing is left in the pools at the end.
//!
//! With fusion on ([`check_fused`]: a bound on the run length above 1), the two in-order
//! streams fuse; every fifth instruction opts out ([`Instruction::fusable`]). The executor
//! queues a fused run as one entry and runs its members back to back, and checks that a
//! run's members are on one fusing stream and consecutive in build order but for
//! instructions already released.

use alloc::collections::VecDeque;
use alloc::vec::Vec;
use core::cell::Cell;

use crate::{
    AccessMode, Completion, Dependence, DispatchCtx, Dispatched, Engine, Executor, Fixed,
    Instruction, StreamPolicy,
};

/// Data words of a program.
pub const DATA: usize = 8;
/// Streams of a program.
pub const STREAMS: usize = 4;

/// One operation of a [`Program`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `writes[i] ← mix(writes[i], id, reads)` on `stream`.
    Kernel {
        /// Stream index (`0..STREAMS`).
        stream: u8,
        /// Data words read.
        reads: Vec<u8>,
        /// Data words written.
        writes: Vec<u8>,
        /// Also writes the stream's schedule dependence.
        sequential: bool,
    },
    /// A barrier: checks that everything before it was released.
    Barrier,
}

/// A decoded program.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Program {
    /// The operations, in submission order.
    pub ops: Vec<Op>,
}

impl Program {
    /// Decodes a program: two bytes per operation (then one per extra operand), never
    /// failing. Byte 0 of an operation picks barrier (1 in 32) or kernel and its stream;
    /// byte 1 its operand counts.
    pub fn from_bytes(data: &[u8]) -> Self {
        let mut ops = Vec::new();
        let mut it = data.iter().copied();
        while let (Some(a), Some(b)) = (it.next(), it.next()) {
            if a % 32 == 31 {
                ops.push(Op::Barrier);
                continue;
            }
            let stream = (a >> 5) % STREAMS as u8;
            let sequential = a & 1 == 1;
            let n_reads = (b & 3) as usize;
            let n_writes = 1 + ((b >> 2) & 1) as usize;
            let mut word = |default: u8| it.next().unwrap_or(default) % DATA as u8;
            let reads = (0..n_reads)
                .map(|k| word(b.wrapping_add(k as u8) >> 4))
                .collect();
            let writes = (0..n_writes)
                .map(|k| word((b >> 3).wrapping_add(k as u8)))
                .collect();
            ops.push(Op::Kernel {
                stream,
                reads,
                writes,
                sequential,
            });
        }
        Self { ops }
    }

    /// Operations that use more than one stream's data: a count of data words touched on
    /// one stream and then on another (the histories the engine must order across streams).
    pub fn cross_stream_uses(&self) -> usize {
        let mut last = [u8::MAX; DATA];
        let mut n = 0;
        for op in &self.ops {
            if let Op::Kernel {
                stream,
                reads,
                writes,
                ..
            } = op
            {
                for &w in reads.iter().chain(writes) {
                    let l = &mut last[w as usize];
                    n += usize::from(*l != u8::MAX && *l != *stream);
                    *l = *stream;
                }
            }
        }
        n
    }
}

fn mix(old: u64, id: u64, input: u64) -> u64 {
    let mut x = old ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ input.rotate_left(17);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 32)
}

fn apply(values: &mut [u64; DATA], id: usize, reads: &[u8], writes: &[u8]) {
    let input = reads
        .iter()
        .fold(0u64, |acc, &r| mix(acc, r as u64, values[r as usize]));
    for &w in writes {
        values[w as usize] = mix(values[w as usize], id as u64, input);
    }
}

/// The sequential interpreter: the program's effect, one operation after the other.
pub fn interpret(p: &Program) -> [u64; DATA] {
    let mut v = initial();
    for (id, op) in p.ops.iter().enumerate() {
        if let Op::Kernel { reads, writes, .. } = op {
            apply(&mut v, id, reads, writes);
        }
    }
    v
}

fn initial() -> [u64; DATA] {
    core::array::from_fn(|i| i as u64 * 1000 + 7)
}

/// How the check found the engine wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// Final data differ from the interpreter's.
    Values {
        /// The engine's run.
        got: alloc::boxed::Box<[u64; DATA]>,
        /// The interpreter's.
        want: alloc::boxed::Box<[u64; DATA]>,
    },
    /// Operation `0` was released before it was done.
    ReleasedEarly(usize),
    /// Barrier `0` ran before everything submitted before it was released.
    BarrierEarly(usize),
    /// A stream released out of dispatch order (the stream).
    ReleaseOrder(u32),
    /// Nothing could make progress with work left.
    Hang,
    /// The engine reported a stall (a pool too small for one instruction).
    Stalled,
    /// Objects left in the pools after the program finished.
    Leak,
    /// Operation `0` was dispatched as a fused run's member that does not follow the
    /// run's previous member (stream, fusability, build order: only released operations
    /// may lie between them), or a run was left open.
    BadRun(usize),
}

/// What one checked run did (for fuzzing statistics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Operations run.
    pub ops: usize,
    /// Instructions run by a waiting "caller" after the engine let it claim them.
    pub claimed: usize,
    /// Times the instruction pool was full at submission.
    pub full: usize,
    /// Most instructions in the engine at once.
    pub max_in_engine: usize,
    /// Instructions dispatched as a fused run's second or later member.
    pub fused: usize,
    /// The longest fused run.
    pub longest_run: usize,
}

/// A small xorshift generator (the executor's choices).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

struct Policy {
    strict: bool,
    later: bool,
}
impl StreamPolicy for Policy {
    fn completion(&self) -> Completion {
        if self.later {
            Completion::Later
        } else {
            Completion::AtLaunch
        }
    }
    fn strict_same_stream_edges(&self) -> bool {
        self.strict
    }
    fn may_run_on_caller(&self) -> bool {
        !self.later
    }
}

static POLICIES: [Policy; STREAMS] = [
    Policy {
        strict: false,
        later: false,
    },
    Policy {
        strict: false,
        later: false,
    },
    Policy {
        strict: true,
        later: false,
    },
    Policy {
        strict: false,
        later: true,
    },
];

struct Job<'a> {
    id: usize,
    op: &'a Op,
    deps: &'a [Dependence],
    done: &'a Cell<bool>,
}

// SAFETY: the dependences live in `check`'s frame, declared before the engine and
// outliving it, not inside the job; one engine uses them; `stream`/`policy` are fixed.
unsafe impl Instruction for Job<'_> {
    type Policy = Policy;
    fn stream(&self) -> u32 {
        match self.op {
            Op::Kernel { stream, .. } => *stream as u32,
            Op::Barrier => 0,
        }
    }
    fn policy(&self) -> &Policy {
        &POLICIES[self.stream() as usize]
    }
    fn is_barrier(&self) -> bool {
        matches!(self.op, Op::Barrier)
    }
    fn stream_sequential(&self) -> bool {
        matches!(
            self.op,
            Op::Kernel {
                sequential: true,
                ..
            }
        )
    }
    fn for_each_access(&self, f: &mut dyn FnMut(&Dependence, AccessMode)) {
        if let Op::Kernel { reads, writes, .. } = self.op {
            for &w in writes {
                f(&self.deps[w as usize], AccessMode::Write);
            }
            for &r in reads {
                f(&self.deps[r as usize], AccessMode::Read);
            }
        }
    }
    fn is_done(&self) -> bool {
        self.done.get()
    }
    fn fusable(&self) -> bool {
        self.id % 5 != 4
    }
}

struct Exec<'a> {
    ops: &'a [Op],
    done: &'a [Cell<bool>],
    values: [u64; DATA],
    /// Dispatched, not yet run, per stream: fused runs (an unfused instruction is a run
    /// of one).
    queues: [VecDeque<Vec<usize>>; STREAMS],
    /// The fused run being dispatched: its stream and members so far.
    open_run: Option<(usize, Vec<usize>)>,
    fused: usize,
    longest_run: usize,
    /// Run on a "later" stream, done at a later tick.
    completing: Vec<usize>,
    /// Claimed by a "caller", not yet run.
    claimed: Vec<usize>,
    /// Per stream: dispatch sequence numbers of dispatched, unreleased jobs, in order.
    dispatch_order: [VecDeque<usize>; STREAMS],
    released: usize,
    released_ids: Vec<bool>,
    rng: Rng,
    error: Option<Mismatch>,
    claims: usize,
    refused_barrier: bool,
}

impl Exec<'_> {
    fn run_job(&mut self, id: usize) {
        if let Op::Kernel {
            reads,
            writes,
            stream,
            ..
        } = &self.ops[id]
        {
            apply(&mut self.values, id, reads, writes);
            if POLICIES[*stream as usize].later {
                self.completing.push(id);
                return;
            }
        }
        self.done[id].set(true);
    }

    /// Runs a few random pieces of dispatched work. Returns whether anything ran.
    fn tick(&mut self) -> bool {
        let mut any = false;
        for _ in 0..1 + self.rng.below(3) {
            match self.rng.below(4) {
                0 if !self.claimed.is_empty() => {
                    let k = self.rng.below(self.claimed.len());
                    let id = self.claimed.swap_remove(k);
                    self.run_job(id);
                    any = true;
                }
                1 if !self.completing.is_empty() => {
                    let k = self.rng.below(self.completing.len());
                    let id = self.completing.swap_remove(k);
                    self.done[id].set(true);
                    any = true;
                }
                _ => {
                    let s = self.rng.below(STREAMS);
                    let q = &mut self.queues[s];
                    if q.is_empty() {
                        continue;
                    }
                    let k = if POLICIES[s].strict {
                        self.rng.below(q.len())
                    } else {
                        0
                    };
                    let run = q.remove(k).expect("index in range");
                    self.run_run(run);
                    any = true;
                }
            }
        }
        any
    }

    /// Runs everything that can run (used when the engine made no progress).
    fn drain_one(&mut self) -> bool {
        if let Some(id) = self.claimed.pop() {
            self.run_job(id);
            return true;
        }
        if let Some(id) = self.completing.pop() {
            self.done[id].set(true);
            return true;
        }
        for s in 0..STREAMS {
            if let Some(run) = self.queues[s].pop_front() {
                self.run_run(run);
                return true;
            }
        }
        false
    }

    /// Runs a queued run's members back to back, in order.
    fn run_run(&mut self, run: Vec<usize>) {
        for id in run {
            self.run_job(id);
        }
    }

    /// Whether `id` may join the open run on stream `s`.
    fn follows_run(&self, s: usize, job: &Job<'_>) -> bool {
        let Some((rs, members)) = &self.open_run else {
            return false;
        };
        let last = *members.last().expect("a run has a member");
        *rs == s
            && job.fusable()
            && job.policy().may_fuse()
            && last < job.id
            && (last + 1..job.id).all(|k| self.released_ids[k])
    }
}

impl<'a> Executor<Job<'a>> for Exec<'a> {
    fn dispatch(&mut self, job: &Job<'a>, ctx: &DispatchCtx<'_, Job<'a>>) -> Dispatched {
        let s = ctx.stream() as usize;
        self.dispatch_order[s].push_back(job.id);
        if ctx.run_index() > 0 {
            // The next member of the open run: the next operation, on the same stream.
            if self.follows_run(s, job) {
                if let Some((_, members)) = &mut self.open_run {
                    members.push(job.id);
                }
                self.fused += 1;
            } else {
                self.error.get_or_insert(Mismatch::BadRun(job.id));
            }
        } else {
            if self.open_run.is_some() {
                // The previous run said it continued, and did not.
                self.error.get_or_insert(Mismatch::BadRun(job.id));
            }
            if ctx.sole_access() && job.policy().may_run_on_caller() && self.rng.below(4) == 0 {
                // Claiming ends a run the engine would have continued.
                self.claims += 1;
                self.claimed.push(job.id);
                return Dispatched::Claimed;
            }
            self.open_run = Some((s, alloc::vec![job.id]));
        }
        if !ctx.run_continues()
            && let Some((rs, members)) = self.open_run.take()
        {
            self.longest_run = self.longest_run.max(members.len());
            self.queues[rs].push_back(members);
        }
        Dispatched::Handed
    }

    fn run_barrier(&mut self, job: &Job<'a>) -> bool {
        if !self.refused_barrier && self.rng.below(3) == 0 {
            // "Not now" (once in a row): the engine must try again later.
            self.refused_barrier = true;
            return false;
        }
        self.refused_barrier = false;
        if self.released != job.id {
            self.error.get_or_insert(Mismatch::BarrierEarly(job.id));
        }
        self.done[job.id].set(true);
        true
    }

    fn released(&mut self, job: Job<'a>) {
        if !job.done.get() {
            self.error.get_or_insert(Mismatch::ReleasedEarly(job.id));
        }
        if !job.is_barrier() {
            let s = job.stream();
            if self.dispatch_order[s as usize].pop_front() != Some(job.id) {
                self.error.get_or_insert(Mismatch::ReleaseOrder(s));
            }
        }
        self.released_ids[job.id] = true;
        while self.released < self.released_ids.len() && self.released_ids[self.released] {
            self.released += 1;
        }
    }
}

/// Pool sizes of the checked engine: small, so that full pools and stalls happen.
pub type CheckStorage = Fixed<24, 96, 256, STREAMS>;

/// Runs `program` through an engine (with `planted` bug, feature `planted-bugs`), the
/// executor's choices drawn from `seed`, and compares with [`interpret`].
///
/// # Errors
/// The first [`Mismatch`] found.
pub fn check(program: &Program, seed: u64) -> Result<RunStats, Mismatch> {
    run(program, seed, |_engine| {})
}

/// [`check`] with fusion on: runs of at most `max_run` instructions
/// ([`Engine::set_max_run`]; 1 is [`check`]).
///
/// # Errors
/// The first [`Mismatch`] found.
pub fn check_fused(program: &Program, seed: u64, max_run: usize) -> Result<RunStats, Mismatch> {
    run(program, seed, |engine| engine.set_max_run(max_run))
}

/// [`check_fused`] with `bug` planted in the engine (feature `planted-bugs`): the check
/// must find it in some programs.
///
/// # Errors
/// The first [`Mismatch`] found.
#[cfg(feature = "planted-bugs")]
pub fn check_planted(
    program: &Program,
    seed: u64,
    bug: crate::PlantedBug,
    max_run: usize,
) -> Result<RunStats, Mismatch> {
    run(program, seed, |engine| {
        engine.plant(bug);
        engine.set_max_run(max_run);
    })
}

fn run(
    program: &Program,
    seed: u64,
    setup: impl FnOnce(&mut Engine<Job<'_>, CheckStorage>),
) -> Result<RunStats, Mismatch> {
    let deps: [Dependence; DATA] = core::array::from_fn(|_| Dependence::new());
    let done: Vec<Cell<bool>> = program.ops.iter().map(|_| Cell::new(false)).collect();
    let mut exec = Exec {
        ops: &program.ops,
        done: &done,
        values: initial(),
        queues: Default::default(),
        open_run: None,
        fused: 0,
        longest_run: 0,
        completing: Vec::new(),
        claimed: Vec::new(),
        dispatch_order: Default::default(),
        released: 0,
        released_ids: alloc::vec![false; program.ops.len()],
        rng: Rng(seed | 1),
        error: None,
        claims: 0,
        refused_barrier: false,
    };
    let mut engine: Engine<Job<'_>, CheckStorage> = Engine::new();
    engine.set_pending_window(1 + (seed as usize >> 8) % 8);
    setup(&mut engine);
    let mut stats = RunStats {
        ops: program.ops.len(),
        ..RunStats::default()
    };
    let mut next = 0;
    let mut idle_rounds = 0;
    loop {
        // Submit a few, until the pool is full.
        for _ in 0..1 + exec.rng.below(4) {
            if next == program.ops.len() {
                break;
            }
            let job = Job {
                id: next,
                op: &program.ops[next],
                deps: &deps,
                done: &done[next],
            };
            match engine.submit(job) {
                Ok(()) => next += 1,
                Err(_) => {
                    stats.full += 1;
                    break;
                }
            }
        }
        stats.max_in_engine = stats.max_in_engine.max(engine.instructions());
        let progress = engine.step(&mut exec).map_err(|_| Mismatch::Stalled)?;
        let ran = exec.tick() || (!progress.any() && exec.drain_one());
        if let Some(e) = exec.error.take() {
            return Err(e);
        }
        if next == program.ops.len() && engine.is_idle() {
            break;
        }
        if progress.any() || ran {
            idle_rounds = 0;
        } else {
            idle_rounds += 1;
            if idle_rounds > 8 {
                return Err(Mismatch::Hang);
            }
        }
    }
    if engine.accesses() != 0 || engine.edges() != 0 || engine.instructions() != 0 {
        return Err(Mismatch::Leak);
    }
    if exec.open_run.is_some() {
        return Err(Mismatch::BadRun(program.ops.len()));
    }
    stats.claimed = exec.claims;
    stats.fused = exec.fused;
    stats.longest_run = exec.longest_run;
    let want = interpret(program);
    if exec.values != want {
        return Err(Mismatch::Values {
            got: alloc::boxed::Box::new(exec.values),
            want: alloc::boxed::Box::new(want),
        });
    }
    Ok(stats)
}
