//! Device work the VM stopped waiting for, named by later timeouts.
//!
//! Before a failed launch poisons its outputs, the stream's worker drains the device
//! stream, bounded by the timeout period (`engine/device_launch/completion.rs`). When the
//! device never finishes what was queued there (an event that never completes), the
//! drain gives up, the failed instruction is done and released, and the work after it
//! goes on. The stuck device work is then held by no lively instruction: a caller whose
//! wait times out a moment later (its wait and the drain run for the same period) would
//! get a diagnostic that names nothing stuck, only the instructions dispatched since. So
//! the drain leaves the event it gave up on here, before its instruction is done, and
//! every diagnostic names that device work for as long as the event stays uncompleted.

use std::sync::{Arc, Mutex};

use crate::device::Event;
use crate::util::error::LivelyInstruction;
use crate::util::ids::StreamId;
use crate::util::lock;

/// The most streams remembered at once: one entry per stream (a later give-up on the
/// same stream replaces the earlier), the oldest forgotten past this.
const MAX: usize = 16;

/// The device work drains gave up on, per stream, while its event is uncompleted.
#[derive(Default)]
pub(crate) struct GivenUpWork {
    entries: Mutex<Vec<Entry>>,
}

struct Entry {
    stream: StreamId,
    /// The instruction whose drain gave up (the stuck work is queued before it).
    before: String,
    event: Arc<dyn Event>,
}

impl GivenUpWork {
    /// A drain on `stream`, before `before` failed, gave up waiting for `event`.
    pub(crate) fn record(&self, stream: StreamId, before: String, event: Arc<dyn Event>) {
        let mut entries = lock(&self.entries);
        entries.retain(|e| e.stream != stream && !e.event.query());
        if entries.len() == MAX {
            entries.remove(0);
        }
        entries.push(Entry {
            stream,
            before,
            event,
        });
    }

    /// The given-up work still uncompleted, oldest first, as diagnostic entries
    /// (`device work of <stream> (before <instruction>)`); the completed is forgotten.
    pub(crate) fn still_stuck(&self) -> Vec<LivelyInstruction> {
        let mut entries = lock(&self.entries);
        entries.retain(|e| !e.event.query());
        entries
            .iter()
            .map(|e| LivelyInstruction::device_work(e.stream, Some(e.before.clone())))
            .collect()
    }
}

impl std::fmt::Debug for GivenUpWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GivenUpWork")
            .field("entries", &lock(&self.entries).len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Device, HostFn};
    use ivm_core::sync::{AtomicBool, Ordering};

    /// An event completed by the test.
    #[derive(Debug, Default)]
    struct Flag(AtomicBool);

    impl Event for Flag {
        fn device(&self) -> Device {
            Device::CPU
        }
        fn query(&self) -> bool {
            self.0.load(Ordering::Relaxed)
        }
        fn synchronize(&self) -> crate::Result<()> {
            Ok(())
        }
        fn on_complete(&self, f: HostFn) {
            f();
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn given_up_work_is_named_until_its_event_completes() {
        let g = GivenUpWork::default();
        let s = StreamId::default_for(Device::CPU);
        let ev = Arc::new(Flag::default());
        g.record(s, "kernel#7".into(), ev.clone());
        let named = g.still_stuck();
        assert_eq!(named.len(), 1);
        assert!(named[0].launched && !named[0].done);
        assert_eq!(
            named[0].name,
            format!("device work of {s} (before kernel#7)")
        );
        // A later give-up on the same stream replaces it.
        g.record(s, "kernel#9".into(), ev.clone());
        assert_eq!(g.still_stuck().len(), 1);
        ev.0.store(true, Ordering::Relaxed);
        assert!(g.still_stuck().is_empty(), "completed work is forgotten");
    }
}
