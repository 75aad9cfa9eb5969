//! A third-party adapter may panic, through the public API only, in both VM modes: a
//! stream whose `launch_host` (or `record_event`, or `copy`) panics once fails the
//! instruction it was launching (its outputs poisoned, the panic's message in the error);
//! the stream's worker lives on, later work on the stream runs, `sync` and `shutdown`
//! return, and no read returns bytes that no kernel wrote.
//!
//! And the sim's asynchronous results in single-thread mode: a completion that the sim's
//! thread delivers wakes the caller waiting for it, not the caller's deadline.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::{
    Config, DeviceAdapter, DeviceAllocator, DeviceKind, DeviceMemory, DeviceStream, Error, Event,
    HostFn, KernelMode, Mode, Result, StreamId, StreamPolicy, StreamType, Tensor, VirtualMachine,
};

const MODES: [Mode; 2] = [Mode::MultiThread, Mode::SingleThread];

/// Which call of the stream panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Panics {
    LaunchHost,
    RecordEvent,
    Copy,
}

/// The sim, whose streams panic once in the chosen call when armed, and whose memory
/// panics as `memory` says.
#[derive(Debug)]
struct Panicky {
    inner: Arc<SimAdapter>,
    which: Panics,
    /// Panics left to throw (shared by every stream).
    armed: Arc<AtomicUsize>,
    memory: MemoryPanics,
}

/// Which calls of the adapter's memory panic, while set (neither by default).
#[derive(Debug, Clone, Default)]
struct MemoryPanics {
    end_access: Arc<std::sync::atomic::AtomicBool>,
    drop: Arc<std::sync::atomic::AtomicBool>,
}

#[derive(Debug)]
struct PanickyStream {
    inner: Arc<dyn DeviceStream>,
    which: Panics,
    armed: Arc<AtomicUsize>,
    stream_type: StreamType,
}

impl Panics {
    /// The stream whose call panics: the compute stream's kernel launch, or the copy (and
    /// its event) on the host-to-device stream. Only there: the reads that follow also
    /// copy and record events (on the compute stream), and which of them calls first is a
    /// race between two workers and the caller.
    fn stream_type(self) -> StreamType {
        match self {
            Panics::LaunchHost => StreamType::Compute,
            Panics::RecordEvent | Panics::Copy => StreamType::HostToDevice,
        }
    }
}

impl PanickyStream {
    fn maybe_panic(&self, call: Panics) {
        if call == self.which
            && self.stream_type == call.stream_type()
            && self
                .armed
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        {
            panic!("the adapter's {call:?} panics");
        }
    }
}

// SAFETY: every call is the sim stream's own (the wrapper only panics before delegating).
unsafe impl DeviceStream for PanickyStream {
    fn device(&self) -> ivm_std::Device {
        self.inner.device()
    }
    fn kernel_mode(&self) -> KernelMode {
        self.inner.kernel_mode()
    }
    fn launch_host(&self, f: HostFn) -> Result<()> {
        self.maybe_panic(Panics::LaunchHost);
        self.inner.launch_host(f)
    }
    unsafe fn copy(
        &self,
        src: &Arc<dyn DeviceMemory>,
        src_offset: usize,
        dst: &Arc<dyn DeviceMemory>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.maybe_panic(Panics::Copy);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.copy(src, src_offset, dst, dst_offset, len) }
    }
    fn record_event(&self) -> Result<Arc<dyn Event>> {
        self.maybe_panic(Panics::RecordEvent);
        self.inner.record_event()
    }
    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        self.inner.wait_event(event)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn pinned_buffer(&self) -> &Arc<dyn DeviceMemory> {
        self.inner.pinned_buffer()
    }
    fn take_error(&self) -> Option<String> {
        self.inner.take_error()
    }
    fn as_any(&self) -> &dyn Any {
        self.inner.as_any()
    }
}

impl DeviceAdapter for Panicky {
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }
    fn supports_events(&self) -> bool {
        self.inner.supports_events()
    }
    fn stream_policy(
        &self,
        index: u32,
        stream_type: StreamType,
        mode: KernelMode,
    ) -> Box<dyn StreamPolicy> {
        self.inner.stream_policy(index, stream_type, mode)
    }
    fn create_stream(&self, index: u32, stream_type: StreamType) -> Result<Arc<dyn DeviceStream>> {
        Ok(Arc::new(PanickyStream {
            inner: self.inner.create_stream(index, stream_type)?,
            which: self.which,
            armed: self.armed.clone(),
            stream_type,
        }))
    }
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>> {
        Ok(Arc::new(PanickyMemoryAllocator {
            inner: self.inner.allocator(index)?,
            panics: self.memory.clone(),
        }))
    }
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

fn vm_with(mode: Mode, which: Panics) -> (VirtualMachine, Arc<AtomicUsize>) {
    let armed = Arc::new(AtomicUsize::new(0));
    let adapter = Arc::new(Panicky {
        inner: SimAdapter::new(SimConfig::default()),
        which,
        armed: armed.clone(),
        memory: MemoryPanics::default(),
    });
    let config = Config::default()
        .with_mode(mode)
        .with_timeout_period(Duration::from_secs(10));
    (
        VirtualMachine::with_adapters(config, vec![adapter]).unwrap(),
        armed,
    )
}

fn assert_failed_by_the_adapter<T: std::fmt::Debug>(what: &str, r: Result<T>) {
    match &r {
        Err(Error::Poisoned { message, .. }) | Err(Error::Device(message))
            if message.contains("panics") => {}
        _ => panic!("{what}: expected a failure naming the adapter's panic, got {r:?}"),
    }
}

#[test]
fn a_stream_whose_adapter_panics_once_fails_that_work_and_keeps_serving() {
    for which in [Panics::LaunchHost, Panics::RecordEvent, Panics::Copy] {
        for mode in MODES {
            let what = format!("{mode:?}, {which:?}");
            let (vm, armed) = vm_with(mode, which);
            let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
            let h2d = vm
                .stream(StreamId {
                    device: sim_device(0),
                    stream_type: StreamType::HostToDevice,
                    thread_id: 0,
                })
                .unwrap();
            let (a, b, c) = (
                vm.new_tensor_on(&s, 8).unwrap(),
                vm.new_tensor_on(&s, 8).unwrap(),
                vm.new_tensor_on(&s, 8).unwrap(),
            );
            vm.run(|bl| bl.call(&s, &[], &[&a], |k| k.output_u64(0)[0] = 3))
                .unwrap();
            assert_eq!(read_u64(&vm, &a).unwrap(), 3, "{what}");
            armed.store(1, Ordering::Relaxed);
            // A kernel (launch_host on the sim), or a copy on a stream done by its event
            // (copy, then record_event).
            vm.run(|bl| {
                bl.call(&s, &[], &[&b], |k| k.output_u64(0)[0] = 7)?;
                bl.copy(&h2d, &a, &c)
            })
            .unwrap();
            let rb = read_u64(&vm, &b);
            let rc = read_u64(&vm, &c);
            assert_eq!(
                armed.load(Ordering::Relaxed),
                0,
                "{what}: the panic was thrown"
            );
            match which {
                Panics::LaunchHost => {
                    assert_failed_by_the_adapter(&what, rb);
                    assert_eq!(rc.unwrap(), 3, "{what}");
                }
                Panics::RecordEvent | Panics::Copy => {
                    assert_eq!(rb.unwrap(), 7, "{what}");
                    assert_failed_by_the_adapter(&what, rc);
                }
            }
            let r = vm.sync_timeout(Duration::from_secs(10));
            assert!(!matches!(r, Err(Error::Timeout(_))), "{what}: {r:?}");
            // The stream goes on (a poisoned tensor stays poisoned: a new one).
            let d = vm.new_tensor_on(&s, 8).unwrap();
            vm.run(|bl| bl.call(&s, &[], &[&d], |k| k.output_u64(0)[0] = 11))
                .unwrap();
            assert_eq!(read_u64(&vm, &d).unwrap(), 11, "{what}");
            vm.sync().unwrap();
            vm.shutdown().unwrap();
        }
    }
}

/// The sim's asynchronous results wake a caller waiting in single-thread mode: each wait
/// returns long before its deadline (the result is ready within microseconds; before the
/// fix the caller slept until the deadline).
#[test]
fn async_results_on_the_sim_arrive_before_the_deadline_in_both_modes() {
    let deadline = Duration::from_secs(60);
    for host_visible in [true, false] {
        for mode in MODES {
            let what = format!("{mode:?}, host_visible {host_visible}");
            let sim = SimAdapter::new(SimConfig {
                host_visible,
                ..SimConfig::default()
            });
            let config = Config::default()
                .with_mode(mode)
                .with_timeout_period(deadline);
            let vm = VirtualMachine::with_adapters(config, vec![sim]).unwrap();
            let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
            let t = vm.new_tensor_on(&s, 8).unwrap();
            let start = Instant::now();
            vm.write_small_async(&t, 0, &[7; 8])
                .wait_timeout(deadline)
                .unwrap();
            assert_eq!(
                vm.access_async(&t, |b| b[0])
                    .wait_timeout(deadline)
                    .unwrap(),
                7,
                "{what}"
            );
            assert_eq!(vm.access_async(&t, |b| b[1]).wait().unwrap(), 7, "{what}");
            let mut out = [0u8; 8];
            vm.read_small_async(&t, 0, &mut out)
                .wait_timeout(deadline)
                .unwrap();
            assert_eq!(out, [7; 8], "{what}");
            // Liveness, not speed: four waits whose results are ready within microseconds
            // must not have waited for a deadline or a timeout period of a minute.
            let took = start.elapsed();
            assert!(
                took < deadline / 2,
                "{what}: a completion did not wake its waiter ({took:?})"
            );
            vm.shutdown().unwrap();
        }
    }
}

/// The sim, whose `stream_policy` (or `create_stream`) panics.
#[derive(Debug)]
struct PanickyCreation {
    inner: Arc<SimAdapter>,
    in_policy: bool,
}

impl DeviceAdapter for PanickyCreation {
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }
    fn stream_policy(
        &self,
        index: u32,
        stream_type: StreamType,
        mode: KernelMode,
    ) -> Box<dyn StreamPolicy> {
        assert!(!self.in_policy, "stream_policy panics");
        self.inner.stream_policy(index, stream_type, mode)
    }
    fn create_stream(&self, index: u32, stream_type: StreamType) -> Result<Arc<dyn DeviceStream>> {
        assert!(self.in_policy, "create_stream panics");
        self.inner.create_stream(index, stream_type)
    }
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>> {
        self.inner.allocator(index)
    }
}

#[test]
fn an_adapter_that_panics_creating_a_stream_is_an_error_and_the_vm_goes_on() {
    for in_policy in [true, false] {
        for mode in MODES {
            let adapter = Arc::new(PanickyCreation {
                inner: SimAdapter::new(SimConfig::default()),
                in_policy,
            });
            let config = Config::default().with_mode(mode);
            let vm = VirtualMachine::with_adapters(config, vec![adapter]).unwrap();
            let r = vm.stream(StreamId::compute(sim_device(0), 0));
            match &r {
                Err(Error::Device(m)) if m.contains("panics") => {}
                _ => panic!("{mode:?}, in_policy {in_policy}: {r:?}"),
            }
            let t = vm.new_tensor(8).unwrap();
            vm.run(|b| b.call(&vm.default_stream(), &[], &[&t], |k| k.output_u64(0)[0] = 4))
                .unwrap();
            assert_eq!(read_u64(&vm, &t).unwrap(), 4);
            vm.shutdown().unwrap();
        }
    }
}

/// Memory that panics in the calls `panics` names.
#[derive(Debug)]
struct PanickyMemory {
    inner: Arc<dyn DeviceMemory>,
    panics: MemoryPanics,
}

impl Drop for PanickyMemory {
    fn drop(&mut self) {
        assert!(
            !self.panics.drop.load(Ordering::SeqCst),
            "memory drop panics"
        );
    }
}

// SAFETY: every call is the inner memory's, which keeps the contract.
unsafe impl DeviceMemory for PanickyMemory {
    fn device(&self) -> ivm_std::Device {
        self.inner.device()
    }
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        self.inner.host_ptr()
    }
    fn device_ptr(&self) -> u64 {
        self.inner.device_ptr()
    }
    fn begin_access(&self) -> Result<()> {
        self.inner.begin_access()
    }
    fn end_access(&self) {
        assert!(
            !self.panics.end_access.load(Ordering::SeqCst),
            "end_access panics"
        );
        self.inner.end_access();
    }
    fn as_any(&self) -> &dyn Any {
        self.inner.as_any()
    }
}

#[derive(Debug)]
struct PanickyMemoryAllocator {
    inner: Arc<dyn DeviceAllocator>,
    panics: MemoryPanics,
}

impl DeviceAllocator for PanickyMemoryAllocator {
    fn allocate(&self, n: usize) -> Result<Arc<dyn DeviceMemory>> {
        Ok(Arc::new(PanickyMemory {
            inner: self.inner.allocate(n)?,
            panics: self.panics.clone(),
        }))
    }
    fn free_on(&self, mem: &Arc<dyn DeviceMemory>, stream: &dyn DeviceStream) -> Result<()> {
        self.inner.free_on(mem, stream)
    }
}

/// A VM on the sim whose memory panics as `memory` says (its streams never panic).
fn vm_with_memory(mode: Mode, caching: bool, memory: MemoryPanics) -> VirtualMachine {
    let adapter = Arc::new(Panicky {
        inner: SimAdapter::new(SimConfig::default()),
        which: Panics::LaunchHost,
        armed: Arc::default(),
        memory,
    });
    let config = Config::default()
        .with_mode(mode)
        .with_caching_allocator(caching)
        .with_timeout_period(Duration::from_secs(20));
    VirtualMachine::with_adapters(config, vec![adapter]).unwrap()
}

/// Memory whose `end_access` panics on the sim's own thread (in its copies): the copy
/// fails with the panic's message, the sim's thread lives on, and the device keeps
/// serving. Before, the panic killed the sim's thread: every later read, `sync` and
/// `shutdown` on the device timed out.
#[test]
fn memory_that_panics_on_the_sims_thread_fails_that_copy_and_the_device_goes_on() {
    for mode in MODES {
        let panics = MemoryPanics::default();
        let armed = panics.end_access.clone();
        let vm = vm_with_memory(mode, false, panics);
        let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
        let (bad, good) = (
            vm.new_tensor_on(&s, 8).unwrap(),
            vm.new_tensor_on(&s, 8).unwrap(),
        );
        vm.run(|b| b.call(&s, &[], &[&bad], |k| k.output_u64(0)[0] = 1))
            .unwrap();
        vm.sync().unwrap();
        armed.store(true, Ordering::SeqCst);
        let r = read_u64(&vm, &bad);
        armed.store(false, Ordering::SeqCst);
        match r {
            Err(e) => assert!(e.to_string().contains("end_access panics"), "{mode:?}: {e}"),
            Ok(v) => panic!("{mode:?}: a read whose copy panicked gave {v}"),
        }
        let _ = vm.sync();
        vm.run(|b| b.call(&s, &[], &[&good], |k| k.output_u64(0)[0] = 77))
            .unwrap();
        assert_eq!(read_u64(&vm, &good).unwrap(), 77, "{mode:?}");
        drop((bad, good));
        vm.shutdown().unwrap();
    }
}

/// Memory whose drop panics, wherever its last handle goes: a VM thread (a freed tensor's
/// memory, without the caching allocator), the user's (the caching allocator's blocks at
/// `drop(vm)`). The panic becomes the stream's next device error, which `sync` reports;
/// no thread dies, and `shutdown` and the drops return. Before, the panic unwound through
/// the worker (every later call timed out) or out of `drop(vm)`.
#[test]
fn memory_whose_drop_panics_is_a_device_error_on_any_thread() {
    for mode in MODES {
        for caching in [false, true] {
            let panics = MemoryPanics::default();
            let drop_armed = panics.drop.clone();
            let vm = vm_with_memory(mode, caching, panics);
            let what = format!("{mode:?}, caching {caching}");
            let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
            let good = vm.new_tensor_on(&s, 8).unwrap();
            drop_armed.store(true, Ordering::SeqCst);
            for i in 0..3u64 {
                let t = vm.new_tensor_on(&s, 8).unwrap();
                vm.run(|b| b.call(&s, &[], &[&t], move |k| k.output_u64(0)[0] = i))
                    .unwrap();
                drop(t);
            }
            if !caching {
                // The freed tensors' memory went on the sim's thread or a VM thread; the
                // next observation of the stream (here `sync`; a read would do) says so.
                match vm.sync() {
                    Err(Error::Device(m)) => {
                        assert!(m.contains("memory drop panicked"), "{what}: {m}");
                    }
                    other => panic!("{what}: expected the drop's panic, got {other:?}"),
                }
            }
            vm.run(|b| b.call(&s, &[], &[&good], |k| k.output_u64(0)[0] = 77))
                .unwrap();
            assert_eq!(read_u64(&vm, &good).unwrap(), 77, "{what}");
            drop(good);
            vm.shutdown().unwrap();
            // The caching allocator's blocks go here, on this thread.
            drop(vm);
            drop_armed.store(false, Ordering::SeqCst);
        }
    }
}
