//! Executing an instruction, in one place: whoever the engine hands an instruction to (a
//! worker, the driver inline, a waiting caller) calls [`execute`] (or a variant), which
//! runs it one of three ways:
//!
//! * **on the calling thread** (a synchronous device: cpu): run the body, catch a panic
//!   into a failure that poisons the outputs, set `DONE` (Release), finish the waiter;
//! * **deferred** (critical sections, lazy-job launches): the body gets a [`Completion`]
//!   and returns; whoever holds the completion finishes the instruction later, and a
//!   completion dropped unfired fails it;
//! * **launched on an asynchronous device stream** (sim, cuda): `device_launch/`.

use std::sync::Arc;

use ivm_core::sync::Ordering;

use super::device_launch::{launch, launch_deferred};
use crate::device::DeviceStream;
use crate::model::blob::Blob;
use crate::model::instruction::{Body, Completion, Instruction, KernelCtx, Kind, status};
use crate::util::error::Failure;
use crate::util::panics::catch;

// ---- running a body on the calling thread ------------------------------------------

/// The failure of the first poisoned blob of `blobs` (an operand's poison, not a panic).
pub(crate) fn first_poison<'a>(blobs: impl IntoIterator<Item = &'a Arc<Blob>>) -> Option<Failure> {
    blobs.into_iter().find_map(|b| b.poison()).map(|p| Failure {
        panicked: false,
        ..p
    })
}

/// Poisons every blob of `outputs` with `f`.
pub(crate) fn poison_all(outputs: &[Arc<Blob>], f: &Failure) {
    for b in outputs {
        b.set_poison(f);
    }
}

/// Marks `instr` done, every way it runs ending here: with `failure`, stores it and sets
/// `FAILED`; then sets `DONE` (Release) and, with `finish_waiter`, finishes its waiter.
/// The caller has poisoned the outputs first, as its device's order requires.
///
/// # Safety
/// The caller is `instr`'s executor (a worker, a completion's holder, a device callback)
/// and owns its `failure` until `DONE` (ownership step 3): no other reference to it is
/// alive.
pub(crate) unsafe fn finish(instr: &Instruction, failure: Option<Failure>, finish_waiter: bool) {
    let mut bits = status::DONE;
    if let Some(f) = failure {
        // SAFETY: the caller owns `failure` until DONE (this function's contract).
        instr.failure.with_mut(|p| unsafe { *p = Some(f) });
        bits |= status::FAILED;
    }
    // Release: publishes what the executor did (the body's or the device work's effects on
    // tensor memory, `small`, poison, `failure`) to whoever reads DONE with Acquire: the
    // engine, before the release and the dependants, hence every instruction ordered
    // after this one.
    instr.status.fetch_or(bits, Ordering::Release);
    if finish_waiter && let Some(w) = &instr.waiter {
        // Release inside: publishes the same to the waiting caller.
        w.finished();
    }
}

/// Runs `instr`'s body on the calling thread (its stream's thread, or the scheduler) and
/// marks it done. The caller owns the body (step 3 of the ownership order).
pub(crate) fn execute(instr: &Arc<Instruction>) {
    execute_as(instr, true);
}

/// [`execute`]; `may_block`: false when the engine runs the instruction inline on the
/// driving thread (a deferred body then must not wait for room in a buffer).
pub(crate) fn execute_as(instr: &Arc<Instruction>, may_block: bool) {
    execute_inner(instr, may_block, true);
}

/// [`execute`] for what a worker's queue holds: `head` and the members of the fused run
/// it heads (linked at dispatch through `Body::fused_next`), in order, back to back (a
/// waiting caller running a worker's queue; the worker runs members one by one, each
/// with its own release decision). Each member is run, traced, poisoned and marked done
/// on its own, as if it had been queued alone; a member whose operand an earlier one
/// poisoned fails by that poison, the others run. Returns how many instructions ran, and
/// whether the engine had marked any of them awaited when it ran (`status::AWAITED`).
pub(crate) fn execute_run(head: &Arc<Instruction>) -> (usize, bool) {
    let mut next = take_fused_next(head);
    execute(head);
    let (mut ran, mut awaited) = (1, head.is_awaited());
    while let Some(m) = next {
        next = take_fused_next(&m);
        execute(&m);
        ran += 1;
        awaited |= m.is_awaited();
    }
    (ran, awaited)
}

/// The member queued behind `instr` in its fused run, taken before `instr` runs: once it
/// is done the engine may release it and clear its body.
pub(crate) fn take_fused_next(instr: &Instruction) -> Option<Arc<Instruction>> {
    // SAFETY: the executor owns the body until DONE (ownership step 3), which `execute`
    // sets after this borrow ends.
    unsafe { instr.body_mut() }.fused_next.take()
}

/// [`execute`] by the caller waiting for `instr`, which the engine handed to it
/// (`status::CLAIMED`): no "started" notification (the waiter is the executor).
pub(crate) fn execute_claimed(instr: &Arc<Instruction>) {
    execute_inner(instr, true, false);
}

fn execute_inner(instr: &Arc<Instruction>, may_block: bool, notify_start: bool) {
    crate::model::trace::record(instr, crate::model::trace::Phase::ComputeStart);
    if instr.stream.dev.is_async() {
        // The launch is traced as a zero-length compute (its device work completes later;
        // recording after `launch` could come after the engine's release record).
        crate::model::trace::record(instr, crate::model::trace::Phase::ComputeEnd);
        if launch_deferred(instr) {
            // A custom instruction: completed by whoever holds its completion.
            return;
        }
        // The stream policies of asynchronous devices.
        launch(instr);
        return;
    }
    // Relaxed: LAUNCHED is diagnostic only.
    instr.status.fetch_or(status::LAUNCHED, Ordering::Relaxed);
    if let Some(w) = instr.waiter.as_ref().filter(|_| notify_start) {
        w.started();
    }
    if run_deferred(instr, may_block) {
        // Completed later, by whoever holds its completion.
        return;
    }
    // SAFETY: the executor owns the body until DONE (ownership step 3).
    let body = unsafe { instr.body_mut() };
    let failure = run_body(instr, body);
    if let Some(landed) = body.landed.take() {
        landed(failure.clone());
    }
    if let Some(f) = &failure {
        poison_all(body.outputs.as_slice(), f);
    }
    // Before DONE: the engine's release record must come after it.
    crate::model::trace::record(instr, crate::model::trace::Phase::ComputeEnd);
    // SAFETY: the executor owns the body and `failure` until DONE (ownership step 3).
    unsafe { finish(instr, failure, true) };
}

fn run_body(instr: &Instruction, body: &mut Body) -> Option<Failure> {
    if let Some(failure) = run_kernel(instr, body) {
        return failure;
    }
    let kind = std::mem::replace(&mut body.kind, Kind::Noop);
    if matches!(kind, Kind::Noop) || kind.is_sync_op() {
        // Soft sync on a synchronous device orders nothing.
        return None;
    }
    if matches!(kind, Kind::Free) {
        // A release frees even poisoned memory.
        let dev = &instr.stream.dev;
        let b = body.outputs.as_slice().first()?;
        return dev
            .allocator
            .free_on(&b.mem, &*dev.stream)
            .err()
            .map(|e| Failure {
                instruction: instr.label().into(),
                message: e.to_string().into(),
                panicked: false,
            });
    }
    if !matches!(kind, Kind::Barrier(_)) {
        for b in body.inputs.as_slice().iter().chain(body.outputs.as_slice()) {
            if let Some(p) = b.poison() {
                return Some(Failure {
                    panicked: false,
                    ..p
                });
            }
        }
    }
    let inputs = body.inputs.as_slice();
    let outputs = body.outputs.as_slice();
    let small = &instr.small;
    let stream: &dyn DeviceStream = &*instr.stream.dev.stream;
    let result = catch(|| match kind {
        Kind::Noop
        | Kind::Free
        | Kind::StreamWait { .. }
        | Kind::RecordEvent { .. }
        | Kind::WaitEvent { .. } => {}
        Kind::Kernel(f) => f.call(&mut KernelCtx {
            inputs,
            outputs,
            stream: Some(stream),
            launcher: None,
        }),
        Kind::Copy {
            src_offset,
            dst_offset,
            len,
        } => {
            // SAFETY: reading input 0 and writing output 0 (engine-ordered; distinct
            // blobs: the builder rejects aliasing); ranges checked by the builder.
            let src = unsafe { &inputs[0].bytes()[src_offset..src_offset + len] };
            // SAFETY: as above.
            let dst = unsafe { &mut outputs[0].bytes_mut()[dst_offset..dst_offset + len] };
            dst.copy_from_slice(src);
        }
        Kind::Read(f) => {
            // SAFETY: the body reads input 0 under the engine-ordered invariant; the
            // builder always gives a callback its operand.
            f.take()(unsafe { inputs[0].bytes() })
        }
        Kind::Write(f) => {
            // SAFETY: the body writes output 0 under the engine-ordered invariant.
            f.take()(unsafe { outputs[0].bytes_mut() })
        }
        Kind::SmallRead { offset, len } => {
            // SAFETY: reading input 0 (engine-ordered); bounds checked by the builder.
            let src = unsafe { &inputs[0].bytes()[offset..offset + len] };
            // SAFETY: the executor owns `small` until DONE.
            small.with_mut(|p| unsafe { (&mut *p)[..len].copy_from_slice(src) });
        }
        Kind::SmallWrite { offset, len } => {
            // SAFETY: writing output 0 (engine-ordered); bounds checked by the builder.
            let dst = unsafe { &mut outputs[0].bytes_mut()[offset..offset + len] };
            // SAFETY: the executor owns `small` until DONE.
            small.with(|p| unsafe { dst.copy_from_slice(&(&*p)[..len]) });
        }
        Kind::Barrier(f) => f(),
    });
    result.err().map(|message| Failure {
        instruction: instr.label().into(),
        message: message.into(),
        panicked: true,
    })
}

/// [`run_body`] for a kernel, the common case: run where it lies in the body rather than
/// moved out first (a kernel is over 100 bytes; each move was a copy), then dropped as
/// `run_body` drops every kind it ran. `None` (nothing done) for another kind.
fn run_kernel(instr: &Instruction, body: &mut Body) -> Option<Option<Failure>> {
    let Body {
        kind: Kind::Kernel(f),
        inputs,
        outputs,
        ..
    } = &mut *body
    else {
        return None;
    };
    let (inputs, outputs) = (inputs.as_slice(), outputs.as_slice());
    let failure = match inputs.iter().chain(outputs).find_map(|b| b.poison()) {
        Some(p) => Some(Failure {
            panicked: false,
            ..p
        }),
        None => {
            let stream: &dyn DeviceStream = &*instr.stream.dev.stream;
            catch(|| {
                f.call_in_place(&mut KernelCtx {
                    inputs,
                    outputs,
                    stream: Some(stream),
                    launcher: None,
                });
            })
            .err()
            .map(|message| Failure {
                instruction: instr.label().into(),
                message: message.into(),
                panicked: true,
            })
        }
    };
    // What the kind held (a spent kernel, or the captures of one that did not run, which
    // go to its drop sink) goes now, as in `run_body`.
    body.kind = Kind::Noop;
    Some(failure)
}

// ---- bodies that complete later ---------------------------------------------------

impl Completion {
    /// Finishes the instruction: done, or failed with `failure` (its outputs poisoned).
    pub(crate) fn complete(mut self, result: Result<(), Failure>) {
        if let Some(i) = self.instr.take() {
            finish_deferred(&i, result);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(i) = self.instr.take() {
            let f = Failure {
                instruction: i.label().into(),
                message: "the instruction's body ended without completing it (it panicked)".into(),
                panicked: true,
            };
            finish_deferred(&i, Err(f));
        }
    }
}

/// A deferred body's completion: finishes `instr`. What it publishes includes a critical
/// section's effects on the tensors (graph copies happen-before the record's
/// initialisation, which happens-before this).
fn finish_deferred(instr: &Arc<Instruction>, result: Result<(), Failure>) {
    let failure = result.err();
    if let Some(f) = &failure {
        // SAFETY: the executor's borrow of the body ended before the deferred body got
        // this completion (`run_deferred`), the deferred body holds no borrow of it, and
        // the engine touches it again only after DONE: this completion owns the body and
        // `failure` until DONE (ownership step 3).
        let body = unsafe { instr.body() };
        poison_all(body.outputs.as_slice(), f);
    }
    // SAFETY: as above.
    unsafe { finish(instr, failure, true) };
    // After DONE: release it — on this thread when nobody drives the engine (usually a
    // graph runtime's thread: no scheduler wake-up), else by the holder or a helper.
    instr.stream.dev.wake.complete_outside();
}

/// Runs `instr`'s deferred body, if it has one (the executor, after marking it
/// launched; `may_block`: it runs on its stream's own thread). Returns whether it did; the
/// instruction is then completed by whoever holds its [`Completion`].
pub(crate) fn run_deferred(instr: &Arc<Instruction>, may_block: bool) -> bool {
    let f = {
        // SAFETY: the executor owns the body until DONE (ownership step 3); this borrow
        // ends before the completion exists.
        let body = unsafe { instr.body_mut() };
        match body.deferred.take() {
            Some(d) => d.run,
            None => return false,
        }
    };
    let c = Completion {
        instr: Some(instr.clone()),
    };
    // A panic drops the completion during unwinding, which fails the instruction.
    let _ = catch(move || f(c, may_block));
    // Release: pairs with the engine's Acquire in `can_run_protocol_inline`: this body's
    // effects (its pushes) happen before a later step of the stream that the engine runs
    // on another thread.
    instr.status.fetch_or(status::BODY_RAN, Ordering::Release);
    true
}
