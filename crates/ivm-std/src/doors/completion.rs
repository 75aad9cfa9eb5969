//! Completions: awaiting the VM from async code, and per-call timeouts.
//!
//! # Futures woken by the VM
//!
//! [`Completion<T>`] is a [`Future`] (and a blocking handle) for one instruction or one
//! batch. The work is submitted when the `_async` call returns (in order with the caller's
//! other submissions), not when the future is first polled. The instruction carries a
//! *completion slot*; the thread that finishes it (a worker, a device adapter's thread, the
//! scheduler for barriers) stores the result there and wakes the stored [`Waker`], so an
//! executor never blocks a thread on the VM:
//!
//! * [`read_small_async`](crate::VirtualMachine::read_small_async): reads 1, 2, 4, 8 or 16
//!   bytes into the caller's buffer when awaited;
//! * [`write_small_async`](crate::VirtualMachine::write_small_async);
//! * [`access_async`](crate::VirtualMachine::access_async): any read callback, its result;
//! * [`sync_async`](crate::VirtualMachine::sync_async): everything received before it has been released;
//! * [`run_async`](crate::VirtualMachine::run_async): a `run` whose batch (and everything received before
//!   it) has been released.
//!
//! Dropping a future abandons the wait, never the work: the instruction still runs and its
//! result is dropped (the executor writes into the slot, never into the caller's memory).
//! If the instruction is dropped without running (poisoned input, a failed device stream, a
//! VM dropped with work in flight), the future resolves to that error instead of hanging.
//! Polling after the VM began shutting down returns [`Error::ShutDown`]; polling in a fork
//! child returns [`Error::Forked`]; polling again after `Ready` returns
//! [`Error::InvalidArgument`].
//!
//! Wakers are woken on VM threads: they must be cheap and must not run the task inline
//! (tokio's, smol's and embassy's do not). In single-thread mode nobody runs the engine in
//! the background, so each poll drives it and, while the result is missing, asks to be
//! polled again at once (a busy future): prefer multi-thread mode under an async runtime.
//!
//! Async small accesses and callbacks run on the tensor's device default stream, after its
//! last writer (as their blocking forms), as a callback on its bytes; on device-only
//! memory the callback gets a host staging copy, filled and written back by the device's
//! own copies in stream order.
//!
//! ```
//! use ivm_std::{Config, VirtualMachine};
//!
//! let vm = VirtualMachine::new(Config::default())?;
//! let s = vm.default_stream();
//! let x = vm.new_tensor(8)?;
//! vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 42))?;
//! let mut out = [0u8; 8];
//! // Any executor works; `wait` blocks the calling thread instead.
//! let read = vm.read_small_async(&x, 0, &mut out);
//! let mut read = std::pin::pin!(read);
//! let waker = std::task::Waker::noop();
//! let mut cx = std::task::Context::from_waker(waker);
//! while read.as_mut().poll(&mut cx).is_pending() {
//!     std::thread::yield_now();
//! }
//! assert_eq!(u64::from_ne_bytes(out), 42);
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! # Per-call timeouts
//!
//! `read_small_timeout`, `write_small_timeout`, `sync_timeout` and
//! [`Completion::wait_timeout`] take a hard deadline for this one call instead of the
//! VM-wide progress period: when it passes, they fail with the same diagnostic
//! [`Error::Timeout`] as the VM-wide timeout (listing the lively instructions). The
//! instruction is then abandoned (never reused) and still runs later. A zero timeout is an
//! [`Error::InvalidArgument`]. In single-thread mode the caller sleeps until the deadline at
//! the latest (without holding the engine, which another thread may drive meanwhile); a
//! kernel that the calling thread is running inline is not interrupted.
//!
//! ```
//! use std::time::Duration;
//! use ivm_std::{Config, Error, VirtualMachine};
//!
//! let vm = VirtualMachine::new(Config::default())?;
//! let x = vm.new_tensor(4)?;
//! let mut out = [0u8; 4];
//! vm.read_small_timeout(&x, 0, &mut out, Duration::from_secs(5))?;
//! assert!(matches!(
//!     vm.read_small_timeout(&x, 0, &mut out, Duration::ZERO),
//!     Err(Error::InvalidArgument(_))
//! ));
//! # Ok::<(), ivm_std::Error>(())
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use ivm_core::counter::WaitError;
use ivm_core::sync::{AtomicU32, Ordering};
use ivm_core::wait::Wait;

use crate::doors::sync_access::name_device_work;
use crate::engine::worker::{caller_runs, caller_runs_any};
use crate::model::blob::Blob;
use crate::model::instruction::{Instruction, Kind};
use crate::model::stream::{CompletionSink, StreamShared};
use crate::model::thread_ctx::ThreadCtx;
use crate::runtime::shared::VmShared;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;
use crate::util::lock;

const PENDING: u32 = 0;
const DONE: u32 = 1;

/// The completion slot shared by a [`Completion`] and the instruction that completes it.
pub(crate) struct Slot<T> {
    /// `PENDING` → `DONE` once; futex word for blocking waiters.
    state: AtomicU32,
    value: Mutex<Option<Result<T>>>,
    waker: Mutex<Option<Waker>>,
    /// Single-thread mode: a caller blocked in [`Completion::wait`] sleeps in the engine's
    /// drive loop, not on `state`; the completion (often on a device's thread) announces
    /// itself there too.
    announce: Option<Arc<dyn CompletionSink>>,
}

impl<T> Slot<T> {
    pub(crate) fn new(announce: Option<Arc<dyn CompletionSink>>) -> Self {
        Self {
            state: AtomicU32::new(PENDING),
            value: Mutex::new(None),
            waker: Mutex::new(None),
            announce,
        }
    }

    fn is_done(&self) -> bool {
        // Acquire: pairs with the Release store in `complete`; the value is then there.
        self.state.load(Ordering::Acquire) == DONE
    }

    /// Stores `r` (first result wins) and wakes the waker and blocking waiters.
    pub(crate) fn complete(&self, r: Result<T>) {
        {
            let mut v = lock(&self.value);
            // Relaxed: read under the value mutex, which orders it with the earlier store.
            if self.state.load(Ordering::Relaxed) == DONE {
                return;
            }
            *v = Some(r);
            // Release: publishes the value stored above to `is_done` readers.
            self.state.store(DONE, Ordering::Release);
        }
        FutexWait::wake_all(&self.state);
        if let Some(a) = &self.announce {
            // After the Release store: a drive loop woken here sees DONE.
            a.unpark();
        }
        // Taken under the waker mutex: a poll that registered before this sees its waker
        // woken here; one that registers after sees DONE when it re-checks. The waker is
        // the user's: a panic in it must not unwind through the VM thread completing this.
        let w = lock(&self.waker).take();
        if let Some(w) = w {
            let _ = crate::util::panics::catch(move || w.wake());
        }
    }

    fn take(&self) -> Option<Result<T>> {
        lock(&self.value).take()
    }
}

/// The executor's end of a completion slot. Dropped without completing (the instruction
/// never ran), it completes the slot with the error `on_drop` computes.
pub(crate) struct Completer<T> {
    pub(crate) slot: Arc<Slot<T>>,
    pub(crate) on_drop: Option<Box<dyn FnOnce() -> Error + Send>>,
}

impl<T> Completer<T> {
    pub(crate) fn complete(mut self, r: Result<T>) {
        self.on_drop = None;
        self.slot.complete(r);
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            self.slot.complete(Err(f()));
        }
    }
}

/// Why an instruction over `blob` on `stream` was dropped without running.
fn dropped_error(blob: &Blob, stream: &StreamShared) -> Error {
    if let Some(f) = blob.poison() {
        return f.poison_error();
    }
    if let Some(f) = stream.dev.sticky.get() {
        return f.poison_error();
    }
    Error::ShutDown
}

/// A result the VM delivers later: a [`Future`], or a blocking handle through
/// [`wait`](Self::wait) / [`wait_timeout`](Self::wait_timeout). See [`crate::doors::completion`].
#[must_use = "the work runs anyway; dropping the completion only forgets its result"]
pub struct Completion<T> {
    vm: Arc<VmShared>,
    slot: Arc<Slot<T>>,
    taken: bool,
    /// Whose queued work a blocking [`wait`](Self::wait) may run itself
    /// (`worker::caller_runs`).
    runs: Runs,
}

/// What a caller blocked in [`Completion::wait`] may run itself while the workers sleep.
enum Runs {
    /// The queue of this worker, up to its instruction (an access on its stream).
    Stream(Arc<ThreadCtx>),
    /// Every worker's queue: it waits for everything received before it (`sync_async`,
    /// `run_async`).
    Everything,
    /// Nothing (a stream without a worker).
    Nothing,
}

impl<T> std::fmt::Debug for Completion<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("vm", &self.vm.id)
            .field("done", &self.slot.is_done())
            .field("taken", &self.taken)
            .finish()
    }
}

impl<T> Completion<T> {
    /// This completion is for one instruction on `stream`: a blocking wait runs only that
    /// stream's worker queue, up to it.
    pub(crate) fn on_stream(mut self, stream: &StreamShared) -> Self {
        self.runs = match &stream.thread {
            Some(w) => Runs::Stream(w.clone()),
            None => Runs::Nothing,
        };
        self
    }

    pub(crate) fn new(vm: &Arc<VmShared>) -> (Self, Arc<Slot<T>>) {
        let announce = vm
            .core
            .single_thread()
            .then(|| vm.core.token().clone() as Arc<dyn CompletionSink>);
        let slot = Arc::new(Slot::new(announce));
        (
            Self {
                vm: vm.clone(),
                slot: slot.clone(),
                taken: false,
                runs: Runs::Everything,
            },
            slot,
        )
    }

    /// A completion that is already resolved (validation errors of `_async` calls).
    pub(crate) fn ready(vm: &Arc<VmShared>, r: Result<T>) -> Self {
        let (c, slot) = Self::new(vm);
        slot.complete(r);
        c
    }

    /// Whether the result has arrived (polling would return `Ready`).
    pub fn is_done(&self) -> bool {
        self.slot.is_done()
    }

    fn check(&self) -> Result<()> {
        self.vm.core.birth().check()?;
        if self.taken {
            return Err(Error::InvalidArgument(
                "a completion was polled again after it returned Ready".into(),
            ));
        }
        if self.vm.core.is_shut() {
            return Err(Error::ShutDown);
        }
        Ok(())
    }

    fn take(&mut self) -> Result<T> {
        self.taken = true;
        self.slot.take().unwrap_or(Err(Error::ShutDown))
    }

    /// Blocks until the result arrives; fails with [`Error::Timeout`] (with a diagnostic)
    /// after a whole `timeout_period` of the VM in which no instruction finished.
    ///
    /// # Errors
    /// The instruction's own error; [`Error::Reentrant`] from a VM thread (waiting there
    /// would deadlock); [`Error::ShutDown`]; [`Error::Forked`]; [`Error::Timeout`].
    pub fn wait(self) -> Result<T> {
        let period = self.vm.core.config().timeout_period;
        self.wait_inner(period, true)
    }

    /// Blocks until the result arrives or `timeout` passes (then [`Error::Timeout`] with a
    /// diagnostic). The work itself is not cancelled.
    ///
    /// # Errors
    /// As [`wait`](Self::wait); a zero `timeout` is an [`Error::InvalidArgument`].
    pub fn wait_timeout(self, timeout: Duration) -> Result<T> {
        check_timeout(timeout)?;
        self.wait_inner(timeout, false)
    }

    fn wait_inner(mut self, period: Duration, progress: bool) -> Result<T> {
        self.check()?;
        if crate::engine::core::inside(self.vm.id) {
            return Err(Error::Reentrant);
        }
        let slot = self.slot.clone();
        if self.vm.core.single_thread() {
            // `wait_timeout`: a hard deadline; `wait`: the VM-wide progress period.
            let deadline = (!progress).then(|| FutexWait::now().saturating_add(period));
            // `wait` (not `wait_timeout`, whose deadline a graph kernel could outlast) runs
            // lazy graphs' ready actors while it waits, as a worker would.
            let vm = &self.vm;
            self.vm.core.drive_until_helping(
                |_| slot.is_done(),
                deadline,
                || progress && crate::doors::sync_access::graph_help(vm, &|| slot.is_done()),
                || progress.then(|| vm.graph_progress()).flatten(),
            )?;
            return self.take();
        }
        let _hook = (!slot.is_done()).then(|| self.vm.core.wait_scope());
        let mut last = self.vm.core.progress();
        let mut end = FutexWait::now().saturating_add(period);
        while !slot.is_done() {
            // Before sleeping: run what is queued to a sleeping worker (`caller_runs`) —
            // not in `wait_timeout`: a kernel run here could outlast the caller's deadline,
            // which the caller could then not keep.
            let done = || slot.is_done();
            let ran = progress
                && match &self.runs {
                    Runs::Stream(w) => caller_runs(&self.vm.core, w, done),
                    Runs::Everything => caller_runs_any(&self.vm.core, done),
                    Runs::Nothing => false,
                };
            if ran {
                continue;
            }
            FutexWait::wait(&slot.state, PENDING, Some(end));
            if slot.is_done() {
                break;
            }
            if FutexWait::now() >= end {
                let now = self.vm.core.progress();
                if !progress || now == last {
                    return Err(Error::Timeout(self.vm.core.diagnostic()));
                }
                last = now;
                end = FutexWait::now().saturating_add(period);
            }
        }
        self.take()
    }
}

impl<T> Future for Completion<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        if let Err(e) = this.check() {
            this.taken = true;
            return Poll::Ready(Err(e));
        }
        if this.slot.is_done() {
            return Poll::Ready(this.take());
        }
        if this.vm.core.single_thread() {
            // Nobody runs the engine in the background: drive it here.
            if crate::engine::core::inside(this.vm.id) {
                this.taken = true;
                return Poll::Ready(Err(Error::Reentrant));
            }
            if let Err(e) = this.vm.core.drive() {
                this.taken = true;
                return Poll::Ready(Err(e));
            }
            if this.slot.is_done() {
                return Poll::Ready(this.take());
            }
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        {
            let mut w = lock(&this.slot.waker);
            match &mut *w {
                Some(old) if old.will_wake(cx.waker()) => {}
                other => *other = Some(cx.waker().clone()),
            }
        }
        // Re-check after registering (see `Slot::complete`).
        if this.slot.is_done() {
            return Poll::Ready(this.take());
        }
        Poll::Pending
    }
}

/// The future of [`read_small_async`](crate::VirtualMachine::read_small_async): copies the bytes into the
/// caller's buffer when it resolves.
#[must_use = "the read runs anyway; dropping the future only forgets its result"]
#[derive(Debug)]
pub struct ReadSmallMem<'a> {
    pub(crate) inner: Completion<[u8; 16]>,
    pub(crate) out: &'a mut [u8],
}

impl Future for ReadSmallMem<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => Poll::Ready(r.map(|bytes| {
                let n = this.out.len();
                this.out.copy_from_slice(&bytes[..n]);
            })),
        }
    }
}

impl ReadSmallMem<'_> {
    /// Blocks until the bytes arrive or `timeout` passes (see [`Completion::wait_timeout`]).
    ///
    /// # Errors
    /// As [`Completion::wait_timeout`].
    pub fn wait_timeout(self, timeout: Duration) -> Result<()> {
        let bytes = self.inner.wait_timeout(timeout)?;
        let n = self.out.len();
        self.out.copy_from_slice(&bytes[..n]);
        Ok(())
    }
}

pub(crate) fn check_timeout(timeout: Duration) -> Result<()> {
    if timeout.is_zero() {
        return Err(Error::InvalidArgument(
            "a timeout of zero (use a positive duration)".into(),
        ));
    }
    Ok(())
}

/// Validates an async access of `t` and returns its default stream.
pub(crate) fn async_target(shared: &Arc<VmShared>, t: &Tensor) -> Result<Arc<StreamShared>> {
    shared.core.check_caller()?;
    shared.check_tensor(t)?;
    shared.default_stream_of(t.device())
}

/// Receives `instr` after the soft sync that `t` needs on `stream`.
pub(crate) fn submit_on(
    shared: &VmShared,
    t: &Tensor,
    stream: &Arc<StreamShared>,
    instr: Instruction,
    write: bool,
) -> Result<()> {
    {
        // SAFETY: not shared yet; we own the body (ownership step 1).
        let body = unsafe { instr.body_mut() };
        if write {
            body.outputs.push(t.blob().clone());
        } else {
            body.inputs.push(t.blob().clone());
        }
    }
    let mut list = Vec::with_capacity(1);
    shared.soft_sync([t], stream, &mut |i| list.push(i));
    list.push(Arc::new(instr));
    shared.core.receive_list(&mut list, true)
}

pub(crate) fn completer_for<T>(
    slot: Arc<Slot<T>>,
    t: &Tensor,
    stream: &Arc<StreamShared>,
) -> Completer<T> {
    let (blob, st) = (t.blob().clone(), stream.clone());
    Completer {
        slot,
        on_drop: Some(Box::new(move || dropped_error(&blob, &st))),
    }
}

/// A barrier instruction whose callback completes `slot`.
pub(crate) fn barrier_completing(shared: &VmShared, slot: Arc<Slot<()>>) -> Instruction {
    let done = Completer {
        slot,
        on_drop: Some(Box::new(|| Error::ShutDown)),
    };
    let mut instr = Instruction::new(
        "sync_async",
        shared.barrier_stream(),
        Kind::Barrier(Box::new(move || done.complete(Ok(())))),
    );
    instr.barrier = true;
    instr
}

/// Waits for `instr` (received, with a waiter) with a hard deadline `timeout` from now.
pub(crate) fn wait_deadline(
    shared: &VmShared,
    instr: &Arc<Instruction>,
    timeout: Duration,
    skip: bool,
) -> Result<()> {
    let Some(waiter) = instr.waiter.as_ref() else {
        return Err(Error::InvalidArgument(
            "internal: waiting on an instruction without waiter".into(),
        ));
    };
    if shared.core.single_thread() {
        let deadline = FutexWait::now().saturating_add(timeout);
        return shared
            .core
            .drive_until(|_| waiter.btb.is_done(), Some(deadline))
            .map_err(|e| name_device_work(e, instr));
    }
    if skip && shared.core.flying() < shared.core.config().skip_blocking_threshold {
        waiter.btb.skip_blocking();
    }
    let _hook = (!waiter.btb.is_done()).then(|| shared.core.wait_scope());
    // No `caller_runs` here: a wait with a deadline of its own only waits. A kernel it ran
    // itself could outlast the deadline, which it could then not keep (and a kernel that
    // waits for this very caller's next step, after the timeout, would never end). So the
    // workers run it: those asleep with work left to their doze are woken now.
    if !waiter.btb.is_done() {
        crate::engine::worker::wake_sleepers_with_work(&shared.core);
    }
    match waiter.btb.wait_until_done(timeout, || true) {
        Ok(()) => Ok(()),
        Err(WaitError::Stopped) => Err(name_device_work(
            Error::Timeout(shared.core.diagnostic()),
            instr,
        )),
        Err(WaitError::Closed) => Err(Error::ShutDown),
    }
}
