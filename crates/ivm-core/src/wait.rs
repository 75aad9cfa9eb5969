//! Wait backends: how a thread sleeps while an `AtomicU32` holds a value, and how another
//! thread wakes it.
//!
//! ivm-core never sleeps on its own: every blocking type ([`Notifier`](crate::notifier::Notifier),
//! the counters, the parking protocol) is generic over a [`Wait`] backend. Core ships
//! [`SpinWait`] (no OS needed, for bare metal), with the `cortex-m` feature `WfeWait`
//! (sleeps in `WFE` until an event or interrupt, wakes with `SEV`: a microcontroller's
//! core sleeps instead of spinning), and, under `cfg(loom)`, `LoomWait` (a futex emulated
//! with loom's `Mutex` + `Condvar`, so loom sees lost wake-ups as deadlocks). ivm-std
//! plugs in a futex.
//!
//! The bare-metal backends have no clock of their own: their deadlines are measured on a
//! [`Clock`] you supply as a type parameter (a hardware timer, a tick counter an interrupt
//! advances), [`NoClock`] by default.

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

/// The polling wait of the backends without an OS ([`SpinWait`], and `WfeWait` on
/// Cortex-M): until `atom` no longer holds `expected` or `deadline` passes on `C`, calling
/// `idle` between checks (a spin hint, or WFE).
#[cfg(not(loom))]
#[inline]
fn poll_until_changed<C: Clock>(
    atom: &AtomicU32,
    expected: u32,
    deadline: Option<Instant>,
    mut idle: impl FnMut(),
) -> WaitResult {
    loop {
        // Relaxed: the caller re-reads the atomic with the ordering it needs.
        if atom.load(Ordering::Relaxed) != expected {
            return WaitResult::Woken;
        }
        if deadline.is_some_and(|deadline| C::now() >= deadline) {
            return WaitResult::TimedOut;
        }
        idle();
    }
}

#[cfg(not(loom))]
impl<C: Clock> Wait for SpinWait<C> {
    #[inline]
    fn now() -> Instant {
        C::now()
    }

    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
        poll_until_changed::<C>(atom, expected, deadline, crate::sync::spin_loop)
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

/// A wait backend for Cortex-M cores (feature `cortex-m`): sleeps in `WFE` (wait for
/// event) instead of spinning, and wakes with `SEV` (send event).
///
/// [`wait`](Wait::wait) loops: it returns [`WaitResult::Woken`] as soon as `atom` no longer
/// holds `expected`, [`WaitResult::TimedOut`] once `deadline` has passed on the clock `C`,
/// and otherwise executes `WFE`, which sleeps until the core's event register is set.
/// That register is set by `SEV` (on any core: [`wake_one`](Wait::wake_one) and
/// [`wake_all`](Wait::wake_all) execute it), and by every exception return, so an
/// interrupt handler that changes `atom` wakes the waiter even without calling `wake_*`.
///
/// # No lost wake-up
///
/// The waiter compares `atom` and then executes `WFE`; a waker that changes `atom` in
/// between also sets the event register (its `SEV`, or the return from its interrupt
/// handler), and a `WFE` that finds the register set clears it and returns at once. So
/// the waiter re-checks `atom` instead of sleeping through the change. A stale event left
/// by some earlier `SEV` or interrupt only costs one spurious turn of the loop. The wakes
/// execute `DSB` before `SEV`, so that on a multi-core part the change to `atom` is
/// visible to a core the event wakes.
///
/// # Deadlines
///
/// `WFE` has no timeout: a timed wait notices its deadline only when something wakes the
/// core. Give timed waits a periodic interrupt, typically the timer that drives the clock
/// `C` (a SysTick handler advancing a tick counter): each of its exception returns wakes
/// the waiter, which then checks the deadline. With the default [`NoClock`] a deadline
/// passes only if it is at the clock's origin.
///
/// On targets other than `target_arch = "arm"` (host builds, docs, tests) `WFE` is replaced
/// by a spin-loop hint and `SEV` by nothing, so this behaves like [`SpinWait`]. Under loom
/// it behaves as `LoomWait`, like [`SpinWait`].
///
/// ```
/// use core::sync::atomic::{AtomicU32, Ordering};
/// use ivm_core::wait::{Clock, Instant, Wait, WaitResult, WfeWait};
///
/// /// Milliseconds counted by a timer interrupt (a SysTick handler on a real board).
/// static TICKS: AtomicU32 = AtomicU32::new(0);
/// struct Ticks;
/// impl Clock for Ticks {
///     fn now() -> Instant {
///         Instant::from_nanos(u64::from(TICKS.load(Ordering::Relaxed)) * 1_000_000)
///     }
/// }
///
/// static READY: AtomicU32 = AtomicU32::new(1); // an interrupt handler already stored 1
/// assert_eq!(WfeWait::<Ticks>::wait(&READY, 0, None), WaitResult::Woken);
/// assert_eq!(
///     WfeWait::<Ticks>::wait(&READY, 1, Some(Instant::ZERO)),
///     WaitResult::TimedOut,
///     "the deadline is at the origin: already passed"
/// );
/// ```
#[cfg(feature = "cortex-m")]
#[cfg_attr(docsrs, doc(cfg(feature = "cortex-m")))]
#[derive(Debug, Clone, Copy, Default)]
pub struct WfeWait<C: Clock = NoClock>(PhantomData<C>);

/// Wait for event: sleeps until the event register is set (spin hint off Arm).
#[cfg(all(feature = "cortex-m", not(loom)))]
#[inline(always)]
fn wfe() {
    #[cfg(target_arch = "arm")]
    cortex_m::asm::wfe();
    #[cfg(not(target_arch = "arm"))]
    crate::sync::spin_loop();
}

/// Send event: sets every core's event register, after a `DSB` so that what the waker
/// stored before is visible to the cores it wakes (nothing off Arm).
#[cfg(all(feature = "cortex-m", not(loom)))]
#[inline(always)]
fn sev() {
    #[cfg(target_arch = "arm")]
    {
        cortex_m::asm::dsb();
        cortex_m::asm::sev();
    }
}

#[cfg(all(feature = "cortex-m", not(loom)))]
impl<C: Clock> Wait for WfeWait<C> {
    #[inline]
    fn now() -> Instant {
        C::now()
    }

    fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
        // An event set since the compare (a waker's SEV, an interrupt's return) makes the
        // WFE return at once: see "No lost wake-up".
        poll_until_changed::<C>(atom, expected, deadline, wfe)
    }

    #[inline]
    fn wake_one(_atom: &AtomicU32) {
        // SEV wakes every core waiting for an event; each re-checks its own atomic.
        sev();
    }

    #[inline]
    fn wake_all(_atom: &AtomicU32) {
        sev();
    }
}

/// Under loom, `WfeWait` behaves as `LoomWait`, like `SpinWait`.
#[cfg(all(feature = "cortex-m", loom))]
impl<C: Clock> Wait for WfeWait<C> {
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

/// The parking spots of one model execution, and which atomic owns each.
#[cfg(loom)]
struct Spots {
    /// The address of the atomic each spot belongs to, in the order the atomics were first
    /// waited on or woken. A std mutex, not a loom one: it is bookkeeping of the emulation,
    /// not a synchronisation point of the model.
    owners: std::sync::Mutex<std::vec::Vec<usize>>,
    spots: [(loom::sync::Mutex<()>, loom::sync::Condvar); PARKING_SPOTS],
}

#[cfg(loom)]
loom::lazy_static! {
    /// One parking spot per atomic (the first `PARKING_SPOTS - 1` atomics used; later ones
    /// share the last spot), so that a wake on one atomic does not wake (and so hide a lost
    /// wake on) an unrelated one.
    ///
    /// Spots are handed out in first-use order, not by hashing the address: addresses
    /// change from one execution of a model to the next (leaked or reallocated state), and
    /// a spot choice that depends on them would make loom's executions diverge from the
    /// schedule it replays. First-use order depends only on the schedule.
    ///
    /// Loom drops lazy statics when the model closure returns: every model must join all
    /// of its threads before returning.
    static ref PARKING: Spots = Spots {
        owners: std::sync::Mutex::new(std::vec::Vec::new()),
        spots: core::array::from_fn(|_| (loom::sync::Mutex::new(()), loom::sync::Condvar::new())),
    };
}

#[cfg(loom)]
fn parking_spot(atom: &AtomicU32) -> &'static (loom::sync::Mutex<()>, loom::sync::Condvar) {
    let addr = core::ptr::from_ref(atom).addr();
    let mut owners = PARKING
        .owners
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let i = match owners.iter().position(|&a| a == addr) {
        Some(i) => i,
        None => {
            owners.push(addr);
            owners.len() - 1
        }
    };
    &PARKING.spots[i.min(PARKING_SPOTS - 1)]
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

#[cfg(all(test, not(loom), feature = "cortex-m"))]
mod tests {
    use super::*;
    use core::sync::atomic::AtomicU64;

    /// A clock that advances one microsecond each time it is read.
    static NOW: AtomicU64 = AtomicU64::new(0);
    struct Stepping;
    impl Clock for Stepping {
        fn now() -> Instant {
            Instant::from_nanos(NOW.fetch_add(1_000, Ordering::Relaxed))
        }
    }

    #[test]
    fn wfe_wait_returns_when_the_value_differs_or_the_deadline_passes() {
        let atom = AtomicU32::new(7);
        assert_eq!(WfeWait::<Stepping>::wait(&atom, 6, None), WaitResult::Woken);
        let deadline = WfeWait::<Stepping>::now().saturating_add(Duration::from_micros(50));
        assert_eq!(
            WfeWait::<Stepping>::wait(&atom, 7, Some(deadline)),
            WaitResult::TimedOut
        );
        assert!(WfeWait::<Stepping>::now() >= deadline);
        // Off Arm the wakes are no-ops; they must not panic.
        WfeWait::<Stepping>::wake_one(&atom);
        WfeWait::<Stepping>::wake_all(&atom);
        assert_eq!(WfeWait::<NoClock>::wait(&atom, 6, None), WaitResult::Woken);
    }
}
