//! `sim`: a simulated asynchronous accelerator.
//!
//! Each stream is a queue executed by a thread of its own. Every item (a kernel body, a
//! copy, an event record, a device-side wait, a free) may start only after a *launch
//! latency* from its enqueue and after the previous item finished; kernels and copies then
//! take a *kernel* / *copy latency* before their body runs, so their effects appear when
//! they complete, as on a real device. Latencies are drawn uniformly from configurable
//! ranges with a seeded generator ([`SimConfig`]).
//!
//! * [`Event::query`] is false right after [`DeviceStream::record_event`] while work is
//!   queued before the record; the event completes when the stream's thread reaches it,
//!   and then runs its [`on_complete`](Event::on_complete) callbacks on that thread.
//! * [`DeviceStream::wait_event`] really holds back the waiting stream's queue: its thread
//!   sleeps until the event completes.
//! * Memory is host memory, so kernel bodies (host closures) see its bytes. The allocator
//!   frees in stream order and poisons what it frees; an access that begins after the free
//!   (or a free during an access) is refused and counted ([`SimAllocatorStats`]), never a
//!   data race.
//! * A host closure that panics records the stream's error ([`DeviceStream::take_error`]).
//! * Faults can be injected, seeded and off by default ([`SimFaults`] in
//!   [`SimConfig::faults`]): failing launches, events that never complete or complete
//!   with an error, failing allocations, slow copies.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use ivm_device::sim::{SimAdapter, SimConfig};
//! use ivm_std::{Config, Device, StreamId, VirtualMachine};
//!
//! let sim = SimAdapter::new(SimConfig::default());
//! let vm = VirtualMachine::with_adapters(Config::default(), vec![sim.clone()])?;
//! let dev = Device { kind: ivm_device::sim::SIM, index: 0 };
//! let s = vm.stream(StreamId::compute(dev, 0))?;
//! let x = vm.new_tensor_on(&s, 8)?;
//! vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 42))?;
//! let mut out = [0u8; 8];
//! vm.read_small(&x, 0, &mut out)?;
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```

mod event;
mod faults;
mod memory;

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use ivm_core::sync::{AtomicUsize, Ordering};
use ivm_std::device::check_range;
use ivm_std::{
    Device, DeviceAdapter, DeviceAllocator, DeviceKind, DeviceMemory, DeviceStream, Error, Event,
    HostFn, HostMemory, KernelMode, Result, StreamType,
};

pub use event::SimEvent;
pub use faults::{SimFaultStats, SimFaults};
pub use memory::{POISON_BYTE, SimAllocator, SimAllocatorStats, SimMemory};

/// A latency range: each item draws a duration uniformly from `min..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latency {
    /// Shortest.
    pub min: Duration,
    /// Longest.
    pub max: Duration,
}

impl Latency {
    /// No latency.
    pub const ZERO: Latency = Latency::fixed(Duration::ZERO);

    /// Always `d`.
    pub const fn fixed(d: Duration) -> Self {
        Self { min: d, max: d }
    }

    /// Uniform in `min..=max` (swapped if given the wrong way round).
    pub fn between(min: Duration, max: Duration) -> Self {
        Self {
            min: min.min(max),
            max: max.max(min),
        }
    }

    fn draw(&self, rng: &mut SplitMix) -> Duration {
        if self.max <= self.min {
            return self.min;
        }
        let span = (self.max - self.min).as_nanos();
        let span = u64::try_from(span).unwrap_or(u64::MAX);
        self.min + Duration::from_nanos(rng.next() % span.saturating_add(1))
    }
}

/// Configuration of a [`SimAdapter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// How many sim devices (`sim:0` .. `sim:{devices-1}`).
    pub devices: u32,
    /// From enqueue until an item may start.
    pub launch_latency: Latency,
    /// How long a kernel body (or other host closure) takes before it runs.
    pub kernel_latency: Latency,
    /// How long a copy takes before its bytes move.
    pub copy_latency: Latency,
    /// Seed of the latency generator (each stream derives its own).
    pub seed: u64,
    /// Injected faults (none by default).
    pub faults: SimFaults,
    /// Whether the host may touch the devices' memory (default `true`). With `false` the
    /// memory is *device-only*, like a discrete GPU's: `DeviceMemory::host_ptr` is `None`,
    /// so the VM reaches it only through the sim's copies (small reads and writes, sync
    /// callbacks, lazy-job interfaces and parameters stage through host memory), and a
    /// host kernel on it fails. The sim's own copies still move the bytes.
    pub host_visible: bool,
}

impl Default for SimConfig {
    /// One device; 5 µs launch latency, no kernel or copy latency (a kernel takes as long
    /// as its body).
    fn default() -> Self {
        Self {
            devices: 1,
            launch_latency: Latency::fixed(Duration::from_micros(5)),
            kernel_latency: Latency::ZERO,
            copy_latency: Latency::ZERO,
            seed: 0x1b4d_5eed,
            faults: SimFaults::NONE,
            host_visible: true,
        }
    }
}

impl SimConfig {
    /// `devices` devices with random non-zero latencies (launch 20 µs–1 ms, kernels
    /// 20 µs–2 ms, copies 20 µs–1 ms) drawn from `seed`: what tests use so that events
    /// complete well after they are recorded, in an order that varies with the seed.
    pub fn random(devices: u32, seed: u64) -> Self {
        let us = Duration::from_micros;
        Self {
            devices,
            launch_latency: Latency::between(us(20), us(1000)),
            kernel_latency: Latency::between(us(20), us(2000)),
            copy_latency: Latency::between(us(20), us(1000)),
            seed,
            faults: SimFaults::NONE,
            host_visible: true,
        }
    }
}

/// splitmix64: small, seedable, good enough for latencies.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The sim device adapter. Register it with
/// [`VirtualMachine::with_adapters`](ivm_std::VirtualMachine::with_adapters).
#[derive(Debug)]
pub struct SimAdapter {
    config: SimConfig,
    allocators: Vec<Arc<SimAllocator>>,
    streams_created: AtomicUsize,
    faults: Arc<faults::FaultState>,
}

impl SimAdapter {
    /// A sim adapter with `config.devices` devices.
    pub fn new(config: SimConfig) -> Arc<Self> {
        let faults = Arc::new(faults::FaultState::new(config.faults));
        let allocators = (0..config.devices)
            .map(|i| {
                Arc::new(SimAllocator::new(
                    sim_device(i),
                    faults.clone(),
                    config.host_visible,
                ))
            })
            .collect();
        Arc::new(Self {
            config,
            allocators,
            streams_created: AtomicUsize::new(0),
            faults,
        })
    }

    /// The faults injected so far, by kind.
    pub fn fault_stats(&self) -> SimFaultStats {
        self.faults.stats()
    }

    /// Turns every fault off (the device recovers) and completes the events that were
    /// left uncompleted (running their callbacks on this thread); returns how many. Call
    /// it before shutting down a VM whose sim had `event_never_completes`: its last
    /// synchronisations wait for those events.
    pub fn heal(&self) -> usize {
        self.faults.heal()
    }

    /// Turns the configured faults back on after [`heal`](Self::heal).
    pub fn resume_faults(&self) {
        self.faults.resume();
    }

    /// Events left uncompleted now (by `event_never_completes`).
    pub fn stuck_events(&self) -> usize {
        self.faults.stuck_now()
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The allocator counters of device `index` (`None` if it does not exist).
    pub fn allocator_stats(&self, index: u32) -> Option<SimAllocatorStats> {
        self.allocators
            .get(index as usize)
            .map(|a| a.stats.snapshot())
    }

    /// Bounds the memory of device `index` to `capacity` bytes allocated and not yet freed
    /// (`None`: unbounded, the default). An allocation beyond it is
    /// [`Error::OutOfMemory`]; a capacity below what is already in use only refuses new
    /// allocations.
    ///
    /// # Errors
    /// [`Error::UnsupportedStream`] for a device that does not exist.
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_device::sim::{SimAdapter, SimConfig};
    /// use ivm_std::{DeviceAdapter, Error};
    ///
    /// let sim = SimAdapter::new(SimConfig::default());
    /// sim.set_memory_capacity(0, Some(1024))?;
    /// let a = sim.allocator(0)?;
    /// let _x = a.allocate(1000)?;
    /// assert!(matches!(a.allocate(100), Err(Error::OutOfMemory { nbytes: 100, .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn set_memory_capacity(&self, index: u32, capacity: Option<usize>) -> Result<()> {
        self.check(index)?;
        // Relaxed: a setting read by later allocations; nothing is published through it.
        self.allocators[index as usize]
            .capacity
            .store(capacity.unwrap_or(usize::MAX), Ordering::Relaxed);
        Ok(())
    }

    /// A stream of device `index`, outside any VM (the adapter works on its own too).
    pub fn new_stream(&self, index: u32) -> Result<Arc<SimStream>> {
        self.check(index)?;
        // Relaxed: a counter that only makes stream seeds and names distinct.
        let n = self.streams_created.fetch_add(1, Ordering::Relaxed);
        SimStream::spawn(
            sim_device(index),
            &self.config,
            n as u64,
            self.faults.clone(),
        )
    }

    fn check(&self, index: u32) -> Result<()> {
        if index >= self.config.devices {
            return Err(Error::UnsupportedStream(format!(
                "sim:{index}: the sim adapter has {} device(s)",
                self.config.devices
            )));
        }
        Ok(())
    }
}

/// The sim adapter's device kind, `"sim"`: a kind of its own, registered through ivm-std's
/// public API like any third-party adapter's.
pub const SIM: DeviceKind = DeviceKind::named("sim");

/// `sim:index`.
pub const fn sim_device(index: u32) -> Device {
    Device { kind: SIM, index }
}

impl DeviceAdapter for SimAdapter {
    fn kind(&self) -> DeviceKind {
        SIM
    }
    fn device_count(&self) -> u32 {
        self.config.devices
    }
    /// Sim memory is host memory: a stream copies between any two sim devices.
    fn supports_peer_copy(&self) -> bool {
        true
    }
    fn create_stream(&self, index: u32, _stream_type: StreamType) -> Result<Arc<dyn DeviceStream>> {
        Ok(self.new_stream(index)?)
    }
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>> {
        self.check(index)?;
        Ok(self.allocators[index as usize].clone())
    }
}

/// What a queue item does when the stream's thread reaches it.
enum Op {
    Host(HostFn),
    Copy {
        src: Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
        /// An injected fault: copy nothing, record a device error.
        fail: bool,
    },
    Record(Arc<event::EventInner>, EventFault),
    Wait(Arc<event::EventInner>),
    Free(Arc<dyn DeviceMemory>),
}

/// What an injected fault does to an event record.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EventFault {
    None,
    NeverCompletes,
    Error,
}

struct Item {
    /// Earliest start (enqueue + launch latency).
    ready_at: Instant,
    /// How long the item takes before its effect.
    latency: Duration,
    op: Op,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    closed: bool,
    /// An error a host closure or copy hit (taken by `take_error`).
    error: Option<String>,
}

struct StreamState {
    device: Device,
    queue: Mutex<Queue>,
    /// Signalled when an item is pushed or the stream closes.
    cv: Condvar,
    latencies: (Latency, Latency, Latency),
    rng: Mutex<SplitMix>,
    faults: Arc<faults::FaultState>,
    fault_rng: Mutex<SplitMix>,
}

impl StreamState {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_error(&self, e: String) {
        let mut q = self.lock();
        if q.error.is_none() {
            q.error = Some(e);
        }
    }
}

/// A stream of a sim device: an in-order queue run by its own thread.
pub struct SimStream {
    state: Arc<StreamState>,
    pinned: Arc<dyn DeviceMemory>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("device", &self.state.device)
            .field("queued", &self.queued())
            .finish()
    }
}

impl SimStream {
    fn spawn(
        device: Device,
        cfg: &SimConfig,
        n: u64,
        faults: Arc<faults::FaultState>,
    ) -> Result<Arc<Self>> {
        let mut seed = SplitMix(cfg.seed ^ (u64::from(device.index) << 48) ^ n);
        let state = Arc::new(StreamState {
            device,
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            latencies: (cfg.launch_latency, cfg.kernel_latency, cfg.copy_latency),
            rng: Mutex::new(SplitMix(seed.next())),
            fault_rng: Mutex::new(faults.rng(n.wrapping_add(1))),
            faults,
        });
        let s2 = state.clone();
        let h = std::thread::Builder::new()
            .name(format!("sim{}s{n}", device.index))
            .spawn(move || run(&s2))
            .map_err(|e| Error::Spawn(e.to_string()))?;
        let thread_id = h.thread().id();
        Ok(Arc::new(Self {
            state,
            pinned: Arc::new(HostMemory::zeroed(64)),
            thread: Mutex::new(Some(h)),
            thread_id,
        }))
    }

    /// Items queued and not yet started.
    pub fn queued(&self) -> usize {
        self.state.lock().items.len()
    }

    fn push(&self, op: Op) {
        let (launch, kernel, copy) = self.state.latencies;
        let (ready, latency) = {
            let mut rng = self
                .state
                .rng
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let l = launch.draw(&mut rng);
            let k = match op {
                Op::Host(_) => kernel.draw(&mut rng),
                Op::Copy { .. } => copy.draw(&mut rng),
                Op::Record(..) | Op::Wait(_) | Op::Free(_) => Duration::ZERO,
            };
            (l, k)
        };
        let latency = if matches!(op, Op::Copy { .. })
            && self
                .state
                .faults
                .roll(&self.state.fault_rng, faults::Kind::SlowCopy)
        {
            latency.max(Duration::from_micros(10)) * 100
        } else {
            latency
        };
        let item = Item {
            ready_at: Instant::now() + ready,
            latency,
            op,
        };
        let mut q = self.state.lock();
        q.items.push_back(item);
        drop(q);
        self.state.cv.notify_one();
    }

    pub(crate) fn enqueue_free(&self, mem: Arc<dyn DeviceMemory>) {
        self.push(Op::Free(mem));
    }

    fn check_side(&self, m: &dyn DeviceMemory) -> Result<()> {
        let d = m.device();
        // Another sim device's memory: a peer copy (`supports_peer_copy`).
        if d == self.state.device || d == Device::CPU || d.kind == SIM {
            if memory::bytes_of(m).is_none() {
                return Err(Error::DeviceMismatch(format!(
                    "memory of {d} is not host-accessible; the sim cannot copy it"
                )));
            }
            return Ok(());
        }
        Err(Error::DeviceMismatch(format!(
            "a stream of {} copies memory of {} or the host, not of {d}",
            self.state.device, self.state.device
        )))
    }
}

thread_local! {
    /// Set on sim stream threads.
    static ON_SIM_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for SimStream {
    fn drop(&mut self) {
        self.state.lock().closed = true;
        self.state.cv.notify_all();
        // The last handle may go on a sim thread (inside a host closure that held it):
        // joining there could wait for an event that thread itself has yet to reach, so
        // the stream's thread then drains and exits by itself.
        let on_sim = ON_SIM_THREAD.with(std::cell::Cell::get);
        // Neither is it joined while an injected fault leaves events uncompleted: a
        // device-side wait on one would hold it forever; it exits once healed.
        let stuck = self.state.faults.stuck_now() > 0;
        if !on_sim
            && !stuck
            && std::thread::current().id() != self.thread_id
            && let Some(h) = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        {
            let _ = h.join();
        }
    }
}

/// The stream's thread: runs items in order, sleeping while the queue is empty, until a
/// launch latency has passed, for the item's own latency, and on device-side waits.
fn run(state: &StreamState) {
    ON_SIM_THREAD.with(|c| c.set(true));
    loop {
        let item = {
            let mut q = state.lock();
            loop {
                if let Some(i) = q.items.pop_front() {
                    break i;
                }
                if q.closed {
                    return;
                }
                q = state.cv.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let now = Instant::now();
        if item.ready_at > now {
            std::thread::sleep(item.ready_at - now);
        }
        if !item.latency.is_zero() {
            std::thread::sleep(item.latency);
        }
        match item.op {
            Op::Host(f) => {
                if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "non-string panic payload".into());
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
                    state.set_error(format!("{}: host closure panicked: {msg}", state.device));
                }
            }
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
                fail,
            } => {
                if fail {
                    state.set_error(format!("{}: sim fault: copy failed", state.device));
                } else if let Err(e) = copy_now(&*src, src_offset, &*dst, dst_offset, len) {
                    state.set_error(format!("{}: copy failed: {e}", state.device));
                }
            }
            Op::Record(ev, fault) => match fault {
                EventFault::NeverCompletes if state.faults.leave_stuck(&ev) => {}
                EventFault::Error => {
                    state.set_error(format!(
                        "{}: sim fault: event completed with an error",
                        state.device
                    ));
                    ev.complete();
                }
                _ => ev.complete(),
            },
            Op::Wait(ev) => ev.wait(),
            Op::Free(mem) => {
                if let Some(m) = mem.as_any().downcast_ref::<SimMemory>() {
                    m.free_now();
                }
            }
        }
    }
}

fn copy_now(
    src: &dyn DeviceMemory,
    src_offset: usize,
    dst: &dyn DeviceMemory,
    dst_offset: usize,
    len: usize,
) -> Result<()> {
    src.begin_access()?;
    if let Err(e) = dst.begin_access() {
        src.end_access();
        return Err(e);
    }
    if let (Some(s), Some(d)) = (memory::bytes_of(src), memory::bytes_of(dst)) {
        // SAFETY: ranges checked at enqueue; both memories are alive (we hold their Arcs)
        // and not freed (begin_access succeeded); the enqueuer guaranteed nothing else
        // touches the ranges until this copy completes; `copy` allows overlap.
        unsafe { std::ptr::copy(s.as_ptr().add(src_offset), d.as_ptr().add(dst_offset), len) };
    }
    dst.end_access();
    src.end_access();
    Ok(())
}

// SAFETY: one thread runs the queue in order, each item after the previous one finished;
// queued copies hold both memories' `Arc`s until they ran; the pinned buffer is a 64-byte
// `HostMemory` touched only by copies enqueued here.
unsafe impl DeviceStream for SimStream {
    fn device(&self) -> Device {
        self.state.device
    }
    fn kernel_mode(&self) -> KernelMode {
        KernelMode::Queued
    }
    fn launch_host(&self, f: HostFn) -> Result<()> {
        let st = &self.state;
        if st.faults.roll(&st.fault_rng, faults::Kind::LaunchFail) {
            drop(f);
            return Err(Error::Device(format!(
                "{}: sim fault: kernel launch failed",
                st.device
            )));
        }
        self.push(Op::Host(f));
        Ok(())
    }
    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check_side(&**src)?;
        self.check_side(&**dst)?;
        check_range(&**src, src_offset, len)?;
        check_range(&**dst, dst_offset, len)?;
        let st = &self.state;
        let fail = st.faults.roll(&st.fault_rng, faults::Kind::CopyFail);
        self.push(Op::Copy {
            src: src.clone(),
            src_offset,
            dst: dst.clone(),
            dst_offset,
            len,
            fail,
        });
        Ok(())
    }
    fn record_event(&self) -> Result<Arc<dyn Event>> {
        let inner = Arc::new(event::EventInner::default());
        let st = &self.state;
        let fault = if st.faults.roll(&st.fault_rng, faults::Kind::NeverCompletes) {
            EventFault::NeverCompletes
        } else if st.faults.roll(&st.fault_rng, faults::Kind::EventError) {
            EventFault::Error
        } else {
            EventFault::None
        };
        self.push(Op::Record(inner.clone(), fault));
        Ok(Arc::new(SimEvent {
            device: self.state.device,
            inner,
        }))
    }
    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        match event.as_any().downcast_ref::<SimEvent>() {
            Some(e) if e.device == self.state.device => {
                self.push(Op::Wait(e.inner.clone()));
                Ok(())
            }
            _ => Err(Error::ForeignEvent {
                stream: self.state.device,
                event: event.device(),
            }),
        }
    }
    fn synchronize(&self) -> Result<()> {
        self.record_event()?.synchronize()
    }
    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory> {
        &self.pinned
    }
    fn take_error(&self) -> Option<String> {
        self.state.lock().error.take()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests;
