//! A sim stream: an in-order queue of host closures, copies, event records, device-side
//! waits and frees, run by a thread of its own after each item's latencies.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use ivm_std::device::check_range;
use ivm_std::panics::catch;
use ivm_std::{
    Device, DeviceMemory, DeviceStream, Error, Event, HostFn, HostMemory, KernelMode, Result,
};

use super::config::{Latency, SimConfig, SplitMix};
use super::{SIM, SimEvent, SimMemory, event, faults, memory};

/// What a queue item does when the stream's thread reaches it.
enum Op {
    Host(HostFn),
    Copy {
        src: Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
        /// An injected fault: copy nothing, record a device error.
        fail: bool,
    },
    Record(Arc<event::EventInner>, EventFault),
    Wait(Arc<event::EventInner>),
    Free(Arc<dyn DeviceMemory>),
}

/// What an injected fault does to an event record.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EventFault {
    None,
    NeverCompletes,
    Error,
}

struct Item {
    /// Earliest start (enqueue + launch latency).
    ready_at: Instant,
    /// How long the item takes before its effect.
    latency: Duration,
    op: Op,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    closed: bool,
    /// An error a host closure or copy hit (taken by `take_error`).
    error: Option<String>,
}

struct StreamState {
    device: Device,
    queue: Mutex<Queue>,
    /// Signalled when an item is pushed or the stream closes.
    cv: Condvar,
    latencies: (Latency, Latency, Latency),
    rng: Mutex<SplitMix>,
    /// Queued (the default) or launcher ([`SimConfig::launcher`]).
    mode: KernelMode,
    faults: Arc<faults::FaultState>,
    fault_rng: Mutex<SplitMix>,
}

impl StreamState {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_error(&self, e: String) {
        let mut q = self.lock();
        if q.error.is_none() {
            q.error = Some(e);
        }
    }
}

/// A stream of a sim device: an in-order queue run by its own thread.
pub struct SimStream {
    state: Arc<StreamState>,
    pinned: Arc<dyn DeviceMemory>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("device", &self.state.device)
            .field("queued", &self.queued())
            .finish()
    }
}

impl SimStream {
    pub(super) fn spawn(
        device: Device,
        cfg: &SimConfig,
        n: u64,
        faults: Arc<faults::FaultState>,
    ) -> Result<Arc<Self>> {
        let mut seed = SplitMix(cfg.seed ^ (u64::from(device.index) << 48) ^ n);
        let state = Arc::new(StreamState {
            device,
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            latencies: (cfg.launch_latency, cfg.kernel_latency, cfg.copy_latency),
            rng: Mutex::new(SplitMix(seed.next())),
            mode: cfg.kernel_mode(),
            fault_rng: Mutex::new(faults.rng(n.wrapping_add(1))),
            faults,
        });
        let s2 = state.clone();
        let h = std::thread::Builder::new()
            .name(format!("sim{}s{n}", device.index))
            .spawn(move || run(&s2))
            .map_err(|e| Error::Spawn(e.to_string()))?;
        let thread_id = h.thread().id();
        Ok(Arc::new(Self {
            state,
            pinned: Arc::new(HostMemory::zeroed(64)),
            thread: Mutex::new(Some(h)),
            thread_id,
        }))
    }

    /// Items queued and not yet started.
    pub fn queued(&self) -> usize {
        self.state.lock().items.len()
    }

    fn push(&self, op: Op) {
        let (launch, kernel, copy) = self.state.latencies;
        let (ready, latency) = {
            let mut rng = self
                .state
                .rng
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let l = launch.draw(&mut rng);
            let k = match op {
                Op::Host(_) => kernel.draw(&mut rng),
                Op::Copy { .. } => copy.draw(&mut rng),
                Op::Record(..) | Op::Wait(_) | Op::Free(_) => Duration::ZERO,
            };
            (l, k)
        };
        let latency = if matches!(op, Op::Copy { .. })
            && self
                .state
                .faults
                .roll(&self.state.fault_rng, faults::Kind::SlowCopy)
        {
            latency.max(Duration::from_micros(10)).saturating_mul(100)
        } else {
            latency
        };
        // A latency too long for the clock (the configuration takes any `Duration`)
        // makes the item wait a year, not the enqueue panic.
        let now = Instant::now();
        let far = Duration::from_secs(365 * 24 * 3600);
        let item = Item {
            ready_at: now.checked_add(ready).unwrap_or_else(|| now + far),
            latency,
            op,
        };
        let mut q = self.state.lock();
        q.items.push_back(item);
        drop(q);
        self.state.cv.notify_one();
    }

    pub(crate) fn enqueue_free(&self, mem: Arc<dyn DeviceMemory>) {
        self.push(Op::Free(mem));
    }

    fn check_side(&self, m: &dyn DeviceMemory) -> Result<()> {
        let d = m.device();
        // Another sim device's memory: a peer copy (`supports_peer_copy`).
        if d == self.state.device || d == Device::CPU || d.kind == SIM {
            if memory::bytes_of(m).is_none() {
                return Err(Error::DeviceMismatch(format!(
                    "memory of {d} is not host-accessible; the sim cannot copy it"
                )));
            }
            return Ok(());
        }
        Err(Error::DeviceMismatch(format!(
            "a stream of {} copies memory of {} or the host, not of {d}",
            self.state.device, self.state.device
        )))
    }
}

thread_local! {
    /// Set on sim stream threads.
    static ON_SIM_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Drop for SimStream {
    fn drop(&mut self) {
        self.state.lock().closed = true;
        self.state.cv.notify_all();
        // The last handle may go on a sim thread (inside a host closure that held it):
        // joining there could wait for an event that thread itself has yet to reach, so
        // the stream's thread then drains and exits by itself.
        let on_sim = ON_SIM_THREAD.with(std::cell::Cell::get);
        // Neither is it joined while an injected fault leaves events uncompleted: a
        // device-side wait on one would hold it forever; it exits once healed.
        let stuck = self.state.faults.stuck_now() > 0;
        if !on_sim
            && !stuck
            && std::thread::current().id() != self.thread_id
            && let Some(h) = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        {
            let _ = h.join();
        }
    }
}

/// The stream's thread: runs items in order, sleeping while the queue is empty, until a
/// launch latency has passed, for the item's own latency, and on device-side waits.
fn run(state: &StreamState) {
    ON_SIM_THREAD.with(|c| c.set(true));
    loop {
        let item = {
            let mut q = state.lock();
            loop {
                if let Some(i) = q.items.pop_front() {
                    break i;
                }
                if q.closed {
                    return;
                }
                q = state.cv.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let now = Instant::now();
        if item.ready_at > now {
            std::thread::sleep(item.ready_at - now);
        }
        if !item.latency.is_zero() {
            std::thread::sleep(item.latency);
        }
        // Adapter code runs in an operation too (a memory's accesses, its drop when freed):
        // a panic there fails the stream, never this thread.
        let op = item.op;
        if let Err(msg) = catch(|| run_op(state, op)) {
            state.set_error(format!("{}: an operation panicked: {msg}", state.device));
        }
    }
}

/// Runs one queued operation on the stream's thread.
fn run_op(state: &StreamState, op: Op) {
    match op {
        Op::Host(f) => {
            if let Err(msg) = catch(f) {
                state.set_error(format!("{}: host closure panicked: {msg}", state.device));
            }
        }
        Op::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
            fail,
        } => {
            if fail {
                state.set_error(format!("{}: sim fault: copy failed", state.device));
            } else if let Err(e) = copy_now(&*src, src_offset, &*dst, dst_offset, len) {
                state.set_error(format!("{}: copy failed: {e}", state.device));
            }
        }
        Op::Record(ev, fault) => match fault {
            EventFault::NeverCompletes if state.faults.leave_stuck(&ev) => {}
            EventFault::Error => {
                state.set_error(format!(
                    "{}: sim fault: event completed with an error",
                    state.device
                ));
                ev.complete();
            }
            _ => ev.complete(),
        },
        Op::Wait(ev) => ev.wait(),
        Op::Free(mem) => {
            if let Some(m) = mem.as_any().downcast_ref::<SimMemory>() {
                m.free_now();
            }
        }
    }
}

fn copy_now(
    src: &dyn DeviceMemory,
    src_offset: usize,
    dst: &dyn DeviceMemory,
    dst_offset: usize,
    len: usize,
) -> Result<()> {
    src.begin_access()?;
    if let Err(e) = dst.begin_access() {
        src.end_access();
        return Err(e);
    }
    if let (Some(s), Some(d)) = (memory::bytes_of(src), memory::bytes_of(dst)) {
        // SAFETY: ranges checked at enqueue; both memories are alive (we hold their Arcs)
        // and not freed (begin_access succeeded); the enqueuer guaranteed nothing else
        // touches the ranges until this copy completes; `copy` allows overlap.
        unsafe { std::ptr::copy(s.as_ptr().add(src_offset), d.as_ptr().add(dst_offset), len) };
    }
    dst.end_access();
    src.end_access();
    Ok(())
}

// SAFETY: one thread runs the queue in order, each item after the previous one finished;
// queued copies hold both memories' `Arc`s until they ran; the pinned buffer is a 64-byte
// `HostMemory` touched only by copies enqueued here.
unsafe impl DeviceStream for SimStream {
    fn device(&self) -> Device {
        self.state.device
    }
    fn kernel_mode(&self) -> KernelMode {
        self.state.mode
    }
    fn launch_host(&self, f: HostFn) -> Result<()> {
        let st = &self.state;
        if st.faults.roll(&st.fault_rng, faults::Kind::LaunchFail) {
            drop(f);
            return Err(Error::Device(format!(
                "{}: sim fault: kernel launch failed",
                st.device
            )));
        }
        self.push(Op::Host(f));
        Ok(())
    }
    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check_side(&**src)?;
        self.check_side(&**dst)?;
        check_range(&**src, src_offset, len)?;
        check_range(&**dst, dst_offset, len)?;
        let st = &self.state;
        let fail = st.faults.roll(&st.fault_rng, faults::Kind::CopyFail);
        self.push(Op::Copy {
            src: src.clone(),
            src_offset,
            dst: dst.clone(),
            dst_offset,
            len,
            fail,
        });
        Ok(())
    }
    fn record_event(&self) -> Result<Arc<dyn Event>> {
        let inner = Arc::new(event::EventInner::default());
        let st = &self.state;
        let fault = if st.faults.roll(&st.fault_rng, faults::Kind::NeverCompletes) {
            EventFault::NeverCompletes
        } else if st.faults.roll(&st.fault_rng, faults::Kind::EventError) {
            EventFault::Error
        } else {
            EventFault::None
        };
        self.push(Op::Record(inner.clone(), fault));
        Ok(Arc::new(SimEvent {
            device: self.state.device,
            inner,
        }))
    }
    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        match event.as_any().downcast_ref::<SimEvent>() {
            Some(e) if e.device == self.state.device => {
                self.push(Op::Wait(e.inner.clone()));
                Ok(())
            }
            _ => Err(Error::ForeignEvent {
                stream: self.state.device,
                event: event.device(),
            }),
        }
    }
    fn synchronize(&self) -> Result<()> {
        self.record_event()?.synchronize()
    }
    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory> {
        &self.pinned
    }
    fn take_error(&self) -> Option<String> {
        self.state.lock().error.take()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
