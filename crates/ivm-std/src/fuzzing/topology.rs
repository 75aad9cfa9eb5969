//! The stream topology: the streams a [`Runner`](super::Runner) runs programs on and where
//! their tensors start ([`Topology`], [`stream_ids`]), fitting a program to it and
//! counting its cross-stream uses ([`CrossStream`]).

use std::fmt;

use super::program::{Op, Program, slot};
use super::{ALL_TENSORS, MAX_STREAMS, STREAMS, TENSORS};
use crate::util::error::{Error, Result};
use crate::util::ids::{Device, StreamId, StreamType};

/// The streams a program runs on, by index: the cpu default stream (compute, worker
/// thread 0, where sync reads and writes also run), compute on thread 1, host-to-device on
/// thread 1 (shares that worker with the previous one) and compute on thread 2.
pub fn stream_ids() -> [StreamId; STREAMS] {
    let c = Device::CPU;
    [
        StreamId::default_for(c),
        StreamId::compute(c, 1),
        StreamId {
            device: c,
            stream_type: StreamType::HostToDevice,
            thread_id: 1,
        },
        StreamId::compute(c, 2),
    ]
}

/// The streams a [`Runner`](super::Runner) runs programs on, and where the program's
/// tensors start.
///
/// A program's stream indices are positions in [`streams`](Self::streams); its tensors
/// live on devices (tensor `i` starts homed on stream `homes[i]`, an
/// [`Op::Recreate`] re-homes it). [`fit`](Self::fit) turns any program into one that
/// is valid on the topology: kernels run on a stream of their first output's device and
/// keep only operands of that device; copies run on a stream of the device they touch
/// (preferring host-to-device / device-to-host streams for those directions) and are
/// dropped when they would join two accelerators; planned panics stay only on cpu
/// streams and only in programs without launches (a kernel failing on an asynchronous
/// stream poisons, stickily, what is launched on that stream later, and poison through a
/// graph run is not modelled by [`interpret`](super::interpret)). An op whose stream is
/// already valid keeps it, so `fit` is idempotent (a fitted program replays as it is).
/// For the default cpu topology (the [`stream_ids`]) `fit` changes nothing but drops
/// self-copies.
///
/// The topology of devices other than the cpu needs their adapters: build the runner with
/// [`Runner::with_topology`](super::Runner::with_topology). Every device's memory must be
/// host-accessible (lazy launches copy through host pointers): cpu and sim are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The streams, by index (1 to [`MAX_STREAMS`], distinct, of compute, host-to-device
    /// or device-to-host type).
    pub streams: Vec<StreamId>,
    /// The stream each tensor slot's first tensor is homed on (index into `streams`).
    pub homes: [u8; TENSORS],
}

impl Default for Topology {
    fn default() -> Self {
        Self::cpu()
    }
}

impl Topology {
    /// The cpu-only topology of [`stream_ids`], every tensor homed on the default stream.
    pub fn cpu() -> Self {
        Self {
            streams: stream_ids().to_vec(),
            homes: [0; TENSORS],
        }
    }

    /// The cpu (default stream, compute on thread 1) plus, per device in `devices`:
    /// compute on threads 0 and 1, host-to-device on thread 0, device-to-host on thread 1.
    /// Tensors start on the cpu default stream, the first device, the last device and the
    /// cpu's second stream.
    pub fn with_devices(devices: &[Device]) -> Self {
        let c = Device::CPU;
        let mut streams = vec![StreamId::default_for(c), StreamId::compute(c, 1)];
        for &d in devices {
            let id = |stream_type, thread_id| StreamId {
                device: d,
                stream_type,
                thread_id,
            };
            streams.extend([
                id(StreamType::Compute, 0),
                id(StreamType::Compute, 1),
                id(StreamType::HostToDevice, 0),
                id(StreamType::DeviceToHost, 1),
            ]);
        }
        let homes = match devices.len() {
            0 => [0, 1, 0, 1],
            n => [0, 2, (2 + 4 * (n - 1)) as u8, 1],
        };
        Self { streams, homes }
    }

    /// Checks the topology.
    ///
    /// # Errors
    /// [`Error::Config`] for no streams or more than [`MAX_STREAMS`], a stream listed
    /// twice, a stream type other than compute, host-to-device or device-to-host, or a home
    /// out of range.
    pub fn validate(&self) -> Result<()> {
        let n = self.streams.len();
        if n == 0 || n > MAX_STREAMS {
            return Err(Error::Config(format!(
                "fuzzing topology: {n} streams (1 to {MAX_STREAMS})"
            )));
        }
        for (i, s) in self.streams.iter().enumerate() {
            if self.streams[..i].contains(s) {
                return Err(Error::Config(format!("fuzzing topology: {s} listed twice")));
            }
            if !matches!(
                s.stream_type,
                StreamType::Compute | StreamType::HostToDevice | StreamType::DeviceToHost
            ) {
                return Err(Error::Config(format!(
                    "fuzzing topology: {s}: only compute and copy streams"
                )));
            }
        }
        if let Some(h) = self.homes.iter().find(|&&h| usize::from(h) >= n) {
            return Err(Error::Config(format!(
                "fuzzing topology: home s{h} of {n} streams"
            )));
        }
        Ok(())
    }

    /// The device of stream `index` (modulo the number of streams).
    pub fn device_of(&self, index: usize) -> Device {
        self.streams[index % self.streams.len()].device
    }

    fn on(&self, d: Device) -> Vec<usize> {
        (0..self.streams.len())
            .filter(|&i| self.streams[i].device == d)
            .collect()
    }

    /// `program` made valid on this topology (see the [type docs](Self)). Stream indices
    /// of the result are positions in [`streams`](Self::streams).
    pub fn fit(&self, program: &Program) -> Program {
        let n = self.streams.len();
        let launches = program.ops.iter().any(|op| matches!(op, Op::Launch(_)));
        let mut dev: [Device; TENSORS] =
            std::array::from_fn(|t| self.device_of(usize::from(self.homes[t])));
        let on_dev = |dev: &[Device; TENSORS], d: Device| -> u8 {
            (0..TENSORS)
                .filter(|&t| dev[t] == d)
                .fold(0, |m, t| m | (1 << t))
        };
        let mut ops = Vec::with_capacity(program.ops.len());
        for op in &program.ops {
            match *op {
                Op::Kernel(mut k) => {
                    let s0 = usize::from(k.stream) % n;
                    let d = k
                        .output_slots()
                        .next()
                        .map_or(self.device_of(s0), |t| dev[t]);
                    let s = if self.device_of(s0) == d {
                        s0
                    } else {
                        let c = self.on(d);
                        c[usize::from(k.stream) % c.len()]
                    };
                    let m = on_dev(&dev, d);
                    k.stream = s as u8;
                    k.inputs &= m & ALL_TENSORS;
                    k.outputs &= m & ALL_TENSORS;
                    k.panic &= d == Device::CPU && !launches;
                    ops.push(Op::Kernel(k));
                }
                Op::Recreate { tensor, home } => {
                    let h = usize::from(home) % n;
                    dev[slot(tensor)] = self.streams[h].device;
                    ops.push(Op::Recreate {
                        tensor,
                        home: h as u8,
                    });
                }
                Op::Copy { stream, src, dst } => {
                    let (s, t) = (slot(src), slot(dst));
                    let (ds, dd) = (dev[s], dev[t]);
                    if s == t || (ds != Device::CPU && dd != Device::CPU && ds != dd) {
                        continue;
                    }
                    let d = if ds == Device::CPU { dd } else { ds };
                    let want = match (ds == Device::CPU, dd == Device::CPU) {
                        (true, false) => Some(StreamType::HostToDevice),
                        (false, true) => Some(StreamType::DeviceToHost),
                        _ => None,
                    };
                    let c = self.on(d);
                    let pref: Vec<usize> = c
                        .iter()
                        .copied()
                        .filter(|&i| Some(self.streams[i].stream_type) == want)
                        .collect();
                    let b = usize::from(stream);
                    let s = if self.device_of(b) == d {
                        b % n
                    } else if b % 2 == 0 && !pref.is_empty() {
                        pref[(b / 2) % pref.len()]
                    } else {
                        c[b % c.len()]
                    };
                    ops.push(Op::Copy {
                        stream: s as u8,
                        src,
                        dst,
                    });
                }
                other => ops.push(other),
            }
        }
        Program { ops }
    }

    /// Counts the cross-stream uses of a [`fit`](Self::fit)ted program: an operand used on
    /// another stream than its tensor's previous use (what soft sync orders).
    pub fn cross_stream_uses(&self, program: &Program) -> CrossStream {
        let mut dev: [Device; TENSORS] =
            std::array::from_fn(|t| self.device_of(usize::from(self.homes[t])));
        let mut last: [Option<StreamId>; TENSORS] = [None; TENSORS];
        let mut c = CrossStream::default();
        let cs = StreamId {
            device: Device::CPU,
            stream_type: StreamType::CriticalSection,
            thread_id: 0,
        };
        let mut used = |t: usize, s: StreamId, last: &mut [Option<StreamId>; TENSORS]| {
            if let Some(l) = last[t]
                && l != s
            {
                c.streams += 1;
                if l.device != s.device {
                    c.devices += 1;
                }
            }
            last[t] = Some(s);
        };
        for op in &program.ops {
            match *op {
                Op::Kernel(k) => {
                    let s = self.streams[usize::from(k.stream) % self.streams.len()];
                    for t in k.input_slots().chain(k.output_slots()) {
                        used(t, s, &mut last);
                    }
                }
                Op::Copy { stream, src, dst } => {
                    let s = self.streams[usize::from(stream) % self.streams.len()];
                    used(slot(src), s, &mut last);
                    used(slot(dst), s, &mut last);
                }
                Op::SyncRead { tensor }
                | Op::SyncWrite { tensor, .. }
                | Op::SyncUpdate { tensor, .. } => {
                    let t = slot(tensor);
                    used(t, StreamId::default_for(dev[t]), &mut last);
                }
                Op::Launch(l) => {
                    for t in l.slots() {
                        used(t, cs, &mut last);
                    }
                }
                Op::Recreate { tensor, home } => {
                    let t = slot(tensor);
                    dev[t] = self.device_of(usize::from(home));
                    last[t] = None;
                }
                Op::Barrier | Op::Sync | Op::Submit => {}
            }
        }
        c
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "streams:")?;
        for (i, s) in self.streams.iter().enumerate() {
            write!(f, " s{i}={s}")?;
        }
        write!(f, "; homes:")?;
        for (t, h) in self.homes.iter().enumerate() {
            write!(f, " t{t}=s{h}")?;
        }
        Ok(())
    }
}

/// Cross-stream uses in a program ([`Topology::cross_stream_uses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CrossStream {
    /// Operands used on another stream than their tensor's previous use.
    pub streams: usize,
    /// Of those, the ones where the two streams are on different devices.
    pub devices: usize,
}
