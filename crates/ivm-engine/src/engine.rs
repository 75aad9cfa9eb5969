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
//!
//! The engine's state, its entry points ([`Engine::submit`], [`Engine::step`]) and its
//! queries are here; the rest is split by concept, each an `impl Engine` block or the
//! types it needs: `slots` (what the pools hold), `handle` (1. handling received
//! instructions: accesses and edges), `dispatch` (2. dispatch, and [`DispatchCtx`]),
//! `release` (3. release, 4. barriers), `views` (the lively walk) and `planted` (bugs
//! planted on purpose).
//!
//! [`Dependence`]: crate::Dependence

use ivm_core::list::{IndexList, NIL};

use crate::pool::{Slab, Slots, Storage};
use crate::{Executor, Full, Instruction, Stalled, StreamPolicy};

mod dispatch;
mod handle;
mod planted;
mod release;
mod slots;
mod views;

pub use dispatch::DispatchCtx;
#[cfg(feature = "planted-bugs")]
pub use planted::PlantedBug;
pub(crate) use slots::OnDep;
pub use slots::{AccessSlot, Edge, Node, NodeState, StreamSlot};
use slots::{Active, DepRef, LivelyTag, Queue};
pub use views::{Lively, OutEdge};

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
    /// The longest fused run (1: fusion off).
    max_run: usize,
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
            max_run: 1,
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

    /// The longest fused run, in instructions: at most `max_run` consecutive ready
    /// instructions of one stream are dispatched as one run ([`DispatchCtx::run_index`],
    /// [`DispatchCtx::run_continues`]). 1 (the default) turns fusion off; 0 counts as 1.
    /// A bound keeps one hand-over from holding a stream's worker, and the release of the
    /// run's members, for more than a few instructions' time.
    pub fn set_max_run(&mut self, max_run: usize) {
        self.max_run = max_run.max(1);
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
            slot.fuse = instr.policy().may_fuse();
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

#[cfg(test)]
mod tests;
