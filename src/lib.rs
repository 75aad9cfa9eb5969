#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

/// Collective communication (all-reduce, broadcast, all-gather, barriers) on collective
/// streams, over MPI behind the `mpi` feature.
pub use ivm_ccl;
/// The `no_std` core: intrusive lists, MPSC queue, notifier, counters, blocking-then-busy,
/// scheduler parking.
pub use ivm_core;
/// Device adapters: the simulated accelerator, CUDA behind the `cuda` feature.
pub use ivm_device;
/// The `no_std` dependency engine: instructions, dependences, edges, in-order release per
/// stream, over fixed-capacity or growable pools.
pub use ivm_engine;
/// The VM on std.
pub use ivm_std;

/// The graph runtime that lazy jobs run on (the crate `ivm-graph`, written against
/// ivm-std's public lazy-job protocol only).
pub use ivm_graph as graph;
pub use ivm_std::{
    Config, Done, Error, ForeignHooks, InstructionPolicy, InstructionsBuilder, KernelCtx,
    LazyGraph, Mode, Result, Stream, StreamId, StreamType, Tensor, VirtualMachine,
};
