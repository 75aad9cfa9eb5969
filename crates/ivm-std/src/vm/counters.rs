//! A [`VirtualMachine`]'s cheap counters for tests and benchmarks: instructions in flight,
//! the small accesses done without a worker or through an express lane, live engine
//! objects.

use ivm_core::sync::Ordering;

use super::VirtualMachine;
use crate::engine::DebugCounters;
#[cfg(doc)]
use crate::util::config::Config;

impl VirtualMachine {
    /// Instructions received and not yet released.
    pub fn flying_instruction_count(&self) -> usize {
        self.shared.core.flying()
    }

    /// How many small sync accesses ran without a worker (see
    /// [`Config::inline_sync_access`]): `(direct, inline)` — done by their caller with no
    /// instruction at all (nothing in flight), or run as an instruction by the thread that
    /// drove the engine. For tests and benchmarks.
    #[doc(hidden)]
    pub fn debug_inline_accesses(&self) -> (usize, usize) {
        self.shared.core.inline_accesses()
    }

    /// How many small sync accesses the VM's polling workers did through their express
    /// lanes (`model/express.rs`: no instruction, the engine at rest). For tests and
    /// benchmarks.
    #[doc(hidden)]
    pub fn debug_express_accesses(&self) -> usize {
        let mut n = 0;
        let mut k = 0;
        while let Some(ctx) = self.shared.core.worker(k) {
            // Relaxed: a statistic.
            n += ctx.express_served.load(Ordering::Relaxed);
            k += 1;
        }
        n
    }

    /// Live engine objects and instructions in flight. After `shutdown` all are zero.
    #[doc(hidden)]
    pub fn debug_counters(&self) -> DebugCounters {
        let (instructions, accesses, edges) = self.shared.core.live_counts();
        DebugCounters {
            instructions,
            accesses,
            edges,
            flying: self.shared.core.flying(),
        }
    }
}
