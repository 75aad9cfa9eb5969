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
//! * [`Op::SyncRead`] / [`Op::SyncWrite`]: `read_small` / `write_small`
//!   interleaved with the kernels; [`Op::SyncUpdate`]: a read-modify-write through
//!   `access_mut` (which the VM may run on the calling thread);
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
use std::sync::{Arc, Mutex};

pub use arbitrary;

use crate::device::DeviceAdapter;
use crate::model::stream::Stream;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};
use crate::vm::VirtualMachine;
use crate::{Config, DebugCounters};

mod faults;
mod interpreter;
mod program;
mod topology;

pub use faults::{FaultCampaign, FaultControl, FaultOutcome};
pub use interpreter::{HashKernels, Kernels, Observed, Trace, interpret};
use interpreter::{batch_end, planned_panic_message, run_graph};
use program::slot;
pub use program::{Delay, KernelOp, LaunchGraphs, LaunchOp, Op, Program, launch_mix};
pub use topology::{CrossStream, Topology, stream_ids};

/// Tensors per program (one `u64` word each).
pub const TENSORS: usize = 4;
/// Streams per program (see [`stream_ids`]).
pub const STREAMS: usize = 4;
/// Most ops [`Program`]'s `Arbitrary` impl generates: long enough for histories that
/// cross streams and devices many times (a 300 s run at 40 never exceeded a few dozen).
pub const MAX_OPS: usize = 128;
/// Most streams a [`Topology`] may have (stream indices in ops range over `0..MAX_STREAMS`
/// and are taken modulo the topology's length).
pub const MAX_STREAMS: usize = 16;
/// Lazy graphs a [`Runner`] launches (see [`LaunchOp`], [`LaunchGraphs`]).
pub const GRAPHS: usize = 2;
/// Every planned kernel panic's message starts with this.
pub const PANIC_MARKER: &str = "ivm-fuzz: planned panic";

const ALL_TENSORS: u8 = (1 << TENSORS) - 1;

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
    /// The program (as fitted to the topology).
    pub program: Program,
    /// The runner's topology.
    pub topology: Topology,
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
        writeln!(f, "{}", self.topology)?;
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
    /// Copies submitted.
    pub copies: usize,
    /// Lazy-job launches submitted.
    pub launches: usize,
    /// Cross-stream uses ([`Topology::cross_stream_uses`]).
    pub cross: CrossStream,
}

/// Runs programs on one [`VirtualMachine`] and compares them with [`interpret`]. The VM is
/// reused across programs (each program gets fresh tensors).
pub struct Runner<K: Kernels = HashKernels> {
    vm: VirtualMachine,
    topology: Topology,
    streams: Vec<Stream>,
    kernels: Arc<K>,
    /// The graphs [`Op::Launch`] launches ([`with_launch_graphs`](Self::with_launch_graphs));
    /// without them launches are left out of programs. Declared after `vm`, so dropped
    /// after the VM drained.
    graphs: Option<Box<dyn LaunchGraphs>>,
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

    /// A runner like [`new`](Self::new) whose VM's engine has `bug` planted: the
    /// equivalence check's own tests show that it catches each bug. The only way to plant
    /// one; no `Config` can.
    #[doc(hidden)]
    pub fn with_planted_bug(config: Config, bug: PlantedBug) -> Result<Self> {
        Self::start(config, Vec::new(), Topology::cpu(), HashKernels, bug)
    }
}

impl<K: Kernels> Runner<K> {
    /// A runner with `kernels` on a new VM with `config` and the cpu [`Topology`].
    pub fn with_kernels(config: Config, kernels: K) -> Result<Self> {
        Self::with_topology(config, Vec::new(), Topology::cpu(), kernels)
    }

    /// A runner with `kernels` on a new VM with `config` and `adapters` (besides the cpu),
    /// running programs on `topology`'s streams.
    ///
    /// # Errors
    /// An invalid topology ([`Topology::validate`]), the VM's start errors, a stream the
    /// adapters cannot create.
    pub fn with_topology(
        config: Config,
        adapters: Vec<Arc<dyn DeviceAdapter>>,
        topology: Topology,
        kernels: K,
    ) -> Result<Self> {
        Self::start(config, adapters, topology, kernels, PlantedBug::None)
    }

    fn start(
        config: Config,
        adapters: Vec<Arc<dyn DeviceAdapter>>,
        topology: Topology,
        kernels: K,
        planted: PlantedBug,
    ) -> Result<Self> {
        topology.validate()?;
        let vm = VirtualMachine::start(config, adapters, planted)?;
        let streams = topology
            .streams
            .iter()
            .map(|&id| vm.stream(id))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            vm,
            topology,
            streams,
            kernels: Arc::new(kernels),
            graphs: None,
        })
    }

    /// This runner, launching `graphs` for the programs' [`Op::Launch`]es. Without it a
    /// runner leaves launches out of every program (ivm-std has no graph runtime of its
    /// own; `ivm_graph::fuzzing::launch_graphs` builds these with ivm-graph's).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a graph's interface is not the one [`LaunchOp`]
    /// documents (inputs, outputs and parameters, by count and size).
    pub fn with_launch_graphs(mut self, graphs: impl LaunchGraphs + 'static) -> Result<Self> {
        // Per graph: which inputs and outputs are valid (graph 1's third input is not),
        // and its parameter count.
        let shapes: [(&[bool], &[bool], usize); GRAPHS] = [
            (&[true], &[true, true], 1),
            (&[true, true, false], &[true], 1),
        ];
        for (index, (inputs, outputs, params)) in shapes.into_iter().enumerate() {
            let g = graphs.lazy(index);
            let valid =
                |i: &[crate::lazy::Interface]| i.iter().map(|i| i.valid).collect::<Vec<_>>();
            let sizes = g.inputs().iter().chain(g.outputs()).map(|i| i.nbytes);
            let ok = valid(g.inputs()) == inputs
                && valid(g.outputs()) == outputs
                && g.params().len() == params
                && sizes
                    .chain(g.params().iter().map(|p| p.nbytes))
                    .all(|b| b == 8);
            if !ok {
                return Err(Error::InvalidArgument(format!(
                    "launch graph {index} ({}) must have {} inputs (valid: {inputs:?}), {} \
                     outputs (valid: {outputs:?}) and {params} parameter, of 8 bytes each \
                     (see LaunchOp)",
                    g.job_name(),
                    inputs.len(),
                    outputs.len(),
                )));
            }
        }
        self.graphs = Some(Box::new(graphs));
        Ok(self)
    }

    /// `program` as this runner runs it: fitted to the topology ([`Topology::fit`]), its
    /// launches left out when the runner has no [`LaunchGraphs`].
    pub(crate) fn prepare(&self, program: &Program) -> Program {
        match self.graphs {
            Some(_) => self.topology.fit(program),
            None => self.topology.fit(&program.clone().without_launches()),
        }
    }

    /// The VM.
    pub fn vm(&self) -> &VirtualMachine {
        &self.vm
    }

    /// The topology programs run on.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Shuts the VM down (draining it) and returns its live-object counters, which are
    /// all zero unless the VM leaked an instruction, access or edge.
    pub fn shutdown(self) -> Result<DebugCounters> {
        self.vm.shutdown()?;
        Ok(self.vm.debug_counters())
    }

    /// Fits `program` to the topology ([`Topology::fit`]; launches left out without
    /// [`LaunchGraphs`]), runs it on the VM and compares
    /// every sync access, every final value and the barrier order with [`interpret`].
    pub fn run(&self, program: &Program) -> Result<Outcome, Box<Mismatch>> {
        let program = &self.prepare(program);
        let expected = interpret(program, &*self.kernels);
        let got = self.execute(program).map_err(|(op, e)| {
            Box::new(Mismatch {
                program: program.clone(),
                topology: self.topology.clone(),
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
                topology: self.topology.clone(),
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
        let count = |f: fn(&Op) -> bool| program.ops.iter().filter(|op| f(op)).count();
        Ok(Outcome {
            kernels: kernels.len(),
            syncs: got.syncs.len(),
            panics: kernels.iter().filter(|k| k.panic).count(),
            copies: count(|op| matches!(op, Op::Copy { .. })),
            launches: count(|op| matches!(op, Op::Launch(_))),
            cross: self.topology.cross_stream_uses(program),
        })
    }

    /// Runs `program` on the VM and records what it observes.
    fn execute(&self, program: &Program) -> Result<Trace, (Option<usize>, Error)> {
        let vm = &self.vm;
        let mut tensors: Vec<Tensor> = (0..TENSORS)
            .map(|t| vm.new_tensor_on(&self.streams[usize::from(self.topology.homes[t])], 8))
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
                        .read_small(&tensors[slot(tensor)], 0, &mut b)
                        .map(|()| Observed::Value(u64::from_ne_bytes(b)));
                    trace.syncs.push((i, Observed::from_result(r)));
                    i += 1;
                }
                Op::SyncWrite { tensor, value } => {
                    let r = vm
                        .write_small(&tensors[slot(tensor)], 0, &value.to_ne_bytes())
                        .map(|()| Observed::Written);
                    trace.syncs.push((i, Observed::from_result(r)));
                    i += 1;
                }
                Op::SyncUpdate { tensor, add } => {
                    let r = vm
                        .access_mut(&tensors[slot(tensor)], move |b| {
                            let mut w = [0u8; 8];
                            w.copy_from_slice(&b[..8]);
                            let old = u64::from_ne_bytes(w);
                            b[..8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
                            old
                        })
                        .map(Observed::Value);
                    trace.syncs.push((i, Observed::from_result(r)));
                    i += 1;
                }
                Op::Sync => {
                    vm.sync().map_err(|e| (Some(i), e))?;
                    i += 1;
                }
                Op::Submit => i += 1,
                Op::Kernel(_)
                | Op::Recreate { .. }
                | Op::Copy { .. }
                | Op::Launch(_)
                | Op::Barrier => {
                    // A batch: every kernel, recreate and barrier up to the next other op.
                    let start = i;
                    let end = batch_end(&program.ops, i);
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
                .read_small(t, 0, &mut b)
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
                    op_name(index),
                    &self.streams[usize::from(k.stream)],
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
                let s = &self.streams[usize::from(home)];
                let fresh = self.vm.new_tensor_on(s, 8)?;
                let old = std::mem::replace(&mut tensors[slot(tensor)], fresh);
                b.release_tensor(old)
            }
            Op::Copy { stream, src, dst } => b.copy(
                &self.streams[usize::from(stream)],
                &tensors[slot(src)],
                &tensors[slot(dst)],
            ),
            Op::Launch(l) => {
                let p = l.slots();
                let t = |i: usize| &tensors[p[i]];
                let graphs = self.graphs.as_deref().ok_or_else(|| {
                    Error::InvalidArgument("a launch on a runner without launch graphs".into())
                })?;
                let g = graphs.lazy(l.graph_index());
                match l.graph_index() {
                    0 => b.launch_lazy_job(&[t(3)], &[t(0), t(1)], &[t(2)], g),
                    _ => b.launch_lazy_job(&[t(2), t(3), t(3)], &[t(0)], &[t(1)], g),
                }
            }
            Op::Barrier => {
                let rec = barriers.clone();
                b.barrier(move || rec.lock().unwrap_or_else(|e| e.into_inner()).push(index))
            }
            Op::SyncRead { .. }
            | Op::SyncWrite { .. }
            | Op::SyncUpdate { .. }
            | Op::Sync
            | Op::Submit => {
                unreachable!("ivm fuzzing: not a batch op")
            }
        }
    }
}

/// The name of op `index`'s instruction (`fuzz_op<index>`), so that an error naming a
/// failed instruction names the op (`fuzz_op<index>#<id>`).
fn op_name(index: usize) -> &'static str {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..MAX_OPS)
            .map(|i| &*Box::leak(format!("fuzz_op{i}").into_boxed_str()))
            .collect()
    });
    names.get(index).copied().unwrap_or("fuzz_op")
}

/// The op index an instruction label `fuzz_op<index>#<id>` names.
fn op_of_label(label: &str) -> Option<usize> {
    label
        .split('#')
        .next()?
        .strip_prefix("fuzz_op")?
        .parse()
        .ok()
}

/// Runs `program` on a fresh VM with `config` and [`HashKernels`], compares it with the
/// interpreter, then shuts the VM down and checks that nothing was left behind.
pub fn check(program: &Program, config: Config) -> Result<Outcome, Box<Mismatch>> {
    let topology = Topology::cpu();
    // What the runner below runs: it has no launch graphs.
    let program = &topology.fit(&program.clone().without_launches());
    let vm_err = |e: Error| {
        Box::new(Mismatch {
            program: program.clone(),
            topology: topology.clone(),
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
            topology,
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

/// A bug planted in the engine (ivm-engine's feature `planted-bugs`) to show that the
/// equivalence check catches it (tests of this module only; see
/// [`Runner::with_planted_bug`]). Never set outside those tests.
#[doc(hidden)]
pub use ivm_engine::PlantedBug;
