//! Sim events: completed by the recording stream's thread when its queue reaches them.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use ivm_std::{Device, Event, HostFn, Result};

#[derive(Default)]
struct State {
    done: bool,
    callbacks: Vec<HostFn>,
}

/// The shared part of a sim event.
#[derive(Default)]
pub(crate) struct EventInner {
    state: Mutex<State>,
    cv: Condvar,
}

impl EventInner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.lock().done
    }

    /// Completes the event (the recording stream reached it): runs the callbacks on this
    /// thread, then marks it done and wakes waiters — so once `query()` or `synchronize()`
    /// sees the event done, every callback registered before that has run. A callback
    /// registered while others run is picked up by the next round of the loop; one
    /// registered after `done` runs at once in `on_complete`.
    pub(crate) fn complete(&self) {
        loop {
            let callbacks = {
                let mut s = self.lock();
                if s.callbacks.is_empty() {
                    s.done = true;
                    break;
                }
                std::mem::take(&mut s.callbacks)
            };
            for f in callbacks {
                f();
            }
        }
        self.cv.notify_all();
    }

    /// Blocks until the event completed (sleeps on a condition variable).
    pub(crate) fn wait(&self) {
        let mut s = self.lock();
        while !s.done {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// An event recorded on a sim stream.
pub struct SimEvent {
    pub(crate) device: Device,
    pub(crate) inner: Arc<EventInner>,
}

impl std::fmt::Debug for SimEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEvent")
            .field("device", &self.device)
            .field("done", &self.inner.is_done())
            .finish()
    }
}

impl Event for SimEvent {
    fn device(&self) -> Device {
        self.device
    }
    fn query(&self) -> bool {
        self.inner.is_done()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.wait();
        Ok(())
    }
    fn on_complete(&self, f: HostFn) {
        let mut s = self.inner.lock();
        if s.done {
            drop(s);
            f();
        } else {
            s.callbacks.push(f);
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
