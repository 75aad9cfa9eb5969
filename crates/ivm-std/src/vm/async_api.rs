//! The `_async` entry points of [`VirtualMachine`]: each submits its work at once and
//! returns a [`Completion`](crate::Completion) (the mechanism is in `completion.rs`).

use super::VirtualMachine;
use crate::device::check_range;
use crate::doors::builder::InstructionsBuilder;
use crate::doors::completion::{
    Completer, Completion, ReadSmallMem, async_target, barrier_completing, check_timeout,
    completer_for, submit_on, wait_deadline,
};
use crate::doors::sync_access::check_size;
use crate::model::instruction::Waiter;
use crate::model::instruction::{Instruction, Kind, ReadFn, WriteFn};
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

impl VirtualMachine {
    /// Reads `out.len()` (1, 2, 4, 8 or 16) bytes of `t` at `offset` without blocking:
    /// the returned future copies them into `out` when it resolves. See
    /// [`crate::doors::completion`].
    ///
    /// # Errors
    /// Returned by the future, never by this call: those of
    /// [`read_small`](Self::read_small) ([`Error::UnsupportedSize`] for a length other than
    /// 1, 2, 4, 8 or 16, [`Error::OutOfBounds`] for a range outside `t`, ...) and of
    /// [`Completion`](crate::Completion)'s waits.
    pub fn read_small_async<'a>(
        &self,
        t: &Tensor,
        offset: usize,
        out: &'a mut [u8],
    ) -> ReadSmallMem<'a> {
        let shared = self.shared_state();
        let len = out.len();
        let inner = match self.read_async(t, offset, len) {
            Ok(c) => c,
            Err(e) => Completion::ready(shared, Err(e)),
        };
        ReadSmallMem { inner, out }
    }

    fn read_async(&self, t: &Tensor, offset: usize, len: usize) -> Result<Completion<[u8; 16]>> {
        let shared = self.shared_state();
        check_size(len)?;
        let stream = async_target(shared, t)?;
        check_range(&*t.blob().mem, offset, len)?;
        let (c, slot) = Completion::new(shared);
        let c = c.on_stream(&stream);
        let done = completer_for(slot, t, &stream);
        let f = move |b: &[u8]| {
            let mut small = [0u8; 16];
            small[..len].copy_from_slice(&b[offset..offset + len]);
            done.complete(Ok(small));
        };
        let instr = Instruction::new(
            "read_small_async",
            stream.clone(),
            Kind::Read(ReadFn::new(Box::new(f))),
        );
        submit_on(shared, t, &stream, instr, false)?;
        Ok(c)
    }

    /// Writes `data` (1, 2, 4, 8 or 16 bytes, copied now) at `offset` of `t` without
    /// blocking; the completion resolves once the write is done. See
    /// [`crate::doors::completion`].
    ///
    /// # Errors
    /// As [`read_small_async`](Self::read_small_async).
    pub fn write_small_async(&self, t: &Tensor, offset: usize, data: &[u8]) -> Completion<()> {
        let shared = self.shared_state();
        let r = (|| {
            let len = data.len();
            check_size(len)?;
            let stream = async_target(shared, t)?;
            check_range(&*t.blob().mem, offset, len)?;
            let mut small = [0u8; 16];
            small[..len].copy_from_slice(data);
            let (c, slot) = Completion::new(shared);
            let c = c.on_stream(&stream);
            let done = completer_for(slot, t, &stream);
            let f = move |b: &mut [u8]| b[offset..offset + len].copy_from_slice(&small[..len]);
            let instr = Instruction::new(
                "write_small_async",
                stream.clone(),
                Kind::Write(WriteFn::new(Box::new(f))),
            );
            // Resolved once the bytes reached the tensor, not inside the callback: on
            // device-only memory the callback writes a host staging copy, and only the
            // copy back after it makes the write done (or failed).
            // SAFETY: not shared yet; we own the body (ownership step 1).
            unsafe { instr.body_mut() }.landed = Some(Box::new(move |failure| {
                done.complete(failure.map_or(Ok(()), |f| Err(f.poison_error())));
            }));
            submit_on(shared, t, &stream, instr, true)?;
            Ok(c)
        })();
        r.unwrap_or_else(|e| Completion::ready(shared, Err(e)))
    }

    /// Runs `f` on `t`'s bytes (after every earlier writer) on its device's default stream
    /// without blocking; the completion resolves to `f`'s result. A panic in `f` resolves
    /// to [`Error::KernelPanicked`]. See [`crate::doors::completion`].
    pub fn access_async<R: Send + 'static>(
        &self,
        t: &Tensor,
        f: impl FnOnce(&[u8]) -> R + Send + 'static,
    ) -> Completion<R> {
        let shared = self.shared_state();
        let r = (|| {
            let stream = async_target(shared, t)?;
            let (c, slot) = Completion::new(shared);
            let c = c.on_stream(&stream);
            let done = completer_for(slot, t, &stream);
            let cb = move |b: &[u8]| {
                let r = crate::util::panics::catch(|| f(b));
                done.complete(r.map_err(|message| Error::KernelPanicked {
                    instruction: "access_async".into(),
                    message,
                }));
            };
            let instr = Instruction::new(
                "access_async",
                stream.clone(),
                Kind::Read(ReadFn::routed(Box::new(cb), shared.core.drop_sink())),
            );
            submit_on(shared, t, &stream, instr, false)?;
            Ok(c)
        })();
        r.unwrap_or_else(|e| Completion::ready(shared, Err(e)))
    }

    /// A completion that resolves once every instruction received before this call has
    /// been released (an async [`sync`](Self::sync) without its device synchronisation:
    /// on asynchronous devices, compute instructions are released when launched).
    pub fn sync_async(&self) -> Completion<()> {
        let shared = self.shared_state();
        let r = (|| {
            shared.core.check_caller()?;
            let (c, slot) = Completion::new(shared);
            let instr = barrier_completing(shared, slot);
            shared.core.receive_one(Arc::new(instr), false)?;
            Ok(c)
        })();
        r.unwrap_or_else(|e| Completion::ready(shared, Err(e)))
    }

    /// [`run`](Self::run), plus a completion that resolves once the batch (and every
    /// instruction received before it) has been released.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub fn run_async<R>(
        &self,
        f: impl FnOnce(&mut InstructionsBuilder<'_>) -> Result<R>,
    ) -> Result<(R, Completion<()>)> {
        let shared = self.shared_state();
        let (c, slot) = Completion::new(shared);
        let r = self.run(|b| {
            let r = f(b)?;
            let done = Completer {
                slot,
                on_drop: Some(Box::new(|| Error::ShutDown)),
            };
            b.barrier(move || done.complete(Ok(())))?;
            Ok(r)
        })?;
        Ok((r, c))
    }

    /// [`read_small`](Self::read_small) that fails with the diagnostic
    /// [`Error::Timeout`] once `timeout` has passed (a hard deadline for this call, instead
    /// of the VM-wide progress period). See [`crate::doors::completion`].
    ///
    /// # Errors
    /// As [`read_small`](Self::read_small); a zero `timeout` is an
    /// [`Error::InvalidArgument`].
    pub fn read_small_timeout(
        &self,
        t: &Tensor,
        offset: usize,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<()> {
        self.small_timeout(t, offset, Some(out), None, timeout)
    }

    /// [`write_small`](Self::write_small) with a per-call timeout.
    ///
    /// # Errors
    /// As [`read_small_timeout`](Self::read_small_timeout).
    pub fn write_small_timeout(
        &self,
        t: &Tensor,
        offset: usize,
        data: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.small_timeout(t, offset, None, Some(data), timeout)
    }

    /// [`sync`](Self::sync) with a per-call timeout: a hard deadline for the release of
    /// everything received before it and the device synchronisation that follows.
    ///
    /// # Errors
    /// As [`sync`](Self::sync); [`Error::Timeout`] once `timeout` has passed; a zero
    /// `timeout` is an [`Error::InvalidArgument`].
    pub fn sync_timeout(&self, timeout: Duration) -> Result<()> {
        let shared = self.shared_state();
        shared.core.check_caller()?;
        check_timeout(timeout)?;
        let deadline = crate::util::deadline_after(timeout);
        let mut instr = Instruction::new("sync", shared.barrier_stream(), Kind::Noop);
        instr.barrier = true;
        instr.waiter = Some(Waiter::new());
        let instr = Arc::new(instr);
        shared.core.receive_one(instr.clone(), false)?;
        wait_deadline(shared, &instr, timeout, false)?;
        crate::vm::sync_devices(shared, deadline)
    }

    fn small_timeout(
        &self,
        t: &Tensor,
        offset: usize,
        read: Option<&mut [u8]>,
        write: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<()> {
        let shared = self.shared_state();
        shared.core.check_caller()?;
        check_timeout(timeout)?;
        let len = read
            .as_ref()
            .map_or_else(|| write.map_or(0, <[u8]>::len), |b| b.len());
        check_size(len)?;
        shared.check_tensor(t)?;
        check_range(&*t.blob().mem, offset, len)?;
        let stream = shared.default_stream_of(t.device())?;
        let (name, kind) = match write {
            None => ("read_small", Kind::SmallRead { offset, len }),
            Some(_) => ("write_small", Kind::SmallWrite { offset, len }),
        };
        let mut instr = Instruction::new(name, stream.clone(), kind);
        instr.waiter = Some(Waiter::new());
        if let Some(src) = write {
            // SAFETY: not shared yet: we own `small` (ownership step 1).
            instr
                .small
                .with_mut(|p| unsafe { (&mut *p)[..len].copy_from_slice(src) });
        }
        {
            // SAFETY: not shared yet; we own the body (ownership step 1).
            let body = unsafe { instr.body_mut() };
            if write.is_some() {
                body.outputs.push(t.blob().clone());
            } else {
                body.inputs.push(t.blob().clone());
            }
        }
        // A fresh instruction (never a ring entry): on a timeout it is simply abandoned and
        // a late executor writes only into its own buffer.
        let instr = Arc::new(instr);
        let mut list = Vec::with_capacity(1);
        shared.soft_sync([t], &stream, &mut |i| list.push(i));
        list.push(instr.clone());
        shared.core.receive_list(&mut list, true)?;
        wait_deadline(shared, &instr, timeout, true)?;
        crate::doors::sync_access::small_result(&instr, read)
    }
}
