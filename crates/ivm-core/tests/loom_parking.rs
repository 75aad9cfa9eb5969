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
