//! Seeded fault injection ([`SimFaults`]): kernel launches that fail, events that never
//! complete or complete with an error, allocations that fail, copies 100× slower, copies
//! that fail.

use std::sync::{Arc, Mutex, PoisonError};

use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering};

use super::SplitMix;
use super::event::EventInner;

/// Fault injection knobs of a [`SimAdapter`](super::SimAdapter), all off by default. Each
/// rate is "one in N" (`0`: never), drawn per operation from a generator seeded with
/// [`seed`](Self::seed) (each stream and allocator derives its own).
///
/// * `kernel_launch_fail`: [`DeviceStream::launch_host`](ivm_std::DeviceStream::launch_host)
///   returns [`Error::Device`](ivm_std::Error::Device) and queues nothing;
/// * `event_never_completes`: a recorded event is never completed by its stream (work
///   after it still runs; a device-side wait on it blocks its stream) until
///   [`SimAdapter::heal`](super::SimAdapter::heal);
/// * `event_error`: when the stream reaches the event it records a device error
///   ([`DeviceStream::take_error`](ivm_std::DeviceStream::take_error)), then completes it;
/// * `alloc_fail`: an allocation returns [`Error::OutOfMemory`](ivm_std::Error::OutOfMemory);
/// * `slow_copy`: a copy takes 100× its drawn latency (at least 1 ms in all);
/// * `copy_fail`: when the stream reaches a copy it copies nothing and records a device
///   error ([`DeviceStream::take_error`](ivm_std::DeviceStream::take_error)), as a copy
///   from freed memory does.
///
/// [`SimAdapter::fault_stats`](super::SimAdapter::fault_stats) counts what was injected.
///
/// # Examples
///
/// ```
/// use ivm_device::sim::{SimAdapter, SimConfig, SimFaults};
/// use ivm_std::{DeviceAdapter, DeviceStream, StreamType};
///
/// // Every launch fails until the device is healed.
/// let sim = SimAdapter::new(SimConfig {
///     faults: SimFaults { seed: 1, kernel_launch_fail: 1, ..SimFaults::NONE },
///     ..SimConfig::default()
/// });
/// let s = sim.create_stream(0, StreamType::Compute)?;
/// assert!(s.launch_host(Box::new(|| {})).is_err());
/// assert_eq!(sim.fault_stats().kernel_launch_fail, 1);
/// sim.heal();
/// s.launch_host(Box::new(|| {}))?;
/// s.synchronize()?;
/// # Ok::<(), ivm_std::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimFaults {
    /// Seed of the fault generators.
    pub seed: u64,
    /// One launch in N fails.
    pub kernel_launch_fail: u32,
    /// One event in N never completes (until healed).
    pub event_never_completes: u32,
    /// One event in N completes with a device error.
    pub event_error: u32,
    /// One allocation in N fails.
    pub alloc_fail: u32,
    /// One copy in N is 100× slower.
    pub slow_copy: u32,
    /// One copy in N fails on the device.
    pub copy_fail: u32,
}

impl SimFaults {
    /// No faults.
    pub const NONE: SimFaults = SimFaults {
        seed: 0,
        kernel_launch_fail: 0,
        event_never_completes: 0,
        event_error: 0,
        alloc_fail: 0,
        slow_copy: 0,
        copy_fail: 0,
    };

    /// Whether any fault is enabled.
    pub fn any(&self) -> bool {
        self.kernel_launch_fail
            | self.event_never_completes
            | self.event_error
            | self.alloc_fail
            | self.slow_copy
            | self.copy_fail
            != 0
    }
}

/// Faults injected so far, by kind ([`SimAdapter::fault_stats`](super::SimAdapter::fault_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimFaultStats {
    /// Launches refused.
    pub kernel_launch_fail: usize,
    /// Events left uncompleted (each completed later by `heal`).
    pub event_never_completes: usize,
    /// Events completed with a device error.
    pub event_error: usize,
    /// Allocations refused.
    pub alloc_fail: usize,
    /// Copies slowed down.
    pub slow_copy: usize,
    /// Copies that failed.
    pub copy_fail: usize,
}

impl SimFaultStats {
    /// The sum over the kinds.
    pub fn total(&self) -> usize {
        self.kernel_launch_fail
            + self.event_never_completes
            + self.event_error
            + self.alloc_fail
            + self.slow_copy
            + self.copy_fail
    }
}

/// A fault kind (index into the counters).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    LaunchFail = 0,
    NeverCompletes = 1,
    EventError = 2,
    AllocFail = 3,
    SlowCopy = 4,
    CopyFail = 5,
}

/// The adapter's fault state, shared by its streams and allocators.
pub(crate) struct FaultState {
    pub(crate) config: SimFaults,
    /// Cleared by `heal`: no fault is injected while false.
    enabled: AtomicBool,
    counts: [AtomicUsize; 6],
    /// Events a stream reached but left uncompleted; `heal` completes them. Also guards
    /// the hand-over with `heal` (a stream checks `enabled` under this lock).
    stuck: Mutex<Vec<Arc<EventInner>>>,
}

impl std::fmt::Debug for FaultState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultState")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl FaultState {
    pub(crate) fn new(config: SimFaults) -> Self {
        Self {
            config,
            enabled: AtomicBool::new(config.any()),
            counts: Default::default(),
            stuck: Mutex::new(Vec::new()),
        }
    }

    /// A generator for one stream or allocator (`n` makes it distinct).
    pub(crate) fn rng(&self, n: u64) -> SplitMix {
        let mut s = SplitMix(self.config.seed ^ n.wrapping_mul(0x2545_F491_4F6C_DD1D));
        SplitMix(s.next())
    }

    /// Draws whether a fault of `kind` happens now (one in `rate`) and counts it.
    pub(crate) fn roll(&self, rng: &Mutex<SplitMix>, kind: Kind) -> bool {
        let c = &self.config;
        let rate = match kind {
            Kind::LaunchFail => c.kernel_launch_fail,
            Kind::NeverCompletes => c.event_never_completes,
            Kind::EventError => c.event_error,
            Kind::AllocFail => c.alloc_fail,
            Kind::SlowCopy => c.slow_copy,
            Kind::CopyFail => c.copy_fail,
        };
        // Relaxed: a switch; a fault drawn just after `heal` is harmless (a stuck event is
        // re-checked under the lock in `leave_stuck`).
        if rate == 0 || !self.enabled.load(Ordering::Relaxed) {
            return false;
        }
        let hit = rng
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .next()
            .is_multiple_of(u64::from(rate));
        if hit && !matches!(kind, Kind::NeverCompletes) {
            self.count(kind);
        }
        hit
    }

    fn count(&self, kind: Kind) {
        // Relaxed: statistics.
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The stream reached a record drawn to never complete: keeps it uncompleted, unless
    /// the adapter was healed meanwhile. Returns whether it was left uncompleted.
    pub(crate) fn leave_stuck(&self, ev: &Arc<EventInner>) -> bool {
        let mut s = self.stuck.lock().unwrap_or_else(PoisonError::into_inner);
        // Relaxed: `heal` clears it under this lock, which orders the two.
        if !self.enabled.load(Ordering::Relaxed) {
            return false;
        }
        s.push(ev.clone());
        self.count(Kind::NeverCompletes);
        true
    }

    /// Turns every fault off and completes the events left uncompleted.
    pub(crate) fn heal(&self) -> usize {
        let stuck = {
            let mut s = self.stuck.lock().unwrap_or_else(PoisonError::into_inner);
            // Relaxed: read under the same lock by `leave_stuck`.
            self.enabled.store(false, Ordering::Relaxed);
            std::mem::take(&mut *s)
        };
        let n = stuck.len();
        for ev in stuck {
            ev.complete();
        }
        n
    }

    /// Turns the configured faults back on (after `heal`).
    pub(crate) fn resume(&self) {
        let _s = self.stuck.lock().unwrap_or_else(PoisonError::into_inner);
        // Relaxed: under the lock, as in `heal`.
        self.enabled.store(self.config.any(), Ordering::Relaxed);
    }

    /// Events left uncompleted now.
    pub(crate) fn stuck_now(&self) -> usize {
        self.stuck
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub(crate) fn stats(&self) -> SimFaultStats {
        // Relaxed: statistics.
        let c = |k: Kind| self.counts[k as usize].load(Ordering::Relaxed);
        SimFaultStats {
            kernel_launch_fail: c(Kind::LaunchFail),
            event_never_completes: c(Kind::NeverCompletes),
            event_error: c(Kind::EventError),
            alloc_fail: c(Kind::AllocFail),
            slow_copy: c(Kind::SlowCopy),
            copy_fail: c(Kind::CopyFail),
        }
    }
}
