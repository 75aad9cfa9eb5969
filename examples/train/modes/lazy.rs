//! Lazy: the whole step one compiled graph ([`compile`]), launched through critical
//! sections each step.

use std::sync::Arc;
use std::time::Duration;

use ivm::graph::{BlobId, Graph, GraphBuilder, GraphCtx};
use ivm::ivm_std::{Error, Result, Stream, Tensor, VirtualMachine};

use crate::program::{Program, Role};
use crate::trace::{self, Cat};

use super::*;

use super::device::Device;

/// Where a graph kernel finds an operand.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Blob(BlobId),
    Param(usize),
}

/// Builds the compiled graph of one training step: the batch (`x`, `y`) are its inputs,
/// the loss its output, the state buffers its parameters; every op is a kernel (a
/// parameter kernel when it touches state, so parameter updates keep program order).
pub fn compile(prog: &Program, single_thread: bool) -> Result<Graph> {
    let mut g = GraphBuilder::new("train_step");
    // One thread: a training step is a chain of short kernels, and every hand-over
    // between graph threads would cost more than most of them take.
    g.threads(1);
    // One register slot per blob: with one thread nothing runs ahead, and a second copy of
    // every activation would only double the working set (out of the L2 cache).
    g.pipeline_depth(1);
    // The caller waiting for the loss runs the graph's ready work itself
    // (`GraphBuilder::run_on_caller`) rather than waiting for the graph's thread, which
    // may not have a CPU (a busy machine): it stops once the loss is out, and the graph's
    // thread does the rest of the step while the caller goes on. `IVM_GRAPH_ON_CALLER=0`
    // leaves every firing to the graph's thread (multi-thread mode; single-thread mode
    // has no other thread to leave it to).
    let on_caller = single_thread || std::env::var("IVM_GRAPH_ON_CALLER").as_deref() != Ok("0");
    g.run_on_caller(on_caller);
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
        let single = vm.config().mode == ivm::ivm_std::Mode::SingleThread;
        let graph = compile(&prog, single)?;
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
