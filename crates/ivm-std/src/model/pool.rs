//! Pooled instructions: the engine hands every instruction it releases back to its VM's
//! pool when it holds the last reference (`Arc::get_mut`), and builders take them from
//! there, so that a steady state of `call`s (with a plain `fn` or a closure of at most
//! [`INLINE_BYTES`](crate::model::kernel::INLINE_BYTES) bytes, see `kernel.rs`), touches,
//! releases, soft-sync events and `sync()`s allocates nothing.
//!
//! The pool is bounded ([`POOL_MAX`]); beyond it released instructions are freed. It
//! belongs to its VM and is emptied when the scheduler exits, so pooled instructions
//! (which keep their last stream alive until reused) do not outlive the VM's threads.

use std::sync::{Arc, Mutex};

use crate::model::instruction::{Instruction, Kind};
use crate::model::stream::StreamShared;
use crate::util::lock;
use crate::util::tuning::{POOL_MAX, PREFILL, RETRY_MAX};

#[derive(Default)]
struct Free {
    v: Vec<Arc<Instruction>>,
    prefilled: bool,
}

/// A VM's pool of released instructions, each held only by the pool.
#[derive(Default)]
pub(crate) struct InstrPool {
    free: Mutex<Free>,
}

impl InstrPool {
    /// A new instruction: a pooled one reset in place, or a fresh allocation.
    pub(crate) fn instruction(
        &self,
        name: &'static str,
        stream: &Arc<StreamShared>,
        kind: Kind,
    ) -> Arc<Instruction> {
        let taken = {
            let mut free = lock(&self.free);
            if free.v.is_empty() && !free.prefilled {
                free.prefilled = true;
                free.v.reserve_exact(POOL_MAX);
                for _ in 0..PREFILL {
                    let spare = Instruction::new("pooled", stream.clone(), Kind::Noop);
                    free.v.push(Arc::new(spare));
                }
            }
            free.v.pop()
        };
        if let Some(mut a) = taken {
            // `get_mut` succeeds: the pool held the only reference (the engine checked
            // with `get_mut`, whose Acquire ordered every earlier use before it).
            if let Some(m) = Arc::get_mut(&mut a) {
                m.renew(name, stream, kind);
                return a;
            }
            debug_assert!(false, "ivm: a pooled instruction is shared");
        }
        Arc::new(Instruction::new(name, stream.clone(), kind))
    }

    /// Engine: takes back every instruction in `released` that nobody else holds (up to
    /// [`POOL_MAX`]). An instruction without a waiter that is still shared is kept in
    /// `released` for the next call (at most [`RETRY_MAX`]): its executor sets DONE before
    /// it drops its own reference, so the engine may release it a moment before. The rest
    /// (sync-access ring entries, waited-on instructions) is let go.
    pub(crate) fn give_back(&self, released: &mut Vec<Arc<Instruction>>) {
        let mut free = lock(&self.free);
        if free.v.capacity() == 0 {
            free.v.reserve_exact(POOL_MAX);
        }
        let free = &mut free.v;
        let mut kept = 0;
        let mut i = 0;
        // Moved, not cloned, into the pool (a clone and a drop would be two RMWs on the
        // count). Which `RETRY_MAX` are kept when more qualify follows the swaps, not the
        // list's order: a matter of reuse only.
        while i < released.len() {
            let a = &mut released[i];
            if Arc::get_mut(a).is_some() {
                let a = released.swap_remove(i);
                if free.len() < POOL_MAX {
                    free.push(a);
                }
                continue;
            }
            if a.waiter.is_none() && kept < RETRY_MAX {
                kept += 1;
                i += 1;
            } else {
                drop(released.swap_remove(i));
            }
        }
    }

    /// Frees every pooled instruction (VM shutdown).
    pub(crate) fn clear(&self) {
        let v = std::mem::take(&mut lock(&self.free).v);
        drop(v);
    }
}
