//! `sim`: a simulated asynchronous accelerator.
//!
//! Each stream is a queue executed by a thread of its own. Every item (a kernel body, a
//! copy, an event record, a device-side wait, a free) may start only after a *launch
//! latency* from its enqueue and after the previous item finished; kernels and copies then
//! take a *kernel* / *copy latency* before their body runs, so their effects appear when
//! they complete, as on a real device. Latencies are drawn uniformly from configurable
//! ranges with a seeded generator ([`SimConfig`]).
//!
//! * [`Event::query`](ivm_std::Event::query) is false right after [`DeviceStream::record_event`] while work is
//!   queued before the record; the event completes when the stream's thread reaches it,
//!   and then runs its [`on_complete`](ivm_std::Event::on_complete) callbacks on that thread.
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

mod config;
mod event;
mod faults;
mod memory;
mod stream;

use std::sync::Arc;

use ivm_core::sync::{AtomicUsize, Ordering};
use ivm_std::{
    Device, DeviceAdapter, DeviceAllocator, DeviceKind, DeviceStream, Error, Result, StreamType,
};

pub(crate) use config::SplitMix;
pub use config::{Latency, SimConfig};
pub use event::SimEvent;
pub use faults::{SimFaultStats, SimFaults};
pub use memory::{POISON_BYTE, SimAllocator, SimAllocatorStats, SimMemory};
pub use stream::SimStream;

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

#[cfg(test)]
mod tests;
