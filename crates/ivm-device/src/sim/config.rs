//! The sim's configuration: latency ranges, the adapter's settings, and the seeded
//! generator the latencies and faults are drawn from.

use std::time::Duration;

use ivm_std::KernelMode;

use super::SimFaults;

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

    pub(super) fn draw(&self, rng: &mut SplitMix) -> Duration {
        if self.max <= self.min {
            return self.min;
        }
        let span = (self.max - self.min).as_nanos();
        let span = u64::try_from(span).unwrap_or(u64::MAX);
        self.min + Duration::from_nanos(rng.next() % span.saturating_add(1))
    }
}

/// Configuration of a [`SimAdapter`](super::SimAdapter).
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
    /// Whether the streams are *launcher* streams ([`KernelMode::Launcher`], the mode cuda's
    /// streams have) instead of queued ones ([`KernelMode::Queued`], the default): a
    /// kernel's body then runs on the VM's worker and enqueues its device work on
    /// [`KernelCtx::device_stream`](ivm_std::KernelCtx::device_stream) (host work through
    /// [`KernelCtx::on_host`](ivm_std::KernelCtx::on_host)), with the same queue,
    /// latencies, events and faults. What runs on cuda's streams runs on these without a
    /// GPU.
    pub launcher: bool,
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
            launcher: false,
        }
    }
}

impl SimConfig {
    /// The kernel mode of this configuration's streams ([`launcher`](Self::launcher)).
    pub fn kernel_mode(&self) -> KernelMode {
        if self.launcher {
            KernelMode::Launcher
        } else {
            KernelMode::Queued
        }
    }

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
            launcher: false,
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
