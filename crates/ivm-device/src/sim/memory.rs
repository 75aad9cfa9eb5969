//! The sim's memory: host memory posing as device memory, with an allocator that poisons
//! what it frees and counts every use after free.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ivm_core::sync::{AtomicUsize, Ordering};
use ivm_std::{Device, DeviceAllocator, DeviceMemory, DeviceStream, Error, HostMemory, Result};

/// The byte a freed sim allocation is filled with.
pub const POISON_BYTE: u8 = 0xDB;

/// Bit 0 of [`SimMemory`]'s state word: freed. The rest counts bodies accessing it (each
/// adds 2).
const FREED: usize = 1;

/// Counters of a sim device's allocator (see [`SimAdapter::allocator_stats`]).
///
/// [`SimAdapter::allocator_stats`]: super::SimAdapter::allocator_stats
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimAllocatorStats {
    /// Allocations made.
    pub allocations: usize,
    /// Allocations freed (in stream order).
    pub frees: usize,
    /// Bytes allocated and not yet freed.
    pub live_bytes: usize,
    /// Allocations not yet freed (`allocations - frees`).
    pub live_allocations: usize,
    /// Frees of an allocation already freed (each ignored). A correct VM never causes one.
    pub double_frees: usize,
    /// Uses after free detected: an access that began after the free, or a free while an
    /// access was in progress. A correct VM never causes one.
    pub use_after_free: usize,
    /// A description of the first few uses after free.
    pub reports: Vec<String>,
}

#[derive(Debug, Default)]
pub(crate) struct Stats {
    allocations: AtomicUsize,
    frees: AtomicUsize,
    live_bytes: AtomicUsize,
    double_frees: AtomicUsize,
    use_after_free: AtomicUsize,
    reports: Mutex<Vec<String>>,
}

impl Stats {
    pub(crate) fn snapshot(&self) -> SimAllocatorStats {
        // Relaxed: statistics; callers read them after synchronising with the work.
        let allocations = self.allocations.load(Ordering::Relaxed);
        let frees = self.frees.load(Ordering::Relaxed);
        SimAllocatorStats {
            allocations,
            frees,
            live_bytes: self.live_bytes.load(Ordering::Relaxed),
            live_allocations: allocations.saturating_sub(frees),
            double_frees: self.double_frees.load(Ordering::Relaxed),
            use_after_free: self.use_after_free.load(Ordering::Relaxed),
            reports: self
                .reports
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        }
    }

    fn report(&self, what: String) {
        // Relaxed: a statistic.
        self.use_after_free.fetch_add(1, Ordering::Relaxed);
        let mut r = self
            .reports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.len() < 16 {
            r.push(what);
        }
    }
}

/// One allocation of a sim device: host memory (so queued kernels see its bytes) plus a
/// state word that turns every use after free into a reported error instead of a race.
///
/// Accesses bracket themselves with [`begin_access`](DeviceMemory::begin_access) /
/// [`end_access`](DeviceMemory::end_access); the free marks the word. Both are one
/// read-modify-write on the same word, so exactly one side sees the other: an access that
/// starts after the free fails (and touches nothing), a free during an access is reported
/// and leaves the bytes alone; otherwise the free poisons the bytes with [`POISON_BYTE`].
#[derive(Debug)]
pub struct SimMemory {
    host: HostMemory,
    device: Device,
    /// `false`: device-only ([`SimConfig::host_visible`](super::SimConfig::host_visible)).
    host_visible: bool,
    /// `FREED` bit | 2 × accesses in progress.
    state: AtomicUsize,
    stats: Arc<Stats>,
}

impl SimMemory {
    /// Whether the allocation has been freed (in stream order).
    pub fn is_freed(&self) -> bool {
        // Acquire: pairs with the AcqRel free.
        self.state.load(Ordering::Acquire) & FREED != 0
    }

    /// Frees the allocation now (called on a sim stream's thread, in stream order).
    pub(crate) fn free_now(&self) {
        // AcqRel: Acquire sees the bytes written by accesses that ended (Release) before;
        // Release publishes the poison to an access that fails on the bit.
        let prev = self.state.fetch_or(FREED, Ordering::AcqRel);
        if prev & FREED != 0 {
            // Freeing twice is a no-op, counted.
            // Relaxed: a statistic.
            self.stats.double_frees.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Relaxed: statistics.
        self.stats.frees.fetch_add(1, Ordering::Relaxed);
        self.stats
            .live_bytes
            .fetch_sub(self.host.nbytes(), Ordering::Relaxed);
        let accessors = prev >> 1;
        if accessors > 0 {
            self.stats.report(format!(
                "{}: {}-byte allocation freed while {accessors} access(es) were in progress",
                self.device,
                self.host.nbytes()
            ));
            return;
        }
        if let Some(p) = self.host.host_ptr() {
            // SAFETY: no access is in progress and every later one fails on FREED without
            // touching the bytes, so nothing else reads or writes them now.
            unsafe { std::ptr::write_bytes(p.as_ptr(), POISON_BYTE, self.host.nbytes()) };
        }
    }
}

// SAFETY: the bytes are a `HostMemory` owned by this object (8-byte aligned, initialised,
// valid until drop); the sim touches them only through copies and frees it was asked for.
// `host_ptr` answers the same every time (`host_visible` is fixed at allocation).
unsafe impl DeviceMemory for SimMemory {
    fn device(&self) -> Device {
        self.device
    }
    fn nbytes(&self) -> usize {
        self.host.nbytes()
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        if self.host_visible {
            self.host.host_ptr()
        } else {
            None
        }
    }
    fn device_ptr(&self) -> u64 {
        self.host.device_ptr()
    }
    fn begin_access(&self) -> Result<()> {
        // Acquire: sees the bytes as the last access or the allocation left them.
        let prev = self.state.fetch_add(2, Ordering::Acquire);
        if prev & FREED != 0 {
            // Relaxed: undoes our own increment; nothing is published through it.
            self.state.fetch_sub(2, Ordering::Relaxed);
            let what = format!(
                "{}: access to a freed {}-byte allocation",
                self.device,
                self.host.nbytes()
            );
            self.stats.report(what.clone());
            return Err(Error::Device(format!("use after free: {what}")));
        }
        Ok(())
    }
    fn end_access(&self) {
        // Release: the access's writes happen before a later free's AcqRel.
        self.state.fetch_sub(2, Ordering::Release);
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The bytes the sim's copies move for `m`: host memory, or a sim allocation (device-only
/// ones included: the sim is the device, so its copy engine reaches them).
pub(crate) fn bytes_of(m: &dyn DeviceMemory) -> Option<NonNull<u8>> {
    m.host_ptr().or_else(|| {
        m.as_any()
            .downcast_ref::<SimMemory>()
            .and_then(|s| s.host.host_ptr())
    })
}

/// The allocator of one sim device: zero-filled host memory; frees are queued on a sim
/// stream and poison the bytes when the stream reaches them. A capacity
/// ([`SimAdapter::set_memory_capacity`](super::SimAdapter::set_memory_capacity)) bounds the
/// bytes allocated and not yet freed (in stream order); a request beyond it is
/// [`Error::OutOfMemory`].
#[derive(Debug)]
pub struct SimAllocator {
    device: Device,
    pub(crate) stats: Arc<Stats>,
    /// Bytes that may be live at once (`usize::MAX`: unbounded).
    pub(crate) capacity: AtomicUsize,
    faults: Arc<super::faults::FaultState>,
    fault_rng: Mutex<super::SplitMix>,
    host_visible: bool,
}

impl SimAllocator {
    pub(crate) fn new(
        device: Device,
        faults: Arc<super::faults::FaultState>,
        host_visible: bool,
    ) -> Self {
        let fault_rng = Mutex::new(faults.rng(!u64::from(device.index)));
        Self {
            device,
            stats: Arc::new(Stats::default()),
            capacity: AtomicUsize::new(usize::MAX),
            faults,
            fault_rng,
            host_visible,
        }
    }

    /// Reserves `nbytes` of the capacity, or reports out of memory.
    fn reserve(&self, nbytes: usize) -> Result<()> {
        // Relaxed: the capacity is a setting, `live_bytes` a counter; the CAS makes
        // concurrent reservations add up, nothing is published through them.
        let cap = self.capacity.load(Ordering::Relaxed);
        let mut live = self.stats.live_bytes.load(Ordering::Relaxed);
        loop {
            let next = live.checked_add(nbytes).filter(|&n| n <= cap);
            let Some(next) = next else {
                return Err(Error::OutOfMemory {
                    nbytes,
                    stream: self.device.to_string(),
                    detail: format!(
                        "{} has {live} of {cap} bytes in use (freed memory counts until its \
                         stream reaches the free)",
                        self.device
                    ),
                });
            };
            match self.stats.live_bytes.compare_exchange_weak(
                live,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => live = now,
            }
        }
    }
}

impl DeviceAllocator for SimAllocator {
    fn allocate(&self, nbytes: usize) -> Result<Arc<dyn DeviceMemory>> {
        if self
            .faults
            .roll(&self.fault_rng, super::faults::Kind::AllocFail)
        {
            return Err(Error::OutOfMemory {
                nbytes,
                stream: self.device.to_string(),
                detail: format!("{}: sim fault: allocation failed", self.device),
            });
        }
        self.reserve(nbytes)?;
        let host = match HostMemory::try_zeroed(nbytes) {
            Ok(h) => h,
            Err(e) => {
                // Relaxed: gives back the reservation (a counter, as in `reserve`).
                self.stats.live_bytes.fetch_sub(nbytes, Ordering::Relaxed);
                return Err(match e {
                    Error::OutOfMemory { detail, .. } => Error::OutOfMemory {
                        nbytes,
                        stream: self.device.to_string(),
                        detail: format!("{}'s host backing: {detail}", self.device),
                    },
                    e => e,
                });
            }
        };
        // Relaxed: statistics.
        self.stats.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SimMemory {
            host,
            device: self.device,
            host_visible: self.host_visible,
            state: AtomicUsize::new(0),
            stats: self.stats.clone(),
        }))
    }

    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()> {
        if mem.as_any().downcast_ref::<SimMemory>().is_none() || mem.device() != self.device {
            return Err(Error::DeviceMismatch(format!(
                "the allocator of {} cannot free memory of {}",
                self.device,
                mem.device()
            )));
        }
        let Some(s) = stream.as_any().downcast_ref::<super::SimStream>() else {
            return Err(Error::DeviceMismatch(format!(
                "memory of {} freed on a stream of {}",
                self.device,
                stream.device()
            )));
        };
        if s.device() != self.device {
            return Err(Error::DeviceMismatch(format!(
                "memory of {} freed on a stream of {}",
                self.device,
                s.device()
            )));
        }
        s.enqueue_free(mem.clone());
        Ok(())
    }
}
