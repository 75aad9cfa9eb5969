//! Shared end-event records: how a graph runtime tells the VM that it is done with one
//! interface tensor of one run.
//!
//! A record is created empty by a critical-section begin instruction, shared with the
//! matching critical-section end instruction, and initialised exactly once by the graph
//! runtime (the interface kernel after its copy, or `finish` for whatever is left). It is
//! *done* once it is initialised; the end instruction is done when its record is. (The
//! graph runtime only ever sees host memory: a lazy launch stages device-only tensors
//! through host ones, so its copies are synchronous.)

use std::fmt;
use std::sync::Mutex;

use crate::util::error::Error;
use crate::util::lock;

/// The event a [`SharedEventRecord`] is initialised with.
#[derive(Clone)]
pub enum EndEvent {
    /// Already done: a synchronous copy, a tensor without memory, an invalid interface,
    /// or `finish` of a run.
    Done,
    /// The run failed for this interface: the end instruction fails with this error (an
    /// output end poisons its tensor with it).
    Failed(Error),
}

impl fmt::Debug for EndEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndEvent::Done => f.write_str("Done"),
            EndEvent::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
        }
    }
}

/// [`SharedEventRecord::init`] on a record that is already initialised (the event it was
/// given is handed back).
#[derive(Debug, Clone)]
pub struct AlreadyInitialised(pub EndEvent);

/// What a record's waiter is told once the record is done.
pub type RecordResult = Result<(), Error>;

type DoneFn = Box<dyn FnOnce(RecordResult) + Send>;

#[derive(Default)]
struct State {
    event: Option<EndEvent>,
    waiters: Vec<DoneFn>,
}

/// An end-event record shared by a critical-section begin instruction, its end
/// instruction and the graph runtime: created empty, initialised once.
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use ivm_std::lazy::{EndEvent, SharedEventRecord};
///
/// let r = SharedEventRecord::new();
/// let seen = Arc::new(Mutex::new(None));
/// let s2 = seen.clone();
/// r.on_done(move |res| *s2.lock().unwrap() = Some(res.is_ok()));
/// assert!(!r.is_done());
/// r.init(EndEvent::Done).unwrap();
/// assert!(r.is_done());
/// assert_eq!(*seen.lock().unwrap(), Some(true));
/// assert!(!r.try_init(EndEvent::Done)); // no-op on an initialised record
/// assert!(r.init(EndEvent::Done).is_err());
/// ```
pub struct SharedEventRecord {
    state: Mutex<State>,
}

impl Default for SharedEventRecord {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for SharedEventRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = lock(&self.state);
        f.debug_struct("SharedEventRecord")
            .field("event", &g.event)
            .field("waiters", &g.waiters.len())
            .finish()
    }
}

/// Runs `f` with the record's result once `event` is done.
fn when_done(event: &EndEvent, f: DoneFn) {
    match event {
        EndEvent::Done => f(Ok(())),
        EndEvent::Failed(e) => f(Err(e.clone())),
    }
}

impl SharedEventRecord {
    /// An empty (uninitialised) record.
    pub fn new() -> Self {
        Self {
            state: Mutex::new(State::default()),
        }
    }

    /// Initialises the record with `event`.
    ///
    /// # Errors
    /// [`AlreadyInitialised`] (with `event`) if it was initialised before; the record is
    /// unchanged.
    pub fn init(&self, event: EndEvent) -> Result<(), AlreadyInitialised> {
        let mut event = Some(event);
        if self.init_with(|| event.take().expect("init_with calls its closure once")) {
            Ok(())
        } else {
            Err(AlreadyInitialised(event.expect(
                "the closure did not run, so the event is still here",
            )))
        }
    }

    /// Initialises the record with `event` unless it is already initialised (then it does
    /// nothing). Returns whether it initialised it.
    pub fn try_init(&self, event: EndEvent) -> bool {
        self.init_with(|| event)
    }

    /// If the record is empty, runs `make` *under the record's lock* and initialises the
    /// record with what it returns; otherwise does nothing. Returns whether it ran. Holding
    /// the lock makes the work inside `make` (an interface copy) and the initialisation
    /// one step: a concurrent `try_init` (a run's `finish`) waits for it, and after an
    /// initialisation nobody can start such work any more.
    pub fn init_with(&self, make: impl FnOnce() -> EndEvent) -> bool {
        let mut g = lock(&self.state);
        if g.event.is_some() {
            return false;
        }
        let event = make();
        g.event = Some(event.clone());
        let waiters = std::mem::take(&mut g.waiters);
        drop(g);
        for w in waiters {
            when_done(&event, w);
        }
        true
    }

    /// Whether the record has been initialised.
    pub fn is_initialised(&self) -> bool {
        lock(&self.state).event.is_some()
    }

    /// Whether the record is done (initialised).
    pub fn is_done(&self) -> bool {
        lock(&self.state).event.is_some()
    }

    /// The record's result once it is done (`None` before).
    pub fn result(&self) -> Option<RecordResult> {
        match &lock(&self.state).event {
            None => None,
            Some(EndEvent::Done) => Some(Ok(())),
            Some(EndEvent::Failed(e)) => Some(Err(e.clone())),
        }
    }

    /// Calls `f` once, when the record is done (at once, on this thread, if it already
    /// is; otherwise on the thread that initialises it).
    pub fn on_done(&self, f: impl FnOnce(RecordResult) + Send + 'static) {
        let mut g = lock(&self.state);
        match &g.event {
            None => g.waiters.push(Box::new(f)),
            Some(event) => {
                let event = event.clone();
                drop(g);
                when_done(&event, Box::new(f));
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn empty_record_is_not_done_until_init() {
        let r = SharedEventRecord::new();
        assert!(!r.is_initialised() && !r.is_done());
        assert!(r.result().is_none());
        assert!(r.try_init(EndEvent::Done));
        assert!(r.is_initialised() && r.is_done());
        assert!(!r.try_init(EndEvent::Failed(Error::ShutDown)), "no-op");
        assert!(matches!(r.result(), Some(Ok(()))));
        assert!(matches!(
            r.init(EndEvent::Done),
            Err(AlreadyInitialised(EndEvent::Done))
        ));
    }

    #[test]
    fn init_runs_the_waiters_and_later_ones_at_once() {
        let r = SharedEventRecord::new();
        let fired = Arc::new(AtomicUsize::new(0));
        let f2 = fired.clone();
        r.on_done(move |res| {
            assert!(res.is_ok());
            f2.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(fired.load(Ordering::Relaxed), 0, "not initialised yet");
        r.init(EndEvent::Done).unwrap();
        assert!(r.is_initialised() && r.is_done());
        assert_eq!(fired.load(Ordering::Relaxed), 1);
        // A late waiter on a done record runs at once.
        let f3 = fired.clone();
        r.on_done(move |_| {
            f3.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(fired.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn failed_record_reports_its_error() {
        let r = SharedEventRecord::new();
        r.init(EndEvent::Failed(Error::GraphClosed { job: "j".into() }))
            .unwrap();
        assert!(r.is_done());
        let got = Arc::new(Mutex::new(None));
        let g2 = got.clone();
        r.on_done(move |res| *g2.lock().unwrap() = Some(res));
        assert!(matches!(
            got.lock().unwrap().take(),
            Some(Err(Error::GraphClosed { .. }))
        ));
    }

    #[test]
    fn init_with_runs_once_under_contention() {
        let r = Arc::new(SharedEventRecord::new());
        let ran = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let (r, ran) = (r.clone(), ran.clone());
                s.spawn(move || {
                    r.init_with(|| {
                        ran.fetch_add(1, Ordering::Relaxed);
                        EndEvent::Done
                    });
                    r.try_init(EndEvent::Done);
                });
            }
        });
        assert_eq!(ran.load(Ordering::Relaxed), 1);
        assert!(r.is_done());
    }
}
