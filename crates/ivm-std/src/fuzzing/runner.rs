//! The VM runner: a [`Runner`] runs programs on a real VM and compares what they observe
//! with the sequential interpreter; a difference is a [`Mismatch`] (at a [`Point`]), a
//! success an [`Outcome`]. Also [`check`] (one program on a fresh VM, leak check included)
//! and [`silence_planned_panics`].

use std::fmt;
use std::sync::{Arc, Mutex};

use super::interpreter::{
    HashKernels, Kernels, Observed, Trace, batch_end, interpret, planned_panic_message,
};
use super::program::{KernelOp, LaunchGraphs, Op, Program, slot, sync_update};
use super::topology::{CrossStream, Topology};
use super::{GRAPHS, MAX_OPS, PANIC_MARKER, PlantedBug, TENSORS};
use crate::device::DeviceAdapter;
use crate::model::stream::Stream;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};
use crate::vm::VirtualMachine;
use crate::{Config, DebugCounters};

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
    pub(super) vm: VirtualMachine,
    pub(super) topology: Topology,
    pub(super) streams: Vec<Stream>,
    pub(super) kernels: Arc<K>,
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
    /// [`Error::InvalidArgument`] when a graph's interface is not the one
    /// [`LaunchOp`](super::LaunchOp) documents (inputs, outputs and parameters, by count
    /// and size).
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
                        .access_mut(&tensors[slot(tensor)], move |b| sync_update(b, add))
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

    pub(super) fn build(
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
                    // On a launcher device the body enqueues the work (`on_host`); a
                    // device that refuses it fails the kernel with its answer.
                    move |ctx| {
                        ctx.on_host(move |ctx| {
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
                        })
                        // Unwinds without the panic hook: an expected failure under
                        // injected faults, whose message the instruction's error carries.
                        .unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e.to_string())));
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
pub(super) fn op_name(index: usize) -> &'static str {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..MAX_OPS)
            .map(|i| &*Box::leak(format!("fuzz_op{i}").into_boxed_str()))
            .collect()
    });
    names.get(index).copied().unwrap_or("fuzz_op")
}

/// The op index an instruction label `fuzz_op<index>#<id>` names.
pub(super) fn op_of_label(label: &str) -> Option<usize> {
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
