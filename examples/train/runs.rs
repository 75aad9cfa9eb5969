//! Running the modes side by side, so that the host's drift hits them alike: every mode
//! trains its own copy of the model (its own VM), one epoch at a time, round-robin —
//! epoch e of each mode before epoch e + 1 of any — with the order rotated every epoch
//! (plain, eager, lazy; then eager, lazy, plain; ...). The cost of a mode is then the
//! ratio of each of its epochs to plain's same epoch, reported as the median and the
//! interquartile range over all epochs of all runs (`ratios`, `Spread`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ivm::ivm_std::{Result, Stream, VirtualMachine};

use crate::modes::{Batch, Eager, Lazy, Plain, Trainer};
use crate::program::{self, Program};
use crate::{Mode, Run, Setup, data, new_vm, trace};

/// The untimed pause before each epoch: the threads of the mode before stop polling (their
/// poll windows are 100 µs). Pinned, they would take the kernel CPU from this epoch;
/// unpinned, the OS leaves them beside this epoch's threads (the threads of a process
/// rarely migrate), whose VM then sees its worker share a CPU, and degrades to its callers
/// running its queue for `CONTENDED_HOLD` (a program running one mode has no such
/// neighbour).
const SETTLE: Duration = Duration::from_micros(300);

/// Runs epoch `epoch` of `trainer` (all its steps, in the epoch's row `order`; `next` is
/// the next epoch's order, for the prefetch of the last step), appending the losses.
pub fn epoch(
    setup: &Setup<'_>,
    prog: &Program,
    trainer: &mut dyn Trainer,
    order: &Arc<[u32]>,
    next: Option<&Arc<[u32]>>,
    losses: &mut Vec<f32>,
) -> Result<Duration> {
    let spe = setup.steps_per_epoch;
    let e0 = Instant::now();
    for s in 0..spe {
        let batch = Batch {
            order: order.clone(),
            start: s * prog.batch,
        };
        let following = if s + 1 < spe {
            Some(Batch {
                order: order.clone(),
                start: (s + 1) * prog.batch,
            })
        } else {
            next.map(|o| Batch {
                order: o.clone(),
                start: 0,
            })
        };
        losses.push(trainer.step(&batch, following.as_ref())?);
    }
    Ok(e0.elapsed())
}

/// One mode while an interleaved run goes on.
struct Live<'vm> {
    mode: Mode,
    trainer: Box<dyn Trainer + 'vm>,
    losses: Vec<f32>,
    epochs: Vec<Duration>,
    elapsed: Duration,
    last_epoch: Duration,
    /// Samples of the busy threads during this mode's epochs (see [`Counters`]).
    busy_on_caller: u64,
    busy_samples: u64,
}

/// One interleaved run of `modes` (see the module docs); `traced`: record each mode's
/// last epoch (left out of the epoch times, since it pays for its trace).
pub fn interleaved(
    setup: &Setup<'_>,
    modes: &[Mode],
    prog: &Arc<Program>,
    traced: bool,
) -> Result<Vec<Run>> {
    let a = setup.args;
    // `(caller CPU, kernel CPU)` (`pin.rs`): the VMs, their streams and graphs are made on
    // the kernel CPU, so that their threads start there.
    let pins = a
        .pin
        .then(crate::pin::cpus)
        .flatten()
        .filter(|&(_, kernels)| crate::pin::to(kernels));
    // The VMs first: the trainers borrow them.
    let vms: Vec<Option<(VirtualMachine, Stream, Option<Stream>)>> = modes
        .iter()
        .map(|m| match m {
            Mode::Plain => Ok(None),
            _ => new_vm(a.device).map(Some),
        })
        .collect::<Result<_>>()?;
    let mut lives = Vec::new();
    for (&mode, vm) in modes.iter().zip(&vms) {
        let trainer: Box<dyn Trainer + '_> = match (mode, vm) {
            (Mode::Plain, _) => Box::new(Plain::new(prog.clone(), setup.rows.clone())),
            (Mode::Eager | Mode::EagerOneStream, Some((vm, s, h2d))) => {
                // On the sim, the batches are copied from the host: on the h2d stream
                // (overlapping compute), or on the compute stream itself.
                let copy = match mode {
                    Mode::EagerOneStream => h2d.as_ref().map(|_| s.clone()),
                    _ => h2d.clone(),
                };
                Box::new(Eager::new(vm, s.clone(), prog.clone(), &setup.rows, copy)?)
            }
            (Mode::Lazy, Some((vm, s, _))) => {
                Box::new(Lazy::new(vm, s.clone(), prog.clone(), &setup.rows)?)
            }
            _ => unreachable!("every VM mode has its VM"),
        };
        lives.push(Live {
            mode,
            trainer,
            losses: Vec::with_capacity(a.epochs * setup.steps_per_epoch),
            epochs: Vec::with_capacity(a.epochs),
            elapsed: Duration::ZERO,
            last_epoch: Duration::ZERO,
            busy_on_caller: 0,
            busy_samples: 0,
        });
    }
    if let Some((caller, _)) = pins {
        crate::pin::to(caller);
    }
    let rows = setup.rows.y.len();
    let mut next_order: Arc<[u32]> = data::epoch_order(rows, a.seed, 0).into();
    for e in 0..a.epochs {
        let last = e + 1 == a.epochs;
        let order = next_order;
        next_order = data::epoch_order(rows, a.seed, e + 1).into();
        let n = lives.len();
        for k in 0..n {
            let live = &mut lives[(e + k) % n];
            let trace_this = last && traced;
            if trace_this {
                live.trainer.sync()?;
                trace::start(live.mode.pid());
            }
            let next = (!last).then_some(&next_order);
            let plain_here = pins.filter(|_| live.mode == Mode::Plain);
            // Untimed (see `SETTLE`).
            std::thread::sleep(SETTLE);
            if let Some((_, kernels)) = plain_here {
                crate::pin::to(kernels);
            }
            let busy0 = crate::hog::on_cpu();
            let t = epoch(
                setup,
                prog,
                &mut *live.trainer,
                &order,
                next,
                &mut live.losses,
            )?;
            if let Some((caller, _)) = pins {
                let busy = crate::hog::on_cpu();
                let delta = |c: usize| busy[c].saturating_sub(busy0[c]);
                live.busy_on_caller += busy.get(caller).map_or(0, |_| delta(caller));
                live.busy_samples += (0..busy.len()).map(delta).sum::<u64>();
            }
            if let Some((caller, _)) = plain_here {
                crate::pin::to(caller);
            }
            live.elapsed += t;
            live.last_epoch = t;
            if trace_this {
                live.trainer.sync()?;
                trace::stop();
            } else {
                live.epochs.push(t);
            }
        }
        if let Some((_, kernels)) = pins.filter(|_| e == 0) {
            // Threads the VMs started during the first epochs (a lazy job's workers start
            // at its first launch) began on the caller CPU.
            crate::pin::adopt(kernels);
        }
    }
    if let Some((_, kernels)) = pins {
        crate::pin::restore();
        let off = crate::pin::misplaced(kernels);
        if !off.is_empty() {
            eprintln!(
                "warning: threads left off the kernel CPU {kernels} (the modes' kernels may not share a CPU): {}",
                off.join(", ")
            );
        }
    }
    let mut runs = Vec::with_capacity(lives.len());
    for (mut live, vm) in lives.into_iter().zip(&vms) {
        let weights = live.trainer.weights()?;
        let mut counters = match vm {
            Some((vm, _, _)) => Counters::of(&vm.stats()?),
            None => Counters::default(),
        };
        counters.busy_on_caller = live.busy_on_caller;
        counters.busy_samples = live.busy_samples;
        let accuracy = program::accuracy(&prog.layers, &weights, &setup.test.x, &setup.test.y);
        runs.push(Run {
            mode: live.mode,
            losses: live.losses,
            elapsed: live.elapsed,
            last_epoch: live.last_epoch,
            epochs: live.epochs,
            weights,
            accuracy,
            read_lat: live.trainer.read_latencies().to_vec(),
            counters,
        });
    }
    for (vm, _, _) in vms.into_iter().flatten() {
        vm.shutdown()?;
    }
    Ok(runs)
}

/// A VM's counters, summed over runs: fusion (`Config::fusion`) and contention.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    runs: usize,
    instructions: usize,
    longest: usize,
    received: usize,
    caller_ran: usize,
    handed_over: usize,
    cpu_shared: usize,
    preempted: usize,
    worker_stalled: usize,
    caller_preempted: usize,
    crowded: usize,
    tiny_kernel_marks: usize,
    /// Samples of the busy threads (`--hog`) during this mode's epochs: on the caller's
    /// CPU, and in all (pinned runs only).
    busy_on_caller: u64,
    busy_samples: u64,
}

impl Counters {
    pub fn of(s: &ivm::ivm_std::VmStats) -> Self {
        let sum = |f: fn(&ivm::ivm_std::ThreadStats) -> usize| s.threads.iter().map(f).sum();
        Self {
            runs: s.fused_runs,
            instructions: s.fused_instructions,
            longest: s.longest_fused_run,
            received: s.received,
            caller_ran: s.caller_ran,
            handed_over: sum(|t| t.handed_over),
            cpu_shared: sum(|t| t.cpu_shared),
            preempted: sum(|t| t.preempted),
            worker_stalled: s.worker_stalled,
            caller_preempted: s.caller_preempted,
            crowded: s.crowded,
            tiny_kernel_marks: s.tiny_kernel_marks,
            busy_on_caller: 0,
            busy_samples: 0,
        }
    }

    /// The busy threads' share of samples on the caller's CPU during this mode's epochs,
    /// in percent (pinned runs with `--hog` only).
    pub fn busy_share(&self) -> Option<f64> {
        (self.busy_samples > 0)
            .then(|| 100.0 * self.busy_on_caller as f64 / self.busy_samples as f64)
    }

    pub fn add(&mut self, o: &Self) {
        self.runs += o.runs;
        self.instructions += o.instructions;
        self.longest = self.longest.max(o.longest);
        self.received += o.received;
        self.caller_ran += o.caller_ran;
        self.handed_over += o.handed_over;
        self.cpu_shared += o.cpu_shared;
        self.preempted += o.preempted;
        self.worker_stalled += o.worker_stalled;
        self.caller_preempted += o.caller_preempted;
        self.crowded += o.crowded;
        self.tiny_kernel_marks += o.tiny_kernel_marks;
        self.busy_on_caller += o.busy_on_caller;
        self.busy_samples += o.busy_samples;
    }
}

/// Fusion, then where the VM's threads met contention (`VmStats`, `ThreadStats`).
impl std::fmt::Display for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} fused runs, mean length {:.1}, longest {}; {:.1} % of {} instructions fused; \
             callers ran {} instructions; workers: {} hand-overs to a waiting caller, {} \
             stretches on a shared CPU, {} preemptions seen while polling; callers: {} \
             stalled workers seen, {} preemptions seen, {} looks at a busy neighbour; {} tiny-kernel \
             marks",
            self.runs,
            self.instructions as f64 / self.runs.max(1) as f64,
            self.longest,
            100.0 * self.instructions as f64 / self.received.max(1) as f64,
            self.received,
            self.caller_ran,
            self.handed_over,
            self.cpu_shared,
            self.preempted,
            self.worker_stalled,
            self.caller_preempted,
            self.crowded,
            self.tiny_kernel_marks,
        )?;
        if let Some(busy) = self.busy_share() {
            write!(
                f,
                "; busy threads on the caller's CPU {busy:.0} % of its epochs"
            )?;
        }
        Ok(())
    }
}

/// Median and quartiles of a sample.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub q1: f64,
    pub median: f64,
    pub q3: f64,
    pub n: usize,
}

impl Spread {
    pub fn of(mut v: Vec<f64>) -> Option<Spread> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let x = p * (v.len() - 1) as f64;
            let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
        };
        Some(Spread {
            q1: at(0.25),
            median: at(0.5),
            q3: at(0.75),
            n: v.len(),
        })
    }
}

/// The ratio of every epoch of `mode` to plain's same epoch of the same run, over all
/// runs (`runs[r]` is run r's modes).
pub fn ratios(runs: &[Vec<Run>], mode: Mode) -> Vec<f64> {
    let mut out = Vec::new();
    for run in runs {
        let (Some(p), Some(m)) = (
            run.iter().find(|r| r.mode == Mode::Plain),
            run.iter().find(|r| r.mode == mode),
        ) else {
            continue;
        };
        for (pe, me) in p.epochs.iter().zip(&m.epochs) {
            out.push(me.as_secs_f64() / pe.as_secs_f64());
        }
    }
    out
}
