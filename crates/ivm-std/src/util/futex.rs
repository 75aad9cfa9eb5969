//! The futex wait backend: how ivm-std's threads sleep.
//!
//! Wakes go through [`atomic_wait`]. `atomic-wait` has no timeout, so a timed wait calls
//! the Linux futex directly (`FUTEX_WAIT | FUTEX_PRIVATE_FLAG` with a relative timeout
//! recomputed from the saved deadline); on other systems the timed path sleeps in short
//! slices and re-checks. Under `cfg(loom)` [`FutexWait`] is ivm-core's loom emulation.

#[cfg(loom)]
pub use ivm_core::LoomWait as FutexWait;

#[cfg(not(loom))]
pub use imp::FutexWait;

#[cfg(not(loom))]
mod imp {
    use std::sync::OnceLock;

    use ivm_core::sync::{AtomicU32, Ordering};
    use ivm_core::wait::{Instant, Wait, WaitResult};

    /// Sleeps on a futex (Linux; `atomic-wait`'s platform wait elsewhere).
    ///
    /// Its clock is [`std::time::Instant`] measured from the first use in the process.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct FutexWait;

    fn origin() -> std::time::Instant {
        static ORIGIN: OnceLock<std::time::Instant> = OnceLock::new();
        *ORIGIN.get_or_init(std::time::Instant::now)
    }

    impl FutexWait {
        /// Converts a backend instant into a [`std::time::Instant`].
        pub fn to_std(instant: Instant) -> std::time::Instant {
            origin() + std::time::Duration::from_nanos(instant.as_nanos())
        }

        /// Converts a [`std::time::Instant`] into a backend instant (saturating at the
        /// clock's origin).
        pub fn from_std(instant: std::time::Instant) -> Instant {
            let nanos = instant.saturating_duration_since(origin()).as_nanos();
            Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }
    }

    impl Wait for FutexWait {
        #[inline]
        fn now() -> Instant {
            Self::from_std(std::time::Instant::now())
        }

        fn wait(atom: &AtomicU32, expected: u32, deadline: Option<Instant>) -> WaitResult {
            match deadline {
                None => {
                    atomic_wait::wait(atom, expected);
                    WaitResult::Woken
                }
                Some(deadline) => timed_wait(atom, expected, deadline),
            }
        }

        #[inline]
        fn wake_one(atom: &AtomicU32) {
            atomic_wait::wake_one(atom);
        }

        #[inline]
        fn wake_all(atom: &AtomicU32) {
            atomic_wait::wake_all(atom);
        }
    }

    #[cfg(target_os = "linux")]
    fn timed_wait(atom: &AtomicU32, expected: u32, deadline: Instant) -> WaitResult {
        let now = FutexWait::now();
        if now >= deadline {
            // Relaxed: the caller re-reads the atomic with the ordering it needs.
            return if atom.load(Ordering::Relaxed) == expected {
                WaitResult::TimedOut
            } else {
                WaitResult::Woken
            };
        }
        let remaining = deadline.saturating_duration_since(now);
        let timeout = libc::timespec {
            tv_sec: libc::time_t::try_from(remaining.as_secs()).unwrap_or(libc::time_t::MAX),
            // subsec_nanos() < 1e9 fits an i32, and i32 converts into c_long on every target.
            tv_nsec: libc::c_long::from(remaining.subsec_nanos() as i32),
        };
        // SAFETY: `atom` is a live, aligned 4-byte atomic for the whole call (we hold a
        // reference); FUTEX_WAIT only reads it and compares it with `expected`; `timeout`
        // is a valid timespec on our stack; the unused arguments are ignored by FUTEX_WAIT.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                atom.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                &raw const timeout,
                core::ptr::null::<u32>(),
                0u32,
            )
        };
        if r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT) {
            return WaitResult::TimedOut;
        }
        // Woken, EAGAIN (the value already differed) or EINTR: the caller re-checks.
        WaitResult::Woken
    }

    #[cfg(not(target_os = "linux"))]
    fn timed_wait(atom: &AtomicU32, expected: u32, deadline: Instant) -> WaitResult {
        // No portable futex with a timeout: sleep in short slices and re-check. Wakes from
        // `atomic_wait::wake_*` are observed at the next slice.
        loop {
            if atom.load(Ordering::Relaxed) != expected {
                return WaitResult::Woken;
            }
            let now = FutexWait::now();
            if now >= deadline {
                return WaitResult::TimedOut;
            }
            let slice = deadline
                .saturating_duration_since(now)
                .min(std::time::Duration::from_micros(100));
            std::thread::sleep(slice);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::sync::Arc;
        use std::time::Duration;

        #[test]
        fn timed_wait_times_out_when_nobody_wakes() {
            let atom = AtomicU32::new(7);
            let deadline = FutexWait::now().saturating_add(Duration::from_millis(5));
            let mut result = FutexWait::wait(&atom, 7, Some(deadline));
            // A futex may return early (EINTR): loop like every caller does.
            while result == WaitResult::Woken && atom.load(Ordering::Relaxed) == 7 {
                result = FutexWait::wait(&atom, 7, Some(deadline));
            }
            assert_eq!(result, WaitResult::TimedOut);
            assert!(FutexWait::now() >= deadline);
        }

        #[test]
        fn wait_returns_at_once_when_value_differs() {
            let atom = AtomicU32::new(1);
            assert_eq!(FutexWait::wait(&atom, 0, None), WaitResult::Woken);
            let deadline = FutexWait::now().saturating_add(Duration::from_secs(60));
            assert_eq!(FutexWait::wait(&atom, 0, Some(deadline)), WaitResult::Woken);
        }

        #[test]
        fn wake_reaches_a_sleeper() {
            for timed in [false, true] {
                let atom = Arc::new(AtomicU32::new(0));
                let sleeper = {
                    let atom = Arc::clone(&atom);
                    std::thread::spawn(move || {
                        let deadline =
                            timed.then(|| FutexWait::now().saturating_add(Duration::from_secs(60)));
                        while atom.load(Ordering::Acquire) == 0 {
                            assert_eq!(FutexWait::wait(&atom, 0, deadline), WaitResult::Woken);
                        }
                    })
                };
                std::thread::sleep(Duration::from_millis(2));
                atom.store(1, Ordering::Release);
                FutexWait::wake_all(&atom);
                sleeper.join().unwrap();
            }
        }

        #[test]
        fn std_instant_round_trip() {
            let now = std::time::Instant::now();
            let back = FutexWait::to_std(FutexWait::from_std(now));
            let diff = if back > now { back - now } else { now - back };
            assert!(diff < Duration::from_micros(1));
        }
    }
}
