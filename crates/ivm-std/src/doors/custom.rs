//! Custom instructions: an embedder's own kind of instruction, ordered by the engine like
//! any other (it names the tensors it reads and writes), run on its stream's thread, and
//! completed either during its launch or later — from any thread — through a [`Done`]
//! handle (an I/O request, a foreign runtime's event, an RPC).
//!
//! Submit one with
//! [`InstructionsBuilder::custom`](crate::InstructionsBuilder::custom). What the handle
//! guarantees:
//!
//! * it completes the instruction once: [`Done::complete`] and [`Done::fail`] consume it;
//! * dropped without being fired, it fails the instruction with an error naming it
//!   (its outputs are poisoned, their readers get the error) — never a hang;
//! * fired after its VM is gone (its `VirtualMachine` dropped, whether the drop's shutdown
//!   waited for the handle or gave up), it does no harm and returns [`Error::ShutDown`];
//! * fired during [`InstructionPolicy::launch`], it takes effect when `launch` returns:
//!   the operands lent to `launch` stay the instruction's own until then.
//!
//! Until the instruction completes, later instructions that read or write its operands
//! wait for it, on its own stream too: it is never prescheduled past
//! ([`InstructionPolicy::completes_during_launch`] lifts that for a policy that always
//! fires its handle before `launch` returns). Custom instructions run on every stream: on
//! the cpu device on the stream's worker; on a device whose kernels run in its queue (the
//! sim) in the device's stream order, on the device's thread, seeing the operands' bytes;
//! on a launcher device (cuda) on the stream's worker, where the policy enqueues its
//! device work on [`KernelCtx::device_stream`] and fires the handle when that work is
//! enqueued (then, like a kernel, it is ordered by the device queue) or done.

use std::sync::{Arc, Mutex, Weak};

use crate::engine::core::VmCore;
use crate::engine::execute::first_poison;
use crate::model::blob::Blob;
use crate::model::instruction::{Callback, Completion, KernelCtx, Operands};
use crate::util::error::{Error, Failure, Result};
use crate::util::lock;
use crate::util::panics::catch;

/// What a custom instruction does when it runs (OneFlow's `InstructionPolicy`). Closures
/// `FnOnce(&mut KernelCtx, Done)` are policies.
///
/// # Examples
///
/// An instruction completed later by another thread (a stand-in for an I/O completion):
///
/// ```
/// use ivm_std::{Config, VirtualMachine};
///
/// let vm = VirtualMachine::new(Config::default())?;
/// let (s, t) = (vm.default_stream(), vm.new_tensor(8)?);
/// vm.run(|b| {
///     b.custom(&s, &[], &[&t], |k: &mut ivm_std::KernelCtx<'_>, done: ivm_std::Done| {
///         k.output_u64(0)[0] = 7; // the operands are lent for this call only
///         std::thread::spawn(move || {
///             std::thread::sleep(std::time::Duration::from_millis(5));
///             done.complete().unwrap();
///         });
///     })
/// })?;
/// let mut out = [0u8; 8];
/// vm.read_small(&t, 0, &mut out)?; // waits for the completion, not just the launch
/// assert_eq!(u64::from_ne_bytes(out), 7);
/// # Ok::<(), ivm_std::Error>(())
/// ```
pub trait InstructionPolicy: Send + 'static {
    /// Runs the instruction, once, on its stream's thread, when every instruction it
    /// depends on has completed. `ctx` lends its operands for this call; `done` completes
    /// it, now or later, from any thread. A panic fails the instruction, even after
    /// `done` was handed to another thread (firing it later returns an error).
    fn launch(self: Box<Self>, ctx: &mut KernelCtx<'_>, done: Done);

    /// Whether `launch` always fires its handle before it returns. Then the instruction
    /// is prescheduled like a kernel (its stream's next instruction may be dispatched
    /// while it runs), and a handle still unfired when `launch` returns fails it. Default
    /// `false`: it may complete later, and nothing on its stream that uses its operands
    /// starts before it has.
    fn completes_during_launch(&self) -> bool {
        false
    }

    /// Called instead of [`launch`](Self::launch) when an operand was poisoned by an
    /// earlier failed instruction: the instruction fails with `error` (the operand's
    /// poison; its outputs are poisoned with it) without launching. A policy whose launch
    /// has a counterpart elsewhere — a peer process waiting for the same collective, a
    /// remote request — tells it here, so that the counterpart fails too instead of
    /// waiting. It runs on the stream's thread; a panic is caught and ignored. The policy
    /// is then dropped unlaunched (through the VM's [`DropSink`](crate::DropSink), if one
    /// is installed). Default: nothing.
    fn poisoned(&mut self, error: &Error) {
        let _ = error;
    }
}

impl<F> InstructionPolicy for F
where
    F: FnOnce(&mut KernelCtx<'_>, Done) + Send + 'static,
{
    fn launch(self: Box<Self>, ctx: &mut KernelCtx<'_>, done: Done) {
        (*self)(ctx, done)
    }
}

/// A custom instruction's completion, shared by its [`Done`] handle and its launch.
struct Shared {
    /// Taken by whoever completes the instruction.
    completion: Option<Completion>,
    /// `launch` has not returned yet: a firing waits here for it.
    launching: bool,
    fired: Option<std::result::Result<(), Failure>>,
    /// Why the instruction failed without this handle, once it has.
    failed_without: Option<&'static str>,
}

/// The right to complete one custom instruction (see the [module docs](self)).
#[must_use = "dropping the handle unfired fails the instruction"]
pub struct Done {
    shared: Arc<Mutex<Shared>>,
    vm: Weak<VmCore>,
    label: Arc<str>,
    fired: bool,
}

impl std::fmt::Debug for Done {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Done")
            .field("instruction", &self.label)
            .finish()
    }
}

impl Done {
    /// The instruction's label (`name#id`), as diagnostics and errors name it.
    pub fn instruction(&self) -> &str {
        &self.label
    }

    /// Completes the instruction successfully.
    ///
    /// # Errors
    /// [`Error::ShutDown`] if its VM is gone (the instruction was abandoned; nothing else
    /// happens); [`Error::InvalidArgument`] naming the instruction if it was already
    /// failed without this handle: its launch panicked (after handing the handle away),
    /// or its policy promised
    /// [`completes_during_launch`](InstructionPolicy::completes_during_launch) and its
    /// launch returned without firing this handle.
    pub fn complete(mut self) -> Result<()> {
        self.fire(Ok(()))
    }

    /// Fails the instruction with `message`: its outputs are poisoned and their readers
    /// get an error naming it.
    ///
    /// # Errors
    /// As [`complete`](Self::complete).
    pub fn fail(mut self, message: impl Into<String>) -> Result<()> {
        let f = Failure {
            instruction: self.label.clone(),
            message: message.into().into(),
            panicked: false,
        };
        self.fire(Err(f))
    }

    fn fire(&mut self, result: std::result::Result<(), Failure>) -> Result<()> {
        self.fired = true;
        let gone = self
            .vm
            .upgrade()
            .is_none_or(|core| core.is_handle_dropped());
        let mut s = lock(&self.shared);
        if s.completion.is_none() {
            let why = s.failed_without.unwrap_or("it was completed");
            return Err(Error::InvalidArgument(format!(
                "{}: already failed ({why})",
                self.label
            )));
        }
        if s.launching {
            // Takes effect when the launch returns; a launch that then panics fails the
            // instruction instead (this call cannot know that yet).
            s.fired = Some(result);
        } else if let Some(c) = s.completion.take() {
            drop(s);
            c.complete(result);
        }
        if gone { Err(Error::ShutDown) } else { Ok(()) }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if !self.fired {
            let f = Failure {
                instruction: self.label.clone(),
                message: "its completion handle was dropped without being fired".into(),
                panicked: false,
            };
            let _ = self.fire(Err(f));
        }
    }
}

/// The deferred body of a custom instruction (`InstructionsBuilder::custom`): checks its
/// operands, lends them to the policy's `launch`, and completes it as the handle says.
pub(crate) fn run(
    policy: Callback<dyn InstructionPolicy>,
    ops: (Operands, Operands),
    completion: Completion,
    vm: Weak<VmCore>,
    during_launch: bool,
    device_stream: Option<&dyn crate::device::DeviceStream>,
) {
    let (inputs, outputs) = ops;
    let label: Arc<str> = completion
        .instr
        .as_ref()
        .map_or_else(String::new, |i| i.label())
        .into();
    // On a launcher device the policy runs on the worker, ahead of the device: its
    // `on_host` work is enqueued for this instruction, and a failure known here waits for
    // the stream's earlier work before it poisons the outputs (`drain_before_failing`).
    let instr = device_stream.and(completion.instr.clone());
    // Like a kernel: a poisoned operand fails it without launching it; the policy hears
    // of it (`InstructionPolicy::poisoned`) and drops unrun (to the drop sink, if any).
    if let Some(f) = first_poison(inputs.as_slice().iter().chain(outputs.as_slice())) {
        let mut policy = policy;
        if let Some(p) = policy.get_mut() {
            let error = f.poison_error();
            let _ = catch(|| p.poisoned(&error));
        }
        drop(policy);
        if let Some(i) = &instr {
            crate::engine::device_launch::drain_before_failing(i);
        }
        completion.complete(Err(f));
        return;
    }
    let shared = Arc::new(Mutex::new(Shared {
        completion: Some(completion),
        launching: true,
        fired: None,
        failed_without: None,
    }));
    let done = Done {
        shared: shared.clone(),
        vm,
        label: label.clone(),
        fired: false,
    };
    let policy = policy.take();
    let ran = {
        let (ins, outs): (&[Arc<Blob>], &[Arc<Blob>]) = (inputs.as_slice(), outputs.as_slice());
        let mut ctx = KernelCtx {
            inputs: ins,
            outputs: outs,
            stream: device_stream,
            launcher: instr
                .as_deref()
                .map(|i| i as &dyn crate::model::kernel::HostEnqueue),
        };
        catch(|| policy.launch(&mut ctx, done))
    };
    let mut s = lock(&shared);
    s.launching = false;
    // A panic fails the instruction whether or not the handle escaped first: the operands
    // were lent for the launch only, and what it left in them is not to be trusted. (A
    // handle dropped by the unwinding stashed a dropped-handle failure: the panic is the
    // better answer.) An escaped handle fired later is told why it came too late.
    let result = match ran {
        Err(message) => {
            s.failed_without = Some("its launch panicked");
            Some(Err(Failure {
                instruction: label,
                message: format!("its launch panicked: {message}").into(),
                panicked: true,
            }))
        }
        Ok(()) => match s.fired.take() {
            Some(r) => Some(r),
            None if during_launch => {
                s.failed_without = Some(
                    "its policy promised to complete during launch, and the launch \
                     returned without firing its handle",
                );
                Some(Err(Failure {
                    instruction: label,
                    message: "its policy promised to complete during launch; the launch \
                              returned without firing its handle"
                        .into(),
                    panicked: false,
                }))
            }
            // Completed later, by whoever holds the handle.
            None => None,
        },
    };
    let c = if result.is_some() {
        s.completion.take()
    } else {
        None
    };
    drop(s);
    if let (Some(c), Some(r)) = (c, result) {
        if let (Some(i), Err(_)) = (&instr, &r) {
            crate::engine::device_launch::drain_before_failing(i);
        }
        c.complete(r);
    }
}
