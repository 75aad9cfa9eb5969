//! The error type of every public ivm-std call.

use std::fmt;
use std::sync::Arc;

/// Everything a public ivm-std call can fail with. No public call panics on bad input.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `run`, a `sync_*` call, `sync()` or `shutdown()` was called from inside a kernel,
    /// callback or barrier, or from any thread of the same VM; waiting there would deadlock.
    #[error("ivm: reentrant call from a VM thread, kernel, callback or barrier")]
    Reentrant,
    /// The VM has been shut down (or is shutting down) and accepts no more work.
    #[error("ivm: the virtual machine is shut down")]
    ShutDown,
    /// The VM was created in another process: this process is a `fork()` child that
    /// inherited it. The VM's threads do not exist here, so every entry point refuses
    /// (see [`crate::contract`]). Create a new VM in the child instead.
    #[error(
        "ivm: this virtual machine belongs to the parent of a fork(); create a new one in the child"
    )]
    Forked,
    /// An argument that no call accepts (a zero timeout, for example).
    #[error("ivm: invalid argument: {0}")]
    InvalidArgument(String),
    /// A small-memory access of a size other than 1, 2, 4, 8 or 16 bytes.
    #[error("ivm: unsupported small-memory access size {0} (supported: 1, 2, 4, 8, 16 bytes)")]
    UnsupportedSize(usize),
    /// An access reaches past the end of the tensor.
    #[error(
        "ivm: access of {len} bytes at offset {offset} is out of bounds of a {size}-byte tensor"
    )]
    OutOfBounds {
        /// Bytes requested.
        len: usize,
        /// Offset requested.
        offset: usize,
        /// Size of the tensor.
        size: usize,
    },
    /// A blocking wait saw no instruction finish during a whole timeout period.
    #[error("ivm: timed out waiting; no instruction finished within the timeout period\n{0}")]
    Timeout(Diagnostic),
    /// The kernel (or callback) of an instruction panicked.
    #[error("ivm: instruction `{instruction}` panicked: {message}")]
    KernelPanicked {
        /// Name and id of the instruction that panicked.
        instruction: String,
        /// The panic message.
        message: String,
    },
    /// The tensor was written by an instruction that failed; its contents are undefined.
    #[error("ivm: tensor poisoned by failed instruction `{instruction}`: {message}")]
    Poisoned {
        /// Name and id of the instruction that failed first.
        instruction: String,
        /// Why it failed.
        message: String,
    },
    /// A tensor or stream of another virtual machine was passed to this one.
    #[error("ivm: {0} belongs to another virtual machine")]
    ForeignObject(&'static str),
    /// The same tensor was passed twice to one instruction where that would alias.
    #[error("ivm: the same tensor appears twice among an instruction's operands")]
    AliasedOperand,
    /// A stream id that this VM cannot serve (for example a device it has no adapter for).
    #[error("ivm: unsupported stream: {0}")]
    UnsupportedStream(String),
    /// An `IVM_*` environment variable (or a config field) has an invalid value.
    #[error("ivm: invalid configuration: {0}")]
    Config(String),
    /// The VM could not start one of its threads.
    #[error("ivm: could not spawn a VM thread: {0}")]
    Spawn(String),
    /// A copy between tensors (or memories) of different sizes.
    #[error("ivm: copy between mismatched sizes: source {src} bytes, destination {dst} bytes")]
    SizeMismatch {
        /// Bytes of the source.
        src: usize,
        /// Bytes of the destination.
        dst: usize,
    },
    /// A tensor (or memory) on a device the stream cannot reach.
    #[error("ivm: device mismatch: {0}")]
    DeviceMismatch(String),
    /// A stream was asked to wait on an event of another device (or adapter).
    #[error("ivm: a stream of {stream} cannot wait on an event of {event}")]
    ForeignEvent {
        /// The device of the waiting stream.
        stream: crate::Device,
        /// The device of the event.
        event: crate::Device,
    },
    /// A device adapter failed (driver missing, out of memory, device error).
    #[error("ivm: device error: {0}")]
    Device(String),
    /// An allocation could not be satisfied. Names the request and where it was made:
    /// the stream (allocations through the VM and its caching allocator) or the device (a
    /// bare device allocator). The VM first returns its cached blocks to the device and
    /// retries once (see [`crate::device::alloc_cache`]); this is what remains.
    #[error("ivm: out of memory: {nbytes} bytes requested on {stream}: {detail}")]
    OutOfMemory {
        /// Bytes requested.
        nbytes: usize,
        /// The stream the request was made on (or the device, from a bare allocator).
        stream: String,
        /// What the allocator reported (capacity, bytes in use).
        detail: String,
    },
    /// A lazy graph names one interface op twice (among its inputs or its outputs).
    #[error("ivm: lazy job `{job}`: duplicate interface op name `{name}`")]
    DuplicateInterfaceName {
        /// The job name.
        job: String,
        /// The duplicated op name.
        name: String,
    },
    /// A lazy-job launch passed another number of input, output or parameter tensors than
    /// the graph declares names.
    #[error("ivm: lazy job `{job}`: the graph declares {expected} {what}, {got} tensor(s) given")]
    InterfaceCountMismatch {
        /// The job name.
        job: String,
        /// `inputs`, `outputs` or `parameters`.
        what: &'static str,
        /// Names the graph declares.
        expected: usize,
        /// Tensors given.
        got: usize,
    },
    /// A tensor passed to a lazy job differs in size from the graph blob of its interface.
    #[error(
        "ivm: lazy job `{job}`: interface op `{name}` holds {expected} bytes, the tensor {got}"
    )]
    InterfaceSizeMismatch {
        /// The job name.
        job: String,
        /// The interface op name.
        name: String,
        /// Bytes of the graph blob.
        expected: usize,
        /// Bytes of the eager tensor.
        got: usize,
    },
    /// The graph runtime of a lazy job shut down before the run finished.
    #[error("ivm: lazy job `{job}`: the graph runtime was shut down")]
    GraphClosed {
        /// The job name.
        job: String,
    },
    /// A collective across processes (a communicator's all-reduce, broadcast, barrier,
    /// global sync) failed as a whole: a peer rank reported a failure, the ranks disagree
    /// on what the collective is, or not every rank arrived in time. The message names
    /// the collective, the ranks involved and the rank count.
    #[error("ivm: collective failed: {0}")]
    Collective(String),
    /// A lazy graph description (or a graph built by a graph runtime, e.g. ivm-graph) is invalid.
    #[error("ivm: invalid lazy graph `{job}`: {message}")]
    InvalidGraph {
        /// The job name.
        job: String,
        /// What is wrong.
        message: String,
    },
}

/// The convenience result type of ivm-std.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an instruction failed, as recorded on the instruction and on poisoned tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// `name#id` of the instruction that failed first.
    pub(crate) instruction: Arc<str>,
    pub(crate) message: Arc<str>,
    /// The instruction itself panicked (false: it refused to run on poisoned input).
    pub(crate) panicked: bool,
}

impl Failure {
    pub(crate) fn to_error(&self) -> Error {
        if self.panicked {
            Error::KernelPanicked {
                instruction: self.instruction.to_string(),
                message: self.message.to_string(),
            }
        } else {
            Error::Poisoned {
                instruction: self.instruction.to_string(),
                message: self.message.to_string(),
            }
        }
    }

    pub(crate) fn poison_error(&self) -> Error {
        Error::Poisoned {
            instruction: self.instruction.to_string(),
            message: self.message.to_string(),
        }
    }
}

/// One lively instruction, as listed by a timeout [`Diagnostic`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LivelyInstruction {
    /// `name#id`.
    pub name: String,
    /// The stream it runs on.
    pub stream: String,
    /// Handed to its stream (worker or scheduler).
    pub dispatched: bool,
    /// Its body started.
    pub launched: bool,
    /// Its stream reports it done.
    pub done: bool,
    /// In-edges not yet removed (sources not yet released), by source name.
    pub in_edges: Vec<String>,
}

impl LivelyInstruction {
    /// The device work of `stream` that had not completed when a wait timed out: work the
    /// engine no longer tracks (an instruction done at launch was released once its work
    /// was queued), held back on the device by an event that did not complete. `before`:
    /// the instruction whose completion is queued behind it, if a caller waits for one.
    pub(crate) fn device_work(stream: impl fmt::Display, before: Option<String>) -> Self {
        let name = match before {
            Some(b) => format!("device work of {stream} (before {b})"),
            None => format!("device work of {stream}"),
        };
        Self {
            name,
            stream: stream.to_string(),
            dispatched: true,
            launched: true,
            done: false,
            in_edges: Vec::new(),
        }
    }
}

/// What the engine was doing when a wait timed out: every lively instruction, oldest first.
/// Non-exhaustive: later versions add what else a timeout can name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Diagnostic {
    /// Instructions received but not yet handled by the engine.
    pub pending: usize,
    /// Lively instructions, oldest first (capped; see `truncated`).
    pub lively: Vec<LivelyInstruction>,
    /// How many lively instructions were left out of `lively`.
    pub truncated: usize,
    /// Set when the scheduler did not answer the diagnostic request in time.
    pub scheduler_unresponsive: bool,
    /// Probes still polled that have not returned true
    /// ([`blocking_run_probe`](crate::VirtualMachine::blocking_run_probe)): they keep the
    /// VM from being idle, so a `shutdown` waits for them.
    pub probes: usize,
    /// The lazy graphs launched here that describe their state
    /// ([`LazyGraph::set_state_probe`](crate::lazy::LazyGraph::set_state_probe); ivm-graph's
    /// do): `job: state` each, as the graph runtime told it when the diagnostic was built
    /// (the live graphs whose offers the VM keeps, eight at most).
    pub graphs: Vec<String>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.scheduler_unresponsive {
            writeln!(
                f,
                "  (the scheduler did not answer the diagnostic request: it is itself blocked, e.g. in a barrier)"
            )?;
        }
        writeln!(
            f,
            "  {} pending, {} lively instruction(s):",
            self.pending,
            self.lively.len() + self.truncated
        )?;
        for i in &self.lively {
            write!(
                f,
                "  - {} on {}: dispatched={} launched={} done={}",
                i.name, i.stream, i.dispatched, i.launched, i.done
            )?;
            if i.in_edges.is_empty() {
                writeln!(f)?;
            } else {
                writeln!(f, ", waiting for [{}]", i.in_edges.join(", "))?;
            }
        }
        if self.truncated > 0 {
            writeln!(f, "  ... and {} more", self.truncated)?;
        }
        if self.probes > 0 {
            writeln!(f, "  {} probe(s) polled, not yet true", self.probes)?;
        }
        for g in &self.graphs {
            writeln!(f, "  graph {g}")?;
        }
        Ok(())
    }
}
