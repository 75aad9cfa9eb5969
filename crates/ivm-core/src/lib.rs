//! ivm-core: the `no_std`, allocation-free concurrency primitives of the ivm instruction VM.
//!
//! Everything here builds for bare-metal targets (`thumbv7em-none-eabihf`), never
//! allocates and takes every atomic from one sync facade, so that a build with
//! `RUSTFLAGS="--cfg loom"` checks it — and checks downstream crates that use it — with
//! loom.
//!
//! | module | what |
//! |---|---|
//! | [`list`] | intrusive doubly-linked list; a node sits in several lists through distinct hooks; pointer hooks ([`List`]) or index hooks over a pool ([`list::IndexList`]) |
//! | [`mpsc`] | intrusive lock-free multi-producer single-consumer queue; `push` says whether it was empty |
//! | [`notifier`] | [`Notifier`]: a count of notifications plus a closed flag; no wake call when nobody sleeps |
//! | [`counter`] | [`SpinCounter`], [`BlockingCounter`] |
//! | [`btb`] | [`BlockingThenBusy`] and the notify-skip handshake |
//! | [`parking`] | [`Parking`]: the scheduler's park/unpark protocol that never loses an input |
//! | [`wait`] | the [`Wait`] backend trait (futex-like), the spinning backend and (feature `cortex-m`) the `WFE`/`SEV` backend |
//!
//! Blocking types are generic over a [`Wait`] backend: [`SpinWait`] here (with a clock you
//! supply), `WfeWait` with the `cortex-m` feature (sleeps in `WFE` until an event or
//! interrupt; same clock parameter), a futex in `ivm-std`, a loom futex emulation under
//! `cfg(loom)`.
//!
//! # Features
//!
//! * `cortex-m`: `wait::WfeWait`, a wait backend for Cortex-M cores (depends on the
//!   `cortex-m` crate). Off by default; the rest of the crate does not need it.
//!
//! # The handshake between two threads
//!
//! A waiter wants a result a worker computes. The worker notifies the
//! [`BlockingThenBusy`] when it *starts* and decreases it when it has *finished*; the
//! waiter sleeps until the start (or skips the sleep when little is in flight) and spins for
//! the short compute, so it neither burns a core while a queue drains nor pays a wake-up at
//! the end:
//!
//! ```
//! use core::time::Duration;
//! use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
//! use ivm_core::BlockingThenBusy;
//!
//! let btb: BlockingThenBusy = BlockingThenBusy::new();
//! let result = AtomicU64::new(0);
//! for (round, skip) in [(1u64, false), (2, true)] {
//!     std::thread::scope(|s| {
//!         s.spawn(|| {
//!             let _ = btb.notify(); // worker: started
//!             result.store(round * 10, Relaxed);
//!             btb.decrease(); // worker: finished (Release)
//!         });
//!         if skip {
//!             btb.skip_blocking(); // notify-skip: spin from the start, no wake call
//!         }
//!         btb.wait_until_done(Duration::MAX, || false).unwrap(); // Acquire
//!         assert_eq!(result.load(Relaxed), round * 10);
//!     });
//!     btb.reset(); // legal after a wait that returned Ok
//! }
//! ```
//!
//! # Loom
//!
//! Loom is a `[target.'cfg(loom)'.dependencies]` entry, not a dev-dependency: a crate that
//! depends on ivm-core and is built with `--cfg loom` gets ivm-core's types on loom's
//! atomics, and [`DefaultWait`] becomes `LoomWait`, a futex emulated with loom's `Mutex` and
//! `Condvar` (so a lost wake-up is a reported deadlock). Constructors are `const fn` except
//! under loom. Loom drops its lazy statics when the model closure returns: join every thread
//! a model spawns before returning.
#![no_std]
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(any(test, loom))]
extern crate std;

#[doc(hidden)]
pub mod sync;

pub mod btb;
pub mod counter;
pub mod list;
pub mod mpsc;
pub mod notifier;
pub mod parking;
pub mod wait;

pub use btb::{BlockingThenBusy, SpinBudget};
pub use counter::{BlockingCounter, SpinCounter, WaitError};
pub use list::List;
pub use mpsc::MpscQueue;
pub use notifier::{Closed, Notifier, Timed};
pub use parking::{Park, Parking};
#[cfg(loom)]
pub use wait::LoomWait;
#[cfg(feature = "cortex-m")]
#[cfg_attr(docsrs, doc(cfg(feature = "cortex-m")))]
pub use wait::WfeWait;
pub use wait::{Clock, DefaultWait, Instant, NoClock, SpinWait, Wait, WaitResult};
