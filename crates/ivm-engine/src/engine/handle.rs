//! Step 1, handling received instructions: reserving pool room, then turning each access
//! into edges (from the accesses since the last write of its dependence) and onto its
//! dependence's access list.
//!
//! Separate because it is where the dependence graph is built; the other steps only
//! consume it.

use core::ptr::NonNull;

use ivm_core::list::IndexList;

use super::Engine;
use super::slots::{DepRef, NodeState, OnDep};
use crate::dependence::{AccessMode, Dependence};
use crate::pool::{Slots, Storage};
use crate::{Instruction, Stalled};

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
    // ---- 1. handle pending ----------------------------------------------------------

    pub(super) fn handle_pending(&mut self) -> usize {
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
    pub(super) fn dep_list(&self, dep: DepRef) -> IndexList<OnDep> {
        match dep {
            // SAFETY: `d` is alive while an instruction naming it is lively (the
            // `Instruction` contract), and we are its engine (`&self` from `&mut self`
            // callers): engine only.
            DepRef::External(d) => unsafe { d.as_ref().list() },
            DepRef::Stream(s) => self.streams.as_slice()[s as usize].schedule,
            DepRef::None => unreachable!("ivm-engine: access without dependence"),
        }
    }

    pub(super) fn set_dep_list(&mut self, dep: DepRef, list: IndexList<OnDep>) {
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
}
