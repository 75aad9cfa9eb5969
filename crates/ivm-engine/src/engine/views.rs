//! Read-only views for diagnostics and DAG dumps: [`Engine::lively`] and what it yields
//! ([`Lively`], [`OutEdge`]).
//!
//! Separate because nothing here changes the engine.

use super::Engine;
use super::slots::NodeState;
use crate::Instruction;
use crate::pool::Storage;

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
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
    ///
    /// [`StreamPolicy::strict_same_stream_edges`]: crate::StreamPolicy::strict_same_stream_edges
    pub strict: bool,
}
