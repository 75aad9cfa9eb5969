//! What eager and lazy share: a VM, its stream, a tensor per program buffer, the dataset
//! and the data loader ([`Device`]), and the host tensors and staging it is made of.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm::ivm_std::{Result, Stream, Tensor, VirtualMachine};

use crate::kernels;
use crate::program::Program;
use crate::trace::{self, Cat};

use super::*;

/// A host-side tensor of the front end: `len` `f32`s in an ivm tensor.
#[derive(Debug, Clone)]
pub struct HostTensor {
    /// The ivm tensor.
    pub tensor: Tensor,
    /// Number of `f32`s.
    pub len: usize,
}

impl HostTensor {
    /// A tensor on `stream`'s device holding `data`.
    pub fn from_f32(vm: &VirtualMachine, stream: &Stream, data: &[f32]) -> Result<Self> {
        Ok(Self {
            tensor: vm.new_tensor_from(stream, &bytes_of(data))?,
            len: data.len(),
        })
    }

    /// Its contents (waits for every earlier writer).
    pub fn to_vec(&self, vm: &VirtualMachine) -> Result<Vec<f32>> {
        let v = vm.access(&self.tensor, |b| f32s(b).to_vec())?;
        debug_assert_eq!(v.len(), self.len);
        Ok(v)
    }

    /// Its first element, read with `read_small` (the `.item()` of a loop).
    pub fn item(&self, vm: &VirtualMachine) -> Result<f32> {
        let mut b = [0u8; 4];
        vm.read_small(&self.tensor, 0, &mut b)?;
        Ok(f32::from_ne_bytes(b))
    }
}

/// Host-side data loading for a device whose memory is not the host's: the dataset stays
/// on the host, the data loader gathers each batch into a host staging tensor and copies
/// it to the device on `copy` — a host-to-device stream that overlaps the compute stream,
/// or the compute stream itself (one stream: every copy waits for the step before it).
/// Double-buffered: the copy of batch `t + 1` goes to the other slot while step `t`
/// computes.
pub struct Staging {
    host: Stream,
    copy: Stream,
    x_all: HostTensor,
    y_all: HostTensor,
    /// Per slot: host staging (x, y).
    stage: [(HostTensor, HostTensor); 2],
    /// Per slot: device batch (x, y).
    dev: [(HostTensor, HostTensor); 2],
    /// Steps submitted so far (slot of step t: t % 2); `None` until the first batch moved.
    step: Option<usize>,
}

/// What eager and lazy share: the VM, the stream, a tensor per program buffer, the
/// dataset (on the device, or on the host with [`Staging`]), and the data loader.
pub(super) struct Device<'vm> {
    pub(super) vm: &'vm VirtualMachine,
    pub(super) stream: Stream,
    pub(super) prog: Arc<Program>,
    pub(super) tensors: Vec<HostTensor>,
    /// The dataset on the device (without staging).
    pub(super) all: Option<(HostTensor, HostTensor)>,
    pub(super) staging: Option<Staging>,
    /// The dataset on the host (the host data loader's source).
    pub(super) rows: TrainRows,
    pub(super) lat: Vec<Duration>,
    /// The program's kernels, one per op, for the instructions' closures to borrow. Leaked
    /// on purpose (a few dozen pointers per mode and run): a closure that cloned the
    /// kernel's `Arc` would have the caller increment and the worker decrement its count
    /// for every op, a cache line moving between the two cores for each instruction
    /// (the worker's decrement was about 1 % of its kernel time in `perf`); plain pays
    /// nothing of the kind, and a runtime keeps its kernels in a registry that outlives
    /// its instructions.
    pub(super) kernels: &'static [crate::program::Kernel],
}

impl<'vm> Device<'vm> {
    pub(super) fn new(
        vm: &'vm VirtualMachine,
        stream: Stream,
        prog: Arc<Program>,
        rows: &TrainRows,
        copy: Option<Stream>,
    ) -> Result<Self> {
        let tensors = (0..prog.bufs.len())
            .map(|i| HostTensor::from_f32(vm, &stream, &prog.initial(i)))
            .collect::<Result<Vec<_>>>()?;
        let (all, staging) = match copy {
            None => (
                Some((
                    HostTensor::from_f32(vm, &stream, &rows.x)?,
                    HostTensor::from_f32(vm, &stream, &rows.y)?,
                )),
                None,
            ),
            Some(copy) => {
                let host = vm.default_stream();
                let pair = |s: &Stream| -> Result<(HostTensor, HostTensor)> {
                    Ok((
                        HostTensor::from_f32(vm, s, &vec![0.0; prog.bufs[prog.x].len])?,
                        HostTensor::from_f32(vm, s, &vec![0.0; prog.bufs[prog.y].len])?,
                    ))
                };
                let staging = Staging {
                    x_all: HostTensor::from_f32(vm, &host, &rows.x)?,
                    y_all: HostTensor::from_f32(vm, &host, &rows.y)?,
                    stage: [pair(&host)?, pair(&host)?],
                    dev: [pair(&stream)?, pair(&stream)?],
                    host,
                    copy,
                    step: None,
                };
                (None, Some(staging))
            }
        };
        let kernels = Box::leak(prog.ops.iter().map(|op| op.kernel.clone()).collect());
        Ok(Self {
            vm,
            stream,
            prog,
            tensors,
            all,
            staging,
            rows: rows.clone(),
            lat: Vec::new(),
            kernels,
        })
    }

    /// A gather of `batch`'s rows of `all` into `dst` on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather_one(
        &self,
        b: &mut ivm::ivm_std::InstructionsBuilder<'_>,
        stream: &Stream,
        batch: &Batch,
        all: &Tensor,
        dst: &Tensor,
        width: usize,
    ) -> Result<()> {
        let order = batch.order.clone();
        let (start, end) = (batch.start, batch.start + self.prog.batch);
        b.call_named("gather", stream, &[all], &[dst], move |k| {
            host_kernel(k, 1, move |ins, out| {
                trace::span("gather", Cat::Kernel, || {
                    kernels::gather(f32s(ins[0]), &order[start..end], f32s_mut(out), width)
                })
            })
        })
    }

    /// The data loader. Without staging: gathers the batch on the device into `x` and
    /// `y`. With staging: gathers `batch` on the host into staging slot `slot` and copies
    /// it to the device slot.
    pub(super) fn load(
        &self,
        b: &mut ivm::ivm_std::InstructionsBuilder<'_>,
        batch: &Batch,
        slot: usize,
    ) -> Result<()> {
        let p = &self.prog;
        if let Some((x_all, y_all)) = &self.all {
            self.gather_one(
                b,
                &self.stream,
                batch,
                &x_all.tensor,
                &self.tensors[p.x].tensor,
                self.rows.width,
            )?;
            return self.gather_one(
                b,
                &self.stream,
                batch,
                &y_all.tensor,
                &self.tensors[p.y].tensor,
                1,
            );
        }
        let st = self
            .staging
            .as_ref()
            .expect("a device has the dataset or staging");
        let (sx, sy) = &st.stage[slot];
        let (dx, dy) = &st.dev[slot];
        self.gather_one(
            b,
            &st.host,
            batch,
            &st.x_all.tensor,
            &sx.tensor,
            self.rows.width,
        )?;
        self.gather_one(b, &st.host, batch, &st.y_all.tensor, &sy.tensor, 1)?;
        // Trace markers around the copies (only while recording): spans of the copy
        // stream's queue from before the first copy to after the second.
        let begin = trace::is_on().then(|| Arc::new(std::sync::Mutex::new(0.0f64)));
        if let Some(t) = &begin {
            let t = t.clone();
            b.call_named("h2d begin", &st.copy, &[], &[&dx.tensor], move |_| {
                *t.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = trace::now_us();
            })?;
        }
        b.copy(&st.copy, &sx.tensor, &dx.tensor)?;
        b.copy(&st.copy, &sy.tensor, &dy.tensor)?;
        if let Some(t) = begin {
            b.call_named(
                "h2d end",
                &st.copy,
                &[&dx.tensor, &dy.tensor],
                &[],
                move |_| {
                    let s = *t.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    trace::record_span("h2d copy x, y", Cat::Copy, s, trace::now_us());
                },
            )?;
        }
        Ok(())
    }

    /// The host data loader: gathers `batch`'s rows of the host dataset straight into the
    /// `x` and `y` tensors with `access_mut` (each waits until the
    /// tensor is free, i.e. the previous run copied it in). When the stream is idle the
    /// VM hands such a callback to the calling thread: no worker runs, nothing wakes.
    pub(super) fn load_on_host(&self, batch: &Batch) -> Result<()> {
        let p = &self.prog;
        let (start, end) = (batch.start, batch.start + p.batch);
        for (src, dst, width) in [(&self.rows.x, p.x, self.rows.width), (&self.rows.y, p.y, 1)] {
            let (src, order) = (src.clone(), batch.order.clone());
            self.vm.access_mut(&self.tensors[dst].tensor, move |b| {
                trace::span("gather", Cat::Kernel, || {
                    kernels::gather(&src, &order[start..end], f32s_mut(b), width)
                })
            })?;
        }
        Ok(())
    }

    pub(super) fn read_loss(&mut self) -> Result<f32> {
        let t0 = Instant::now();
        let v = trace::span("read loss", Cat::Read, || {
            self.tensors[self.prog.loss].item(self.vm)
        })?;
        self.lat.push(t0.elapsed());
        Ok(v)
    }

    pub(super) fn weights(&self) -> Result<Weights> {
        self.prog
            .weights
            .iter()
            .map(|&(w, b)| {
                Ok((
                    self.tensors[w].to_vec(self.vm)?,
                    self.tensors[b].to_vec(self.vm)?,
                ))
            })
            .collect()
    }

    /// The staging slot of this step (moving the first batch if nothing moved yet), and
    /// advances the step count.
    pub(super) fn begin_step(&mut self, batch: &Batch) -> Result<usize> {
        let Some(step) = self.staging.as_ref().map(|s| s.step) else {
            return Ok(0);
        };
        let t = match step {
            Some(t) => t,
            None => {
                let me = &*self;
                me.vm.run(|b| {
                    me.load(b, batch, 0)?;
                    me.handover(b, 0)
                })?;
                0
            }
        };
        if let Some(s) = &mut self.staging {
            s.step = Some(t + 1);
        }
        Ok(t % 2)
    }

    /// The tensor of buffer `i` in staging slot `slot`.
    pub(super) fn tensor(&self, i: usize, slot: usize) -> &Tensor {
        match &self.staging {
            Some(st) if i == self.prog.x => &st.dev[slot].0.tensor,
            Some(st) if i == self.prog.y => &st.dev[slot].1.tensor,
            _ => &self.tensors[i].tensor,
        }
    }

    /// Eager: one `run` holding (with staging) the move of the next batch into the other
    /// slot, then the step's instructions.
    pub(super) fn submit_step(
        &self,
        batch: &Batch,
        next: Option<&Batch>,
        slot: usize,
    ) -> Result<()> {
        let d = self;
        d.vm.run(|b| match (&d.staging, next) {
            (None, _) => d.load(b, batch, slot),
            // The next batch first: soft sync orders its copy after the last use of
            // the other slot by recording an event on the compute stream where the
            // copy is submitted — before this step's kernels, so the copy waits for
            // the previous step only, not for this one.
            (Some(_), Some(next)) => d.load(b, next, slot ^ 1),
            (Some(_), None) => Ok(()),
        })?;
        for (op, kernel) in d.prog.ops.iter().zip(d.kernels) {
            d.vm.run(|b| d.push_op(b, op, kernel, slot))?;
        }
        if let (Some(_), Some(_)) = (&d.staging, next) {
            d.vm.run(|b| d.handover(b, slot ^ 1))?;
        }
        Ok(())
    }

    /// One op as an instruction on the compute stream.
    pub(super) fn push_op(
        &self,
        b: &mut ivm::ivm_std::InstructionsBuilder<'_>,
        op: &crate::program::Op,
        kernel: &'static crate::program::Kernel,
        slot: usize,
    ) -> Result<()> {
        let n = op.reads.len();
        let out = self.tensor(op.write, slot);
        let mut ins: [&Tensor; 4] = [out; 4];
        for (t, &i) in ins.iter_mut().zip(&op.reads) {
            *t = self.tensor(i, slot);
        }
        let name = op.name;
        b.call_named(op.name, &self.stream, &ins[..n], &[out], move |k| {
            host_kernel(k, n, move |ins, out| {
                let mut reads: [&[f32]; 4] = [&[]; 4];
                for (r, b) in reads.iter_mut().zip(ins) {
                    *r = f32s(b);
                }
                trace::span(name, Cat::Kernel, || kernel(&reads[..n], f32s_mut(out)));
            })
        })
    }

    /// Hands staging slot `slot`'s device batch over to the compute stream, at the end of
    /// a step's instructions: a no-op read on the compute stream, so that soft sync records
    /// the copy stream's event right after this slot's copies (not after a later batch's)
    /// and the compute stream waits for it after the kernels already submitted.
    pub(super) fn handover(
        &self,
        b: &mut ivm::ivm_std::InstructionsBuilder<'_>,
        slot: usize,
    ) -> Result<()> {
        if let Some(st) = &self.staging {
            let (dx, dy) = &st.dev[slot];
            b.touch_tensors(&self.stream, &[&dx.tensor, &dy.tensor])?;
        }
        Ok(())
    }
}

/// Runs the host kernel `f` over the kernel's `n` inputs and its output. On the cpu and on
/// the sim's queued streams the body runs where the bytes are ready: `f` runs at once. On
/// a launcher device (cuda, or the sim with launcher streams) the body runs on the worker
/// ahead of the device, and the memory may be device-only: the kernel enqueues on the
/// device stream a copy of each device-only operand into host memory, `f` as a host
/// function over the host bytes, and the output's copy back, in stream order. That is
/// the demo's device kernel there (it has no GPU code of its own): the VM's launcher
/// paths, device memory, copies and events all run. A device that refuses the work fails
/// the kernel.
fn host_kernel<F>(k: &mut ivm::KernelCtx<'_>, n: usize, f: F)
where
    F: FnOnce(&[&[u8]], &mut [u8]) + Send + 'static,
{
    use ivm::ivm_std::{DeviceMemory, HostMemory, KernelMode};
    // The cpu's kernels have a device stream too (a synchronous one): only a launcher's
    // needs the copies and the enqueued host function (an allocation and an `Arc` clone
    // per operand, per kernel).
    let launcher = k
        .device_stream()
        .filter(|s| s.kernel_mode() == KernelMode::Launcher);
    let Some(stream) = launcher else {
        let mut reads: [&[u8]; 4] = [&[]; 4];
        for (j, r) in reads.iter_mut().enumerate().take(n) {
            *r = k.input(j);
        }
        return f(&reads[..n], k.output(0));
    };
    let fail = |e: ivm::Error| -> ! { std::panic::resume_unwind(Box::new(e.to_string())) };
    let out = k.output_memory(0).clone();
    // Host memory for each operand (the operand itself where the host may touch it).
    let mut host: Vec<Arc<dyn DeviceMemory>> = Vec::with_capacity(n + 1);
    for m in (0..n).map(|j| k.input_memory(j)).chain([&out]) {
        if m.host_ptr().is_some() {
            host.push(m.clone());
            continue;
        }
        let h: Arc<dyn DeviceMemory> =
            Arc::new(HostMemory::try_zeroed(m.nbytes()).unwrap_or_else(|e| fail(e)));
        // SAFETY: the engine gives this kernel its operands (no writer of an input, no
        // other access of the output) until its stream has run what it enqueues; `h` is
        // new and touched only by this kernel's work, in stream order.
        unsafe { stream.copy(m, 0, &h, 0, m.nbytes()) }.unwrap_or_else(|e| fail(e));
        host.push(h);
    }
    let bytes = host.clone();
    stream
        .launch_host(Box::new(move || {
            let slice = |m: &Arc<dyn DeviceMemory>| {
                let p = m.host_ptr().expect("host memory").as_ptr();
                // SAFETY: host memory of `nbytes` bytes (the `DeviceMemory` contract),
                // accessed by this function alone in stream order: the copies in
                // completed, the copy back starts after it; the output is distinct from
                // the inputs (the VM refuses a tensor that is both).
                unsafe { std::slice::from_raw_parts_mut(p, m.nbytes()) }
            };
            let (ins, out) = bytes.split_at(n);
            let mut reads: [&[u8]; 4] = [&[]; 4];
            for (r, m) in reads.iter_mut().zip(ins) {
                *r = slice(m);
            }
            f(&reads[..n], slice(&out[0]));
        }))
        .unwrap_or_else(|e| fail(e));
    if out.host_ptr().is_none() {
        // SAFETY: as above: the output is this kernel's until its stream ran this copy.
        unsafe { stream.copy(&host[n], 0, &out, 0, out.nbytes()) }.unwrap_or_else(|e| fail(e));
    }
}
