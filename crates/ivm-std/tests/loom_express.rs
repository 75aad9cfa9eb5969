//! Loom model of a worker's express lane (`model/express.rs`): the engine's holder hands a
//! small access straight to a polling worker, which may close the lane (before it sleeps)
//! at any moment.
//!
//! * The worker opens its lane, polls it a few times, closes it (serving what is posted),
//!   opens it again, polls once more and closes it for good (a worker that sleeps, wakes
//!   and sleeps again).
//! * Two posters, one after the other as the engine token orders them (a loom mutex): the
//!   first writes `1`s through the lane and reads them back; the second reads. Each gives
//!   up after two looks (the worker "not running") and withdraws; whenever the lane says
//!   it did nothing (closed, withdrawn), the poster does the access itself, as the VM's
//!   instruction path would.
//!
//! Checked in every interleaving: the request cell is never touched by two threads without
//! a happens-before edge (loom reports a race otherwise); a read returns the bytes of the
//! last write (never a buffer nobody filled); every write lands exactly once; nothing posted
//! is stranded (a poster waiting forever is a reported deadlock or livelock). Planted bugs,
//! each caught: the worker reopening with a Relaxed store, the worker closing with a plain
//! store (a posted request dropped), and the poster reading its answer with a Relaxed load.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-std --release --test loom_express`.
#![cfg(loom)]

use ivm_std::{Express, ExpressLane, Planted};

/// The tensor's bytes (host memory the lane's pointer points to), leaked: a planted bug
/// panics, and a second panic while unwinding loom state aborts the binary.
struct Memory(std::cell::UnsafeCell<[u8; 8]>);

// SAFETY: accessed by a poster directly only when the lane did nothing (then the worker
// never touches it), or by the worker between `TAKEN` and its answer, which the poster
// waits for: what the model checks by the values it reads.
unsafe impl Sync for Memory {}

fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

/// A poster's give-up rule: after two looks.
fn patience() -> impl FnMut() -> bool {
    let mut looks = 0;
    move || {
        looks += 1;
        looks >= 2
    }
}

/// One access by a poster holding the engine: through the lane, or itself when the lane
/// did nothing.
fn access(lane: &ExpressLane, mem: &Memory, write: Option<[u8; 8]>) -> [u8; 8] {
    let at = mem.0.get().cast::<u8>();
    let mut out = [0u8; 8];
    let done = match write {
        // SAFETY: one poster at a time (the engine mutex); `at` is 8 valid bytes nobody
        // else touches until we return (the model checks the worker keeps to that).
        Some(src) => unsafe { lane.write(at, &src, patience()) },
        // SAFETY: as above.
        None => unsafe { lane.read(at, &mut out, patience()) },
    };
    match done {
        Express::Done => {}
        Express::Closed | Express::Withdrawn => {
            // SAFETY: the lane did nothing: the worker does not touch the memory.
            unsafe {
                match write {
                    Some(src) => *mem.0.get() = src,
                    None => out = *mem.0.get(),
                }
            }
        }
    }
    write.unwrap_or(out)
}

fn model(planted: Planted) {
    loom::model(move || {
        let lane = leak(ExpressLane::with_planted(planted));
        let mem = leak(Memory(std::cell::UnsafeCell::new([0; 8])));
        let engine = leak(loom::sync::Mutex::new(()));

        let worker = loom::thread::spawn(move || {
            lane.open();
            for _ in 0..2 {
                lane.serve();
                loom::thread::yield_now();
            }
            lane.close();
            lane.open();
            lane.serve();
            loom::thread::yield_now();
            lane.close();
        });

        let second = loom::thread::spawn(move || {
            let _engine = engine.lock().unwrap();
            let got = access(lane, mem, None);
            assert!(
                got == [0; 8] || got == [1; 8],
                "a read returned {got:?}: neither before nor after the write"
            );
        });

        {
            let _engine = engine.lock().unwrap();
            access(lane, mem, Some([1; 8]));
            assert_eq!(access(lane, mem, None), [1; 8], "a read missed the write");
        }
        second.join().unwrap();
        worker.join().unwrap();
        // SAFETY: every thread is joined.
        assert_eq!(unsafe { *mem.0.get() }, [1; 8], "the write did not land");
    });
}

#[test]
fn express_accesses_are_done_once_and_never_stranded() {
    model(Planted::None);
}

/// The worker reopens with a Relaxed store: a poster that posted before the worker closed
/// reads the reopened lane as its answer without synchronising with the worker's copy.
/// Loom must report the race on the request.
#[test]
#[should_panic]
fn planted_open_relaxed() {
    model(Planted::OpenRelaxed);
}

/// The worker closes with a plain store: a posted request is dropped, and its poster reads
/// `CLOSED` as the answer. Loom must find a read of a buffer nobody filled (or a lost
/// write).
#[test]
#[should_panic]
fn planted_close_by_store() {
    model(Planted::CloseByStore);
}

/// The poster reads the answer with a Relaxed load: its read of the buffer races with the
/// worker's copy. Loom must report the race.
#[test]
#[should_panic]
fn planted_answer_relaxed() {
    model(Planted::AnswerRelaxed);
}
