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

mod blob;
mod describe;
mod fire;
mod layout;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use ivm_core::notifier::Notifier;
use ivm_core::sync::{AtomicBool, AtomicUsize, Ordering};
use ivm_core::wait::Wait;

use super::{GraphBuilder, GraphCtx, GraphEvent, KernelBody, Phase, TraceFn, describe};
use blob::GBlob;
use fire::{JobCache, try_fire};
use ivm_std::Error;
use ivm_std::futex::FutexWait;
use ivm_std::lazy::{CriticalSectionInstance, JobInstance, LazyGraph};
pub(crate) use layout::build;

/// Most scans a helping VM caller makes of one graph thread's actors per help
/// ([`Shared::help`]).
const HELP_SCANS: usize = 64;

/// How long a graph thread that owes its actors a scan sleeps at a time while someone
/// else holds them (see `thread_loop`, `owed`).
const OWED_RECHECK: Duration = Duration::from_millis(1);

/// How long a graph thread that let go of its actors for a knocking caller waits for the
/// caller to take them before it scans on: a caller that spins retries within
/// microseconds; one that knocked and went to sleep costs this once. (Tests: longer, as
/// a loaded test machine may keep the knocking thread off its CPU for milliseconds.)
#[cfg(not(test))]
const KNOCK_GRACE: Duration = Duration::from_micros(20);
#[cfg(test)]
const KNOCK_GRACE: Duration = Duration::from_millis(50);

/// How long an idle graph thread polls with spin-loop hints only before it starts
/// yielding (see `thread_loop`).
const POLL_PURE_SPIN: Duration = Duration::from_micros(2);

std::thread_local! {
    /// The graph (its [`Shared`]'s address) and thread whose actors this thread scans as a
    /// helping VM caller ([`Shared::help`]): a [`Graph::shutdown`] from one of those actors'
    /// kernels must not join that thread, which waits for the actors this thread holds.
    static HELPING: std::cell::Cell<Option<(usize, usize)>> = const { std::cell::Cell::new(None) };
}

/// Locks `m`, taking the data of a poisoned mutex as it is: every mutex here guards data
/// that a panicking holder leaves consistent (a kernel panic is caught outside them).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`lock`] if nobody holds `m` now, else `None`.
fn try_lock<T>(m: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
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
    /// The threads of the neighbours (`preds`, `succs`, and the parameter kernel after
    /// this one if this is one) other than this actor's, each once: the ones a firing
    /// notifies.
    remote_threads: Vec<usize>,
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
    /// How many (actor, slot) `failed` flags are set: while none is, a firing skips
    /// looking at its predecessors' flags (see `fire::upstream_failure`). Read by every firing of
    /// every thread and written only when a flag changes: on cache lines of its own, away
    /// from `param_turn` and the other fields written per firing.
    failing: CachePadded<AtomicUsize>,
    /// Job instances of started iterations, oldest first (source tick pushes, callback
    /// notifier pops).
    jobs: Mutex<VecDeque<(usize, Arc<JobInstance>)>>,
    stop: AtomicBool,
    /// Runs finished by the callback notifier (counted before the launch is finished).
    runs_finished: AtomicUsize,
    trace: Option<TraceFn>,
    /// How long an idle thread polls before it sleeps ([`GraphBuilder::poll_window`]).
    poll: Duration,
    /// Per graph thread: its kernel firings and productive scans (see [`Progress`]).
    progress: Progress,
    /// Set by a helping caller that found a thread's actors taken while the VM counts as
    /// crowded (`lazy::helping_caller_crowded`): the thread lets go of them after its
    /// kernel (`scan_until`). A hint (Relaxed): the actors' lock hands them over.
    knocked: CachePadded<AtomicBool>,
    /// Bumped by a helping caller each time it takes a thread's actors: a thread that let
    /// go of them for a knock sees whether the caller took them.
    helps: CachePadded<AtomicUsize>,
}

/// Per graph thread, its kernel firings and productive scans (wrapping), each thread's
/// count on cache lines of its own: the graph's progress count for the VM's waiting
/// callers (`LazyGraph::set_progress_probe`). A waiting caller reads it when its wait
/// starts and then after each stretch of `CALLER_STALL` (200 µs) without a release; were
/// the count the actors' `done` counters themselves, each read would take their lines
/// from the graph thread, which then missed on its next firing of every actor. It moves
/// with every kernel, not only once per scan: one scan may fire a whole step of long
/// kernels, and a count that stood still that long would send the caller to sleep.
#[derive(Clone)]
pub(crate) struct Progress(Arc<[CachePadded<AtomicUsize>]>);

impl Progress {
    pub(crate) fn new(threads: usize) -> Self {
        Self(
            (0..threads)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
        )
    }

    /// One of graph thread `t`'s actors fired (or a scan of them did). Called only by
    /// whoever holds thread `t`'s actors (`Shared::threads[t]`'s lock, for one scan), so
    /// the load and store below never race with another writer.
    fn fired(&self, t: usize) {
        // Relaxed: a count compared with an earlier one; nothing is read through it. The
        // writers of count `t` are serialised by the lock (above).
        let c = &self.0[t];
        c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// The sum of the threads' counts (wrapping).
    pub(crate) fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |sum, c| {
            // Relaxed: as in `fired`.
            sum.wrapping_add(c.load(Ordering::Relaxed) as u64)
        })
    }
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
        let me = Arc::as_ptr(s) as usize;
        let helping = HELPING
            .with(std::cell::Cell::get)
            .and_then(|(graph, t)| (graph == me).then_some(t));
        // Handle `t` is thread `t`'s (`layout::spawn_threads` spawns them in order).
        let handles = std::mem::take(&mut *lock(&self.handles));
        for (t, h) in handles.into_iter().enumerate() {
            if h.thread().id() == std::thread::current().id() || helping == Some(t) {
                // Dropped from one of its own kernels, on its thread or on a caller
                // scanning its actors: the thread exits by itself once it sees `stop`
                // (after the caller let go of its actors).
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

fn thread_loop(s: &Shared, t: usize) {
    ivm_std::lazy::mark_graph_thread();
    let notifier = &s.notifiers[t];
    // Polling: spin-loop hints for a moment (the next firing of a busy graph comes within
    // microseconds), then yield the CPU (few cores: do not starve the threads that feed
    // us) until the poll window ends.
    let backoff = ivm_core::sync::Backoff::new();
    let mut idle_since: Option<Instant> = None;
    // Whether we owe our actors a scan: since our last scan that fired nothing, we took a
    // wake or fired something (which readies our own actors without a notification).
    // Whoever holds our actors meanwhile may not cover it: a helper (`Shared::help`)
    // whose last scan came before what the wake announced leaves without notifying us,
    // and a diagnostic's look (`describe.rs`) scans nothing. Until we have scanned, we
    // never sleep without a bound.
    let mut owed = false;
    loop {
        // Acquire: pairs with `shutdown`'s Release store.
        if s.stop.load(Ordering::Acquire) {
            break;
        }
        // A helping caller (`Shared::help`) that holds our actors scans until nothing is
        // ready or notifies us when it stops with work left, so we poll and sleep as if
        // idle (in bounded stretches while we owe a scan, below) instead of blocking on
        // the lock: a thread blocked there made every
        // helper's unlock a futex wake on the caller's path, and, woken, took the
        // actors back from a caller that was running the graph on a CPU of its own
        // (ARCHITECTURE.md, "ivm-graph").
        let mut knocked = false;
        let any = match try_lock(&s.threads[t]) {
            Some(mut actors) => {
                let (any, stopped) = scan_until(s, t, &mut actors, Stop::Knock);
                knocked = stopped;
                owed = any;
                if !any {
                    // Idle: let go of the last job instance (its parameter tensors)
                    // meanwhile.
                    actors.job = None;
                }
                any
            }
            None => false,
        };
        if knocked {
            // A waiting caller on a crowded machine offered to run our actors: it has a
            // CPU, we may have to wait for ours between kernels. Let it take them (it
            // retries at once while it spins); if it does not within `KNOCK_GRACE`, scan
            // on. Whoever holds them, we owe a scan (bounded sleeps below).
            let before = s.helps.load(Ordering::Relaxed);
            let start = Instant::now();
            while s.helps.load(Ordering::Relaxed) == before && start.elapsed() < KNOCK_GRACE {
                ivm_core::sync::spin_loop();
            }
            owed = true;
            idle_since = None;
            continue;
        }
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
        if owed {
            // Someone holds our actors, for as long as its scans take (kernels of any
            // length): sleep in bounded stretches until we get them, woken at once by a
            // helper that leaves work to us. A missed wake costs `OWED_RECHECK`, not a
            // stall; a spin here would take a core from whoever runs our actors.
            let deadline = FutexWait::now().saturating_add(OWED_RECHECK);
            if notifier.timed_wait_and_clear(deadline).is_err() {
                break;
            }
            // `idle_since` kept: the poll window is over, the next miss sleeps at once.
            continue;
        }
        idle_since = None;
        backoff.reset();
        // Whatever makes one of our actors ready afterwards notifies us; a notification
        // that arrived during the scan is still pending, so this returns at once.
        if notifier.wait_and_clear().is_err() {
            break;
        }
        owed = true;
    }
    // Held critical-section instances drop here: unfinished ones fail their records.
    drop(std::mem::take(&mut *lock(&s.threads[t])));
}

/// Who scans, and when a scan stops early ([`scan_until`]).
enum Stop<'a> {
    /// A helping caller: after a kernel whose protocol successors fired (an output copied
    /// out may end the caller's wait: the caller looks before it scans on) or at which
    /// the predicate (its wait is over) turns true.
    Helper(&'a dyn Fn() -> bool),
    /// The graph's own thread: after a kernel at which a helping caller has knocked
    /// (`Shared::knocked`).
    Knock,
}

/// One scan of graph thread `t`'s actors (by the thread, or by a VM caller running the
/// graph): fires every ready actor once or more, unless `stop` says to stop after a
/// kernel. Whether any actor fired, and whether the scan stopped early.
fn scan_until(s: &Shared, t: usize, st: &mut ThreadActors, stop: Stop<'_>) -> (bool, bool) {
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
            s.progress.fired(t);
            // Protocol actors first after every kernel: an output copies its blob out
            // as soon as it is produced (the eager side may go on while later kernels
            // run); and if anything was pushed to the job's buffers (their listeners
            // notify this thread), the next run's actors get their turn before more
            // kernels.
            let mut handed_out = false;
            for &p in succs {
                handed_out |= try_fire(s, &mut protocol[p], job);
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
            let stop_here = match stop {
                Stop::Helper(wait_over) => handed_out || wait_over(),
                Stop::Knock => s.take_knock(),
            };
            if stop_here {
                return (true, true);
            }
        }
    }
    for p in protocol.iter_mut() {
        if try_fire(s, p, job) {
            any = true;
        }
    }
    if any {
        s.progress.fired(t);
    }
    (any, false)
}

/// Marks this thread as scanning graph thread `t`'s actors (see [`HELPING`]) until dropped.
struct HelpingMark(Option<(usize, usize)>);

impl HelpingMark {
    fn enter(s: &Shared, t: usize) -> Self {
        Self(HELPING.with(|h| h.replace(Some((s as *const Shared as usize, t)))))
    }
}

impl Drop for HelpingMark {
    fn drop(&mut self) {
        HELPING.with(|h| h.set(self.0));
    }
}

impl Shared {
    /// A helping caller found a thread's actors taken (see `knocked`).
    fn knock(&self) {
        // Relaxed: a hint (see the field); the load first keeps the line shared while a
        // knock waits to be taken.
        if !self.knocked.load(Ordering::Relaxed) {
            self.knocked.store(true, Ordering::Relaxed);
        }
    }

    /// Takes a helping caller's knock, if there is one (see `knocked`).
    fn take_knock(&self) -> bool {
        // Relaxed: a hint (see the field); the load first keeps the line shared while
        // nobody knocks.
        self.knocked.load(Ordering::Relaxed) && self.knocked.swap(false, Ordering::Relaxed)
    }

    /// A VM caller runs the graph ([`GraphBuilder::run_on_caller`]): scans each graph
    /// thread whose actors nobody is scanning now until a scan finds nothing ready — the
    /// thread's own condition for sleeping, so no actor made ready by a notification the
    /// scans consumed is left for a thread that sleeps. Never waits for a lock.
    fn help(&self, wait_over: &dyn Fn() -> bool) -> bool {
        let mut any = false;
        for (t, actors) in self.threads.iter().enumerate() {
            // Acquire: as in `thread_loop`; a stopped graph's actors are gone or going.
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let Some(mut actors) = try_lock(actors) else {
                // Taken (by the graph's thread): on a crowded machine, knock, so that the
                // thread lets go of them after its kernel.
                if ivm_std::lazy::helping_caller_crowded() {
                    self.knock();
                }
                continue;
            };
            // Relaxed: a hint for a thread that let go for a knock.
            self.helps.fetch_add(1, Ordering::Relaxed);
            // At most `HELP_SCANS` scans: a caller whose wait is over must not stay here
            // while other threads keep feeding the graph. Stopping with work still ready
            // hands it to the graph's thread, which a notification wakes.
            let mut scans = 0;
            let _helping = HelpingMark::enter(self, t);
            loop {
                let (fired, stopped) = scan_until(self, t, &mut actors, Stop::Helper(wait_over));
                if !fired {
                    break;
                }
                any = true;
                scans += 1;
                // Stopped early (an output went out or the caller's wait is over: the
                // caller looks before it helps again) or out of scans: what may still be
                // ready is the thread's.
                if stopped || scans == HELP_SCANS {
                    let _ = self.notifiers[t].notify();
                    break;
                }
            }
        }
        any
    }

    fn trace(&self, actor: usize, iteration: usize, phase: Phase, failed: bool) {
        if let Some(f) = &self.trace {
            let ev = GraphEvent {
                actor: &self.actors[actor].name,
                iteration: iteration as u64,
                phase,
                failed,
            };
            // Ignored (the payload dropped under its own catch).
            let _ = ivm_std::panics::catch(|| f(&ev));
        }
    }

    fn failure_name(&self, actor: usize) -> String {
        format!("graph `{}` kernel `{}`", self.job, self.actors[actor].name)
    }
}
