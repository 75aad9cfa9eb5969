//! How a launched instruction is done: at launch, by a host closure queued after its work
//! (a waiter's finisher, a write's `landed`), or by its event's completion callback; and
//! how a failure poisons its outputs in the device's stream order.

use std::sync::Arc;

use ivm_core::sync::Ordering;

use super::{failure, poison_all};
use crate::device::{HostFn, KernelMode};
use crate::engine::execute::{finish, first_poison};
use crate::model::blob::Blob;
use crate::model::instruction::{Instruction, Landed, Operands, status};
use crate::model::stream::DeviceCtx;
use crate::util::error::Failure;

/// What a host-observed completion on `dev` reports: the stream's sticky failure (taken,
/// so it is reported once) or an error the device reported.
pub(super) fn observe(dev: &DeviceCtx, instr_label: impl FnOnce() -> String) -> Option<Failure> {
    if let Some(f) = dev.sticky.take() {
        return Some(f);
    }
    device_error(dev, || instr_label().into())
}

/// The error the device reported on `dev`'s stream since it was last taken (taken now), as
/// a failure of the instruction `label` names.
pub(super) fn device_error(dev: &DeviceCtx, label: impl FnOnce() -> Arc<str>) -> Option<Failure> {
    dev.stream.take_error().map(|m| Failure {
        instruction: label(),
        message: m.into(),
        panicked: false,
    })
}

/// Queues `landed` on `instr`'s stream after everything its launch queued (a staged
/// write's copy back included): it is told the stream's pending device error (which
/// becomes the stream's sticky failure and poisons `outputs`, as a failed copy back left
/// them stale) or an output's poison. If the device refuses the closure, `landed` is told
/// that, and so is the instruction.
pub(super) fn queue_landed(
    instr: &Instruction,
    outputs: &Operands,
    landed: Landed,
) -> Result<(), Failure> {
    let st = instr.stream.clone();
    let outs = outputs.clone();
    let label: Arc<str> = instr.label().into();
    let slot = Arc::new(std::sync::Mutex::new(Some(landed)));
    let s2 = slot.clone();
    let host: HostFn = Box::new(move || {
        let outs = outs.as_slice();
        let f = match device_error(&st.dev, || label) {
            Some(f) => {
                st.dev.sticky.set(&f);
                poison_all(outs, &f);
                Some(f)
            }
            None => first_poison(outs),
        };
        if let Some(landed) = crate::util::lock(&s2).take() {
            landed(f);
        }
    });
    if let Err(e) = instr.stream.dev.stream.launch_host(host) {
        let f = failure(instr, e.to_string());
        if let Some(landed) = crate::util::lock(&slot).take() {
            landed(Some(f.clone()));
        }
        return Err(f);
    }
    Ok(())
}

/// Marks `instr` done now (Release), with `failure` if any; finishes its waiter if
/// `finish_waiter`.
pub(super) fn done_now(instr: &Instruction, failure: Option<Failure>, finish_waiter: bool) {
    if let Some(f) = &failure {
        // SAFETY: still the executor (before DONE); no other borrow of the body is alive.
        let body = unsafe { instr.body() };
        poison_in_stream_order(instr, body.outputs.as_slice(), f);
    }
    // SAFETY: the executor owns `failure` until DONE (and the waiter until `finished`).
    unsafe { finish(instr, failure, finish_waiter) };
}

/// Poisons the outputs of `instr`, whose launch on an asynchronous device failed.
///
/// Work launched before this instruction may still be queued on the device — an earlier
/// reader of these outputs, done at launch — and must not see a later instruction's
/// failure. Such work checks its operands for poison when the device reaches it: a
/// queued device's kernel bodies (`KernelMode::Queued`, the sim), and on every
/// asynchronous device the sync callbacks, copies' poison carriers and a launcher
/// kernel's host work ([`KernelCtx::on_host`](crate::KernelCtx::on_host)).
///
/// On a queued device the poison is queued on the stream, behind that work, as a
/// kernel's own failure on the device would be. (Soft sync has put a device-side wait on
/// this stream ahead of it for earlier work of other streams of the device.) Later work
/// of this stream meets the poison in stream order. When the device refuses the poison
/// too (and on streams done when their device work is), the worker drains the stream
/// first ([`drain`]), then poisons, before the instruction is done and anything after it
/// launches.
///
/// On a launcher device the worker always drains first: there, later instructions check
/// their operands when the worker launches them (a kernel's body, a custom instruction's
/// policy, which must not enqueue device work over a failed producer's output), so the
/// poison must be in place when this one is done, and not before the earlier work ran.
/// A failed launch is rare; the drain is bounded by the timeout period.
pub(super) fn poison_in_stream_order(instr: &Instruction, outputs: &[Arc<Blob>], f: &Failure) {
    let dev = &instr.stream.dev;
    if !outputs.is_empty() {
        if dev.mode == KernelMode::Launcher {
            drain(instr);
            return poison_all(outputs, f);
        }
        if instr.stream.policy.done_at_launch() {
            let mut outs = Operands::default();
            for b in outputs {
                outs.push(b.clone());
            }
            let f2 = f.clone();
            let queued = dev
                .stream
                .launch_host(Box::new(move || poison_all(outs.as_slice(), &f2)));
            if queued.is_ok() {
                return;
            }
        }
        drain(instr);
    }
    poison_all(outputs, f);
}

/// Waits until the device stream of `instr` (a failed launch) has run what was queued on
/// it so far, at most the VM's timeout period (a device that neither takes work nor
/// finishes it gets what follows late, never a hung worker). When it gives up, it leaves
/// the stuck work for diagnostics (`device/given_up.rs`) before `instr` is done.
pub(super) fn drain(instr: &Instruction) {
    let dev = &instr.stream.dev;
    let deadline = crate::util::deadline_after(dev.drain_bound);
    if let Ok(stuck) = crate::device::wait_streams(&[&*dev.stream], deadline) {
        for (_, event) in stuck {
            dev.given_up
                .record(instr.stream.id, instr.label().to_string(), event);
        }
    }
}

/// The completion callback of an event-completed instruction (adapter thread, or inline).
pub(super) fn complete(instr: &Arc<Instruction>, data: bool) {
    let dev = &instr.stream.dev;
    let failure = {
        // SAFETY: the launch's borrow ended before this callback was registered; until
        // DONE below this callback is the body's only owner (ownership step 3).
        let body = unsafe { instr.body() };
        let failure = if data {
            observe(dev, || instr.label()).or_else(|| {
                first_poison(body.inputs.as_slice().iter().chain(body.outputs.as_slice()))
            })
        } else {
            None
        };
        if let Some(f) = &failure {
            poison_all(body.outputs.as_slice(), f);
        }
        failure
    };
    // SAFETY: this callback owns `failure` until DONE (as above).
    unsafe { finish(instr, failure, true) };
    // After DONE: the scheduler (or a single-thread caller) may release it now.
    dev.wake.unpark();
}

/// The host closure queued after a done-at-launch instruction that a caller waits for:
/// copies a small read out of the pinned buffer, reports the stream's sticky failure or a
/// poisoned operand, and releases the caller. A failure poisons the instruction's
/// `outputs` too (a write whose completion reports a device error is not to be trusted),
/// in stream order, so before any later reader of them on the device.
pub(super) fn finisher(instr: Arc<Instruction>, operands: Operands, outputs: Operands) -> HostFn {
    Box::new(move || {
        let dev = &instr.stream.dev;
        let failure = observe(dev, || instr.label()).or_else(|| first_poison(operands.as_slice()));
        if let Some(f) = failure {
            poison_all(outputs.as_slice(), &f);
            // SAFETY: this finisher owns `small` and `failure` from the launch until the
            // waiter's `finished` below (module docs); nobody else touches them meanwhile.
            instr.failure.with_mut(|p| unsafe { *p = Some(f) });
            // Relaxed: diagnostic bit; the waiter reads `failure` after its Acquire.
            instr.status.fetch_or(status::FAILED, Ordering::Relaxed);
        }
        if let Some(w) = &instr.waiter {
            // Release inside: publishes `small` and `failure` to the waiting caller.
            w.finished();
        }
        if dev.single_thread {
            dev.wake.unpark();
        }
    })
}
