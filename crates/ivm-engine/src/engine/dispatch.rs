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

    /// The other dispatched, unreleased instructions of its stream, oldest first.
    pub fn others_on_stream(&self) -> impl Iterator<Item = &'a I> + '_ {
        self.running
            .iter(self.nodes)
            .filter(move |&m| m != self.node)
            .filter_map(move |m| self.nodes[m as usize].instr.as_ref())
    }
}
