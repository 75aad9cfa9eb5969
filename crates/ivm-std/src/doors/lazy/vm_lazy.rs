//! The per-VM lazy-job state ([`VmLazy`]): the launcher's queue, the transport dependence
//! and what the launched graphs offer a waiting caller; kept type-erased in the VM's shared
//! state and reached through `VmShared::lazy`.

use std::cell::Cell;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ivm_core::sync::{AtomicBool, Ordering};

use super::launcher_queue::LauncherQueue;
#[cfg(doc)]
use crate::doors::lazy::LazyGraph;
use crate::doors::lazy::{CallerHelper, LazyInner, ProgressProbe, StateProbe};
use crate::engine::core::NEXT_BLOB_ID;
use crate::model::blob::Blob;
use crate::util::ids::Device;
use crate::util::lock;
use crate::util::panics::catch;

/// Per-VM lazy-job state: the launcher's queue and the transport dependence (a memoryless
/// blob every launch writes).
pub(crate) struct VmLazy {
    pub(crate) queue: Arc<LauncherQueue>,
    pub(crate) transport: Arc<Blob>,
    /// What the graphs this VM launched offered a waiting caller: a caller helper
    /// ([`LazyGraph::set_caller_helper`]) and a progress probe
    /// ([`LazyGraph::set_progress_probe`]), and a state probe for diagnostics
    /// ([`LazyGraph::set_state_probe`]), registered at each graph's first launch (a graph
    /// serves one VM), with the graph's description to tell when it is gone. At most
    /// [`OFFERS`] graphs alive at once; more are not registered (those run on their own
    /// threads only, and a caller waiting for them sleeps as for any long work). Shared
    /// with the VM core's diagnostic (`VmShared::lazy`).
    offers: Offers,
    /// Whether a registered offer ever had a helper: a wait looks at it without the lock.
    has_helpers: AtomicBool,
    /// Whether a registered offer ever had a progress probe (as `has_helpers`).
    has_probes: AtomicBool,
}

/// One graph's offer to waiting callers (see [`VmLazy::offers`]).
#[derive(Clone)]
struct GraphOffer {
    graph: Weak<LazyInner>,
    helper: Option<CallerHelper>,
    progress: Option<ProgressProbe>,
    state: Option<StateProbe>,
}

/// Most graph offers one VM keeps.
const OFFERS: usize = 8;

type Offers = Arc<Mutex<heapless::Vec<GraphOffer, OFFERS>>>;

impl VmLazy {
    pub(crate) fn new(vm_id: usize) -> Self {
        Self {
            queue: Arc::new(LauncherQueue::default()),
            transport: Arc::new(Blob::new(
                vm_id,
                NEXT_BLOB_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                Device::CPU,
                0,
            )),
            offers: Arc::default(),
            has_helpers: AtomicBool::new(false),
            has_probes: AtomicBool::new(false),
        }
    }

    /// Registers what `graph` offers at its first launch (nothing when it offers nothing).
    pub(super) fn register(&self, graph: &Arc<LazyInner>) {
        // The first launch seals both slots (see `LazyInner::helper`).
        let helper = graph.helper.get_or_init(|| None).clone();
        let progress = graph.progress.get_or_init(|| None).clone();
        let state = graph.state.get_or_init(|| None).clone();
        if helper.is_none() && progress.is_none() && state.is_none() {
            return;
        }
        let (has_helper, has_probe) = (helper.is_some(), progress.is_some());
        let mut offers = lock(&self.offers);
        // The offers of graphs dropped since make room.
        offers.retain(|o| o.graph.strong_count() > 0);
        let offer = GraphOffer {
            graph: Arc::downgrade(graph),
            helper,
            progress,
            state,
        };
        if offers.push(offer).is_ok() {
            // Relaxed: hints for waits; the offers themselves are read under the lock.
            if has_helper {
                self.has_helpers.store(true, Ordering::Relaxed);
            }
            if has_probe {
                self.has_probes.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Whether a graph with a caller helper was ever launched here: the one thing a wait
    /// looks at when there is none.
    pub(crate) fn has_helpers(&self) -> bool {
        // Relaxed: see `register`.
        self.has_helpers.load(Ordering::Relaxed)
    }

    /// Runs the caller helpers (a caller about to wait, outside the engine) until
    /// `wait_over`: whether any ran something. Allocates nothing; the helpers run without
    /// the lock.
    pub(crate) fn help(&self, wait_over: &dyn Fn() -> bool) -> bool {
        live_offers(&self.offers)
            .filter_map(|o| o.helper)
            // A helper that panics ran nothing this caller can count on; the graph's own
            // launch reports its failure (the helper is the graph runtime's code).
            .fold(false, |any, h| {
                (!wait_over() && catch(|| h(wait_over)).unwrap_or(false)) | any
            })
    }

    /// What a diagnostic adds for the live graphs with a state probe: `job: state` each
    /// (see [`Diagnostic::graphs`](crate::Diagnostic::graphs)).
    pub(crate) fn diagnostic_extra(&self) -> impl Fn() -> Vec<String> + Send + Sync + use<> {
        let offers = self.offers.clone();
        move || {
            live_offers(&offers)
                .filter_map(|o| Some((o.graph.upgrade()?, o.state?)))
                .map(|(g, probe)| {
                    // A probe that panics says so instead of its state.
                    let state = catch(|| probe())
                        .unwrap_or_else(|m| format!("(its state probe panicked: {m})"));
                    format!("{}: {state}", g.job)
                })
                .collect()
        }
    }

    /// The sum of the live graphs' progress counts (wrapping), or `None` when no graph
    /// with a probe was ever launched here. A waiting caller compares two of these to see
    /// whether a graph did work in between. Allocates nothing; the probes run without the
    /// lock.
    pub(crate) fn graph_progress(&self) -> Option<u64> {
        // Relaxed: see `register`.
        if !self.has_probes.load(Ordering::Relaxed) {
            return None;
        }
        Some(
            live_offers(&self.offers)
                .filter_map(|o| o.progress)
                // A probe that panics counts nothing (no progress seen through it).
                .fold(0u64, |sum, p| sum.wrapping_add(catch(|| p()).unwrap_or(0))),
        )
    }
}

/// The offers of the graphs still alive, copied out of the lock (nothing allocated: a
/// fixed-capacity vector of shared handles), so that what they call runs unlocked.
fn live_offers(offers: &Offers) -> impl Iterator<Item = GraphOffer> + use<> {
    let offers = lock(offers).clone();
    offers.into_iter().filter(|o| o.graph.strong_count() > 0)
}

impl crate::runtime::shared::VmShared {
    /// The VM's lazy-job state, created on first use; its graphs' states join the core's
    /// diagnostics from then on.
    pub(crate) fn lazy(&self) -> &VmLazy {
        self.lazy
            .get_or_init(|| {
                let lazy = VmLazy::new(self.id);
                self.core
                    .set_diagnostic_extra(Box::new(lazy.diagnostic_extra()));
                Box::new(lazy)
            })
            .downcast_ref()
            .expect("ivm: the lazy slot holds a VmLazy (only this function fills it)")
    }

    /// The lazy state, if this VM ever launched a lazy job.
    pub(crate) fn lazy_if_used(&self) -> Option<&VmLazy> {
        self.lazy.get().and_then(|l| l.downcast_ref())
    }

    /// What a waiting caller counts as progress made elsewhere: its lazy graphs' probes
    /// ([`VmLazy::graph_progress`]); `None` when none was ever launched with one.
    pub(crate) fn graph_progress(&self) -> Option<u64> {
        self.lazy_if_used().and_then(VmLazy::graph_progress)
    }
}

/// When a waiting caller in multi-thread mode runs its lazy graphs' ready work
/// (`sync_access::wait_small`, `LazyGraph::set_caller_helper`). At once, unless the
/// machine counts as quiet (`VmCore::neighbours_quiet_until`: the VM's looks found no
/// busy thread beside it) and neither are its callers crowded nor was this caller
/// preempted lately: waiting for a thread that may not have a CPU is never faster than
/// doing its work. On a quiet machine only once the graphs made no progress for
/// `GRAPH_HELP_PATIENCE` of this wait (and before the caller sleeps, `wait_small`): a
/// graph thread with a CPU of its own runs a step on warm caches, while a caller that
/// took its forward pass after an idle spell split the next steps over two CPUs. A graph
/// that stops after it was seen moving in this wait is taken to have lost its thread's
/// CPU: the machine no longer counts as quiet (also when it stopped for want of work, or
/// moved by the caller's own help: a false count costs the old behaviour until the next
/// look). One per wait, on the waiting caller's stack.
pub(crate) struct HelpGate {
    /// The graphs' progress count when it last moved, and when that was seen.
    last: Cell<Option<(Option<u64>, Instant)>>,
    /// Whether the count moved since this wait's first reading.
    moved: Cell<bool>,
    /// When to read the progress count next: it takes the offers' lock, so a spinning
    /// caller reads it at most every [`CHECK_EVERY`](Self::CHECK_EVERY).
    next: Cell<Option<Instant>>,
    /// What the last reading found: no progress for the patience.
    stalled: Cell<bool>,
}

/// What a [`HelpGate`] reading found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// The caller waits for the graphs' threads.
    Shut,
    /// The caller runs the graphs' ready work.
    Open,
    /// Open, and the graphs stopped after they were seen moving: their thread lost its CPU.
    Starved,
}

impl HelpGate {
    const CHECK_EVERY: Duration = Duration::from_micros(5);

    pub(crate) fn new() -> Self {
        Self {
            last: Cell::new(None),
            moved: Cell::new(false),
            next: Cell::new(None),
            stalled: Cell::new(false),
        }
    }

    /// Whether the caller may run its graphs' ready work now.
    pub(crate) fn open(&self, shared: &crate::runtime::shared::VmShared) -> bool {
        if !shared.lazy_if_used().is_some_and(VmLazy::has_helpers) {
            return false;
        }
        let core = &shared.core;
        let now = Instant::now();
        // The graphs' threads may lack a CPU.
        let at_once = !core.neighbours_quiet_until.holds_or_clear()
            || core.callers_contended_until.holds_or_clear()
            || crate::engine::helping::caller_preempted_lately(now);
        match self.look(now, at_once, || shared.graph_progress()) {
            Look::Shut => false,
            Look::Open => true,
            Look::Starved => {
                core.neighbours_quiet_until.clear();
                true
            }
        }
    }

    /// [`open`](Self::open) at `now`: `Open` at once if `at_once`, else by the graphs'
    /// progress count, read with `progress` (`None`: no graph has a probe, so none is
    /// seen to move).
    fn look(&self, now: Instant, at_once: bool, progress: impl FnOnce() -> Option<u64>) -> Look {
        if at_once {
            return Look::Open;
        }
        if self.next.get().is_some_and(|n| now < n) {
            return if self.stalled.get() {
                Look::Open
            } else {
                Look::Shut
            };
        }
        self.next.set(Some(now + Self::CHECK_EVERY));
        let p = progress();
        let stalled = match self.last.get() {
            Some((q, since)) if q == p => {
                now.saturating_duration_since(since) >= crate::util::tuning::GRAPH_HELP_PATIENCE
            }
            last => {
                self.moved.set(last.is_some());
                self.last.set(Some((p, now)));
                false
            }
        };
        let was = self.stalled.replace(stalled);
        match (stalled, was, self.moved.get()) {
            (false, ..) => Look::Shut,
            (true, false, true) => Look::Starved,
            (true, ..) => Look::Open,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::tuning::GRAPH_HELP_PATIENCE;

    /// Whether `g` lets the caller help at `now`.
    fn open(g: &HelpGate, now: Instant, progress: impl FnOnce() -> Option<u64>) -> bool {
        g.look(now, false, progress) != Look::Shut
    }

    #[test]
    fn the_gate_opens_at_once_off_a_quiet_machine_without_reading_progress() {
        let g = HelpGate::new();
        let t0 = Instant::now();
        assert_eq!(
            g.look(t0, true, || panic!("read the progress count")),
            Look::Open
        );
    }

    #[test]
    fn the_gate_stays_shut_while_the_graphs_progress() {
        let g = HelpGate::new();
        let t0 = Instant::now();
        let mut count = 0u64;
        for k in 0..1000u32 {
            let now = t0 + k * Duration::from_micros(7);
            let p = || {
                count += 1;
                Some(count)
            };
            assert!(
                !open(&g, now, p),
                "opened at look {k} although the graphs moved"
            );
        }
    }

    #[test]
    fn the_gate_opens_after_the_patience_without_progress_and_shuts_when_it_moves() {
        let g = HelpGate::new();
        let t0 = Instant::now();
        let step = Duration::from_micros(1);
        let mut reads = 0u32;
        let mut now = t0;
        // A look per microsecond: the count is read at most every `CHECK_EVERY`.
        loop {
            let look = g.look(now, false, || {
                reads += 1;
                Some(7)
            });
            if look != Look::Shut {
                // Never seen moving: a thread that has not started, not one that lost
                // its CPU.
                assert_eq!(look, Look::Open);
                break;
            }
            now += step;
            assert!(
                now - t0 <= GRAPH_HELP_PATIENCE + HelpGate::CHECK_EVERY,
                "never opened"
            );
        }
        assert!(
            now - t0 >= GRAPH_HELP_PATIENCE,
            "opened after {:?}",
            now - t0
        );
        let most = (now - t0).as_micros() / HelpGate::CHECK_EVERY.as_micros() + 1;
        assert!(
            u128::from(reads) <= most,
            "{reads} readings in {:?}",
            now - t0
        );
        // Open between readings too, until a reading sees the count move.
        assert!(open(&g, now + step, || panic!("read before `CHECK_EVERY`")));
        assert!(!open(&g, now + HelpGate::CHECK_EVERY, || Some(8)));
    }

    #[test]
    fn a_graph_that_stops_after_moving_is_starved_once_per_stall() {
        let g = HelpGate::new();
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        assert_eq!(g.look(at(0), false, || Some(1)), Look::Shut);
        assert_eq!(g.look(at(10), false, || Some(2)), Look::Shut);
        let stall = at(10) + GRAPH_HELP_PATIENCE;
        assert_eq!(g.look(stall, false, || Some(2)), Look::Starved);
        assert_eq!(
            g.look(stall + HelpGate::CHECK_EVERY, false, || Some(2)),
            Look::Open
        );
        // It moves again, then stops again: a second stall.
        let moved = stall + 2 * HelpGate::CHECK_EVERY;
        assert_eq!(g.look(moved, false, || Some(3)), Look::Shut);
        assert_eq!(
            g.look(moved + GRAPH_HELP_PATIENCE, false, || Some(3)),
            Look::Starved
        );
    }

    #[test]
    fn a_graph_without_a_progress_probe_gets_help_after_the_patience() {
        let g = HelpGate::new();
        let t0 = Instant::now();
        assert!(!open(&g, t0, || None));
        assert!(!open(&g, t0 + HelpGate::CHECK_EVERY, || None));
        assert_eq!(g.look(t0 + GRAPH_HELP_PATIENCE, false, || None), Look::Open);
    }
}
