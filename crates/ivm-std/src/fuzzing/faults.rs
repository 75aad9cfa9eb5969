//! The equivalence programs under injected device faults ([`Runner::run_with_faults`]).
//!
//! A device adapter that injects faults (the sim of `ivm-device` with its `SimFaults`:
//! failing launches, events that never complete or complete with an error, failing
//! allocations, slow copies, failing copies; ivm-std cannot name it) is driven through [`FaultControl`].
//! Nothing tells the harness which instruction a fault hit: it learns the failed
//! instructions (the *roots*) from the errors the program observes, then replays the
//! program through a sequential model told which ops failed, and checks:
//!
//! * every error an observation (a sync access, a final read) gets names a root: a kernel
//!   or copy of the program (its instruction is named `fuzz_op<index>`) on a device that
//!   injects faults, a planned kernel panic, the observing access itself (its own device
//!   work failed: only for a tensor of such a device), or the fill of a new tensor's
//!   reused memory (`fill_reused_block`: the tensor is born poisoned; the harness learns
//!   which tensors were from their blobs once the program has drained);
//! * a root's outputs are poisoned by it (unless poisoned already), and every later
//!   reader of a poisoned tensor gets an error naming the root that poisoned it first
//!   (inputs before outputs, as [`interpret`]); a sync write or update that failed itself
//!   poisons its tensor, a sync read that failed itself changes nothing;
//! * every value no failure reaches equals the model's (the sequential interpreter's);
//! * nothing hangs: a wait that fails with [`Error::Timeout`] (which ends the program)
//!   happens only while an event is left uncompleted, and its diagnostic names launched
//!   work that is not done;
//! * after the program, with the device healed, the VM drains and gives every device
//!   allocation back (no live allocation, no double free, no use after free:
//!   [`FaultControl::check_memory`]).
//!
//! Lazy-graph launches are part of the programs. Two findings of this harness were fixed
//! on the way: a graph run did not propagate poison from its operands to its outputs (a
//! poisoned parameter now fails the run's iteration, `JobInstance::param_poison`); and a
//! launch that failed on a queued device poisoned its outputs ahead of an earlier reader
//! still queued there, which then failed with the later op's error (the poison now
//! reaches them in stream order, `engine/device_launch.rs`). The model accepts nothing else for
//! either.
//!
//! Allocations that fail are retried a few times; a program whose first tensors still
//! cannot be allocated is not run ([`FaultOutcome::aborted`]), one whose recreate cannot
//! ends before that batch ([`FaultOutcome::cut`]; later ops were fitted to the new
//! tensor's device).

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};

use super::TENSORS;
use super::interpreter::{Kernels, Trace, batch_end, interpret, run_graph};
use super::program::{KernelOp, Op, Program, slot};
use super::runner::{Mismatch, Point, Runner, op_name, op_of_label};
use crate::runtime::tensor::Tensor;
use crate::util::error::{Diagnostic, Error, Result};
use crate::util::ids::Device;

/// What a fault-injecting device lets [`Runner::run_with_faults`] do.
pub trait FaultControl {
    /// Turns every fault off and completes the events left uncompleted.
    fn heal(&self);
    /// Turns the faults back on (after [`heal`](Self::heal)).
    fn resume(&self);
    /// Events left uncompleted now.
    fn stuck_events(&self) -> usize;
    /// Checks the device's memory once the VM drained and gave its cached memory back:
    /// no allocation live, no double free, no use after free. `Err`: what is wrong.
    fn check_memory(&self) -> std::result::Result<(), String>;
}

/// What one program under faults observed ([`Runner::run_with_faults`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultOutcome {
    /// The program did not start: a first tensor's allocation failed.
    pub aborted: bool,
    /// The program ended early with [`Error::Timeout`] (an event that never completed).
    pub timeout: bool,
    /// Observations (sync accesses, final reads) checked against the model.
    pub compared: usize,
    /// Of those, values (or successful writes) equal to the model's.
    pub values: usize,
    /// Of those, errors naming the root that poisoned the tensor.
    pub poisoned: usize,
    /// Of those, accesses that failed themselves (their own device work failed).
    pub own_failures: usize,
    /// Distinct failed instructions (roots) the observations named.
    pub roots: usize,
    /// `vm.sync()` calls that reported a device error.
    pub sync_errors: usize,
    /// The program ended before a batch whose recreate could not allocate its tensor.
    pub cut: bool,
}

/// The sums of a fault campaign's [`FaultOutcome`]s; `Display` prints them on one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultCampaign {
    /// Programs run.
    pub programs: usize,
    /// Programs not started (a first allocation failed).
    pub aborted: usize,
    /// Programs ended by a timeout.
    pub timeouts: usize,
    /// Observations compared.
    pub compared: usize,
    /// Values equal to the model's.
    pub values: usize,
    /// Errors naming the root that poisoned the tensor.
    pub poisoned: usize,
    /// Accesses that failed themselves.
    pub own_failures: usize,
    /// Failed instructions named.
    pub roots: usize,
    /// `vm.sync()` calls that reported a device error.
    pub sync_errors: usize,
    /// Programs ended before a recreate whose allocation failed.
    pub cut: usize,
}

impl FaultCampaign {
    /// Adds one program's outcome.
    pub fn record(&mut self, o: &FaultOutcome) {
        self.programs += 1;
        self.aborted += usize::from(o.aborted);
        self.timeouts += usize::from(o.timeout);
        self.compared += o.compared;
        self.values += o.values;
        self.poisoned += o.poisoned;
        self.own_failures += o.own_failures;
        self.roots += o.roots;
        self.sync_errors += o.sync_errors;
        self.cut += usize::from(o.cut);
    }
}

impl fmt::Display for FaultCampaign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} programs ({} not started: first allocation failed; {} ended by a timeout); \
             {} observations compared: {} values, {} errors naming their root, {} own \
             failures; {} failed instructions; {} sync errors; {} programs cut at a failed allocation",
            self.programs,
            self.aborted,
            self.timeouts,
            self.compared,
            self.values,
            self.poisoned,
            self.own_failures,
            self.roots,
            self.sync_errors,
            self.cut
        )
    }
}

/// What one observation got.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Obs {
    Value(u64),
    Written,
    /// An error naming a failed instruction (its label `name#id`).
    Failed {
        instruction: String,
        error: String,
    },
    /// Any other error (never expected).
    Other(String),
}

impl Obs {
    fn from_result(r: Result<Obs>) -> Self {
        match r {
            Ok(o) => o,
            Err(e) => match &e {
                Error::Poisoned { instruction, .. } | Error::KernelPanicked { instruction, .. } => {
                    Obs::Failed {
                        instruction: instruction.clone(),
                        error: e.to_string(),
                    }
                }
                _ => Obs::Other(e.to_string()),
            },
        }
    }
}

impl fmt::Display for Obs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Obs::Value(v) => write!(f, "value {v:#018x}"),
            Obs::Written => write!(f, "write ok"),
            Obs::Failed { error, .. } => write!(f, "{error}"),
            Obs::Other(e) => write!(f, "error: {e}"),
        }
    }
}

/// What a run under faults recorded. Observation indices are op indices of the program
/// extended by one final read per tensor slot (`ops.len() + slot`).
#[derive(Default)]
struct FaultRun {
    obs: Vec<(usize, Obs)>,
    barriers: Vec<usize>,
    /// The batch starting at this op did not run: a recreate's allocation failed.
    cut: Option<usize>,
    /// The op at which a wait timed out, the diagnostic, and the events left
    /// uncompleted then.
    timeout: Option<(usize, Diagnostic, usize)>,
    sync_errors: usize,
    aborted: bool,
    /// A VM call that failed otherwise than the model allows.
    vm_error: Option<(usize, String)>,
    /// Every tensor created, by its creation's root index ([`born_root`]), kept to learn
    /// after the program whether it was born poisoned, with the ids of the instructions
    /// its creation made (its fill's is among them).
    created: Vec<(usize, Arc<crate::model::blob::Blob>, std::ops::Range<usize>)>,
    /// Tensors born poisoned (their memory, a reused block, was filled by an
    /// instruction that failed): the fill's label, by creation root.
    born: HashMap<String, usize>,
}

/// The root index of a tensor's creation: a recreate's op index, or past the program and
/// its final reads for the first tensors (`ops + TENSORS + slot`).
fn born_root(program: &Program, op: Option<usize>, t: usize) -> usize {
    op.unwrap_or(program.ops.len() + TENSORS + t)
}

/// The device of the tensors homed on stream `home`.
fn device_of_home<K: Kernels>(runner: &Runner<K>, home: u8) -> Device {
    runner.topology.device_of(usize::from(home))
}

impl<K: Kernels> Runner<K> {
    /// Runs `program` (fitted to the topology) while `device` injects faults, and checks
    /// it against the sequential model told which instructions failed (see the
    /// module docs). After the program the device is healed, the VM drained and
    /// its cached memory returned, the device's memory checked, and the faults resumed:
    /// the next program starts clean.
    ///
    /// # Errors
    /// The first [`Mismatch`]: an observation the model does not allow, a timeout without
    /// a stuck event or whose diagnostic names nothing stuck, a VM that does not recover
    /// once the device is healed, or device memory left behind.
    pub fn run_with_faults(
        &self,
        program: &Program,
        device: &dyn FaultControl,
    ) -> std::result::Result<FaultOutcome, Box<Mismatch>> {
        let program = &self.prepare(program);
        let run = self.execute_faulty(program, device);
        let recovered = self.recover(device);
        let mismatch = |at: Point, e: &dyn fmt::Display, g: &dyn fmt::Display| {
            Box::new(Mismatch {
                program: program.clone(),
                topology: self.topology.clone(),
                at,
                expected: e.to_string(),
                got: g.to_string(),
                vm_trace: None::<Trace>,
                expected_trace: interpret(program, &*self.kernels),
            })
        };
        if let Err(e) = recovered {
            return Err(mismatch(
                Point::Vm { op: None },
                &"recovery once healed",
                &e,
            ));
        }
        let mut out = FaultOutcome {
            aborted: run.aborted,
            timeout: run.timeout.is_some(),
            sync_errors: run.sync_errors,
            cut: run.cut.is_some(),
            ..FaultOutcome::default()
        };
        if let Some((op, e)) = &run.vm_error {
            return Err(mismatch(Point::Vm { op: Some(*op) }, &"Ok", e));
        }
        if run.aborted {
            return Ok(out);
        }
        if let Some((op, d, stuck)) = &run.timeout {
            let at = Point::Vm {
                op: (*op < program.ops.len()).then_some(*op),
            };
            if *stuck == 0 {
                return Err(mismatch(
                    at,
                    &"no timeout: no event was left uncompleted",
                    d,
                ));
            }
            if !d.lively.iter().any(|l| l.launched && !l.done) {
                return Err(mismatch(at, &"a diagnostic naming the stuck work", d));
            }
        }
        check(self, program, &run, &mut out).map_err(|(at, e, g)| mismatch(at, &e, &g))?;
        Ok(out)
    }

    /// Heals the device, drains the VM, gives its cached memory back, checks the
    /// device's memory and resumes the faults.
    fn recover(&self, device: &dyn FaultControl) -> std::result::Result<(), String> {
        device.heal();
        // Device errors left by the program are reported (once) by these syncs.
        let mut r = self.vm.sync();
        for _ in 0..3 {
            if r.is_ok() {
                break;
            }
            r = self.vm.sync();
        }
        r.map_err(|e| format!("vm.sync() after healing: {e}"))?;
        self.vm
            .shrink_all_mem()
            .map_err(|e| format!("shrink_all_mem after healing: {e}"))?;
        device.check_memory()?;
        device.resume();
        Ok(())
    }

    fn execute_faulty(&self, program: &Program, device: &dyn FaultControl) -> FaultRun {
        let vm = &self.vm;
        let mut run = FaultRun::default();
        let home = |h: u8| &self.streams[usize::from(h)];
        let mut tensors = Vec::with_capacity(TENSORS);
        for t in 0..TENSORS {
            match self.allocate(home(self.topology.homes[t])) {
                (Ok(x), ids) => {
                    run.created
                        .push((born_root(program, None, t), x.blob().clone(), ids));
                    tensors.push(x);
                }
                (Err(Error::Timeout(d)), _) => {
                    run.timeout = Some((0, d, device.stuck_events()));
                    break;
                }
                (Err(_), _) => {
                    run.aborted = true;
                    break;
                }
            }
        }
        let barriers = Arc::new(Mutex::new(Vec::new()));
        if run.timeout.is_none() && !run.aborted {
            self.run_ops(program, device, &mut tensors, &barriers, &mut run);
        }
        if run.timeout.is_none() && run.cut.is_none() && !run.aborted {
            for (t, x) in tensors.iter().enumerate() {
                let i = program.ops.len() + t;
                let mut b = [0u8; 8];
                let r = vm
                    .read_small(x, 0, &mut b)
                    .map(|()| Obs::Value(u64::from_ne_bytes(b)));
                if !observe(&mut run, i, r, device) {
                    break;
                }
            }
        }
        // The tensors go once the device works again (`recover` drains their releases).
        device.heal();
        drop(tensors);
        let _ = vm.sync();
        // Every fill ran by now; a failed one poisoned its tensor first (and first stays).
        // Only a tensor's own fill makes it born poisoned: a fill's poison also spreads
        // (a copy from a tensor born poisoned), so the fill's id must be one its creation
        // made.
        for (root, blob, ids) in std::mem::take(&mut run.created) {
            if let Some(f) = blob.poison()
                && let Some(id) = f.instruction.strip_prefix("fill_reused_block#")
                && id.parse().is_ok_and(|id: usize| ids.contains(&id))
            {
                run.born.insert(f.instruction.to_string(), root);
            }
        }
        run.barriers = std::mem::take(&mut *barriers.lock().unwrap_or_else(|e| e.into_inner()));
        run
    }

    /// A new 8-byte tensor homed on `s`, with a few tries: an allocation fault should not
    /// cost the whole program; and the ids of the instructions the tries made.
    fn allocate(&self, s: &crate::Stream) -> (Result<Tensor>, std::ops::Range<usize>) {
        let first = crate::model::instruction::peek_next_id();
        let mut r = self.vm.new_tensor_on(s, 8);
        for _ in 0..4 {
            if r.is_ok() || matches!(r, Err(Error::Timeout(_))) {
                break;
            }
            r = self.vm.new_tensor_on(s, 8);
        }
        (r, first..crate::model::instruction::peek_next_id())
    }

    fn run_ops(
        &self,
        program: &Program,
        device: &dyn FaultControl,
        tensors: &mut [Tensor],
        barriers: &Arc<Mutex<Vec<usize>>>,
        run: &mut FaultRun,
    ) {
        let vm = &self.vm;
        let mut i = 0;
        while i < program.ops.len() {
            let going = match program.ops[i] {
                Op::SyncRead { tensor } => {
                    let mut b = [0u8; 8];
                    let r = vm
                        .read_small(&tensors[slot(tensor)], 0, &mut b)
                        .map(|()| Obs::Value(u64::from_ne_bytes(b)));
                    observe(run, i, r, device)
                }
                Op::SyncWrite { tensor, value } => {
                    let r = vm
                        .write_small(&tensors[slot(tensor)], 0, &value.to_ne_bytes())
                        .map(|()| Obs::Written);
                    observe(run, i, r, device)
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
                        .map(Obs::Value);
                    observe(run, i, r, device)
                }
                Op::Sync => match vm.sync() {
                    Ok(()) => true,
                    Err(Error::Timeout(d)) => {
                        run.timeout = Some((i, d, device.stuck_events()));
                        false
                    }
                    // A device error or a sticky failure, reported once.
                    Err(Error::Device(_) | Error::Poisoned { .. }) => {
                        run.sync_errors += 1;
                        true
                    }
                    Err(e) => {
                        run.vm_error = Some((i, e.to_string()));
                        false
                    }
                },
                Op::Submit => true,
                Op::Kernel(_)
                | Op::Recreate { .. }
                | Op::Copy { .. }
                | Op::Launch(_)
                | Op::Barrier => {
                    let end = batch_end(&program.ops, i);
                    let going = self.run_batch(program, i, end, device, tensors, barriers, run);
                    i = end - 1;
                    going
                }
            };
            if !going {
                return;
            }
            i += 1;
        }
    }

    /// One `run` batch, ops `start..end`. The recreates' tensors are allocated first (a
    /// few tries each): if one cannot be, the program ends here.
    #[allow(clippy::too_many_arguments)]
    fn run_batch(
        &self,
        program: &Program,
        start: usize,
        end: usize,
        device: &dyn FaultControl,
        tensors: &mut [Tensor],
        barriers: &Arc<Mutex<Vec<usize>>>,
        run: &mut FaultRun,
    ) -> bool {
        let vm = &self.vm;
        let mut fresh = Vec::new();
        for (j, op) in program.ops.iter().enumerate().take(end).skip(start) {
            if let Op::Recreate { home, .. } = op {
                match self.allocate(&self.streams[usize::from(*home)]) {
                    (Ok(t), ids) => {
                        run.created.push((j, t.blob().clone(), ids));
                        fresh.push(t);
                    }
                    (Err(Error::Timeout(d)), _) => {
                        run.timeout = Some((j, d, device.stuck_events()));
                        return false;
                    }
                    (Err(_), _) => {
                        run.cut = Some(start);
                        return false;
                    }
                }
            }
        }
        let mut fresh = fresh.into_iter();
        let r = vm.run(|b| {
            for (j, op) in program.ops.iter().enumerate().take(end).skip(start) {
                match *op {
                    Op::Recreate { tensor, .. } => {
                        if let Some(t) = fresh.next() {
                            let old = std::mem::replace(&mut tensors[slot(tensor)], t);
                            b.release_tensor(old)?;
                        }
                    }
                    Op::Copy { stream, src, dst } => b.copy_named(
                        op_name(j),
                        &self.streams[usize::from(stream)],
                        &tensors[slot(src)],
                        &tensors[slot(dst)],
                    )?,
                    _ => self.build(b, j, op, tensors, barriers)?,
                }
            }
            Ok(())
        });
        match r {
            Ok(()) => true,
            Err(Error::Timeout(d)) => {
                run.timeout = Some((start, d, device.stuck_events()));
                false
            }
            Err(e) => {
                run.vm_error = Some((start, e.to_string()));
                false
            }
        }
    }
}

/// Records observation `i`; a timeout ends the program (returns false).
fn observe(run: &mut FaultRun, i: usize, r: Result<Obs>, device: &dyn FaultControl) -> bool {
    if let Err(Error::Timeout(d)) = r {
        run.timeout = Some((i, d, device.stuck_events()));
        return false;
    }
    run.obs.push((i, Obs::from_result(r)));
    true
}

type Failure = (Point, String, String);

/// The failed program ops, the accesses that failed themselves, and the root each
/// observation names (`None`: it got no error).
type Roots = (BTreeSet<usize>, BTreeSet<usize>, Vec<Option<usize>>);

/// The roots the observations name: program ops (kernels, copies) and accesses that
/// failed themselves. Returns (failed program ops, own failures, the root each
/// observation names).
fn roots(
    program: &Program,
    obs: &[(usize, Obs)],
    born: &HashMap<String, usize>,
) -> std::result::Result<Roots, Failure> {
    let mut failed = BTreeSet::new();
    let mut own = BTreeSet::new();
    let mut labels: HashMap<&str, usize> = HashMap::new();
    let mut named = Vec::with_capacity(obs.len());
    for (i, o) in obs {
        let Obs::Failed { instruction, error } = o else {
            named.push(None);
            continue;
        };
        let at = point(program, *i);
        let root = if let Some(j) = op_of_label(instruction) {
            let ok = j < *i
                && j < program.ops.len()
                && matches!(program.ops[j], Op::Kernel(_) | Op::Copy { .. });
            if !ok {
                return Err((
                    at,
                    "an error naming an earlier kernel or copy".into(),
                    error.clone(),
                ));
            }
            failed.insert(j);
            j
        } else if let Some(&k) = labels.get(instruction.as_str()) {
            k
        } else if let Some(&k) = born.get(instruction) {
            // A tensor born poisoned: its creation is the root.
            k
        } else if ["read_small#", "write_small#", "access_mut#"]
            .iter()
            .any(|n| instruction.starts_with(n))
        {
            // First seen at this access: its own failure.
            labels.insert(instruction, *i);
            own.insert(*i);
            *i
        } else {
            return Err((
                at,
                "an error naming a failed instruction of the program".into(),
                format!("{error} (unattributed)"),
            ));
        };
        named.push(Some(root));
    }
    Ok((failed, own, named))
}

fn point(program: &Program, i: usize) -> Point {
    match i.checked_sub(program.ops.len()) {
        Some(t) => Point::Final { tensor: t },
        None => Point::Sync { op: i },
    }
}

/// A tensor slot in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Holds this value.
    Val(u64),
    /// Poisoned by the failure of this op (program op, or own failure of an access).
    Poison(usize),
    /// Reached by a failure through a lazy-graph run, which [`interpret`] does not model
    /// (poison through a graph run): poisoned by some root, or holding some value.
    Unknown,
}

impl Slot {
    /// Poisons it by `root`, unless poisoned already (the first failure stays; an
    /// unknown slot may have been, so it stays unknown).
    fn poison(&mut self, root: usize) {
        if let Slot::Val(_) = self {
            *self = Slot::Poison(root);
        }
    }

    /// What the VM takes from operands `slots` (inputs before outputs): the first poisoned
    /// one's root; `Unknown` if an unknown one comes first.
    fn first_failure(slots: impl IntoIterator<Item = Slot>) -> Option<Slot> {
        slots.into_iter().find(|s| !matches!(s, Slot::Val(_)))
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Slot::Val(v) => write!(f, "value {v:#018x}"),
            Slot::Poison(r) => write!(f, "an error naming op #{r}"),
            Slot::Unknown => write!(f, "a value, or an error naming a failed op"),
        }
    }
}

/// Replays the program sequentially with the roots failing and compares every
/// observation.
fn check<K: Kernels>(
    runner: &Runner<K>,
    program: &Program,
    run: &FaultRun,
    out: &mut FaultOutcome,
) -> std::result::Result<(), Failure> {
    let (failed, own, named) = roots(program, &run.obs, &run.born)?;
    out.roots = failed.len() + own.len() + run.born.len();
    let born: BTreeSet<usize> = run.born.values().copied().collect();
    let fresh = |root: usize| {
        if born.contains(&root) {
            Slot::Poison(root)
        } else {
            Slot::Val(0)
        }
    };
    let topology = &runner.topology;
    // A root among the program's ops failed on a device that injects faults, or panicked.
    for &j in &failed {
        let (stream, panics) = match program.ops[j] {
            Op::Kernel(k) => (k.stream, k.panic),
            Op::Copy { stream, .. } => (stream, false),
            _ => unreachable!("roots are kernels and copies"),
        };
        if !panics && topology.device_of(usize::from(stream)) == Device::CPU {
            return Err((
                Point::Sync { op: j },
                "no failure of an op on the cpu".into(),
                format!("op #{j} failed"),
            ));
        }
    }
    let obs: HashMap<usize, (&Obs, Option<usize>)> = run
        .obs
        .iter()
        .zip(&named)
        .map(|((i, o), r)| (*i, (o, *r)))
        .collect();
    let mut slots: [Slot; TENSORS] = std::array::from_fn(|t| fresh(born_root(program, None, t)));
    let mut dev: [Device; TENSORS] =
        std::array::from_fn(|t| device_of_home(runner, topology.homes[t]));
    let mut barriers = Vec::new();
    let end = run
        .timeout
        .as_ref()
        .map(|(op, _, _)| *op)
        .or(run.cut)
        .unwrap_or(usize::MAX);
    let finals = (0..TENSORS as u8).map(|t| Op::SyncRead { tensor: t });
    for (i, op) in program.ops.iter().copied().chain(finals).enumerate() {
        if i >= end {
            break;
        }
        match op {
            Op::Kernel(k) => {
                kernel(runner, i, k, failed.contains(&i), &mut slots);
            }
            Op::Copy { src, dst, .. } => {
                let (s, d) = (slot(src), slot(dst));
                if failed.contains(&i) {
                    // Its own failure comes first (at launch, or observed at completion).
                    slots[d].poison(i);
                } else {
                    match (slots[s], slots[d]) {
                        (_, Slot::Poison(_) | Slot::Unknown) => {}
                        (Slot::Poison(r), Slot::Val(_)) => slots[d] = Slot::Poison(r),
                        (Slot::Unknown, Slot::Val(_)) => slots[d] = Slot::Unknown,
                        (Slot::Val(v), Slot::Val(_)) => slots[d] = Slot::Val(v),
                    }
                }
            }
            Op::Recreate { tensor, home } => {
                let t = slot(tensor);
                slots[t] = fresh(i);
                dev[t] = device_of_home(runner, home);
            }
            Op::Launch(l) => {
                let p = l.slots();
                let (reads, writes): (&[usize], &[usize]) = match l.graph_index() {
                    0 => (&p[3..], &p[..3]),
                    _ => (&p[2..], &p[..2]),
                };
                if Slot::first_failure(reads.iter().chain(writes).map(|&t| slots[t])).is_some() {
                    for &t in writes {
                        if !matches!(slots[t], Slot::Poison(_)) {
                            slots[t] = Slot::Unknown;
                        }
                    }
                } else {
                    let mut value = [0u64; TENSORS];
                    for (v, s) in value.iter_mut().zip(&slots) {
                        if let Slot::Val(x) = s {
                            *v = *x;
                        }
                    }
                    run_graph(l, &mut value);
                    for &t in writes {
                        slots[t] = Slot::Val(value[t]);
                    }
                }
            }
            Op::Barrier => barriers.push(i),
            Op::Sync | Op::Submit => {}
            Op::SyncRead { tensor }
            | Op::SyncWrite { tensor, .. }
            | Op::SyncUpdate { tensor, .. } => {
                let t = slot(tensor);
                let Some(&(o, root)) = obs.get(&i) else {
                    return Err((point(program, i), "an observation".into(), "none".into()));
                };
                let expected = match (op, slots[t]) {
                    (Op::SyncWrite { .. }, Slot::Val(_)) => "write ok".to_string(),
                    (_, s) => s.to_string(),
                };
                out.compared += 1;
                let ok = match (o, root) {
                    (Obs::Failed { .. }, Some(q)) if q == i && own.contains(&i) => {
                        // Its own device work failed: only on a device that injects faults.
                        out.own_failures += 1;
                        if !matches!(op, Op::SyncRead { .. }) {
                            slots[t].poison(i);
                        }
                        dev[t] != Device::CPU
                    }
                    (Obs::Failed { .. }, Some(q)) => {
                        out.poisoned += 1;
                        match slots[t] {
                            Slot::Poison(r) => r == q,
                            // Was poisoned, by a root (the roots were checked above).
                            Slot::Unknown => {
                                slots[t] = Slot::Poison(q);
                                true
                            }
                            Slot::Val(_) => false,
                        }
                    }
                    (Obs::Value(v), _) => match (op, slots[t]) {
                        (Op::SyncRead { .. }, Slot::Val(x)) => {
                            out.values += 1;
                            *v == x
                        }
                        (Op::SyncUpdate { add, .. }, Slot::Val(x)) => {
                            out.values += 1;
                            slots[t] = Slot::Val(x.wrapping_add(add));
                            *v == x
                        }
                        // Not poisoned; its value is not modelled.
                        (Op::SyncRead { .. } | Op::SyncUpdate { .. }, Slot::Unknown) => true,
                        _ => false,
                    },
                    (Obs::Written, _) => match (op, slots[t]) {
                        (Op::SyncWrite { value: v, .. }, Slot::Val(_) | Slot::Unknown) => {
                            out.values += usize::from(matches!(slots[t], Slot::Val(_)));
                            slots[t] = Slot::Val(v);
                            true
                        }
                        _ => false,
                    },
                    _ => false,
                };
                if !ok {
                    let got = match (o, root) {
                        (Obs::Failed { error, .. }, Some(q)) => format!("{error} (op #{q})"),
                        (o, _) => o.to_string(),
                    };
                    return Err((point(program, i), expected, got));
                }
            }
        }
    }
    if end == usize::MAX && barriers != run.barriers {
        return Err((
            Point::Barriers,
            format!("{barriers:?}"),
            format!("{:?}", run.barriers),
        ));
    }
    Ok(())
}

/// Kernel `i` in the model: a launch that failed (`failed`, not a planned panic) poisons
/// its outputs with itself (its operands' poison is checked on the device, where it never
/// ran); otherwise as [`interpret`]: poisoned operands poison the outputs with the first
/// one's root, a panic with itself.
fn kernel<K: Kernels>(
    runner: &Runner<K>,
    i: usize,
    k: KernelOp,
    failed: bool,
    slots: &mut [Slot; TENSORS],
) {
    let ins: Vec<usize> = k.input_slots().collect();
    let outs: Vec<usize> = k.output_slots().collect();
    let result = if failed && !k.panic {
        Slot::Poison(i)
    } else if let Some(s) = Slot::first_failure(ins.iter().chain(&outs).map(|&t| slots[t])) {
        s
    } else {
        let val = |t: usize| match slots[t] {
            Slot::Val(v) => v,
            _ => unreachable!("no failed operand"),
        };
        let iv: Vec<u64> = ins.iter().map(|&t| val(t)).collect();
        let mut ov: Vec<u64> = outs.iter().map(|&t| val(t)).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runner.kernels.apply(k.id, &iv, &mut ov);
        }));
        if r.is_err() || k.panic {
            Slot::Poison(i)
        } else {
            for (&t, v) in outs.iter().zip(ov) {
                slots[t] = Slot::Val(v);
            }
            return;
        }
    };
    for &t in &outs {
        match result {
            Slot::Poison(r) => slots[t].poison(r),
            _ => {
                if !matches!(slots[t], Slot::Poison(_)) {
                    slots[t] = Slot::Unknown;
                }
            }
        }
    }
}
