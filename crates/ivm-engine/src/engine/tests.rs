//! Engine unit tests: one scenario per rule, then the equivalence check over random
//! programs (sizes shrink under miri, paths do not).

use core::cell::Cell;
use std::vec;
use std::vec::Vec;

use super::*;
use crate::check::{Program, check, check_fused};
use crate::{AccessMode, Completion, Dependence, Dispatched, Fixed};

struct Pol {
    strict: bool,
    fuse: bool,
}
impl StreamPolicy for Pol {
    fn completion(&self) -> Completion {
        Completion::Later
    }
    fn strict_same_stream_edges(&self) -> bool {
        self.strict
    }
    fn may_fuse(&self) -> bool {
        self.fuse
    }
}
static IN_ORDER: Pol = Pol {
    strict: false,
    fuse: false,
};
static STRICT: Pol = Pol {
    strict: true,
    fuse: false,
};
/// Streams 4 and up: in-order, fusing.
static FUSING: Pol = Pol {
    strict: false,
    fuse: true,
};

struct T<'a> {
    name: &'static str,
    stream: u32,
    strict: bool,
    deps: &'a [Dependence],
    reads: &'static [usize],
    writes: &'static [usize],
    barrier: bool,
    sequential: bool,
    strict_edges: bool,
    /// Opts out of fused runs ([`Instruction::fusable`]).
    unfusable: bool,
    done: &'a Cell<bool>,
}

// SAFETY: the test's dependences are locals declared before the engine (they outlive it).
unsafe impl Instruction for T<'_> {
    type Policy = Pol;
    fn stream(&self) -> u32 {
        self.stream
    }
    fn policy(&self) -> &Pol {
        if self.strict {
            &STRICT
        } else if self.stream >= 4 {
            &FUSING
        } else {
            &IN_ORDER
        }
    }
    fn fusable(&self) -> bool {
        !self.unfusable
    }
    fn is_barrier(&self) -> bool {
        self.barrier
    }
    fn stream_sequential(&self) -> bool {
        self.sequential
    }
    fn strict_edges(&self) -> bool {
        self.strict_edges
    }
    fn for_each_access(&self, f: &mut dyn FnMut(&Dependence, AccessMode)) {
        for &d in self.writes {
            f(&self.deps[d], AccessMode::Write);
        }
        for &d in self.reads {
            f(&self.deps[d], AccessMode::Read);
        }
    }
    fn is_done(&self) -> bool {
        self.done.get()
    }
    fn awaited(&self) {
        AWAITED.with(|a| a.borrow_mut().push(self.name));
    }
}

std::thread_local! {
    /// The instructions told they are awaited ([`Instruction::awaited`]), in order, on
    /// this test's thread.
    static AWAITED: core::cell::RefCell<Vec<&'static str>> = const { core::cell::RefCell::new(Vec::new()) };
}

/// Takes this thread's record of `awaited` calls.
fn awaited_log() -> Vec<&'static str> {
    AWAITED.with(|a| core::mem::take(&mut *a.borrow_mut()))
}

fn t<'a>(
    name: &'static str,
    stream: u32,
    deps: &'a [Dependence],
    reads: &'static [usize],
    writes: &'static [usize],
    done: &'a Cell<bool>,
) -> T<'a> {
    T {
        name,
        stream,
        strict: false,
        deps,
        reads,
        writes,
        barrier: false,
        sequential: false,
        strict_edges: false,
        unfusable: false,
        done,
    }
}

/// Records dispatches and releases; claims what `claim` names when the engine allows it.
#[derive(Default)]
struct Rec {
    dispatched: Vec<&'static str>,
    /// Dispatches grouped by fused run (an unfused instruction is a run of one).
    runs: Vec<Vec<&'static str>>,
    /// The last dispatch said the run continues.
    open: bool,
    released: Vec<&'static str>,
    barriers: Vec<&'static str>,
    claim: Option<&'static str>,
    refuse_barriers: bool,
}

impl<'a> Executor<T<'a>> for Rec {
    fn dispatch(&mut self, i: &T<'a>, ctx: &DispatchCtx<'_, T<'a>>) -> Dispatched {
        self.dispatched.push(i.name);
        assert_eq!(
            ctx.run_index() > 0,
            self.open,
            "{}: a member follows exactly a dispatch that said the run continues",
            i.name
        );
        if ctx.run_index() == 0 {
            self.runs.push(Vec::new());
        }
        self.runs.last_mut().unwrap().push(i.name);
        let claim = self.claim == Some(i.name) && ctx.sole_access();
        // Claiming ends the run.
        self.open = ctx.run_continues() && !claim;
        if claim {
            Dispatched::Claimed
        } else {
            Dispatched::Handed
        }
    }
    fn run_barrier(&mut self, i: &T<'a>) -> bool {
        if self.refuse_barriers {
            return false;
        }
        self.barriers.push(i.name);
        i.done.set(true);
        true
    }
    fn released(&mut self, i: T<'a>) {
        self.released.push(i.name);
    }
}

type Small<'a> = Engine<T<'a>, Fixed<16, 32, 32, 8>>;

#[test]
fn write_waits_for_every_read_since_the_last_write() {
    let d: [Dependence; 2] = Default::default();
    let (w1, r1, r2, w2) = (
        Cell::new(false),
        Cell::new(false),
        Cell::new(false),
        Cell::new(false),
    );
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    e.submit(t("w1", 0, &d, &[], &[0], &w1)).unwrap();
    e.submit(t("r1", 1, &d, &[0], &[], &r1)).unwrap();
    e.submit(t("r2", 2, &d, &[0], &[], &r2)).unwrap();
    e.submit(t("w2", 3, &d, &[], &[0], &w2)).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["w1"]);
    assert_eq!(e.edges(), 2 + 3, "w1→r1, w1→r2; w1, r1, r2 → w2");
    w1.set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["w1", "r1", "r2"], "reads run concurrently");
    r1.set(true);
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched.len(), 3, "w2 still waits for r2");
    r2.set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["w1", "r1", "r2", "w2"]);
    w2.set(true);
    e.step(&mut x).unwrap();
    assert!(e.is_idle());
    assert_eq!((e.accesses(), e.edges()), (0, 0));
    e.lively.assert_valid(&e.nodes);
}

#[test]
fn same_stream_successor_is_prescheduled_and_released_in_order() {
    let d: [Dependence; 2] = Default::default();
    let (d1, d2) = (Cell::new(false), Cell::new(false));
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    e.submit(t("p", 0, &d, &[], &[0], &d1)).unwrap();
    e.submit(t("c", 0, &d, &[0], &[0], &d2)).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.dispatched,
        ["p", "c"],
        "in-order stream: c need not wait for p to finish"
    );
    // c finishes first (say, reported first): it may not be released before p.
    d2.set(true);
    e.step(&mut x).unwrap();
    assert!(x.released.is_empty(), "release is in order per stream");
    d1.set(true);
    e.step(&mut x).unwrap();
    assert_eq!(x.released, ["p", "c"]);
}

#[test]
fn a_dispatched_instruction_is_told_when_work_waits_for_its_release() {
    let d: [Dependence; 3] = Default::default();
    let cells: [Cell<bool>; 6] = Default::default();
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    awaited_log();
    // A same-stream reader is prescheduled: nothing waits for `p`'s release.
    e.submit(t("p", 0, &d, &[], &[0], &cells[0])).unwrap();
    e.submit(t("same", 0, &d, &[0], &[], &cells[1])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["p", "same"]);
    assert!(
        awaited_log().is_empty(),
        "prescheduled successors await nothing"
    );
    // A reader on another stream, received while `p` runs, waits for its release.
    e.submit(t("other", 1, &d, &[0], &[], &cells[2])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(awaited_log(), ["p"]);
    // One received before its source's dispatch: told at the dispatch.
    e.submit(t("q", 0, &d, &[], &[1], &cells[3])).unwrap();
    e.submit(t("q_reader", 2, &d, &[1], &[], &cells[4]))
        .unwrap();
    for c in &cells[..3] {
        c.set(true);
    }
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["p", "same", "q"]);
    assert_eq!(awaited_log(), ["q"]);
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["p", "same", "q", "other"]);
    // A barrier waits for every running instruction.
    let mut b = t("barrier", 3, &d, &[], &[], &cells[5]);
    b.barrier = true;
    e.submit(b).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(awaited_log(), ["q"], "q is the only one still running");
    cells[3].set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched.last(), Some(&"q_reader"));
    assert_eq!(
        awaited_log(),
        ["q_reader"],
        "dispatched while a barrier waits"
    );
}

#[test]
fn strict_stream_edges_wait_for_release() {
    let d: [Dependence; 2] = Default::default();
    let (d1, d2) = (Cell::new(false), Cell::new(false));
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    let mut begin = t("begin", 2, &d, &[], &[0], &d1);
    begin.strict = true;
    begin.sequential = true;
    let mut end = t("end", 2, &d, &[0], &[], &d2);
    end.strict = true;
    end.sequential = true;
    e.submit(begin).unwrap();
    e.submit(end).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.dispatched,
        ["begin"],
        "the data edge is strict (the schedule edge was upgraded)"
    );
    d1.set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["begin", "end"]);
}

#[test]
fn strict_edges_of_one_instruction_wait_for_release_on_an_in_order_stream() {
    let d: [Dependence; 2] = Default::default();
    let cells: [Cell<bool>; 5] = Default::default();
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    // Prescheduled as usual: a reader behind a plain writer of its stream.
    e.submit(t("plain", 0, &d, &[], &[1], &cells[0])).unwrap();
    e.submit(t("plain_reader", 0, &d, &[1], &[], &cells[1]))
        .unwrap();
    // Edges from an instruction that completes later wait for its release ...
    let mut io = t("io", 0, &d, &[], &[0], &cells[2]);
    io.strict_edges = true;
    e.submit(io).unwrap();
    e.submit(t("io_reader", 0, &d, &[0], &[], &cells[3]))
        .unwrap();
    // ... and so do edges to one (`late` reads what `plain` wrote).
    let mut late = t("late", 0, &d, &[1], &[], &cells[4]);
    late.strict_edges = true;
    e.submit(late).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.dispatched,
        ["plain", "io", "plain_reader"],
        "io_reader waits for io's release, late for plain's (its edge is strict too)"
    );
    for c in &cells[..3] {
        c.set(true);
    }
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.released, ["plain", "io", "plain_reader"]);
    // Both unblocked by this step's releases (no edge between them: either order).
    let mut rest = x.dispatched[3..].to_vec();
    rest.sort_unstable();
    assert_eq!(rest, ["io_reader", "late"]);
}

#[test]
fn barrier_runs_when_oldest_and_holds_nothing_after_it() {
    let d: [Dependence; 2] = Default::default();
    let (d1, db, d2) = (Cell::new(false), Cell::new(false), Cell::new(false));
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    e.submit(t("before", 0, &d, &[], &[0], &d1)).unwrap();
    let mut bar = t("barrier", 0, &d, &[], &[], &db);
    bar.barrier = true;
    e.submit(bar).unwrap();
    e.submit(t("after", 1, &d, &[], &[1], &d2)).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.dispatched,
        ["before", "after"],
        "a barrier orders only what came before it"
    );
    assert!(x.barriers.is_empty());
    d1.set(true);
    x.refuse_barriers = true;
    e.step(&mut x).unwrap();
    assert!(x.barriers.is_empty(), "the executor may refuse (not now)");
    assert!(e.has_work(), "a refused barrier at the front is still work");
    x.refuse_barriers = false;
    e.step(&mut x).unwrap();
    assert_eq!(x.barriers, ["barrier"]);
    d2.set(true);
    e.step(&mut x).unwrap();
    assert!(e.is_idle());
}

#[test]
fn a_claimed_instruction_holds_later_ones_of_its_stream() {
    let d: [Dependence; 2] = Default::default();
    let (d1, d2) = (Cell::new(false), Cell::new(false));
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec {
        claim: Some("cb"),
        ..Rec::default()
    };
    e.submit(t("cb", 0, &d, &[0], &[], &d1)).unwrap();
    e.submit(t("next", 0, &d, &[], &[1], &d2)).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.dispatched,
        ["cb"],
        "next is held while cb runs on its caller"
    );
    d1.set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.dispatched, ["cb", "next"]);
    d2.set(true);
    e.step(&mut x).unwrap();
    assert!(e.is_idle());
}

#[test]
fn full_pools_are_error_values() {
    let d: [Dependence; 3] = Default::default();
    let done: [Cell<bool>; 4] = Default::default();
    // Two instructions at most; two accesses at most.
    let mut e: Engine<T<'_>, Fixed<2, 2, 4, 2>> = Engine::new();
    let mut x = Rec::default();
    e.submit(t("a", 0, &d, &[], &[0], &done[0])).unwrap();
    e.submit(t("b", 0, &d, &[], &[1], &done[1])).unwrap();
    let Err(Full(back)) = e.submit(t("c", 0, &d, &[], &[2], &done[2])) else {
        panic!("a third instruction must not fit");
    };
    assert_eq!(back.name, "c", "the refused instruction comes back");
    assert!(
        e.submit(t("s", 7, &d, &[], &[], &done[3])).is_err(),
        "stream 7 is past the pool"
    );
    e.step(&mut x).unwrap();
    done[0].set(true);
    done[1].set(true);
    e.step(&mut x).unwrap();
    assert!(e.is_idle());
    // Three accesses can never fit two slots: a stall, reported once nothing is lively.
    e.submit(t("wide", 0, &d, &[], &[0, 1, 2], &done[2]))
        .unwrap();
    assert_eq!(
        e.step(&mut x),
        Err(Stalled {
            accesses: 3,
            edges: 0
        })
    );
}

#[test]
fn diagnostics_see_lively_instructions_and_edges() {
    let d: [Dependence; 2] = Default::default();
    let (d1, d2) = (Cell::new(false), Cell::new(false));
    let mut e: Small<'_> = Engine::new();
    let mut x = Rec::default();
    e.submit(t("w", 0, &d, &[], &[0], &d1)).unwrap();
    e.submit(t("r", 1, &d, &[0], &[], &d2)).unwrap();
    e.step(&mut x).unwrap();
    let seen: Vec<_> = e
        .lively()
        .map(|l| (l.instr().name, l.state(), l.in_edges()))
        .collect();
    assert_eq!(
        seen,
        [
            ("w", NodeState::Dispatched, 0),
            ("r", NodeState::Waiting, 1)
        ]
    );
    let r = e.lively().nth(1).unwrap();
    assert_eq!(r.sources().map(|s| s.name).collect::<Vec<_>>(), ["w"]);
    let w = e.lively().next().unwrap();
    assert_eq!(w.out_edges().map(|o| o.to.name).collect::<Vec<_>>(), ["r"]);
}

// ---- fused runs --------------------------------------------------------------------

/// Stream 4 and 5 fuse (`FUSING`); a fused engine with runs of at most `max_run`.
fn fused<'a>(max_run: usize) -> Small<'a> {
    let mut e: Small<'a> = Engine::new();
    e.set_max_run(max_run);
    e
}

#[test]
fn independent_and_dependent_instructions_of_one_stream_fuse() {
    let d: [Dependence; 3] = Default::default();
    let done: [Cell<bool>; 4] = Default::default();
    let mut e = fused(8);
    let mut x = Rec::default();
    // a, b independent; c reads a (prescheduled by a's dispatch); d0 writes what c reads.
    e.submit(t("a", 4, &d, &[], &[0], &done[0])).unwrap();
    e.submit(t("b", 4, &d, &[], &[1], &done[1])).unwrap();
    e.submit(t("c", 4, &d, &[0], &[2], &done[2])).unwrap();
    e.submit(t("d0", 4, &d, &[], &[0], &done[3])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs, [["a", "b", "c", "d0"]], "one run, in build order");
    // Each member is still released on its own, in order, once done.
    done[1].set(true);
    e.step(&mut x).unwrap();
    assert!(x.released.is_empty(), "b is done before a: release waits");
    done[0].set(true);
    e.step(&mut x).unwrap();
    assert_eq!(
        x.released,
        ["a", "b"],
        "done members leave before the run ends"
    );
    done[2].set(true);
    done[3].set(true);
    e.step(&mut x).unwrap();
    assert_eq!(x.released, ["a", "b", "c", "d0"]);
    assert!(e.is_idle());
    // The same program without fusion: the same dispatch order, runs of one.
    let done: [Cell<bool>; 2] = Default::default();
    let mut e = fused(1);
    let mut x = Rec::default();
    e.submit(t("a", 4, &d, &[], &[0], &done[0])).unwrap();
    e.submit(t("b", 4, &d, &[0], &[1], &done[1])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs, [["a"], ["b"]], "max_run 1: fusion off");
}

#[test]
fn another_stream_a_barrier_or_an_opt_out_ends_a_run() {
    let d: [Dependence; 8] = Default::default();
    let done: [Cell<bool>; 8] = Default::default();
    let mut e = fused(8);
    let mut x = Rec::default();
    // All independent: ready together, dispatched in build order.
    e.submit(t("a", 4, &d, &[], &[0], &done[0])).unwrap();
    e.submit(t("b", 4, &d, &[], &[1], &done[1])).unwrap();
    // Another stream's instruction between them in build order.
    e.submit(t("o", 5, &d, &[], &[2], &done[2])).unwrap();
    e.submit(t("c", 4, &d, &[], &[3], &done[3])).unwrap();
    let mut opt_out = t("u", 4, &d, &[], &[4], &done[4]);
    opt_out.unfusable = true;
    e.submit(opt_out).unwrap();
    e.submit(t("f", 4, &d, &[], &[5], &done[5])).unwrap();
    e.submit(T {
        barrier: true,
        ..t("bar", 4, &d, &[], &[], &done[6])
    })
    .unwrap();
    e.submit(t("g", 4, &d, &[], &[6], &done[7])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(
        x.runs,
        [
            vec!["a", "b"],
            vec!["o"],
            vec!["c"],
            vec!["u"],
            vec!["f"],
            vec!["g"]
        ],
        "o (stream 5), the opt-out u and the barrier end runs (a barrier orders nothing \
         after it: g is ready)"
    );
}

#[test]
fn a_member_waiting_outside_the_run_ends_it_and_the_bound_holds() {
    let d: [Dependence; 4] = Default::default();
    let done: [Cell<bool>; 7] = Default::default();
    let mut e = fused(2);
    let mut x = Rec::default();
    // w runs on stream 0; r (stream 4) reads what w writes: r waits for w's release.
    e.submit(t("w", 0, &d, &[], &[0], &done[0])).unwrap();
    e.step(&mut x).unwrap();
    e.submit(t("a", 4, &d, &[], &[1], &done[1])).unwrap();
    e.submit(t("r", 4, &d, &[0], &[2], &done[2])).unwrap();
    e.submit(t("b", 4, &d, &[], &[3], &done[3])).unwrap();
    e.submit(t("c", 4, &d, &[], &[1], &done[4])).unwrap();
    e.submit(t("e", 4, &d, &[], &[3], &done[5])).unwrap();
    e.step(&mut x).unwrap();
    // r waits for w: the run of a ends before it; b starts one of its own, bounded to 2.
    assert_eq!(
        x.runs,
        [vec!["w"], vec!["a"], vec!["b", "c"], vec!["e"]],
        "r waits outside the run; runs are at most 2 long"
    );
    done[0].set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs.last().unwrap(), &["r"], "r runs once w is released");
}

#[test]
fn a_reader_on_another_stream_waits_for_its_member_not_the_run() {
    let d: [Dependence; 3] = Default::default();
    let done: [Cell<bool>; 4] = Default::default();
    let mut e = fused(8);
    let mut x = Rec::default();
    e.submit(t("a", 4, &d, &[], &[0], &done[0])).unwrap();
    e.submit(t("b", 4, &d, &[], &[1], &done[1])).unwrap();
    e.submit(t("c", 4, &d, &[], &[2], &done[2])).unwrap();
    e.submit(t("ra", 0, &d, &[0], &[], &done[3])).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs, [["a", "b", "c"]]);
    assert_eq!(awaited_log(), ["a"], "only the member ra reads is awaited");
    done[0].set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.released, ["a"]);
    assert_eq!(
        x.dispatched.last(),
        Some(&"ra"),
        "ra runs while b and c are not done"
    );
}

#[test]
fn a_claimed_head_ends_its_run() {
    let d: [Dependence; 2] = Default::default();
    let (d1, d2) = (Cell::new(false), Cell::new(false));
    let mut e = fused(8);
    let mut x = Rec {
        claim: Some("cb"),
        ..Rec::default()
    };
    e.submit(t("cb", 4, &d, &[0], &[], &d1)).unwrap();
    e.submit(t("next", 4, &d, &[], &[1], &d2)).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs, [["cb"]], "next is held while cb runs on its caller");
    d1.set(true);
    e.step(&mut x).unwrap();
    e.step(&mut x).unwrap();
    assert_eq!(x.runs, [["cb"], ["next"]]);
    d2.set(true);
    e.step(&mut x).unwrap();
    assert!(e.is_idle());
}

fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

const PROGRAMS: u64 = if cfg!(miri) { 12 } else { 1500 };

#[test]
fn random_programs_match_the_sequential_interpreter() {
    let mut claimed = 0;
    let mut full = 0;
    for seed in 0..PROGRAMS {
        let p = Program::from_bytes(&seeded_bytes(seed, 16 + (seed as usize * 97) % 400));
        let stats = check(&p, seed).unwrap_or_else(|m| panic!("seed {seed}: {m:?}\n{p:?}"));
        claimed += stats.claimed;
        full += stats.full;
    }
    assert!(claimed > 0, "the check exercised claimed instructions");
    assert!(full > 0, "the check exercised full pools");
}

#[test]
fn random_programs_match_the_sequential_interpreter_with_fusion() {
    let (mut fused, mut longest) = (0, 0);
    for seed in 0..PROGRAMS {
        let p = Program::from_bytes(&seeded_bytes(seed, 16 + (seed as usize * 97) % 400));
        let max_run = 2 + seed as usize % 24;
        let stats = check_fused(&p, seed, max_run)
            .unwrap_or_else(|m| panic!("seed {seed}, max_run {max_run}: {m:?}\n{p:?}"));
        fused += stats.fused;
        longest = longest.max(stats.longest_run);
    }
    assert!(fused > 0, "the check exercised fused runs");
    assert!(
        longest >= 3,
        "the check exercised runs longer than two ({longest})"
    );
}

#[cfg(feature = "planted-bugs")]
#[test]
fn planted_bugs_are_caught() {
    use crate::PlantedBug;
    for bug in [
        PlantedBug::DropReadWriteEdge,
        PlantedBug::OutOfOrderRelease,
        PlantedBug::FuseWaiting,
    ] {
        // Fusion on and off, except for the bug that only a fused run can show.
        for max_run in [1, 8] {
            if bug == PlantedBug::FuseWaiting && max_run == 1 {
                continue;
            }
            let caught = (0..PROGRAMS.max(200)).find(|&seed| {
                let p = Program::from_bytes(&seeded_bytes(seed, 64));
                crate::check::check_planted(&p, seed, bug, max_run).is_err()
            });
            assert!(caught.is_some(), "{bug:?} not caught (max_run {max_run})");
        }
    }
}
