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

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use ivm_core::sync::Ordering;

use super::execute::{first_poison, panic_message};
use crate::device::{DeviceMemory, DeviceStream, Event, HostFn, KernelMode};
use crate::model::blob::Blob;
use crate::model::instruction::{
    Completion, Instruction, KernelCtx, KernelFn, Kind, Landed, Operands, ReadFn, WriteFn, status,
};
use crate::model::stream::{DeviceCtx, StreamShared};
use crate::util::error::Failure;

/// How a launched instruction completes.
enum Outcome {
    /// Done now (its work is ordered by the device queue, or there was none).
    AtLaunch,
    /// Done when this event completes.
    OnEvent(Arc<dyn Event>),
}

/// Work that runs inside the device queue (kernel bodies on a queued device, callbacks).
/// A callback on device-only memory gets the bytes of its host staging copy
/// ([`stage`]) instead of the operand's.
enum Queued {
    Kernel(KernelFn),
    Read(ReadFn, Option<Arc<dyn DeviceMemory>>),
    Write(WriteFn, Option<Arc<dyn DeviceMemory>>),
}

/// A host staging copy of `mem` for a sync callback on device-only memory (ARCHITECTURE.md,
/// "Device-only memory through the doors"): zeroed host memory of the same size, filled
/// from `mem` by a copy enqueued on `stream` now, so that the callback queued after it
/// sees the device's bytes in stream order. `None` for host-accessible memory.
fn stage(
    stream: &dyn DeviceStream,
    mem: &Arc<dyn DeviceMemory>,
) -> crate::Result<Option<Arc<dyn DeviceMemory>>> {
    if mem.host_ptr().is_some() || mem.nbytes() == 0 {
        return Ok(None);
    }
    let host: Arc<dyn DeviceMemory> = Arc::new(crate::HostMemory::try_zeroed(mem.nbytes())?);
    // SAFETY: the engine orders this instruction after the tensor's last writer (soft
    // sync: after its device work) and before its next access; the staging memory is
    // new, and touched only by work this instruction enqueues, in stream order.
    unsafe { stream.copy(mem, 0, &host, 0, mem.nbytes()) }?;
    Ok(Some(host))
}

/// The bytes of a staging copy.
///
/// # Safety
/// Nothing else accesses `staging` while the returned slice lives (stream order: the copy
/// that fills it completed, the copy that empties it has not started).
#[allow(clippy::mut_from_ref)]
unsafe fn staged_bytes(staging: &Arc<dyn DeviceMemory>) -> &mut [u8] {
    let p = staging
        .host_ptr()
        .expect("ivm: a staging buffer is host memory");
    // SAFETY: `host_ptr` is valid for `nbytes` bytes (the `DeviceMemory` contract); the
    // caller guarantees exclusive access.
    unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), staging.nbytes()) }
}

fn failure(instr: &Instruction, message: impl Into<Arc<str>>) -> Failure {
    Failure {
        instruction: instr.label().into(),
        message: message.into(),
        panicked: false,
    }
}

fn poison_all(outputs: &[Arc<Blob>], f: &Failure) {
    for b in outputs {
        b.set_poison(f);
    }
}

/// What a host-observed completion on `dev` reports: the stream's sticky failure (taken,
/// so it is reported once) or an error the device reported.
fn observe(dev: &DeviceCtx, instr_label: impl FnOnce() -> String) -> Option<Failure> {
    if let Some(f) = dev.sticky.take() {
        return Some(f);
    }
    device_error(dev, || instr_label().into())
}

/// The error the device reported on `dev`'s stream since it was last taken (taken now), as
/// a failure of the instruction `label` names.
fn device_error(dev: &DeviceCtx, label: impl FnOnce() -> Arc<str>) -> Option<Failure> {
    dev.stream.take_error().map(|m| Failure {
        instruction: label(),
        message: m.into(),
        panicked: false,
    })
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

/// Queues `landed` on `instr`'s stream after everything its launch queued (a staged
/// write's copy back included): it is told the stream's pending device error (which
/// becomes the stream's sticky failure and poisons `outputs`, as a failed copy back left
/// them stale) or an output's poison. If the device refuses the closure, `landed` is told
/// that, and so is the instruction.
fn queue_landed(instr: &Instruction, outputs: &Operands, landed: Landed) -> Result<(), Failure> {
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
fn done_now(instr: &Instruction, failure: Option<Failure>, finish_waiter: bool) {
    let mut bits = status::DONE;
    if let Some(f) = failure {
        // SAFETY: still the executor (before DONE); no other borrow of the body is alive.
        let body = unsafe { instr.body() };
        poison_in_stream_order(instr, body.outputs.as_slice(), &f);
        // SAFETY: the executor owns `failure` until DONE (and the waiter until `finished`).
        instr.failure.with_mut(|p| unsafe { *p = Some(f) });
        bits |= status::FAILED;
    }
    // Release: publishes the launch's effects (poison, `failure`) to the engine's Acquire.
    instr.status.fetch_or(bits, Ordering::Release);
    if finish_waiter && let Some(w) = &instr.waiter {
        // Release inside: publishes the same to the waiting caller.
        w.finished();
    }
}

/// Poisons the outputs of `instr`, whose launch on an asynchronous device failed.
///
/// On a device whose kernels run in its queue (`KernelMode::Queued`, the sim), a body
/// checks its operands for poison when the device reaches it. Work launched before this
/// instruction may still be queued there — an earlier reader of these outputs, done at
/// launch — and must not see a later instruction's failure: so the poison is queued on
/// the stream, behind that work, as a kernel's own failure on the device would be. (Soft
/// sync has put a device-side wait on this stream ahead of it for earlier work of other
/// streams of the device.) Later work of this stream meets the poison in stream order.
/// When the device refuses the poison too (and on streams done when their device work
/// is), the worker drains the stream first ([`drain`]), then poisons, before the
/// instruction is done and anything after it launches. On devices whose kernels check
/// their operands at launch (`Launcher`: earlier readers checked theirs when they were
/// launched), the outputs are poisoned now.
fn poison_in_stream_order(instr: &Instruction, outputs: &[Arc<Blob>], f: &Failure) {
    let dev = &instr.stream.dev;
    if dev.mode == KernelMode::Queued && !outputs.is_empty() {
        // Only where done means launched (compute streams): a stream whose instructions
        // are done when their device work is (copy streams) promises its readers that
        // nothing of it is left on the device once it is done — no soft sync orders them
        // after it — so its poison must be in place when it is done: drain first.
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
        drain(dev);
    }
    poison_all(outputs, f);
}

/// Waits until `dev`'s stream has run what was queued on it so far, at most the VM's
/// timeout period (a device that neither takes work nor finishes it gets what follows
/// late, never a hung worker).
fn drain(dev: &DeviceCtx) {
    let deadline = std::time::Instant::now() + dev.drain_bound;
    let _ = crate::device::wait_streams(&[&*dev.stream], deadline);
}

/// The completion callback of an event-completed instruction (adapter thread, or inline).
fn complete(instr: &Arc<Instruction>, data: bool) {
    let dev = &instr.stream.dev;
    let mut bits = status::DONE;
    {
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
        if let Some(f) = failure {
            poison_all(body.outputs.as_slice(), &f);
            // SAFETY: this callback owns `failure` until DONE.
            instr.failure.with_mut(|p| unsafe { *p = Some(f) });
            bits |= status::FAILED;
        }
    }
    // Release: publishes the device work's completion (and poison, `failure`) to the
    // engine's Acquire read of DONE, hence to every instruction ordered after this one.
    instr.status.fetch_or(bits, Ordering::Release);
    if let Some(w) = &instr.waiter {
        w.finished();
    }
    // After DONE: the scheduler (or a single-thread caller) may release it now.
    dev.wake.unpark();
}

/// The host closure queued after a done-at-launch instruction that a caller waits for:
/// copies a small read out of the pinned buffer, reports the stream's sticky failure or a
/// poisoned operand, and releases the caller. A failure poisons the instruction's
/// `outputs` too (a write whose completion reports a device error is not to be trusted),
/// in stream order, so before any later reader of them on the device.
fn finisher(instr: Arc<Instruction>, operands: Operands, outputs: Operands) -> HostFn {
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

fn launch_kind(
    instr: &Arc<Instruction>,
    kind: Kind,
    inputs: &Operands,
    outputs: &Operands,
) -> Result<Outcome, Failure> {
    let st = &instr.stream;
    let dev = &st.dev;
    let stream: &dyn DeviceStream = &*dev.stream;
    let err = |e: crate::Error| failure(instr, e.to_string());
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
            };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f.call(&mut ctx))) {
                let message = panic_message(&*payload);
                let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
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
        // Device-side waits complete like the stream's other work: at launch on a compute
        // stream, when an event recorded after them completes on a copy stream. They write
        // the tensors they order, so a host-side reader whose last writer is such a wait
        // must not start before the waited-for work (e.g. a compute-stream copy into a cpu
        // tensor, then read on a copy stream, then by a cpu kernel).
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
    }
    if st.policy.done_at_launch() {
        Ok(Outcome::AtLaunch)
    } else {
        Ok(Outcome::OnEvent(stream.record_event().map_err(err)?))
    }
}

fn pinned_bytes(pinned: &Arc<dyn DeviceMemory>) -> *mut u8 {
    pinned
        .host_ptr()
        .expect("ivm: a stream's pinned buffer must be host memory")
        .as_ptr()
}

/// Queues `work` on `instr`'s device stream. It runs in stream order: refuses to run
/// (poisoning its outputs) after a sticky failure of the stream or on poisoned operands,
/// brackets its memory accesses with `begin_access`/`end_access`, and on a panic sets the
/// stream's sticky failure and poisons its outputs.
fn queue(
    instr: &Instruction,
    inputs: &Operands,
    outputs: &Operands,
    work: Queued,
) -> crate::Result<()> {
    let st: Arc<StreamShared> = instr.stream.clone();
    let (name, id) = (instr.name, instr.id);
    let (ins, outs) = (inputs.clone(), outputs.clone());
    let f: HostFn = Box::new(move || {
        let (ins, outs) = (ins.as_slice(), outs.as_slice());
        let fail = |message: String, panicked: bool| Failure {
            instruction: format!("{name}#{id}").into(),
            message: message.into(),
            panicked,
        };
        if let Some(f) = st
            .dev
            .sticky
            .get()
            .or_else(|| first_poison(ins.iter().chain(outs)))
        {
            poison_all(outs, &f);
            return;
        }
        if matches!(work, Queued::Read(_, Some(_)) | Queued::Write(_, Some(_)))
            && let Some(f) = device_error(&st.dev, || format!("{name}#{id}").into())
        {
            // A staged callback must not run on a staging copy that a failed copy-in left
            // zeroed (a write would then copy those zeros back to the device). The error
            // becomes the stream's sticky failure, so that a host observer still gets it
            // once: the waiter's finisher, or the async completion of the callback dropped
            // here unrun (`completion::dropped_error`).
            st.dev.sticky.set(&f);
            poison_all(outs, &f);
            return;
        }
        let all: Vec<&Arc<Blob>> = ins.iter().chain(outs).collect();
        for (k, b) in all.iter().enumerate() {
            if let Err(e) = b.mem.begin_access() {
                for b in &all[..k] {
                    b.mem.end_access();
                }
                let f = fail(e.to_string(), false);
                st.dev.sticky.set(&f);
                poison_all(outs, &f);
                return;
            }
        }
        let r = catch_unwind(AssertUnwindSafe(|| match work {
            Queued::Kernel(k) => k.call(&mut KernelCtx {
                inputs: ins,
                outputs: outs,
                stream: None,
            }),
            // SAFETY: stream order: the staging copy was filled by the copy enqueued before
            // this closure and is emptied (if at all) by one enqueued after it.
            Queued::Read(cb, Some(h)) => cb.take()(unsafe { staged_bytes(&h) }),
            // SAFETY: as above.
            Queued::Write(cb, Some(h)) => cb.take()(unsafe { staged_bytes(&h) }),
            // SAFETY: stream order plus the engine order give this callback the input
            // (no concurrent writer); the builder always gives it its operand.
            Queued::Read(cb, None) => cb.take()(unsafe { ins[0].bytes() }),
            // SAFETY: as above, exclusive access to the output.
            Queued::Write(cb, None) => cb.take()(unsafe { outs[0].bytes_mut() }),
        }));
        for b in &all {
            b.mem.end_access();
        }
        if let Err(payload) = r {
            let message = panic_message(&*payload);
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            let f = fail(message, true);
            st.dev.sticky.set(&f);
            poison_all(outs, &f);
        }
    });
    instr.stream.dev.stream.launch_host(f)
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
        let _ = catch_unwind(AssertUnwindSafe(move || run(c, true)));
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
            let _ = catch_unwind(AssertUnwindSafe(move || run(c, true)));
        }
    });
    if let Err(e) = dev.stream.launch_host(host) {
        let taken = crate::util::lock(&slot).take();
        if let Some((run, c)) = taken {
            drop(run);
            // Its failure poisons its outputs: not ahead of earlier work still queued on
            // the device (as `poison_in_stream_order`, whose queueing the device would
            // refuse as well).
            drain(dev);
            c.complete(Err(failure(instr, e.to_string())));
        }
    }
    true
}
