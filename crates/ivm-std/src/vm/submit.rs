//! The submission door of a [`VirtualMachine`]: [`run`](VirtualMachine::run) hands built
//! instructions to the engine, [`sync`](VirtualMachine::sync) waits for everything before
//! it (and its device half, [`sync_devices`]), and
//! [`blocking_run_probe`](VirtualMachine::blocking_run_probe) waits for a probe.

use std::sync::{Arc, Mutex};

use ivm_core::counter::BlockingCounter;
use ivm_core::sync::{AtomicBool, Ordering};

use super::VirtualMachine;
use crate::doors::builder::InstructionsBuilder;
use crate::doors::sync_access;
use crate::engine::core::{Probe, ReentryGuard};
use crate::runtime::shared::VmShared;
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;
use crate::util::lock;
use crate::util::panics::catch;

impl VirtualMachine {
    /// Builds instructions with `f` and hands them to the VM. If `f` returns an error,
    /// nothing is submitted. Blocks while more than the high-water mark are in flight.
    ///
    /// # Errors
    /// [`Error::Reentrant`] from a VM thread, kernel, callback or barrier;
    /// [`Error::ShutDown`]; whatever `f` returns.
    pub fn run<R>(&self, f: impl FnOnce(&mut InstructionsBuilder<'_>) -> Result<R>) -> Result<R> {
        self.shared.core.check_caller()?;
        crate::engine::preemption::sense_caller(&self.shared.core);
        let mut b = InstructionsBuilder::new(&self.shared);
        let r = f(&mut b)?;
        let at_rest = b.run_at_rest_or_submit()?;
        // After a run at rest the engine has nothing to do unless a kernel, or a handle
        // given up, pushed a tensor's release meanwhile.
        if !at_rest || !self.shared.core.nothing_pending() {
            self.shared.core.drive()?;
        }
        Ok(r)
    }

    /// Waits until every instruction received before this call has been released and the
    /// device work of every asynchronous device stream has completed.
    ///
    /// # Errors
    /// Besides the usual ones: a sticky asynchronous failure of a device stream (a kernel
    /// that failed after its instruction was done at launch), reported once and cleared,
    /// or an error the device reported. [`Error::Timeout`] when the device work has not
    /// completed one `timeout_period` after the release (an event that never completes):
    /// its diagnostic has a `device work of <stream>` entry per stream still waited for.
    /// [`Error::KernelPanicked`] naming a barrier
    /// ([`InstructionsBuilder::barrier`]) whose callback panicked since the last `sync`
    /// that reported one (the first such barrier; reported once).
    pub fn sync(&self) -> Result<()> {
        self.shared.core.check_caller()?;
        // A reusable barrier from this thread's ring: no allocation in steady state.
        let instr = sync_access::sync_barrier(&self.shared);
        sync_access::sync_wait(&self.shared, instr)?;
        let deadline = crate::util::deadline_after(self.shared.core.config().timeout_period);
        sync_devices(&self.shared, deadline)?;
        self.shared
            .core
            .take_barrier_failure()
            .map_or(Ok(()), |f| Err(f.to_error()))
    }

    /// Polls `probe` on the scheduler thread (in single-thread mode, on this thread, between
    /// engine steps) until it returns true, and waits for that.
    ///
    /// # Errors
    /// [`Error::KernelPanicked`] when the probe panics. [`Error::Timeout`] when the probe
    /// has not returned true and no instruction at all finished during one whole
    /// `timeout_period`, as every blocking wait: the probe is then withdrawn (never
    /// called again once this returns) and the diagnostic counts it under `probes`.
    pub fn blocking_run_probe(
        &self,
        mut probe: impl FnMut() -> bool + Send + 'static,
    ) -> Result<()> {
        self.shared.core.check_caller()?;
        let core = &self.shared.core;
        let period = core.config().timeout_period;
        // A period without progress: no instruction finished since the last look.
        let mut last = core.progress();
        let mut stalled = move || {
            let now = core.progress();
            std::mem::replace(&mut last, now) == now
        };
        if core.single_thread() {
            let mut period_end = crate::util::deadline_after(period);
            loop {
                core.drive()?;
                let r = {
                    let _reentry = ReentryGuard::enter(self.shared.id);
                    catch(&mut probe)
                };
                match r {
                    Ok(true) => return Ok(()),
                    Ok(false) => std::thread::yield_now(),
                    Err(message) => {
                        return Err(Error::KernelPanicked {
                            instruction: "probe".into(),
                            message,
                        });
                    }
                }
                if std::time::Instant::now() >= period_end {
                    if stalled() {
                        let mut d = core.diagnostic();
                        d.probes += 1;
                        return Err(Error::Timeout(d));
                    }
                    period_end = crate::util::deadline_after(period);
                }
            }
        }
        let _hook = core.wait_scope();
        let panicked: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let done = Arc::new(BlockingCounter::<FutexWait>::new(1));
        // Set by a caller that gave up: the scheduler drops the probe at its next poll.
        let withdrawn = Arc::new(AtomicBool::new(false));
        let (d2, p2, w2) = (done.clone(), panicked.clone(), withdrawn.clone());
        core.submit_probe(Probe::User(Box::new(move || {
            // Relaxed: a request to stop polling; the probe publishes nothing to a caller
            // that has left.
            if w2.load(Ordering::Relaxed) {
                return true;
            }
            let r = match catch(&mut probe) {
                Ok(r) => r,
                Err(message) => {
                    *lock(&p2) = Some(message);
                    true
                }
            };
            if r {
                // Release: publishes the probe's effects to the waiting caller.
                d2.decrease();
            }
            r
        })));
        if done.wait_until_zero(period, stalled).is_err() {
            // The diagnostic first, so that it counts the probe: the scheduler still polls
            // it in the round that answers. Withdrawn first, a round that began between
            // the two would drop it before the diagnostic's round counts.
            let d = core.diagnostic();
            // Relaxed: see the probe.
            withdrawn.store(true, Ordering::Relaxed);
            // Acquire (in `is_zero`): the probe may have succeeded meanwhile.
            if !done.is_zero() {
                return Err(Error::Timeout(d));
            }
        }
        match lock(&panicked).take() {
            Some(m) => Err(Error::KernelPanicked {
                instruction: "probe".into(),
                message: m,
            }),
            None => Ok(()),
        }
    }
}

/// The device half of `sync`: instructions on asynchronous devices are released when
/// launched, so it waits for their device work too, until `deadline` at the latest. A
/// host-observed completion: reports (and clears) sticky failures and device errors,
/// except after a timeout, which leaves them to the next observation.
pub(crate) fn sync_devices(shared: &VmShared, deadline: std::time::Instant) -> Result<()> {
    let streams = shared.async_streams();
    let _hook = (!streams.is_empty()).then(|| shared.core.wait_scope());
    shared.wait_devices(&streams, deadline, true)?;
    let mut first = None;
    for s in &streams {
        let f = s.dev.sticky.take().map(|f| f.poison_error());
        let e = s.dev.stream.take_error().map(Error::Device);
        if first.is_none() {
            first = f.or(e);
        }
    }
    first.map_or(Ok(()), Err)
}
