//! A caching allocator per device stream, with size-class bins.
//!
//! [`CachingAllocator`] wraps any [`DeviceAllocator`] for **one stream**. A request is
//! rounded up to a size class ([`size_class`]: four classes per power of two, at most 25%
//! slack, 256 bytes at least) and served from that class's bin when it holds a block;
//! otherwise the device allocator is asked for a block of the class size. The block is
//! handed out as a [`CachedBlock`] whose [`nbytes`](DeviceMemory::nbytes) is the size
//! requested.
//!
//! # Stream order
//!
//! A block freed with [`free_on`](DeviceAllocator::free_on) on the cache's own stream goes
//! back into that stream's bins at once, without a trip through the device allocator: the
//! caller of `free_on` guarantees (as for every allocator) that nothing enqueued *after*
//! the free on that stream's order races with what came before, so work enqueued later on
//! the same stream may use the block. Work on *other* streams may not, until it is ordered
//! after the stream (soft sync does that in the VM). A block freed on another stream is
//! returned to the device allocator in that stream's order instead.
//!
//! # Zero fill
//!
//! The [`DeviceAllocator`] contract promises zero-filled memory that is ready for every
//! stream. A reused block holds its previous owner's bytes, and the previous owner's work
//! may still be queued on the stream, so it can only be filled in stream order:
//!
//! * [`CachingAllocator::allocate_on_stream`] (what the VM uses) does **not** zero a reused
//!   block: it says so ([`Allocation::reused`]) and the caller fills it in stream order.
//!   The VM enqueues a fill instruction on the stream that writes the tensor (zeros, or the
//!   initial data), and marks the stream as the tensor's last user, so soft sync orders
//!   every other stream after the fill. On a synchronous device (cpu) it fills at once:
//!   nothing is queued there.
//! * The [`DeviceAllocator::allocate`] implementation keeps the trait's promise: it zeroes
//!   a reused block in stream order and blocks until the stream has done it.
//!
//! # Out of memory
//!
//! A device allocation that fails with [`Error::OutOfMemory`] is reported with the
//! request size and the cache's stream. [`DeviceAllocator::allocate`] on the cache first
//! returns the cached blocks to the device, waits for the stream, and retries once; the VM
//! does the same for every stream of the device (never from one of its own threads, where
//! waiting could deadlock). Nothing aborts.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use ivm_std::alloc_cache::CachingAllocator;
//! use ivm_std::{CpuAdapter, DeviceAdapter, DeviceAllocator, StreamType};
//!
//! let cpu = CpuAdapter::new();
//! let stream = cpu.create_stream(0, StreamType::Compute)?;
//! let cache = CachingAllocator::new(cpu.allocator(0)?, stream.clone(), "cpu:0/compute");
//! let a = cache.allocate(1000)?; // a miss: 1024 bytes from the device allocator
//! cache.free_on(&a, &*stream)?; // back into the stream's 1024-byte bin
//! let b = cache.allocate_on_stream(900)?; // a hit: same block, stale bytes
//! assert!(b.reused);
//! assert_eq!(b.mem.nbytes(), 900);
//! let st = cache.stats();
//! assert_eq!((st.hits, st.misses, st.cached_bytes), (1, 1, 0));
//! cache.free_on(&b.mem, &*stream)?;
//! assert_eq!(cache.release_cached()?, 1024); // back to the device allocator
//! # Ok::<(), ivm_std::Error>(())
//! ```

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ivm_core::sync::{AtomicBool, Ordering};

use crate::device::cpu::HostMemory;
use crate::device::{DeviceAllocator, DeviceMemory, DeviceStream, KernelMode};
use crate::util::error::{Error, Result};
use crate::util::ids::Device;
use crate::util::lock;

/// The smallest size class (and the granularity of small requests).
pub const MIN_CLASS: usize = 256;

/// The size class of a request of `nbytes`: at least [`MIN_CLASS`], otherwise `nbytes`
/// rounded up to the next of `2^k`, `1.25 · 2^k`, `1.5 · 2^k`, `1.75 · 2^k` (at most 25%
/// slack). Sizes too large to round are their own class.
///
/// ```
/// use ivm_std::alloc_cache::size_class;
/// assert_eq!(size_class(1), 256);
/// assert_eq!(size_class(257), 320);
/// assert_eq!(size_class(1000), 1024);
/// assert_eq!(size_class(1025), 1280);
/// ```
pub fn size_class(nbytes: usize) -> usize {
    if nbytes <= MIN_CLASS {
        return MIN_CLASS;
    }
    // k = floor(log2(nbytes - 1)) >= 8, so the step is at least 64.
    let k = usize::BITS - 1 - (nbytes - 1).leading_zeros();
    let step = (1usize << k) / 4;
    nbytes.div_ceil(step).checked_mul(step).unwrap_or(nbytes)
}

/// A block handed out by a [`CachingAllocator`]: a device allocation of a size class,
/// seen as the `nbytes` bytes requested.
///
/// [`as_any`](DeviceMemory::as_any) answers with the wrapped allocation, so adapters that
/// downcast memory to their own type (for device pointers) work on blocks unchanged;
/// [`cached_block`](DeviceMemory::cached_block) answers with the block itself.
pub struct CachedBlock {
    base: Arc<dyn DeviceMemory>,
    nbytes: usize,
    class: usize,
    /// Set by the first free (a second free is a no-op).
    released: AtomicBool,
}

impl CachedBlock {
    /// The device allocation this block wraps (its size is the block's size class).
    pub fn base(&self) -> &Arc<dyn DeviceMemory> {
        &self.base
    }

    /// The size class (the bytes the device allocation holds).
    pub fn class(&self) -> usize {
        self.class
    }
}

impl fmt::Debug for CachedBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedBlock")
            .field("nbytes", &self.nbytes)
            .field("class", &self.class)
            .field("device", &self.base.device())
            .finish()
    }
}

// SAFETY: `host_ptr` is the wrapped allocation's pointer, which that allocation's own
// `DeviceMemory` guarantee makes 8-byte aligned and valid for `base.nbytes() >= nbytes`
// initialised bytes while `base` lives (we hold it); the cache touches the bytes only
// through the zero fills it enqueues in stream order. The answer is the wrapped
// allocation's, the same on every call.
unsafe impl DeviceMemory for CachedBlock {
    fn device(&self) -> Device {
        self.base.device()
    }
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        self.base.host_ptr()
    }
    fn device_ptr(&self) -> u64 {
        self.base.device_ptr()
    }
    fn begin_access(&self) -> Result<()> {
        self.base.begin_access()
    }
    fn end_access(&self) {
        self.base.end_access();
    }
    fn as_any(&self) -> &dyn Any {
        self.base.as_any()
    }
    fn cached_block(&self) -> Option<&CachedBlock> {
        Some(self)
    }
}

/// What [`CachingAllocator::allocate_on_stream`] returns.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// The memory (`nbytes` as requested).
    pub mem: Arc<dyn DeviceMemory>,
    /// `false`: fresh from the device allocator, zero-filled and ready for every stream.
    /// `true`: reused from the stream's bins: its bytes are stale and it is ready only in
    /// the cache's stream order; the caller must fill it in that order and order other
    /// streams after the fill.
    pub reused: bool,
}

/// Counters of a caching allocator (or the sum over a VM's streams:
/// [`VirtualMachine::cache_stats`](crate::VirtualMachine::cache_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes of the blocks waiting in the bins now (size-class bytes).
    pub cached_bytes: usize,
    /// Blocks waiting in the bins now.
    pub cached_blocks: usize,
    /// Allocations served from the bins, ever.
    pub hits: usize,
    /// Allocations that went to the device allocator, ever (zero-size requests excluded).
    pub misses: usize,
    /// Bytes obtained from the device allocator, ever.
    pub device_allocated_bytes: usize,
    /// Bytes returned to the device allocator, ever.
    pub returned_bytes: usize,
}

impl CacheStats {
    /// The field-wise sum of `self` and `other`.
    pub fn merged(self, other: CacheStats) -> CacheStats {
        CacheStats {
            cached_bytes: self.cached_bytes + other.cached_bytes,
            cached_blocks: self.cached_blocks + other.cached_blocks,
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            device_allocated_bytes: self.device_allocated_bytes + other.device_allocated_bytes,
            returned_bytes: self.returned_bytes + other.returned_bytes,
        }
    }
}

/// The blocks of one size class.
#[derive(Default)]
struct Bin {
    /// Idle device allocations of the class. Its capacity is kept at least `total`, so
    /// that a free (on the release path of every tensor) never allocates.
    idle: Vec<Arc<dyn DeviceMemory>>,
    /// Blocks of the class this cache holds or has handed out.
    total: usize,
}

#[derive(Default)]
struct Bins {
    /// Size class -> its bin (entries are created by misses, before any free needs them).
    bins: BTreeMap<usize, Bin>,
    stats: CacheStats,
}

/// A caching allocator for one device stream (see the [module docs](self)).
pub struct CachingAllocator {
    inner: Arc<dyn DeviceAllocator>,
    stream: Arc<dyn DeviceStream>,
    label: String,
    bins: Mutex<Bins>,
    /// How long `allocate` waits for its stream (`None`: as long as the device takes).
    sync_timeout: Option<std::time::Duration>,
}

impl fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("stream", &self.label)
            .field("stats", &self.stats())
            .finish()
    }
}

impl CachingAllocator {
    /// A cache over `inner` (the allocator of `stream`'s device) for `stream`; `label`
    /// names the stream in errors.
    pub fn new(
        inner: Arc<dyn DeviceAllocator>,
        stream: Arc<dyn DeviceStream>,
        label: impl Into<String>,
    ) -> Self {
        Self {
            inner,
            stream,
            label: label.into(),
            bins: Mutex::new(Bins::default()),
            sync_timeout: None,
        }
    }

    /// Bounds the waits of [`allocate`](DeviceAllocator::allocate) for its stream (a
    /// reused block is zeroed in stream order, and an allocation that found the device
    /// out of memory waits for the blocks it returned): after `timeout` it fails with
    /// [`Error::Timeout`], whose diagnostic names the stream's device work, instead of
    /// blocking for as long as the device takes (forever, on an event that never
    /// completes). The VM bounds its caches by its `timeout_period`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use ivm_std::alloc_cache::CachingAllocator;
    /// use ivm_std::{CpuAdapter, DeviceAdapter, DeviceAllocator, StreamType};
    ///
    /// let cpu = CpuAdapter::new();
    /// let stream = cpu.create_stream(0, StreamType::Compute)?;
    /// let cache = CachingAllocator::new(cpu.allocator(0)?, stream, "cpu/test")
    ///     .with_sync_timeout(Duration::from_secs(1));
    /// assert_eq!(cache.allocate(64)?.nbytes(), 64);
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    #[must_use]
    pub fn with_sync_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.sync_timeout = Some(timeout);
        self
    }

    /// Waits for the device work queued so far on the cache's stream (bounded by
    /// [`with_sync_timeout`](Self::with_sync_timeout)).
    fn sync_stream(&self) -> Result<()> {
        let Some(deadline) = self
            .sync_timeout
            .and_then(|t| std::time::Instant::now().checked_add(t))
        else {
            return self.stream.synchronize();
        };
        if super::wait_streams(&[&*self.stream], deadline)?.is_empty() {
            return Ok(());
        }
        let mut d = crate::util::error::Diagnostic::default();
        d.lively
            .push(crate::util::error::LivelyInstruction::device_work(
                &self.label,
                None,
            ));
        Err(Error::Timeout(d))
    }

    /// The stream this cache serves.
    pub fn stream(&self) -> &Arc<dyn DeviceStream> {
        &self.stream
    }

    /// The device allocator it wraps.
    pub fn inner(&self) -> &Arc<dyn DeviceAllocator> {
        &self.inner
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> CacheStats {
        lock(&self.bins).stats
    }

    fn is_own_stream(&self, stream: &dyn DeviceStream) -> bool {
        std::ptr::addr_eq(stream as *const dyn DeviceStream, Arc::as_ptr(&self.stream))
    }

    /// `nbytes` bytes for work on this cache's stream: from the bins when a block of the
    /// size class is cached (`reused`: stale bytes, ready in stream order only — see
    /// [`Allocation`]), otherwise a zero-filled block of the size class from the device
    /// allocator. Zero-size requests go to the device allocator unwrapped.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming the request and the stream when the device allocator
    /// is out of memory (this call does not retry: see [`release_cached`](Self::release_cached));
    /// whatever else the device allocator reports.
    pub fn allocate_on_stream(&self, nbytes: usize) -> Result<Allocation> {
        if nbytes == 0 {
            return Ok(Allocation {
                mem: self
                    .inner
                    .allocate(0)
                    .map_err(|e| self.name_request(e, 0))?,
                reused: false,
            });
        }
        let class = size_class(nbytes);
        {
            let mut g = lock(&self.bins);
            let hit = g.bins.get_mut(&class).and_then(|b| b.idle.pop());
            if let Some(base) = hit {
                g.stats.hits += 1;
                g.stats.cached_blocks -= 1;
                g.stats.cached_bytes -= class;
                drop(g);
                return Ok(Allocation {
                    mem: Arc::new(CachedBlock {
                        base,
                        nbytes,
                        class,
                        released: AtomicBool::new(false),
                    }),
                    reused: true,
                });
            }
        }
        let base = self
            .inner
            .allocate(class)
            .map_err(|e| self.name_request(e, nbytes))?;
        if base.nbytes() < class || base.device() != self.stream.device() {
            return Err(Error::Device(format!(
                "the allocator of {} returned {} bytes on {} for {class} bytes",
                self.stream.device(),
                base.nbytes(),
                base.device()
            )));
        }
        {
            let mut g = lock(&self.bins);
            g.stats.misses += 1;
            g.stats.device_allocated_bytes += class;
            let bin = g.bins.entry(class).or_default();
            bin.total += 1;
            // Room for every block of the class: its free will not allocate.
            let room = bin.total.saturating_sub(bin.idle.len());
            bin.idle.reserve(room);
        }
        Ok(Allocation {
            mem: Arc::new(CachedBlock {
                base,
                nbytes,
                class,
                released: AtomicBool::new(false),
            }),
            reused: false,
        })
    }

    /// Names the request and the stream in an out-of-memory error.
    fn name_request(&self, e: Error, nbytes: usize) -> Error {
        match e {
            Error::OutOfMemory { detail, .. } => {
                let class = size_class(nbytes);
                let cached = self.stats().cached_bytes;
                Error::OutOfMemory {
                    nbytes,
                    stream: format!("stream {}", self.label),
                    detail: format!(
                        "{detail} (size class {class} bytes; {cached} bytes cached on this stream)"
                    ),
                }
            }
            e => e,
        }
    }

    /// Returns every cached block to the device allocator, freed in this cache's stream
    /// order (after everything enqueued on the stream so far). Returns the bytes returned.
    /// The device may reclaim them only when the stream gets there: synchronise the
    /// stream to be sure they are gone
    /// ([`VirtualMachine::shrink_all_mem`](crate::VirtualMachine::shrink_all_mem) does).
    ///
    /// # Errors
    /// The first error of the device allocator's `free_on` (the other blocks are still
    /// returned).
    pub fn release_cached(&self) -> Result<usize> {
        let taken: Vec<(usize, Arc<dyn DeviceMemory>)> = {
            let mut g = lock(&self.bins);
            g.stats.cached_blocks = 0;
            g.stats.cached_bytes = 0;
            let mut taken = Vec::new();
            for (&class, bin) in g.bins.iter_mut() {
                bin.total = bin.total.saturating_sub(bin.idle.len());
                taken.extend(bin.idle.drain(..).map(|b| (class, b)));
            }
            g.bins.retain(|_, b| b.total > 0);
            taken
        };
        let mut bytes = 0;
        let mut first = None;
        for (class, base) in taken {
            match self.inner.free_on(&base, &*self.stream) {
                Ok(()) => bytes += class,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        lock(&self.bins).stats.returned_bytes += bytes;
        first.map_or(Ok(bytes), Err)
    }

    /// Fills `mem` (a block this cache handed out) with zeros in stream order.
    fn zero_in_stream_order(&self, mem: &Arc<dyn DeviceMemory>) -> Result<()> {
        let n = mem.nbytes();
        if mem.host_ptr().is_some() {
            let m = mem.clone();
            let fill = move || {
                if let Some(p) = m.host_ptr() {
                    // SAFETY: the block was just taken from the bins: in this stream's
                    // order nothing else touches it (its previous owner's work ran
                    // before, nobody else holds it yet); `p` is valid for `n` bytes.
                    unsafe { std::ptr::write_bytes(p.as_ptr(), 0, n) };
                }
            };
            if self.stream.kernel_mode() == KernelMode::Synchronous {
                fill();
                return Ok(());
            }
            return self.stream.launch_host(Box::new(fill));
        }
        let zeros: Arc<dyn DeviceMemory> = Arc::new(HostMemory::try_zeroed(n)?);
        // SAFETY: as above, nothing else touches the block in stream order; the zeros are
        // ours; the stream holds both until the copy completed.
        unsafe { self.stream.copy(&zeros, 0, mem, 0, n) }
    }
}

impl DeviceAllocator for CachingAllocator {
    /// Keeps the trait's promise: a reused block is zeroed in stream order and this call
    /// blocks until the stream has done it (so it must not be called from a host closure
    /// running on the cache's own stream). Out of memory: returns the cached blocks to the
    /// device, waits for the stream, retries once.
    fn allocate(&self, nbytes: usize) -> Result<Arc<dyn DeviceMemory>> {
        let a = match self.allocate_on_stream(nbytes) {
            Err(Error::OutOfMemory { .. }) if self.stats().cached_blocks > 0 => {
                self.release_cached()?;
                self.sync_stream()?;
                self.allocate_on_stream(nbytes)?
            }
            r => r?,
        };
        if a.reused {
            let r = self.zero_in_stream_order(&a.mem).and_then(|()| {
                if self.stream.kernel_mode() == KernelMode::Synchronous {
                    Ok(())
                } else {
                    self.sync_stream()
                }
            });
            if let Err(e) = r {
                // Back into the bins, in stream order (dropped, the block would leak its
                // device memory): zeroed again when it is reused.
                let _ = self.free_on(&a.mem, &*self.stream);
                return Err(e);
            }
        }
        Ok(a.mem)
    }

    /// A block of a caching allocator freed on this cache's stream goes into this cache's
    /// bins (a second free of the same block is a no-op); one freed on another stream is
    /// returned to the device allocator in that stream's order; other memory is passed to
    /// the device allocator.
    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()> {
        let Some(b) = mem.cached_block() else {
            return self.inner.free_on(mem, stream);
        };
        if b.base.device() != self.stream.device() {
            return Err(Error::DeviceMismatch(format!(
                "a block of {} freed through the cache of stream {}",
                b.base.device(),
                self.label
            )));
        }
        // AcqRel: one free wins; it sees the block as its handing-out left it.
        if b.released.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if !self.is_own_stream(stream) {
            self.inner.free_on(&b.base, stream)?;
            let mut g = lock(&self.bins);
            g.stats.returned_bytes += b.class;
            if let Some(bin) = g.bins.get_mut(&b.class) {
                bin.total = bin.total.saturating_sub(1);
            }
            return Ok(());
        }
        let mut g = lock(&self.bins);
        g.bins.entry(b.class).or_default().idle.push(b.base.clone());
        g.stats.cached_blocks += 1;
        g.stats.cached_bytes += b.class;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceAdapter;
    use crate::device::cpu::CpuAdapter;
    use crate::util::ids::StreamType;

    fn cache() -> (CachingAllocator, Arc<dyn DeviceStream>) {
        let cpu = CpuAdapter::new();
        let s = cpu.create_stream(0, StreamType::Compute).unwrap();
        (
            CachingAllocator::new(cpu.allocator(0).unwrap(), s.clone(), "cpu:0/test"),
            s,
        )
    }

    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        for n in (1..5000).chain([1 << 20, (1 << 20) + 1, usize::MAX / 2, usize::MAX]) {
            let c = size_class(n);
            assert!(c >= n, "{n} -> {c}");
            if n > MIN_CLASS {
                assert!(c - n <= n / 4 + 1, "{n} -> {c}");
            }
            assert_eq!(size_class(c), c, "a class is its own class ({n} -> {c})");
        }
    }

    #[test]
    fn freed_blocks_are_reused_zeroed_and_double_frees_are_noops() {
        let (c, s) = cache();
        let a = c.allocate(100).unwrap();
        // SAFETY: the block is ours; 100 bytes are valid.
        unsafe { std::ptr::write_bytes(a.host_ptr().unwrap().as_ptr(), 7, 100) };
        c.free_on(&a, &*s).unwrap();
        c.free_on(&a, &*s).unwrap();
        assert_eq!(c.stats().cached_blocks, 1);
        let b = c.allocate(200).unwrap();
        assert_eq!(b.nbytes(), 200);
        assert_eq!(b.host_ptr(), a.host_ptr());
        // SAFETY: as above, 200 bytes (class 256).
        let bytes = unsafe { std::slice::from_raw_parts(b.host_ptr().unwrap().as_ptr(), 200) };
        assert!(bytes.iter().all(|&x| x == 0));
        let st = c.stats();
        assert_eq!((st.hits, st.misses, st.cached_blocks), (1, 1, 0));
    }

    #[test]
    fn blocks_freed_on_another_stream_go_back_to_the_device() {
        let (c, _s) = cache();
        let other = CpuAdapter::new()
            .create_stream(0, StreamType::Compute)
            .unwrap();
        let a = c.allocate(10).unwrap();
        c.free_on(&a, &*other).unwrap();
        let st = c.stats();
        assert_eq!((st.cached_blocks, st.returned_bytes), (0, MIN_CLASS));
    }

    #[test]
    fn zero_size_requests_pass_through() {
        let (c, s) = cache();
        let a = c.allocate(0).unwrap();
        assert!(a.cached_block().is_none());
        c.free_on(&a, &*s).unwrap();
        assert_eq!(c.stats(), CacheStats::default());
    }
}
