//! Steps 3 and 4, the end of an instruction's life: done instructions are released in
//! order per stream (their accesses erased, their out-edges removed), and barriers run and
//! are released once they are the oldest lively instruction.
//!
//! Separate because it is where the engine's pools are freed.

use ivm_core::list::NIL;

use super::Engine;
use super::slots::{DepRef, Edge, NodeState};
use crate::pool::{Slots, Storage};
use crate::{Executor, Instruction};

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
    // ---- 3. release -----------------------------------------------------------------

    pub(super) fn release_done<X: Executor<I>>(&mut self, x: &mut X) -> usize {
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

    pub(super) fn run_barriers<X: Executor<I>>(&mut self, x: &mut X) -> (usize, usize) {
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
}
