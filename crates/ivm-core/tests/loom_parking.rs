//! Loom models of the scheduler's parking protocol (ARCHITECTURE.md, "The scheduler's parking
//! protocol"): producers publish, then `unpark()`; the consumer announces the park with an
//! RMW, re-checks its inputs, and only then sleeps. A completion races the park.
//!
//! The inputs are Relaxed atomics on purpose: only the protocol's Release (unpark) /
//! Acquire (park) can make the consumer see them, so a broken protocol shows up as a
//! consumer that sleeps forever (loom: deadlock).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ivm-core --release --test loom_parking`.
#![cfg(loom)]

use ivm_core::parking::{Park, Parking};
use ivm_core::wait::{Instant, LoomWait};
use loom::sync::atomic::AtomicU32;
use loom::sync::atomic::Ordering::Relaxed;
use loom::thread;

struct Shared {
    parking: Parking<LoomWait>,
    /// Completions published so far.
    completions: AtomicU32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// The consumer checks its inputs *before* announcing the park, not after.
    CheckBeforePark,
    /// The producer looks at the state with a load and unparks only if it saw PARKED:
    /// a store-load (Dekker) race without an RMW on the producer side.
    UnparkByLoad,
}

fn leak() -> &'static Shared {
    // Leaked, not Arc'd: a planted bug panics, and a second panic while unwinding a loom
    // Arc aborts the test binary.
    Box::leak(Box::new(Shared {
        parking: Parking::new(),
        completions: AtomicU32::new(0),
    }))
}

fn producer(s: &'static Shared, bug: Bug) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        s.completions.fetch_add(1, Relaxed); // publish ...
        if bug == Bug::UnparkByLoad {
            if s.parking.is_parked() {
                s.parking.unpark();
            }
        } else {
            s.parking.unpark(); // ... then unpark
        }
    })
}

/// The scheduler loop: run until `expected` completions were seen, parking in between.
fn consume(s: &Shared, expected: u32, bug: Bug) {
    let mut seen = 0;
    while seen < expected {
        let now = s.completions.load(Relaxed);
        if now > seen {
            seen = now;
            continue;
        }
        let r = if bug == Bug::CheckBeforePark {
            // Already checked above, "so" park without re-checking.
            s.parking.park(|| false, None)
        } else {
            s.parking.park(|| s.completions.load(Relaxed) > seen, None)
        };
        assert!(matches!(r, Park::Unparked | Park::HadInput), "{r:?}");
    }
}

fn model(producers: usize, bug: Bug) {
    loom::model(move || {
        let s = leak();
        let handles: Vec<_> = (0..producers).map(|_| producer(s, bug)).collect();
        consume(s, producers as u32, bug);
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn completion_races_park() {
    model(1, Bug::None);
}

#[test]
fn two_completions_race_park() {
    model(2, Bug::None);
}

/// A timed park racing the completion: whatever it returns, a later untimed park still
/// sees the completion (a timeout never swallows an unpark).
#[test]
fn timed_park_races_completion() {
    loom::model(|| {
        let s = leak();
        let p = producer(s, Bug::None);
        let r = s.parking.park(
            || s.completions.load(Relaxed) > 0,
            Some(Instant::from_nanos(1)),
        );
        assert_ne!(r, Park::Closed);
        consume(s, 1, Bug::None);
        p.join().unwrap();
    });
}

/// Shutdown racing the park: the consumer ends with `Closed`, never hangs.
#[test]
fn close_races_park() {
    loom::model(|| {
        let s = leak();
        let closer = thread::spawn(move || s.parking.close());
        loop {
            match s.parking.park(|| false, None) {
                Park::Closed => break,
                Park::Unparked | Park::HadInput => continue,
                Park::TimedOut => unreachable!("no deadline"),
            }
        }
        assert!(s.parking.is_closed());
        closer.join().unwrap();
    });
}

#[test]
#[should_panic(expected = "deadlock")]
fn planted_check_before_park() {
    model(1, Bug::CheckBeforePark);
}

#[test]
#[should_panic(expected = "deadlock")]
fn planted_unpark_by_load() {
    model(1, Bug::UnparkByLoad);
}

// ---- data published through the parking alone -------------------------------------------
//
// The models above publish their inputs through atomics, and the consumer loops until it
// sees them, so a missing Acquire only delays it by one more park. These models publish a
// plain cell (a loom `UnsafeCell`) and read it right after `park` returned, with nothing
// but the parking word (or the closed flag) in between: a weakened ordering on that path
// is a data race, which loom reports. (Found by `.ci/ordering_mutants.sh`: each of the
// orderings these models check survived every model before.)

/// A cell written by a producer or the closer before it unparks or closes, and read by the
/// consumer once `park` says so.
struct Published {
    parking: Parking<LoomWait>,
    /// Written by the producer before its unpark.
    by_producer: loom::cell::UnsafeCell<u32>,
    /// Set (Release) by the producer after writing its cell, before its unpark: the
    /// consumer's `has_input`. Its own Acquire makes a `HadInput` return safe by itself.
    produced: loom::sync::atomic::AtomicBool,
    /// Written by the closer before `close`.
    by_closer: loom::cell::UnsafeCell<u32>,
}

fn leak_published() -> &'static Published {
    Box::leak(Box::new(Published {
        parking: Parking::new(),
        by_producer: loom::cell::UnsafeCell::new(0),
        produced: loom::sync::atomic::AtomicBool::new(false),
        by_closer: loom::cell::UnsafeCell::new(0),
    }))
}

fn publishing_producer(s: &'static Published) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        // SAFETY: only this thread writes the cell, before its Release unpark; the
        // consumer reads it only after it synchronised with that unpark (or with the
        // `produced` flag) — the property under test; loom reports a race otherwise.
        s.by_producer.with_mut(|p| unsafe { *p = 7 });
        s.produced
            .store(true, loom::sync::atomic::Ordering::Release);
        s.parking.unpark();
    })
}

fn publishing_closer(s: &'static Published) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        // SAFETY: as in `publishing_producer`, with `close` as the publishing step.
        s.by_closer.with_mut(|p| unsafe { *p = 9 });
        s.parking.close();
    })
}

/// What the consumer may read after `park` returned `r`.
fn read_after(s: &Published, r: Park) {
    match r {
        Park::Unparked | Park::HadInput => {
            // Only the producer unparks in these models before the closer's data counts,
            // and `HadInput` came from `produced` (Acquire): the producer's cell is
            // published either way.
            if r == Park::HadInput || s.produced.load(loom::sync::atomic::Ordering::Relaxed) {
                // SAFETY: see `publishing_producer`.
                let v = s.by_producer.with(|p| unsafe { *p });
                assert_eq!(v, 7);
            }
        }
        Park::Closed => {
            // SAFETY: see `publishing_closer`.
            let v = s.by_closer.with(|p| unsafe { *p });
            assert_eq!(v, 9);
        }
        Park::TimedOut => {}
    }
}

/// An unpark wakes a sleeping consumer, which then reads what the producer wrote before
/// unparking: the Acquire load of the state after the wait must pair with the unpark.
#[test]
fn unpark_publishes_to_the_woken_consumer() {
    loom::model(|| {
        let s = leak_published();
        let p = publishing_producer(s);
        let r = s.parking.park(
            || s.produced.load(loom::sync::atomic::Ordering::Acquire),
            None,
        );
        assert!(matches!(r, Park::Unparked | Park::HadInput), "{r:?}");
        if r == Park::Unparked {
            // The unpark that ended the park is the producer's: its cell is published.
            // SAFETY: see `publishing_producer`.
            let v = s.by_producer.with(|p| unsafe { *p });
            assert_eq!(v, 7);
        }
        p.join().unwrap();
    });
}

/// A timed park whose deadline races the unpark: when the withdrawal finds the unpark
/// already there (`Unparked`), the consumer reads the producer's cell, so the
/// withdrawing swap must be Acquire.
#[test]
fn timed_park_withdrawal_publishes_the_racing_unpark() {
    loom::model(|| {
        let s = leak_published();
        let p = publishing_producer(s);
        let r = s.parking.park(|| false, Some(Instant::from_nanos(1)));
        if r == Park::Unparked {
            // SAFETY: see `publishing_producer`.
            let v = s.by_producer.with(|p| unsafe { *p });
            assert_eq!(v, 7);
        }
        p.join().unwrap();
    });
}

/// Shutdown publishes like an input: a consumer that parks and gets `Closed` (through the
/// flag check before it sleeps, or woken by the close) reads what the closer wrote
/// before closing.
#[test]
fn close_publishes_to_the_parking_consumer() {
    loom::model(|| {
        let s = leak_published();
        let c = publishing_closer(s);
        loop {
            let r = s.parking.park(|| false, None);
            read_after(s, r);
            if r == Park::Closed {
                break;
            }
        }
        c.join().unwrap();
    });
}

/// A producer's unpark and the close race a sleeping consumer: the consumer may be woken
/// by the producer's unpark and then find the flag set, so the flag's own load must be
/// Acquire (the unpark it synchronised with says nothing about the closer's data).
#[test]
fn close_racing_an_unpark_still_publishes() {
    loom::model(|| {
        let s = leak_published();
        let p = publishing_producer(s);
        let c = publishing_closer(s);
        loop {
            let r = s.parking.park(
                || s.produced.load(loom::sync::atomic::Ordering::Acquire),
                None,
            );
            read_after(s, r);
            if r == Park::Closed {
                break;
            }
            if r == Park::HadInput {
                // Consume the input so that the next park sleeps.
                s.produced
                    .store(false, loom::sync::atomic::Ordering::Relaxed);
            }
        }
        p.join().unwrap();
        c.join().unwrap();
    });
}

/// `is_closed` is how another thread learns about shutdown: it reads what the closer
/// wrote before closing.
#[test]
fn is_closed_publishes_the_closer_data() {
    loom::model(|| {
        let s = leak_published();
        let c = publishing_closer(s);
        if s.parking.is_closed() {
            // SAFETY: see `publishing_closer`.
            let v = s.by_closer.with(|p| unsafe { *p });
            assert_eq!(v, 9);
        }
        c.join().unwrap();
    });
}

/// A timed park whose withdrawal finds a producer's unpark while the close is under way:
/// it may report `Closed` after synchronising with the producer only, so the flag's load
/// on that path must be Acquire too.
#[test]
fn timed_park_withdrawal_racing_unpark_and_close() {
    loom::model(|| {
        let s = leak_published();
        let p = publishing_producer(s);
        let c = publishing_closer(s);
        let r = s.parking.park(|| false, Some(Instant::from_nanos(1)));
        read_after(s, r);
        p.join().unwrap();
        c.join().unwrap();
    });
}
