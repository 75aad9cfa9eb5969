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
//! Lazy-graph launches are part of the programs. The model holds two rules that the VM
//! keeps: a graph run whose parameter is poisoned fails its iteration
//! (`JobInstance::param_poison`), so its outputs carry the error; and a launch that fails
//! on a queued device poisons its outputs in stream order, after any earlier reader still
//! queued there (`engine/device_launch/completion.rs`, `poison_in_stream_order`).
//!
//! Allocations that fail are retried a few times; a program whose first tensors still
//! cannot be allocated is not run ([`FaultOutcome::aborted`]), one whose recreate cannot
//! ends before that batch ([`FaultOutcome::cut`]; later ops were fitted to the new
//! tensor's device).
//!
//! The harness is one file per concept: `record.rs` (what a run under faults records: the
//! observations and the tensors created), `run.rs` (running a program on the VM while the
//! device injects faults, then recovering) and `check.rs` (the sequential model told which
//! ops failed, against which the observations are checked).

mod check;
mod record;
mod run;

use std::fmt;

#[cfg(doc)]
use super::interpreter::interpret;
#[cfg(doc)]
use super::runner::Runner;
#[cfg(doc)]
use crate::util::error::Error;

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
