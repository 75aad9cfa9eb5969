//! Soft sync: cross-stream order on asynchronous devices (ARCHITECTURE.md, "Cross-stream order:
//! soft sync").
//!
//! Before an instruction uses a tensor on stream S while the tensor was last used on
//! stream L ≠ S:
//! * both on one device, both supporting events, neither on a thread of its own (and
//!   [`Config::stream_wait`](crate::Config::stream_wait) on): a device-side **stream wait**
//!   — one instruction on S (record on L, wait on S) when L and S share a worker thread, a
//!   record-event instruction on L plus a wait-event instruction on S otherwise;
//! * else, only when L is done at launch and supports events (a device compute stream): a
//!   **record event** on L, done when the event completes, so that L's device work on the
//!   tensor becomes observable by the host before S's instruction is dispatched;
//! * streams without events (cpu, critical section, launcher) need nothing.
//!
//! The sync instructions *write* the tensors they order, so that the instruction on S
//! (read or write) gets an edge from them. Then the tensor's last-used stream becomes S.
//!
//! The last-used stream is per tensor and updated when an instruction is built (one atomic
//! swap, or a load that finds it already there; nothing in a VM without events, which
//! never consults it): several threads building instructions on the same device tensor at once must
//! order their `run`s themselves (as in OneFlow, the bookkeeping follows the build order).

use std::sync::Arc;

use ivm_core::sync::{AtomicU32, Ordering};

use crate::device::policy::Placement;
use crate::model::blob::Blob;
use crate::model::instruction::{EventSlot, Instruction, Kind, Operands};
use crate::model::stream::StreamShared;
use crate::runtime::shared::VmShared;
use ivm_core::list::NIL;

/// What soft sync emits between two streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    Nothing,
    /// One instruction on S: record on L, wait on S (L and S share a thread).
    StreamWait,
    /// Record an event on L, wait for it on S.
    RecordAndWait,
    /// Record an event on L; done (observed by the host) when it completes.
    RecordForHost,
}

/// The soft-sync rule between the last-used stream `l` and the new stream `s`.
pub(crate) fn plan(l: &StreamShared, s: &StreamShared, stream_wait: bool) -> Plan {
    if l.index == s.index {
        return Plan::Nothing;
    }
    let own = |x: &StreamShared| x.policy.placement() == Placement::OwnWorker;
    let (le, se) = (l.policy.supports_events(), s.policy.supports_events());
    if stream_wait && l.id.device == s.id.device && le && se && !own(l) && !own(s) {
        let same_thread = match (&l.thread, &s.thread) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            // Single-thread mode: everything runs on the caller's thread.
            (None, None) => true,
            _ => false,
        };
        if same_thread {
            Plan::StreamWait
        } else {
            Plan::RecordAndWait
        }
    } else if le && l.policy.done_at_launch() {
        Plan::RecordForHost
    } else {
        Plan::Nothing
    }
}

/// One tensor about to be used: its last-used stream (index) and its blob.
pub(crate) struct Use<'a> {
    pub(crate) last: &'a AtomicU32,
    pub(crate) blob: &'a Arc<Blob>,
}

fn sync_instruction(
    vm: &VmShared,
    name: &'static str,
    stream: &Arc<StreamShared>,
    kind: Kind,
    blobs: &Operands,
) -> Arc<Instruction> {
    let instr = vm.core.pool().instruction(name, stream, kind);
    {
        // SAFETY: not shared yet; we own the body (ownership step 1).
        let body = unsafe { instr.body_mut() };
        for b in blobs.as_slice() {
            body.outputs.push(b.clone());
        }
    }
    instr
}

/// Emits (through `push`, in order) the soft-sync instructions needed before `uses` are used
/// on `s`, and makes `s` their last-used stream. Does nothing in a VM whose adapters have
/// no events (cpu only).
pub(crate) fn before_use<'a>(
    vm: &VmShared,
    uses: impl IntoIterator<Item = Use<'a>>,
    s: &Arc<StreamShared>,
    push: &mut dyn FnMut(Arc<Instruction>),
) {
    if !vm.events {
        // Without events no plan is ever consulted, for the VM's whole life (`events` is
        // fixed when it starts): the last-used streams are never read, so not kept up
        // (an RMW per operand saved).
        return;
    }
    // (last-used stream index, tensors last used there); inline up to 8 streams, so that
    // the common case allocates nothing.
    let mut groups: heapless::Vec<(u32, Operands), 8> = heapless::Vec::new();
    let mut spill: Vec<(u32, Operands)> = Vec::new();
    for u in uses {
        // Relaxed: bookkeeping that follows the build order (module docs); one RMW so that
        // two builders never both see the same predecessor. A load that finds `s` already
        // stands for that RMW (it would write what is there), and saves it on one stream.
        if u.last.load(Ordering::Relaxed) == s.index {
            continue;
        }
        let l = u.last.swap(s.index, Ordering::Relaxed);
        if l == s.index || l == NIL {
            continue;
        }
        match groups
            .iter_mut()
            .chain(spill.iter_mut())
            .find(|(g, _)| *g == l)
        {
            Some((_, blobs)) => blobs.push(u.blob.clone()),
            None => {
                let mut blobs = Operands::default();
                blobs.push(u.blob.clone());
                if let Err(g) = groups.push((l, blobs)) {
                    spill.push(g);
                }
            }
        }
    }
    if groups.is_empty() && spill.is_empty() {
        // The common case (one stream): nothing to emit, and no need to
        // move the inline groups (hundreds of bytes) into an iterator.
        return;
    }
    for (l, blobs) in groups.into_iter().chain(spill) {
        let Some(ls) = vm.stream_by_index(l) else {
            continue;
        };
        match plan(&ls, s, vm.core.config().stream_wait) {
            Plan::Nothing => {}
            Plan::StreamWait => push(sync_instruction(
                vm,
                "soft_sync_stream_wait",
                s,
                Kind::StreamWait { from: ls },
                &blobs,
            )),
            Plan::RecordAndWait => {
                let slot = Arc::new(EventSlot::new());
                push(sync_instruction(
                    vm,
                    "soft_sync_record_event",
                    &ls,
                    Kind::RecordEvent {
                        slot: Some(slot.clone()),
                    },
                    &blobs,
                ));
                push(sync_instruction(
                    vm,
                    "soft_sync_wait_event",
                    s,
                    Kind::WaitEvent { slot },
                    &blobs,
                ));
            }
            Plan::RecordForHost => push(sync_instruction(
                vm,
                "soft_sync_record_event_for_host",
                &ls,
                Kind::RecordEvent { slot: None },
                &blobs,
            )),
        }
    }
}
