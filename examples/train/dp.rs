//! Data-parallel training over MPI (`--data-parallel`, feature `mpi`):
//!
//! ```sh
//! cargo build --release --example train --features mpi
//! mpirun -np 2 target/release/examples/train --data-parallel
//! ```
//!
//! Every rank trains a replica of the MLP on its share of every batch (rank `r` of `R`
//! takes rows `r·B/R .. (r+1)·B/R` of the global batch of `B` rows), eagerly on its own
//! VM. Each gradient is all-reduced (summed) on the collective stream as soon as the
//! backward kernel that wrote it is done, and scaled by `1/R` there, while the compute
//! stream goes on with the rest of the backward pass; the Adam step of a parameter waits
//! for its gradient's all-reduce (the engine orders it: it reads the tensor the collective
//! writes). The loss is all-reduced the same way, so every rank reads the global batch's
//! loss.
//!
//! Checked, exit code non-zero otherwise: every rank's per-step losses and final weights
//! are bit-identical to rank 0's; the losses agree with a single-process run with the
//! same global batch (rank 0 runs it, interleaved epoch by epoch with the data-parallel
//! epochs) to a relative 1e-5 — not bit for bit, since the sum over the batch is split.
//! Printed: steps/s with 1 rank and with `R`, and the share of all-reduce time hidden
//! behind compute (the part of each collective's span during which the compute stream was
//! running a kernel), measured on rank 0, and writes rank 0's data-parallel epochs as a
//! Perfetto trace through `trace.rs` (kernels on the threads that ran them, collectives on
//! the collective stream's lane).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm::ivm_ccl::{self, Collectives, Communicator, DType, Dst, LocalGroup, Src};
use ivm::ivm_std::{
    Config, Device, Error, KernelCtx, Result, Stream, StreamId, StreamType, Tensor, VirtualMachine,
};

use crate::Args;
use crate::data::{self, Data};
use crate::kernels::Adam;
use crate::modes::{f32s, f32s_mut};
use crate::program::{Program, Role};
use crate::runs::Spread;
use crate::trace::{self, Cat};

/// The trace's process id of the data-parallel run.
const TRACE_PID: u32 = 1;

/// One replica: a VM, its compute stream, the program's tensors, the collectives.
struct Replica {
    vm: VirtualMachine,
    compute: Stream,
    ccl: Collectives,
    prog: Arc<Program>,
    tensors: Vec<Tensor>,
    rows: Arc<Vec<f32>>,
    labels: Arc<Vec<f32>>,
    width: usize,
}

impl Replica {
    fn new(comm: Arc<dyn Communicator>, prog: Arc<Program>, data: &Data) -> Result<Self> {
        let vm = VirtualMachine::new(Config::from_env()?)?;
        let compute = vm.stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::Compute,
            thread_id: 1,
        })?;
        let ccl = Collectives::new(&vm, comm)?;
        let tensors = (0..prog.bufs.len())
            .map(|i| {
                let init: Vec<u8> = prog
                    .initial(i)
                    .iter()
                    .flat_map(|x| x.to_ne_bytes())
                    .collect();
                vm.new_tensor_from(&compute, &init)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            vm,
            compute,
            ccl,
            prog,
            tensors,
            rows: Arc::new(data.train.x.clone()),
            labels: Arc::new(data.train.y.clone()),
            width: data.features,
        })
    }

    /// Submits one step on `rows` (this rank's rows of the global batch) and returns the
    /// global loss.
    fn step(&self, rows: Vec<u32>) -> Result<f32> {
        let p = &*self.prog;
        let t = &self.tensors;
        let size = self.ccl.size() as f32;
        self.vm.run(|b| {
            // The data loader: this rank's rows into the batch tensors.
            let (x, y, w) = (self.rows.clone(), self.labels.clone(), self.width);
            b.call_named(
                "load_batch",
                &self.compute,
                &[],
                &[&t[p.x], &t[p.y]],
                move |k| {
                    let xs = f32s_mut(k.output(0));
                    for (i, &r) in rows.iter().enumerate() {
                        let r = r as usize;
                        xs[i * w..(i + 1) * w].copy_from_slice(&x[r * w..(r + 1) * w]);
                    }
                    let ys = f32s_mut(k.output(1));
                    for (i, &r) in rows.iter().enumerate() {
                        ys[i] = y[r as usize];
                    }
                },
            )?;
            for op in &p.ops {
                let reads: Vec<&Tensor> = op.reads.iter().map(|&r| &t[r]).collect();
                let kernel = op.kernel.clone();
                let name = op.name;
                b.call_named(op.name, &self.compute, &reads, &[&t[op.write]], move |k| {
                    trace::span(name, Cat::Kernel, || run_op(k, &kernel));
                })?;
                // A gradient (or the loss) is reduced over the ranks as soon as it is
                // written, and averaged on the collective stream itself.
                let name = &p.bufs[op.write].name;
                let reduce = op.write == p.loss
                    || (p.bufs[op.write].role == Role::Temp
                        && (name.starts_with("dw") || name.starts_with("db")));
                if reduce {
                    let g = &t[op.write];
                    self.ccl.all_reduce_sum(b, g, DType::F32)?;
                    b.call_named("average", self.ccl.stream(), &[], &[g], move |k| {
                        for v in f32s_mut(k.output(0)) {
                            *v /= size;
                        }
                    })?;
                }
            }
            Ok(())
        })?;
        let mut out = [0u8; 4];
        self.vm.read_small(&t[p.loss], 0, &mut out)?;
        Ok(f32::from_ne_bytes(out))
    }

    /// Every state tensor's bytes, in program order (the final weights and optimiser
    /// state).
    fn state(&self) -> Result<Vec<u8>> {
        let mut all = Vec::new();
        for i in self.prog.state() {
            all.extend(self.vm.access(&self.tensors[i], |d: &[u8]| d.to_vec())?);
        }
        Ok(all)
    }
}

fn run_op(k: &mut KernelCtx<'_>, kernel: &crate::program::Kernel) {
    let n = k.num_inputs();
    let mut reads: [&[f32]; 4] = [&[]; 4];
    for (i, r) in reads.iter_mut().enumerate().take(n) {
        *r = f32s(k.input(i));
    }
    kernel(&reads[..n], f32s_mut(k.output(0)));
}

/// Runs one epoch of `replica` (`share` of `ranks` of every global batch) and returns its
/// losses and wall time.
fn epoch(
    replica: &Replica,
    order: &[u32],
    global_batch: usize,
    steps: usize,
    share: (usize, usize),
) -> Result<(Vec<f32>, Duration)> {
    let (rank, ranks) = share;
    let local = global_batch / ranks;
    let t0 = Instant::now();
    let mut losses = Vec::with_capacity(steps);
    for s in 0..steps {
        let start = s * global_batch + rank * local;
        losses.push(replica.step(order[start..start + local].to_vec())?);
    }
    replica.vm.sync()?;
    Ok((losses, t0.elapsed()))
}

/// FNV-1a over bytes: a fingerprint to compare ranks' results through a collective.
fn fingerprint(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Every rank's `value`, in rank order (a host all-gather outside any VM).
fn gather_u64(comm: &dyn Communicator, value: u64) -> Result<Vec<u64>> {
    let send = value.to_ne_bytes();
    let mut recv = vec![0u8; 8 * comm.size()];
    comm.all_gather(
        Src::Host(&send),
        Dst::Host(&mut recv),
        Instant::now() + ivm_ccl::DEFAULT_TIMEOUT,
    )
    .map_err(|e| Error::Collective(e.to_string()))?;
    Ok(recv
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
        .collect())
}

/// Microseconds of `coll` (collective spans, start and end) during which a compute
/// kernel ran (`compute`: kernel spans of the same clock), and the total.
fn hidden(coll: &[(f64, f64)], compute: &[(f64, f64)]) -> (f64, f64) {
    let mut total = 0.0;
    let mut covered = 0.0;
    for &(s, e) in coll {
        total += e - s;
        for &(cs, ce) in compute {
            covered += (e.min(ce) - s.max(cs)).max(0.0);
        }
    }
    (covered, total)
}

/// The `--data-parallel` run (see the module docs).
pub fn run(args: &Args, data: &Data, adam: Adam) -> Result<ExitCode> {
    let (_mpi, comm) = ivm_ccl::mpi::init()?;
    let (rank, ranks) = (comm.rank(), comm.size());
    let (features, classes) = (data.features, data.classes);
    if !args.batch.is_multiple_of(ranks) {
        if rank == 0 {
            eprintln!(
                "--batch-size {} is not a multiple of {ranks} ranks",
                args.batch
            );
        }
        return Ok(ExitCode::from(2));
    }
    let steps = data.train.rows / args.batch;
    let layers = [features, args.hidden, classes];
    let dp = Replica::new(
        comm.clone(),
        Arc::new(Program::classifier(
            &layers,
            args.batch / ranks,
            adam,
            args.seed,
        )),
        data,
    )?;
    // Rank 0's single-process reference: the same code with a group of one and the whole
    // global batch (its all-reduces are identities, its averages divide by 1).
    let single = if rank == 0 {
        let one = LocalGroup::ranks(1).pop().expect("a group of one");
        Some(Replica::new(
            one,
            Arc::new(Program::classifier(&layers, args.batch, adam, args.seed)),
            data,
        )?)
    } else {
        None
    };
    if rank == 0 && !args.quiet {
        println!(
            "data parallel: {ranks} ranks over MPI, MLP {features}-{}-{classes}, global batch {} \
             ({} rows per rank), {} epochs x {steps} steps",
            args.hidden,
            args.batch,
            args.batch / ranks,
            args.epochs
        );
    }
    let (mut dp_losses, mut ref_losses) = (Vec::new(), Vec::new());
    let (mut dp_rate, mut one_rate) = (Vec::new(), Vec::new());
    // Rank 0's data-parallel epochs are traced (`trace.rs`): compute kernels on the
    // worker's lane, collectives on the collective stream's.
    let mut grads = Vec::new();
    for e in 0..args.epochs {
        let order = data::epoch_order(data.train.rows, args.seed, e);
        // Interleaved: the single-process epoch first on even epochs, second on odd ones
        // (the other ranks wait for it in `global_sync`).
        let single_first = e % 2 == 0;
        let run_single = |losses: &mut Vec<f32>, rate: &mut Vec<f64>| -> Result<()> {
            if let Some(s) = &single {
                let (l, t) = epoch(s, &order, args.batch, steps, (0, 1))?;
                losses.extend(l);
                rate.push(steps as f64 / t.as_secs_f64());
            }
            Ok(())
        };
        if single_first {
            run_single(&mut ref_losses, &mut one_rate)?;
        }
        dp.ccl.global_sync(&dp.vm)?;
        dp.ccl.record_spans(true);
        trace::start(TRACE_PID);
        let (l, t) = epoch(&dp, &order, args.batch, steps, (rank, ranks))?;
        dp.ccl.global_sync(&dp.vm)?;
        for c in dp.ccl.take_spans() {
            let name = format!("{} #{} ({} B)", c.kind.name(), c.seq, c.bytes);
            trace::record_at("collective stream", name, Cat::Collective, c.start, c.end);
            if c.bytes > 4 {
                // A gradient's (the loss is 4 bytes).
                grads.push((c.start, c.end));
            }
        }
        trace::stop();
        dp_losses.extend(l);
        dp_rate.push(steps as f64 / t.as_secs_f64());
        if !single_first {
            run_single(&mut ref_losses, &mut one_rate)?;
        }
        dp.ccl.global_sync(&dp.vm)?;
    }

    // Every rank's losses and final state, bit for bit, against rank 0's.
    let lf = fingerprint(dp_losses.iter().flat_map(|x| x.to_bits().to_ne_bytes()));
    let wf = fingerprint(dp.state()?);
    let losses_all = gather_u64(&*comm, lf)?;
    let weights_all = gather_u64(&*comm, wf)?;
    let mut failed = Vec::new();
    for r in 1..ranks {
        if losses_all[r] != losses_all[0] {
            failed.push(format!("rank {r}'s per-step losses differ from rank 0's"));
        }
        if weights_all[r] != weights_all[0] {
            failed.push(format!("rank {r}'s final weights differ from rank 0's"));
        }
    }
    if rank == 0 {
        let worst = dp_losses
            .iter()
            .zip(&ref_losses)
            .map(|(a, b)| ((a - b) / b.abs().max(f32::MIN_POSITIVE)).abs())
            .fold(0f32, f32::max);
        if worst > 1e-5 || dp_losses.len() != ref_losses.len() {
            failed.push(format!(
                "the data-parallel losses differ from the single-process run's by a relative \
                 {worst:e} (more than 1e-5)"
            ));
        }
        let path = std::env::temp_dir().join("ivm-train-dp-trace.json");
        let traced = trace::write(&path, &[(TRACE_PID, "data parallel, rank 0")]).is_ok();
        let kernels: Vec<(f64, f64)> = trace::spans_of(TRACE_PID)
            .into_iter()
            .filter(|s| s.1 == Cat::Kernel)
            .map(|(_, _, ts, dur)| (ts, ts + dur))
            .collect();
        let grads: Vec<(f64, f64)> = grads
            .iter()
            .map(|&(s, e)| (trace::us_at(s), trace::us_at(e)))
            .collect();
        let (covered, total) = hidden(&grads, &kernels);
        let spread = |v: &[f64]| {
            let s = Spread::of(v.to_vec());
            s.map_or((f64::NAN, f64::NAN, f64::NAN), |s| (s.median, s.q1, s.q3))
        };
        let (m1, a1, b1) = spread(&one_rate);
        let (m2, a2, b2) = spread(&dp_rate);
        println!(
            "losses: {} steps, bit-identical on all {ranks} ranks: {}; worst relative \
             difference from the single-process run: {worst:.1e}",
            dp_losses.len(),
            if failed.is_empty() { "yes" } else { "NO" }
        );
        println!(
            "steps/s, median (interquartile range) of {} interleaved epochs: 1 rank {m1:.0} \
             ({a1:.0} .. {b1:.0}), {ranks} ranks {m2:.0} ({a2:.0} .. {b2:.0}): {:.2}x",
            args.epochs,
            m2 / m1
        );
        println!(
            "all-reduce of gradients hidden behind compute (rank 0): {:.0} % of {:.1} ms",
            100.0 * covered / total.max(f64::MIN_POSITIVE),
            total * 1e-3
        );
        if traced {
            println!(
                "trace of the data-parallel epochs on rank 0: {}",
                path.display()
            );
        }
    }
    if failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &failed {
            eprintln!("train --data-parallel: rank {rank}: {f}");
        }
        Ok(ExitCode::FAILURE)
    }
}
