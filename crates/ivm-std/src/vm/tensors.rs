//! Creating a [`VirtualMachine`]'s tensors: their memory (through a stream's caching
//! allocator when it has one) and their initial bytes (a reused cache block is filled in
//! its stream's order).

use std::sync::Arc;

use ivm_core::sync::Ordering;

use super::VirtualMachine;
use crate::device::DeviceMemory;
use crate::device::cpu::HostMemory;
use crate::engine::core::{NEXT_BLOB_ID, inside};
use crate::model::blob::Blob;
use crate::model::instruction::Kind;
use crate::model::stream::{Stream, StreamShared};
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};

impl VirtualMachine {
    /// A zero-filled cpu tensor of `nbytes` bytes, homed on the default stream.
    pub fn new_tensor(&self, nbytes: usize) -> Result<Tensor> {
        self.new_tensor_on(&self.default_stream(), nbytes)
    }

    /// A zero-filled tensor of `nbytes` bytes on `stream`'s device, homed on `stream` (its
    /// release runs there).
    pub fn new_tensor_on(&self, stream: &Stream, nbytes: usize) -> Result<Tensor> {
        self.tensor_with(stream, nbytes, &[])
    }

    /// A tensor on `stream`'s device holding a copy of `data`.
    pub fn new_tensor_from(&self, stream: &Stream, data: &[u8]) -> Result<Tensor> {
        self.tensor_with(stream, data.len(), data)
    }

    fn tensor_with(&self, stream: &Stream, nbytes: usize, data: &[u8]) -> Result<Tensor> {
        self.shared.check_stream(stream)?;
        if self.shared.core.is_shut() {
            return Err(Error::ShutDown);
        }
        let dev = &stream.shared.dev;
        let (mem, reused) = self.allocate_on(&stream.shared, nbytes)?;
        if mem.nbytes() != nbytes || mem.device() != stream.id().device {
            return Err(Error::Device(format!(
                "the allocator of {} returned {} bytes on {} for {nbytes} bytes",
                stream.id().device,
                mem.nbytes(),
                mem.device()
            )));
        }
        if reused {
            return self.tensor_on_reused_block(stream, mem, data);
        }
        if !data.is_empty() {
            if let Some(p) = mem.host_ptr() {
                // SAFETY: fresh memory of `nbytes` bytes that no instruction or device work
                // can reach yet (the `DeviceMemory` contract makes `p` valid).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr(), nbytes) };
            } else {
                let src: Arc<dyn DeviceMemory> = Arc::new(HostMemory::try_from_bytes(data)?);
                // SAFETY: nothing else can reach either memory until the copy completed
                // (we wait for it below).
                unsafe { dev.stream.copy(&src, 0, &mem, 0, nbytes) }?;
                dev.stream.record_event()?.synchronize()?;
            }
        }
        Ok(Tensor::over(
            self.shared.clone(),
            stream.shared.clone(),
            mem,
        ))
    }

    /// Memory for a tensor homed on `s`: through its caching allocator when it has one
    /// (`true`: a reused block, stale and ready in `s`'s order only). Out of memory with
    /// blocks cached on the device: returns them (waiting for their streams) and retries
    /// once — not from one of this VM's threads, where waiting could deadlock.
    fn allocate_on(
        &self,
        s: &Arc<StreamShared>,
        nbytes: usize,
    ) -> Result<(Arc<dyn DeviceMemory>, bool)> {
        let name = |e: Error| match e {
            Error::OutOfMemory { detail, .. } => Error::OutOfMemory {
                nbytes,
                stream: format!("stream {}", s.id),
                detail,
            },
            e => e,
        };
        let Some(cache) = &s.dev.cache else {
            return s
                .dev
                .allocator
                .allocate(nbytes)
                .map(|m| (m, false))
                .map_err(name);
        };
        let cached_on_device = || {
            self.shared
                .cached_streams(Some(s.id.device))
                .iter()
                .filter_map(|t| t.dev.cache.as_ref())
                .any(|c| c.stats().cached_blocks > 0)
        };
        let a = match cache.allocate_on_stream(nbytes) {
            Err(Error::OutOfMemory { .. }) if !inside(self.shared.id) && cached_on_device() => {
                self.shared.release_caches(Some(s.id.device))?;
                cache.allocate_on_stream(nbytes)?
            }
            r => r?,
        };
        Ok((a.mem, a.reused))
    }

    /// A tensor over a block reused from `stream`'s cache: its bytes are stale and the
    /// previous owner's work may still be queued on the stream, so it is filled (zeros or
    /// `data`) in the stream's order — at once on a synchronous device, where nothing is
    /// queued; otherwise by a fill instruction on the stream that writes the tensor, and
    /// the stream becomes the tensor's last user, so soft sync orders other streams after
    /// the fill.
    fn tensor_on_reused_block(
        &self,
        stream: &Stream,
        mem: Arc<dyn DeviceMemory>,
        data: &[u8],
    ) -> Result<Tensor> {
        let s = &stream.shared;
        let nbytes = mem.nbytes();
        let host = mem.host_ptr();
        if s.dev.mode == crate::KernelMode::Synchronous
            && let Some(p) = host
        {
            // SAFETY: a synchronous stream freed the block only after every access to it
            // completed, and nothing else can reach it yet; `p` is valid for `nbytes`.
            unsafe {
                if data.is_empty() {
                    std::ptr::write_bytes(p.as_ptr(), 0, nbytes);
                } else {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr(), nbytes);
                }
            }
            return Ok(Tensor::over(
                self.shared.clone(),
                stream.shared.clone(),
                mem,
            ));
        }
        let (kind, source) = if host.is_some() {
            let bytes: Box<[u8]> = data.into();
            let fill = crate::model::instruction::WriteFn::new(Box::new(move |b: &mut [u8]| {
                if bytes.is_empty() {
                    b.fill(0);
                } else {
                    b.copy_from_slice(&bytes);
                }
            }));
            (Kind::Write(fill), None)
        } else {
            // Device-only memory: a copy from host memory, in stream order.
            let src = if data.is_empty() {
                HostMemory::try_zeroed(nbytes)?
            } else {
                HostMemory::try_from_bytes(data)?
            };
            let src = Blob::with_memory(
                self.shared.id,
                NEXT_BLOB_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                Arc::new(src),
            );
            let copy = Kind::Copy {
                src_offset: 0,
                dst_offset: 0,
                len: nbytes,
            };
            (copy, Some(Arc::new(src)))
        };
        let t = Tensor::over(self.shared.clone(), stream.shared.clone(), mem);
        let instr = self
            .shared
            .core
            .pool()
            .instruction("fill_reused_block", s, kind);
        {
            // SAFETY: not shared yet; we own the body (ownership step 1).
            let body = unsafe { instr.body_mut() };
            if let Some(src) = source {
                body.inputs.push(src);
            }
            body.outputs.push(t.blob().clone());
        }
        // Relaxed: bookkeeping that follows the build order (as in `soft_sync.rs`).
        t.inner.last_used_stream.store(s.index, Ordering::Relaxed);
        self.shared.core.receive_one(instr, false)?;
        Ok(t)
    }
}
