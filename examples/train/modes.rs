//! The three ways to run a [`Program`]: plain (no VM), eager (every op an ivm
//! instruction) and lazy (the whole step one compiled graph launched through critical
//! sections). Each trainer takes the epoch's row order and a batch start, and returns the
//! step's loss, read back on the host.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm::graph::{BlobId, Graph, GraphBuilder, GraphCtx};
use ivm::ivm_std::{DeviceMemory, Error, HostMemory, Result, Stream, Tensor, VirtualMachine};

use crate::kernels;
use crate::program::{Program, Role};
use crate::trace::{self, Cat};

/// The `f32`s of tensor bytes.
pub fn f32s(b: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid `f32`; `align_to` only yields a middle part
    // that is properly aligned, and the asserts below check that it covers every byte
    // (ivm tensor memory and graph blobs are 8-byte aligned, sizes are multiples of 4).
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "tensor bytes are not f32s"
    );
    mid
}

/// The `f32`s of tensor bytes, mutably.
pub fn f32s_mut(b: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `f32s`; the result borrows `b` mutably.
    let (pre, mid, post) = unsafe { b.align_to_mut::<f32>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "tensor bytes are not f32s"
    );
    mid
}

/// The bytes of `f32`s.
pub fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Per layer: (weights, biases), read back on the host.
pub type Weights = Vec<(Vec<f32>, Vec<f32>)>;

/// The rows of one batch: `order[start..start + batch size]`.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The epoch's row order.
    pub order: Arc<[u32]>,
    /// Where the batch starts in it.
    pub start: usize,
}

/// One way of running training steps.
pub trait Trainer {
    /// Runs one step on `batch` and returns its loss; `next` is the batch of the following
    /// step, if any (a trainer may start moving it while this step computes).
    fn step(&mut self, batch: &Batch, next: Option<&Batch>) -> Result<f32>;
    /// The trained weights.
    fn weights(&mut self) -> Result<Weights>;
    /// Latency of each step's host read of the loss (empty without a VM).
    fn read_latencies(&self) -> &[Duration] {
        &[]
    }
    /// Waits until everything submitted so far has finished.
    fn sync(&self) -> Result<()> {
        Ok(())
    }
}

/// The dataset's training rows, shared by every mode.
#[derive(Debug, Clone)]
pub struct TrainRows {
    /// Features, row-major.
    pub x: Arc<Vec<f32>>,
    /// Labels.
    pub y: Arc<Vec<f32>>,
    /// Features per row.
    pub width: usize,
}

/// `f32`s in the memory the VM gives a cpu tensor ([`HostMemory`]: aligned to 128 bytes),
/// so that the plain baseline computes on memory laid out like the VM modes' and the
/// comparison measures the VM, not the allocator (with `Vec<f32>`, 16-byte aligned, the
/// kernels' vector loads straddle cache lines where the VM's do not).
struct PlainBuf {
    mem: HostMemory,
    len: usize,
}

impl Default for PlainBuf {
    fn default() -> Self {
        Self::from_slice(&[])
    }
}

impl PlainBuf {
    fn from_slice(v: &[f32]) -> Self {
        Self {
            mem: HostMemory::from_bytes(&bytes_of(v)),
            len: v.len(),
        }
    }

    fn ptr(&self) -> *mut f32 {
        let p = self.mem.host_ptr().expect("cpu memory has a host pointer");
        p.as_ptr().cast()
    }

    fn as_slice(&self) -> &[f32] {
        // SAFETY: the memory holds `len` initialised `f32`s (4 * len bytes, copied in or
        // written through `as_mut_slice`; none for an empty buffer, whose pointer is
        // aligned and non-null), is aligned to 128 bytes, and is owned by `self`, which
        // this shared borrow keeps from being written meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_slice`; the exclusive borrow of `self` makes this the only view
        // of the memory.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

/// Plain: the same kernels called directly on host buffers, one thread, no VM.
pub struct Plain {
    prog: Arc<Program>,
    rows: TrainRows,
    bufs: Vec<PlainBuf>,
}

impl Plain {
    /// A plain trainer with the program's initial state.
    pub fn new(prog: Arc<Program>, rows: TrainRows) -> Self {
        let bufs = (0..prog.bufs.len())
            .map(|i| PlainBuf::from_slice(&prog.initial(i)))
            .collect();
        Self { prog, rows, bufs }
    }
}

impl Trainer for Plain {
    fn step(&mut self, batch: &Batch, _next: Option<&Batch>) -> Result<f32> {
        let p = &self.prog;
        let idx = &batch.order[batch.start..batch.start + p.batch];
        let (rows, bufs) = (&self.rows, &mut self.bufs);
        trace::span("gather", Cat::Kernel, || {
            kernels::gather(&rows.x, idx, bufs[p.x].as_mut_slice(), rows.width)
        });
        trace::span("gather", Cat::Kernel, || {
            kernels::gather(&rows.y, idx, bufs[p.y].as_mut_slice(), 1)
        });
        for op in &p.ops {
            let mut out = std::mem::take(&mut self.bufs[op.write]);
            let mut reads: [&[f32]; 4] = [&[]; 4];
            for (r, &i) in reads.iter_mut().zip(&op.reads) {
                *r = self.bufs[i].as_slice();
            }
            trace::span(op.name, Cat::Kernel, || {
                (op.kernel)(&reads[..op.reads.len()], out.as_mut_slice())
            });
            self.bufs[op.write] = out;
        }
        Ok(self.bufs[p.loss].as_slice()[0])
    }

    fn weights(&mut self) -> Result<Weights> {
        Ok(self
            .prog
            .weights
            .iter()
            .map(|&(w, b)| {
                (
                    self.bufs[w].as_slice().to_vec(),
                    self.bufs[b].as_slice().to_vec(),
                )
            })
            .collect())
    }
}

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
struct Device<'vm> {
    vm: &'vm VirtualMachine,
    stream: Stream,
    prog: Arc<Program>,
    tensors: Vec<HostTensor>,
    /// The dataset on the device (without staging).
    all: Option<(HostTensor, HostTensor)>,
    staging: Option<Staging>,
    /// The dataset on the host (the host data loader's source).
    rows: TrainRows,
    lat: Vec<Duration>,
    /// The program's kernels, one per op, for the instructions' closures to borrow. Leaked
    /// on purpose (a few dozen pointers per mode and run): a closure that cloned the
    /// kernel's `Arc` would have the caller increment and the worker decrement its count
    /// for every op, a cache line moving between the two cores for each instruction
    /// (the worker's decrement was about 1 % of its kernel time in `perf`); plain pays
    /// nothing of the kind, and a runtime keeps its kernels in a registry that outlives
    /// its instructions.
    kernels: &'static [crate::program::Kernel],
}

impl<'vm> Device<'vm> {
    fn new(
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
    fn gather_one(
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
            trace::span("gather", Cat::Kernel, || {
                kernels::gather(
                    f32s(k.input(0)),
                    &order[start..end],
                    f32s_mut(k.output(0)),
                    width,
                )
            })
        })
    }

    /// The data loader. Without staging: gathers the batch on the device into `x` and
    /// `y`. With staging: gathers `batch` on the host into staging slot `slot` and copies
    /// it to the device slot.
    fn load(
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
    fn load_on_host(&self, batch: &Batch) -> Result<()> {
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

    fn read_loss(&mut self) -> Result<f32> {
        let t0 = Instant::now();
        let v = trace::span("read loss", Cat::Read, || {
            self.tensors[self.prog.loss].item(self.vm)
        })?;
        self.lat.push(t0.elapsed());
        Ok(v)
    }

    fn weights(&self) -> Result<Weights> {
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
    fn begin_step(&mut self, batch: &Batch) -> Result<usize> {
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
    fn tensor(&self, i: usize, slot: usize) -> &Tensor {
        match &self.staging {
            Some(st) if i == self.prog.x => &st.dev[slot].0.tensor,
            Some(st) if i == self.prog.y => &st.dev[slot].1.tensor,
            _ => &self.tensors[i].tensor,
        }
    }

    /// Eager: one `run` holding (with staging) the move of the next batch into the other
    /// slot, then the step's instructions.
    fn submit_step(&self, batch: &Batch, next: Option<&Batch>, slot: usize) -> Result<()> {
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
    fn push_op(
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
            let mut reads: [&[f32]; 4] = [&[]; 4];
            for (j, r) in reads.iter_mut().enumerate().take(n) {
                *r = f32s(k.input(j));
            }
            let out = f32s_mut(k.output(0));
            trace::span(name, Cat::Kernel, || kernel(&reads[..n], out));
        })
    }

    /// Hands staging slot `slot`'s device batch over to the compute stream, at the end of
    /// a step's instructions: a no-op read on the compute stream, so that soft sync records
    /// the copy stream's event right after this slot's copies (not after a later batch's)
    /// and the compute stream waits for it after the kernels already submitted.
    fn handover(&self, b: &mut ivm::ivm_std::InstructionsBuilder<'_>, slot: usize) -> Result<()> {
        if let Some(st) = &self.staging {
            let (dx, dy) = &st.dev[slot];
            b.touch_tensors(&self.stream, &[&dx.tensor, &dy.tensor])?;
        }
        Ok(())
    }
}

/// Eager: every op an instruction on one stream, the loss read each step with
/// `read_small`.
pub struct Eager<'vm> {
    dev: Device<'vm>,
}

impl<'vm> Eager<'vm> {
    /// An eager trainer running on `stream` of `vm`. With `copy`, the dataset stays on
    /// the host and each batch is copied to the device on `copy` (see [`Staging`]).
    pub fn new(
        vm: &'vm VirtualMachine,
        stream: Stream,
        prog: Arc<Program>,
        rows: &TrainRows,
        copy: Option<Stream>,
    ) -> Result<Self> {
        Ok(Self {
            dev: Device::new(vm, stream, prog, rows, copy)?,
        })
    }
}

impl Trainer for Eager<'_> {
    fn step(&mut self, batch: &Batch, next: Option<&Batch>) -> Result<f32> {
        let slot = self.dev.begin_step(batch)?;
        let d = &self.dev;
        trace::span("run", Cat::Submit, || d.submit_step(batch, next, slot))?;
        self.dev.read_loss()
    }

    fn weights(&mut self) -> Result<Weights> {
        self.dev.weights()
    }

    fn read_latencies(&self) -> &[Duration] {
        &self.dev.lat
    }

    fn sync(&self) -> Result<()> {
        self.dev.vm.sync()
    }
}

/// Where a graph kernel finds an operand.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Blob(BlobId),
    Param(usize),
}

/// Builds the compiled graph of one training step: the batch (`x`, `y`) are its inputs,
/// the loss its output, the state buffers its parameters; every op is a kernel (a
/// parameter kernel when it touches state, so parameter updates keep program order).
pub fn compile(prog: &Program) -> Result<Graph> {
    let mut g = GraphBuilder::new("train_step");
    // One thread: a training step is a chain of short kernels, and every hand-over
    // between graph threads would cost more than most of them take.
    g.threads(1);
    // One register slot per blob: with one thread nothing runs ahead, and a second copy of
    // every activation would only double the working set (out of the L2 cache).
    g.pipeline_depth(1);
    // `IVM_GRAPH_ON_CALLER=1`: the caller waiting for the loss runs the graph's ready work
    // itself (`GraphBuilder::run_on_caller`) instead of waiting for the graph's thread.
    if std::env::var_os("IVM_GRAPH_ON_CALLER").is_some_and(|v| v == "1") {
        g.run_on_caller(true);
    }
    g.trace(trace::graph_event);
    let slots: Vec<Slot> = prog
        .bufs
        .iter()
        .map(|b| match b.role {
            Role::Input => Slot::Blob(g.input(b.name.clone(), 4 * b.len)),
            Role::State => Slot::Param(g.param(b.name.clone(), 4 * b.len)),
            Role::Temp | Role::Output => Slot::Blob(g.blob(b.name.clone(), 4 * b.len)),
        })
        .collect();
    for (i, op) in prog.ops.iter().enumerate() {
        #[derive(Clone, Copy)]
        enum Src {
            Input(usize),
            Param(usize),
        }
        let mut blob_reads = Vec::new();
        let srcs: Vec<Src> = op
            .reads
            .iter()
            .map(|&r| match slots[r] {
                Slot::Blob(id) => {
                    blob_reads.push(id);
                    Src::Input(blob_reads.len() - 1)
                }
                Slot::Param(p) => Src::Param(p),
            })
            .collect();
        let (blob_writes, dst) = match slots[op.write] {
            Slot::Blob(id) => (vec![id], None),
            Slot::Param(p) => (Vec::new(), Some(p)),
        };
        let uses_params = dst.is_some() || srcs.iter().any(|s| matches!(s, Src::Param(_)));
        // Every operand borrowed in place (`GraphCtx::io`): the kernel reads the graph's
        // blobs and the parameter tensors directly and writes its one output (a blob, or
        // a parameter updated in place) without copies.
        let n = srcs.len();
        let kernel = op.kernel.clone();
        let body = move |ctx: &mut GraphCtx<'_>| {
            let io = ctx.io(dst);
            let mut reads: [&[f32]; 4] = [&[]; 4];
            for (r, src) in reads.iter_mut().zip(&srcs) {
                *r = f32s(match *src {
                    Src::Input(j) => io.inputs[j],
                    Src::Param(p) => io.params.get(p),
                });
            }
            let out: &mut [u8] = match io.param_mut {
                Some(p) => p,
                None => &mut *io.outputs[0],
            };
            kernel(&reads[..n], f32s_mut(out));
        };
        let name = format!("{i}:{}", op.name);
        if uses_params {
            g.param_kernel(name, &blob_reads, &blob_writes, body);
        } else {
            g.kernel(name, &blob_reads, &blob_writes, body);
        }
    }
    match slots[prog.loss] {
        Slot::Blob(id) => g.output("loss", id),
        Slot::Param(_) => {
            return Err(Error::Config("the loss must not be a state buffer".into()));
        }
    }
    g.build()
}

/// Lazy: the host data loader fills the batch tensors (see `Device::load_on_host`), then
/// one launch of the compiled step graph (inputs: the batch; outputs: the loss;
/// parameters: the state), then the loss is read with `read_small`. The graph
/// runs on its own thread; the step's loss is out after the forward pass, so the host
/// loads and launches the next step while the graph still runs this one's backward pass
/// and update.
pub struct Lazy<'vm> {
    dev: Device<'vm>,
    graph: Graph,
    params: Vec<usize>,
}

impl<'vm> Lazy<'vm> {
    /// A lazy trainer: compiles the program and launches it from `stream` of `vm`.
    pub fn new(
        vm: &'vm VirtualMachine,
        stream: Stream,
        prog: Arc<Program>,
        rows: &TrainRows,
    ) -> Result<Self> {
        let graph = compile(&prog)?;
        let params = prog.state();
        Ok(Self {
            dev: Device::new(vm, stream, prog, rows, None)?,
            graph,
            params,
        })
    }

    /// The running graph.
    #[allow(dead_code)]
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
}

impl Trainer for Lazy<'_> {
    fn step(&mut self, batch: &Batch, _next: Option<&Batch>) -> Result<f32> {
        let d = &self.dev;
        let p = &d.prog;
        d.load_on_host(batch)?;
        trace::span("run", Cat::Submit, || {
            d.vm.run(|b| {
                let params: Vec<&Tensor> =
                    self.params.iter().map(|&i| &d.tensors[i].tensor).collect();
                b.launch_lazy_job(
                    &[&d.tensors[p.x].tensor, &d.tensors[p.y].tensor],
                    &[&d.tensors[p.loss].tensor],
                    &params,
                    self.graph.lazy(),
                )
            })
        })?;
        self.dev.read_loss()
    }

    fn weights(&mut self) -> Result<Weights> {
        self.dev.weights()
    }

    fn read_latencies(&self) -> &[Duration] {
        &self.dev.lat
    }

    fn sync(&self) -> Result<()> {
        self.dev.vm.sync()
    }
}
