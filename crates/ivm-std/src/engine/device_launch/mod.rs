//! Launching instructions on asynchronous device streams (the third way of [`super::execute`]).
//!
//! The stream policies of asynchronous devices, written against the adapter traits of
//! [`crate::device`]: how a worker launches an instruction on a device stream, and how its
//! completion is observed.
//!
//! * A *data* instruction (kernel, callback, copy, small access, release) launches its work
//!   on the device stream. On a stream whose policy is done at launch (compute) it is done
//!   as soon as the launch returns: the device queue orders it. Otherwise (host-to-device,
//!   device-to-host) an event is recorded after its work and the instruction is done when
//!   the event completes: the event's [`on_complete`](crate::Event::on_complete) callback
//!   sets `DONE` (Release) and unparks the scheduler, which never polls.
//! * A caller waiting on an instruction (sync access) is released by a host closure queued
//!   after the instruction's work (stream order), or by the completion callback.
//! * Soft-sync record events are done at launch, except a host-observed record, done when
//!   its event completes; device-side waits (stream wait, wait event) complete as the
//!   stream's policy says (at launch on compute streams, by event on copy streams).
//! * A launch that fails (the device refused the work, or a sticky failure) poisons the
//!   instruction's outputs in stream order on a queued device (`poison_in_stream_order`),
//!   never ahead of earlier work still queued there.
//! * Sticky failures: a queued kernel that fails sets its stream's sticky failure and
//!   poisons its outputs; every data instruction launched (or reached on the device) on
//!   that stream afterwards poisons its outputs with it, until a host-observed completion
//!   (a sync access, a copy-stream completion) takes it and reports it.
//!
//! Ownership of an instruction's cells on these paths: the launching worker owns `body`
//! until it sets `DONE` or registers the completion callback (its borrow ends first); the
//! callback then owns `body` and `failure` until it sets `DONE`. For a done-at-launch
//! instruction with a waiter, the queued finisher owns `small` and `failure` from the
//! launch until the waiter's `decrease` (the engine never touches them; the ring reuses the
//! instruction only when it holds the sole reference, after the finisher dropped its own).

mod completion;
mod queued;

use std::sync::Arc;

use ivm_core::sync::Ordering;

use self::completion::{complete, device_error, done_now, drain, finisher, queue_landed};
use self::queued::{Queued, queue, stage};
use crate::device::{DeviceMemory, DeviceStream, Event, HostFn, KernelMode};
use crate::engine::execute::{first_poison, poison_all};
use crate::model::blob::Blob;
use crate::model::instruction::{Completion, Instruction, KernelCtx, Kind, Operands, status};
use crate::util::error::Failure;
use crate::util::panics::catch;

/// How a launched instruction completes.
enum Outcome {
    /// Done now (its work is ordered by the device queue, or there was none).
    AtLaunch,
    /// Done when this event completes.
    OnEvent(Arc<dyn Event>),
}

fn failure(instr: &Instruction, message: impl Into<Arc<str>>) -> Failure {
    Failure {
        instruction: instr.label().into(),
        message: message.into(),
        panicked: false,
    }
}

/// Launches `instr` (dispatched to a stream of an asynchronous device) on the calling
/// thread: the stream's worker, or the engine's owner in single-thread mode.
pub(super) fn launch(instr: &Arc<Instruction>) {
    // Relaxed: LAUNCHED is diagnostic only.
    instr.status.fetch_or(status::LAUNCHED, Ordering::Relaxed);
    if let Some(w) = &instr.waiter {
        w.started();
    }
    let dev = &instr.stream.dev;
    let (outcome, data, operands, outputs) = {
        // SAFETY: the executor owns the body until DONE (ownership step 3). This borrow
        // ends before `DONE` is set or a completion callback (the next owner) registered.
        let body = unsafe { instr.body_mut() };
        let kind = std::mem::replace(&mut body.kind, Kind::Noop);
        let data = !kind.is_sync_op() && !matches!(kind, Kind::Noop | Kind::Free);
        let (mut operands, mut outputs) = (Operands::default(), Operands::default());
        if instr.waiter.is_some() {
            for b in body.inputs.as_slice().iter().chain(body.outputs.as_slice()) {
                operands.push(b.clone());
            }
            for b in body.outputs.as_slice() {
                outputs.push(b.clone());
            }
        }
        let landed = body.landed.take();
        let mut outcome = launch_kind(instr, kind, &body.inputs, &body.outputs);
        if let Some(landed) = landed {
            match &outcome {
                Ok(_) => {
                    if let Err(f) = queue_landed(instr, &body.outputs, landed) {
                        outcome = Err(f);
                    }
                }
                Err(f) => landed(Some(f.clone())),
            }
        }
        (outcome, data, operands, outputs)
    };
    match outcome {
        Ok(Outcome::AtLaunch) => {
            if instr.waiter.is_some() {
                // The caller learns the result once the device reached this point.
                let fin = finisher(instr.clone(), operands, outputs);
                if let Err(e) = dev.stream.launch_host(fin) {
                    return done_now(instr, Some(failure(instr, e.to_string())), true);
                }
                return done_now(instr, None, false);
            }
            done_now(instr, None, true);
        }
        Ok(Outcome::OnEvent(ev)) => {
            let i = instr.clone();
            ev.on_complete(Box::new(move || complete(&i, data)));
        }
        Err(f) => done_now(instr, Some(f), true),
    }
}

fn launch_kind(
    instr: &Arc<Instruction>,
    kind: Kind,
    inputs: &Operands,
    outputs: &Operands,
) -> Result<Outcome, Failure> {
    let st = &instr.stream;
    let dev = &st.dev;
    let data = matches!(
        kind,
        Kind::Kernel(_)
            | Kind::Read(_)
            | Kind::Write(_)
            | Kind::SmallRead { .. }
            | Kind::SmallWrite { .. }
            | Kind::Copy { .. }
    );
    if data {
        // A pending sticky failure poisons what is launched now; an instruction whose
        // completion the host observes reports it (and clears it).
        let host_observed = instr.waiter.is_some() || !st.policy.done_at_launch();
        let f = if host_observed {
            dev.sticky.take()
        } else {
            dev.sticky.get()
        };
        if let Some(f) = f {
            return Err(f);
        }
    }
    match kind {
        Kind::Noop => {}
        Kind::Barrier(f) => f(),
        k @ (Kind::Kernel(_) | Kind::Read(_) | Kind::Write(_)) => {
            launch_work(instr, k, inputs, outputs)?;
        }
        k @ (Kind::SmallRead { .. } | Kind::SmallWrite { .. }) => {
            launch_small(instr, k, inputs, outputs)?;
        }
        k @ (Kind::Copy { .. } | Kind::Free) => launch_memory(instr, k, inputs, outputs)?,
        k @ (Kind::StreamWait { .. } | Kind::RecordEvent { .. } | Kind::WaitEvent { .. }) => {
            return launch_sync(instr, k);
        }
    }
    by_policy(instr)
}

/// How work launched on `instr`'s stream completes, as the stream's policy says: at launch,
/// or when an event recorded after it completes.
fn by_policy(instr: &Instruction) -> Result<Outcome, Failure> {
    let st = &instr.stream;
    if st.policy.done_at_launch() {
        Ok(Outcome::AtLaunch)
    } else {
        let stream: &dyn DeviceStream = &*st.dev.stream;
        Ok(Outcome::OnEvent(
            stream
                .record_event()
                .map_err(|e| failure(instr, e.to_string()))?,
        ))
    }
}

/// Data work that runs user code: a kernel (run here on a launcher device, queued in
/// stream order otherwise) or a read or write callback (queued, through host staging
/// where the memory is device-only).
fn launch_work(
    instr: &Arc<Instruction>,
    kind: Kind,
    inputs: &Operands,
    outputs: &Operands,
) -> Result<(), Failure> {
    let dev = &instr.stream.dev;
    let stream: &dyn DeviceStream = &*dev.stream;
    let err = |e: crate::Error| failure(instr, e.to_string());
    match kind {
        Kind::Kernel(f) if dev.mode == KernelMode::Launcher => {
            let ins = inputs.as_slice();
            let outs = outputs.as_slice();
            if let Some(p) = first_poison(ins.iter().chain(outs)) {
                return Err(p);
            }
            let mut ctx = KernelCtx {
                inputs: ins,
                outputs: outs,
                stream: Some(stream),
                launcher: Some(&**instr),
            };
            if let Err(message) = catch(|| f.call(&mut ctx)) {
                return Err(Failure {
                    instruction: instr.label().into(),
                    message: message.into(),
                    panicked: true,
                });
            }
        }
        Kind::Kernel(f) => queue(instr, inputs, outputs, Queued::Kernel(f)).map_err(err)?,
        Kind::Read(f) => {
            let staging = stage(stream, &inputs.as_slice()[0].mem).map_err(err)?;
            queue(instr, inputs, outputs, Queued::Read(f, staging)).map_err(err)?;
        }
        Kind::Write(f) => {
            let dst = &outputs.as_slice()[0].mem;
            let staging = stage(stream, dst).map_err(err)?;
            queue(instr, inputs, outputs, Queued::Write(f, staging.clone())).map_err(err)?;
            if let Some(host) = staging {
                // SAFETY: stream order: the callback queued above is done with the staging
                // copy before this copy starts; the engine gives this instruction the
                // tensor exclusively. A refused or failed callback leaves the staging copy
                // as the device's bytes (or the output poisoned).
                unsafe { stream.copy(&host, 0, dst, 0, host.nbytes()) }.map_err(err)?;
            }
        }
        _ => unreachable!("ivm: launch_work is given kernels, reads and writes"),
    }
    Ok(())
}

/// A small access: a copy between the tensor and the stream's pinned buffer, and a host
/// closure in stream order between the pinned buffer and the instruction's `small`.
fn launch_small(
    instr: &Arc<Instruction>,
    kind: Kind,
    inputs: &Operands,
    outputs: &Operands,
) -> Result<(), Failure> {
    let stream: &dyn DeviceStream = &*instr.stream.dev.stream;
    let err = |e: crate::Error| failure(instr, e.to_string());
    match kind {
        Kind::SmallRead { offset, len } => {
            let src = &inputs.as_slice()[0].mem;
            let pinned = stream.pinned_buffer().clone();
            // SAFETY: the engine orders this read after the tensor's last writer (and soft
            // sync after its device work); the pinned buffer is touched only in this
            // stream's order (the finisher below reads it).
            unsafe { stream.copy(src, offset, &pinned, 0, len) }.map_err(err)?;
            let i = instr.clone();
            stream
                .launch_host(Box::new(move || {
                    let p = pinned_bytes(&pinned);
                    // SAFETY: stream order: the copy above completed and nothing else
                    // touches the pinned buffer now; the finisher owns `small`.
                    i.small.with_mut(|s| unsafe {
                        std::ptr::copy_nonoverlapping(p, (*s).as_mut_ptr(), len)
                    });
                }))
                .map_err(err)?;
        }
        Kind::SmallWrite { offset, len } => {
            let dst = &outputs.as_slice()[0].mem;
            let pinned = stream.pinned_buffer().clone();
            let (i, p2) = (instr.clone(), pinned.clone());
            stream
                .launch_host(Box::new(move || {
                    let p = pinned_bytes(&p2);
                    // SAFETY: stream order: nothing else touches the pinned buffer now;
                    // `small` was filled by the caller before the instruction was received
                    // and nobody writes it meanwhile.
                    i.small
                        .with(|s| unsafe { std::ptr::copy_nonoverlapping((*s).as_ptr(), p, len) });
                }))
                .map_err(err)?;
            // SAFETY: the engine orders this write after every earlier access of the
            // tensor (and soft sync after their device work); pinned buffer: stream order.
            unsafe { stream.copy(&pinned, 0, dst, offset, len) }.map_err(err)?;
        }
        _ => unreachable!("ivm: launch_small is given small reads and writes"),
    }
    Ok(())
}

/// Memory work without user code: a copy between two tensors, or a tensor's release.
fn launch_memory(
    instr: &Arc<Instruction>,
    kind: Kind,
    inputs: &Operands,
    outputs: &Operands,
) -> Result<(), Failure> {
    let st = &instr.stream;
    let dev = &st.dev;
    let stream: &dyn DeviceStream = &*dev.stream;
    let err = |e: crate::Error| failure(instr, e.to_string());
    match kind {
        Kind::Copy {
            src_offset,
            dst_offset,
            len,
        } => {
            let src = &inputs.as_slice()[0];
            let dst = &outputs.as_slice()[0];
            // SAFETY: the engine orders this copy after the source's last writer and after
            // every earlier access of the destination (soft sync: after their device work).
            unsafe { stream.copy(&src.mem, src_offset, &dst.mem, dst_offset, len) }.map_err(err)?;
            if st.policy.done_at_launch() {
                // Nobody observes this copy's completion: carry poison in stream order,
                // and report a device error pending after it (the copy failed, leaving
                // the destination stale) by poisoning the destination: its readers fail,
                // naming this copy.
                let (s2, d2, st2) = (src.clone(), dst.clone(), st.clone());
                let label: Arc<str> = instr.label().into();
                stream
                    .launch_host(Box::new(move || {
                        if let Some(f) = device_error(&st2.dev, || label)
                            .or_else(|| st2.dev.sticky.get())
                            .or_else(|| first_poison([&s2]))
                        {
                            d2.set_poison(&f);
                        }
                    }))
                    .map_err(err)?;
            }
        }
        Kind::Free => {
            if let Some(b) = outputs.as_slice().first() {
                dev.allocator.free_on(&b.mem, stream).map_err(err)?;
            }
        }
        _ => unreachable!("ivm: launch_memory is given copies and frees"),
    }
    Ok(())
}

/// Soft sync's device-side waits and events.
///
/// Device-side waits complete like the stream's other work: at launch on a compute
/// stream, when an event recorded after them completes on a copy stream. They write the
/// tensors they order, so a host-side reader whose last writer is such a wait must not
/// start before the waited-for work (e.g. a compute-stream copy into a cpu tensor, then
/// read on a copy stream, then by a cpu kernel).
fn launch_sync(instr: &Arc<Instruction>, kind: Kind) -> Result<Outcome, Failure> {
    let stream: &dyn DeviceStream = &*instr.stream.dev.stream;
    let err = |e: crate::Error| failure(instr, e.to_string());
    match kind {
        Kind::StreamWait { from } => {
            let ev = from.dev.stream.record_event().map_err(err)?;
            stream.wait_event(&*ev).map_err(err)?;
        }
        Kind::RecordEvent { slot } => {
            let ev = stream.record_event().map_err(err)?;
            return Ok(match slot {
                Some(slot) => {
                    let _ = slot.set(ev);
                    Outcome::AtLaunch
                }
                None => Outcome::OnEvent(ev),
            });
        }
        Kind::WaitEvent { slot } => {
            let ev = slot
                .get()
                .ok_or_else(|| failure(instr, "soft sync: no event was recorded to wait for"))?;
            stream.wait_event(&**ev).map_err(err)?;
        }
        _ => unreachable!("ivm: launch_sync is given soft sync's waits and events"),
    }
    by_policy(instr)
}

/// Waits (bounded by the timeout period) until the work queued so far on the device
/// stream of `instr`, a custom instruction whose policy runs on a launcher device's
/// worker, has run, before its failure known on the worker poisons its outputs: earlier
/// readers of them still queued there check for poison when the device reaches them
/// (see `poison_in_stream_order`).
pub(crate) fn drain_before_failing(instr: &Instruction) {
    drain(instr);
}

/// A kernel running on a launcher device's worker enqueues host work
/// ([`KernelCtx::on_host`]) on its instruction's device stream: it runs in stream order
/// with the checks and failure handling of a queued device's kernel body.
impl crate::model::kernel::HostEnqueue for Instruction {
    fn enqueue_host(
        &self,
        inputs: &[Arc<Blob>],
        outputs: &[Arc<Blob>],
        f: crate::model::kernel::KernelFn,
    ) -> crate::Result<()> {
        let (mut ins, mut outs) = (Operands::default(), Operands::default());
        for b in inputs {
            ins.push(b.clone());
        }
        for b in outputs {
            outs.push(b.clone());
        }
        queue(self, &ins, &outs, Queued::Kernel(f))
    }
}

fn pinned_bytes(pinned: &Arc<dyn DeviceMemory>) -> *mut u8 {
    pinned
        .host_ptr()
        .expect("ivm: a stream's pinned buffer must be host memory")
        .as_ptr()
}

/// Launches `instr`'s deferred body (a custom instruction's) on an asynchronous device, if
/// it has one: on a launcher device on this thread (the body enqueues its device work on
/// the stream); on a queued device in the device's stream order, as a host closure on the
/// device's thread (the body sees the operands' bytes after every earlier work item of
/// the stream). Returns whether it had one; the instruction is then completed by whoever
/// holds its [`Completion`] — or failed here, naming the device's refusal, when the device
/// does not take the closure.
pub(super) fn launch_deferred(instr: &Arc<Instruction>) -> bool {
    let run = {
        // SAFETY: the executor owns the body until DONE (ownership step 3); this borrow
        // ends before the completion exists.
        let body = unsafe { instr.body_mut() };
        match body.deferred.take() {
            Some(d) => d.run,
            None => return false,
        }
    };
    // Relaxed: LAUNCHED is diagnostic only.
    instr.status.fetch_or(status::LAUNCHED, Ordering::Relaxed);
    let c = Completion {
        instr: Some(instr.clone()),
    };
    let dev = &instr.stream.dev;
    if dev.mode != KernelMode::Queued {
        // A panic drops the completion during unwinding, which fails the instruction.
        let _ = catch(move || run(c, true));
        return true;
    }
    // The closure and the completion go to the device together; if the device refuses
    // the closure, the completion comes back out of the shared slot to fail the
    // instruction with the device's answer (the policy drops unrun).
    let slot = Arc::new(std::sync::Mutex::new(Some((run, c))));
    let queued = slot.clone();
    let host: HostFn = Box::new(move || {
        let taken = crate::util::lock(&queued).take();
        if let Some((run, c)) = taken {
            let _ = catch(move || run(c, true));
        }
    });
    if let Err(e) = dev.stream.launch_host(host) {
        let taken = crate::util::lock(&slot).take();
        if let Some((run, c)) = taken {
            drop(run);
            // Its failure poisons its outputs: not ahead of earlier work still queued on
            // the device (as `poison_in_stream_order`, whose queueing the device would
            // refuse as well).
            drain(instr);
            c.complete(Err(failure(instr, e.to_string())));
        }
    }
    true
}
