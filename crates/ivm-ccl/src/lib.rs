//! ivm-ccl: collective communication for the ivm instruction virtual machine — a runtime
//! built on ivm that outgrows one process runs the same program on every rank and moves
//! tensors between ranks with all-reduce, broadcast, all-gather and barriers.
//!
//! * **Ordered like any instruction.** A collective reads and writes tensors, so the
//!   engine orders it against compute (an all-reduce of a gradient waits for the kernel
//!   that wrote it; the optimizer step waits for the all-reduce).
//! * **One transport order on every rank.** Collectives run on the collective stream of
//!   the communicator's device ([`ivm_std::StreamType::Collective`]), which dispatches in
//!   build order: they reach the transport in exactly the order the front end built them,
//!   whichever operands become ready first on each rank.
//! * **Off the compute workers.** The collective stream has a thread of its own: a
//!   transport call waiting for a slow peer stalls no unrelated compute.
//! * **Errors, not hangs.** Every collective starts with a small header exchange
//!   ([`Header`]): ranks that disagree on a collective (its number, kind, type or size)
//!   fail with an error naming both sides; a rank whose operand was poisoned tells its
//!   peers, which fail too; a peer that does not arrive within the timeout is an error
//!   naming the collective and the rank count. [`Collectives::global_sync`] drains the
//!   VM, then meets every rank, and fails on every rank if any rank failed.
//!
//! Transports ([`Communicator`]): MPI through rsmpi for host tensors (feature `mpi`,
//! [`mpi::MpiCommunicator`]); NCCL through cudarc for CUDA tensors (feature `cuda`,
//! `nccl::NcclCommunicator`, bootstrapped over MPI); [`LocalGroup`], ranks as threads of
//! one process, for tests and single-process runs.
//!
//! ```
//! use std::thread;
//! use ivm_ccl::{Collectives, DType, LocalGroup};
//! use ivm_std::{Config, VirtualMachine};
//!
//! // Two ranks as two threads, each with its own VM.
//! let ranks: Vec<_> = LocalGroup::ranks(2)
//!     .into_iter()
//!     .map(|comm| {
//!         thread::spawn(move || -> ivm_std::Result<f32> {
//!             let vm = VirtualMachine::new(Config::default())?;
//!             let ccl = Collectives::new(&vm, comm)?;
//!             let s = vm.default_stream();
//!             let x = 1.0 + ccl.rank() as f32;
//!             let t = vm.new_tensor_from(&s, &x.to_ne_bytes())?;
//!             vm.run(|b| ccl.all_reduce_sum(b, &t, DType::F32))?;
//!             ccl.global_sync(&vm)?;
//!             let mut out = [0u8; 4];
//!             vm.read_small(&t, 0, &mut out)?;
//!             Ok(f32::from_ne_bytes(out))
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().unwrap()?, 3.0);
//! }
//! # Ok::<(), ivm_std::Error>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod collectives;
mod comm;
mod local;
#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub mod mpi;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod nccl;

pub use collectives::{Collectives, DEFAULT_TIMEOUT, Span};
pub use comm::{
    CollectiveKind, Communicator, DType, Dst, HEADER_BYTES, Header, Src, TransportError,
};
pub use local::LocalGroup;
