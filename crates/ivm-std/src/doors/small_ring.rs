//! The thread-local ring of reusable instructions for sync small accesses and `sync()`
//! (ARCHITECTURE.md, "Sync small-memory access"): one slot per (VM, stream, kind) this
//! thread used recently, each holding up to `RING_MAX` instructions taken with
//! `Arc::get_mut` (exclusive, and synchronising with the last holder's drop), so that a
//! steady state allocates nothing. The accesses themselves are in `sync_access.rs`.

use std::cell::RefCell;
use std::sync::Arc;

use crate::model::instruction::{Instruction, Kind, Waiter};
use crate::model::stream::StreamShared;
use crate::runtime::shared::VmShared;
use crate::util::tuning::{RING_MAX, SLOTS};

/// What a ring entry is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum SmallKind {
    Read,
    Write,
    /// `VirtualMachine::sync`'s barrier (reusable too: `sync()` allocates nothing).
    Sync,
}

struct RingSlot {
    vm: usize,
    stream: u32,
    kind: SmallKind,
    instrs: heapless::Vec<Arc<Instruction>, RING_MAX>,
}

thread_local! {
    static RING: RefCell<heapless::Vec<RingSlot, SLOTS>> = const { RefCell::new(heapless::Vec::new()) };
}

fn small_instruction(
    stream: &Arc<StreamShared>,
    kind: SmallKind,
    offset: usize,
    len: usize,
) -> Instruction {
    let (name, k) = match kind {
        SmallKind::Read => ("read_small", Kind::SmallRead { offset, len }),
        SmallKind::Write => ("write_small", Kind::SmallWrite { offset, len }),
        SmallKind::Sync => ("sync", Kind::Noop),
    };
    let mut i = Instruction::new(name, stream.clone(), k);
    i.waiter = Some(Waiter::new());
    i.barrier = kind == SmallKind::Sync;
    i
}

/// The index of this thread's ring slot for (`shared`, `stream`, `kind`), made (empty) if
/// there is none, evicting the oldest slot when all are taken.
fn slot_of(
    ring: &mut heapless::Vec<RingSlot, SLOTS>,
    shared: &VmShared,
    stream: &StreamShared,
    kind: SmallKind,
) -> usize {
    let pos = ring
        .iter()
        .position(|s| s.vm == shared.id && s.stream == stream.index && s.kind == kind);
    pos.unwrap_or_else(|| {
        if ring.is_full() {
            ring.remove(0);
        }
        let slot = RingSlot {
            vm: shared.id,
            stream: stream.index,
            kind,
            instrs: heapless::Vec::new(),
        };
        // Cannot fail: we made room above.
        let _ = ring.push(slot);
        ring.len() - 1
    })
}

/// Fills this thread's ring slot for (`shared`, `stream`, `kind`) to its capacity if it is
/// not yet: the warm-up of [`take_small`], for an access that needs no instruction this
/// time (the express lane) but may need one later — a steady state that falls back to an
/// instruction now and then must not allocate then.
pub(crate) fn warm(shared: &VmShared, stream: &Arc<StreamShared>, kind: SmallKind) {
    let cap = shared.core.config().sync_ring_capacity.min(RING_MAX);
    RING.with(|r| {
        let mut ring = r.borrow_mut();
        let pos = slot_of(&mut ring, shared, stream, kind);
        fill(&mut ring[pos], stream, cap);
    });
}

/// Fills `slot` with fresh instructions up to `cap`, at once: so that no later access
/// allocates, however the engine's releases are timed (growing one entry at a time, a
/// ring that the releases kept small during a warm-up would grow, and allocate, under a
/// later burst).
fn fill(slot: &mut RingSlot, stream: &Arc<StreamShared>, cap: usize) {
    while slot.instrs.len() < cap {
        let _ = slot
            .instrs
            .push(Arc::new(small_instruction(stream, slot.kind, 0, 0)));
    }
}

/// Takes an instruction for one small access: a ring entry this thread holds exclusively
/// (reset in place, no allocation), a ring filled to its capacity on its first use
/// (warm-up), or — when every entry is in flight — the first one the engine releases (so
/// a steady state never allocates). Also returns how many of this ring's earlier accesses
/// finished but are not released yet.
pub(crate) fn take_small(
    shared: &VmShared,
    stream: &Arc<StreamShared>,
    kind: SmallKind,
    offset: usize,
    len: usize,
) -> (Arc<Instruction>, usize) {
    let cap = shared.core.config().sync_ring_capacity.min(RING_MAX);
    RING.with(|r| {
        let mut ring = r.borrow_mut();
        let pos = slot_of(&mut ring, shared, stream, kind);
        let slot = &mut ring[pos];
        let mut waiting_since: Option<std::time::Instant> = None;
        let mut _hook = None;
        loop {
            // Our own earlier accesses that finished but are not released yet (they still
            // count in `flying`; see `wait_small`).
            let mut own_done = 0;
            let mut free = None;
            for (k, entry) in slot.instrs.iter_mut().enumerate() {
                // `get_mut` checks strong == 1 and weak == 0 with Acquire, so the engine's
                // and the executor's last uses happen before we reset it.
                if Arc::get_mut(entry).is_some() {
                    free.get_or_insert(k);
                } else if entry.waiter.as_ref().is_some_and(|w| w.btb.is_done()) {
                    own_done += 1;
                }
            }
            if let Some(k) = free {
                let entry = &mut slot.instrs[k];
                if let Some(m) = Arc::get_mut(entry) {
                    *m = small_instruction(stream, kind, offset, len);
                }
                return (entry.clone(), own_done);
            }
            if slot.instrs.len() < cap {
                // Warm-up, once per slot (or after an abandoned entry): the next look
                // takes one of the fresh entries.
                fill(slot, stream, cap);
                continue;
            }
            // Every entry is still held by the engine (finished, not yet released, or
            // still running): wait for one instead of allocating, helping the engine
            // release it when nobody drives it. After a whole timeout period (a stuck
            // VM: the access itself will report it) fall back to a fresh instruction.
            let since = *waiting_since.get_or_insert_with(std::time::Instant::now);
            _hook.get_or_insert_with(|| shared.core.wait_scope());
            if since.elapsed() >= shared.core.config().timeout_period {
                let fresh = Arc::new(small_instruction(stream, kind, offset, len));
                return (fresh, own_done);
            }
            if shared.core.single_thread() {
                let _ = shared.core.drive();
            } else {
                shared.core.help();
            }
            std::thread::yield_now();
        }
    })
}

/// Drops `instr` from this thread's ring (after an error: never reuse it).
pub(crate) fn abandon(instr: &Arc<Instruction>) {
    RING.with(|r| {
        let mut ring = r.borrow_mut();
        for slot in ring.iter_mut() {
            if let Some(p) = slot.instrs.iter().position(|i| Arc::ptr_eq(i, instr)) {
                slot.instrs.swap_remove(p);
                return;
            }
        }
    });
}
