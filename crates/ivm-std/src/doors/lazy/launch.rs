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
use crate::doors::lazy::{CsKind, EndEvent, JobInstance, LazyGraph, SharedEventRecord};
use crate::model::blob::Blob;
use crate::model::instruction::{Deferred, Instruction, Kind};
use crate::model::stream::Stream;
use crate::model::stream::StreamShared;
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
