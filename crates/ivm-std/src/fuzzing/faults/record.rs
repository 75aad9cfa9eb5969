//! What a run under faults records: each observation ([`Obs`]), the barriers, how the
//! program ended, and the tensors it created ([`FaultRun`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use super::FaultControl;
use crate::fuzzing::TENSORS;
use crate::fuzzing::program::Program;
use crate::util::error::{Diagnostic, Error, Result};

/// What one observation got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Obs {
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
pub(super) struct FaultRun {
    pub(super) obs: Vec<(usize, Obs)>,
    pub(super) barriers: Vec<usize>,
    /// The batch starting at this op did not run: a recreate's allocation failed.
    pub(super) cut: Option<usize>,
    /// The op at which a wait timed out, the diagnostic, and the events left
    /// uncompleted then.
    pub(super) timeout: Option<(usize, Diagnostic, usize)>,
    pub(super) sync_errors: usize,
    pub(super) aborted: bool,
    /// A VM call that failed otherwise than the model allows.
    pub(super) vm_error: Option<(usize, String)>,
    /// Every tensor created, by its creation's root index ([`born_root`]), kept to learn
    /// after the program whether it was born poisoned, with the ids of the instructions
    /// its creation made (its fill's is among them).
    pub(super) created: Vec<(usize, Arc<crate::model::blob::Blob>, std::ops::Range<usize>)>,
    /// Tensors born poisoned (their memory, a reused block, was filled by an
    /// instruction that failed): the fill's label, by creation root.
    pub(super) born: HashMap<String, usize>,
}

/// The root index of a tensor's creation: a recreate's op index, or past the program and
/// its final reads for the first tensors (`ops + TENSORS + slot`).
pub(super) fn born_root(program: &Program, op: Option<usize>, t: usize) -> usize {
    op.unwrap_or(program.ops.len() + TENSORS + t)
}

/// Records observation `i`; a timeout ends the program (returns false).
pub(super) fn observe(
    run: &mut FaultRun,
    i: usize,
    r: Result<Obs>,
    device: &dyn FaultControl,
) -> bool {
    if let Err(Error::Timeout(d)) = r {
        run.timeout = Some((i, d, device.stuck_events()));
        return false;
    }
    run.obs.push((i, Obs::from_result(r)));
    true
}
