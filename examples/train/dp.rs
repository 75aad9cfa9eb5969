//! Data-parallel training over MPI (`--data-parallel`, feature `mpi`):
//!
//! ```sh
//! cargo build --release --example train --features mpi
//! mpirun -np 2 target/release/examples/train --data-parallel
//! ```
//!
//! Every rank trains a replica of the MLP on its share of every batch (rank `r` of `R`
//! takes rows `r·B/R .. (r+1)·B/R` of the global batch of `B` rows; `R` must divide `B`,
//! the run refuses otherwise), eagerly on its own VM. The loss and the gradients travel
//! in buckets, as DDP's do ([`bucket_members`], `--bucket-kib`, 64 by default): in the
//! order the step writes them, up to the cap, a larger one alone. A bucket is packed on
//! the compute stream once its last member is written, all-gathered on the collective
//! stream and reduced there by [`fold`]: the shares added in rank order from rank 0's,
//! then divided by `R`, while the compute stream goes on with the rest of the backward
//! pass; the Adam step of a parameter waits for its gradient's fold (the engine orders
//! it: it reads the tensor the fold writes). Every rank reads the global batch's loss.
//! The default model's five buffers (18 KB) make one bucket: each all-gather waits for
//! the slower rank, and with one CPU per rank (as `mpirun` binds them) nothing overlaps,
//! so one wait per step costs less than five (`docs/perf-2026-12-06.md`).
//!
//! Not an all-reduce: MPI leaves a reduction's order to the library, and Open MPI's
//! changes with the rank count and the message size (Open MPI 4.1: rank order for 2 and 3
//! ranks, other orders from 4), so a float sum over the ranks would not be reproducible in a single
//! process. Folding the gathered shares fixes the order for any rank count and
//! transport, at the cost of receiving `R` shares instead of one sum.
//!
//! The single-process reference (rank 0 runs it, interleaved epoch by epoch with the
//! data-parallel epochs) is gradient accumulation over the same shares: the program of
//! one share run on each share in turn, each bucket packed into its share's slot (where
//! the all-gather puts it), the same fold, then the Adam step. Checked, exit code
//! non-zero otherwise, each check with its own verdict: every rank's per-step losses and
//! final weights are bit-identical to rank 0's, and bit-identical to the reference's, at
//! any length. Printed: steps/s with 1 rank and with `R`, and the share of all-gather
//! time hidden behind compute (the part of each collective's span during which the
//! compute stream was running a kernel), measured on rank 0, and writes rank 0's
//! data-parallel epochs as a Perfetto trace through `trace.rs` (kernels on the threads
//! that ran them, collectives on the collective stream's lane).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm::ivm_ccl::{self, Collectives, Communicator, Dst, Src};
use ivm::ivm_std::{
    Config, Device, Error, InstructionsBuilder, KernelCtx, Result, Stream, StreamId, StreamType,
    Tensor, VirtualMachine,
};

use crate::Args;
use crate::data::{self, Data};
use crate::kernels::Adam;
use crate::modes::{f32s, f32s_mut};
use crate::program::{Op, Program, Role};
use crate::runs::Spread;
use crate::trace::{self, Cat};

/// The trace's process id of the data-parallel run.
const TRACE_PID: u32 = 1;

/// How a replica combines the shares of a global batch.
enum Reduce {
    /// Over the ranks: each reduced buffer is all-gathered on the collective stream and
    /// folded there.
    Ranks(Collectives),
    /// In this process: every share in turn (gradient accumulation), each reduced
    /// buffer copied into its share's slot, folded once the last share is done.
    Sequential,
}

/// One replica: a VM, its compute stream, the program's tensors, how it reduces.
struct Replica {
    vm: VirtualMachine,
    compute: Stream,
    reduce: Reduce,
    prog: Arc<Program>,
    tensors: Vec<Tensor>,
    /// The reduced buffers (the loss and the gradients) in buckets, one all-gather each.
    buckets: Vec<Bucket>,
    /// The shares of every global batch this replica computes: its rank's, or all.
    shares: Vec<usize>,
    /// The rank count: shares per global batch.
    ranks: usize,
    rows: Arc<Vec<f32>>,
    labels: Arc<Vec<f32>>,
    width: usize,
}

/// Reduced buffers that travel together, as DDP's buckets do: one all-gather, one fold.
struct Bucket {
    /// `(buffer, its offset in the bucket, its length)`, in f32s, in the order the step
    /// writes them; the last one written closes the bucket.
    members: Vec<(usize, usize, usize)>,
    /// f32s in the bucket.
    len: usize,
    /// This replica's share of the bucket, packed (what it sends).
    packed: Tensor,
    /// Every share of the bucket side by side in rank order, as an all-gather writes them.
    gathered: Tensor,
}

impl Bucket {
    /// The members' tensors among `tensors`, and their offsets in the bucket (for the
    /// pack and fold kernels, which take them by position).
    fn parts<'t>(&self, tensors: &'t [Tensor]) -> (Vec<&'t Tensor>, Vec<usize>) {
        self.members
            .iter()
            .map(|&(i, offset, _)| (&tensors[i], offset))
            .unzip()
    }
}

/// The reduced buffers of `p`, in the order its forward and backward ops write them, in
/// buckets of at most `cap` bytes (a buffer larger than that travels alone; 0: one buffer
/// per bucket): the first bucket's all-gather starts while the backward pass goes on.
fn bucket_members(p: &Program, cap: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut buckets: Vec<Vec<(usize, usize, usize)>> = Vec::new();
    let mut bytes = 0;
    for op in p
        .ops
        .iter()
        .filter(|op| p.bufs[op.write].role != Role::State)
    {
        let i = op.write;
        if !reduced(p, i) {
            continue;
        }
        let len = p.bufs[i].len;
        match buckets.last_mut() {
            Some(b) if bytes + 4 * len <= cap => {
                let off = b.last().map_or(0, |&(_, o, l)| o + l);
                b.push((i, off, len));
                bytes += 4 * len;
            }
            _ => {
                buckets.push(vec![(i, 0, len)]);
                bytes = 4 * len;
            }
        }
    }
    buckets
}

/// Whether buffer `i` is reduced over the shares: the loss and the gradients.
fn reduced(p: &Program, i: usize) -> bool {
    let name = &p.bufs[i].name;
    i == p.loss
        || (p.bufs[i].role == Role::Temp && (name.starts_with("dw") || name.starts_with("db")))
}

/// `out = (Σ_r parts[r]) / ranks`, element by element, over one member of a bucket: the
/// shares (`parts`, `ranks` buckets of `bucket` f32s side by side) hold it at `offset`,
/// and are added in rank order from share 0: the one order every replica, whatever its
/// transport, uses, so the ranks and the single-process run agree bit for bit.
fn fold(parts: &[f32], ranks: usize, bucket: usize, offset: usize, out: &mut [f32]) {
    let n = out.len();
    out.copy_from_slice(&parts[offset..offset + n]);
    for share in parts.chunks_exact(bucket).skip(1) {
        for (o, &v) in out.iter_mut().zip(&share[offset..offset + n]) {
            *o += v;
        }
    }
    let r = ranks as f32;
    for o in out {
        *o /= r;
    }
}

/// Builds the fold of `bucket` on `stream`: every member's global value, from the
/// gathered shares.
fn fold_bucket(
    b: &mut InstructionsBuilder<'_>,
    stream: &Stream,
    bucket: &Bucket,
    tensors: &[Tensor],
    ranks: usize,
) -> Result<()> {
    let (outs, at) = bucket.parts(tensors);
    let len = bucket.len;
    b.call_named("fold", stream, &[&bucket.gathered], &outs, move |k| {
        let parts = f32s(k.input(0));
        for (j, &o) in at.iter().enumerate() {
            fold(parts, ranks, len, o, f32s_mut(k.output(j)));
        }
    })
}

impl Replica {
    /// A replica of `prog` (built for one share's rows) that computes `shares` of every
    /// global batch of `ranks` shares and reduces them as `reduce` says.
    fn new(
        reduce: impl FnOnce(&VirtualMachine) -> Result<Reduce>,
        prog: Arc<Program>,
        data: &Data,
        shares: Vec<usize>,
        ranks: usize,
        bucket_cap: usize,
    ) -> Result<Self> {
        // The step runs every forward and backward op, then the updates: the program's
        // order, checked (the sequential replica runs the updates once, after all shares).
        let first_update = prog
            .ops
            .iter()
            .position(|op| prog.bufs[op.write].role == Role::State);
        if let Some(u) = first_update
            && prog.ops[u..]
                .iter()
                .any(|op| prog.bufs[op.write].role != Role::State)
        {
            return Err(Error::InvalidArgument(
                "data parallel: an update op comes before a forward or backward op".into(),
            ));
        }
        let vm = VirtualMachine::new(Config::from_env()?)?;
        let compute = vm.stream(StreamId {
            device: Device::CPU,
            stream_type: StreamType::Compute,
            thread_id: 1,
        })?;
        let reduce = reduce(&vm)?;
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
        let buckets = bucket_members(&prog, bucket_cap)
            .into_iter()
            .map(|members| {
                let len = members.iter().map(|&(_, _, l)| l).sum::<usize>();
                Ok(Bucket {
                    members,
                    len,
                    packed: vm.new_tensor_on(&compute, 4 * len)?,
                    gathered: vm.new_tensor_on(&compute, 4 * len * ranks)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            vm,
            compute,
            reduce,
            prog,
            tensors,
            buckets,
            shares,
            ranks,
            rows: Arc::new(data.train.x.clone()),
            labels: Arc::new(data.train.y.clone()),
            width: data.features,
        })
    }

    /// Submits one step on `rows` (per share of `self.shares`, its rows of the global
    /// batch) and returns the global loss.
    fn step(&self, rows: Vec<Vec<u32>>) -> Result<f32> {
        let p = &*self.prog;
        let t = &self.tensors;
        let ranks = self.ranks;
        self.vm.run(|b| {
            for (&share, rows) in self.shares.iter().zip(rows) {
                // The data loader: this share's rows into the batch tensors.
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
                let forward_backward = p
                    .ops
                    .iter()
                    .filter(|op| p.bufs[op.write].role != Role::State);
                for op in forward_backward {
                    self.call(b, op)?;
                    let Some(bucket) = self
                        .buckets
                        .iter()
                        .find(|bk| bk.members.last().is_some_and(|&(i, _, _)| i == op.write))
                    else {
                        continue;
                    };
                    let (members, at) = bucket.parts(t);
                    let len = bucket.len;
                    // This share's bucket, packed: into the tensor it is sent from, or
                    // into its share's slot, where the all-gather would put it.
                    let (dst, base) = match &self.reduce {
                        Reduce::Ranks(_) => (&bucket.packed, 0),
                        Reduce::Sequential => (&bucket.gathered, share * len),
                    };
                    b.call_named("pack", &self.compute, &members, &[dst], move |k| {
                        for (j, &o) in at.iter().enumerate() {
                            let v = f32s(k.input(j));
                            f32s_mut(k.output(0))[base + o..base + o + v.len()].copy_from_slice(v);
                        }
                    })?;
                    // Reduced over the ranks as soon as its last member is written, on
                    // the collective stream, while the compute stream goes on.
                    if let Reduce::Ranks(ccl) = &self.reduce {
                        ccl.all_gather(b, &bucket.packed, &bucket.gathered)?;
                        fold_bucket(b, ccl.stream(), bucket, t, ranks)?;
                    }
                }
            }
            if let Reduce::Sequential = self.reduce {
                for bucket in &self.buckets {
                    fold_bucket(b, &self.compute, bucket, t, ranks)?;
                }
            }
            for op in p
                .ops
                .iter()
                .filter(|op| p.bufs[op.write].role == Role::State)
            {
                self.call(b, op)?;
            }
            Ok(())
        })?;
        let mut out = [0u8; 4];
        self.vm.read_small(&t[p.loss], 0, &mut out)?;
        Ok(f32::from_ne_bytes(out))
    }

    /// Builds `op` as an instruction on the compute stream.
    fn call(&self, b: &mut InstructionsBuilder<'_>, op: &Op) -> Result<()> {
        let t = &self.tensors;
        let reads: Vec<&Tensor> = op.reads.iter().map(|&r| &t[r]).collect();
        let kernel = op.kernel.clone();
        let name = op.name;
        b.call_named(name, &self.compute, &reads, &[&t[op.write]], move |k| {
            trace::span(name, Cat::Kernel, || run_op(k, &kernel));
        })
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

/// Runs one epoch of `replica` (its shares of every global batch of `global_batch` rows)
/// and returns its losses and wall time.
fn epoch(
    replica: &Replica,
    order: &[u32],
    global_batch: usize,
    steps: usize,
) -> Result<(Vec<f32>, Duration)> {
    let local = global_batch / replica.ranks;
    let t0 = Instant::now();
    let mut losses = Vec::with_capacity(steps);
    for s in 0..steps {
        let rows = replica
            .shares
            .iter()
            .map(|&share| {
                let start = s * global_batch + share * local;
                order[start..start + local].to_vec()
            })
            .collect();
        losses.push(replica.step(rows)?);
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
    // Both replicas run the program of one share (`batch / ranks` rows).
    let prog = Arc::new(Program::classifier(
        &layers,
        args.batch / ranks,
        adam,
        args.seed,
    ));
    let dp = Replica::new(
        |vm| Ok(Reduce::Ranks(Collectives::new(vm, comm.clone())?)),
        prog.clone(),
        data,
        vec![rank],
        ranks,
        args.bucket_kib.saturating_mul(1024),
    )?;
    // Rank 0's single-process reference: every share of each global batch in turn, then
    // the same fold.
    let single = if rank == 0 {
        Some(Replica::new(
            |_| Ok(Reduce::Sequential),
            prog,
            data,
            (0..ranks).collect(),
            ranks,
            args.bucket_kib.saturating_mul(1024),
        )?)
    } else {
        None
    };
    let Reduce::Ranks(ccl) = &dp.reduce else {
        unreachable!("the data-parallel replica reduces over the ranks")
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
                let (l, t) = epoch(s, &order, args.batch, steps)?;
                losses.extend(l);
                rate.push(steps as f64 / t.as_secs_f64());
            }
            Ok(())
        };
        if single_first {
            run_single(&mut ref_losses, &mut one_rate)?;
        }
        ccl.global_sync(&dp.vm)?;
        ccl.record_spans(true);
        trace::start(TRACE_PID);
        let (l, t) = epoch(&dp, &order, args.batch, steps)?;
        ccl.global_sync(&dp.vm)?;
        for c in ccl.take_spans() {
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
        ccl.global_sync(&dp.vm)?;
    }

    if rank == 0 && !args.quiet {
        // Where rank 0's VM met contention (six threads on two cores, for 2 ranks there).
        println!(
            "data parallel, rank 0: {}",
            crate::runs::Counters::of(&dp.vm.stats()?)
        );
    }
    // Every rank's losses and final state, bit for bit, against rank 0's.
    let dp_state = dp.state()?;
    let lf = fingerprint(dp_losses.iter().flat_map(|x| x.to_bits().to_ne_bytes()));
    let wf = fingerprint(dp_state.iter().copied());
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
    let ranks_agree = failed.is_empty();
    if let Some(single) = &single {
        // Exact: the same shares, the same kernels, the same fold.
        let same_losses = dp_losses.len() == ref_losses.len()
            && dp_losses
                .iter()
                .zip(&ref_losses)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        let same_state = dp_state == single.state()?;
        let verdict = if same_losses && same_state {
            "yes".to_string()
        } else {
            let first = dp_losses
                .iter()
                .zip(&ref_losses)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            let worst = dp_losses
                .iter()
                .zip(&ref_losses)
                .map(|(a, b)| ((a - b) / b.abs().max(f32::MIN_POSITIVE)).abs())
                .fold(0f32, f32::max);
            let why = format!(
                "losses {} ({} and {} steps, first difference at step {}, worst relative \
                 difference {worst:.1e}); final weights {}",
                if same_losses { "equal" } else { "differ" },
                dp_losses.len(),
                ref_losses.len(),
                first.map_or("none".into(), |i| i.to_string()),
                if same_state { "equal" } else { "differ" },
            );
            failed.push(format!(
                "the data-parallel run does not match the single-process run bit for bit: {why}"
            ));
            format!("NO ({why})")
        };
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
            "losses of {} steps and final weights: bit-identical on all {ranks} ranks: {}",
            dp_losses.len(),
            if ranks_agree { "yes" } else { "NO" }
        );
        println!("the same, bit-identical to the single-process run: {verdict}");
        println!(
            "steps/s, median (interquartile range) of {} interleaved epochs: 1 rank {m1:.0} \
             ({a1:.0} .. {b1:.0}), {ranks} ranks {m2:.0} ({a2:.0} .. {b2:.0}): {:.2}x",
            args.epochs,
            m2 / m1
        );
        println!(
            "all-gathers of gradients hidden behind compute (rank 0): {:.0} % of {:.1} ms",
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
