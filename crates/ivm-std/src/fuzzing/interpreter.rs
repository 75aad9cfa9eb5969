//! The sequential interpreter: the [`Kernels`] a program calls (by default
//! [`HashKernels`]), what a run observes ([`Observed`], [`Trace`]) and [`interpret`], which
//! gives the results the VM must reproduce, with the VM's poison semantics.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::program::{LaunchOp, Op, Program, launch_mix, mix, slot};
use super::{PANIC_MARKER, TENSORS};
use crate::util::error::{Error, Result};

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
    pub(super) fn from_result(r: Result<Observed>) -> Self {
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

/// The end of the batch (one `run`) that starts at op `start`: the first op after it that
/// is not a kernel, recreate, copy, launch or barrier.
pub(super) fn batch_end(ops: &[Op], start: usize) -> usize {
    ops[start..]
        .iter()
        .position(|op| {
            !matches!(
                op,
                Op::Kernel(_) | Op::Recreate { .. } | Op::Copy { .. } | Op::Launch(_) | Op::Barrier
            )
        })
        .map_or(ops.len(), |p| start + p)
}

pub(super) fn planned_panic_message(op: usize) -> String {
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
                        Err(p) => Some(crate::util::panics::panic_message(&*p)),
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
            Op::SyncUpdate { tensor, add } => {
                let t = slot(tensor);
                let o = match &poison[t] {
                    Some(m) => Observed::Poisoned(m.clone()),
                    None => {
                        let old = value[t];
                        value[t] = old.wrapping_add(add);
                        Observed::Value(old)
                    }
                };
                trace.syncs.push((i, o));
            }
            Op::Recreate { tensor, .. } => {
                let t = slot(tensor);
                value[t] = 0;
                poison[t] = None;
            }
            Op::Copy { src, dst, .. } => {
                let (s, d) = (slot(src), slot(dst));
                match poison[s].clone().or_else(|| poison[d].clone()) {
                    Some(m) => {
                        poison[d].get_or_insert(m);
                    }
                    None => value[d] = value[s],
                }
            }
            Op::Launch(l) => {
                // The graph's run, sequentially, at the launch point. Poison through a run
                // is modelled coarsely (a poisoned operand poisons every written one):
                // `Topology::fit` keeps planned panics out of programs with launches.
                let p = l.slots();
                let (reads, writes): (&[usize], &[usize]) = match l.graph_index() {
                    0 => (&p[3..], &p[..3]),
                    _ => (&p[2..], &p[..2]),
                };
                if let Some(m) = reads.iter().chain(writes).find_map(|&t| poison[t].clone()) {
                    for &t in writes {
                        poison[t].get_or_insert_with(|| m.clone());
                    }
                    continue;
                }
                run_graph(l, &mut value);
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

/// One run of launch `l`'s graph on `value` (see [`LaunchOp`]).
pub(super) fn run_graph(l: LaunchOp, value: &mut [u64; TENSORS]) {
    let m = launch_mix;
    let p = l.slots();
    match l.graph_index() {
        0 => {
            let (a, w) = (value[p[3]], value[p[2]]);
            let h = m(m(a, w), 1);
            value[p[0]] = h;
            value[p[1]] = m(h, 2);
            value[p[2]] = m(w, h);
        }
        _ => {
            let (b0, b1, w) = (value[p[2]], value[p[3]], value[p[1]]);
            value[p[0]] = m(m(b0, b1), w);
            value[p[1]] = m(w, m(b0, 7));
        }
    }
}
