//! Names of devices and streams: plain data that every layer above uses.

use std::fmt;

/// The kind of a device: a name. The host CPU's kind ([`DeviceKind::CPU`]) is built in;
/// every other kind is named by the adapter that serves it (ivm-device's sim adapter is
/// `"sim"`, its CUDA adapter `"cuda"`), and a VM accepts one adapter per name.
///
/// # Examples
///
/// ```
/// use ivm_std::{Device, DeviceKind};
///
/// const NPU: DeviceKind = DeviceKind::named("npu");
/// let d = Device { kind: NPU, index: 1 };
/// assert_eq!(d.to_string(), "npu:1");
/// assert_ne!(NPU, DeviceKind::CPU);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceKind {
    name: &'static str,
}

impl DeviceKind {
    /// The host CPU: synchronous, events done when recorded.
    pub const CPU: DeviceKind = DeviceKind::named("cpu");

    /// The kind named `name` (ASCII letters, digits, `-` and `_`; checked when an adapter
    /// registers it).
    pub const fn named(name: &'static str) -> Self {
        Self { name }
    }

    /// Its name.
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// Whether the name is one a VM accepts: non-empty ASCII letters, digits, `-`, `_`.
    pub(crate) fn is_valid(self) -> bool {
        !self.name.is_empty()
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }
}

impl fmt::Debug for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A device: its kind and its index among devices of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    /// The kind of device.
    pub kind: DeviceKind,
    /// Index among devices of this kind.
    pub index: u32,
}

impl Device {
    /// The host CPU.
    pub const CPU: Device = Device {
        kind: DeviceKind::CPU,
        index: 0,
    };

    /// The host CPU.
    pub const fn cpu() -> Device {
        Self::CPU
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.index)
    }
}

/// What a stream is for. Each type has a [`StreamPolicy`](crate::StreamPolicy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum StreamType {
    /// Kernels. Done at launch: the device queue orders the stream.
    Compute,
    /// Host-to-device copies (an event per instruction decides completion on async devices).
    HostToDevice,
    /// Device-to-host copies (an event per instruction decides completion on async devices).
    DeviceToHost,
    /// Barriers: run on the scheduler thread once they are the oldest lively instruction.
    Barrier,
    /// Critical sections of lazy jobs: a thread of their own per (device type, stream type).
    CriticalSection,
    /// Launches of lazy jobs: a thread of their own per (device type, stream type).
    LazyJobLauncher,
    /// Collective communication (all-reduce, broadcast, ...): a thread of its own per
    /// (device type, stream type), so that a transport call waiting for a slow peer never
    /// holds up a compute worker. Done at launch: a host transport returns when the
    /// collective is complete, a device transport has enqueued it on the stream's device
    /// queue (then readers on other streams wait for an event recorded after it).
    Collective,
}

impl StreamType {
    /// Whether streams of this type get a worker thread of their own per (device type,
    /// stream type) instead of sharing the thread of their thread id. A thread shared by the
    /// critical-section and launcher streams can deadlock.
    pub const fn needs_own_thread(self) -> bool {
        matches!(
            self,
            StreamType::CriticalSection | StreamType::LazyJobLauncher | StreamType::Collective
        )
    }

    /// Whether instructions of this type run on the scheduler thread.
    pub const fn runs_on_scheduler(self) -> bool {
        matches!(self, StreamType::Barrier)
    }

    fn short(self) -> &'static str {
        match self {
            StreamType::Compute => "compute",
            StreamType::HostToDevice => "h2d",
            StreamType::DeviceToHost => "d2h",
            StreamType::Barrier => "barrier",
            StreamType::CriticalSection => "critical-section",
            StreamType::LazyJobLauncher => "lazy-job-launcher",
            StreamType::Collective => "collective",
        }
    }
}

/// The identity of a stream: a device, a stream type and a thread id. Streams of the same
/// device and thread id share one worker thread (unless their type needs its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    /// The device the stream runs on.
    pub device: Device,
    /// What the stream is for.
    pub stream_type: StreamType,
    /// Which worker thread (per device) runs it.
    pub thread_id: u32,
}

impl StreamId {
    /// A compute stream of `device` on worker thread `thread_id`.
    pub const fn compute(device: Device, thread_id: u32) -> Self {
        Self {
            device,
            stream_type: StreamType::Compute,
            thread_id,
        }
    }

    /// The default stream of `device`: compute, thread 0. Sync small-memory accesses run here.
    pub const fn default_for(device: Device) -> Self {
        Self::compute(device, 0)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}#{}",
            self.device,
            self.stream_type.short(),
            self.thread_id
        )
    }
}
