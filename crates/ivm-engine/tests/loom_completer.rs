//! Loom models of [`CompletionCell`]: what the work wrote before its fire (or before its
//! completer was dropped unfired) is visible to the owner once it sees the instruction
//! done, and a fire racing the close (shutdown) is either the cell's answer or refused,
//! never both or neither. The other thread stands for an interrupt handler or the thread
//! the work ends on.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-engine --release --test loom_completer`.
#![cfg(loom)]

use ivm_engine::{CellState, CompletionCell, FireError};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

struct Shared {
    cell: CompletionCell,
    /// What the work writes (a DMA transfer's bytes), before it completes.
    data: UnsafeCell<u32>,
}

// SAFETY: `data` is written by the work before its completion and read by the owner only
// after it saw the completion, which is what the models check (loom reports the read as a
// race otherwise).
unsafe impl Sync for Shared {}

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        cell: CompletionCell::new(),
        data: UnsafeCell::new(0),
    })
}

impl Shared {
    /// The work's write, before its completion.
    fn write(&self, v: u32) {
        // SAFETY: each model writes `data` once, on the work's side, before the fire (or
        // the completer's drop) that publishes it, and reads it only after learning of
        // that step through the cell (a race otherwise, which loom reports).
        self.data.with_mut(|p| unsafe { *p = v });
    }

    /// The owner's read, after it learnt of the completion.
    fn read(&self) -> u32 {
        // SAFETY: see `write`.
        self.data.with(|p| unsafe { *p })
    }
}

/// The owner waits as an engine does: it looks until the instruction is done.
fn wait_done(s: &Shared) -> CellState {
    loop {
        let st = s.cell.state();
        if st.is_done() {
            return st;
        }
        thread::yield_now();
    }
}

#[test]
fn a_fire_publishes_the_work() {
    loom::model(|| {
        let s = shared();
        // The executor arms; the work's side fires through the cell (an interrupt handler
        // reaching a `static`).
        s.cell.arm_detached().unwrap();
        let t = {
            let s = s.clone();
            thread::spawn(move || {
                s.write(42);
                s.cell.fire(true).unwrap();
            })
        };
        assert_eq!(wait_done(&s), CellState::Done);
        assert_eq!(s.read(), 42);
        t.join().unwrap();
        assert_eq!(s.cell.reset(), Ok(CellState::Done));
    });
}

#[test]
fn a_completer_dropped_unfired_fails_the_instruction_after_the_work() {
    loom::model(|| {
        let s = shared();
        let t = {
            let s = s.clone();
            thread::spawn(move || {
                let c = s.cell.arm().unwrap();
                s.write(7);
                drop(c);
            })
        };
        assert_eq!(wait_done(&s), CellState::Abandoned);
        assert_eq!(s.read(), 7);
        t.join().unwrap();
    });
}

#[test]
fn a_fire_racing_the_close_is_the_answer_or_refused() {
    loom::model(|| {
        let s = shared();
        s.cell.arm_detached().unwrap();
        let t = {
            let s = s.clone();
            thread::spawn(move || {
                s.write(9);
                s.cell.fire(true)
            })
        };
        let before = s.cell.close();
        if before == CellState::Done {
            // The fire won: its work is visible to the owner that saw it in the close.
            assert_eq!(s.read(), 9);
        }
        let fired = t.join().unwrap();
        match (before, fired) {
            (CellState::Done, Ok(())) | (CellState::Armed, Err(FireError::ShutDown)) => {}
            other => panic!("close saw {:?}, fire got {:?}", other.0, other.1),
        }
        assert_eq!(s.cell.state(), CellState::Closed);
        assert!(s.cell.state().is_done());
    });
}

#[test]
fn a_close_racing_the_reset_stays_closed() {
    loom::model(|| {
        let s = shared();
        s.cell.arm_detached().unwrap();
        s.cell.fire(true).unwrap();
        let t = {
            let s = s.clone();
            thread::spawn(move || s.cell.close())
        };
        let reset = s.cell.reset();
        let before = t.join().unwrap();
        assert_eq!(s.cell.state(), CellState::Closed);
        match (reset, before) {
            (Ok(CellState::Done), CellState::Idle) | (Err(CellState::Closed), CellState::Done) => {}
            other => panic!("reset {:?}, close saw {:?}", other.0, other.1),
        }
    });
}

/// An owner may reset without looking first: a reset that succeeds saw the fire, and
/// what the work wrote before it.
#[test]
fn a_reset_publishes_the_work_like_a_look() {
    loom::model(|| {
        let s = shared();
        s.cell.arm_detached().unwrap();
        let t = {
            let s = s.clone();
            thread::spawn(move || {
                s.write(5);
                s.cell.fire(true).unwrap();
            })
        };
        while s.cell.reset().is_err() {
            thread::yield_now();
        }
        assert_eq!(s.read(), 5);
        t.join().unwrap();
    });
}
