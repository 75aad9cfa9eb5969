//! The lazy-job launcher stream's queue ([`LauncherQueue`]): which launches may push their
//! job instance now, in launch order, without blocking a thread.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::util::lock;

/// What a launch does once the launcher's queue lets it go: enqueue is done, push the
/// job instance (`true`: on the launcher thread, may block on a full buffer; `false`: on
/// the thread of a finishing run, must not block).
type Admit = Box<dyn FnOnce(bool) + Send>;

/// The launcher stream's queue: the graph of every run launched and not yet finished, in
/// launch order, and the launches waiting for it. A launch of another graph than the ones
/// queued waits until the queue is empty; runs of the same graph pipeline. Waiting blocks
/// no thread: a waiting launch is parked here and admitted by the run whose finish
/// empties the queue.
#[derive(Default)]
pub(crate) struct LauncherQueue {
    inner: Mutex<QueueInner>,
}

#[derive(Default)]
struct QueueInner {
    /// Graph ids of runs admitted and not finished, oldest first.
    running: VecDeque<usize>,
    /// Launches not admitted yet, in launch order.
    waiting: VecDeque<(usize, Admit)>,
    /// A thread is running admitted launches' pushes: others leave the admitting to it,
    /// so job instances reach the buffers in launch order.
    admitting: bool,
}

impl QueueInner {
    fn admits(&self, graph: usize) -> bool {
        self.running.iter().all(|&g| g == graph)
    }
}

impl LauncherQueue {
    /// Admits a launch of `graph` now (enqueueing the graph, then running `admit` on this
    /// thread) if no run of another graph is queued, no launch waits and nobody else is
    /// admitting; parks it otherwise.
    pub(crate) fn submit(&self, graph: usize, admit: Admit) {
        let mut g = lock(&self.inner);
        if g.waiting.is_empty() && !g.admitting && g.admits(graph) {
            // Enqueue *before* the job instance is pushed: a fast graph may finish the run
            // (and dequeue it) as soon as its source tick sees it.
            g.running.push_back(graph);
            g.admitting = true;
            drop(g);
            admit(true);
            self.admit_waiting(lock(&self.inner), true);
        } else {
            g.waiting.push_back((graph, admit));
        }
    }

    /// A run of `graph` finished: takes it off the queue and admits the launches that
    /// may go now, in launch order (unless another thread is admitting: it will).
    pub(crate) fn dequeue(&self, graph: usize) {
        let mut g = lock(&self.inner);
        if let Some(p) = g.running.iter().position(|&x| x == graph) {
            g.running.remove(p);
        }
        if g.admitting {
            return;
        }
        self.admit_waiting(g, false);
    }

    /// Admits waiting launches in order while the queue lets them go, running their
    /// pushes outside the lock; `on_launcher`: this is the launcher thread (may block).
    fn admit_waiting<'a>(
        &'a self,
        mut g: std::sync::MutexGuard<'a, QueueInner>,
        on_launcher: bool,
    ) {
        loop {
            let mut batch = Vec::new();
            while let Some(&(next, _)) = g.waiting.front() {
                if !g.admits(next) {
                    break;
                }
                g.running.push_back(next);
                if let Some((_, a)) = g.waiting.pop_front() {
                    batch.push(a);
                }
            }
            if batch.is_empty() {
                g.admitting = false;
                return;
            }
            g.admitting = true;
            drop(g);
            for a in batch {
                a(on_launcher);
            }
            g = lock(&self.inner);
        }
    }
}
