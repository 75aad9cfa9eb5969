//! The thread-safety contract of ivm-std: which types cross threads, which calls may be made
//! from which threads, what [`Error::Reentrant`](crate::Error::Reentrant) covers, and what
//! happens across `fork()`. (Documentation only; `tests/surface_send_sync.rs` checks the
//! `Send`/`Sync` table at compile time.)
//!
//! # Types
//!
//! | type | `Send` | `Sync` | notes |
//! |---|---|---|---|
//! | [`VirtualMachine`](crate::VirtualMachine) | yes | yes | every method takes `&self`; share it with `Arc` |
//! | [`Tensor`](crate::Tensor), [`Stream`](crate::Stream) | yes | yes | cheap clones; the last tensor drop (any thread) enqueues its release and never blocks |
//! | [`Config`](crate::Config), [`Error`](crate::Error), [`Diagnostic`](crate::Diagnostic), [`VmStats`](crate::VmStats), [`Dag`](crate::Dag) | yes | yes | plain data |
//! | [`Completion<T>`](crate::Completion), [`ReadSmallMem`](crate::ReadSmallMem) | if `T: Send` | if `T: Send` | `Unpin`; await or `wait` it on any thread |
//! | [`InstructionsBuilder`](crate::InstructionsBuilder) | yes | yes | lives only inside the `run` closure that lends it |
//! | [`KernelCtx`](crate::KernelCtx) | no | no | lives only inside the kernel body that receives it |
//! | adapter traits ([`DeviceAdapter`](crate::DeviceAdapter), [`DeviceStream`](crate::DeviceStream), [`Event`](crate::Event), [`DeviceAllocator`](crate::DeviceAllocator), [`DeviceMemory`](crate::DeviceMemory)) | required | required | called from the scheduler, workers and callers |
//!
//! Kernels, callbacks, barriers and probes must be `Send + 'static`: they run on VM threads.
//!
//! # Which calls from which threads
//!
//! *Outside threads* (any thread that is not one of this VM's threads and is not inside one
//! of its kernels, callbacks, barriers or probes) may call every entry point, concurrently:
//! `run`, `run_async`, the `sync*` family (blocking, `_timeout`, `_async`), `stream`,
//! `new_tensor*`, `blocking_run_probe`, `dump_dag`, `stats`, `shutdown`. Two threads that
//! build instructions on the same tensor order their `run`s themselves (the VM follows the
//! order in which they were built).
//!
//! *Inside the VM* (its scheduler and worker threads, and any kernel, callback, barrier or
//! probe of this VM, whichever thread runs it):
//!
//! * allowed: dropping tensors, cloning handles, `stats`, `flying_instruction_count`,
//!   `is_shut_down`, `config`, `new_tensor*` on the cpu device, `stream` for an existing
//!   stream, and every call into *another* VM (ivm cannot see a cycle of VMs waiting on
//!   each other: the per-VM timeout reports it);
//! * refused with [`Error::Reentrant`](crate::Error::Reentrant), because each of them waits
//!   for (or submits to) the engine that the calling thread itself has to run: `run`,
//!   `run_async`, `sync`, `read_small`, `write_small` (and their `_timeout` and `_async`
//!   forms), `access`, `access_mut`, `access_async`, `blocking_run_probe`, `dump_dag`,
//!   `shutdown`,
//!   [`Completion::wait`](crate::Completion::wait) / `wait_timeout`.
//!
//! `Reentrant` is keyed by VM: the VM marks its own threads (and the caller's thread while
//! it drives the engine in single-thread mode) with its id in a thread-local, so a kernel of
//! VM A may block on VM B. Dropping a `VirtualMachine` on one of its own threads does not
//! join its threads (it cannot join itself): it stops accepting work and lets them wind down.
//!
//! Wakers of [`Completion`](crate::Completion)s are woken on VM threads (a worker, a device
//! thread, the scheduler for barriers): they must be cheap and must not poll the task
//! inline.
//!
//! # Thread-local state
//!
//! Per calling thread, ivm keeps a spare instruction list (for `run`) and a small ring of
//! reusable sync-access instructions per (VM id, stream, kind). VM ids are never reused in
//! a process, so several VMs in one process never share an instruction: a sync read on VM A
//! never touches VM B's instructions.
//!
//! # fork()
//!
//! A child process of a forked parent must not touch the parent's VM threads (they do not
//! exist in the child, and locks they held stay held). Every VM records the process's fork
//! generation when it is created; in a child every entry point of an inherited VM returns
//! [`Error::Forked`](crate::Error::Forked) before touching its state (`run`, the `sync*`
//! family, `stream`, `new_tensor*`, `blocking_run_probe`, `dump_dag`, `stats`, `shutdown`,
//! polling or waiting a completion), and dropping it (or its tensors) leaks it instead of
//! joining threads that are not there. [`VirtualMachine::is_forked`](crate::VirtualMachine::is_forked)
//! tells which case applies. Create a new VM in the child (single-thread mode fits well).
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use ivm_std::{Config, Error, VirtualMachine};
//!
//! fn assert_send_sync<T: Send + Sync>() {}
//! assert_send_sync::<VirtualMachine>();
//! assert_send_sync::<ivm_std::Tensor>();
//!
//! let vm = Arc::new(VirtualMachine::new(Config::default())?);
//! let s = vm.default_stream();
//! let x = vm.new_tensor(8)?;
//! // Outside threads may call in concurrently.
//! std::thread::scope(|sc| {
//!     for _ in 0..2 {
//!         sc.spawn(|| {
//!             let mut out = [0u8; 8];
//!             vm.read_small(&x, 0, &mut out).unwrap();
//!         });
//!     }
//! });
//! // A kernel calling back into its own VM gets `Reentrant` instead of a deadlock.
//! let (vm2, x2) = (vm.clone(), x.clone());
//! let seen = vm.access(&x, move |_| {
//!     let mut out = [0u8; 8];
//!     matches!(vm2.read_small(&x2, 0, &mut out), Err(Error::Reentrant))
//! })?;
//! assert!(seen);
//! # drop(s);
//! # Ok::<(), ivm_std::Error>(())
//! ```
