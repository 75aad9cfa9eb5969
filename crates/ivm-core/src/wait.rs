//! Wait backends: how a thread sleeps while an `AtomicU32` holds a value, and how another
//! thread wakes it.
//!
//! ivm-core never sleeps on its own: every blocking type ([`Notifier`](crate::notifier::Notifier),
//! the counters, the parking protocol) is generic over a [`Wait`] backend. Core ships
//! [`SpinWait`] (no OS needed, for bare metal) and, under `cfg(loom)`, `LoomWait`
//! (a futex emulated with loom's `Mutex` + `Condvar`, so loom sees lost wake-ups as
//! deadlocks). ivm-std plugs in a futex.

use core::marker::PhantomData;
use core::time::Duration;

use crate::sync::AtomicU32;
#[cfg(not(loom))]
use crate::sync::Ordering;

/// A point on a wait backend's monotonic clock, in nanoseconds since the clock's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The clock's origin.
    pub const ZERO: Instant = Instant(0);

    /// The instant `nanos` nanoseconds after the clock's origin.
    #[inline]
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Nanoseconds since the clock's origin.
    #[inline]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at the end of time.
    #[inline]
    pub fn saturating_add(self, d: Duration) -> Self {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(nanos))
    }

    /// How long from `earlier` to `self` (zero if `earlier` is later).
    #[inline]
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// How a [`Wait::wait`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitResult {
    /// Woken, or the value already differed, or a spurious wake-up: re-check the condition.
    Woken,
    /// The deadline passed while the value still held `expected`.
    TimedOut,
}

/// A way to sleep while an `AtomicU32` holds a value (a futex, in the abstract).
///
/// The contract is the futex one: `wait` returns at once if the atomic no longer holds
/// `expected`, and may return spuriously, so callers always loop on their own condition.
/// A waker changes the atomic **before** calling `wake_*`; a backend must not lose a wake
/// that races with a `wait` that has compared but not yet slept.
pub trait Wait {
    /// Now, on this backend's monotonic clock (the clock deadlines are measured on).
    fn now() -> Instant;

    /// Sleeps while `atom` holds `expected`, until woken or until `deadline` passes.
    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult;

    /// Wakes at most one thread sleeping in [`Wait::wait`] on `atom`.
    fn wake_one(atom: &AtomicU32);

    /// Wakes every thread sleeping in [`Wait::wait`] on `atom`.
    fn wake_all(atom: &AtomicU32);
}

/// A monotonic clock for [`SpinWait`] deadlines.
pub trait Clock {
    /// Now.
    fn now() -> Instant;
}

/// A clock that never advances: with it, [`SpinWait`] deadlines pass only if they are at
/// the origin. Use a real clock (a hardware timer on bare metal) for timed waits.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoClock;

impl Clock for NoClock {
    #[inline]
    fn now() -> Instant {
        Instant::ZERO
    }
}

/// A wait backend that spins (with a spin-loop hint) instead of sleeping; wakes are no-ops.
///
/// For targets without an OS. Deadlines are checked against the caller-supplied
/// [`Clock`] `C`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpinWait<C: Clock = NoClock>(PhantomData<C>);

#[cfg(not(loom))]
impl<C: Clock> Wait for SpinWait<C> {
    #[inline]
    fn now() -> Instant {
        C::now()
    }

    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
        loop {
            // Relaxed: the caller re-reads the atomic with the ordering it needs.
            if atom.load(Ordering::Relaxed) != expected {
                return WaitResult::Woken;
            }
            if deadline.is_some_and(|deadline| C::now() >= deadline) {
                return WaitResult::TimedOut;
            }
            crate::sync::spin_loop();
        }
    }

    #[inline]
    fn wake_one(_atom: &AtomicU32) {}

    #[inline]
    fn wake_all(_atom: &AtomicU32) {}
}

/// Under loom, `SpinWait` behaves as `LoomWait` so that models never spin unboundedly.
#[cfg(loom)]
impl<C: Clock> Wait for SpinWait<C> {
    fn now() -> Instant {
        LoomWait::now()
    }
    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
        LoomWait::wait(atom, expected, deadline)
    }
    fn wake_one(atom: &AtomicU32) {
        LoomWait::wake_one(atom)
    }
    fn wake_all(atom: &AtomicU32) {
        LoomWait::wake_all(atom)
    }
}

/// A futex emulated with loom's `Mutex` + `Condvar` (parking spots hashed by address), so a
/// loom model reports a lost wake-up as a deadlock instead of hiding it in a yield loop.
///
/// A timeout is modelled as a branch that fires at once: a timed wait whose value still
/// holds `expected` returns [`WaitResult::TimedOut`] without sleeping.
#[cfg(loom)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LoomWait;

#[cfg(loom)]
const PARKING_SPOTS: usize = 8;

#[cfg(loom)]
loom::lazy_static! {
    /// Parking spots hashed by the atomic's address, so that a wake on one atomic does not
    /// wake (and so hide a lost wake on) an unrelated one, except on a hash collision.
    ///
    /// Loom drops lazy statics when the model closure returns: every model must join all
    /// of its threads before returning.
    static ref PARKING: [(loom::sync::Mutex<()>, loom::sync::Condvar); PARKING_SPOTS] =
        core::array::from_fn(|_| (loom::sync::Mutex::new(()), loom::sync::Condvar::new()));
}

#[cfg(loom)]
fn parking_spot(atom: &AtomicU32) -> &'static (loom::sync::Mutex<()>, loom::sync::Condvar) {
    let addr = core::ptr::from_ref(atom).addr();
    &PARKING[(addr / core::mem::align_of::<AtomicU32>()) % PARKING_SPOTS]
}

#[cfg(loom)]
impl Wait for LoomWait {
    fn now() -> Instant {
        Instant::ZERO
    }

    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
        let (lock, condvar) = parking_spot(atom);
        let guard = lock.lock().unwrap();
        // Compared under the lock that every waker takes after changing the atomic: either
        // the waker's change happens-before this load (we see it), or the waker locks after
        // we sleep (and its notify reaches us). Relaxed suffices for that; callers re-read.
        if atom.load(loom::sync::atomic::Ordering::Relaxed) != expected {
            return WaitResult::Woken;
        }
        if deadline.is_some() {
            return WaitResult::TimedOut;
        }
        drop(condvar.wait(guard).unwrap());
        WaitResult::Woken
    }

    fn wake_one(atom: &AtomicU32) {
        // Every sleeper on this spot re-checks its own atomic; waking all is always allowed.
        Self::wake_all(atom)
    }

    fn wake_all(atom: &AtomicU32) {
        let (lock, condvar) = parking_spot(atom);
        let _guard = lock.lock().unwrap();
        condvar.notify_all();
    }
}

/// The backend ivm-core's types use when none is named: [`SpinWait`] normally,
/// `LoomWait` under loom.
#[cfg(not(loom))]
pub type DefaultWait = SpinWait<NoClock>;
/// The backend ivm-core's types use when none is named: [`SpinWait`] normally,
/// [`LoomWait`] under loom.
#[cfg(loom)]
pub type DefaultWait = LoomWait;
