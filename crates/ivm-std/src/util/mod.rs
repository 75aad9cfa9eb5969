//! The lowest layer of ivm-std, the vocabulary every layer above uses: errors, the names
//! of devices and streams, the futex wait backend, the mutex helper, the tuning
//! constants, what a VM is configured with ([`Config`](crate::Config)) and the fork
//! policy (the fork generation every entry point checks). Plain data and process-wide
//! state: nothing here knows about instructions, streams or the engine.

pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod fork;
pub mod futex;
pub(crate) mod hooks;
pub(crate) mod ids;
pub mod panics;
pub(crate) mod tuning;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How far off a deadline is that `d` from now would put past the clock's range.
const FAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// `d` from now, or [`FAR`] from now where `d` is too long for the clock: a duration the
/// user hands over (`Config::timeout_period`, a call's timeout) may be anything up to
/// `Duration::MAX`, which means "no deadline", never an overflow panic.
pub(crate) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or_else(|| now + FAR)
}

/// "One in `n`", drawn without a pattern (a xorshift32 generator): which instructions a
/// worker times (`engine/kernel_clock.rs`), which runs at rest a caller judges
/// (`engine/at_rest.rs`). Never a fixed period: a front end's instructions repeat with a
/// period of their own, which a fixed one could always hit, or always miss.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneIn(u32);

impl OneIn {
    /// A generator at its seed (never zero, as xorshift needs).
    pub(crate) const fn new() -> Self {
        Self(0x9E37_79B9)
    }

    /// One step: whether this draw is one in `n`.
    #[inline]
    pub(crate) fn draw(&mut self, n: u32) -> bool {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.0 = x;
        x.is_multiple_of(n)
    }
}

/// Microseconds since this process first asked: the clock of [`HintUntil`].
pub(crate) fn now_us() -> usize {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    usize::try_from(origin.elapsed().as_micros()).unwrap_or(usize::MAX)
}

/// A hint that holds until a moment (one word, microseconds of a process-wide clock;
/// 0: never set): the contention marks of `ThreadCtx`. Relaxed throughout: nothing is
/// published through it, and a stale read only delays or prolongs a policy.
#[derive(Debug, Default)]
pub(crate) struct HintUntil(ivm_core::sync::AtomicUsize);

impl HintUntil {
    /// Makes the hint hold for at least `d` from now (never shortens it).
    pub(crate) fn hold_for(&self, d: Duration) {
        let until = now_us().saturating_add(usize::try_from(d.as_micros()).unwrap_or(usize::MAX));
        self.0.fetch_max(until, ivm_core::sync::Ordering::Relaxed);
    }

    /// Ends the hint now (a later [`hold_for`](Self::hold_for) sets it again).
    pub(crate) fn clear(&self) {
        self.0.store(0, ivm_core::sync::Ordering::Relaxed);
    }

    /// Whether the hint holds now.
    pub(crate) fn holds(&self) -> bool {
        self.holds_at(now_us())
    }

    /// [`holds`](Self::holds), reading no clock when the hint was never set or was last
    /// found expired (then cleared here: a later [`hold_for`](Self::hold_for) wins).
    pub(crate) fn holds_or_clear(&self) -> bool {
        self.is_set() && self.holds_or_clear_at(now_us())
    }

    /// Whether the hint was set and not found expired since (it may have lapsed unseen).
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(ivm_core::sync::Ordering::Relaxed) != 0
    }

    /// [`holds_or_clear`](Self::holds_or_clear) at `now` (a reading of [`now_us`]).
    pub(crate) fn holds_or_clear_at(&self, now: usize) -> bool {
        let until = self.0.load(ivm_core::sync::Ordering::Relaxed);
        if until == 0 {
            return false;
        }
        if now < until {
            return true;
        }
        // Relaxed: as everywhere here. A failure means a new hold: it stands.
        let _ = self.0.compare_exchange(
            until,
            0,
            ivm_core::sync::Ordering::Relaxed,
            ivm_core::sync::Ordering::Relaxed,
        );
        false
    }

    /// Makes the hint hold for `d` from `now` if it would lapse within half of that: a
    /// hint kept alive by its readers writes its line once per half-hold, not per read.
    pub(crate) fn renew_at(&self, now: usize, d: Duration) {
        let d = usize::try_from(d.as_micros()).unwrap_or(usize::MAX);
        let until = self.0.load(ivm_core::sync::Ordering::Relaxed);
        if until.saturating_sub(now) < d / 2 {
            self.0
                .fetch_max(now.saturating_add(d), ivm_core::sync::Ordering::Relaxed);
        }
    }

    /// Whether the hint holds at `now` (a reading of [`now_us`], for several hints).
    pub(crate) fn holds_at(&self, now: usize) -> bool {
        let until = self.0.load(ivm_core::sync::Ordering::Relaxed);
        until != 0 && now < until
    }
}

/// Locks `m`, ignoring poisoning: every VM mutex guards data that a panicking holder leaves
/// consistent (kernels run outside every lock, and their panics are caught).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
