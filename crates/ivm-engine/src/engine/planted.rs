//! Bugs planted on purpose (feature `planted-bugs`): the `PlantedBug` switch and the
//! checks the steps make of it.
//!
//! Separate so that the real engine reads without them; the `fn planted_*` bodies are
//! what `.ci/ordering_mutants.sh` skips.

use super::Engine;
use crate::Instruction;
use crate::pool::{Slots, Storage};

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
    /// A fused run takes in the next instruction of its stream while that one still waits
    /// for a dependence from outside the run.
    FuseWaiting,
}

impl<I: Instruction, S: Storage<I>> Engine<I, S> {
    /// Plants `bug` (feature `planted-bugs`; tests of equivalence checkers only).
    #[cfg(feature = "planted-bugs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "planted-bugs")))]
    pub fn plant(&mut self, bug: PlantedBug) {
        self.planted = bug;
    }

    // ---- planted bugs (feature `planted-bugs`) --------------------------------------

    #[cfg(feature = "planted-bugs")]
    pub(super) fn planted_drop_read_write_edge(&self) -> bool {
        self.planted == PlantedBug::DropReadWriteEdge
    }
    #[cfg(not(feature = "planted-bugs"))]
    pub(super) fn planted_drop_read_write_edge(&self) -> bool {
        false
    }

    #[cfg(feature = "planted-bugs")]
    pub(super) fn planted_out_of_order_release(&self) -> bool {
        self.planted == PlantedBug::OutOfOrderRelease
    }
    #[cfg(not(feature = "planted-bugs"))]
    pub(super) fn planted_out_of_order_release(&self) -> bool {
        false
    }

    #[cfg(feature = "planted-bugs")]
    pub(super) fn planted_fuse_waiting(&self) -> bool {
        self.planted == PlantedBug::FuseWaiting
    }
    #[cfg(not(feature = "planted-bugs"))]
    pub(super) fn planted_fuse_waiting(&self) -> bool {
        false
    }

    /// Planted bug only: the newest node of stream `s`'s running list without in-edges.
    pub(super) fn newest_without_in_edges(&self, s: u32) -> Option<u32> {
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
}
