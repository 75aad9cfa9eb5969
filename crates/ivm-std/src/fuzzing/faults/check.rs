//! The sequential model of a run under faults: it learns the failed instructions (the
//! roots) from the errors observed, replays the program with them failing, and compares
//! every observation ([`check`]).

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use super::FaultOutcome;
use super::record::{FaultRun, Obs, born_root};
use crate::fuzzing::TENSORS;
#[cfg(doc)]
use crate::fuzzing::interpreter::interpret;
use crate::fuzzing::interpreter::{Kernels, run_graph};
use crate::fuzzing::program::{KernelOp, Op, Program, slot};
use crate::fuzzing::runner::{Point, Runner, op_of_label};
use crate::util::ids::Device;

/// The device of the tensors homed on stream `home`.
fn device_of_home<K: Kernels>(runner: &Runner<K>, home: u8) -> Device {
    runner.topology.device_of(usize::from(home))
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
pub(super) fn check<K: Kernels>(
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
