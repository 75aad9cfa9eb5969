//! Laying out a graph: checks the builder's description, places the actors (source tick,
//! wait, inputs, kernels, outputs, callback, notifier) on threads, allocates the blobs' register
//! slots and starts the threads.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crossbeam_utils::CachePadded;
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize};
use ivm_std::futex::FutexWait;
use ivm_std::{Error, Result};

use super::blob::GBlob;
use super::{
    ActorShared, Graph, GraphBuilder, Local, LocalActor, Shared, ThreadActors, describe, lock,
    thread_loop,
};

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
        failing: CachePadded::new(AtomicUsize::new(0)),
        progress: super::Progress::new(nthreads),
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
    // The VM's waiting callers see the graph compute (its threads' productive scans) and
    // keep spinning through a run instead of sleeping until its output ends. The probe
    // holds the counts only: no reference count of the graph's state is touched per wait.
    let progress = shared.progress.clone();
    shared.lazy.set_progress_probe(move || progress.total());
    Ok(graph)
}
