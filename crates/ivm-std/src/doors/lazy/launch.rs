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
//!
//! This file holds the launch itself ([`InstructionsBuilder::launch_lazy_job`]: argument
//! checks, staging of device-only operands, the instructions); beside it,
//! `launcher_queue.rs` holds the launcher's queue, `bodies.rs` what the begins' and the
//! launch's bodies do to the graph's buffers, and `vm_lazy.rs` the per-VM lazy-job state.

use std::sync::Arc;

use crate::device::cpu::HostMemory;
use crate::doors::builder::InstructionsBuilder;
use crate::doors::lazy::vm_lazy::VmLazy;
use crate::doors::lazy::{
    CsKind, EndEvent, Interface, JobInstance, LazyGraph, LazyInner, SharedEventRecord,
};
use crate::model::blob::Blob;
use crate::model::instruction::{Deferred, Instruction, Kind};
use crate::model::stream::Stream;
use crate::model::stream::StreamShared;
use crate::runtime::shared::VmShared;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Failure, Result};
use crate::util::ids::{Device, StreamId, StreamType};

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
        let vm = self.vm();
        check_launch(vm, graph, inputs, outputs, parameters)?;
        // Every stream is created before the first instruction is pushed, so that an error
        // leaves nothing behind in the batch.
        let staging = Staging::new(vm, &graph.inner, inputs, outputs, parameters)?;
        let cs = cpu_stream(vm, StreamType::CriticalSection)?;
        let launcher = cpu_stream(vm, StreamType::LazyJobLauncher)?;
        self.copy_staged_in(&staging, inputs, parameters)?;
        {
            let (inputs, outputs, parameters) = staging.stand_ins(inputs, outputs, parameters);
            let (inputs, outputs, parameters) = (&inputs[..], &outputs[..], &parameters[..]);
            let lazy = vm.lazy();
            // Bodies may block on a full buffer only on their own VM threads: in
            // single-thread mode they run in the caller's engine step, which the graph may
            // be waiting for.
            let block = !vm.core.single_thread();

            // 1. Soft sync every tensor onto the critical-section stream.
            let all: Vec<&Tensor> = inputs
                .iter()
                .chain(outputs)
                .chain(parameters)
                .copied()
                .collect();
            self.soft_sync_onto(&all, &cs);
            let run = Run::new(graph, cs, block, inputs, outputs, parameters);
            // 2. Input and output critical-section begins.
            self.push_begins(&run);
            // 3. Launch lazy job, on the launcher stream.
            self.push_launch(&run, lazy, &launcher, parameters);
            // 4. One end per input, then per output, each done when its record is.
            self.push_ends(&run);
        }
        // 5. Staged outputs and parameters go back to their devices.
        self.copy_staged_out(staging, outputs, parameters)
    }

    /// Copies each staged input and parameter into its host stand-in, on its device's
    /// device-to-host stream, before the run.
    fn copy_staged_in(
        &mut self,
        staging: &Staging,
        inputs: &[&Tensor],
        parameters: &[&Tensor],
    ) -> Result<()> {
        let stage_in = inputs
            .iter()
            .chain(parameters)
            .zip(staging.inputs.iter().chain(&staging.params));
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
        Ok(())
    }

    /// Step 2: the input and output critical-section begins.
    fn push_begins(&mut self, run: &Run<'_>) {
        let (graph, block) = (run.graph, run.block);
        {
            let (gr, b, r) = (graph.clone(), run.in_blobs.clone(), run.in_records.clone());
            let room = graph.clone();
            let refs: Vec<&Arc<Blob>> = run.in_blobs.iter().collect();
            self.push_instr(new_instr(
                "input_critical_section_begin",
                &run.cs,
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
            let (gr, b, r) = (
                graph.clone(),
                run.out_blobs.clone(),
                run.out_records.clone(),
            );
            let room = graph.clone();
            let refs: Vec<&Arc<Blob>> = run.out_blobs.iter().collect();
            self.push_instr(new_instr(
                "output_critical_section_begin",
                &run.cs,
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
    }

    /// Step 3: *launch lazy job*, on the launcher stream, after soft-syncing the
    /// parameters onto it.
    fn push_launch(
        &mut self,
        run: &Run<'_>,
        lazy: &VmLazy,
        launcher: &Arc<StreamShared>,
        parameters: &[&Tensor],
    ) {
        let (graph, block) = (run.graph, run.block);
        let mut writes: Vec<&Arc<Blob>> = run.param_blobs.iter().collect();
        writes.push(&lazy.transport);
        let (gr, queue, params) = (graph.clone(), lazy.queue.clone(), run.param_blobs.clone());
        let room = graph.clone();
        let t: Vec<&Tensor> = parameters.to_vec();
        self.soft_sync_onto(&t, launcher);
        self.push_instr(new_instr(
            "launch_lazy_job",
            launcher,
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

    /// Step 4: one critical-section end per input, then per output, each done when its
    /// record is.
    fn push_ends(&mut self, run: &Run<'_>) {
        let ends = run
            .in_blobs
            .iter()
            .zip(&run.in_records)
            .map(|(b, r)| (b, r, false))
            .chain(
                run.out_blobs
                    .iter()
                    .zip(&run.out_records)
                    .map(|(b, r)| (b, r, true)),
            );
        for (b, r, write) in ends {
            let (name, ins, outs): (&'static str, Vec<&Arc<Blob>>, Vec<&Arc<Blob>>) = if write {
                ("output_critical_section_end", vec![], vec![b])
            } else {
                ("input_critical_section_end", vec![b], vec![])
            };
            let (r, job) = (r.clone(), run.graph.inner.job.clone());
            self.push_instr(new_instr(
                name,
                &run.cs,
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
    }

    /// Step 5: staged outputs and parameters go back to their devices, on their
    /// host-to-device streams after their critical-section ends; the staging tensors are
    /// released after this batch's instructions (a handle dropped here would free them
    /// before the batch is received).
    fn copy_staged_out(
        &mut self,
        staging: Staging,
        outputs: &[&Tensor],
        parameters: &[&Tensor],
    ) -> Result<()> {
        let back = outputs
            .iter()
            .chain(parameters)
            .zip(staging.outputs.iter().chain(&staging.params));
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
        for s in staging
            .inputs
            .into_iter()
            .chain(staging.outputs)
            .chain(staging.params)
            .flatten()
        {
            self.release_tensor(s.host)?;
        }
        Ok(())
    }
}

/// The argument checks of a launch, in order: the numbers of tensors, that they belong to
/// this VM, that `graph` serves it (binding it on its first launch), their sizes, and that
/// no written tensor aliases another operand.
fn check_launch(
    vm: &Arc<VmShared>,
    graph: &LazyGraph,
    inputs: &[&Tensor],
    outputs: &[&Tensor],
    parameters: &[&Tensor],
) -> Result<()> {
    let g = &graph.inner;
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
    Ok(())
}

/// The VM's cpu stream of `stream_type` (critical-section, launcher).
fn cpu_stream(vm: &Arc<VmShared>, stream_type: StreamType) -> Result<Arc<StreamShared>> {
    vm.stream(StreamId {
        device: Device::CPU,
        stream_type,
        thread_id: 0,
    })
}

/// The host stand-ins of a launch's device-only operands, one slot per operand (`None`:
/// the graph sees the operand itself).
///
/// Device-only tensors reach the graph through host staging tensors (ARCHITECTURE.md,
/// "Device-only memory through the doors"): each is copied in on its device's
/// device-to-host stream before the run, and outputs and parameters are copied back on its
/// host-to-device stream after their critical-section ends. The launch sees only host
/// memory.
struct Staging {
    inputs: Vec<Option<Staged>>,
    outputs: Vec<Option<Staged>>,
    params: Vec<Option<Staged>>,
}

impl Staging {
    /// Stages every device-only operand the graph uses, creating the copy streams their
    /// copies need.
    fn new(
        vm: &Arc<VmShared>,
        g: &LazyInner,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        parameters: &[&Tensor],
    ) -> Result<Self> {
        let inputs = g
            .inputs
            .iter()
            .zip(inputs)
            .map(|(i, t)| stage(vm, t, i.valid, true, false))
            .collect::<Result<Vec<_>>>()?;
        let outputs = g
            .outputs
            .iter()
            .zip(outputs)
            .map(|(i, t)| stage(vm, t, i.valid, false, true))
            .collect::<Result<Vec<_>>>()?;
        let params = parameters
            .iter()
            .map(|t| stage(vm, t, true, true, true))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            inputs,
            outputs,
            params,
        })
    }

    /// The tensors the graph sees: each staged operand replaced by its host stand-in.
    fn stand_ins<'t>(
        &'t self,
        inputs: &[&'t Tensor],
        outputs: &[&'t Tensor],
        parameters: &[&'t Tensor],
    ) -> (Vec<&'t Tensor>, Vec<&'t Tensor>, Vec<&'t Tensor>) {
        fn swap<'t>(ts: &[&'t Tensor], staged: &'t [Option<Staged>]) -> Vec<&'t Tensor> {
            ts.iter()
                .zip(staged)
                .map(|(&t, s)| s.as_ref().map_or(t, |s| &s.host))
                .collect()
        }
        (
            swap(inputs, &self.inputs),
            swap(outputs, &self.outputs),
            swap(parameters, &self.params),
        )
    }
}

/// A stand-in for `t` if it is device-only and `used`, with the copy streams it needs: in
/// for what the graph reads, out for what it writes.
fn stage(
    vm: &Arc<VmShared>,
    t: &Tensor,
    used: bool,
    copy_in: bool,
    copy_out: bool,
) -> Result<Option<Staged>> {
    if !used || t.nbytes() == 0 || t.blob().mem.host_ptr().is_some() {
        return Ok(None);
    }
    let copy_stream = |stream_type| -> Result<Stream> {
        let id = StreamId {
            device: t.device(),
            stream_type,
            thread_id: 0,
        };
        Ok(Stream {
            shared: vm.stream(id)?,
        })
    };
    Ok(Some(Staged {
        host: staging_tensor(vm, t.nbytes())?,
        copy_in: copy_in
            .then(|| copy_stream(StreamType::DeviceToHost))
            .transpose()?,
        copy_out: copy_out
            .then(|| copy_stream(StreamType::HostToDevice))
            .transpose()?,
    }))
}

/// What one run's instructions share: the graph, the critical-section stream, whether
/// bodies may block, and the blobs and end records of the tensors the graph sees.
struct Run<'g> {
    graph: &'g LazyGraph,
    cs: Arc<StreamShared>,
    block: bool,
    in_blobs: Vec<Arc<Blob>>,
    out_blobs: Vec<Arc<Blob>>,
    param_blobs: Vec<Arc<Blob>>,
    in_records: Vec<Arc<SharedEventRecord>>,
    out_records: Vec<Arc<SharedEventRecord>>,
}

impl<'g> Run<'g> {
    fn new(
        graph: &'g LazyGraph,
        cs: Arc<StreamShared>,
        block: bool,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        parameters: &[&Tensor],
    ) -> Self {
        let g = &graph.inner;
        let blobs =
            |ts: &[&Tensor]| -> Vec<Arc<Blob>> { ts.iter().map(|t| t.blob().clone()).collect() };
        let records = |ifaces: &[Interface]| -> Vec<Arc<SharedEventRecord>> {
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
        Self {
            graph,
            cs,
            block,
            in_blobs: blobs(inputs),
            out_blobs: blobs(outputs),
            param_blobs: blobs(parameters),
            in_records: records(&g.inputs),
            out_records: records(&g.outputs),
        }
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
fn staging_tensor(vm: &Arc<VmShared>, nbytes: usize) -> Result<Tensor> {
    let mem = Arc::new(HostMemory::try_zeroed(nbytes)?);
    Ok(Tensor::over(
        vm.clone(),
        vm.default_stream_of(Device::CPU)?,
        mem,
    ))
}
