//! Laying out a graph: checks the builder's description, places the actors (source tick,
//! wait, inputs, kernels, outputs, callback, notifier) on threads, allocates the blobs' register
//! slots and starts the threads.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crossbeam_utils::CachePadded;
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize};
use ivm_std::futex::FutexWait;
use ivm_std::lazy::LazyGraph;
use ivm_std::{Error, Result};

use super::blob::GBlob;
use super::{
    ActorShared, Graph, GraphBuilder, Local, LocalActor, Shared, ThreadActors, describe, lock,
    thread_loop,
};
use crate::builder::KernelDesc;

// Actor layout: 0 source tick, 1 wait, inputs, kernels, outputs, callback, notifier.
const SOURCE: usize = 0;
const WAIT: usize = 1;

fn dedup(v: &mut Vec<usize>) {
    v.sort_unstable();
    v.dedup();
}

/// Checks `b`, lays out the actors and starts the threads.
pub(crate) fn build(mut b: GraphBuilder) -> Result<Graph> {
    let lazy = describe(&b)?;
    let mut p = Placement::new(&b);
    p.place_inputs(&b)?;
    let kernels = std::mem::take(&mut b.kernels);
    p.place_kernels(&b, kernels)?;
    p.place_outputs(&b)?;
    let callback = p.place_callback();
    let notifier = p.place_notifier(callback);

    let depth = b.depth.max(1);
    let blobs = alloc_blobs(&b, &p.producer, depth)?;
    let actors = p.shared_actors(&b.job, depth)?;
    let (notifiers, per_thread) = thread_lists(&b.job, p.nthreads)?;
    set_listeners(&lazy, &notifiers, &actors, &p.locals, callback, notifier);

    let nthreads = p.nthreads;
    let shared = Arc::new(Shared {
        job: b.job.clone().into(),
        lazy,
        depth,
        blobs,
        actors,
        notifiers,
        threads: (0..nthreads).map(|_| Mutex::default()).collect(),
        param_kernels: p.param_kernels,
        param_turn: AtomicUsize::new(0),
        failing: CachePadded::new(AtomicUsize::new(0)),
        progress: super::Progress::new(nthreads),
        knocked: crossbeam_utils::CachePadded::new(ivm_core::sync::AtomicBool::new(false)),
        helps: crossbeam_utils::CachePadded::new(ivm_core::sync::AtomicUsize::new(0)),
        jobs: Mutex::new(VecDeque::new()),
        stop: AtomicBool::new(false),
        runs_finished: AtomicUsize::new(0),
        poll: b.poll,
        trace: b.trace.take(),
    });

    hand_out_actors(&shared, per_thread, p.locals);
    let graph = spawn_threads(&shared)?;
    connect_to_vm(&shared, b.on_caller);
    Ok(graph)
}

/// The actors placed so far, one entry per actor (by index) in each list, and what checking
/// the builder's description needs along the way.
struct Placement {
    nblobs: usize,
    nthreads: usize,
    /// Threads that run compute kernels: 1.. (thread 0 runs the protocol actors), or
    /// thread 0 alone in a one-thread graph.
    first_compute: usize,
    /// Producer of each blob: actor index, filled as the actors are placed.
    producer: Vec<Option<usize>>,
    invalid_input_blobs: Vec<usize>,
    names: Vec<Arc<str>>,
    threads: Vec<usize>,
    preds: Vec<Vec<usize>>,
    /// Filled once every actor is placed ([`Placement::place_notifier`]).
    succs: Vec<Vec<usize>>,
    param_of: Vec<Option<usize>>,
    locals: Vec<Local>,
    interface_actors: Vec<usize>,
    kernel_actors: Vec<usize>,
    param_kernels: usize,
    /// The next thread (round robin over the compute threads) of a kernel that names none.
    rr: usize,
}

impl Placement {
    /// The source tick and the wait, on thread 0.
    fn new(b: &GraphBuilder) -> Self {
        let nthreads = b.threads.max(1);
        Placement {
            nblobs: b.blobs.len(),
            nthreads,
            first_compute: usize::from(nthreads > 1),
            producer: vec![None; b.blobs.len()],
            invalid_input_blobs: Vec::new(),
            names: vec!["source-tick".into(), "wait".into()],
            threads: vec![0, 0],
            preds: vec![vec![], vec![SOURCE]],
            succs: Vec::new(),
            param_of: vec![None, None],
            locals: vec![Local::SourceTick, Local::Wait { held: Vec::new() }],
            interface_actors: Vec::new(),
            kernel_actors: Vec::new(),
            param_kernels: 0,
            rr: 0,
        }
    }

    fn check_blob(&self, b: &GraphBuilder, x: usize, what: &str) -> Result<()> {
        if x >= self.nblobs {
            return Err(b.invalid(format!("{what}: unknown blob #{x}")));
        }
        Ok(())
    }

    /// Appends an actor; its index is `self.names.len()` before the call.
    fn push(
        &mut self,
        name: Arc<str>,
        thread: usize,
        preds: Vec<usize>,
        param: Option<usize>,
        local: Local,
    ) {
        self.names.push(name);
        self.threads.push(thread);
        self.preds.push(preds);
        self.param_of.push(param);
        self.locals.push(local);
    }

    /// One actor per valid input op, on thread 0, after the wait.
    fn place_inputs(&mut self, b: &GraphBuilder) -> Result<()> {
        for (op, i) in b.inputs.iter().enumerate() {
            self.check_blob(b, i.blob, &format!("input `{}`", i.name))?;
            if !i.valid {
                continue;
            }
            let id = self.names.len();
            self.producer[i.blob] = Some(id);
            let name = format!("input/{}", i.name).into();
            self.push(name, 0, vec![WAIT], None, Local::Input { op, blob: i.blob });
            self.interface_actors.push(id);
        }
        self.invalid_input_blobs = b
            .inputs
            .iter()
            .filter(|i| !i.valid)
            .map(|i| i.blob)
            .collect();
        Ok(())
    }

    /// One actor per kernel, in declaration order.
    fn place_kernels(&mut self, b: &GraphBuilder, kernels: Vec<KernelDesc>) -> Result<()> {
        for k in kernels {
            let id = self.names.len();
            let what = format!("kernel `{}`", k.name);
            let p = self.kernel_preds(b, &k, id, &what)?;
            let thread = self.kernel_thread(b, &k, &what)?;
            let param = k.params.then(|| {
                self.param_kernels += 1;
                self.param_kernels - 1
            });
            let local = Local::Compute {
                reads: k.reads,
                writes: k.writes,
                body: k.body,
            };
            self.push(k.name.clone(), thread, p, param, local);
            self.kernel_actors.push(id);
        }
        Ok(())
    }

    /// Checks kernel `k`'s reads and writes, records it (actor `id`) as its blobs'
    /// producer; its predecessors: the producers of what it reads, or the wait.
    fn kernel_preds(
        &mut self,
        b: &GraphBuilder,
        k: &KernelDesc,
        id: usize,
        what: &str,
    ) -> Result<Vec<usize>> {
        let mut p = Vec::new();
        for &r in &k.reads {
            self.check_blob(b, r, what)?;
            match self.producer[r] {
                Some(a) => p.push(a),
                None if self.invalid_input_blobs.contains(&r) => {}
                None => {
                    return Err(b.invalid(format!(
                        "{what} reads blob `{}`, which no earlier kernel or input writes",
                        b.blobs[r].name
                    )));
                }
            }
        }
        for (n, &w) in k.writes.iter().enumerate() {
            self.check_blob(b, w, what)?;
            if k.reads.contains(&w) || k.writes[..n].contains(&w) {
                return Err(b.invalid(format!(
                    "{what} writes blob `{}` twice or also reads it",
                    b.blobs[w].name
                )));
            }
            if self.producer[w].is_some() || self.invalid_input_blobs.contains(&w) {
                return Err(b.invalid(format!(
                    "{what} writes blob `{}`, which is already written elsewhere",
                    b.blobs[w].name
                )));
            }
            self.producer[w] = Some(id);
        }
        if p.is_empty() {
            p.push(WAIT);
        }
        dedup(&mut p);
        Ok(p)
    }

    /// The thread kernel `k` asks for if it is a compute thread, else the next in turn.
    fn kernel_thread(&mut self, b: &GraphBuilder, k: &KernelDesc, what: &str) -> Result<usize> {
        let (first_compute, nthreads) = (self.first_compute, self.nthreads);
        Ok(match k.thread {
            Some(t) if (first_compute..nthreads).contains(&t) => t,
            Some(t) => {
                return Err(b.invalid(format!(
                    "{what} on thread {t}: kernels run on threads {first_compute}..{nthreads}"
                )));
            }
            None => {
                let t = first_compute + self.rr % (nthreads - first_compute);
                self.rr += 1;
                t
            }
        })
    }

    /// One actor per valid output op, on thread 0, after the wait and the blob's producer.
    fn place_outputs(&mut self, b: &GraphBuilder) -> Result<()> {
        for (op, o) in b.outputs.iter().enumerate() {
            self.check_blob(b, o.blob, &format!("output `{}`", o.name))?;
            if !o.valid {
                continue;
            }
            if self.producer[o.blob].is_none() && !self.invalid_input_blobs.contains(&o.blob) {
                return Err(b.invalid(format!(
                    "output `{}` copies blob `{}`, which nothing writes",
                    o.name, b.blobs[o.blob].name
                )));
            }
            let id = self.names.len();
            let mut p = vec![WAIT];
            p.extend(self.producer[o.blob]);
            dedup(&mut p);
            let name = format!("output/{}", o.name).into();
            self.push(name, 0, p, None, Local::Output { op, blob: o.blob });
            self.interface_actors.push(id);
        }
        Ok(())
    }

    /// The callback, after every interface actor (or the wait); its index.
    fn place_callback(&mut self) -> usize {
        let callback = self.names.len();
        let preds = if self.interface_actors.is_empty() {
            vec![WAIT]
        } else {
            self.interface_actors.clone()
        };
        let local = Local::Callback { held: Vec::new() };
        self.push("callback".into(), 0, preds, None, local);
        callback
    }

    /// Successors, then the notifier after the callback and every sink; its index.
    fn place_notifier(&mut self, callback: usize) -> usize {
        self.succs = vec![Vec::new(); self.names.len()];
        for (a, ps) in self.preds.iter().enumerate() {
            for &p in ps {
                self.succs[p].push(a);
            }
        }
        let notifier = self.names.len();
        let mut np = vec![callback];
        np.extend(
            self.kernel_actors
                .iter()
                .copied()
                .filter(|&k| self.succs[k].is_empty()),
        );
        for &p in &np {
            self.succs[p].push(notifier);
        }
        self.push("callback-notifier".into(), 0, np, None, Local::Notifier);
        self.succs.push(Vec::new());
        notifier
    }

    /// The part of every actor all threads see (takes the names, predecessors and
    /// successors).
    fn shared_actors(&mut self, job: &str, depth: usize) -> Result<Vec<ActorShared>> {
        let (param_of, param_kernels, threads) =
            (&self.param_of, self.param_kernels, &self.threads);
        let (preds, succs) = (&mut self.preds, &mut self.succs);
        std::mem::take(&mut self.names)
            .into_iter()
            .enumerate()
            .map(|(i, name)| {
                let (failures, failed) = per_slot(job, depth)?;
                // The parameter kernel after this one (the next turn), if this is one.
                let next_param = param_of[i].and_then(|p| {
                    let next = (p + 1) % param_kernels;
                    param_of.iter().position(|&x| x == Some(next))
                });
                // The threads to notify after a firing: those of the neighbours on other
                // threads, each once. Empty on a one-thread graph, whose thread rescans after
                // every firing.
                let mut remote_threads: Vec<usize> = preds[i]
                    .iter()
                    .chain(&succs[i])
                    .chain(&next_param)
                    .map(|&n| threads[n])
                    .filter(|&t| t != threads[i])
                    .collect();
                remote_threads.sort_unstable();
                remote_threads.dedup();
                Ok(ActorShared {
                    name,
                    thread: threads[i],
                    preds: std::mem::take(&mut preds[i]),
                    succs: std::mem::take(&mut succs[i]),
                    done: AtomicUsize::new(0),
                    failures,
                    failed,
                    param: param_of[i],
                    remote_threads,
                })
            })
            .collect()
    }
}

/// The error of an allocation that does not fit (`what` of graph `job`).
fn oom(job: &str, nbytes: usize, what: &str, detail: String) -> Error {
    Error::OutOfMemory {
        nbytes,
        stream: format!("cpu (graph `{job}`, {what})"),
        detail,
    }
}

/// The blobs' register slots: `depth` for a produced blob, one for the others.
fn alloc_blobs(b: &GraphBuilder, producer: &[Option<usize>], depth: usize) -> Result<Vec<GBlob>> {
    // Sizes and the depth come from the user: allocate fallibly (an error, never an abort).
    b.blobs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            GBlob::new(d.nbytes, if producer[i].is_some() { depth } else { 1 })
                .map_err(|e| oom(&b.job, d.nbytes, &format!("blob `{}`", d.name), e))
        })
        .collect()
}

/// An actor's per-slot failure entries and flags (`ActorShared::failures`, `failed`).
type PerSlot = (Box<[Mutex<Option<Error>>]>, Box<[AtomicBool]>);

/// An actor's per-slot failure entries and flags, `n` of each.
fn per_slot(job: &str, n: usize) -> Result<PerSlot> {
    let mut failures = Vec::new();
    let mut failed = Vec::new();
    if failures.try_reserve_exact(n).is_err() || failed.try_reserve_exact(n).is_err() {
        return Err(oom(
            job,
            0,
            "actor slots",
            format!("pipeline depth {n} does not fit in memory"),
        ));
    }
    failures.extend((0..n).map(|_| Mutex::new(None)));
    failed.extend((0..n).map(|_| AtomicBool::new(false)));
    Ok((failures.into_boxed_slice(), failed.into_boxed_slice()))
}

/// Per thread, its notifier and its actor list.
type ThreadLists = (Vec<Arc<Notifier<FutexWait>>>, Vec<Vec<LocalActor>>);

/// One notifier and one (empty) actor list per thread.
fn thread_lists(job: &str, nthreads: usize) -> Result<ThreadLists> {
    // The thread count comes from the user too: one notifier and one actor list each.
    let mut notifiers: Vec<Arc<Notifier<FutexWait>>> = Vec::new();
    let mut per_thread: Vec<Vec<LocalActor>> = Vec::new();
    if notifiers.try_reserve_exact(nthreads).is_err()
        || per_thread.try_reserve_exact(nthreads).is_err()
    {
        return Err(oom(
            job,
            0,
            "threads",
            format!("{nthreads} graph threads do not fit in memory"),
        ));
    }
    notifiers.extend((0..nthreads).map(|_| Arc::new(Notifier::new())));
    per_thread.extend((0..nthreads).map(|_| Vec::new()));
    Ok((notifiers, per_thread))
}

/// Buffers wake the thread of the actor that pops them.
fn set_listeners(
    lazy: &LazyGraph,
    notifiers: &[Arc<Notifier<FutexWait>>],
    actors: &[ActorShared],
    locals: &[Local],
    callback: usize,
    notifier: usize,
) {
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
}

/// Gives every thread its actors.
fn hand_out_actors(shared: &Arc<Shared>, mut per_thread: Vec<Vec<LocalActor>>, locals: Vec<Local>) {
    for (id, kind) in locals.into_iter().enumerate() {
        per_thread[shared.actors[id].thread].push(LocalActor { id, kind });
    }
    for (t, actors) in per_thread.into_iter().enumerate() {
        *lock(&shared.threads[t]) = ThreadActors::new(shared, actors);
    }
}

/// Starts the graph's threads.
fn spawn_threads(shared: &Arc<Shared>) -> Result<Graph> {
    let graph = Graph {
        shared: shared.clone(),
        handles: Mutex::new(Vec::new()),
    };
    for t in 0..shared.threads.len() {
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name(format!("graph-{}-t{t}", shared.job))
            .spawn(move || thread_loop(&s, t))
            .map_err(|e| Error::Spawn(e.to_string()))?;
        lock(&graph.handles).push(h);
    }
    Ok(graph)
}

/// Hands the VM the caller helper (if `on_caller`), the progress probe and the state probe.
fn connect_to_vm(shared: &Arc<Shared>, on_caller: bool) {
    if on_caller {
        // A weak reference: the VM keeps the helper as long as it lives, the graph's
        // state goes with the graph.
        let weak = Arc::downgrade(shared);
        shared.lazy.set_caller_helper_until(move |wait_over| {
            weak.upgrade().is_some_and(|s| s.help(wait_over))
        });
    }
    // The VM's waiting callers see the graph compute (its threads' productive scans) and
    // keep spinning through a run instead of sleeping until its output ends. The probe
    // holds the counts only: no reference count of the graph's state is touched per wait.
    let progress = shared.progress.clone();
    shared.lazy.set_progress_probe(move || progress.total());
    // A timeout's diagnostic says what the graph was doing (weak, as the helper).
    let weak = Arc::downgrade(shared);
    shared.lazy.set_state_probe(move || {
        weak.upgrade()
            .map_or_else(|| "dropped".to_string(), |s| s.describe())
    });
}
