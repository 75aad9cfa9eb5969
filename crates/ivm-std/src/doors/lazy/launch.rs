//! The VM side of a lazy-job launch: the instructions
//! [`InstructionsBuilder::launch_lazy_job`] emits, their bodies, how they complete, and
//! the launcher's queue.
//!
//! Instructions of the critical-section and launcher streams complete *later* than their
//! body returns: a critical-section end is done when its end record is, a launch when the
//! graph's callback notifier finishes its job instance. Their bodies are *deferred*: the
//! executor hands the body a [`Completion`] instead of marking the instruction done, and
//! whoever holds the completion finishes the instruction (sets `DONE` with Release and
//! unparks the scheduler, which never polls for it). A completion dropped unused fails its
//! instruction, so a lost run can never leave an instruction lively forever.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use ivm_core::sync::{AtomicBool, Ordering};

use crate::device::cpu::HostMemory;
use crate::doors::builder::InstructionsBuilder;
use crate::doors::lazy::{
    CallerHelper, CriticalSectionInstance, CsKind, CsOp, EndEvent, JobInstance, LazyGraph,
    LazyInner, ProgressProbe, SharedEventRecord,
};
use crate::engine::core::NEXT_BLOB_ID;
use crate::model::blob::Blob;
use crate::model::instruction::{Deferred, Instruction, Kind};
use crate::model::stream::Stream;
use crate::model::stream::StreamShared;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Failure, Result};
use crate::util::ids::{Device, StreamId, StreamType};
use crate::util::lock;

/// The failure an eager instruction records for a lazy-job error: a graph kernel's
/// failure keeps the kernel's name, anything else is attributed to `instr`.
pub(crate) fn failure_of(e: &Error, instr: &str) -> Failure {
    match e {
        Error::KernelPanicked {
            instruction,
            message,
        }
        | Error::Poisoned {
            instruction,
            message,
        } => Failure {
            instruction: instruction.as_str().into(),
            message: message.as_str().into(),
            panicked: false,
        },
        other => Failure {
            instruction: instr.into(),
            message: other.to_string().into(),
            panicked: false,
        },
    }
}

/// What a launch does once the launcher's queue lets it go: enqueue is done, push the
/// job instance (`true`: on the launcher thread, may block on a full buffer; `false`: on
/// the thread of a finishing run, must not block).
type Admit = Box<dyn FnOnce(bool) + Send>;

/// The launcher stream's queue: the graph of every run launched and not yet finished, in
/// launch order, and the launches waiting for it. A launch of another graph than the ones
/// queued waits until the queue is empty; runs of the same graph pipeline. Waiting blocks
/// no thread: a waiting launch is parked here and admitted by the run whose finish
/// empties the queue.
#[derive(Default)]
pub(crate) struct LauncherQueue {
    inner: Mutex<QueueInner>,
}

#[derive(Default)]
struct QueueInner {
    /// Graph ids of runs admitted and not finished, oldest first.
    running: VecDeque<usize>,
    /// Launches not admitted yet, in launch order.
    waiting: VecDeque<(usize, Admit)>,
    /// A thread is running admitted launches' pushes: others leave the admitting to it,
    /// so job instances reach the buffers in launch order.
    admitting: bool,
}

impl QueueInner {
    fn admits(&self, graph: usize) -> bool {
        self.running.iter().all(|&g| g == graph)
    }
}

impl LauncherQueue {
    /// Admits a launch of `graph` now (enqueueing the graph, then running `admit` on this
    /// thread) if no run of another graph is queued, no launch waits and nobody else is
    /// admitting; parks it otherwise.
    pub(crate) fn submit(&self, graph: usize, admit: Admit) {
        let mut g = lock(&self.inner);
        if g.waiting.is_empty() && !g.admitting && g.admits(graph) {
            // Enqueue *before* the job instance is pushed: a fast graph may finish the run
            // (and dequeue it) as soon as its source tick sees it.
            g.running.push_back(graph);
            g.admitting = true;
            drop(g);
            admit(true);
            self.admit_waiting(lock(&self.inner), true);
        } else {
            g.waiting.push_back((graph, admit));
        }
    }

    /// A run of `graph` finished: takes it off the queue and admits the launches that
    /// may go now, in launch order (unless another thread is admitting: it will).
    pub(crate) fn dequeue(&self, graph: usize) {
        let mut g = lock(&self.inner);
        if let Some(p) = g.running.iter().position(|&x| x == graph) {
            g.running.remove(p);
        }
        if g.admitting {
            return;
        }
        self.admit_waiting(g, false);
    }

    /// Admits waiting launches in order while the queue lets them go, running their
    /// pushes outside the lock; `on_launcher`: this is the launcher thread (may block).
    fn admit_waiting<'a>(
        &'a self,
        mut g: std::sync::MutexGuard<'a, QueueInner>,
        on_launcher: bool,
    ) {
        loop {
            let mut batch = Vec::new();
            while let Some(&(next, _)) = g.waiting.front() {
                if !g.admits(next) {
                    break;
                }
                g.running.push_back(next);
                if let Some((_, a)) = g.waiting.pop_front() {
                    batch.push(a);
                }
            }
            if batch.is_empty() {
                g.admitting = false;
                return;
            }
            g.admitting = true;
            drop(g);
            for a in batch {
                a(on_launcher);
            }
            g = lock(&self.inner);
        }
    }
}

/// Per-VM lazy-job state: the launcher's queue and the transport dependence (a memoryless
/// blob every launch writes).
pub(crate) struct VmLazy {
    pub(crate) queue: Arc<LauncherQueue>,
    pub(crate) transport: Arc<Blob>,
    /// What the graphs this VM launched offered a waiting caller: a caller helper
    /// ([`LazyGraph::set_caller_helper`]) and a progress probe
    /// ([`LazyGraph::set_progress_probe`]), registered at each graph's first launch (a
    /// graph serves one VM), with the graph's description to tell when it is gone. At most
    /// [`OFFERS`] graphs alive at once; more are not registered (those run on their own
    /// threads only, and a caller waiting for them sleeps as for any long work).
    offers: Mutex<heapless::Vec<GraphOffer, OFFERS>>,
    /// Whether a registered offer ever had a helper: a wait looks at it without the lock.
    has_helpers: AtomicBool,
    /// Whether a registered offer ever had a progress probe (as `has_helpers`).
    has_probes: AtomicBool,
}

/// One graph's offer to waiting callers (see [`VmLazy::offers`]).
#[derive(Clone)]
struct GraphOffer {
    graph: Weak<LazyInner>,
    helper: Option<CallerHelper>,
    progress: Option<ProgressProbe>,
}

/// Most graph offers one VM keeps.
const OFFERS: usize = 8;

impl VmLazy {
    pub(crate) fn new(vm_id: usize) -> Self {
        Self {
            queue: Arc::new(LauncherQueue::default()),
            transport: Arc::new(Blob::new(
                vm_id,
                NEXT_BLOB_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                Device::CPU,
                0,
            )),
            offers: Mutex::new(heapless::Vec::new()),
            has_helpers: AtomicBool::new(false),
            has_probes: AtomicBool::new(false),
        }
    }

    /// Registers what `graph` offers at its first launch (nothing when it offers nothing).
    fn register(&self, graph: &Arc<LazyInner>) {
        // The first launch seals both slots (see `LazyInner::helper`).
        let helper = graph.helper.get_or_init(|| None).clone();
        let progress = graph.progress.get_or_init(|| None).clone();
        if helper.is_none() && progress.is_none() {
            return;
        }
        let (has_helper, has_probe) = (helper.is_some(), progress.is_some());
        let mut offers = lock(&self.offers);
        // The offers of graphs dropped since make room.
        offers.retain(|o| o.graph.strong_count() > 0);
        let offer = GraphOffer {
            graph: Arc::downgrade(graph),
            helper,
            progress,
        };
        if offers.push(offer).is_ok() {
            // Relaxed: hints for waits; the offers themselves are read under the lock.
            if has_helper {
                self.has_helpers.store(true, Ordering::Relaxed);
            }
            if has_probe {
                self.has_probes.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Whether a graph with a caller helper was ever launched here: the one thing a wait
    /// looks at when there is none.
    pub(crate) fn has_helpers(&self) -> bool {
        // Relaxed: see `register`.
        self.has_helpers.load(Ordering::Relaxed)
    }

    /// Runs the caller helpers (a caller about to wait, outside the engine): whether any
    /// ran something. Allocates nothing; the helpers run without the lock.
    pub(crate) fn help(&self) -> bool {
        self.live_offers()
            .filter_map(|o| o.helper)
            .fold(false, |any, h| h() | any)
    }

    /// The offers of the graphs still alive, copied out of the lock (nothing allocated:
    /// a fixed-capacity vector of shared handles), so that what they call runs unlocked.
    fn live_offers(&self) -> impl Iterator<Item = GraphOffer> {
        let offers = lock(&self.offers).clone();
        offers.into_iter().filter(|o| o.graph.strong_count() > 0)
    }

    /// The sum of the live graphs' progress counts (wrapping), or `None` when no graph
    /// with a probe was ever launched here. A waiting caller compares two of these to see
    /// whether a graph did work in between. Allocates nothing; the probes run without the
    /// lock.
    pub(crate) fn graph_progress(&self) -> Option<u64> {
        // Relaxed: see `register`.
        if !self.has_probes.load(Ordering::Relaxed) {
            return None;
        }
        Some(
            self.live_offers()
                .filter_map(|o| o.progress)
                .fold(0u64, |sum, p| sum.wrapping_add(p())),
        )
    }
}

impl LazyGraph {
    /// Whether a critical-section begin of `kind` would find room in every buffer it
    /// pushes to.
    pub(crate) fn room_for_begin(&self, kind: CsKind) -> bool {
        let bufs = &self.inner.buffers;
        let per_op = match kind {
            CsKind::Input => &bufs.inputs,
            CsKind::Output => &bufs.outputs,
        };
        let room = |b: &crate::doors::lazy::Buffer<_>| b.len() < b.capacity();
        room(&bufs.wait) && room(&bufs.callback) && per_op.iter().flatten().all(room)
    }

    /// Whether a launch would find room for its job instance.
    pub(crate) fn room_for_job(&self) -> bool {
        let bufs = &self.inner.buffers;
        bufs.callback_notifier.len() < bufs.callback_notifier.capacity()
            && bufs.source_tick.len() < bufs.source_tick.capacity()
    }

    /// A critical-section begin's body: builds the run's instance over `blobs` and
    /// `records` (one per interface op, in declaration order) and publishes it into the
    /// wait and callback buffers and each valid op's buffer. If the graph is closed, the
    /// instance is dropped and its records fail with [`Error::GraphClosed`].
    pub(crate) fn begin(
        &self,
        kind: CsKind,
        blobs: Vec<Arc<Blob>>,
        records: Vec<Arc<SharedEventRecord>>,
        block: bool,
    ) {
        let ifaces = match kind {
            CsKind::Input => &self.inner.inputs,
            CsKind::Output => &self.inner.outputs,
        };
        let ops = ifaces
            .iter()
            .zip(blobs)
            .zip(records)
            .map(|((i, blob), record)| CsOp {
                name: i.name.as_str().into(),
                blob,
                record,
            })
            .collect();
        let cs = Arc::new(CriticalSectionInstance::new(
            kind,
            self.inner.job.clone(),
            ops,
        ));
        let bufs = &self.inner.buffers;
        let per_op = match kind {
            CsKind::Input => &bufs.inputs,
            CsKind::Output => &bufs.outputs,
        };
        let mut ok = bufs.wait.push_with(cs.clone(), block).is_ok()
            && bufs.callback.push_with(cs.clone(), block).is_ok();
        for b in per_op.iter().flatten() {
            ok = ok && b.push_with(cs.clone(), block).is_ok();
        }
        if !ok {
            cs.finish_with_error(&Error::GraphClosed {
                job: self.inner.job.to_string(),
            });
        }
    }

    /// The launch's body, after the queue step: pushes `job` to the callback-notifier,
    /// then the source-tick buffer (blocking while full if `block`). If the graph is
    /// closed, `job` finishes with [`Error::GraphClosed`].
    pub(crate) fn push_job(&self, job: Arc<JobInstance>, block: bool) {
        let bufs = &self.inner.buffers;
        let ok = bufs.callback_notifier.push_with(job.clone(), block).is_ok()
            && bufs.source_tick.push_with(job.clone(), block).is_ok();
        if !ok {
            job.finish(Err(Error::GraphClosed {
                job: self.inner.job.to_string(),
            }));
        }
    }
}

fn new_instr(
    name: &'static str,
    stream: &Arc<StreamShared>,
    inputs: &[&Arc<Blob>],
    outputs: &[&Arc<Blob>],
    deferred: Deferred,
) -> Arc<Instruction> {
    // Stream-sequential on the critical-section stream (its policy dispatches in build
    // order: `Instruction::new`).
    let instr = Instruction::new(name, stream.clone(), Kind::Noop);
    {
        // SAFETY: not shared yet; the builder owns the body (ownership step 1).
        let body = unsafe { instr.body_mut() };
        for b in inputs {
            body.inputs.push((*b).clone());
        }
        for b in outputs {
            body.outputs.push((*b).clone());
        }
        body.deferred = Some(deferred);
    }
    Arc::new(instr)
}

impl InstructionsBuilder<'_> {
    /// Launches one run of the lazy job `graph` (ARCHITECTURE.md, "Lazy jobs and critical
    /// sections"): `inputs` are copied into the graph's input blobs, the graph's output
    /// blobs into `outputs`, and the graph's kernels use `parameters` in place.
    ///
    /// After soft-syncing every tensor onto the critical-section stream, it emits, in
    /// order: the *input critical-section begin* (reads `inputs`), the *output
    /// critical-section begin* (writes `outputs`), *launch lazy job* on the lazy-job
    /// launcher stream (writes `parameters` and the transport dependence), then one
    /// *critical-section end* per input (reads it) and per output (writes it), each done
    /// when the graph has finished with that tensor. Begins and ends write the
    /// critical-section stream's schedule dependence, so the ends retire in this order.
    ///
    /// Eager work that reads output `k` waits for every input's end and for outputs
    /// `..=k` — not for the rest of the graph; eager work that touches a parameter waits
    /// for the whole run. Runs of one graph pipeline; a run of another graph starts once
    /// every run launched before it has finished.
    ///
    /// # Errors
    /// [`Error::InterfaceCountMismatch`] when the numbers of tensors differ from the
    /// graph's names; [`Error::InterfaceSizeMismatch`] when a tensor's size differs from
    /// its interface's (valid interfaces) or parameter's; [`Error::AliasedOperand`] when a
    /// tensor appears among the outputs twice, or among the outputs or parameters and
    /// anywhere else; [`Error::ForeignObject`]; [`Error::InvalidGraph`] when another VM
    /// launched `graph` before; stream creation errors.
    pub fn launch_lazy_job(
        &mut self,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        parameters: &[&Tensor],
        graph: &LazyGraph,
    ) -> Result<()> {
        let g = &graph.inner;
        let (orig_outputs, orig_parameters) = (outputs, parameters);
        for (what, expected, got) in [
            ("inputs", g.inputs.len(), inputs.len()),
            ("outputs", g.outputs.len(), outputs.len()),
            ("parameters", g.params.len(), parameters.len()),
        ] {
            if expected != got {
                return Err(Error::InterfaceCountMismatch {
                    job: g.job.to_string(),
                    what,
                    expected,
                    got,
                });
            }
        }
        let vm = self.vm();
        for t in inputs.iter().chain(outputs).chain(parameters) {
            vm.check_tensor(t)?;
        }
        if graph.bind(vm.id)? {
            vm.lazy().register(g);
        }
        let sizes = g
            .inputs
            .iter()
            .zip(inputs)
            .chain(g.outputs.iter().zip(outputs))
            .filter(|(i, _)| i.valid)
            .map(|(i, t)| (&i.name, i.nbytes, t))
            .chain(
                g.params
                    .iter()
                    .zip(parameters)
                    .map(|(p, t)| (&p.name, p.nbytes, t)),
            );
        for (name, expected, t) in sizes {
            if t.nbytes() != expected {
                return Err(Error::InterfaceSizeMismatch {
                    job: g.job.to_string(),
                    name: name.clone(),
                    expected,
                    got: t.nbytes(),
                });
            }
        }
        // A written tensor (output, parameter) may appear nowhere else: the graph would
        // access it from two kernels at once.
        let written: Vec<&Tensor> = outputs.iter().chain(parameters).copied().collect();
        for (k, w) in written.iter().enumerate() {
            let b = w.blob();
            if written[..k]
                .iter()
                .chain(inputs)
                .any(|t| Arc::ptr_eq(t.blob(), b))
            {
                return Err(Error::AliasedOperand);
            }
        }

        // Device-only tensors reach the graph through host staging tensors (ARCHITECTURE.md,
        // "Device-only memory through the doors"): each is copied in on its device's
        // device-to-host stream before the run, and outputs and parameters are copied back
        // on its host-to-device stream after their critical-section ends. The launch below
        // sees only host memory.
        let copy_stream = |t: &Tensor, stream_type| -> Result<Stream> {
            let id = StreamId {
                device: t.device(),
                stream_type,
                thread_id: 0,
            };
            Ok(Stream {
                shared: vm.stream(id)?,
            })
        };
        // A stand-in for `t` if it is device-only and `used`, with the copy streams it
        // needs: in for what the graph reads, out for what it writes. Every stream is
        // created here, before the first instruction is pushed, so that an error leaves
        // nothing behind in the batch.
        let stage = |t: &Tensor, used: bool, copy_in: bool, copy_out: bool| {
            if !used || t.nbytes() == 0 || t.blob().mem.host_ptr().is_some() {
                return Ok(None);
            }
            Ok(Some(Staged {
                host: staging_tensor(vm, t.nbytes())?,
                copy_in: copy_in
                    .then(|| copy_stream(t, StreamType::DeviceToHost))
                    .transpose()?,
                copy_out: copy_out
                    .then(|| copy_stream(t, StreamType::HostToDevice))
                    .transpose()?,
            }))
        };
        let staged_in = g
            .inputs
            .iter()
            .zip(inputs)
            .map(|(i, t)| stage(t, i.valid, true, false))
            .collect::<Result<Vec<_>>>()?;
        let staged_out = g
            .outputs
            .iter()
            .zip(outputs)
            .map(|(i, t)| stage(t, i.valid, false, true))
            .collect::<Result<Vec<_>>>()?;
        let staged_params = parameters
            .iter()
            .map(|t| stage(t, true, true, true))
            .collect::<Result<Vec<_>>>()?;
        let cs = vm.stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::CriticalSection,
            thread_id: 0,
        })?;
        let launcher = vm.stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::LazyJobLauncher,
            thread_id: 0,
        })?;
        let stage_in = inputs
            .iter()
            .chain(parameters)
            .zip(staged_in.iter().chain(&staged_params));
        for (t, s) in stage_in {
            if let Some(Staged {
                host,
                copy_in: Some(d2h),
                ..
            }) = s
            {
                self.copy_named("lazy_job_stage_in", d2h, t, host)?;
            }
        }
        fn swap<'t>(ts: &[&'t Tensor], staged: &'t [Option<Staged>]) -> Vec<&'t Tensor> {
            ts.iter()
                .zip(staged)
                .map(|(&t, s)| s.as_ref().map_or(t, |s| &s.host))
                .collect()
        }
        let (inputs, outputs, parameters) = (
            &swap(inputs, &staged_in)[..],
            &swap(outputs, &staged_out)[..],
            &swap(parameters, &staged_params)[..],
        );

        let lazy = vm.lazy();
        // Bodies may block on a full buffer only on their own VM threads: in single-thread
        // mode they run in the caller's engine step, which the graph may be waiting for.
        let block = !vm.core.single_thread();

        // 1. Soft sync every tensor onto the critical-section stream.
        let all: Vec<&Tensor> = inputs
            .iter()
            .chain(outputs)
            .chain(parameters)
            .copied()
            .collect();
        self.soft_sync_onto(&all, &cs);

        let blobs =
            |ts: &[&Tensor]| -> Vec<Arc<Blob>> { ts.iter().map(|t| t.blob().clone()).collect() };
        let records = |ifaces: &[crate::doors::lazy::Interface]| -> Vec<Arc<SharedEventRecord>> {
            ifaces
                .iter()
                .map(|i| {
                    let r = Arc::new(SharedEventRecord::new());
                    if !i.valid {
                        // Invalid interfaces: done at once.
                        r.try_init(EndEvent::Done);
                    }
                    r
                })
                .collect()
        };
        let in_blobs = blobs(inputs);
        let out_blobs = blobs(outputs);
        let param_blobs = blobs(parameters);
        let in_records = records(&g.inputs);
        let out_records = records(&g.outputs);

        // 2. Input and output critical-section begins.
        {
            let (gr, b, r) = (graph.clone(), in_blobs.clone(), in_records.clone());
            let room = graph.clone();
            let refs: Vec<&Arc<Blob>> = in_blobs.iter().collect();
            self.push_instr(new_instr(
                "input_critical_section_begin",
                &cs,
                &refs,
                &[],
                Deferred {
                    run: Box::new(move |c, may_block| {
                        gr.begin(CsKind::Input, b, r, block && may_block);
                        c.complete(Ok(()));
                    }),
                    ready_now: Some(Box::new(move || room.room_for_begin(CsKind::Input))),
                },
            ));
        }
        {
            let (gr, b, r) = (graph.clone(), out_blobs.clone(), out_records.clone());
            let room = graph.clone();
            let refs: Vec<&Arc<Blob>> = out_blobs.iter().collect();
            self.push_instr(new_instr(
                "output_critical_section_begin",
                &cs,
                &[],
                &refs,
                Deferred {
                    run: Box::new(move |c, may_block| {
                        gr.begin(CsKind::Output, b, r, block && may_block);
                        c.complete(Ok(()));
                    }),
                    ready_now: Some(Box::new(move || room.room_for_begin(CsKind::Output))),
                },
            ));
        }

        // 3. Launch lazy job, on the launcher stream.
        {
            let mut writes: Vec<&Arc<Blob>> = param_blobs.iter().collect();
            writes.push(&lazy.transport);
            let (gr, queue, params) = (graph.clone(), lazy.queue.clone(), param_blobs.clone());
            let room = graph.clone();
            let t: Vec<&Tensor> = parameters.to_vec();
            self.soft_sync_onto(&t, &launcher);
            self.push_instr(new_instr(
                "launch_lazy_job",
                &launcher,
                &[],
                &writes,
                Deferred {
                    ready_now: Some(Box::new(move || room.room_for_job())),
                    run: Box::new(move |c, may_block| {
                        let id = gr.id();
                        let q = queue.clone();
                        queue.submit(
                            id,
                            Box::new(move |on_launcher| {
                                let name = gr.inner.job.clone();
                                let job = Arc::new(JobInstance::new(
                                    gr.inner.job.clone(),
                                    params,
                                    Box::new(move |r| {
                                        q.dequeue(id);
                                        // The label is made only for a failure.
                                        c.complete(r.map_err(|e| {
                                            failure_of(&e, &format!("launch_lazy_job `{name}`"))
                                        }));
                                    }),
                                ));
                                gr.push_job(job, on_launcher && block && may_block);
                            }),
                        );
                    }),
                },
            ));
        }

        // 4. One end per input, then per output, each done when its record is.
        let ends = in_blobs
            .iter()
            .zip(&in_records)
            .map(|(b, r)| (b, r, false))
            .chain(
                out_blobs
                    .iter()
                    .zip(&out_records)
                    .map(|(b, r)| (b, r, true)),
            );
        for (b, r, write) in ends {
            let (name, ins, outs): (&'static str, Vec<&Arc<Blob>>, Vec<&Arc<Blob>>) = if write {
                ("output_critical_section_end", vec![], vec![b])
            } else {
                ("input_critical_section_end", vec![b], vec![])
            };
            let (r, job) = (r.clone(), g.job.clone());
            self.push_instr(new_instr(
                name,
                &cs,
                &ins,
                &outs,
                Deferred::never_blocks(Box::new(move |c, _| {
                    r.on_done(move |res| {
                        // The label is made only for a failure.
                        c.complete(res.map_err(|e| failure_of(&e, &format!("{name} `{job}`"))));
                    });
                })),
            ));
        }

        // 5. Staged outputs and parameters go back to their devices; the staging tensors
        // are released after this batch's instructions (a handle dropped here would free
        // them before the batch is received).
        let back = orig_outputs
            .iter()
            .chain(orig_parameters)
            .zip(staged_out.iter().chain(&staged_params));
        for (t, s) in back {
            if let Some(Staged {
                host,
                copy_out: Some(h2d),
                ..
            }) = s
            {
                self.copy_named("lazy_job_stage_out", h2d, host, t)?;
            }
        }
        for s in staged_in
            .into_iter()
            .chain(staged_out)
            .chain(staged_params)
            .flatten()
        {
            self.release_tensor(s.host)?;
        }
        Ok(())
    }
}

/// A device-only operand of a lazy launch, replaced for the graph by a host tensor.
struct Staged {
    /// The host stand-in the graph sees.
    host: Tensor,
    /// The device's device-to-host stream, for an operand the graph reads.
    copy_in: Option<Stream>,
    /// Its host-to-device stream, for an operand the graph writes.
    copy_out: Option<Stream>,
}

/// A zero-filled host tensor of `nbytes` for staging a device-only tensor, homed on the
/// cpu default stream (its release, like any cpu tensor's, just drops the memory).
fn staging_tensor(vm: &Arc<crate::runtime::shared::VmShared>, nbytes: usize) -> Result<Tensor> {
    let mem = Arc::new(HostMemory::try_zeroed(nbytes)?);
    Ok(Tensor::over(
        vm.clone(),
        vm.default_stream_of(Device::CPU)?,
        mem,
    ))
}

impl crate::runtime::shared::VmShared {
    /// The VM's lazy-job state, created on first use.
    pub(crate) fn lazy(&self) -> &VmLazy {
        self.lazy
            .get_or_init(|| Box::new(VmLazy::new(self.id)))
            .downcast_ref()
            .expect("ivm: the lazy slot holds a VmLazy (only this function fills it)")
    }

    /// The lazy state, if this VM ever launched a lazy job.
    pub(crate) fn lazy_if_used(&self) -> Option<&VmLazy> {
        self.lazy.get().and_then(|l| l.downcast_ref())
    }
}
