//! Loom model of a worker's express lane (`model/express.rs`): the engine's holder hands a
//! small access straight to a polling worker, which may close the lane (before it sleeps)
//! at any moment.
//!
//! * The worker opens its lane, polls it a few times, closes it (serving what is posted),
//!   opens it again, polls once more and closes it for good (a worker that sleeps, wakes
//!   and sleeps again).
//! * Two posters, one after the other as the engine token orders them (a loom mutex): the
//!   first writes `1`s through the lane and reads them back; the second reads. In one
//!   model each gives up after two looks (the worker "not running") and withdraws;
//!   whenever the lane says it did nothing (closed, withdrawn), the poster does the access
//!   itself, as the VM's instruction path would. In the other a poster never gives up.
//!
//! Checked in every interleaving: the request cell, and a loom cell standing for the
//! tensor's bytes (touched by the worker's copy and by a poster's own access), are never
//! touched by two threads without a happens-before edge (loom reports a race otherwise);
//! a read returns the bytes of the last write, never a buffer nobody filled (a read's
//! buffer is filled with `0xEE` when posted, under loom); the worker served exactly as
//! many accesses as the lane reported done; the write landed; and a poster that never
//! gives up is never stranded (it would spin forever: loom reports it). Planted bugs, each
//! caught: the worker reopening with a Relaxed store, the worker closing with a plain store
//! (a posted request dropped), the poster reading its answer with a Relaxed load, and the
//! poster withdrawing with a plain store (the worker's copy then races with the poster's
//! own access of the bytes).
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_express`.
#![cfg(loom)]

use std::sync::atomic::{AtomicUsize, Ordering};

use ivm_std::{Express, ExpressLane, Planted};
use loom::cell::UnsafeCell as LoomUnsafeCell;

/// The tensor's bytes (host memory the lane's pointer points to), with a loom cell that
/// stands for them (the lane's worker accesses it where it copies; a poster where it
/// copies itself). Leaked: a planted bug panics, and a second panic while unwinding loom
/// state aborts the binary.
struct Memory {
    bytes: std::cell::UnsafeCell<[u8; 8]>,
    tracker: &'static LoomUnsafeCell<()>,
}

// SAFETY: `bytes` is accessed by a poster directly only when the lane did nothing, or by
// the worker between `TAKEN` and its answer; `tracker` makes loom check exactly that.
unsafe impl Sync for Memory {}

fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

/// A poster's give-up rule: after two looks, or never.
fn patience(gives_up: bool) -> impl FnMut() -> bool {
    let mut looks = 0;
    move || {
        looks += 1;
        gives_up && looks >= 2
    }
}

/// One access by a poster holding the engine: through the lane, or itself when the lane
/// did nothing. Counts the accesses the lane did in `done`.
fn access(
    lane: &ExpressLane,
    mem: &Memory,
    write: Option<[u8; 8]>,
    gives_up: bool,
    done: &AtomicUsize,
) -> [u8; 8] {
    let at = mem.bytes.get().cast::<u8>();
    let mut out = [0u8; 8];
    let r = match write {
        // SAFETY: one poster at a time (the engine mutex); `at` is 8 valid bytes nobody
        // else touches until we return (the model checks the worker keeps to that).
        Some(src) => unsafe { lane.write(at, &src, patience(gives_up)) },
        // SAFETY: as above.
        None => unsafe { lane.read(at, &mut out, patience(gives_up)) },
    };
    match r {
        Express::Done => {
            done.fetch_add(1, Ordering::Relaxed);
        }
        Express::Closed | Express::Withdrawn => mem.tracker.with_mut(|_| {
            // SAFETY: the lane did nothing: the worker does not touch the memory (the
            // tracker's access checks it).
            unsafe {
                match write {
                    Some(src) => *mem.bytes.get() = src,
                    None => out = *mem.bytes.get(),
                }
            }
        }),
    }
    write.unwrap_or(out)
}

fn model(planted: Planted, gives_up: bool) {
    loom::model(move || {
        let tracker = leak(LoomUnsafeCell::new(()));
        let lane = leak(ExpressLane::with_planted(planted, tracker));
        let mem = leak(Memory {
            bytes: std::cell::UnsafeCell::new([0; 8]),
            tracker,
        });
        let engine = leak(loom::sync::Mutex::new(()));
        let done = leak(AtomicUsize::new(0));

        let worker = loom::thread::spawn(move || {
            let mut served = 0;
            lane.open();
            for _ in 0..2 {
                served += usize::from(lane.serve());
                loom::thread::yield_now();
            }
            served += lane.close();
            lane.open();
            served += usize::from(lane.serve());
            loom::thread::yield_now();
            served += lane.close();
            served
        });

        let second = loom::thread::spawn(move || {
            let _engine = engine.lock().unwrap();
            let got = access(lane, mem, None, gives_up, done);
            assert!(
                got == [0; 8] || got == [1; 8],
                "a read returned {got:?}: neither before nor after the write"
            );
        });

        {
            let _engine = engine.lock().unwrap();
            access(lane, mem, Some([1; 8]), gives_up, done);
            let got = access(lane, mem, None, gives_up, done);
            assert_eq!(got, [1; 8], "a read missed the write");
        }
        second.join().unwrap();
        let served = worker.join().unwrap();
        assert_eq!(
            served,
            done.load(Ordering::Relaxed),
            "the worker served other than what the lane reported done"
        );
        // SAFETY: every thread is joined.
        assert_eq!(
            unsafe { *mem.bytes.get() },
            [1; 8],
            "the write did not land"
        );
    });
}

#[test]
fn express_accesses_are_done_once_by_whoever_the_lane_says() {
    model(Planted::None, true);
}

/// Posters that never withdraw: whatever they post, the worker serves (closing serves
/// what is posted), so none spins forever.
#[test]
fn a_poster_that_never_gives_up_is_never_stranded() {
    model(Planted::None, false);
}

/// The worker reopens with a Relaxed store: a poster that posted before the worker closed
/// reads the reopened lane as its answer without synchronising with the worker's copy.
/// Loom must report the race (on the request, or on the tensor's bytes).
#[test]
#[should_panic]
fn planted_open_relaxed() {
    model(Planted::OpenRelaxed, true);
}

/// The worker closes with a plain store: a posted request is dropped, and its poster reads
/// `CLOSED` as the answer: a read returns the `0xEE` nobody wrote over, or the write does
/// not land, or the served count falls short.
#[test]
#[should_panic]
fn planted_close_by_store() {
    model(Planted::CloseByStore, true);
}

/// The poster reads the answer with a Relaxed load: its read of the buffer races with the
/// worker's copy. Loom must report the race.
#[test]
#[should_panic]
fn planted_answer_relaxed() {
    model(Planted::AnswerRelaxed, true);
}

/// The poster withdraws with a plain store: the worker may have taken the request and
/// copy while the poster does the access itself. Loom must report the race on the
/// tensor's bytes (or the state the worker's answer overwrites goes wrong).
#[test]
#[should_panic]
fn planted_withdraw_by_store() {
    model(Planted::WithdrawByStore, true);
}
