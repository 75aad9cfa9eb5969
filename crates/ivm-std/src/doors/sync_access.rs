//! Synchronous doors into the VM: small-memory reads and writes (`loss.item()`), sync
//! blob callbacks, and waiting for one instruction with the blocking-then-busy handshake.
//!
//! A sync small access (ARCHITECTURE.md, "Sync small-memory access"):
//! * runs on the tensor's device **default** stream;
//! * with nothing in flight, becomes no instruction at all: the caller copies itself
//!   (`inline_sync_access`), or hands the copy to the stream's polling worker (the
//!   express lane, `model/express.rs`); with work queued to the stream's sleeping worker,
//!   the caller first runs what was built before the call (`caller_runs_built_before`),
//!   then looks again;
//! * else takes a reusable instruction from a thread-local ring per (VM, stream, kind)
//!   (`small_ring.rs`), and allocates only when every ring entry is still in flight;
//! * the executor copies into / out of a 16-byte buffer inside the instruction, never the
//!   caller's memory; the caller copies after its Acquire;
//! * notify-skip when fewer than `skip_blocking_threshold` instructions are in flight;
//! * block, then spin; after each `timeout_period` without any instruction finishing,
//!   the wait fails with a diagnostic, and the instruction is abandoned (dropped from the
//!   ring, never reused).

use std::sync::Arc;

use ivm_core::counter::WaitError;
use ivm_core::sync::Ordering;

use crate::device::check_range;
use crate::doors::small_ring::{SmallKind, abandon, take_small};
use crate::engine::worker::WaitingCaller;
use crate::model::instruction::{Instruction, Kind, ReadFn, Waiter, WriteFn, status};
use crate::model::stream::StreamShared;
use crate::runtime::shared::VmShared;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};

/// `VirtualMachine::sync`'s barrier instruction (with a waiter), from this thread's ring.
pub(crate) fn sync_barrier(shared: &VmShared) -> Arc<Instruction> {
    take_small(shared, &shared.barrier_stream, SmallKind::Sync, 0, 0).0
}

/// `VirtualMachine::sync`: receives `instr` (from [`sync_barrier`]) and waits for it; on
/// an error the instruction is abandoned (never reused).
pub(crate) fn sync_wait(shared: &VmShared, instr: Arc<Instruction>) -> Result<()> {
    let waited = instr.clone();
    if let Err(e) = shared.core.receive_one(instr, false) {
        abandon(&waited);
        return Err(e);
    }
    if let Err(e) = wait(shared, &waited, false) {
        abandon(&waited);
        return Err(e);
    }
    Ok(())
}

/// A small access's length: [`Error::UnsupportedSize`] unless 1, 2, 4, 8 or 16 bytes.
pub(crate) fn check_size(len: usize) -> Result<()> {
    match len {
        1 | 2 | 4 | 8 | 16 => Ok(()),
        _ => Err(Error::UnsupportedSize(len)),
    }
}

/// A small access done by the caller itself, with the engine held and at rest (nothing
/// lively, nothing received: see `VmCore::try_direct`): what the instruction would do,
/// without one. A poisoned tensor fails as the instruction would.
fn direct_access(
    t: &Tensor,
    offset: usize,
    len: usize,
    read: Option<&mut [u8]>,
    write: Option<&[u8]>,
) -> Result<()> {
    let blob = t.blob();
    if let Some(f) = blob.poison() {
        return Err(f.poison_error());
    }
    if let Some(out) = read {
        // SAFETY: the engine is held and at rest: no instruction that accesses this blob
        // is lively, and none can be dispatched before we let go (engine-ordered
        // invariant); a synchronous device with host-visible memory (checked by the
        // caller) has no device work in flight on it; bounds checked by `small_access`.
        let src = unsafe { &blob.bytes()[offset..offset + len] };
        out.copy_from_slice(src);
    } else if let Some(src) = write {
        // SAFETY: as above, exclusive: nothing else accesses the blob meanwhile.
        let dst = unsafe { &mut blob.bytes_mut()[offset..offset + len] };
        dst.copy_from_slice(src);
    }
    Ok(())
}

/// A small access handed to the polling worker `worker` through its express lane, with the
/// engine held and at rest (as [`direct_access`]). `None` when the worker declined: its
/// lane was closed (it went to sleep), or it did not take the access within
/// `tuning::EXPRESS_PATIENCE` (it is not running): nothing was done, and the caller takes
/// the instruction path.
#[inline(never)]
fn express_access(
    worker: &crate::model::thread_ctx::ThreadCtx,
    t: &Tensor,
    offset: usize,
    read: Option<&mut [u8]>,
    write: Option<&[u8]>,
) -> Option<Result<()>> {
    let blob = t.blob();
    if let Some(f) = blob.poison() {
        return Some(Err(f.poison_error()));
    }
    let base = blob.mem.host_ptr()?.as_ptr();
    // Spin briefly (a worker polling on another CPU answers within a microsecond), then
    // yield between looks (the worker may be waiting for this very CPU), then withdraw.
    let start = std::time::Instant::now();
    let (mut looks, mut yielding) = (0u32, false);
    let mut give_up = || {
        looks = looks.wrapping_add(1);
        if !yielding {
            if looks.is_multiple_of(16) {
                yielding = start.elapsed() >= crate::util::tuning::EXPRESS_PURE_SPIN;
            }
            return false;
        }
        std::thread::yield_now();
        start.elapsed() >= crate::util::tuning::EXPRESS_PATIENCE
    };
    // SAFETY: the engine is held and at rest (see `direct_access`): we are the only poster
    // (posting needs the engine), nothing else touches the blob until we let go, and we
    // wait for the worker's answer (or withdraw) before returning; `offset + len` is
    // within the tensor and `len <= 16` (`small_access` checked both); `base` is its host
    // memory, alive while `t` is.
    let done = unsafe {
        let at = base.add(offset);
        match (read, write) {
            (Some(out), _) => worker.express.read(at, out, &mut give_up),
            (None, Some(src)) => worker.express.write(at, src, &mut give_up),
            (None, None) => return Some(Ok(())),
        }
    };
    if yielding {
        // The worker answered late, or not at all: it was not on a CPU while this caller
        // spun, most likely waiting for this very one (woken onto it: each access then
        // costs two context switches, `docs/perf-2026-12-07.md`). As for any worker found
        // off its CPU, it is marked contended (`engine/preemption.rs`): it parks when
        // idle, and the next accesses take the instruction path, run by this caller while
        // it sleeps.
        crate::engine::preemption::mark_contended(worker, crate::util::tuning::CONTENDED_HOLD);
    }
    (done == crate::model::express::Express::Done).then_some(Ok(()))
}

/// `read_small` / `write_small`.
pub(crate) fn small_access(
    shared: &Arc<VmShared>,
    t: &Tensor,
    offset: usize,
    mut read: Option<&mut [u8]>,
    write: Option<&[u8]>,
) -> Result<()> {
    shared.core.check_caller()?;
    let len = read
        .as_ref()
        .map_or_else(|| write.map_or(0, <[u8]>::len), |b| b.len());
    check_size(len)?;
    shared.check_tensor(t)?;
    check_range(&*t.blob().mem, offset, len)?;
    let stream = shared.default_stream_of(t.device())?;
    soft_sync(shared, t, &stream)?;
    let host = !stream.dev.is_async() && t.blob().mem.host_ptr().is_some();
    let kind = if read.is_some() {
        SmallKind::Read
    } else {
        SmallKind::Write
    };
    let inline = shared.core.config().inline_sync_access;
    // The stream's worker, when this caller is not a thread of the VM and waits for it
    // with one running (multi-thread mode).
    let worker = stream
        .thread
        .as_deref()
        .filter(|_| !shared.core.single_thread() && !crate::engine::core::inside(shared.id));
    // The wait hook's scope, once this call runs kernels before its access exists; kept
    // for the rest of the call, whose own wait then opens none (one pair of hook calls).
    let mut _hook = None;
    if host && inline {
        // The fast path: nothing in flight, so no instruction at all (see `try_direct`).
        let mut result = None;
        let read = &mut read;
        let mut direct = || {
            shared.core.try_direct(|| {
                result = Some(direct_access(t, offset, len, read.as_deref_mut(), write));
                true
            })
        };
        let mut done = direct();
        if !done
            && let Some(w) = worker
            && w.is_parked()
            && w.notifier.pending() == 0
            && !w.queue.is_empty()
        {
            // Something in flight, and this stream's worker sleeps with work queued and no
            // wake on its way (a push left it to a doze's deadline: an op submitted after
            // an idle spell): this caller runs that work now, as its wait would, then may
            // find the engine at rest for the fast path (no access instruction to build,
            // hand over and release). The looks are Relaxed hints: the consumer role
            // decides who runs, so a wrong guess costs a wake or a wait. Only what was
            // built before this point runs (ids only grow; read here, not on every access's
            // way, as every build increments the counter): the access, on the same in-order
            // stream, would run after it anyway; what others submit meanwhile is left to
            // the worker, as a wait leaves what follows its access. A worker already woken
            // is left its work (its wake is paid).
            let built_before = crate::model::instruction::peek_next_id();
            _hook = Some(shared.core.wait_scope());
            done = crate::engine::worker::caller_runs_built_before(&shared.core, w, built_before)
                && direct();
        }
        if done {
            return result.unwrap_or(Ok(()));
        }
    }
    if host
        && !inline
        && let Some(worker) = worker
        && worker.express.is_open()
    {
        // The access runs on the stream's worker, which polls: with nothing in flight it
        // needs no instruction either, only the worker's hands (`model/express.rs`). The
        // ring is warmed all the same, for the access that falls back to an instruction.
        crate::doors::small_ring::warm(shared, &stream, kind);
        let mut result = None;
        let read = &mut read;
        if shared.core.try_direct(|| {
            result = express_access(worker, t, offset, read.as_deref_mut(), write);
            false
        }) && let Some(r) = result
        {
            return r;
        }
    }
    let (instr, own_done) = take_small(shared, &stream, kind, offset, len);
    if worker.is_some() {
        // This caller waits for it below and runs it itself while its worker sleeps
        // (`worker::caller_runs`): the push that queues it may leave the worker's wake
        // to us (`thread_ctx.rs`, "A wake left to the waiting caller"); `wait_small`
        // pays it before it blocks.
        // Relaxed: published by the pending-queue push (Release/Acquire).
        instr.status.fetch_or(status::DEFER_WAKE, Ordering::Relaxed);
    }
    {
        // A ring entry is shared with the ring (count 2), so fill it through its cells,
        // which we own until the push below (ownership step 1).
        // SAFETY: not yet received, so the caller owns the body and `small` (step 1).
        let body = unsafe { instr.body_mut() };
        if kind == SmallKind::Read {
            body.inputs.push(t.blob().clone());
        } else {
            body.outputs.push(t.blob().clone());
            let src = write.unwrap_or(&[]);
            // SAFETY: as above, the caller owns `small` until the push.
            instr
                .small
                .with_mut(|p| unsafe { (&mut *p)[..len].copy_from_slice(src) });
        }
    }
    let waited = instr.clone();
    if let Err(e) = shared.core.receive_one(instr, true) {
        abandon(&waited);
        return Err(e);
    }
    if let Err(e) = wait_small(shared, &waited, true, own_done) {
        abandon(&waited);
        return Err(e);
    }
    small_result(&waited, read)
}

/// The outcome of a small access whose wait returned `Ok`: the executor's failure, or
/// (for a read) the bytes copied out of the instruction's own buffer into `out`.
pub(crate) fn small_result(instr: &Instruction, read: Option<&mut [u8]>) -> Result<()> {
    // SAFETY: the caller's wait returned Ok (Acquire on the executor's Release decrease),
    // so the executor is done with `failure` and `small`; the engine never touches them.
    if let Some(f) = instr.failure.with(|p| unsafe { (*p).clone() }) {
        return Err(f.poison_error());
    }
    if let Some(out) = read {
        let len = out.len();
        // SAFETY: as above.
        instr
            .small
            .with(|p| unsafe { out.copy_from_slice(&(&*p)[..len]) });
    }
    Ok(())
}

/// Waits until `instr` (received, with a waiter) is done. `skip`: apply the notify-skip
/// rule (fewer than the threshold in flight → spin from the start).
pub(crate) fn wait(shared: &VmShared, instr: &Arc<Instruction>, skip: bool) -> Result<()> {
    wait_small(shared, instr, skip, 0)
}

/// [`wait`], where `own_done` of the instructions in flight are this caller's own earlier
/// accesses that finished and merely await their release: they do not count against the
/// notify-skip threshold (a caller returns before the engine releases its access, so
/// back-to-back accesses would otherwise always see two in flight and never skip).
///
/// Multi-thread mode: returns at once when the instruction already ran (inline, or a fast
/// worker). With the skip it spins — yielding its CPU, so that a worker sharing the core
/// runs — for up to `tuning::CALLER_YIELD_SPIN` (long enough for a worker that was just
/// woken to run: its completion then needs no second wake). Without it, it spins the same
/// way only while the VM keeps releasing instructions (`helping::spin_while_progress`: the
/// queue in front drains fast, a sleep would cost a wake per access). Then it falls back
/// to the blocking-then-busy wait. Lazy graphs that offer to run on their caller do
/// their ready work in the spin when `HelpGate` opens, and once more before each sleep.
fn wait_small(
    shared: &VmShared,
    instr: &Arc<Instruction>,
    skip: bool,
    own_done: usize,
) -> Result<()> {
    let waiter = instr
        .waiter
        .as_ref()
        .expect("ivm: waiting on an instruction without waiter");
    if shared.core.single_thread() {
        // Runs the engine here; on an asynchronous device, parks until the device work
        // the caller waits for completes (its completion unparks us).
        return shared
            .core
            .drive_until_helping(
                |_| waiter.btb.is_done(),
                None,
                || graph_help(shared, &|| waiter.btb.is_done()),
                // A lazy graph computing counts as progress (`LazyGraph::set_progress_probe`).
                || shared.graph_progress(),
            )
            .map_err(|e| name_device_work(e, instr));
    }
    if waiter.btb.is_done() {
        // Acquire inside: the executor's writes are visible.
        return Ok(());
    }
    let _hook = shared.core.wait_scope();
    crate::engine::preemption::sense_caller(&shared.core);
    // Instructions queued to a sleeping worker, the one waited for and those it waits
    // for among them, are run here rather than waited for (`worker::caller_runs`): its
    // own stream's worker first, then the others (what it waits for may be queued on
    // another stream). A running worker is waited for, unless it shares its CPU: then it
    // hands its queue to us (`model/hand_over.rs`).
    let waiting = WaitingCaller::enter(&shared.core);
    let gate = crate::doors::lazy::vm_lazy::HelpGate::new();
    let mut done = || {
        let finished = || waiter.btb.is_done();
        if finished() {
            return true;
        }
        let ran = waiting.run(&shared.core, instr.stream.thread.as_deref(), finished);
        // Lazy graphs that run on their caller (`LazyGraph::set_caller_helper`) do their
        // ready work here rather than on their own thread when that thread may not have a
        // CPU or makes no progress (`HelpGate`).
        (ran | (gate.open(shared) && help_graphs(shared, &finished))) && finished()
    };
    if done() {
        return Ok(());
    }
    let helping_since = std::time::Instant::now();
    loop {
        let spun = if skip
            && shared.core.flying().saturating_sub(own_done)
                < shared.core.config().skip_blocking_threshold
        {
            waiter.btb.skip_blocking();
            let worker = instr.stream.thread.as_deref();
            let running = || worker.is_none_or(|w| !w.is_parked());
            crate::engine::helping::spin_yield_until(
                &shared.core,
                &mut done,
                crate::util::tuning::CALLER_YIELD_SPIN,
                running,
            )
        } else {
            crate::engine::helping::spin_while_progress(&shared.core, &mut done, || {
                // A lazy graph computing counts as progress (`LazyGraph::set_progress_probe`).
                shared.graph_progress()
            })
        };
        if spun {
            return Ok(());
        }
        // About to sleep: lazy graphs that offer to run here do their ready work first,
        // whatever the gate said (waiting for a thread that is not running is never
        // faster than doing its work), and we spin again; with nothing run, or after a
        // whole `timeout_period` of it (the sleep below judges the timeout), we sleep.
        let finished = || waiter.btb.is_done();
        if helping_since.elapsed() >= shared.core.config().timeout_period
            || !help_graphs(shared, &finished)
        {
            break;
        }
        if finished() {
            return Ok(());
        }
    }
    // We stop running the workers' queues ourselves: a worker that handed its queue to
    // us is woken.
    drop(waiting);
    if let Some(w) = instr.stream.thread.as_deref()
        && crate::model::thread_ctx::withdraw_defer(&instr.status)
    {
        // We stop running the worker's queue ourselves: the wake a push left to us.
        w.wake();
    }
    let mut last = shared.core.progress();
    let r = waiter
        .btb
        .wait_until_done(shared.core.config().timeout_period, || {
            let now = shared.core.progress();
            let stalled = now == last;
            last = now;
            stalled
        });
    match r {
        Ok(()) => Ok(()),
        Err(WaitError::Stopped) => Err(name_device_work(
            Error::Timeout(shared.core.diagnostic()),
            instr,
        )),
        Err(WaitError::Closed) => Err(Error::ShutDown),
    }
}

/// Runs the caller helpers of the lazy graphs this VM launched, as user code runs on a
/// worker (a call into this VM from them is refused), and has the engine take what they
/// completed (driving here when nobody holds it). Whether they ran anything.
fn help_graphs(shared: &VmShared, wait_over: &dyn Fn() -> bool) -> bool {
    let ran = {
        let _reentry = crate::engine::core::ReentryGuard::enter(shared.id);
        graph_help(shared, wait_over)
    };
    if ran {
        shared
            .core
            .after_push(true, crate::engine::drive::Claim::NONE, false);
    }
    ran
}

/// The caller helpers of the lazy graphs this VM launched (`LazyGraph::set_caller_helper`),
/// run on a caller that already refuses calls into this VM (a worker's guard, or
/// single-thread mode's drive), until `wait_over`; whether they ran anything. Called on
/// every look of a waiting caller: nothing but a load when no graph offered a helper.
pub(crate) fn graph_help(shared: &VmShared, wait_over: &dyn Fn() -> bool) -> bool {
    shared
        .lazy_if_used()
        .filter(|l| l.has_helpers())
        .is_some_and(|l| {
            let crowded = shared.core.callers_contended_until.holds_or_clear();
            let outer = crate::doors::lazy::HELPING_CROWDED.with(|c| c.replace(crowded));
            let ran = l.help(wait_over);
            crate::doors::lazy::HELPING_CROWDED.with(|c| c.set(outer));
            ran
        })
}

/// A wait for `instr` that timed out: if it was launched on an asynchronous device, the
/// caller waits for its completion on the device, behind the stream's earlier work. The
/// engine may hold nothing lively for it (an instruction done at launch is released once
/// its work is queued, e.g. a read held back by a device-side wait on an event that never
/// completes), so the diagnostic names that device work first.
pub(crate) fn name_device_work(e: Error, instr: &Instruction) -> Error {
    // Relaxed: LAUNCHED is diagnostic only.
    let launched = instr.status.load(Ordering::Relaxed) & status::LAUNCHED != 0;
    match e {
        Error::Timeout(mut d) if launched && instr.stream.dev.is_async() => {
            let work = crate::util::error::LivelyInstruction::device_work(
                instr.stream.id,
                Some(instr.label()),
            );
            d.lively.insert(0, work);
            Error::Timeout(d)
        }
        e => e,
    }
}

/// `access`: runs `f` on the tensor's bytes on its device's default
/// stream and waits for it.
pub(crate) fn sync_callback<R: Send + 'static>(
    shared: &Arc<VmShared>,
    t: &Tensor,
    kind: CallbackKind<R>,
) -> Result<R> {
    shared.core.check_caller()?;
    shared.check_tensor(t)?;
    let stream = shared.default_stream_of(t.device())?;
    soft_sync(shared, t, &stream)?;
    let slot: Arc<std::sync::Mutex<Option<R>>> = Arc::new(std::sync::Mutex::new(None));
    let s2 = slot.clone();
    let (name, k, write) = match kind {
        CallbackKind::Read(f) => (
            "access",
            Kind::Read(ReadFn::routed(
                Box::new(move |b: &[u8]| {
                    *s2.lock().unwrap_or_else(|e| e.into_inner()) = Some(f(b))
                }),
                shared.core.drop_sink(),
            )),
            false,
        ),
        CallbackKind::Write(f) => (
            "access_mut",
            Kind::Write(WriteFn::routed(
                Box::new(move |b: &mut [u8]| {
                    *s2.lock().unwrap_or_else(|e| e.into_inner()) = Some(f(b))
                }),
                shared.core.drop_sink(),
            )),
            true,
        ),
    };
    let mut instr = Instruction::new(name, stream, k);
    instr.waiter = Some(Waiter::new());
    {
        // SAFETY: not shared yet; we own the body (ownership step 1).
        let body = unsafe { instr.body_mut() };
        if write {
            body.outputs.push(t.blob().clone());
        } else {
            body.inputs.push(t.blob().clone());
        }
    }
    let instr = Arc::new(instr);
    shared
        .core
        .receive_one_claiming(instr.clone(), true, true)?;
    // Relaxed: set by this very thread, while it drove the engine in `receive_one`.
    if instr.status.load(Ordering::Relaxed) & crate::model::instruction::status::CLAIMED != 0 {
        // The engine handed it to us (its stream was idle, its sources released): run it
        // here instead of on the stream's thread — no hand-over, no wake-up — as that
        // thread would (a reentrant call from `f` is refused alike), then have it
        // released like a worker does.
        {
            let _reentry = crate::engine::core::ReentryGuard::enter(shared.id);
            crate::engine::execute::execute_claimed(&instr);
        }
        shared
            .core
            .after_push(true, crate::engine::drive::Claim::NONE, false);
    }
    wait(shared, &instr, true)?;
    // SAFETY: the wait returned Ok: the executor is done with `failure`.
    if let Some(f) = instr.failure.with(|p| unsafe { (*p).clone() }) {
        return Err(f.to_error());
    }
    let r = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    r.ok_or_else(|| Error::Poisoned {
        instruction: instr.label(),
        message: "callback did not run".into(),
    })
}

/// Soft sync before a sync access of `t` on `stream`: receives the instructions it needs
/// (none for cpu tensors: nothing is allocated then).
fn soft_sync(shared: &VmShared, t: &Tensor, stream: &Arc<StreamShared>) -> Result<()> {
    let mut r = Ok(());
    shared.soft_sync([t], stream, &mut |i| {
        if r.is_ok() {
            r = shared.core.receive_one(i, false);
        }
    });
    r
}

type ReadCb<R> = Box<dyn FnOnce(&[u8]) -> R + Send>;
type WriteCb<R> = Box<dyn FnOnce(&mut [u8]) -> R + Send>;

/// A sync callback, reading or writing.
pub(crate) enum CallbackKind<R> {
    Read(ReadCb<R>),
    Write(WriteCb<R>),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker whose express lane is open but that does not answer (here: no thread
    /// serves it; in life, one woken onto the caller's own CPU) is marked contended by the
    /// caller that posted to it, so that the next accesses take the instruction path.
    #[test]
    fn an_express_access_left_unanswered_marks_the_worker_contended() {
        let vm = crate::VirtualMachine::new(crate::Config::default()).unwrap();
        let t = vm.new_tensor(8).unwrap();
        let lane_owner = crate::model::thread_ctx::ThreadCtx::new("unserved".into());
        lane_owner.express.open();
        assert!(!crate::engine::preemption::is_contended(&lane_owner));
        let mut out = [0u8; 8];
        // Nobody serves the lane: the caller spins, yields, then withdraws. (Without the
        // engine held: no other poster exists for this fresh lane, and a withdrawn access
        // touches no memory.)
        assert!(express_access(&lane_owner, &t, 0, Some(&mut out), None).is_none());
        assert!(crate::engine::preemption::is_contended(&lane_owner));
        vm.shutdown().unwrap();
    }
}
