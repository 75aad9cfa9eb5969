//! Step 2, dispatch: ready instructions go to their stream's executor (or wait behind a
//! claimed one), their same-stream successors are prescheduled, and an instruction is told
//! when something waits for its release. [`DispatchCtx`] is what the executor is shown.
//!
//! Separate because it is the one step that hands instructions out.

use ivm_core::list::{IndexList, NIL};

use super::Engine;
use super::slots::{Node, NodeState, Queue};
use crate::pool::{Slots, Storage};
use crate::{Dispatched, Executor, Instruction};

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
    // ---- 2. dispatch ----------------------------------------------------------------

    pub(super) fn dispatch_ready<X: Executor<I>>(&mut self, x: &mut X) -> usize {
        let mut n_dispatched = 0;
        while let Some(n) = self.ready.pop_front(&mut self.nodes) {
            n_dispatched += self.dispatch(n, x);
        }
        n_dispatched
    }

    /// Dispatches node `n` (popped off the ready list) and, with fusion on, the fused run
    /// it heads. Returns how many it dispatched (0 if `n` was held back).
    fn dispatch<X: Executor<I>>(&mut self, n: u32, x: &mut X) -> usize {
        let s = self.nodes[n].stream;
        let slot = &mut self.streams.as_mut_slice()[s as usize];
        if slot.claimed != NIL {
            // Its stream's last node runs on its caller's thread: wait for its release
            // (stream order; see `StreamSlot::claimed`).
            self.nodes[n].state = NodeState::Held;
            slot.held.push_back(&mut self.nodes, n);
            return 0;
        }
        let (mut n, mut index) = (n, 0);
        loop {
            self.start_running(n);
            // Asked after `n`'s prescheduling, which may just have readied the next member.
            let next = self.next_member(n, index);
            let instr = self.nodes[n]
                .instr
                .as_ref()
                .expect("ivm-engine: node without instruction");
            let ctx = DispatchCtx {
                nodes: self.nodes.slice(),
                running: self.streams.as_slice()[s as usize].running,
                node: n,
                run_index: index,
                run_continues: next.is_some(),
            };
            if x.dispatch(instr, &ctx) == Dispatched::Claimed {
                // Runs on its caller, out of stream order: it ends the run, and the rest
                // of the stream waits in `held` until its release.
                self.streams.as_mut_slice()[s as usize].claimed = n;
                return index + 1;
            }
            let Some(m) = next else {
                return index + 1;
            };
            if self.nodes[m].state == NodeState::Ready {
                // Off the ready list (only a planted bug fuses a node that is not on it).
                self.ready.remove(&mut self.nodes, m);
            }
            (n, index) = (m, index + 1);
        }
    }

    /// Node `n` (ready, its stream not held) becomes dispatched: it joins its stream's
    /// running list, its same-stream successors are prescheduled, and it is told whether
    /// anything waits for its release.
    fn start_running(&mut self, n: u32) {
        let s = self.nodes[n].stream;
        self.nodes[n].state = NodeState::Dispatched;
        if self.streams.as_slice()[s as usize].running.is_empty() {
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
        if awaited {
            self.tell_awaited(n);
        }
    }

    /// The member after `n` (member `index` of a fused run, just dispatched) if the run
    /// goes on: fusion is on and the run is shorter than the bound, `n` and its stream
    /// fuse, and the next lively instruction in build order is on the same stream,
    /// fusable and ready now — so no barrier and no unreleased instruction of another
    /// stream lies between them (a released one has finished: nothing waits for it), and
    /// its dependences outside the run were satisfied together with those of the members
    /// before it (prescheduling satisfied its edges from them).
    fn next_member(&self, n: u32, index: usize) -> Option<u32> {
        if index + 1 >= self.max_run {
            return None;
        }
        let s = self.nodes[n].stream;
        if !self.streams.as_slice()[s as usize].fuse || !self.node_fusable(n) {
            return None;
        }
        let m = self.lively.next(&self.nodes, n)?;
        let next = &self.nodes[m];
        let ready = next.state == NodeState::Ready
            // PLANTED BUG (feature `planted-bugs`, off by default): fuses a member whose
            // dependences outside the run are not satisfied yet.
            || (next.state == NodeState::Waiting && self.planted_fuse_waiting());
        (next.stream == s && ready && self.node_fusable(m)).then_some(m)
    }

    fn node_fusable(&self, n: u32) -> bool {
        self.nodes[n].instr.as_ref().is_some_and(I::fusable)
    }

    /// Tells dispatched node `n`'s instruction that something waits for its release
    /// ([`Instruction::awaited`]).
    pub(super) fn tell_awaited(&self, n: u32) {
        if let Some(instr) = self.nodes[n].instr.as_ref() {
            instr.awaited();
        }
    }

    /// [`tell_awaited`](Self::tell_awaited) for every dispatched, unreleased node.
    pub(super) fn tell_running_awaited(&self) {
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
    pub(super) fn unblock(&mut self, n: u32) {
        let d = &mut self.nodes[n];
        d.blocking -= 1;
        if d.blocking == 0 && d.state == NodeState::Waiting {
            d.state = NodeState::Ready;
            self.ready.push_back(&mut self.nodes, n);
        }
    }
}

/// What the engine knows about an instruction it is dispatching (see
/// [`Executor::dispatch`]).
pub struct DispatchCtx<'a, I> {
    nodes: &'a [Node<I>],
    running: IndexList<Queue>,
    node: u32,
    run_index: usize,
    run_continues: bool,
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
    ///
    /// [`StreamPolicy::may_run_on_caller`]: crate::StreamPolicy::may_run_on_caller
    pub fn sole_access(&self) -> bool {
        self.sources_released() && self.alone_on_stream()
    }

    /// Its place in a fused run ([`Engine::set_max_run`](crate::Engine::set_max_run)):
    /// 0 for a run's first member and an instruction dispatched alone, then 1, 2... for
    /// the members dispatched right after it, each in its own call.
    pub fn run_index(&self) -> usize {
        self.run_index
    }

    /// Whether the engine's next [`dispatch`](crate::Executor::dispatch) call is the next
    /// member of this fused run (same stream, next in build order), unless this one is
    /// claimed ([`Dispatched::Claimed`](crate::Dispatched::Claimed) ends the run). An
    /// executor may collect a run's members and hand them over as one unit at the last
    /// (`!run_continues()`); run in order, each is still done, and released, on its own.
    pub fn run_continues(&self) -> bool {
        self.run_continues
    }

    /// The other dispatched, unreleased instructions of its stream, oldest first.
    pub fn others_on_stream(&self) -> impl Iterator<Item = &'a I> + '_ {
        self.running
            .iter(self.nodes)
            .filter(move |&m| m != self.node)
            .filter_map(move |m| self.nodes[m as usize].instr.as_ref())
    }
}
