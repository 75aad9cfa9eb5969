//! The graph's account of its state for a VM timeout's diagnostic
//! (`LazyGraph::set_state_probe`): what a launch that never finishes was waiting for.
//!
//! Separate because it reads every part of [`Shared`] and changes none: a snapshot made
//! of Relaxed loads, `try_lock`s and the buffers' short locks (none is held across user
//! code or a wait), never a wait on the graph's threads.

use std::fmt::Write;

use ivm_core::sync::Ordering;

use super::{Shared, try_lock};

impl Shared {
    /// One line: runs finished and queued, each graph thread's actors (free, or held by
    /// the thread's own scan or a helping caller) and its notifier, each actor's finished
    /// iterations, the parameter kernels' turn, and the job's buffers that hold records.
    pub(super) fn describe(&self) -> String {
        let mut out = String::new();
        // Relaxed, here and below: a snapshot for a person to read; nothing is read
        // through these values.
        let _ = write!(
            out,
            "{} run(s) finished, {} started and unfinished",
            self.runs_finished.load(Ordering::Relaxed),
            try_lock(&self.jobs).map_or_else(|| "?".to_string(), |j| j.len().to_string()),
        );
        if self.stop.load(Ordering::Relaxed) {
            out.push_str(", stopped");
        }
        for (t, actors) in self.threads.iter().enumerate() {
            let notifier = format!("{:?}", self.notifiers[t]);
            // A thread that finds them locked by this look and owes them a scan sleeps
            // only for a bounded stretch (`thread_loop`, `owed`): the look loses no wake.
            let held = if try_lock(actors).is_some() {
                "free"
            } else {
                "in a scan"
            };
            let _ = write!(out, "; thread {t}: actors {held}, notifier {notifier}");
        }
        out.push_str("; done:");
        for a in &self.actors {
            let _ = write!(out, " {}={}", a.name, a.done.load(Ordering::Relaxed));
        }
        let turn = self.param_turn.load(Ordering::Relaxed);
        if let Some(iteration) = turn.checked_div(self.param_kernels) {
            let _ = write!(
                out,
                "; parameter turn: iteration {iteration} kernel {}",
                turn % self.param_kernels
            );
        }
        let queued: Vec<String> = self
            .lazy
            .buffers()
            .occupancy()
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .map(|(name, n)| format!("{name}={n}"))
            .collect();
        if !queued.is_empty() {
            let _ = write!(out, "; buffers holding records: {}", queued.join(" "));
        }
        out
    }
}
