//! Introspection entry points of [`VirtualMachine`]: [`stats`](VirtualMachine::stats) and
//! the DAG dump (the counters and the dump format are in `engine/stats.rs`).

use super::VirtualMachine;
use crate::engine::core::Probe;
use crate::engine::stats::{Dag, DagSlot, StreamStats, ThreadStats, VmStats};
use crate::util::error::{Diagnostic, Error, Result};
use crate::util::futex::FutexWait;
use crate::util::ids::StreamId;
use crate::util::lock;
use ivm_core::counter::BlockingCounter;
use ivm_core::notifier::Timed;
use ivm_core::sync::Ordering;
use ivm_core::wait::Wait;
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl VirtualMachine {
    /// A cheap snapshot of the VM's counters: no round trip to the scheduler (see
    /// [`crate::engine::stats`]).
    ///
    /// # Errors
    /// [`Error::Forked`] in a fork child. Works after shutdown (the final counters).
    pub fn stats(&self) -> Result<VmStats> {
        let shared = self.shared_state();
        shared.core.birth().check()?;
        let c = shared.core.stats();
        // Relaxed loads throughout: statistics (see the module docs).
        let flying = shared.core.flying();
        let released = shared.core.released();
        let lively = c.lively.load(Ordering::Relaxed);
        let mut streams: Vec<(u32, StreamId)> = lock(&shared.registry)
            .streams
            .values()
            .map(|s| (s.index, s.id))
            .collect();
        streams.push((shared.barrier_stream.index, shared.barrier_stream.id));
        streams.sort_unstable_by_key(|(i, _)| *i);
        let streams = streams
            .into_iter()
            .filter_map(|(i, id)| {
                c.running.get(i as usize).map(|r| StreamStats {
                    id,
                    running: r.load(Ordering::Relaxed) as usize,
                })
            })
            .collect();
        let threads = lock(&c.threads)
            .iter()
            .map(|t| ThreadStats {
                name: t.name.clone(),
                parks: t.parks.load(Ordering::Relaxed),
                wakes: t.wakes.load(Ordering::Relaxed),
                preempted: t.preempted.load(Ordering::Relaxed),
                cpu_shared: t.cpu_shared.load(Ordering::Relaxed),
                handed_over: t.handed_over.load(Ordering::Relaxed),
            })
            .collect();
        Ok(VmStats {
            vm_id: shared.id,
            flying,
            received: released + flying,
            released,
            pending: flying.saturating_sub(lively),
            lively,
            ready: c.ready.load(Ordering::Relaxed),
            streams,
            running_other_streams: c.running_other.load(Ordering::Relaxed),
            caller_ran: c.caller_ran.load(Ordering::Relaxed),
            caller_preempted: c.caller_preempted.load(Ordering::Relaxed),
            crowded: c.crowded.load(Ordering::Relaxed),
            worker_stalled: c.worker_stalled.load(Ordering::Relaxed),
            tiny_kernel_marks: c.tiny_kernel_marks.load(Ordering::Relaxed),
            fused_runs: c.fused_runs.load(Ordering::Relaxed),
            fused_instructions: c.fused_instructions.load(Ordering::Relaxed),
            longest_fused_run: c.longest_fused_run.load(Ordering::Relaxed),
            ran_at_rest: c.ran_at_rest.load(Ordering::Relaxed),
            threads,
        })
    }

    /// The lively instruction DAG, taken by the engine's owner (exact; waits for the
    /// scheduler, see [`crate::engine::stats`]). Render it with [`Dag::to_text`] or
    /// [`Dag::to_dot`].
    ///
    /// # Errors
    /// [`Error::Reentrant`] from a VM thread, kernel, callback or barrier;
    /// [`Error::ShutDown`]; [`Error::Forked`]; [`Error::Timeout`] when the scheduler does
    /// not answer in time.
    pub fn dump_dag(&self) -> Result<Dag> {
        let shared = self.shared_state();
        shared.core.check_caller()?;
        if let Some(engine) = shared.core.lock_engine() {
            return Ok(engine.dag());
        }
        let slot = Arc::new(DagSlot {
            done: BlockingCounter::new(1),
            value: Mutex::new(None),
        });
        shared.core.submit_probe(Probe::Dag(slot.clone()));
        let wait = shared
            .core
            .config()
            .timeout_period
            .min(Duration::from_secs(2));
        let _hook = shared.core.wait_scope();
        let deadline = FutexWait::now().saturating_add(wait);
        match slot.done.timed_wait_until_zero(deadline) {
            Ok(Timed::Notified) => lock(&slot.value).take().ok_or(Error::ShutDown),
            _ => Err(Error::Timeout(Diagnostic {
                scheduler_unresponsive: true,
                ..Diagnostic::default()
            })),
        }
    }
}
