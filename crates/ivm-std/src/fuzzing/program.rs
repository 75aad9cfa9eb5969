//! The program model: the [`Op`]s of a random [`Program`] (kernels with their [`Delay`]s,
//! sync accesses, recreates, copies, lazy-graph [`LaunchOp`]s), how `arbitrary` builds
//! them from bytes and how they print.

use std::fmt;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};

use super::{ALL_TENSORS, GRAPHS, MAX_OPS, MAX_STREAMS, TENSORS};
use crate::doors::lazy::LazyGraph;

/// A pause a kernel takes before it reads its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Arbitrary)]
pub enum Delay {
    /// None.
    None,
    /// Busy-wait `n % 64` µs.
    Spin(u8),
    /// `std::thread::yield_now()`.
    Yield,
    /// `std::thread::sleep` for `n % 128 + 1` µs (the OS usually sleeps longer).
    Sleep(u8),
}

impl Delay {
    /// Takes the pause.
    pub fn pause(self) {
        match self {
            Delay::None => {}
            Delay::Spin(n) => {
                let end = Instant::now() + Duration::from_micros(u64::from(n % 64));
                while Instant::now() < end {
                    std::hint::spin_loop();
                }
            }
            Delay::Yield => std::thread::yield_now(),
            Delay::Sleep(n) => std::thread::sleep(Duration::from_micros(u64::from(n % 128) + 1)),
        }
    }
}

/// A kernel call. Tensor sets are bit masks over the [`TENSORS`] slots (higher bits are
/// ignored); a tensor in both sets is an output only. Operands are passed in slot order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOp {
    /// Stream index (modulo [`STREAMS`](super::STREAMS)).
    pub stream: u8,
    /// Kernel id passed to [`Kernels::apply`](super::Kernels::apply).
    pub id: u32,
    /// Tensors read.
    pub inputs: u8,
    /// Tensors written.
    pub outputs: u8,
    /// Pause before reading the inputs.
    pub delay: Delay,
    /// Panic (after the pause, before writing): the outputs get poisoned.
    pub panic: bool,
}

impl KernelOp {
    /// The effective output slots, in order.
    pub fn output_slots(&self) -> impl Iterator<Item = usize> + use<> {
        let m = self.outputs & ALL_TENSORS;
        (0..TENSORS).filter(move |i| m & (1 << i) != 0)
    }

    /// The effective input slots (outputs excluded), in order.
    pub fn input_slots(&self) -> impl Iterator<Item = usize> + use<> {
        let m = self.inputs & ALL_TENSORS & !self.outputs;
        (0..TENSORS).filter(move |i| m & (1 << i) != 0)
    }
}

/// A lazy-job launch of one of the [`GRAPHS`] graphs a [`Runner`](super::Runner) is given
/// ([`LaunchGraphs`]), over a
/// permutation `p` of the tensor slots ([`slots`](Self::slots)):
///
/// * graph 0 (`fuzz_a`): input `a = p[3]`, outputs `o0 = p[0]`, `o1 = p[1]`, parameter
///   `w = p[2]`; `h = mix(mix(a, w), 1)`, `o0 = h`, `o1 = mix(h, 2)`, `w = mix(w, h)`
///   (three graph kernels: forward, output, parameter update);
/// * graph 1 (`fuzz_b`): inputs `b0 = p[2]`, `b1 = p[3]` and an invalid input (also
///   `p[3]`), output `q = p[0]`, parameter `w = p[1]`; `q = mix(mix(b0, b1), w)`,
///   `w = mix(w, mix(b0, 7))`.
///
/// `mix` is [`launch_mix`]. The interpreter runs the graph sequentially at the launch
/// point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchOp {
    /// The graph (modulo [`GRAPHS`]).
    pub graph: u8,
    /// The permutation of the tensor slots (index modulo 24).
    pub perm: u8,
}

impl LaunchOp {
    /// The permutation of the four tensor slots.
    pub fn slots(&self) -> [usize; TENSORS] {
        let mut free: Vec<usize> = (0..TENSORS).collect();
        let mut k = usize::from(self.perm) % 24;
        let mut p = [0; TENSORS];
        for (i, x) in p.iter_mut().enumerate() {
            let r = TENSORS - i;
            *x = free.remove(k % r);
            k /= r;
        }
        p
    }

    /// The graph index.
    pub fn graph_index(&self) -> usize {
        usize::from(self.graph) % GRAPHS
    }
}

/// The lazy graphs a [`Runner`](super::Runner) launches for [`Op::Launch`]
/// ([`Runner::with_launch_graphs`](super::Runner::with_launch_graphs)): graph `i` must
/// compute what [`LaunchOp`] documents for graph `i`, with [`launch_mix`]. Any graph
/// runtime that serves the lazy-job protocol may provide them;
/// `ivm_graph::fuzzing::launch_graphs` builds them with ivm-graph's. The runner keeps
/// them until after its VM has drained.
pub trait LaunchGraphs: Send + Sync {
    /// Graph `index`'s lazy graph (`index < GRAPHS`).
    fn lazy(&self, index: usize) -> &LazyGraph;
}

/// The mixing function of the runner's lazy graphs (non-commutative).
pub fn launch_mix(x: u64, y: u64) -> u64 {
    mix(x ^ y.wrapping_add(0x9e37_79b9_7f4a_7c15).rotate_left(17))
}

/// One step of a [`Program`]. Tensor and stream indices are taken modulo [`TENSORS`] and
/// [`STREAMS`](super::STREAMS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A kernel (queued into the current `run` batch).
    Kernel(KernelOp),
    /// `read_small` of the tensor's 8 bytes.
    SyncRead {
        /// Slot.
        tensor: u8,
    },
    /// `write_small` of `value`.
    SyncWrite {
        /// Slot.
        tensor: u8,
        /// The value written.
        value: u64,
    },
    /// `access_mut` adding `add` (wrapping) to the tensor's first
    /// 8 bytes; observes the value before.
    SyncUpdate {
        /// Slot.
        tensor: u8,
        /// The value added.
        add: u64,
    },
    /// Drops the slot's tensor (inside the current batch, with `release_tensor`) and puts
    /// a new zeroed tensor homed on stream `home` in the slot.
    Recreate {
        /// Slot.
        tensor: u8,
        /// Stream index the new tensor is homed on (its release runs there).
        home: u8,
    },
    /// Copies tensor `src` into tensor `dst` with the builder's `copy` on stream `stream`
    /// (queued into the current batch).
    Copy {
        /// Stream index.
        stream: u8,
        /// Source slot.
        src: u8,
        /// Destination slot.
        dst: u8,
    },
    /// Launches a run of one of the runner's lazy graphs (queued into the current batch;
    /// left out by a runner without [`LaunchGraphs`]).
    Launch(LaunchOp),
    /// A barrier (queued into the current batch); its callback records that it ran.
    Barrier,
    /// `vm.sync()`.
    Sync,
    /// Ends the current `run` batch (submits it).
    Submit,
}

/// A random program (see the [module docs](super)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Program {
    /// The ops, in program order.
    pub ops: Vec<Op>,
}

impl Program {
    /// The program `arbitrary` builds from `bytes` (never fails: exhausted input ends it).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::arbitrary(&mut Unstructured::new(bytes)).unwrap_or_default()
    }

    /// A program from a deterministic pseudo-random byte stream seeded with `seed`.
    pub fn from_seed(seed: u64) -> Self {
        let mut s = seed;
        let bytes: Vec<u8> = (0..512)
            .flat_map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                mix(s).to_le_bytes()
            })
            .collect();
        Self::from_bytes(&bytes)
    }

    /// The same program with every planned kernel panic removed (for libFuzzer, which
    /// aborts on any panic).
    pub fn without_panics(mut self) -> Self {
        for op in &mut self.ops {
            if let Op::Kernel(k) = op {
                k.panic = false;
            }
        }
        self
    }

    /// The program without its [`Op::Launch`]es (what a runner without
    /// [`LaunchGraphs`] runs).
    pub fn without_launches(mut self) -> Self {
        self.ops.retain(|op| !matches!(op, Op::Launch(_)));
        self
    }

    /// Whether some kernel panics.
    pub fn has_panics(&self) -> bool {
        self.ops
            .iter()
            .any(|op| matches!(op, Op::Kernel(k) if k.panic))
    }
}

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let t = |u: &mut Unstructured<'a>| u.int_in_range(0..=TENSORS as u8 - 1);
        let s = |u: &mut Unstructured<'a>| u.int_in_range(0..=MAX_STREAMS as u8 - 1);
        Ok(match u.int_in_range(0u8..=109)? {
            0..=59 => {
                let stream = s(u)?;
                let id = u.arbitrary()?;
                let mut outputs = u.arbitrary::<u8>()? & ALL_TENSORS;
                if outputs.count_ones() > 2 {
                    // Mostly one or two outputs: more conflicts between kernels.
                    outputs &= outputs.wrapping_neg() | (1 << t(u)?);
                }
                if outputs == 0 {
                    outputs = 1 << t(u)?;
                }
                let inputs = u.arbitrary::<u8>()? & ALL_TENSORS & !outputs;
                let delay = match u.int_in_range(0u8..=19)? {
                    0..=6 => Delay::None,
                    7..=13 => Delay::Spin(u.arbitrary()?),
                    14..=15 => Delay::Yield,
                    _ => Delay::Sleep(u.arbitrary()?),
                };
                let panic = u.ratio(1u8, 24)?;
                Op::Kernel(KernelOp {
                    stream,
                    id,
                    inputs,
                    outputs,
                    delay,
                    panic,
                })
            }
            60..=71 => Op::SyncRead { tensor: t(u)? },
            72..=75 => Op::SyncWrite {
                tensor: t(u)?,
                value: u.arbitrary()?,
            },
            76..=78 => Op::SyncUpdate {
                tensor: t(u)?,
                add: u.arbitrary()?,
            },
            79..=84 => Op::Recreate {
                tensor: t(u)?,
                home: s(u)?,
            },
            85..=87 => Op::Barrier,
            88..=90 => Op::Sync,
            91..=99 => Op::Submit,
            100..=105 => Op::Copy {
                stream: s(u)?,
                src: t(u)?,
                dst: t(u)?,
            },
            _ => Op::Launch(LaunchOp {
                graph: u.int_in_range(0..=GRAPHS as u8 - 1)?,
                perm: u.int_in_range(0..=23)?,
            }),
        })
    }
}

impl<'a> Arbitrary<'a> for Program {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(1..=MAX_OPS)?;
        let mut ops = Vec::with_capacity(n);
        while ops.len() < n && !u.is_empty() {
            ops.push(u.arbitrary()?);
        }
        Ok(Program { ops })
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slots = |f: &mut fmt::Formatter<'_>, it: &mut dyn Iterator<Item = usize>| {
            let v: Vec<String> = it.map(|i| format!("t{i}")).collect();
            write!(f, "[{}]", v.join(","))
        };
        match self {
            Op::Kernel(k) => {
                write!(f, "kernel {} on s{}: ", k.id, k.stream)?;
                slots(f, &mut k.input_slots())?;
                write!(f, " -> ")?;
                slots(f, &mut k.output_slots())?;
                match k.delay {
                    Delay::None => {}
                    Delay::Spin(n) => write!(f, ", spin {}us", n % 64)?,
                    Delay::Yield => write!(f, ", yield")?,
                    Delay::Sleep(n) => write!(f, ", sleep {}us", n % 128 + 1)?,
                }
                if k.panic {
                    write!(f, ", PANICS")?;
                }
                Ok(())
            }
            Op::SyncRead { tensor } => write!(f, "sync_read t{}", slot(*tensor)),
            Op::SyncWrite { tensor, value } => {
                write!(f, "sync_write t{} = {value:#x}", slot(*tensor))
            }
            Op::SyncUpdate { tensor, add } => {
                write!(f, "sync_update t{} += {add:#x}", slot(*tensor))
            }
            Op::Recreate { tensor, home } => {
                write!(f, "recreate t{} (home s{home})", slot(*tensor))
            }
            Op::Copy { stream, src, dst } => {
                write!(f, "copy t{} -> t{} on s{stream}", slot(*src), slot(*dst))
            }
            Op::Launch(l) => {
                let p = l.slots();
                match l.graph_index() {
                    0 => write!(
                        f,
                        "launch fuzz_a: in [t{}] -> out [t{},t{}], param t{}",
                        p[3], p[0], p[1], p[2]
                    ),
                    _ => write!(
                        f,
                        "launch fuzz_b: in [t{},t{}] -> out [t{}], param t{}",
                        p[2], p[3], p[0], p[1]
                    ),
                }
            }
            Op::Barrier => write!(f, "barrier"),
            Op::Sync => write!(f, "sync"),
            Op::Submit => write!(f, "submit"),
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  #{i:<3} {op}")?;
        }
        Ok(())
    }
}

/// [`Op::SyncUpdate`]'s body on the tensor's bytes: adds `add` to the word, returns the
/// old one (the runner and the fault harness run it through `access_mut`).
pub(super) fn sync_update(bytes: &mut [u8], add: u64) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[..8]);
    let old = u64::from_ne_bytes(w);
    bytes[..8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
    old
}

pub(super) fn slot(t: u8) -> usize {
    usize::from(t) % TENSORS
}

/// SplitMix64's finaliser: a strong 64-bit mixer.
pub(super) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
