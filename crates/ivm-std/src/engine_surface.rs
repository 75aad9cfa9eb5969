//! The engine's side of introspection (a child module of `engine`, so it reads the
//! engine's private state): publishing the stats counters after a step, and the DAG dump.

use ivm_core::sync::Ordering;

use super::{Engine, NodeState as EngineState};
use crate::instruction::status;
use crate::slab::NIL;
use crate::stats::{Dag, DagEdge, DagNode, NodeState, StatsCells, TRACKED_STREAMS};

impl Engine {
    /// Publishes the engine-side stats counters (Relaxed stores; statistics only).
    pub(crate) fn publish_stats(&self, cells: &StatsCells) {
        cells.lively.store(self.nodes.live(), Ordering::Relaxed);
        cells
            .engine_pending
            .store(self.pending.len(), Ordering::Relaxed);
        cells.ready.store(self.ready.len(), Ordering::Relaxed);
        let mut other = 0usize;
        for (i, es) in self.streams.iter().enumerate() {
            let len = es.as_ref().map_or(0, |es| es.running.len);
            match cells.running.get(i) {
                Some(c) => c.store(len, Ordering::Relaxed),
                None => other += len as usize,
            }
        }
        if self.streams.len() > TRACKED_STREAMS || other > 0 {
            cells.running_other.store(other, Ordering::Relaxed);
        }
    }

    /// Every lively instruction and the edges between them, oldest first.
    pub(crate) fn dag(&self) -> Dag {
        let mut d = Dag {
            pending: self.pending.len(),
            ..Dag::default()
        };
        let mut n = self.lively.head;
        while n != NIL {
            let node = &self.nodes[n];
            if let Some(instr) = &node.instr {
                // Relaxed: diagnostic bits.
                let st = instr.status.load(Ordering::Relaxed);
                let state = if instr.barrier && node.state != EngineState::Dispatched {
                    NodeState::Barrier
                } else {
                    match node.state {
                        EngineState::Waiting => NodeState::Waiting,
                        EngineState::Ready => NodeState::Ready,
                        EngineState::Dispatched => NodeState::Dispatched,
                    }
                };
                d.nodes.push(DagNode {
                    id: instr.id,
                    name: instr.label(),
                    stream: instr.stream.id.to_string(),
                    state,
                    launched: st & status::LAUNCHED != 0,
                    done: st & status::DONE != 0,
                    failed: st & status::FAILED != 0,
                });
                for e in &node.out {
                    if let Some(dst) = &self.nodes[e.dst].instr {
                        d.edges.push(DagEdge {
                            from: instr.id,
                            to: dst.id,
                            satisfied: e.satisfied,
                            strict: e.strict,
                        });
                    }
                }
            }
            n = node.lively.next;
        }
        d
    }
}
