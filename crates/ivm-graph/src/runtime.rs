//! The actors of a running graph, their threads, and the register protocol between them.
//!
//! Every actor has one counter, `done`: the iterations it has finished. For an edge
//! `P → C`, `P.done − C.done` is the number of P's tokens C has not consumed yet. C fires
//! iteration `i = C.done` once every predecessor has `done > i`, and P fires iteration
//! `j = P.done` once every successor has `j − done < depth`. A produced blob has `depth`
//! register slots; iteration `i` uses slot `i % depth`. So when P writes slot `j % depth`,
//! every consumer has finished iteration `j − depth`, the last user of that slot, and
//! when C reads slot `i % depth`, P has finished writing it:
//!
//! * P writes the slot, then stores `done` with Release; C loads it with Acquire before
//!   reading (publishes the blob and the per-slot failure);
//! * C finishes reading, then stores its `done` with Release; P loads it with Acquire
//!   before overwriting the slot (orders C's reads before P's writes).
//!
//! Each actor's `done` is written only by the thread that runs the actor.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering, UnsafeCell};

use super::{GraphBuilder, GraphCtx, GraphEvent, KernelBody, Phase, TraceFn, describe};
use ivm_std::futex::FutexWait;
use ivm_std::lazy::{CriticalSectionInstance, JobInstance, LazyGraph, TryPop};
use ivm_std::{Error, Result};

/// Most scans a helping VM caller makes of one graph thread's actors per help
/// ([`Shared::help`]).
const HELP_SCANS: usize = 64;

/// How long an idle graph thread polls with spin-loop hints only before it starts
/// yielding (see `thread_loop`).
const POLL_PURE_SPIN: Duration = Duration::from_micros(2);

/// Locks `m`, taking the data of a poisoned mutex as it is: every mutex here guards data
/// that a panicking holder leaves consistent (a kernel panic is caught outside them).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `words` zero words, or why the host cannot provide them (sizes come from the user: an
/// error, never an abort).
fn try_zeroed_words(words: usize) -> std::result::Result<Box<[u64]>, String> {
    let mut w = Vec::new();
    w.try_reserve_exact(words).map_err(|_| {
        format!(
            "the host allocator refused {words} words ({} bytes)",
            words.saturating_mul(8)
        )
    })?;
    // Within the reserved capacity: no reallocation.
    w.resize(words, 0);
    Ok(w.into_boxed_slice())
}

/// A graph blob: `depth` register slots if an actor produces it, one (zero, read-only)
/// slot otherwise.
struct GBlob {
    nbytes: usize,
    slots: Box<[UnsafeCell<Box<[u64]>>]>,
}

// SAFETY: a slot is written only by the blob's producer actor while no consumer reads it,
// and read by consumers only after the producer published it (the register protocol in
// the module docs; each hand-over is a Release/Acquire pair on an actor's `done`).
unsafe impl Sync for GBlob {}

impl GBlob {
    /// `slots` zero-filled slots of `nbytes`, or why the host cannot provide them.
    fn new(nbytes: usize, slots: usize) -> std::result::Result<Self, String> {
        let words = nbytes.div_ceil(8);
        let mut v = Vec::new();
        v.try_reserve_exact(slots)
            .map_err(|_| format!("{slots} register slots do not fit in memory"))?;
        for _ in 0..slots {
            v.push(UnsafeCell::new(try_zeroed_words(words)?));
        }
        Ok(Self {
            nbytes,
            slots: v.into_boxed_slice(),
        })
    }

    fn slot_index(&self, iteration: usize) -> usize {
        iteration % self.slots.len()
    }

    /// The slot of `iteration`.
    ///
    /// # Safety
    /// The caller is a consumer firing `iteration` (its producer published the slot and
    /// cannot overwrite it before the caller's `done` moves past `iteration`), or a
    /// constant blob; the slice does not outlive the firing.
    unsafe fn read(&self, iteration: usize) -> &[u8] {
        let nbytes = self.nbytes;
        // SAFETY: by the caller's contract no write to this slot runs concurrently; the
        // box holds at least `nbytes` initialised bytes.
        self.slots[self.slot_index(iteration)]
            .with(|p| unsafe { std::slice::from_raw_parts((*p).as_ptr().cast::<u8>(), nbytes) })
    }

    /// The slot of `iteration`, mutably.
    ///
    /// # Safety
    /// The caller is the blob's producer firing `iteration` (every consumer finished the
    /// slot's previous iteration); the slice does not outlive the firing and is the only
    /// one.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write(&self, iteration: usize) -> &mut [u8] {
        let nbytes = self.nbytes;
        // SAFETY: by the caller's contract this is the only access to the slot.
        self.slots[self.slot_index(iteration)].with_mut(|p| unsafe {
            std::slice::from_raw_parts_mut((*p).as_mut_ptr().cast::<u8>(), nbytes)
        })
    }
}

/// The part of an actor every thread sees.
struct ActorShared {
    name: Arc<str>,
    thread: usize,
    preds: Vec<usize>,
    succs: Vec<usize>,
    /// Iterations finished (written by the actor's thread only).
    done: AtomicUsize,
    /// Per register slot: the failure of the iteration using it, as seen by this actor.
    failures: Box<[Mutex<Option<Error>>]>,
    /// Per register slot: whether `failures` holds one (written by the actor's thread
    /// before its Release store of `done`, read after an Acquire load of it), so that a
    /// successor locks `failures` only when there is a failure to read.
    failed: Box<[AtomicBool]>,
    /// Position among parameter kernels.
    param: Option<usize>,
    /// The parameter kernel after this one (the next turn), if this is one.
    next_param: Option<usize>,
}

/// The part of an actor its thread owns.
enum Local {
    SourceTick,
    Wait {
        held: Vec<Arc<CriticalSectionInstance>>,
    },
    Input {
        op: usize,
        blob: usize,
    },
    Output {
        op: usize,
        blob: usize,
    },
    Compute {
        reads: Vec<usize>,
        writes: Vec<usize>,
        body: KernelBody,
    },
    Callback {
        held: Vec<Arc<CriticalSectionInstance>>,
    },
    Notifier,
}

struct LocalActor {
    id: usize,
    kind: Local,
}

/// What one graph thread runs: its actors, split into kernels and protocol actors, and the
/// scan's job cache. Behind a lock in [`Shared::threads`], held for one scan by the thread,
/// or by a VM caller running the graph ([`GraphBuilder::run_on_caller`]).
#[derive(Default)]
struct ThreadActors {
    compute: Vec<LocalActor>,
    protocol: Vec<LocalActor>,
    /// Per compute actor: the positions in `protocol` of its protocol successors (the
    /// outputs copying what it writes, the callback notifier).
    proto_succs: Vec<Vec<usize>>,
    job: JobCache,
}

impl ThreadActors {
    fn new(s: &Shared, actors: Vec<LocalActor>) -> Self {
        let (compute, protocol): (Vec<LocalActor>, Vec<LocalActor>) = actors
            .into_iter()
            .partition(|a| matches!(a.kind, Local::Compute { .. }));
        let proto_succs = compute
            .iter()
            .map(|k| {
                s.actors[k.id]
                    .succs
                    .iter()
                    .filter_map(|&c| protocol.iter().position(|p| p.id == c))
                    .collect()
            })
            .collect();
        Self {
            compute,
            protocol,
            proto_succs,
            job: None,
        }
    }
}

pub(crate) struct Shared {
    job: Arc<str>,
    lazy: LazyGraph,
    depth: usize,
    blobs: Vec<GBlob>,
    actors: Vec<ActorShared>,
    notifiers: Vec<Arc<Notifier<FutexWait>>>,
    /// Each graph thread's actors (see [`ThreadActors`]).
    threads: Vec<Mutex<ThreadActors>>,
    param_kernels: usize,
    /// `iteration * param_kernels + position` of the parameter kernel whose turn it is.
    param_turn: AtomicUsize,
    /// Job instances of started iterations, oldest first (source tick pushes, callback
    /// notifier pops).
    jobs: Mutex<VecDeque<(usize, Arc<JobInstance>)>>,
    stop: AtomicBool,
    /// Runs finished by the callback notifier (counted before the launch is finished).
    runs_finished: AtomicUsize,
    trace: Option<TraceFn>,
    /// How long an idle thread polls before it sleeps ([`GraphBuilder::poll_window`]).
    poll: Duration,
}

/// A running graph: its actors' threads and its [`LazyGraph`]. Launch it with
/// [`InstructionsBuilder::launch_lazy_job`](ivm_std::InstructionsBuilder::launch_lazy_job)
/// passing [`Graph::lazy`]. See the [module docs](super).
pub struct Graph {
    shared: Arc<Shared>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("job", &self.shared.job)
            .field("actors", &self.shared.actors.len())
            .field("threads", &self.shared.notifiers.len())
            .field("iterations_done", &self.iterations_done())
            .finish()
    }
}

impl Graph {
    /// The description the VM launches.
    pub fn lazy(&self) -> &LazyGraph {
        &self.shared.lazy
    }

    /// The job name.
    pub fn job_name(&self) -> &str {
        &self.shared.job
    }

    /// Number of actor threads.
    pub fn num_threads(&self) -> usize {
        self.shared.notifiers.len()
    }

    /// Runs finished by the callback notifier (failed or not). A run is counted before
    /// its launch instruction is marked done, so once eager code has seen a run's launch
    /// complete, the count includes it.
    pub fn iterations_done(&self) -> u64 {
        // Relaxed: a count; the run's effects are published through the VM.
        self.shared.runs_finished.load(Ordering::Relaxed) as u64
    }

    /// The names of the actors, with the thread each runs on.
    pub fn actors(&self) -> Vec<(String, usize)> {
        self.shared
            .actors
            .iter()
            .map(|a| (a.name.to_string(), a.thread))
            .collect()
    }

    /// Stops the graph: closes its buffers, lets each thread finish the kernel it is
    /// running, joins the threads, and fails every unfinished run with
    /// [`Error::GraphClosed`]. Idempotent; also run on drop.
    pub fn shutdown(&self) {
        let s = &self.shared;
        // Release: a thread that sees `stop` exits after its current firing.
        s.stop.store(true, Ordering::Release);
        s.lazy.close();
        for n in &s.notifiers {
            n.close();
        }
        let handles = std::mem::take(&mut *lock(&self.handles));
        for h in handles {
            if h.thread().id() == std::thread::current().id() {
                // Dropped from one of its own kernels: the thread exits by itself.
                continue;
            }
            let _ = h.join();
        }
        let jobs = std::mem::take(&mut *lock(&s.jobs));
        for (_, job) in jobs {
            job.finish(Err(Error::GraphClosed {
                job: s.job.to_string(),
            }));
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn dedup(v: &mut Vec<usize>) {
    v.sort_unstable();
    v.dedup();
}

/// Checks `b`, lays out the actors and starts the threads.
pub(crate) fn build(mut b: GraphBuilder) -> Result<Graph> {
    let lazy = describe(&b)?;
    let nblobs = b.blobs.len();
    let nthreads = b.threads.max(1);
    // Threads that run compute kernels: 1.. (thread 0 runs the protocol actors), or
    // thread 0 alone in a one-thread graph.
    let first_compute = usize::from(nthreads > 1);
    // Producer of each blob: actor index, filled below.
    let mut producer: Vec<Option<usize>> = vec![None; nblobs];
    let check_blob = |b: &GraphBuilder, x: usize, what: &str| -> Result<()> {
        if x >= nblobs {
            return Err(b.invalid(format!("{what}: unknown blob #{x}")));
        }
        Ok(())
    };

    // Actor layout: 0 source tick, 1 wait, inputs, kernels, outputs, callback, notifier.
    const SOURCE: usize = 0;
    const WAIT: usize = 1;
    let mut names: Vec<Arc<str>> = vec!["source-tick".into(), "wait".into()];
    let mut threads: Vec<usize> = vec![0, 0];
    let mut preds: Vec<Vec<usize>> = vec![vec![], vec![SOURCE]];
    let mut locals: Vec<Local> = vec![Local::SourceTick, Local::Wait { held: Vec::new() }];
    let mut interface_actors = Vec::new();

    for (op, i) in b.inputs.iter().enumerate() {
        check_blob(&b, i.blob, &format!("input `{}`", i.name))?;
        if !i.valid {
            continue;
        }
        let id = names.len();
        producer[i.blob] = Some(id);
        names.push(format!("input/{}", i.name).into());
        threads.push(0);
        preds.push(vec![WAIT]);
        locals.push(Local::Input { op, blob: i.blob });
        interface_actors.push(id);
    }
    let invalid_input_blobs: Vec<usize> = b
        .inputs
        .iter()
        .filter(|i| !i.valid)
        .map(|i| i.blob)
        .collect();

    let mut kernel_actors = Vec::new();
    let mut param_kernels = 0;
    let mut param_of: Vec<Option<usize>> = vec![None, None];
    param_of.resize(names.len(), None);
    let kernels = std::mem::take(&mut b.kernels);
    let mut rr = 0;
    for k in kernels {
        let id = names.len();
        let what = format!("kernel `{}`", k.name);
        let mut p = Vec::new();
        for &r in &k.reads {
            check_blob(&b, r, &what)?;
            match producer[r] {
                Some(a) => p.push(a),
                None if invalid_input_blobs.contains(&r) => {}
                None => {
                    return Err(b.invalid(format!(
                        "{what} reads blob `{}`, which no earlier kernel or input writes",
                        b.blobs[r].name
                    )));
                }
            }
        }
        for (n, &w) in k.writes.iter().enumerate() {
            check_blob(&b, w, &what)?;
            if k.reads.contains(&w) || k.writes[..n].contains(&w) {
                return Err(b.invalid(format!(
                    "{what} writes blob `{}` twice or also reads it",
                    b.blobs[w].name
                )));
            }
            if producer[w].is_some() || invalid_input_blobs.contains(&w) {
                return Err(b.invalid(format!(
                    "{what} writes blob `{}`, which is already written elsewhere",
                    b.blobs[w].name
                )));
            }
            producer[w] = Some(id);
        }
        if p.is_empty() {
            p.push(WAIT);
        }
        dedup(&mut p);
        let thread = match k.thread {
            Some(t) if (first_compute..nthreads).contains(&t) => t,
            Some(t) => {
                return Err(b.invalid(format!(
                    "{what} on thread {t}: kernels run on threads {first_compute}..{nthreads}"
                )));
            }
            None => {
                let t = first_compute + rr % (nthreads - first_compute);
                rr += 1;
                t
            }
        };
        names.push(k.name.clone());
        threads.push(thread);
        preds.push(p);
        param_of.push(k.params.then(|| {
            param_kernels += 1;
            param_kernels - 1
        }));
        locals.push(Local::Compute {
            reads: k.reads,
            writes: k.writes,
            body: k.body,
        });
        kernel_actors.push(id);
    }

    for (op, o) in b.outputs.iter().enumerate() {
        check_blob(&b, o.blob, &format!("output `{}`", o.name))?;
        if !o.valid {
            continue;
        }
        if producer[o.blob].is_none() && !invalid_input_blobs.contains(&o.blob) {
            return Err(b.invalid(format!(
                "output `{}` copies blob `{}`, which nothing writes",
                o.name, b.blobs[o.blob].name
            )));
        }
        let id = names.len();
        let mut p = vec![WAIT];
        p.extend(producer[o.blob]);
        dedup(&mut p);
        names.push(format!("output/{}", o.name).into());
        threads.push(0);
        preds.push(p);
        param_of.push(None);
        locals.push(Local::Output { op, blob: o.blob });
        interface_actors.push(id);
    }

    let callback = names.len();
    names.push("callback".into());
    threads.push(0);
    preds.push(if interface_actors.is_empty() {
        vec![WAIT]
    } else {
        interface_actors.clone()
    });
    param_of.push(None);
    locals.push(Local::Callback { held: Vec::new() });

    // Successors, then the notifier after the callback and every sink.
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
    for (a, ps) in preds.iter().enumerate() {
        for &p in ps {
            succs[p].push(a);
        }
    }
    let notifier = names.len();
    let mut np = vec![callback];
    np.extend(
        kernel_actors
            .iter()
            .copied()
            .filter(|&k| succs[k].is_empty()),
    );
    for &p in &np {
        succs[p].push(notifier);
    }
    names.push("callback-notifier".into());
    threads.push(0);
    preds.push(np);
    param_of.push(None);
    succs.push(Vec::new());
    locals.push(Local::Notifier);
    param_of.resize(names.len(), None);

    let depth = b.depth.max(1);
    // Sizes and the depth come from the user: allocate fallibly (an error, never an abort).
    let oom = |nbytes: usize, what: &str, detail: String| Error::OutOfMemory {
        nbytes,
        stream: format!("cpu (graph `{}`, {what})", b.job),
        detail,
    };
    let blobs = b
        .blobs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            GBlob::new(d.nbytes, if producer[i].is_some() { depth } else { 1 })
                .map_err(|e| oom(d.nbytes, &format!("blob `{}`", d.name), e))
        })
        .collect::<Result<Vec<_>>>()?;
    let per_slot = |n: usize| {
        let mut failures = Vec::new();
        let mut failed = Vec::new();
        if failures.try_reserve_exact(n).is_err() || failed.try_reserve_exact(n).is_err() {
            return Err(oom(
                0,
                "actor slots",
                format!("pipeline depth {n} does not fit in memory"),
            ));
        }
        failures.extend((0..n).map(|_| Mutex::new(None)));
        failed.extend((0..n).map(|_| AtomicBool::new(false)));
        Ok((failures.into_boxed_slice(), failed.into_boxed_slice()))
    };
    let actors: Vec<ActorShared> = names
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            let (failures, failed) = per_slot(depth)?;
            Ok(ActorShared {
                name,
                thread: threads[i],
                preds: std::mem::take(&mut preds[i]),
                succs: std::mem::take(&mut succs[i]),
                done: AtomicUsize::new(0),
                failures,
                failed,
                param: param_of[i],
                next_param: param_of[i].and_then(|p| {
                    let next = (p + 1) % param_kernels;
                    param_of.iter().position(|&x| x == Some(next))
                }),
            })
        })
        .collect::<Result<_>>()?;
    // The thread count comes from the user too: one notifier and one actor list each.
    let mut notifiers: Vec<Arc<Notifier<FutexWait>>> = Vec::new();
    let mut per_thread: Vec<Vec<LocalActor>> = Vec::new();
    if notifiers.try_reserve_exact(nthreads).is_err()
        || per_thread.try_reserve_exact(nthreads).is_err()
    {
        return Err(oom(
            0,
            "threads",
            format!("{nthreads} graph threads do not fit in memory"),
        ));
    }
    notifiers.extend((0..nthreads).map(|_| Arc::new(Notifier::new())));
    per_thread.extend((0..nthreads).map(|_| Vec::new()));

    // Buffers wake the thread of the actor that pops them.
    let bufs = lazy.buffers();
    let wake = |t: usize| {
        let n = notifiers[t].clone();
        move || {
            let _ = n.notify();
        }
    };
    bufs.source_tick.set_listener(wake(actors[SOURCE].thread));
    bufs.wait.set_listener(wake(actors[WAIT].thread));
    bufs.callback.set_listener(wake(actors[callback].thread));
    bufs.callback_notifier
        .set_listener(wake(actors[notifier].thread));
    for (a, l) in locals.iter().enumerate() {
        match l {
            Local::Input { op, .. } => {
                if let Some(buf) = &bufs.inputs[*op] {
                    buf.set_listener(wake(actors[a].thread));
                }
            }
            Local::Output { op, .. } => {
                if let Some(buf) = &bufs.outputs[*op] {
                    buf.set_listener(wake(actors[a].thread));
                }
            }
            _ => {}
        }
    }

    let shared = Arc::new(Shared {
        job: b.job.clone().into(),
        lazy,
        depth,
        blobs,
        actors,
        notifiers,
        threads: (0..nthreads).map(|_| Mutex::default()).collect(),
        param_kernels,
        param_turn: AtomicUsize::new(0),
        jobs: Mutex::new(VecDeque::new()),
        stop: AtomicBool::new(false),
        runs_finished: AtomicUsize::new(0),
        poll: b.poll,
        trace: b.trace.take(),
    });

    for (id, kind) in locals.into_iter().enumerate() {
        per_thread[shared.actors[id].thread].push(LocalActor { id, kind });
    }
    for (t, actors) in per_thread.into_iter().enumerate() {
        *lock(&shared.threads[t]) = ThreadActors::new(&shared, actors);
    }
    let graph = Graph {
        shared: shared.clone(),
        handles: Mutex::new(Vec::new()),
    };
    for t in 0..nthreads {
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name(format!("graph-{}-t{t}", shared.job))
            .spawn(move || thread_loop(&s, t))
            .map_err(|e| Error::Spawn(e.to_string()))?;
        lock(&graph.handles).push(h);
    }
    if b.on_caller {
        // A weak reference: the VM keeps the helper as long as it lives, the graph's
        // state goes with the graph.
        let weak = Arc::downgrade(&shared);
        shared
            .lazy
            .set_caller_helper(move || weak.upgrade().is_some_and(|s| s.help()));
    }
    Ok(graph)
}

fn thread_loop(s: &Shared, t: usize) {
    ivm_std::lazy::mark_graph_thread();
    let notifier = &s.notifiers[t];
    // Polling: spin-loop hints for a moment (the next firing of a busy graph comes within
    // microseconds), then yield the CPU (few cores: do not starve the threads that feed
    // us) until the poll window ends.
    let backoff = ivm_core::sync::Backoff::new();
    let mut idle_since: Option<Instant> = None;
    loop {
        // Acquire: pairs with `shutdown`'s Release store.
        if s.stop.load(Ordering::Acquire) {
            break;
        }
        let any = {
            let mut actors = lock(&s.threads[t]);
            let any = scan(s, t, &mut actors);
            if !any {
                // Idle: let go of the last job instance (its parameter tensors) meanwhile.
                actors.job = None;
            }
            any
        };
        if any {
            idle_since = None;
            backoff.reset();
            continue;
        }
        if !s.poll.is_zero() {
            let idle = idle_since.get_or_insert_with(Instant::now).elapsed();
            if idle < s.poll {
                if idle < POLL_PURE_SPIN {
                    ivm_core::sync::spin_loop();
                } else {
                    backoff.snooze();
                }
                continue;
            }
        }
        idle_since = None;
        backoff.reset();
        // Whatever makes one of our actors ready afterwards notifies us; a notification
        // that arrived during the scan is still pending, so this returns at once.
        if notifier.wait_and_clear().is_err() {
            break;
        }
    }
    // Held critical-section instances drop here: unfinished ones fail their records.
    drop(std::mem::take(&mut *lock(&s.threads[t])));
}

/// One scan of graph thread `t`'s actors (by the thread, or by a VM caller running the
/// graph): fires every ready actor once or more; whether any fired.
fn scan(s: &Shared, t: usize, st: &mut ThreadActors) -> bool {
    let notifier = &s.notifiers[t];
    let ThreadActors {
        compute,
        protocol,
        proto_succs,
        job,
    } = st;
    let mut any = false;
    for (k, succs) in compute.iter_mut().zip(proto_succs.iter()) {
        if try_fire(s, k, job) {
            any = true;
            // Protocol actors first after every kernel: an output copies its blob out
            // as soon as it is produced (the eager side may go on while later kernels
            // run); and if anything was pushed to the job's buffers (their listeners
            // notify this thread), the next run's actors get their turn before more
            // kernels.
            for &p in succs {
                try_fire(s, &mut protocol[p], job);
            }
            if notifier.pending() > 0 {
                // Consumes the notifications: the Acquire fence after the clearing RMW
                // (which reads the notifiers' Release RMWs) makes what they published
                // before notifying — a buffer push, another thread's `done` — visible
                // to every scan from here on, so no notification the final sleep
                // would have relied on is lost.
                notifier.clear();
                ivm_core::sync::fence(Ordering::Acquire);
                for p in protocol.iter_mut() {
                    try_fire(s, p, job);
                }
            }
        }
    }
    for p in protocol.iter_mut() {
        if try_fire(s, p, job) {
            any = true;
        }
    }
    any
}

impl Shared {
    /// A VM caller runs the graph ([`GraphBuilder::run_on_caller`]): scans each graph
    /// thread whose actors nobody is scanning now until a scan finds nothing ready — the
    /// thread's own condition for sleeping, so no actor made ready by a notification the
    /// scans consumed is left for a thread that sleeps. Never waits for a lock.
    fn help(&self) -> bool {
        let mut any = false;
        for (t, actors) in self.threads.iter().enumerate() {
            // Acquire: as in `thread_loop`; a stopped graph's actors are gone or going.
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let mut actors = match actors.try_lock() {
                Ok(a) => a,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => continue,
            };
            // At most `HELP_SCANS` scans: a caller whose wait is over must not stay here
            // while other threads keep feeding the graph. Stopping with work still ready
            // hands it to the graph's thread, which a notification wakes.
            let mut scans = 0;
            while scan(self, t, &mut actors) {
                any = true;
                scans += 1;
                if scans == HELP_SCANS {
                    let _ = self.notifiers[t].notify();
                    break;
                }
            }
        }
        any
    }

    fn notify(&self, actor: usize) {
        let _ = self.notifiers[self.actors[actor].thread].notify();
    }

    fn trace(&self, actor: usize, iteration: usize, phase: Phase, failed: bool) {
        if let Some(f) = &self.trace {
            let ev = GraphEvent {
                actor: self.actors[actor].name.clone(),
                iteration: iteration as u64,
                phase,
                failed,
            };
            let _ = catch_unwind(AssertUnwindSafe(|| f(&ev)));
        }
    }

    fn failure_name(&self, actor: usize) -> String {
        format!("graph `{}` kernel `{}`", self.job, self.actors[actor].name)
    }
}

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

/// Fires actor `a` once if it is ready. Returns whether it fired.
/// The job instance of the iteration this thread's parameter kernels last ran (saves the
/// lookup in `Shared::jobs` for every parameter kernel of an iteration but the first).
type JobCache = Option<(usize, Arc<JobInstance>)>;

fn try_fire(s: &Shared, a: &mut LocalActor, job_cache: &mut JobCache) -> bool {
    let me = &s.actors[a.id];
    // Relaxed: only this thread writes our own counter.
    let it = me.done.load(Ordering::Relaxed);
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
    let bufs = s.lazy.buffers();
    // External input, taken only once everything else is ready (so a popped item is
    // always used at once).
    let mut job: Option<Arc<JobInstance>> = None;
    let mut cs: Option<Arc<CriticalSectionInstance>> = None;
    let ready = match &mut a.kind {
        Local::SourceTick => match bufs.source_tick.try_pop() {
            TryPop::Item(j) => {
                job = Some(j);
                true
            }
            _ => false,
        },
        Local::Notifier => match bufs.callback_notifier.try_pop() {
            TryPop::Item(j) => {
                job = Some(j);
                true
            }
            _ => false,
        },
        Local::Wait { held } => fill(&bufs.wait, held, 2),
        Local::Callback { held } => fill(&bufs.callback, held, 2),
        Local::Input { op, .. } => match bufs.inputs[*op].as_ref().map(|b| b.try_pop()) {
            Some(TryPop::Item(x)) => {
                cs = Some(x);
                true
            }
            _ => false,
        },
        Local::Output { op, .. } => match bufs.outputs[*op].as_ref().map(|b| b.try_pop()) {
            Some(TryPop::Item(x)) => {
                cs = Some(x);
                true
            }
            _ => false,
        },
        Local::Compute { .. } => true,
    };
    if !ready {
        return false;
    }

    let slot = it % s.depth;
    let upstream: Option<Error> = me.preds.iter().find_map(|&p| {
        let pred = &s.actors[p];
        // Relaxed: ordered by the Acquire load of the predecessor's `done` above.
        if pred.failed[slot].load(Ordering::Relaxed) {
            lock(&pred.failures[slot]).clone()
        } else {
            None
        }
    });
    s.trace(a.id, it, Phase::Start, upstream.is_some());
    let result: Option<Error> = match &mut a.kind {
        Local::SourceTick => {
            let j = job.take().expect("source tick fired with a job instance");
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
            let cs = cs.take().expect("input kernel fired with an instance");
            match upstream {
                Some(e) => {
                    cs.fail_op(*op, e.clone());
                    Some(e)
                }
                None => {
                    // SAFETY: we produce this blob and fire iteration `it`; every consumer
                    // finished iteration `it - depth` (checked above).
                    let dst = unsafe { s.blobs[*blob].write(it) };
                    cs.copy_input(*op, dst).err()
                }
            }
        }
        Local::Output { op, blob } => {
            let cs = cs.take().expect("output kernel fired with an instance");
            match upstream {
                Some(e) => {
                    cs.fail_op(*op, e.clone());
                    Some(e)
                }
                None => {
                    // SAFETY: the producer of this blob published iteration `it` (checked
                    // above) and cannot overwrite it before our `done` moves on.
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
            let j = job.take().expect("notifier fired with a job instance");
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
    };
    let failed = result.is_some();
    // Relaxed: only this thread writes our flags; published by the Release store of
    // `done` below.
    if failed || me.failed[slot].load(Ordering::Relaxed) {
        *lock(&me.failures[slot]) = result;
        me.failed[slot].store(failed, Ordering::Relaxed);
    }
    s.trace(a.id, it, Phase::End, failed);
    if me.param.is_some() {
        // Release: publishes our parameter accesses to the next parameter kernel.
        s.param_turn.fetch_add(1, Ordering::Release);
    }
    // Release: publishes the slot we wrote, our failure entry, and (to producers) that we
    // are done reading their slots of iteration `it`.
    me.done.store(it.wrapping_add(1), Ordering::Release);
    // Wake the threads of the actors this firing may have made ready. Our own thread
    // rescans after every firing: no notification needed for its actors.
    for &n in me.preds.iter().chain(&me.succs).chain(&me.next_param) {
        if s.actors[n].thread != me.thread {
            s.notify(n);
        }
    }
    true
}

/// Runs a compute kernel's body for iteration `it`; its failure, if it panicked.
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
    let job = if me.param.is_some() {
        // Iteration `it`'s instance stays in `jobs` until its callback notifier fires,
        // which waits (transitively) for every kernel of the iteration: a cached one for
        // `it` is the one `jobs` holds.
        match job_cache {
            Some((i, j)) if *i == it => Some(j.clone()),
            _ => {
                let j = lock(&s.jobs)
                    .iter()
                    .find(|(i, _)| *i == it)
                    .map(|(_, j)| j.clone());
                *job_cache = j.clone().map(|j| (it, j));
                j
            }
        }
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
        job: job.as_deref(),
    };
    match catch_unwind(AssertUnwindSafe(|| body(&mut ctx))) {
        Ok(()) => None,
        Err(payload) => {
            let message = panic_message(&*payload);
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            Some(Error::KernelPanicked {
                instruction: s.failure_name(id),
                message,
            })
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
