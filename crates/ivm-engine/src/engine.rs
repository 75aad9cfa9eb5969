//! The engine proper: pools, the handle → dispatch → release steps, barriers, and the
//! read-only views (dispatch context, lively walk) that executors and diagnostics use.
//!
//! Every object is an index into one of four pools ([`crate::pool`]) and every list is an
//! ivm-core [`IndexList`] threaded through a hook of the pooled objects:
//!
//! | list | of | through | held by |
//! |---|---|---|---|
//! | lively | nodes, oldest first | `Node::lively` | the engine |
//! | pending / ready / held / running / barriers | nodes | `Node::queue` (a node is on one at a time) | engine, stream |
//! | out-edges | edges | `Edge::out` | the source node |
//! | accesses of a node | accesses | `AccessSlot::on_node` | the node |
//! | accesses since the last write | accesses | `AccessSlot::on_dep` | a [`Dependence`] or a stream's schedule dependence |
//! | active streams | streams | `StreamSlot::active` | the engine |
//!
//! A freed object is on its pool's free list through the hook it no longer needs (a freed
//! node's `lively`, a freed access's `on_node`, a freed edge's `out`).

use core::ptr::NonNull;

use ivm_core::list::{IndexLinks, IndexList, NIL};

use crate::dependence::{AccessMode, Dependence};
use crate::pool::{Free, Slab, Slots, Storage, hook};
use crate::{Dispatched, Executor, Full, Instruction, Stalled, StreamPolicy};

/// Tag: the lively list (nodes, oldest first).
pub(crate) enum LivelyTag {}
/// Tag: pending, ready, held, running and barrier lists (a node is on one at a time).
pub(crate) enum Queue {}
/// Tag: a node's out-edges.
pub(crate) enum Out {}
/// Tag: a node's accesses.
pub(crate) enum OnNode {}
/// Tag: a dependence's accesses since its last write.
pub(crate) enum OnDep {}
/// Tag: the list of streams with a non-empty running list.
pub(crate) enum Active {}

/// Where a lively instruction is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeState {
    /// Received, not yet handled (no dependences consumed).
    #[default]
    Pending,
    /// Waiting for in-edges.
    Waiting,
    /// Ready: will be dispatched by the next step.
    Ready,
    /// Ready, but held back behind a claimed instruction of its stream.
    Held,
    /// Handed to its stream's executor.
    Dispatched,
    /// A barrier waiting to be the oldest lively instruction.
    Barrier,
}

/// A pool slot for one instruction (engine-internal; public only so that a
/// [`Storage`] can name its container).
pub struct Node<I> {
    instr: Option<I>,
    stream: u32,
    state: NodeState,
    /// In-edges whose source is neither released nor (non-strictly) dispatched on this
    /// node's stream.
    blocking: u32,
    /// In-edges whose source is not released.
    in_edges: u32,
    out: IndexList<Out>,
    accesses: IndexList<OnNode>,
    lively: IndexLinks,
    queue: IndexLinks,
    /// Its same-stream out-edges are strict ([`Instruction::strict_edges`]).
    strict_out: bool,
}

impl<I> Default for Node<I> {
    fn default() -> Self {
        Self {
            instr: None,
            stream: 0,
            state: NodeState::Pending,
            blocking: 0,
            in_edges: 0,
            out: IndexList::new(),
            accesses: IndexList::new(),
            lively: IndexLinks::new(),
            queue: IndexLinks::new(),
            strict_out: false,
        }
    }
}

macro_rules! node_hook {
    ($tag:ty, $field:ident) => {
        impl<I> ivm_core::list::IndexLinked<$tag> for Node<I> {
            #[inline]
            fn links(&self) -> &IndexLinks {
                &self.$field
            }
            #[inline]
            fn links_mut(&mut self) -> &mut IndexLinks {
                &mut self.$field
            }
        }
    };
}
node_hook!(LivelyTag, lively);
node_hook!(Free, lively);
node_hook!(Queue, queue);

/// A pool slot for one edge (engine-internal).
#[derive(Default)]
pub struct Edge {
    dst: u32,
    /// No longer counted in `dst.blocking` (source dispatched on `dst`'s stream).
    satisfied: bool,
    /// A same-stream edge that dispatch order does not satisfy
    /// ([`StreamPolicy::strict_same_stream_edges`]).
    strict: bool,
    out: IndexLinks,
}
hook!(Edge, Out, out);
hook!(Edge, Free, out);

/// Which dependence an access is to.
#[derive(Clone, Copy, Default)]
enum DepRef {
    #[default]
    None,
    /// An instruction's operand (alive while the instruction is lively: the
    /// [`Instruction`] contract).
    External(NonNull<Dependence>),
    /// A stream's schedule dependence (in the engine's stream pool).
    Stream(u32),
}

/// A pool slot for one access of an instruction to a dependence (engine-internal).
#[derive(Default)]
pub struct AccessSlot {
    node: u32,
    dep: DepRef,
    write: bool,
    on_node: IndexLinks,
    on_dep: IndexLinks,
}
hook!(AccessSlot, OnNode, on_node);
hook!(AccessSlot, Free, on_node);
hook!(AccessSlot, OnDep, on_dep);

// SAFETY: the only non-`Send` part is `DepRef::External`'s pointer. It is dereferenced only
// by the engine that owns this slot, through `&mut Engine` (single owner; whoever moves the
// engine between threads orders the moves), the `Dependence` it points to is `Sync`, and
// the `Instruction` contract keeps it alive while the access exists. So an engine — and its
// pools — may move to another thread with the instructions it holds (`I: Send`).
unsafe impl Send for AccessSlot {}

/// A pool slot for one stream (engine-internal).
#[derive(Default)]
pub struct StreamSlot {
    known: bool,
    strict: bool,
    running: IndexList<Queue>,
    /// A node handed to its waiting caller ([`Dispatched::Claimed`]) and not yet released:
    /// later nodes wait in `held`, in dispatch order, until its release.
    claimed: u32,
    held: IndexList<Queue>,
    /// The stream's schedule dependence: accesses since its last stream-sequential write.
    schedule: IndexList<OnDep>,
    active: IndexLinks,
}
hook!(StreamSlot, Active, active);

/// What one [`Engine::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Received instructions handled (dependences consumed).
    pub handled: usize,
    /// Instructions dispatched to the executor.
    pub dispatched: usize,
    /// Instructions released (barriers included).
    pub released: usize,
    /// Barriers run.
    pub barriers: usize,
}

impl Progress {
    /// Whether the step changed anything.
    pub fn any(&self) -> bool {
        self.handled + self.dispatched + self.released + self.barriers > 0
    }
}

/// Bugs planted on purpose (feature `planted-bugs`): the equivalence fuzzers' own tests
/// show that their check catches each.
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlantedBug {
    /// No bug.
    #[default]
    None,
    /// A write gets no edge from the reads since the last write.
    DropReadWriteEdge,
    /// Release takes the newest instruction of a stream without in-edges instead of the
    /// front, finished or not.
    OutOfOrderRelease,
}

/// The dependency engine over instructions `I` and storage `S`. See the [crate docs](crate).
pub struct Engine<I, S: Storage<I>> {
    nodes: Slab<Node<I>, S::Nodes>,
    accesses: Slab<AccessSlot, S::Accesses>,
    edges: Slab<Edge, S::Edges>,
    streams: S::Streams,
    active: IndexList<Active>,
    lively: IndexList<LivelyTag>,
    pending: IndexList<Queue>,
    ready: IndexList<Queue>,
    barriers: IndexList<Queue>,
    pending_window: usize,
    /// Set while handling the data dependences of an instruction on a strict stream.
    strict: bool,
    /// Set when the oldest pending instruction did not fit the pools (it waits for
    /// releases).
    stalled: Option<Stalled>,
    #[cfg(feature = "planted-bugs")]
    planted: PlantedBug,
}

impl<I: Instruction, S: Storage<I>> Default for Engine<I, S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
    /// An empty engine. It handles at most 256 received instructions per step (see
    /// [`set_pending_window`](Self::set_pending_window)).
    pub fn new() -> Self {
        Self {
            nodes: Slab::new(),
            accesses: Slab::new(),
            edges: Slab::new(),
            streams: S::Streams::default(),
            active: IndexList::new(),
            lively: IndexList::new(),
            pending: IndexList::new(),
            ready: IndexList::new(),
            barriers: IndexList::new(),
            pending_window: 256,
            strict: false,
            stalled: None,
            #[cfg(feature = "planted-bugs")]
            planted: PlantedBug::None,
        }
    }

    /// Makes room up front, where the storage can grow: the first `nodes` lively
    /// instructions with up to `accesses` accesses and `edges` edges among them allocate
    /// nothing.
    pub fn presize(&mut self, nodes: u32, accesses: u32, edges: u32) {
        self.nodes.presize(nodes);
        self.accesses.presize(accesses);
        self.edges.presize(edges);
    }

    /// How many received instructions one step handles at most (keeps a step short under
    /// a flood). At least 1.
    pub fn set_pending_window(&mut self, window: usize) {
        self.pending_window = window.max(1);
    }

    /// Plants `bug` (feature `planted-bugs`; tests of equivalence checkers only).
    #[cfg(feature = "planted-bugs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "planted-bugs")))]
    pub fn plant(&mut self, bug: PlantedBug) {
        self.planted = bug;
    }

    /// Receives an instruction: it is handled by a later [`step`](Self::step), in
    /// submission order.
    ///
    /// # Errors
    /// [`Full`] (with the instruction) when the instruction pool is full or its stream
    /// index is past the stream pool's capacity.
    pub fn submit(&mut self, instr: I) -> Result<(), Full<I>> {
        if !self.ensure_stream(&instr) {
            return Err(Full(instr));
        }
        let Some(n) = self.nodes.alloc() else {
            return Err(Full(instr));
        };
        let stream = instr.stream();
        let node = &mut self.nodes[n];
        node.instr = Some(instr);
        node.stream = stream;
        node.state = NodeState::Pending;
        node.blocking = 0;
        node.in_edges = 0;
        debug_assert!(node.out.is_empty() && node.accesses.is_empty());
        self.pending.push_back(&mut self.nodes, n);
        Ok(())
    }

    /// Registers the instruction's stream on first sight. False if its index does not fit.
    fn ensure_stream(&mut self, instr: &I) -> bool {
        let s = instr.stream() as usize;
        while self.streams.as_slice().len() <= s {
            if self.streams.try_push(StreamSlot::default()).is_err() {
                return false;
            }
        }
        let slot = &mut self.streams.as_mut_slice()[s];
        if !slot.known {
            slot.known = true;
            slot.strict = instr.policy().strict_same_stream_edges();
            slot.claimed = NIL;
        }
        true
    }

    /// Nothing received, nothing lively.
    pub fn is_idle(&self) -> bool {
        self.nodes.live() == 0
    }

    /// Whether a [`step`](Self::step) now could make progress without new input (pending
    /// or ready work, a barrier at the front, a done instruction at a running front).
    pub fn has_work(&self) -> bool {
        (!self.pending.is_empty() && self.stalled.is_none())
            || !self.ready.is_empty()
            || self.barrier_at_front()
            || self.any_front_done()
    }

    /// Whether the front of some stream's running list is releasable now.
    pub fn any_front_done(&self) -> bool {
        self.active.iter(self.streams.as_slice()).any(|s| {
            self.streams.as_slice()[s as usize]
                .running
                .front()
                .is_some_and(|f| self.releasable(f))
        })
    }

    /// Received instructions not yet handled.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Ready instructions not yet dispatched.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }

    /// Lively instructions (handled, not released).
    pub fn lively_len(&self) -> usize {
        self.lively.len()
    }

    /// Instructions received and not released (pending + lively).
    pub fn instructions(&self) -> usize {
        self.nodes.live()
    }

    /// Accesses not yet erased.
    pub fn accesses(&self) -> usize {
        self.accesses.live()
    }

    /// Edges not yet removed.
    pub fn edges(&self) -> usize {
        self.edges.live()
    }

    /// Streams the engine has met (indices `0..stream_count()`, some possibly unused).
    pub fn stream_count(&self) -> usize {
        self.streams.as_slice().len()
    }

    /// Dispatched, unreleased instructions of stream `s`.
    pub fn running_len(&self, s: u32) -> usize {
        self.streams
            .as_slice()
            .get(s as usize)
            .map_or(0, |st| st.running.len())
    }

    fn barrier_at_front(&self) -> bool {
        matches!((self.barriers.front(), self.lively.front()), (Some(b), Some(f)) if b == f)
    }

    fn releasable(&self, n: u32) -> bool {
        let node = &self.nodes[n];
        node.in_edges == 0 && node.instr.as_ref().is_some_and(I::is_done)
    }

    /// One scheduling step: handles up to the pending window of received instructions,
    /// dispatches every ready one, releases done ones in order per stream, runs barriers
    /// that are oldest.
    ///
    /// # Errors
    /// [`Stalled`] when the oldest received instruction needs more accesses or edges than
    /// the pools hold and nothing lively is left to free them.
    pub fn step<X: Executor<I>>(&mut self, x: &mut X) -> Result<Progress, Stalled> {
        let mut p = Progress {
            handled: self.handle_pending(),
            ..Progress::default()
        };
        p.dispatched = self.dispatch_ready(x);
        p.released = self.release_done(x);
        let (barriers, released) = self.run_barriers(x);
        p.barriers = barriers;
        p.released += released;
        if let Some(st) = self.stalled
            && self.lively.is_empty()
        {
            return Err(st);
        }
        Ok(p)
    }

    // ---- 1. handle pending ----------------------------------------------------------

    fn handle_pending(&mut self) -> usize {
        let mut handled = 0;
        self.stalled = None;
        while handled < self.pending_window {
            let Some(n) = self.pending.front() else { break };
            if let Err(st) = self.reserve_for(n) {
                // Waits (in order) until releases free room.
                self.stalled = Some(st);
                break;
            }
            self.pending.remove(&mut self.nodes, n);
            self.handle_one(n);
            handled += 1;
        }
        handled
    }

    /// Checks that handling node `n` cannot run out of accesses or edges.
    fn reserve_for(&mut self, n: u32) -> Result<(), Stalled> {
        let instr = self.nodes[n]
            .instr
            .as_ref()
            .expect("ivm-engine: pending node without instruction");
        if instr.is_barrier() {
            return Ok(());
        }
        let sequential = instr.stream_sequential();
        let mut accesses = usize::from(sequential);
        // An upper bound: a write gets an edge per access since the last write, a read one.
        let mut edges = 0usize;
        let mut count = |d: &Dependence, mode: AccessMode| {
            accesses += 1;
            edges += match mode {
                // SAFETY: `d` is alive (the instruction contract) and we are its engine
                // (`&mut self`): engine only.
                AccessMode::Write => unsafe { d.list() }.len(),
                AccessMode::Read => 1,
            };
        };
        instr.for_each_access(&mut count);
        if sequential {
            edges += self.streams.as_slice()[self.nodes[n].stream as usize]
                .schedule
                .len();
        }
        if self.accesses.can_alloc(accesses) && self.edges.can_alloc(edges) {
            Ok(())
        } else {
            Err(Stalled { accesses, edges })
        }
    }

    fn handle_one(&mut self, n: u32) {
        self.lively.push_back(&mut self.nodes, n);
        let instr = self.nodes[n]
            .instr
            .as_ref()
            .expect("ivm-engine: node without instruction");
        let sequential = instr.stream_sequential();
        let strict_edges = instr.strict_edges();
        let barrier = instr.is_barrier();
        self.nodes[n].strict_out = strict_edges;
        if barrier {
            self.nodes[n].state = NodeState::Barrier;
            self.barriers.push_back(&mut self.nodes, n);
            // It waits for the release of every instruction running now.
            self.tell_running_awaited();
            return;
        }
        self.nodes[n].state = NodeState::Waiting;
        let stream = self.nodes[n].stream;
        if sequential {
            self.access(DepRef::Stream(stream), n, true);
        }
        self.strict = self.streams.as_slice()[stream as usize].strict || strict_edges;
        // The instruction leaves its slot while its operands are visited, so that the
        // visitor may change the pools; it moves back unchanged (the dependences it names
        // do not live inside it: the `Instruction` contract).
        let instr = self.nodes[n]
            .instr
            .take()
            .expect("ivm-engine: node without instruction");
        instr.for_each_access(&mut |d, mode| {
            self.access(
                DepRef::External(NonNull::from(d)),
                n,
                mode == AccessMode::Write,
            );
        });
        self.nodes[n].instr = Some(instr);
        self.strict = false;
        if self.nodes[n].blocking == 0 {
            self.nodes[n].state = NodeState::Ready;
            self.ready.push_back(&mut self.nodes, n);
        }
    }

    /// The access list of `dep`.
    fn dep_list(&self, dep: DepRef) -> IndexList<OnDep> {
        match dep {
            // SAFETY: `d` is alive while an instruction naming it is lively (the
            // `Instruction` contract), and we are its engine (`&self` from `&mut self`
            // callers): engine only.
            DepRef::External(d) => unsafe { d.as_ref().list() },
            DepRef::Stream(s) => self.streams.as_slice()[s as usize].schedule,
            DepRef::None => unreachable!("ivm-engine: access without dependence"),
        }
    }

    fn set_dep_list(&mut self, dep: DepRef, list: IndexList<OnDep>) {
        match dep {
            // SAFETY: as in `dep_list`; `&mut self` makes us the only user.
            DepRef::External(d) => unsafe { d.as_ref().set_list(list) },
            DepRef::Stream(s) => self.streams.as_mut_slice()[s as usize].schedule = list,
            DepRef::None => unreachable!("ivm-engine: access without dependence"),
        }
    }

    /// One access of node `n` to `dep`: a write gets an edge from every access since the
    /// last write (which then leave the list) and becomes the list's only, leading access;
    /// a read gets an edge from the leading write, if any, and joins the list.
    fn access(&mut self, dep: DepRef, n: u32, write: bool) {
        let mut list = self.dep_list(dep);
        // Strictness applies to data dependences, never to the schedule dependence: from
        // this node's stream policy or `strict_edges` (`self.strict`), or the source's.
        let external = matches!(dep, DepRef::External(_));
        let here = self.strict;
        let strict_from = |this: &Self, src: u32| external && (here || this.nodes[src].strict_out);
        if write {
            let mut a = list.front();
            while let Some(i) = a {
                let (src, was_write) = (self.accesses[i].node, self.accesses[i].write);
                a = list.next(&self.accesses, i);
                if was_write || !self.planted_drop_read_write_edge() {
                    let strict = strict_from(self, src);
                    self.add_edge(src, n, strict);
                }
            }
            list.clear(&mut self.accesses, |_, _| {});
        } else if let Some(f) = list.front()
            && self.accesses[f].write
        {
            let src = self.accesses[f].node;
            let strict = strict_from(self, src);
            self.add_edge(src, n, strict);
        }
        let a = self
            .accesses
            .alloc()
            .expect("ivm-engine: access pool checked by reserve_for");
        let acc = &mut self.accesses[a];
        acc.node = n;
        acc.dep = dep;
        acc.write = write;
        self.nodes[n].accesses.push_back(&mut self.accesses, a);
        list.push_back(&mut self.accesses, a);
        self.set_dep_list(dep, list);
    }

    fn add_edge(&mut self, src: u32, dst: u32, strict: bool) {
        if src == dst {
            return;
        }
        let same_stream = self.nodes[src].stream == self.nodes[dst].stream;
        let strict = same_stream && strict;
        let src_dispatched = self.nodes[src].state == NodeState::Dispatched;
        if same_stream && !strict && src_dispatched {
            // The in-order stream already runs `src` before `dst`, and releases in order.
            return;
        }
        if src_dispatched {
            // `dst` waits for the release of an instruction already handed out.
            self.tell_awaited(src);
        }
        if let Some(e) = self.nodes[src].out.back()
            && self.edges[e].dst == dst
        {
            if strict && !self.edges[e].strict {
                // Upgrade (a schedule-dependence edge made just before), counting it as
                // blocking again if dispatch had already satisfied it.
                self.edges[e].strict = true;
                if self.edges[e].satisfied {
                    self.edges[e].satisfied = false;
                    self.nodes[dst].blocking += 1;
                }
            }
            return;
        }
        let e = self
            .edges
            .alloc()
            .expect("ivm-engine: edge pool checked by reserve_for");
        let edge = &mut self.edges[e];
        edge.dst = dst;
        edge.satisfied = false;
        edge.strict = strict;
        let mut out = self.nodes[src].out;
        out.push_back(&mut self.edges, e);
        self.nodes[src].out = out;
        let d = &mut self.nodes[dst];
        d.in_edges += 1;
        d.blocking += 1;
    }

    // ---- 2. dispatch ----------------------------------------------------------------

    fn dispatch_ready<X: Executor<I>>(&mut self, x: &mut X) -> usize {
        let mut n_dispatched = 0;
        while let Some(n) = self.ready.pop_front(&mut self.nodes) {
            if self.dispatch(n, x) {
                n_dispatched += 1;
            }
        }
        n_dispatched
    }

    /// Dispatches node `n` (popped off the ready list). False if it was held back.
    fn dispatch<X: Executor<I>>(&mut self, n: u32, x: &mut X) -> bool {
        let s = self.nodes[n].stream;
        let slot = &mut self.streams.as_mut_slice()[s as usize];
        if slot.claimed != NIL {
            // Its stream's last node runs on its caller's thread: wait for its release
            // (stream order; see `StreamSlot::claimed`).
            self.nodes[n].state = NodeState::Held;
            slot.held.push_back(&mut self.nodes, n);
            return false;
        }
        self.nodes[n].state = NodeState::Dispatched;
        if slot.running.is_empty() {
            self.active.push_back(self.streams.as_mut_slice(), s);
        }
        let slot = &mut self.streams.as_mut_slice()[s as usize];
        slot.running.push_back(&mut self.nodes, n);
        // Preschedule: same-stream successors no longer wait for this one.
        let mut e = self.nodes[n].out.front();
        // Whether anything still waits for this one's release (a barrier waits for every
        // instruction received before it; over-approximated as "any barrier pending").
        let mut awaited = !self.barriers.is_empty();
        while let Some(i) = e {
            e = self.nodes[n].out.next(&self.edges, i);
            let edge = &self.edges[i];
            let dst = edge.dst;
            if !edge.satisfied && !edge.strict && self.nodes[dst].stream == s {
                self.edges[i].satisfied = true;
                self.unblock(dst);
            } else if !edge.satisfied {
                awaited = true;
            }
        }
        let instr = self.nodes[n]
            .instr
            .as_ref()
            .expect("ivm-engine: node without instruction");
        if awaited {
            instr.awaited();
        }
        let ctx = DispatchCtx {
            nodes: self.nodes.slice(),
            running: self.streams.as_slice()[s as usize].running,
            node: n,
        };
        if x.dispatch(instr, &ctx) == Dispatched::Claimed {
            self.streams.as_mut_slice()[s as usize].claimed = n;
        }
        true
    }

    /// Tells dispatched node `n`'s instruction that something waits for its release
    /// ([`Instruction::awaited`]).
    fn tell_awaited(&self, n: u32) {
        if let Some(instr) = self.nodes[n].instr.as_ref() {
            instr.awaited();
        }
    }

    /// [`tell_awaited`](Self::tell_awaited) for every dispatched, unreleased node.
    fn tell_running_awaited(&self) {
        let mut next_stream = self.active.front();
        while let Some(s) = next_stream {
            let running = self.streams.as_slice()[s as usize].running;
            let mut r = running.front();
            while let Some(n) = r {
                r = running.next(&self.nodes, n);
                self.tell_awaited(n);
            }
            next_stream = self.active.next(self.streams.as_slice(), s);
        }
    }

    /// One blocking in-edge of `n` is satisfied; `n` becomes ready at the last one.
    fn unblock(&mut self, n: u32) {
        let d = &mut self.nodes[n];
        d.blocking -= 1;
        if d.blocking == 0 && d.state == NodeState::Waiting {
            d.state = NodeState::Ready;
            self.ready.push_back(&mut self.nodes, n);
        }
    }

    // ---- 3. release -----------------------------------------------------------------

    fn release_done<X: Executor<I>>(&mut self, x: &mut X) -> usize {
        let mut released = 0;
        let mut next_stream = self.active.front();
        while let Some(s) = next_stream {
            while let Some(f) = self.streams.as_slice()[s as usize].running.front() {
                if !self.releasable(f) {
                    break;
                }
                // PLANTED BUG (feature `planted-bugs`, off by default): out of order.
                let f = if self.planted_out_of_order_release() {
                    self.newest_without_in_edges(s).unwrap_or(f)
                } else {
                    f
                };
                let slot = &mut self.streams.as_mut_slice()[s as usize];
                slot.running.remove(&mut self.nodes, f);
                if slot.claimed == f {
                    // The caller ran it: the stream's held nodes go on, in order.
                    slot.claimed = NIL;
                    let mut held = core::mem::take(&mut slot.held);
                    let mut h = held.front();
                    while let Some(i) = h {
                        h = held.next(&self.nodes, i);
                        self.nodes[i].state = NodeState::Ready;
                    }
                    self.ready.splice_back(&mut self.nodes, &mut held);
                }
                self.release(f, x);
                released += 1;
            }
            next_stream = self.active.next(self.streams.as_slice(), s);
            if self.streams.as_slice()[s as usize].running.is_empty() {
                self.active.remove(self.streams.as_mut_slice(), s);
            }
        }
        released
    }

    /// Releases node `n` (done, no in-edges, off every queue): erases its accesses,
    /// removes its out-edges (readying successors), leaves the lively list, and hands the
    /// instruction back to the executor.
    fn release<X: Executor<I>>(&mut self, n: u32, x: &mut X) {
        let mut accesses = core::mem::take(&mut self.nodes[n].accesses);
        while let Some(a) = accesses.pop_front(&mut self.accesses) {
            if self.accesses[a].on_dep.is_linked() {
                let dep = self.accesses[a].dep;
                let mut list = self.dep_list(dep);
                list.remove(&mut self.accesses, a);
                self.set_dep_list(dep, list);
            }
            self.accesses[a].dep = DepRef::None;
            self.accesses.free(a);
        }
        let mut out = core::mem::take(&mut self.nodes[n].out);
        while let Some(e) = out.pop_front(&mut self.edges) {
            let Edge { dst, satisfied, .. } = self.edges[e];
            self.nodes[dst].in_edges -= 1;
            if !satisfied {
                self.unblock(dst);
            }
            self.edges.free(e);
        }
        self.lively.remove(&mut self.nodes, n);
        let instr = self.nodes[n]
            .instr
            .take()
            .expect("ivm-engine: releasing a node without instruction");
        self.nodes.free(n);
        x.released(instr);
    }

    // ---- 4. barriers ----------------------------------------------------------------

    fn run_barriers<X: Executor<I>>(&mut self, x: &mut X) -> (usize, usize) {
        let mut ran = 0;
        while self.barrier_at_front() {
            let n = self
                .barriers
                .front()
                .expect("ivm-engine: barrier list empty");
            let instr = self.nodes[n]
                .instr
                .as_ref()
                .expect("ivm-engine: barrier without instruction");
            if !x.run_barrier(instr) {
                break;
            }
            self.barriers.remove(&mut self.nodes, n);
            self.release(n, x);
            ran += 1;
        }
        (ran, ran)
    }

    // ---- planted bugs (feature `planted-bugs`) --------------------------------------

    #[cfg(feature = "planted-bugs")]
    fn planted_drop_read_write_edge(&self) -> bool {
        self.planted == PlantedBug::DropReadWriteEdge
    }
    #[cfg(not(feature = "planted-bugs"))]
    fn planted_drop_read_write_edge(&self) -> bool {
        false
    }

    #[cfg(feature = "planted-bugs")]
    fn planted_out_of_order_release(&self) -> bool {
        self.planted == PlantedBug::OutOfOrderRelease
    }
    #[cfg(not(feature = "planted-bugs"))]
    fn planted_out_of_order_release(&self) -> bool {
        false
    }

    /// Planted bug only: the newest node of stream `s`'s running list without in-edges.
    fn newest_without_in_edges(&self, s: u32) -> Option<u32> {
        let running = self.streams.as_slice()[s as usize].running;
        let mut n = running.back();
        while let Some(i) = n {
            if self.nodes[i].in_edges == 0 {
                return Some(i);
            }
            n = running.prev(&self.nodes, i);
        }
        None
    }

    // ---- views ----------------------------------------------------------------------

    /// Every lively instruction, oldest first, then the received ones not yet handled:
    /// for diagnostics (the no-progress report) and DAG dumps.
    pub fn lively(&self) -> impl Iterator<Item = Lively<'_, I, S>> + '_ {
        self.lively
            .iter(&self.nodes)
            .chain(self.pending.iter(&self.nodes))
            .map(move |n| Lively {
                engine: self,
                node: n,
            })
    }
}

impl<I, S: Storage<I>> Drop for Engine<I, S> {
    fn drop(&mut self) {
        // Unlink every access from its external dependence before the instructions (which
        // keep the dependences alive) go, so no dependence is left pointing into this
        // engine's pool.
        let mut n = self.lively.front();
        while let Some(i) = n {
            let mut a = self.nodes[i].accesses.front();
            while let Some(ai) = a {
                a = self.nodes[i].accesses.next(&self.accesses, ai);
                if let DepRef::External(d) = self.accesses[ai].dep
                    && self.accesses[ai].on_dep.is_linked()
                {
                    // SAFETY: node `i` is lively, so its instruction (still held) keeps
                    // `d` alive; `&mut self`: engine only.
                    let mut list = unsafe { d.as_ref().list() };
                    list.remove(&mut self.accesses, ai);
                    // SAFETY: as above.
                    unsafe { d.as_ref().set_list(list) };
                }
            }
            n = self.lively.next(&self.nodes, i);
        }
    }
}

/// What the engine knows about an instruction it is dispatching (see
/// [`Executor::dispatch`]).
pub struct DispatchCtx<'a, I> {
    nodes: &'a [Node<I>],
    running: IndexList<Queue>,
    node: u32,
}

impl<'a, I> DispatchCtx<'a, I> {
    /// The instruction's stream.
    pub fn stream(&self) -> u32 {
        self.nodes[self.node as usize].stream
    }

    /// Whether every source of the instruction is **released** (done, not merely
    /// dispatched).
    pub fn sources_released(&self) -> bool {
        self.nodes[self.node as usize].in_edges == 0
    }

    /// Whether it is the only dispatched, unreleased instruction of its stream (so no
    /// earlier instruction of the stream, which got no edge to it, is still running).
    pub fn alone_on_stream(&self) -> bool {
        self.running.len() == 1 && self.running.front() == Some(self.node)
    }

    /// The rule for running an access on a thread other than its stream's (the driving
    /// thread, a waiting caller): every source released and alone on its stream. Then
    /// every other accessor of its data is ordered by an edge from or to it. The stream
    /// must also allow it ([`StreamPolicy::may_run_on_caller`]), which the executor
    /// checks with the policy it knows.
    pub fn sole_access(&self) -> bool {
        self.sources_released() && self.alone_on_stream()
    }

    /// The other dispatched, unreleased instructions of its stream, oldest first.
    pub fn others_on_stream(&self) -> impl Iterator<Item = &'a I> + '_ {
        self.running
            .iter(self.nodes)
            .filter(move |&m| m != self.node)
            .filter_map(move |m| self.nodes[m as usize].instr.as_ref())
    }
}

/// One lively (or received) instruction seen through [`Engine::lively`].
pub struct Lively<'a, I, S: Storage<I>> {
    engine: &'a Engine<I, S>,
    node: u32,
}

impl<'a, I: Instruction, S: Storage<I>> Lively<'a, I, S> {
    /// The instruction.
    pub fn instr(&self) -> &'a I {
        self.engine.nodes[self.node]
            .instr
            .as_ref()
            .expect("ivm-engine: lively node without instruction")
    }

    /// Where it is in its life.
    pub fn state(&self) -> NodeState {
        self.engine.nodes[self.node].state
    }

    /// In-edges whose source is not released.
    pub fn in_edges(&self) -> u32 {
        self.engine.nodes[self.node].in_edges
    }

    /// Its out-edges.
    pub fn out_edges(&self) -> impl Iterator<Item = OutEdge<'a, I>> + 'a {
        let e = self.engine;
        e.nodes[self.node].out.iter(&e.edges).map(move |i| {
            let edge = &e.edges[i];
            OutEdge {
                to: e.nodes[edge.dst]
                    .instr
                    .as_ref()
                    .expect("ivm-engine: edge to a node without instruction"),
                satisfied: edge.satisfied,
                strict: edge.strict,
            }
        })
    }

    /// The sources of its in-edges that are not released, found by scanning the lively
    /// instructions (diagnostic path: O(lively × edges)).
    pub fn sources(&self) -> impl Iterator<Item = &'a I> + 'a {
        let e = self.engine;
        let me = self.node;
        e.lively.iter(&e.nodes).filter_map(move |m| {
            let src = &e.nodes[m];
            src.out
                .iter(&e.edges)
                .any(|i| e.edges[i].dst == me)
                .then_some(())
                .and(src.instr.as_ref())
        })
    }
}

/// An edge seen through [`Lively::out_edges`].
pub struct OutEdge<'a, I> {
    /// The instruction that waits.
    pub to: &'a I,
    /// Satisfied by dispatch order (its source was dispatched on the same in-order stream).
    pub satisfied: bool,
    /// Kept until the source's release although same-stream
    /// ([`StreamPolicy::strict_same_stream_edges`]).
    pub strict: bool,
}

#[cfg(test)]
mod tests;
