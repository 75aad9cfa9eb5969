//! Loom models of the counters: [`BlockingCounter`] (sleeping waiter, wake only when the
//! decrease to zero sees `WAITERS`) and [`SpinCounter`]; each decreaser's data lives in a
//! loom `UnsafeCell`, so a missing Release/Acquire is a reported causality violation.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_counter`.
#![cfg(loom)]

use core::time::Duration;

use ivm_core::counter::{BlockingCounter, SpinCounter, WaitError};
use ivm_core::notifier::Timed;
use ivm_core::wait::{Instant, LoomWait};
use loom::cell::UnsafeCell;
use loom::thread;

struct Shared<C> {
    counter: C,
    data: [UnsafeCell<u32>; 2],
}

// SAFETY: decreaser `i` writes only `data[i]`, before its decrease (a closer: before its
// close); the waiter reads after it saw zero (or the close), through the counter's
// Release/Acquire, which is what the models check.
unsafe impl<C: Sync> Sync for Shared<C> {}

fn leak<C>(counter: C) -> &'static Shared<C> {
    // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a loom
    // Arc aborts the test binary.
    Box::leak(Box::new(Shared {
        counter,
        data: [UnsafeCell::new(0), UnsafeCell::new(0)],
    }))
}

fn read_all<C>(s: &Shared<C>) -> [u32; 2] {
    // SAFETY: see `Shared`.
    [0, 1].map(|i| s.data[i].with(|p| unsafe { *p }))
}

fn blocking(relaxed: bool) {
    loom::model(move || {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        // The waiter adds the second unit of work before handing it out.
        s.counter.increase();
        let workers = [0, 1].map(|i| {
            thread::spawn(move || {
                // SAFETY: see `Shared`.
                s.data[i].with_mut(|p| unsafe { *p = i as u32 + 1 });
                if relaxed {
                    s.counter.planted_decrease_relaxed();
                } else {
                    s.counter.decrease();
                }
            })
        });
        s.counter
            .wait_until_zero(Duration::MAX, || unreachable!("no period"))
            .unwrap();
        assert_eq!(read_all(s), [1, 2], "returned before both decreases");
        for w in workers {
            w.join().unwrap();
        }
    });
}

#[test]
fn blocking_counter_two_decreasers() {
    blocking(false);
}

#[test]
#[should_panic(expected = "Causality violation")]
fn planted_decrease_relaxed() {
    blocking(true);
}

/// A timed wait (loom fires the timeout as a branch) racing the decrease.
#[test]
fn blocking_counter_timed() {
    loom::model(|| {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        let w = thread::spawn(move || {
            // SAFETY: see `Shared`.
            s.data[0].with_mut(|p| unsafe { *p = 1 });
            s.counter.decrease();
        });
        if s.counter.timed_wait_until_zero(Instant::from_nanos(1)) == Ok(Timed::Notified) {
            assert_eq!(read_all(s)[0], 1);
        }
        // After a timeout the counter still works: wait for real.
        s.counter.wait_until_zero(Duration::MAX, || false).unwrap();
        assert_eq!(read_all(s)[0], 1);
        w.join().unwrap();
    });
}

/// `close()` racing the decrease: Ok (with the data) or Closed, never a hang.
#[test]
fn blocking_counter_close_races_decrease() {
    loom::model(|| {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        let w = thread::spawn(move || {
            // SAFETY: see `Shared`.
            s.data[0].with_mut(|p| unsafe { *p = 1 });
            s.counter.decrease();
        });
        let closer = thread::spawn(move || s.counter.close());
        match s.counter.wait_until_zero(Duration::MAX, || false) {
            Ok(()) => assert_eq!(read_all(s)[0], 1),
            Err(e) => assert_eq!(e, WaitError::Closed),
        }
        w.join().unwrap();
        closer.join().unwrap();
    });
}

#[test]
fn spin_counter_two_decreasers() {
    loom::model(|| {
        let s = leak(SpinCounter::new(2));
        let workers = [0, 1].map(|i| {
            thread::spawn(move || {
                // SAFETY: see `Shared`.
                s.data[i].with_mut(|p| unsafe { *p = i as u32 + 1 });
                s.counter.decrease();
            })
        });
        s.counter.wait_until_zero();
        assert_eq!(read_all(s), [1, 2]);
        for w in workers {
            w.join().unwrap();
        }
    });
}

// ---- data published through a look, or through the close --------------------------------
//
// The models above read the data after `wait_until_zero`. These read it right after a
// look that does not wait (`is_zero`, `is_closed`), or after a wait that ended with
// `Closed`, with nothing but the counter's word in between: a weakened ordering on that
// path is a data race, which loom reports. (Found by `.ci/ordering_mutants.sh`: each
// ordering these models check survived every other model.)

/// `is_zero` (a look without waiting; `BlockingThenBusy::is_done` is this look), polled
/// until it says zero: then the decreaser's data is visible. (Polled, not looked at once:
/// with a single look, loom explored only the schedule in which the look comes first.)
#[test]
fn blocking_counter_is_zero_publishes() {
    loom::model(|| {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        let w = thread::spawn(move || {
            // SAFETY: see `Shared`.
            s.data[0].with_mut(|p| unsafe { *p = 1 });
            s.counter.decrease();
        });
        while !s.counter.is_zero() {
            thread::yield_now();
        }
        assert_eq!(read_all(s)[0], 1);
        w.join().unwrap();
    });
}

/// The closer writes its data, then closes; nobody decreases.
fn closer(s: &'static Shared<BlockingCounter<LoomWait>>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        // SAFETY: see `Shared`.
        s.data[1].with_mut(|p| unsafe { *p = 2 });
        s.counter.close();
    })
}

/// A wait that ends with `Closed` (seen before sleeping, or woken by the close) reads what
/// the closer wrote before closing.
#[test]
fn blocking_counter_close_publishes_to_the_waiter() {
    loom::model(|| {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        let c = closer(s);
        assert_eq!(
            s.counter.wait_until_zero(Duration::MAX, || false),
            Err(WaitError::Closed)
        );
        assert_eq!(read_all(s)[1], 2);
        c.join().unwrap();
    });
}

/// `is_closed` (`BlockingThenBusy::is_closed` is this look): once it says closed, the
/// closer's data is visible.
#[test]
fn blocking_counter_is_closed_publishes() {
    loom::model(|| {
        let s = leak(BlockingCounter::<LoomWait>::new(1));
        let c = closer(s);
        if s.counter.is_closed() {
            assert_eq!(read_all(s)[1], 2);
        }
        c.join().unwrap();
    });
}
