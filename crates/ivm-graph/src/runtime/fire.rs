//! Firing one actor: the readiness checks of the register protocol (parent module docs),
//! then what each kind of actor does for one iteration.

use std::sync::Arc;

use ivm_core::sync::Ordering;
use ivm_std::Error;
use ivm_std::lazy::{CriticalSectionInstance, JobBuffers, JobInstance, TryPop};

use super::{ActorShared, GraphCtx, KernelBody, Local, LocalActor, Phase, Shared, lock};

/// Pops one item of `buf` into `held` until it holds `n`; whether it does.
fn fill(
    buf: &ivm_std::lazy::Buffer<Arc<CriticalSectionInstance>>,
    held: &mut Vec<Arc<CriticalSectionInstance>>,
    n: usize,
) -> bool {
    while held.len() < n {
        match buf.try_pop() {
            TryPop::Item(x) => held.push(x),
            TryPop::Empty | TryPop::Closed => return false,
        }
    }
    true
}

/// The job instance of the iteration this thread's parameter kernels last ran (saves the
/// lookup in `Shared::jobs` for every parameter kernel of an iteration but the first).
pub(super) type JobCache = Option<(usize, Arc<JobInstance>)>;

/// Fires actor `a` once if it is ready. Returns whether it fired.
pub(super) fn try_fire(s: &Shared, a: &mut LocalActor, job_cache: &mut JobCache) -> bool {
    let me = &s.actors[a.id];
    // Relaxed: only this thread writes our own counter.
    let it = me.done.load(Ordering::Relaxed);
    if !neighbours_ready(s, me, it) {
        return false;
    }
    // External input, taken only once everything else is ready (so a popped item is
    // always used at once).
    let Some(popped) = pop_external(s.lazy.buffers(), &mut a.kind) else {
        return false;
    };
    let slot = it % s.depth;
    let upstream = upstream_failure(s, me, slot);
    s.trace(a.id, it, Phase::Start, upstream.is_some());
    let result = run_actor(s, a, it, upstream, popped, job_cache);
    let failed = record_failure(s, me, slot, result);
    s.trace(a.id, it, Phase::End, failed);
    publish(s, me, it);
    true
}

/// Whether `me` may fire iteration `it` as far as its neighbours go: every predecessor
/// finished it, every successor is less than `depth` iterations behind, and it is this
/// parameter kernel's turn.
fn neighbours_ready(s: &Shared, me: &ActorShared, it: usize) -> bool {
    for &p in &me.preds {
        // Acquire: pairs with the predecessor's Release store of `done`; publishes the
        // slot of iteration `it` and its failure.
        if s.actors[p].done.load(Ordering::Acquire).wrapping_sub(it) == 0 {
            return false;
        }
    }
    for &c in &me.succs {
        // Acquire: pairs with the successor's Release store of `done`; its reads of the
        // slot we are about to overwrite happened before.
        if it.wrapping_sub(s.actors[c].done.load(Ordering::Acquire)) >= s.depth {
            return false;
        }
    }
    if let Some(p) = me.param {
        let turn = it.wrapping_mul(s.param_kernels).wrapping_add(p);
        // Acquire: pairs with the previous parameter kernel's Release increment; its
        // parameter accesses happened before ours.
        if s.param_turn.load(Ordering::Acquire) != turn {
            return false;
        }
    }
    true
}

/// What an actor fires with from the VM's buffers: the source tick and the notifier pop a
/// job instance, an input or output actor a critical section instance.
enum Popped {
    Nothing,
    Job(Arc<JobInstance>),
    Instance(Arc<CriticalSectionInstance>),
}

impl Popped {
    fn job(self) -> Option<Arc<JobInstance>> {
        match self {
            Popped::Job(j) => Some(j),
            _ => None,
        }
    }

    fn instance(self) -> Option<Arc<CriticalSectionInstance>> {
        match self {
            Popped::Instance(cs) => Some(cs),
            _ => None,
        }
    }
}

/// Pops what actor `kind` fires with; `None` if it is not there yet.
fn pop_external(bufs: &JobBuffers, kind: &mut Local) -> Option<Popped> {
    match kind {
        Local::SourceTick => match bufs.source_tick.try_pop() {
            TryPop::Item(j) => Some(Popped::Job(j)),
            _ => None,
        },
        Local::Notifier => match bufs.callback_notifier.try_pop() {
            TryPop::Item(j) => Some(Popped::Job(j)),
            _ => None,
        },
        Local::Wait { held } => fill(&bufs.wait, held, 2).then_some(Popped::Nothing),
        Local::Callback { held } => fill(&bufs.callback, held, 2).then_some(Popped::Nothing),
        Local::Input { op, .. } => match bufs.inputs[*op].as_ref().map(|b| b.try_pop()) {
            Some(TryPop::Item(x)) => Some(Popped::Instance(x)),
            _ => None,
        },
        Local::Output { op, .. } => match bufs.outputs[*op].as_ref().map(|b| b.try_pop()) {
            Some(TryPop::Item(x)) => Some(Popped::Instance(x)),
            _ => None,
        },
        Local::Compute { .. } => Some(Popped::Nothing),
    }
}

/// The failure a predecessor of `me` passes on for the iteration using `slot`, if any.
fn upstream_failure(s: &Shared, me: &ActorShared, slot: usize) -> Option<Error> {
    // Relaxed: a predecessor that failed iteration `it` counted its flag in `failing`
    // before its Release store of `done`, which our Acquire load in `neighbours_ready`
    // read, so we read its increment or a later value; it takes the flag out only when it
    // fires iteration `it + depth` without failing, after we are done with `it`. So zero
    // means no predecessor failed it.
    if s.failing.load(Ordering::Relaxed) == 0 {
        None
    } else {
        me.preds.iter().find_map(|&p| {
            let pred = &s.actors[p];
            // Relaxed: ordered by the Acquire load of the predecessor's `done` in
            // `neighbours_ready`.
            if pred.failed[slot].load(Ordering::Relaxed) {
                lock(&pred.failures[slot]).clone()
            } else {
                None
            }
        })
    }
}

/// What actor `a` does for iteration `it`, given the failure its predecessors pass on and
/// what it popped; its failure.
fn run_actor(
    s: &Shared,
    a: &mut LocalActor,
    it: usize,
    upstream: Option<Error>,
    popped: Popped,
    job_cache: &mut JobCache,
) -> Option<Error> {
    match &mut a.kind {
        Local::SourceTick => {
            let j = popped.job().expect("source tick fired with a job instance");
            // A poisoned parameter fails the iteration: no kernel computes from it, the
            // outputs are poisoned with its error, and the run finishes with it.
            let poisoned = j.param_poison();
            lock(&s.jobs).push_back((it, j));
            poisoned
        }
        Local::Wait { held } => {
            held.clear();
            upstream
        }
        Local::Input { op, blob } => {
            let cs = popped
                .instance()
                .expect("input kernel fired with an instance");
            match upstream {
                Some(e) => {
                    cs.fail_op(*op, e.clone());
                    Some(e)
                }
                None => {
                    // SAFETY: we produce this blob and fire iteration `it`; every consumer
                    // finished iteration `it - depth` (checked in `neighbours_ready`).
                    let dst = unsafe { s.blobs[*blob].write(it) };
                    cs.copy_input(*op, dst).err()
                }
            }
        }
        Local::Output { op, blob } => {
            let cs = popped
                .instance()
                .expect("output kernel fired with an instance");
            match upstream {
                Some(e) => {
                    cs.fail_op(*op, e.clone());
                    Some(e)
                }
                None => {
                    // SAFETY: the producer of this blob published iteration `it` (checked
                    // in `neighbours_ready`) and cannot overwrite it before our `done`
                    // moves on.
                    let src = unsafe { s.blobs[*blob].read(it) };
                    cs.copy_output(*op, src).err()
                }
            }
        }
        Local::Compute {
            reads,
            writes,
            body,
        } => match upstream {
            Some(e) => Some(e),
            None => run_kernel(s, a.id, it, reads, writes, body, job_cache),
        },
        Local::Callback { held } => {
            for cs in held.drain(..) {
                match &upstream {
                    Some(e) => cs.finish_with_error(e),
                    None => cs.finish(),
                }
            }
            upstream
        }
        Local::Notifier => {
            let j = popped.job().expect("notifier fired with a job instance");
            finish_run(s, it, j, upstream)
        }
    }
}

/// The callback notifier's firing: finishes job instance `j` of iteration `it`.
fn finish_run(
    s: &Shared,
    it: usize,
    j: Arc<JobInstance>,
    upstream: Option<Error>,
) -> Option<Error> {
    let started = lock(&s.jobs).pop_front();
    debug_assert!(
        started
            .as_ref()
            .is_some_and(|(i, sj)| *i == it && Arc::ptr_eq(sj, &j)),
        "ivm graph: callback notifier out of step with the source tick"
    );
    drop(started);
    // Relaxed: a count (see `Graph::iterations_done`); the job's completion below
    // happens after it in this thread.
    s.runs_finished.fetch_add(1, Ordering::Relaxed);
    j.finish(match &upstream {
        Some(e) => Err(e.clone()),
        None => Ok(()),
    });
    upstream
}

/// Records `me`'s failure of the iteration using `slot` (or that it no longer fails it)
/// for its successors, and counts the flags set in `failing`; whether it failed.
fn record_failure(s: &Shared, me: &ActorShared, slot: usize, result: Option<Error>) -> bool {
    let failed = result.is_some();
    // Relaxed: only this thread writes our flags; published by the Release store of
    // `done` in `publish`.
    let was_failed = me.failed[slot].load(Ordering::Relaxed);
    if failed || was_failed {
        *lock(&me.failures[slot]) = result;
        me.failed[slot].store(failed, Ordering::Relaxed);
        // Relaxed: ordered for our successors by the Release store of `done` in `publish`
        // (the argument is in `upstream_failure`, where `failing` is read).
        if failed && !was_failed {
            s.failing.fetch_add(1, Ordering::Relaxed);
        } else if !failed && was_failed {
            s.failing.fetch_sub(1, Ordering::Relaxed);
        }
    }
    failed
}

/// Ends `me`'s firing of iteration `it`: passes the parameter turn on, publishes `done`,
/// and notifies the threads of the neighbours.
fn publish(s: &Shared, me: &ActorShared, it: usize) {
    if me.param.is_some() {
        // Release: publishes our parameter accesses to the next parameter kernel.
        s.param_turn.fetch_add(1, Ordering::Release);
    }
    // Release: publishes the slot we wrote, our failure entry, and (to producers) that we
    // are done reading their slots of iteration `it`.
    me.done.store(it.wrapping_add(1), Ordering::Release);
    // Wake the threads of the actors this firing may have made ready. Our own thread
    // rescans after every firing: no notification needed for its actors.
    for &t in &me.remote_threads {
        let _ = s.notifiers[t].notify();
    }
}

/// Runs a compute kernel's body for iteration `it`; its failure, if it panicked.
// Out of line: the kernel path is long and its operand arrays large, and `try_fire`, which
// every scan runs for every actor (mostly to find it not ready), stays small without it.
#[inline(never)]
fn run_kernel(
    s: &Shared,
    id: usize,
    it: usize,
    reads: &[usize],
    writes: &[usize],
    body: &mut KernelBody,
    job_cache: &mut JobCache,
) -> Option<Error> {
    let me = &s.actors[id];
    let job: Option<&JobInstance> = if me.param.is_some() {
        // Iteration `it`'s instance stays in `jobs` until its callback notifier fires,
        // which waits (transitively) for every kernel of the iteration: a cached one for
        // `it` is the one `jobs` holds. Borrowed from the cache: no reference count
        // traffic per parameter kernel.
        if !matches!(job_cache, Some((i, _)) if *i == it) {
            *job_cache = lock(&s.jobs)
                .iter()
                .find(|(i, _)| *i == it)
                .map(|(_, j)| (it, j.clone()));
        }
        job_cache.as_ref().map(|(_, j)| &**j)
    } else {
        None
    };
    // The operand lists live on the stack up to `INLINE` operands (no allocation per
    // firing), on the heap beyond.
    const INLINE: usize = 8;
    // SAFETY: each read blob's producer published iteration `it` (or it is a constant);
    // nobody overwrites it before our `done` moves on.
    let read = |r: usize| unsafe { s.blobs[r].read(it) };
    // SAFETY: we produce these (distinct) blobs and fire iteration `it`; every consumer
    // finished the slot's previous iteration.
    let write = |w: usize| unsafe { s.blobs[w].write(it) };
    let mut ins_inline: [&[u8]; INLINE] = [&[]; INLINE];
    let ins_heap: Vec<&[u8]>;
    let ins: &[&[u8]] = if reads.len() <= INLINE {
        for (slot, &r) in ins_inline.iter_mut().zip(reads) {
            *slot = read(r);
        }
        &ins_inline[..reads.len()]
    } else {
        ins_heap = reads.iter().map(|&r| read(r)).collect();
        &ins_heap
    };
    let mut outs_inline: [&mut [u8]; INLINE] = Default::default();
    let mut outs_heap: Vec<&mut [u8]>;
    let outs: &mut [&mut [u8]] = if writes.len() <= INLINE {
        for (slot, &w) in outs_inline.iter_mut().zip(writes) {
            *slot = write(w);
        }
        &mut outs_inline[..writes.len()]
    } else {
        outs_heap = writes.iter().map(|&w| write(w)).collect();
        &mut outs_heap
    };
    let mut ctx = GraphCtx {
        kernel: &me.name,
        iteration: it as u64,
        reads: ins,
        writes: outs,
        job,
    };
    ivm_std::panics::catch(|| body(&mut ctx))
        .err()
        .map(|message| Error::KernelPanicked {
            instruction: s.failure_name(id),
            message,
        })
}
