//! Work that runs inside an asynchronous device's queue: kernel bodies on a queued device
//! and sync callbacks, with the checks a device-side body makes in stream order (sticky
//! failure, poisoned operands, access bracketing, panics), and the host staging copies of
//! callbacks on device-only memory.

use std::sync::Arc;

use super::completion::device_error;
use super::poison_all;
use crate::device::{DeviceMemory, DeviceStream, HostFn};
use crate::engine::execute::first_poison;
use crate::model::blob::Blob;
use crate::model::instruction::{Instruction, KernelCtx, KernelFn, Operands, ReadFn, WriteFn};
use crate::model::stream::StreamShared;
use crate::util::error::Failure;
use crate::util::panics::catch;

/// Work that runs inside the device queue (kernel bodies on a queued device, callbacks).
/// A callback on device-only memory gets the bytes of its host staging copy
/// ([`stage`]) instead of the operand's.
pub(super) enum Queued {
    Kernel(KernelFn),
    Read(ReadFn, Option<Arc<dyn DeviceMemory>>),
    Write(WriteFn, Option<Arc<dyn DeviceMemory>>),
}

/// A host staging copy of `mem` for a sync callback on device-only memory (ARCHITECTURE.md,
/// "Device-only memory through the doors"): zeroed host memory of the same size, filled
/// from `mem` by a copy enqueued on `stream` now, so that the callback queued after it
/// sees the device's bytes in stream order. `None` for host-accessible memory.
pub(super) fn stage(
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

/// Queues `work` on `instr`'s device stream. It runs in stream order: refuses to run
/// (poisoning its outputs) after a sticky failure of the stream or on poisoned operands,
/// brackets its memory accesses with `begin_access`/`end_access`, and on a panic sets the
/// stream's sticky failure and poisons its outputs.
pub(super) fn queue(
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
        let r = catch(|| match work {
            Queued::Kernel(k) => k.call(&mut KernelCtx {
                inputs: ins,
                outputs: outs,
                stream: None,
                launcher: None,
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
        });
        for b in &all {
            b.mem.end_access();
        }
        if let Err(message) = r {
            let f = fail(message, true);
            st.dev.sticky.set(&f);
            poison_all(outs, &f);
        }
    });
    instr.stream.dev.stream.launch_host(f)
}
