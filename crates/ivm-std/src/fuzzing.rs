//! Equivalence fuzzing of the VM (feature `fuzzing`): random instruction programs run by a
//! real [`VirtualMachine`] must give exactly the results of a sequential interpreter.
//!
//! A [`Program`] is a list of [`Op`]s over [`TENSORS`] one-word (`u64`) tensors and
//! [`STREAMS`] streams spread over three worker threads:
//!
//! * [`Op::Kernel`]: a kernel on one stream that reads some tensors and writes others
//!   (`x ← hash(x, kernel id, inputs)` by default: non-commutative, so any reordering of
//!   dependent kernels changes the result), after an optional small [`Delay`] (spin, yield
//!   or sleep, taken *before* it reads its inputs, so a missing edge lets another thread
//!   overtake it), and optionally panicking (a failed instruction poisons its outputs);
//! * [`Op::SyncRead`] / [`Op::SyncWrite`]: `sync_read_small_mem` / `sync_write_small_mem`
//!   interleaved with the kernels;
//! * [`Op::Recreate`]: drops the tensor's handle (its release is enqueued while kernels
//!   may still use it) and puts a fresh zeroed tensor, homed on some stream, in its slot;
//! * [`Op::Barrier`], [`Op::Sync`] and [`Op::Submit`] (ends the current `run` batch).
//!
//! [`interpret`] runs a program sequentially and gives the expected [`Trace`] (every sync
//! read and sync write result, the final value of every tensor, the order barriers ran),
//! with the VM's poison semantics: a kernel that panics poisons its outputs; a kernel or a
//! sync access that touches a poisoned tensor fails without running and poisons its
//! outputs with the same failure (its first poisoned operand's, inputs before outputs);
//! later sync reads of a poisoned tensor get [`Error::Poisoned`] carrying the message of
//! the kernel that panicked. [`Runner`] runs the same program on a VM and compares; a
//! difference is a [`Mismatch`] whose `Display` names the first differing observation and
//! lists the program.
//!
//! Programs come from bytes through [`arbitrary::Arbitrary`] (cargo-fuzz), from
//! [`Program::from_bytes`] (proptest over a byte vector) or from [`Program::from_seed`]
//! (a deterministic loop). libFuzzer aborts on any panic, so fuzz targets call
//! [`Program::without_panics`]; kernel panics belong in proptest.
//!
//! # Fuzzing your own kernels
//!
//! A runtime built on ivm plugs its kernels in through [`Kernels`]: kernel id → a
//! deterministic function from the input words to the output words. The interpreter and
//! the VM call the same function, so the check covers the VM's ordering of *your* kernels
//! (and a kernel that panics on some inputs is modelled too).
//!
//! ```
//! use ivm_std::Config;
//! use ivm_std::fuzzing::{Kernels, Program, Runner};
//!
//! /// Two kernels of "my runtime": an affine update and a saturating subtraction.
//! struct MyKernels;
//!
//! impl Kernels for MyKernels {
//!     fn apply(&self, id: u32, inputs: &[u64], outputs: &mut [u64]) {
//!         let sum = inputs.iter().fold(0u64, |a, &x| a.wrapping_mul(3).wrapping_add(x));
//!         for (j, o) in outputs.iter_mut().enumerate() {
//!             *o = match id % 2 {
//!                 0 => o.wrapping_mul(5).wrapping_add(sum).wrapping_add(j as u64),
//!                 _ => sum.saturating_sub(*o) ^ u64::from(id),
//!             };
//!         }
//!     }
//! }
//!
//! let runner = Runner::with_kernels(Config::default(), MyKernels)?;
//! for seed in 0..8 {
//!     let program = Program::from_seed(seed);
//!     if let Err(mismatch) = runner.run(&program) {
//!         panic!("{mismatch}");
//!     }
//! }
//! // Nothing may outlive the programs in the engine.
//! assert_eq!(runner.shutdown()?, ivm_std::DebugCounters::default());
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! A cargo-fuzz target reuses one runner (one VM) across runs; its body is this function
//! (see `fuzz/fuzz_targets/vm_program.rs` in the ivm repository):
//!
//! ```no_run
//! use std::sync::OnceLock;
//!
//! use ivm_std::Config;
//! use ivm_std::fuzzing::{Program, Runner};
//!
//! static RUNNER: OnceLock<Runner> = OnceLock::new();
//!
//! // libfuzzer_sys::fuzz_target!(|program: Program| fuzz_one(program));
//! fn fuzz_one(program: Program) {
//!     let runner = RUNNER.get_or_init(|| Runner::new(Config::default()).unwrap());
//!     if let Err(mismatch) = runner.run(&program.without_panics()) {
//!         panic!("{mismatch}");
//!     }
//! }
//! ```

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use arbitrary;
use arbitrary::{Arbitrary, Unstructured};

use crate::error::{Error, Result};
use crate::stream::{Device, Stream, StreamId, StreamType};
use crate::tensor::Tensor;
use crate::vm::VirtualMachine;
use crate::{Config, DebugCounters};

/// Tensors per program (one `u64` word each).
pub const TENSORS: usize = 4;
/// Streams per program (see [`stream_ids`]).
pub const STREAMS: usize = 4;
/// Most ops [`Program`]'s `Arbitrary` impl generates.
pub const MAX_OPS: usize = 40;
/// Every planned kernel panic's message starts with this.
pub const PANIC_MARKER: &str = "ivm-fuzz: planned panic";

const ALL_TENSORS: u8 = (1 << TENSORS) - 1;

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
    /// Stream index (modulo [`STREAMS`]).
    pub stream: u8,
    /// Kernel id passed to [`Kernels::apply`].
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

    fn stream_index(&self) -> usize {
        usize::from(self.stream) % STREAMS
    }
}

/// One step of a [`Program`]. Tensor and stream indices are taken modulo [`TENSORS`] and
/// [`STREAMS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A kernel (queued into the current `run` batch).
    Kernel(KernelOp),
    /// `sync_read_small_mem` of the tensor's 8 bytes.
    SyncRead {
        /// Slot.
        tensor: u8,
    },
    /// `sync_write_small_mem` of `value`.
    SyncWrite {
        /// Slot.
        tensor: u8,
        /// The value written.
        value: u64,
    },
    /// Drops the slot's tensor (inside the current batch, with `release_tensor`) and puts
    /// a new zeroed tensor homed on stream `home` in the slot.
    Recreate {
        /// Slot.
        tensor: u8,
        /// Stream index the new tensor is homed on (its release runs there).
        home: u8,
    },
    /// A barrier (queued into the current batch); its callback records that it ran.
    Barrier,
    /// `vm.sync()`.
    Sync,
    /// Ends the current `run` batch (submits it).
    Submit,
}

/// A random program (see the [module docs](self)).
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
        let s = |u: &mut Unstructured<'a>| u.int_in_range(0..=STREAMS as u8 - 1);
        Ok(match u.int_in_range(0u8..=99)? {
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
            72..=78 => Op::SyncWrite {
                tensor: t(u)?,
                value: u.arbitrary()?,
            },
            79..=84 => Op::Recreate {
                tensor: t(u)?,
                home: s(u)?,
            },
            85..=87 => Op::Barrier,
            88..=90 => Op::Sync,
            _ => Op::Submit,
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
                write!(f, "kernel {} on s{}: ", k.id, k.stream_index())?;
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
            Op::Recreate { tensor, home } => write!(
                f,
                "recreate t{} (home s{})",
                slot(*tensor),
                usize::from(*home) % STREAMS
            ),
            Op::Barrier => write!(f, "barrier"),
            Op::Sync => write!(f, "sync"),
            Op::Submit => write!(f, "submit"),
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids = stream_ids();
        write!(f, "streams:")?;
        for (i, s) in ids.iter().enumerate() {
            write!(f, " s{i}={s}")?;
        }
        writeln!(f)?;
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  #{i:<3} {op}")?;
        }
        Ok(())
    }
}

fn slot(t: u8) -> usize {
    usize::from(t) % TENSORS
}

/// SplitMix64's finaliser: a strong 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The kernels a program calls: kernel id → a deterministic function of the input words
/// (one per input tensor, in slot order) updating the output words in place (each holds
/// the tensor's current value on entry). It runs on VM worker threads and in the
/// interpreter, and must give the same result for the same arguments. A panic is allowed
/// (it is modelled: the outputs are poisoned) but must be deterministic too.
pub trait Kernels: Send + Sync + 'static {
    /// Runs kernel `id`.
    fn apply(&self, id: u32, inputs: &[u64], outputs: &mut [u64]);
}

/// The default kernels: `x ← hash(x, id, output position, inputs in order)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HashKernels;

impl Kernels for HashKernels {
    fn apply(&self, id: u32, inputs: &[u64], outputs: &mut [u64]) {
        for (j, o) in outputs.iter_mut().enumerate() {
            let mut h = mix(*o ^ (u64::from(id) << 8) ^ j as u64);
            for &x in inputs {
                h = mix(h ^ x);
            }
            *o = h;
        }
    }
}

/// What a sync access, or the final read of a tensor, observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// A sync read (or final read) returned this value.
    Value(u64),
    /// A sync write succeeded.
    Written,
    /// The access failed with [`Error::Poisoned`] carrying this message (the message of
    /// the kernel panic that poisoned the tensor first).
    Poisoned(String),
    /// Any other error (never expected).
    Error(String),
}

impl Observed {
    fn from_result(r: Result<Observed>) -> Self {
        match r {
            Ok(o) => o,
            Err(Error::Poisoned { message, .. }) => Observed::Poisoned(message),
            Err(e) => Observed::Error(e.to_string()),
        }
    }
}

impl fmt::Display for Observed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observed::Value(v) => write!(f, "value {v:#018x}"),
            Observed::Written => write!(f, "write ok"),
            Observed::Poisoned(m) => write!(f, "poisoned ({m})"),
            Observed::Error(e) => write!(f, "error: {e}"),
        }
    }
}

/// Everything a run of a program observes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// `(op index, result)` of every sync read and sync write, in program order.
    pub syncs: Vec<(usize, Observed)>,
    /// The final value (or poison) of every tensor slot.
    pub finals: Vec<Observed>,
    /// Op indices of the barriers, in the order their callbacks ran.
    pub barriers: Vec<usize>,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

fn planned_panic_message(op: usize) -> String {
    format!("{PANIC_MARKER} in op #{op}")
}

/// Runs `program` sequentially: the results the VM must reproduce.
pub fn interpret<K: Kernels + ?Sized>(program: &Program, kernels: &K) -> Trace {
    let mut value = [0u64; TENSORS];
    // The message of the failure that poisoned each slot first.
    let mut poison: [Option<String>; TENSORS] = Default::default();
    let mut trace = Trace::default();
    for (i, op) in program.ops.iter().enumerate() {
        match *op {
            Op::Kernel(k) => {
                let ins: Vec<usize> = k.input_slots().collect();
                let outs: Vec<usize> = k.output_slots().collect();
                let refused = ins.iter().chain(&outs).find_map(|&t| poison[t].clone());
                let failure = refused.or_else(|| {
                    let iv: Vec<u64> = ins.iter().map(|&t| value[t]).collect();
                    let mut ov: Vec<u64> = outs.iter().map(|&t| value[t]).collect();
                    let r = catch_unwind(AssertUnwindSafe(|| {
                        kernels.apply(k.id, &iv, &mut ov);
                    }));
                    match r {
                        Err(p) => Some(panic_message(&*p)),
                        Ok(()) if k.panic => Some(planned_panic_message(i)),
                        Ok(()) => {
                            for (&t, v) in outs.iter().zip(ov) {
                                value[t] = v;
                            }
                            None
                        }
                    }
                });
                if let Some(m) = failure {
                    for &t in &outs {
                        poison[t].get_or_insert_with(|| m.clone());
                    }
                }
            }
            Op::SyncRead { tensor } => {
                let t = slot(tensor);
                let o = match &poison[t] {
                    Some(m) => Observed::Poisoned(m.clone()),
                    None => Observed::Value(value[t]),
                };
                trace.syncs.push((i, o));
            }
            Op::SyncWrite { tensor, value: v } => {
                let t = slot(tensor);
                let o = match &poison[t] {
                    Some(m) => Observed::Poisoned(m.clone()),
                    None => {
                        value[t] = v;
                        Observed::Written
                    }
                };
                trace.syncs.push((i, o));
            }
            Op::Recreate { tensor, .. } => {
                let t = slot(tensor);
                value[t] = 0;
                poison[t] = None;
            }
            Op::Barrier => trace.barriers.push(i),
            Op::Sync | Op::Submit => {}
        }
    }
    trace.finals = (0..TENSORS)
        .map(|t| match &poison[t] {
            Some(m) => Observed::Poisoned(m.clone()),
            None => Observed::Value(value[t]),
        })
        .collect();
    trace
}

/// Where the VM and the interpreter first disagreed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Point {
    /// The sync read or write of op `op`.
    Sync {
        /// Op index.
        op: usize,
    },
    /// The final value of a tensor slot.
    Final {
        /// Slot.
        tensor: usize,
    },
    /// The order (or number) of barrier callbacks.
    Barriers,
    /// Engine objects left after shutdown ([`check`] only).
    Leftover,
    /// A VM call failed at op `op` (`None`: after the program).
    Vm {
        /// Op index.
        op: Option<usize>,
    },
}

/// A difference between the VM and the interpreter. `Display` shows the first difference
/// and the whole program.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The program.
    pub program: Program,
    /// Where they first differ.
    pub at: Point,
    /// What the interpreter says.
    pub expected: String,
    /// What the VM did.
    pub got: String,
    /// The VM's whole trace, when it ran to the end.
    pub vm_trace: Option<Trace>,
    /// The interpreter's trace.
    pub expected_trace: Trace,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = match &self.at {
            Point::Sync { op } => format!("op #{op} ({})", self.program.ops[*op]),
            Point::Final { tensor } => format!("final value of t{tensor}"),
            Point::Barriers => "barrier order".into(),
            Point::Leftover => "live engine objects after shutdown".into(),
            Point::Vm { op: Some(op) } => format!("VM call at op #{op}"),
            Point::Vm { op: None } => "VM call after the program".into(),
        };
        writeln!(f, "VM differs from the sequential interpreter at {at}:")?;
        writeln!(f, "  expected: {}", self.expected)?;
        writeln!(f, "  got:      {}", self.got)?;
        writeln!(f, "program ({} ops):", self.program.ops.len())?;
        write!(f, "{}", self.program)
    }
}

impl std::error::Error for Mismatch {}

/// Statistics of one successful run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Kernels submitted.
    pub kernels: usize,
    /// Sync reads and writes compared.
    pub syncs: usize,
    /// Kernels that panicked (planned).
    pub panics: usize,
}

/// Runs programs on one [`VirtualMachine`] and compares them with [`interpret`]. The VM is
/// reused across programs (each program gets fresh tensors).
pub struct Runner<K: Kernels = HashKernels> {
    vm: VirtualMachine,
    streams: Vec<Stream>,
    kernels: Arc<K>,
}

impl<K: Kernels> fmt::Debug for Runner<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner").field("vm", &self.vm).finish()
    }
}

impl Runner<HashKernels> {
    /// A runner with [`HashKernels`] on a new VM with `config` (use a multi-thread one).
    pub fn new(config: Config) -> Result<Self> {
        Self::with_kernels(config, HashKernels)
    }
}

impl<K: Kernels> Runner<K> {
    /// A runner with `kernels` on a new VM with `config`.
    pub fn with_kernels(config: Config, kernels: K) -> Result<Self> {
        let vm = VirtualMachine::new(config)?;
        let streams = stream_ids()
            .into_iter()
            .map(|id| vm.stream(id))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            vm,
            streams,
            kernels: Arc::new(kernels),
        })
    }

    /// The VM.
    pub fn vm(&self) -> &VirtualMachine {
        &self.vm
    }

    /// Shuts the VM down (draining it) and returns its live-object counters, which are
    /// all zero unless the VM leaked an instruction, access or edge.
    pub fn shutdown(self) -> Result<DebugCounters> {
        self.vm.shutdown()?;
        Ok(self.vm.debug_counters())
    }

    /// Runs `program` on the VM and compares every sync access, every final value and the
    /// barrier order with [`interpret`].
    pub fn run(&self, program: &Program) -> Result<Outcome, Box<Mismatch>> {
        let expected = interpret(program, &*self.kernels);
        let got = self.execute(program).map_err(|(op, e)| {
            Box::new(Mismatch {
                program: program.clone(),
                at: Point::Vm { op },
                expected: "Ok".into(),
                got: e.to_string(),
                vm_trace: None,
                expected_trace: expected.clone(),
            })
        })?;
        let mismatch = |at, e: &dyn fmt::Display, g: &dyn fmt::Display| {
            Box::new(Mismatch {
                program: program.clone(),
                at,
                expected: e.to_string(),
                got: g.to_string(),
                vm_trace: Some(got.clone()),
                expected_trace: expected.clone(),
            })
        };
        for ((op, e), (_, g)) in expected.syncs.iter().zip(&got.syncs) {
            if e != g {
                return Err(mismatch(Point::Sync { op: *op }, e, g));
            }
        }
        for (t, (e, g)) in expected.finals.iter().zip(&got.finals).enumerate() {
            if e != g {
                return Err(mismatch(Point::Final { tensor: t }, e, g));
            }
        }
        if expected.barriers != got.barriers {
            return Err(mismatch(
                Point::Barriers,
                &format!("{:?}", expected.barriers),
                &format!("{:?}", got.barriers),
            ));
        }
        let kernels: Vec<&KernelOp> = program
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Kernel(k) => Some(k),
                _ => None,
            })
            .collect();
        Ok(Outcome {
            kernels: kernels.len(),
            syncs: got.syncs.len(),
            panics: kernels.iter().filter(|k| k.panic).count(),
        })
    }

    /// Runs `program` on the VM and records what it observes.
    fn execute(&self, program: &Program) -> Result<Trace, (Option<usize>, Error)> {
        let vm = &self.vm;
        let mut tensors: Vec<Tensor> = (0..TENSORS)
            .map(|_| vm.new_tensor(8))
            .collect::<Result<_>>()
            .map_err(|e| (None, e))?;
        let barriers = Arc::new(Mutex::new(Vec::new()));
        let mut trace = Trace::default();
        let mut i = 0;
        while i < program.ops.len() {
            match program.ops[i] {
                Op::SyncRead { tensor } => {
                    let mut b = [0u8; 8];
                    let r = vm
                        .sync_read_small_mem(&tensors[slot(tensor)], &mut b)
                        .map(|()| Observed::Value(u64::from_ne_bytes(b)));
                    trace.syncs.push((i, Observed::from_result(r)));
                    i += 1;
                }
                Op::SyncWrite { tensor, value } => {
                    let r = vm
                        .sync_write_small_mem(&tensors[slot(tensor)], &value.to_ne_bytes())
                        .map(|()| Observed::Written);
                    trace.syncs.push((i, Observed::from_result(r)));
                    i += 1;
                }
                Op::Sync => {
                    vm.sync().map_err(|e| (Some(i), e))?;
                    i += 1;
                }
                Op::Submit => i += 1,
                Op::Kernel(_) | Op::Recreate { .. } | Op::Barrier => {
                    // A batch: every kernel, recreate and barrier up to the next other op.
                    let start = i;
                    let end = program.ops[i..]
                        .iter()
                        .position(|op| {
                            !matches!(op, Op::Kernel(_) | Op::Recreate { .. } | Op::Barrier)
                        })
                        .map_or(program.ops.len(), |p| i + p);
                    vm.run(|b| {
                        for (j, op) in program.ops[start..end].iter().enumerate() {
                            self.build(b, start + j, op, &mut tensors, &barriers)?;
                        }
                        Ok(())
                    })
                    .map_err(|e| (Some(start), e))?;
                    i = end;
                }
            }
        }
        for t in &tensors {
            let mut b = [0u8; 8];
            let r = vm
                .sync_read_small_mem(t, &mut b)
                .map(|()| Observed::Value(u64::from_ne_bytes(b)));
            trace.finals.push(Observed::from_result(r));
        }
        drop(tensors);
        // Every barrier was received before this sync, so each has run.
        vm.sync().map_err(|e| (None, e))?;
        trace.barriers = std::mem::take(&mut *barriers.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(trace)
    }

    fn build(
        &self,
        b: &mut crate::InstructionsBuilder<'_>,
        index: usize,
        op: &Op,
        tensors: &mut [Tensor],
        barriers: &Arc<Mutex<Vec<usize>>>,
    ) -> Result<()> {
        match *op {
            Op::Kernel(k) => {
                let ins: Vec<&Tensor> = k.input_slots().map(|t| &tensors[t]).collect();
                let outs: Vec<&Tensor> = k.output_slots().map(|t| &tensors[t]).collect();
                let kernels = self.kernels.clone();
                b.call_named(
                    "fuzz_kernel",
                    &self.streams[k.stream_index()],
                    &ins,
                    &outs,
                    move |ctx| {
                        k.delay.pause();
                        let mut iv = [0u64; TENSORS];
                        let mut ov = [0u64; TENSORS];
                        let (ni, no) = (ctx.num_inputs(), ctx.num_outputs());
                        for (x, v) in iv.iter_mut().enumerate().take(ni) {
                            *v = ctx.input_u64(x)[0];
                        }
                        for (x, v) in ov.iter_mut().enumerate().take(no) {
                            *v = ctx.output_u64(x)[0];
                        }
                        kernels.apply(k.id, &iv[..ni], &mut ov[..no]);
                        if k.panic {
                            panic!("{}", planned_panic_message(index));
                        }
                        for (x, v) in ov.iter().enumerate().take(no) {
                            ctx.output_u64(x)[0] = *v;
                        }
                    },
                )
            }
            Op::Recreate { tensor, home } => {
                let s = &self.streams[usize::from(home) % STREAMS];
                let fresh = self.vm.new_tensor_on(s, 8)?;
                let old = std::mem::replace(&mut tensors[slot(tensor)], fresh);
                b.release_tensor(old)
            }
            Op::Barrier => {
                let rec = barriers.clone();
                b.barrier(move || rec.lock().unwrap_or_else(|e| e.into_inner()).push(index))
            }
            Op::SyncRead { .. } | Op::SyncWrite { .. } | Op::Sync | Op::Submit => {
                unreachable!("ivm fuzzing: not a batch op")
            }
        }
    }
}

/// Runs `program` on a fresh VM with `config` and [`HashKernels`], compares it with the
/// interpreter, then shuts the VM down and checks that nothing was left behind.
pub fn check(program: &Program, config: Config) -> Result<Outcome, Box<Mismatch>> {
    let vm_err = |e: Error| {
        Box::new(Mismatch {
            program: program.clone(),
            at: Point::Vm { op: None },
            expected: "Ok".into(),
            got: e.to_string(),
            vm_trace: None,
            expected_trace: interpret(program, &HashKernels),
        })
    };
    let runner = Runner::new(config).map_err(vm_err)?;
    let outcome = runner.run(program)?;
    let left = runner.shutdown().map_err(vm_err)?;
    if left != DebugCounters::default() {
        return Err(Box::new(Mismatch {
            program: program.clone(),
            at: Point::Leftover,
            expected: format!("{:?}", DebugCounters::default()),
            got: format!("{left:?}"),
            vm_trace: None,
            expected_trace: interpret(program, &HashKernels),
        }));
    }
    Ok(outcome)
}

/// Installs (once per process) a panic hook that stays silent for planned kernel panics
/// (messages starting with [`PANIC_MARKER`]) and defers to the previous hook otherwise.
pub fn silence_planned_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let planned = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with(PANIC_MARKER));
            if !planned {
                previous(info);
            }
        }));
    });
}

/// A bug planted in the engine to show that the equivalence check catches it (tests of
/// this module only; see `Config::planted`). Never set outside those tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlantedBug {
    /// No bug (the default).
    #[default]
    None,
    /// A write does not wait for the reads since the last write (dropped read→write
    /// edges).
    DropReadWriteEdge,
    /// Release out of order on a stream: once a stream's oldest instruction is
    /// releasable, the newest one without in-edges is released first, whether it has
    /// finished or not.
    OutOfOrderRelease,
}
