//! The per-VM lazy-job state ([`VmLazy`]): the launcher's queue, the transport dependence
//! and what the launched graphs offer a waiting caller; kept type-erased in the VM's shared
//! state and reached through `VmShared::lazy`.

use std::sync::{Arc, Mutex, Weak};

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
