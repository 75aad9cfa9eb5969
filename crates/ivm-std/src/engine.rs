//! The dependency engine: DESIGN.md "Scheduling", run by exactly one thread at a time
//! (the scheduler thread, or the caller holding the engine lock in single-thread mode).
//!
//! All per-instruction, per-access and per-edge state lives in pools owned by the engine
//! (`Slab`s whose entries keep their `Vec` capacity when reused), so a steady state
//! allocates nothing here. Instructions reach the engine through `receive`; each `step`
//! handles a bounded window of them, dispatches ready instructions, releases done ones in
//! order per stream, runs a barrier once it is the oldest lively instruction, and runs
//! probes.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;

use ivm_core::sync::Ordering;

use crate::dependence::Dependence;
use crate::drive::Driver;
use crate::error::{Diagnostic, LivelyInstruction};
use crate::instruction::{self, Instruction, Kind, status};
use crate::shared::{Probe, VmShared};
use crate::slab::{IdxList, Links, NIL, Slab};
use crate::stream::{Placement, StreamShared, StreamType};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum NodeState {
    /// Waiting for in-edges.
    #[default]
    Waiting,
    /// On the ready list.
    Ready,
    /// Handed to its stream's executor.
    Dispatched,
}

#[derive(Debug, Clone, Copy)]
struct OutEdge {
    dst: u32,
    /// No longer counted in `dst.blocking` (source dispatched on `dst`'s stream).
    satisfied: bool,
    /// A same-stream edge that dispatch order does not satisfy: `dst` waits for `src`'s
    /// release (tensor edges between critical-section instructions, whose effects on the
    /// tensor happen in the graph runtime between a begin and its end's record).
    strict: bool,
}

/// Engine state of one lively instruction.
#[derive(Default)]
struct Node {
    instr: Option<Arc<Instruction>>,
    stream: u32,
    state: NodeState,
    /// In-edges whose source is neither released nor dispatched on this node's stream.
    blocking: u32,
    /// In-edges whose source is not released yet.
    in_edges: u32,
    out: Vec<OutEdge>,
    accesses: Vec<u32>,
    lively: Links,
    running: Links,
}

/// One access of an instruction to a dependence.
#[derive(Default)]
struct Access {
    node: u32,
    /// Valid while `node`'s instruction is lively: its body holds the blob (or stream) that
    /// owns the dependence until the engine clears it at release, after erasing accesses.
    dep: Option<NonNull<Dependence>>,
    write: bool,
    /// Hook of the dependence's list of accesses since its last write.
    links: Links,
}

struct EngineStream {
    shared: Arc<StreamShared>,
    running: IdxList,
    /// A node handed to its waiting caller (`status::CLAIMED`) and not yet released. It
    /// runs on the caller's thread, outside stream order as the stream's worker sees it,
    /// so later nodes of the stream wait in `held` (in dispatch order) until its release.
    claimed: Option<u32>,
    held: Vec<u32>,
}

/// Live-object counts (see [`crate::VirtualMachine::debug_counters`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DebugCounters {
    /// Lively instructions held by the engine plus instructions received but not handled.
    pub instructions: usize,
    /// Accesses not yet erased.
    pub accesses: usize,
    /// Edges not yet removed.
    pub edges: usize,
    /// Instructions in flight (pending + not released), as `flying_instruction_count`.
    pub flying: usize,
}

/// The engine. See the module docs.
pub(crate) struct Engine {
    nodes: Slab<Node>,
    accesses: Slab<Access>,
    edges: usize,
    lively: IdxList,
    streams: Vec<Option<EngineStream>>,
    /// Indices of streams whose running list is not empty.
    active: Vec<u32>,
    ready: VecDeque<u32>,
    barriers: VecDeque<u32>,
    pending: VecDeque<Arc<Instruction>>,
    probes: Vec<Probe>,
    pending_window: usize,
    /// Set while handling the tensor dependences of a critical-section instruction:
    /// same-stream edges made then are strict (see `OutEdge::strict`).
    strict: bool,
    /// Who runs the current steps (`drive.rs`): probes and user barriers are the
    /// scheduler thread's.
    driver: Driver,
    /// Set by a step when a non-scheduler driver met work reserved to the scheduler thread
    /// (a submitted probe, a user barrier at the front).
    needs_scheduler: bool,
    /// Ready small sync accesses may run inline in the driver (`Config::inline_sync_access`).
    inline_small: bool,
    /// Small sync accesses run inline since the last step's end (published by `step`).
    inline_runs: usize,
    /// Instructions released by this step, handed to the VM's pool at its end.
    recycled: Vec<Arc<Instruction>>,
    /// Planted bug (feature `fuzzing`, equivalence-fuzzer tests only): see `planted_*`.
    #[cfg(feature = "fuzzing")]
    planted: crate::fuzzing::PlantedBug,
}

// SAFETY: the raw `NonNull<Dependence>` pointers are only dereferenced by the engine's
// owner, and the dependences they point to are `Sync`; the engine moves to the scheduler
// thread once and is used there only (or under the engine lock).
unsafe impl Send for Engine {}

/// Lively instructions the engine's pools are sized for up front.
const PRESIZE: u32 = 256;

fn lively_hook(n: &mut Node) -> &mut Links {
    &mut n.lively
}
fn running_hook(n: &mut Node) -> &mut Links {
    &mut n.running
}
fn access_hook(a: &mut Access) -> &mut Links {
    &mut a.links
}

impl Engine {
    pub(crate) fn new(pending_window: usize) -> Self {
        Self {
            // Pre-sized (issue 6: a steady state allocates nothing, deterministically, as
            // long as fewer than `PRESIZE` instructions are lively).
            nodes: Slab::prefilled(PRESIZE, || Node {
                out: Vec::with_capacity(4),
                accesses: Vec::with_capacity(4),
                ..Node::default()
            }),
            accesses: Slab::prefilled(2 * PRESIZE, Access::default),
            edges: 0,
            lively: IdxList::new(),
            streams: Vec::with_capacity(16),
            active: Vec::with_capacity(16),
            ready: VecDeque::with_capacity(PRESIZE as usize),
            barriers: VecDeque::with_capacity(16),
            pending: VecDeque::with_capacity(PRESIZE as usize),
            probes: Vec::new(),
            pending_window,
            strict: false,
            driver: Driver::Scheduler,
            needs_scheduler: false,
            inline_small: false,
            inline_runs: 0,
            recycled: Vec::with_capacity(PRESIZE as usize),
            #[cfg(feature = "fuzzing")]
            planted: crate::fuzzing::PlantedBug::None,
        }
    }

    /// Takes a received instruction (drained from the VM's pending queue).
    pub(crate) fn receive(&mut self, instr: Arc<Instruction>) {
        crate::trace::record(&instr, crate::trace::Phase::Receive);
        self.pending.push_back(instr);
    }

    /// Nothing pending, nothing lively, no probe.
    pub(crate) fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.lively.is_empty() && self.probes.is_empty()
    }

    /// Whether a `step` now could make progress without new input (ready work, pending
    /// work, a barrier at the front, a done instruction at a running front, probes).
    pub(crate) fn has_work(&self) -> bool {
        !self.pending.is_empty()
            || !self.ready.is_empty()
            || !self.probes.is_empty()
            || self.barrier_at_front()
            || self.any_front_done()
    }

    pub(crate) fn has_probes(&self) -> bool {
        !self.probes.is_empty()
    }

    /// Who runs the next steps, and whether ready small sync accesses may run inline.
    pub(crate) fn set_driver(&mut self, driver: Driver, inline_small: bool) {
        self.driver = driver;
        self.inline_small = inline_small;
    }

    /// The last step met work reserved to the scheduler thread (see `needs_scheduler`).
    pub(crate) fn needs_scheduler(&self) -> bool {
        self.needs_scheduler
    }

    fn barrier_at_front(&self) -> bool {
        matches!((self.barriers.front(), self.lively.front()), (Some(b), Some(f)) if *b == f)
    }

    /// Whether the front of some running list is releasable.
    pub(crate) fn any_front_done(&self) -> bool {
        self.active.iter().any(|&s| {
            let Some(es) = &self.streams[s as usize] else {
                return false;
            };
            es.running.front().is_some_and(|f| self.releasable(f))
        })
    }

    fn releasable(&self, n: u32) -> bool {
        let node = &self.nodes[n];
        node.in_edges == 0
            && node
                .instr
                .as_ref()
                .is_some_and(|i| i.status() & status::DONE != 0)
    }

    pub(crate) fn counters(&self) -> (usize, usize, usize) {
        (
            self.nodes.live() + self.pending.len(),
            self.accesses.live(),
            self.edges,
        )
    }

    /// One scheduling step. Returns whether anything changed.
    pub(crate) fn step(&mut self, shared: &VmShared) -> bool {
        let mut progress = false;
        self.needs_scheduler = false;
        if shared.probes_submitted() {
            if self.driver == Driver::Scheduler {
                for p in shared.take_probes() {
                    self.probes.push(p);
                }
            } else {
                self.needs_scheduler = true;
            }
        }
        #[cfg(feature = "fuzzing")]
        {
            self.planted = shared.config.planted;
        }
        progress |= self.handle_pending();
        progress |= self.dispatch_ready();
        let released = self.release_done(shared);
        progress |= released > 0;
        progress |= self.run_barrier(shared);
        progress |= self.run_probes();
        if released > 0 {
            shared.after_release(released);
        }
        if self.inline_runs > 0 {
            shared
                .cell
                .count_inline(std::mem::take(&mut self.inline_runs));
        }
        if !self.recycled.is_empty() {
            shared.cell.pool.give_back(&mut self.recycled);
        }
        if progress {
            shared.publish_counters(self.counters());
            self.publish_stats(&shared.stats);
        }
        progress
    }

    // ---- 2. handle pending -------------------------------------------------------------

    fn handle_pending(&mut self) -> bool {
        let mut handled = 0;
        while handled < self.pending_window {
            let Some(instr) = self.pending.pop_front() else {
                break;
            };
            handled += 1;
            self.handle_one(instr);
        }
        handled > 0
    }

    fn ensure_stream(&mut self, s: &Arc<StreamShared>) -> u32 {
        let i = s.index as usize;
        if self.streams.len() <= i {
            self.streams.resize_with(i + 1, || None);
        }
        if self.streams[i].is_none() {
            self.streams[i] = Some(EngineStream {
                shared: s.clone(),
                running: IdxList::new(),
                claimed: None,
                held: Vec::new(),
            });
        }
        s.index
    }

    fn handle_one(&mut self, instr: Arc<Instruction>) {
        let stream = self.ensure_stream(&instr.stream);
        let n = self.nodes.alloc();
        {
            let node = &mut self.nodes[n];
            node.stream = stream;
            node.state = NodeState::Waiting;
            node.blocking = 0;
            node.in_edges = 0;
            debug_assert!(node.out.is_empty() && node.accesses.is_empty());
            node.instr = Some(instr.clone());
        }
        self.lively.push_back(&mut self.nodes, n, lively_hook);
        if instr.barrier {
            self.barriers.push_back(n);
            return;
        }
        if instr.stream_sequential {
            self.write(NonNull::from(&instr.stream.schedule_dep), n);
        }
        // SAFETY: the engine owns the body between receive and dispatch (ownership step 2).
        let body = unsafe { instr.body() };
        // A critical-section instruction is done when the graph runtime is done with its
        // tensors, not in stream order: its tensor edges on its own stream are strict.
        self.strict = instr.stream.id.stream_type == StreamType::CriticalSection;
        for b in body.outputs.as_slice() {
            self.write(NonNull::from(&*b.dep), n);
        }
        for b in body.inputs.as_slice() {
            self.read(NonNull::from(&*b.dep), n);
        }
        self.strict = false;
        if self.nodes[n].blocking == 0 {
            self.nodes[n].state = NodeState::Ready;
            self.ready.push_back(n);
        }
    }

    fn new_access(&mut self, dep: NonNull<Dependence>, n: u32, write: bool) -> u32 {
        let a = self.accesses.alloc();
        let acc = &mut self.accesses[a];
        acc.node = n;
        acc.dep = Some(dep);
        acc.write = write;
        debug_assert!(!acc.links.linked);
        self.nodes[n].accesses.push(a);
        a
    }

    /// A write: an edge from every access since the last write, which then leave the
    /// dependence's list; the write becomes the list's only (leading) access.
    fn write(&mut self, dep: NonNull<Dependence>, n: u32) {
        // SAFETY: `dep` is kept alive by the instruction being handled (its body holds the
        // owning blob / stream); engine-only invariant for the list.
        let d = unsafe { dep.as_ref() };
        // SAFETY: we are the engine (engine-only invariant).
        let mut list = unsafe { d.list() };
        let mut a = list.head;
        while a != NIL {
            let src = self.accesses[a].node;
            // PLANTED BUG (feature `fuzzing`, off by default): drop read→write edges.
            if self.planted_drop_read_write_edge() && !self.accesses[a].write {
                a = self.accesses[a].links.next;
                continue;
            }
            self.add_edge(src, n);
            a = self.accesses[a].links.next;
        }
        list.clear(&mut self.accesses, access_hook, |_, _| {});
        let acc = self.new_access(dep, n, true);
        list.push_back(&mut self.accesses, acc, access_hook);
        // SAFETY: as above.
        unsafe { d.set_list(list) };
    }

    /// A read: an edge from the leading write, if the list starts with one.
    fn read(&mut self, dep: NonNull<Dependence>, n: u32) {
        // SAFETY: as in `write`.
        let d = unsafe { dep.as_ref() };
        // SAFETY: engine-only invariant.
        let mut list = unsafe { d.list() };
        if let Some(f) = list.front()
            && self.accesses[f].write
        {
            let src = self.accesses[f].node;
            self.add_edge(src, n);
        }
        let acc = self.new_access(dep, n, false);
        list.push_back(&mut self.accesses, acc, access_hook);
        // SAFETY: engine-only invariant.
        unsafe { d.set_list(list) };
    }

    fn add_edge(&mut self, src: u32, dst: u32) {
        if src == dst {
            return;
        }
        let same_stream = self.nodes[src].stream == self.nodes[dst].stream;
        let strict = same_stream && self.strict;
        let s = &mut self.nodes[src];
        if same_stream && !strict && s.state == NodeState::Dispatched {
            // The in-order stream already runs `src` before `dst`, and releases in order.
            return;
        }
        if let Some(e) = s.out.last_mut()
            && e.dst == dst
        {
            if strict && !e.strict {
                // Upgrade (a schedule-dependence edge made just before), counting it as
                // blocking again if dispatch had already satisfied it.
                e.strict = true;
                if e.satisfied {
                    e.satisfied = false;
                    self.nodes[dst].blocking += 1;
                }
            }
            return;
        }
        s.out.push(OutEdge {
            dst,
            satisfied: false,
            strict,
        });
        self.edges += 1;
        let d = &mut self.nodes[dst];
        d.in_edges += 1;
        d.blocking += 1;
    }

    // ---- 3. dispatch -------------------------------------------------------------------

    fn dispatch_ready(&mut self) -> bool {
        let mut any = false;
        while let Some(n) = self.ready.pop_front() {
            any = true;
            self.dispatch(n);
        }
        any
    }

    fn dispatch(&mut self, n: u32) {
        let stream = self.nodes[n].stream;
        if let Some(es) = self.streams[stream as usize].as_mut()
            && es.claimed.is_some()
        {
            // Its stream's last node runs on its caller's thread: wait for its release
            // (stream order; see `EngineStream::claimed`).
            es.held.push(n);
            return;
        }
        self.nodes[n].state = NodeState::Dispatched;
        let instr = self.nodes[n]
            .instr
            .clone()
            .expect("ivm engine: dispatching a node without instruction");
        // Relaxed: diagnostic bit; the hand-over below carries the ordering.
        instr.status.fetch_or(status::DISPATCHED, Ordering::Relaxed);
        let es = self.streams[stream as usize]
            .as_mut()
            .expect("ivm engine: unknown stream");
        if es.running.is_empty() {
            self.active.push(stream);
        }
        es.running.push_back(&mut self.nodes, n, running_hook);
        // Preschedule: same-stream successors no longer wait for this one.
        let mut i = 0;
        while i < self.nodes[n].out.len() {
            let e = self.nodes[n].out[i];
            if !e.satisfied && !e.strict && self.nodes[e.dst].stream == stream {
                self.nodes[n].out[i].satisfied = true;
                let d = &mut self.nodes[e.dst];
                d.blocking -= 1;
                if d.blocking == 0 && d.state == NodeState::Waiting {
                    d.state = NodeState::Ready;
                    self.ready.push_back(e.dst);
                }
            }
            i += 1;
        }
        crate::trace::record(&instr, crate::trace::Phase::Dispatch);
        if self.inline_small && self.can_run_inline(n, stream, &instr) {
            // The driver runs it now (see `can_run_inline`): no hand-over, no wake.
            instruction::execute(&instr);
            self.inline_runs += 1;
            return;
        }
        if self.can_hand_to_caller(n, stream, &instr) {
            // Its waiting caller drives the engine right now: it runs the instruction
            // after letting go of the engine (`sync_access::sync_callback`).
            // Relaxed: read by this very thread.
            instr.status.fetch_or(status::CLAIMED, Ordering::Relaxed);
            if let Some(es) = self.streams[stream as usize].as_mut() {
                es.claimed = Some(n);
            }
            return;
        }
        if self.can_run_protocol_inline(n, stream, &instr) {
            // A lazy-job protocol step the driver does now, without blocking (see
            // `can_run_protocol_inline`): no hand-over to the stream's thread, no wake.
            instruction::execute_as(&instr, false);
            return;
        }
        let es = self.streams[stream as usize]
            .as_ref()
            .expect("ivm engine: unknown stream");
        match (&es.shared.thread, es.shared.policy.placement()) {
            (Some(thread), Placement::SharedWorker | Placement::OwnWorker) => thread.submit(instr),
            // Single-thread mode, or a stream that lives on the scheduler.
            _ => instruction::execute(&instr),
        }
    }

    /// Whether node `n` (just dispatched on `stream`) is a lazy-job protocol step — a
    /// critical-section begin or end, or a launch: a deferred body on a critical-section or
    /// launcher stream — that the driving thread may run itself: every other instruction of
    /// its stream that is dispatched and unreleased has already run its body (`BODY_RAN`, or
    /// `DONE` for a step without deferred body; read with Acquire: so the stream's own thread runs nothing of it now, nothing is
    /// queued there, and stream order holds — which is all that a prescheduled same-stream
    /// edge asks for; edges from other streams and strict ones are satisfied only at their
    /// source's release, before `n` was ready), and its body would not block (every buffer
    /// it pushes to has room). The body is the VM's own code (pushes to the graph's
    /// buffers, a callback registration), never user code.
    ///
    /// Each of these steps on its stream's thread would cost a wake-up when that thread
    /// sleeps — tens of microseconds on a small VM, per step of every launch.
    fn can_run_protocol_inline(&self, n: u32, stream: u32, instr: &Instruction) -> bool {
        if !instr.stream.id.stream_type.needs_own_thread() {
            return false;
        }
        let Some(es) = self.streams[stream as usize].as_ref() else {
            return false;
        };
        let mut m = es.running.head;
        while m != NIL {
            if m != n {
                let ran = self.nodes[m].instr.as_ref().is_some_and(|i| {
                    // Acquire: pairs with the Release in `lazy::launch::run_deferred` (or
                    // the executor's Release of DONE, for a step without deferred body).
                    i.status.load(Ordering::Acquire) & (status::BODY_RAN | status::DONE) != 0
                });
                if !ran {
                    return false;
                }
            }
            m = self.nodes[m].running.next;
        }
        // SAFETY: the engine owns the body until it hands the instruction to an executor
        // (ownership step 2); we have not yet.
        let body = unsafe { instr.body() };
        body.deferred
            .as_ref()
            .is_some_and(crate::lazy::launch::Deferred::runs_without_blocking)
    }

    /// Whether node `n` (just dispatched on `stream`) is a sync callback
    /// (`sync_access_blob_by_callback[_mut]`) that its waiting caller may run itself: that
    /// caller is the thread driving the engine now, inside the submission of this very
    /// instruction (`sync_access::claimable`: it runs it as soon as the submission
    /// returns, before it waits), on a worker's stream, and the access is one
    /// [`sole_host_access`](Self::sole_host_access) allows. As for an inline small access,
    /// every other accessor of the tensor is ordered by an edge from or to it. Unlike it,
    /// the callback is user code and may take long, so it runs after the caller let go of
    /// the engine, not inside this step; meanwhile later nodes of its stream are held back
    /// (`EngineStream::claimed`), so that stream order holds although the stream's worker
    /// does not run it.
    fn can_hand_to_caller(&self, n: u32, stream: u32, instr: &Instruction) -> bool {
        self.driver == Driver::Caller
            && crate::sync_access::claimable(instr)
            && instr.stream.thread.is_some()
            && self.sole_host_access(n, stream, instr, true)
    }

    /// Whether node `n` (just dispatched on `stream`, its instruction `instr`) may run in
    /// the driving thread instead of on its stream's thread: a small sync access (8-odd
    /// bytes copied, no user code) that [`sole_host_access`](Self::sole_host_access)
    /// allows.
    ///
    /// Why this stays correct when another thread submits a write to the same tensor at
    /// that moment: the engine is held by this driver, so that write is handled either
    /// before this access (then the access has an edge from it: `in_edges > 0`, no inline)
    /// or after it (then the write has an edge from this access, which is released only
    /// after it ran; a same-stream successor prescheduled by this dispatch is dispatched
    /// only after `execute` below returned). Every other accessor of the tensor is ordered
    /// by an edge, and a released source has finished (its DONE was read with Acquire).
    fn can_run_inline(&self, n: u32, stream: u32, instr: &Instruction) -> bool {
        self.sole_host_access(n, stream, instr, false)
    }

    /// Whether node `n` is a sync access — a small one, or a callback if `callback` —
    /// with its waiter, on a synchronous device, over host-visible memory, whose every
    /// source is **released** (`in_edges == 0`: DONE, not merely dispatched — OneFlow
    /// #7607) and whose stream has nothing else dispatched and unreleased (so no earlier
    /// instruction of the stream, which got no edge to it, is still running).
    fn sole_host_access(&self, n: u32, stream: u32, instr: &Instruction, callback: bool) -> bool {
        if instr.waiter.is_none() || instr.stream.dev.is_async() || self.nodes[n].in_edges != 0 {
            return false;
        }
        let only = self.streams[stream as usize]
            .as_ref()
            .is_some_and(|es| es.running.len == 1 && es.running.head == n);
        if !only {
            return false;
        }
        // SAFETY: the engine owns the body until it hands the instruction to an executor
        // (ownership step 2); we have not yet.
        let body = unsafe { instr.body() };
        let operand = match (&body.kind, callback) {
            (Kind::SmallRead { .. }, false) | (Kind::Read(_), true) => {
                body.inputs.as_slice().first()
            }
            (Kind::SmallWrite { .. }, false) | (Kind::Write(_), true) => {
                body.outputs.as_slice().first()
            }
            _ => return false,
        };
        body.deferred.is_none() && operand.is_some_and(|b| b.mem.host_ptr().is_some())
    }

    // ---- 4. release --------------------------------------------------------------------

    fn release_done(&mut self, shared: &VmShared) -> usize {
        let mut released = 0;
        let mut k = 0;
        while k < self.active.len() {
            let s = self.active[k];
            loop {
                let es = self.streams[s as usize]
                    .as_ref()
                    .expect("ivm engine: unknown stream");
                let Some(f) = es.running.front() else { break };
                if !self.releasable(f) {
                    break;
                }
                // PLANTED BUG (feature `fuzzing`, off by default): release out of order.
                let f = if self.planted_out_of_order_release() {
                    self.newest_without_in_edges(s).unwrap_or(f)
                } else {
                    f
                };
                let es = self.streams[s as usize]
                    .as_mut()
                    .expect("ivm engine: unknown stream");
                es.running.remove(&mut self.nodes, f, running_hook);
                if es.claimed == Some(f) {
                    // The caller ran it: the stream's held nodes go on, in order.
                    es.claimed = None;
                    for h in es.held.drain(..) {
                        self.ready.push_back(h);
                    }
                }
                self.release(f, shared);
                released += 1;
            }
            let es = self.streams[s as usize]
                .as_ref()
                .expect("ivm engine: unknown stream");
            if es.running.is_empty() {
                self.active.swap_remove(k);
            } else {
                k += 1;
            }
        }
        released
    }

    /// Releases node `n` (done, no in-edges, already off its running list): erases its
    /// accesses, removes its out-edges (readying successors), leaves the lively list, drops
    /// the engine's hold on the instruction's operands.
    fn release(&mut self, n: u32, shared: &VmShared) {
        let mut accesses = std::mem::take(&mut self.nodes[n].accesses);
        for &a in &accesses {
            if self.accesses[a].links.linked {
                let dep = self.accesses[a]
                    .dep
                    .expect("ivm engine: access without dependence");
                // SAFETY: `dep` is alive (this node's instruction still holds its owner);
                // engine-only invariant for the list.
                let d = unsafe { dep.as_ref() };
                // SAFETY: engine-only invariant.
                let mut list = unsafe { d.list() };
                list.remove(&mut self.accesses, a, access_hook);
                // SAFETY: engine-only invariant.
                unsafe { d.set_list(list) };
            }
            self.accesses[a].dep = None;
            self.accesses.free(a);
        }
        accesses.clear();
        self.nodes[n].accesses = accesses;

        let mut out = std::mem::take(&mut self.nodes[n].out);
        for e in &out {
            let d = &mut self.nodes[e.dst];
            d.in_edges -= 1;
            if !e.satisfied {
                d.blocking -= 1;
                if d.blocking == 0 && d.state == NodeState::Waiting {
                    d.state = NodeState::Ready;
                    self.ready.push_back(e.dst);
                }
            }
        }
        self.edges -= out.len();
        out.clear();
        self.nodes[n].out = out;

        self.lively.remove(&mut self.nodes, n, lively_hook);
        let instr = self.nodes[n]
            .instr
            .take()
            .expect("ivm engine: releasing a node without instruction");
        crate::trace::record(&instr, crate::trace::Phase::Release);
        self.nodes.free(n);
        // Planted bug only (`OutOfOrderRelease`): released before it finished, so its
        // executor still owns the body; leave it alone.
        let premature = self.planted_out_of_order_release() && instr.status() & status::DONE == 0;
        if !premature {
            // SAFETY: the executor set DONE (we read it with Acquire in `releasable`, or ran
            // the body ourselves), so the engine owns the body again (ownership step 4).
            let body = unsafe { instr.body_mut() };
            body.inputs.clear();
            body.outputs.clear();
            body.kind = Kind::Noop;
        }
        shared.instruction_released();
        if premature {
            // Waited-on instructions (sync-access ring entries, sync callbacks) belong to
            // their waiter, not to the pool.
            drop(instr);
        } else {
            // Back to the VM's pool at the end of the step (when nobody else holds it).
            self.recycled.push(instr);
        }
    }

    // ---- planted bugs (feature `fuzzing`; the equivalence fuzzer's `planted_*` tests) --

    /// `PlantedBug::DropReadWriteEdge` is on: a write gets no edge from earlier reads.
    #[cfg(feature = "fuzzing")]
    fn planted_drop_read_write_edge(&self) -> bool {
        self.planted == crate::fuzzing::PlantedBug::DropReadWriteEdge
    }
    #[cfg(not(feature = "fuzzing"))]
    fn planted_drop_read_write_edge(&self) -> bool {
        false
    }

    /// `PlantedBug::OutOfOrderRelease` is on: see `newest_without_in_edges`.
    #[cfg(feature = "fuzzing")]
    fn planted_out_of_order_release(&self) -> bool {
        self.planted == crate::fuzzing::PlantedBug::OutOfOrderRelease
    }
    #[cfg(not(feature = "fuzzing"))]
    fn planted_out_of_order_release(&self) -> bool {
        false
    }

    /// Planted bug only: the newest instruction on stream `s`'s running list without
    /// in-edges, released in place of the front (out of order, finished or not).
    fn newest_without_in_edges(&self, s: u32) -> Option<u32> {
        let es = self.streams[s as usize].as_ref()?;
        let mut n = es.running.tail;
        while n != NIL {
            if self.nodes[n].in_edges == 0 {
                return Some(n);
            }
            n = self.nodes[n].running.prev;
        }
        None
    }

    // ---- 5. barriers -------------------------------------------------------------------

    fn run_barrier(&mut self, shared: &VmShared) -> bool {
        let mut any = false;
        while self.barrier_at_front() {
            if self.driver != Driver::Scheduler && self.front_barrier_has_callback() {
                // A user callback runs on the scheduler thread.
                self.needs_scheduler = true;
                break;
            }
            let n = self
                .barriers
                .pop_front()
                .expect("ivm engine: barrier list empty");
            let instr = self.nodes[n]
                .instr
                .clone()
                .expect("ivm engine: barrier node without instruction");
            // Relaxed: diagnostic bit.
            instr.status.fetch_or(status::DISPATCHED, Ordering::Relaxed);
            crate::trace::record(&instr, crate::trace::Phase::Dispatch);
            instruction::execute(&instr);
            drop(instr);
            self.release(n, shared);
            shared.after_release(1);
            any = true;
        }
        any
    }

    /// Whether the barrier at the front carries a user callback (`sync()`'s does not).
    fn front_barrier_has_callback(&self) -> bool {
        let Some(&n) = self.barriers.front() else {
            return false;
        };
        self.nodes[n].instr.as_ref().is_some_and(|i| {
            // SAFETY: the engine owns a barrier's body until it runs it (ownership step 2).
            matches!(unsafe { i.body() }.kind, Kind::Barrier(_))
        })
    }

    // ---- 6. probes ---------------------------------------------------------------------

    fn run_probes(&mut self) -> bool {
        if self.probes.is_empty() || self.driver != Driver::Scheduler {
            return false;
        }
        let mut probes = std::mem::take(&mut self.probes);
        let before = probes.len();
        probes.retain_mut(|p| match p {
            Probe::User(f) => !f(),
            Probe::Diagnose(slot) => {
                slot.fulfil(self.diagnostic());
                false
            }
            Probe::Dag(slot) => {
                slot.fulfil(self.dag());
                false
            }
        });
        let any = probes.len() != before;
        // Probes added while running (none today) would be in `self.probes`.
        probes.append(&mut self.probes);
        self.probes = probes;
        any
    }

    /// Lists lively instructions, oldest first (at most 64).
    pub(crate) fn diagnostic(&self) -> Diagnostic {
        const MAX: usize = 64;
        let mut d = Diagnostic {
            pending: self.pending.len(),
            ..Diagnostic::default()
        };
        let mut n = self.lively.head;
        while n != NIL {
            let node = &self.nodes[n];
            if d.lively.len() == MAX {
                d.truncated += 1;
            } else if let Some(instr) = &node.instr {
                let st = instr.status.load(Ordering::Relaxed);
                let mut in_edges = Vec::new();
                // In-edges are found by scanning lively sources (diagnostic path only).
                let mut m = self.lively.head;
                while m != NIL {
                    let src = &self.nodes[m];
                    if src.out.iter().any(|e| e.dst == n)
                        && let Some(si) = &src.instr
                    {
                        in_edges.push(si.label());
                    }
                    m = src.lively.next;
                }
                d.lively.push(LivelyInstruction {
                    name: instr.label(),
                    stream: instr.stream.id.to_string(),
                    dispatched: st & status::DISPATCHED != 0,
                    launched: st & status::LAUNCHED != 0,
                    done: st & status::DONE != 0,
                    in_edges,
                });
            }
            n = node.lively.next;
        }
        d
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Unlink every access from its dependence before the nodes (and the blobs their
        // instructions hold) go, so that no dependence is left pointing into this pool.
        let mut n = self.lively.head;
        while n != NIL {
            for &a in &self.nodes[n].accesses {
                if self.accesses[a].links.linked
                    && let Some(dep) = self.accesses[a].dep
                {
                    // SAFETY: the node's instruction (still held) keeps `dep` alive;
                    // engine-only invariant.
                    let d = unsafe { dep.as_ref() };
                    // SAFETY: engine-only invariant.
                    let mut list = unsafe { d.list() };
                    list.remove(&mut self.accesses, a, access_hook);
                    // SAFETY: engine-only invariant.
                    unsafe { d.set_list(list) };
                }
            }
            n = self.nodes[n].lively.next;
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

#[path = "engine_surface.rs"]
mod surface;
