//! The engine's side of introspection (a child module of `engine`): publishing the stats
//! counters after a step, and the DAG dump.

use ivm_core::sync::Ordering;
use ivm_engine::NodeState as EngineState;

use super::Engine;
use crate::engine::stats::{Dag, DagEdge, DagNode, NodeState, StatsCells, TRACKED_STREAMS};
use crate::model::instruction::status;

impl Engine {
    /// Publishes the engine-side stats counters (Relaxed stores; statistics only).
    pub(crate) fn publish_stats(&self, cells: &StatsCells) {
        cells
            .lively
            .store(self.core.lively_len(), Ordering::Relaxed);
        cells
            .engine_pending
            .store(self.core.pending_len(), Ordering::Relaxed);
        cells.ready.store(self.core.ready_len(), Ordering::Relaxed);
        let streams = self.core.stream_count();
        let mut other = 0usize;
        for i in 0..streams {
            let len = self.core.running_len(i as u32);
            match cells.running.get(i) {
                Some(c) => c.store(len as u32, Ordering::Relaxed),
                None => other += len,
            }
        }
        if streams > TRACKED_STREAMS || other > 0 {
            cells.running_other.store(other, Ordering::Relaxed);
        }
    }

    /// Every lively instruction and the edges between them, oldest first.
    pub(crate) fn dag(&self) -> Dag {
        let mut d = Dag {
            pending: self.core.pending_len(),
            ..Dag::default()
        };
        for l in self.core.lively() {
            let state = match l.state() {
                EngineState::Pending => continue,
                EngineState::Barrier => NodeState::Barrier,
                EngineState::Waiting => NodeState::Waiting,
                EngineState::Ready | EngineState::Held => NodeState::Ready,
                EngineState::Dispatched => NodeState::Dispatched,
            };
            let instr = &l.instr().0;
            // Relaxed: diagnostic bits.
            let st = instr.status.load(Ordering::Relaxed);
            d.nodes.push(DagNode {
                id: instr.id,
                name: instr.label(),
                stream: instr.stream.id.to_string(),
                state,
                launched: st & status::LAUNCHED != 0,
                done: st & status::DONE != 0,
                failed: st & status::FAILED != 0,
            });
            for e in l.out_edges() {
                d.edges.push(DagEdge {
                    from: instr.id,
                    to: e.to.0.id,
                    satisfied: e.satisfied,
                    strict: e.strict,
                });
            }
        }
        d
    }
}
