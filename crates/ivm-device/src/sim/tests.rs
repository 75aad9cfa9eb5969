//! The sim adapter on its own (no VM).

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::{Duration, Instant};

use super::*;
use ivm_std::{CpuAdapter, DeviceMemory, HostMemory};

fn adapter(devices: u32) -> Arc<SimAdapter> {
    SimAdapter::new(SimConfig::random(devices, 7))
}

fn bytes(m: &Arc<dyn DeviceMemory>) -> Vec<u8> {
    let p = m.host_ptr().unwrap();
    // SAFETY: the tests read memory only after synchronising the streams that touch it.
    unsafe { std::slice::from_raw_parts(p.as_ptr(), m.nbytes()) }.to_vec()
}

#[test]
fn query_is_false_while_work_is_queued_before_the_record() {
    let sim = adapter(1);
    let s = sim.new_stream(0).unwrap();
    // The host op holds until the query is done: no deadline a loaded machine could miss.
    let (go, gate) = std::sync::mpsc::channel::<()>();
    s.launch_host(Box::new(move || {
        let _ = gate.recv_timeout(Duration::from_secs(10));
    }))
    .unwrap();
    let e = s.record_event().unwrap();
    assert!(
        !e.query(),
        "done right after record with work queued before it"
    );
    go.send(()).unwrap();
    let fired = Arc::new(AtomicBool::new(false));
    let f2 = fired.clone();
    e.on_complete(Box::new(move || f2.store(true, SeqCst)));
    e.synchronize().unwrap();
    assert!(e.query());
    assert!(
        fired.load(SeqCst),
        "on_complete ran when the event completed"
    );
    // Registered after completion: runs at once.
    let f3 = Arc::new(AtomicBool::new(false));
    let f4 = f3.clone();
    e.on_complete(Box::new(move || f4.store(true, SeqCst)));
    assert!(f3.load(SeqCst));
}

#[test]
fn launch_latency_delays_even_an_empty_stream() {
    let sim = SimAdapter::new(SimConfig {
        launch_latency: Latency::fixed(Duration::from_millis(20)),
        ..SimConfig::default()
    });
    let s = sim.new_stream(0).unwrap();
    let t0 = Instant::now();
    let e = s.record_event().unwrap();
    assert!(!e.query());
    e.synchronize().unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(20));
}

#[test]
fn device_side_wait_holds_back_the_waiting_queue() {
    let sim = adapter(1);
    let (a, b) = (sim.new_stream(0).unwrap(), sim.new_stream(0).unwrap());
    let flag = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicBool::new(false));
    let f2 = flag.clone();
    a.launch_host(Box::new(move || {
        std::thread::sleep(Duration::from_millis(50));
        f2.store(true, SeqCst);
    }))
    .unwrap();
    let e = a.record_event().unwrap();
    b.wait_event(&*e).unwrap();
    let (f3, s2) = (flag.clone(), seen.clone());
    b.launch_host(Box::new(move || s2.store(f3.load(SeqCst), SeqCst)))
        .unwrap();
    let eb = b.record_event().unwrap();
    assert!(!eb.query(), "b must be held back by the wait");
    b.synchronize().unwrap();
    assert!(
        seen.load(SeqCst),
        "b ran its closure before a's event completed"
    );
}

#[test]
fn waiting_on_an_event_of_another_device_is_an_error() {
    let sim = adapter(2);
    let (s0, s1) = (sim.new_stream(0).unwrap(), sim.new_stream(1).unwrap());
    let e1 = s1.record_event().unwrap();
    assert!(matches!(
        s0.wait_event(&*e1),
        Err(Error::ForeignEvent { .. })
    ));
    let cpu = CpuAdapter::new()
        .create_stream(0, StreamType::Compute)
        .unwrap();
    let ec = cpu.record_event().unwrap();
    assert!(matches!(
        s0.wait_event(&*ec),
        Err(Error::ForeignEvent { .. })
    ));
    assert!(matches!(
        cpu.wait_event(&*e1),
        Err(Error::ForeignEvent { .. })
    ));
    assert!(sim.new_stream(2).is_err());
}

#[test]
fn copies_check_sizes_and_devices() {
    let sim = adapter(2);
    let s = sim.new_stream(0).unwrap();
    let a0 = sim.allocator(0).unwrap().allocate(8).unwrap();
    let a1 = sim.allocator(1).unwrap().allocate(8).unwrap();
    let h: Arc<dyn DeviceMemory> = Arc::new(HostMemory::from_bytes(&[9; 8]));
    // SAFETY: nothing else touches these memories.
    unsafe {
        assert!(matches!(
            s.copy(&h, 0, &a0, 4, 8),
            Err(Error::OutOfBounds { .. })
        ));
        s.copy(&h, 0, &a0, 0, 8).unwrap();
        // A peer copy: sim:0's stream copies sim:0 memory into sim:1 memory.
        s.copy(&a0, 0, &a1, 0, 8).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(bytes(&a0), vec![9; 8]);
    assert_eq!(bytes(&a1), vec![9; 8]);
    assert!(s.take_error().is_none());
}

#[test]
fn the_allocator_poisons_freed_memory_and_reports_a_free_before_a_read() {
    // Negative control for the VM test: a free queued on another stream, with nothing
    // ordering it after the read, runs first; the poisoning allocator catches it.
    let sim = SimAdapter::new(SimConfig::default());
    let (reader, freer) = (sim.new_stream(0).unwrap(), sim.new_stream(0).unwrap());
    let alloc = sim.allocator(0).unwrap();
    let mem = alloc.allocate(16).unwrap();
    let out: Arc<dyn DeviceMemory> = Arc::new(HostMemory::zeroed(16));
    reader
        .launch_host(Box::new(|| std::thread::sleep(Duration::from_millis(30))))
        .unwrap();
    // SAFETY: `out` is touched by nothing else; `mem` is freed concurrently on purpose,
    // which the sim turns into a refused access (no race).
    unsafe { reader.copy(&mem, 0, &out, 0, 16) }.unwrap();
    alloc.free_on(&mem, &*freer).unwrap();
    freer.synchronize().unwrap();
    assert_eq!(
        bytes(&mem),
        vec![POISON_BYTE; 16],
        "freed memory is poisoned"
    );
    reader.synchronize().unwrap();
    let err = reader.take_error().expect("the late read is refused");
    assert!(err.contains("use after free"), "{err}");
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!(st.use_after_free, 1, "{st:?}");
    assert_eq!((st.allocations, st.frees, st.live_bytes), (1, 1, 0));
    // Freeing twice is a no-op, counted.
    alloc.free_on(&mem, &*freer).unwrap();
    freer.synchronize().unwrap();
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!((st.frees, st.double_frees, st.live_allocations), (1, 1, 0));
}

fn faulty(faults: SimFaults) -> Arc<SimAdapter> {
    SimAdapter::new(SimConfig {
        faults: SimFaults { seed: 3, ..faults },
        ..SimConfig::default()
    })
}

#[test]
fn no_fault_is_injected_by_default() {
    let sim = adapter(1);
    let s = sim.new_stream(0).unwrap();
    let alloc = sim.allocator(0).unwrap();
    for _ in 0..64 {
        s.launch_host(Box::new(|| {})).unwrap();
        let m = alloc.allocate(8).unwrap();
        alloc.free_on(&m, &*s).unwrap();
        s.synchronize().unwrap();
    }
    assert!(s.take_error().is_none());
    assert_eq!(sim.fault_stats(), SimFaultStats::default());
    let st = sim.allocator_stats(0).unwrap();
    assert_eq!(
        (st.allocations, st.live_allocations, st.double_frees),
        (64, 0, 0)
    );
}

#[test]
fn failing_launches_and_allocations_until_healed() {
    let sim = faulty(SimFaults {
        kernel_launch_fail: 1,
        alloc_fail: 1,
        ..SimFaults::NONE
    });
    let s = sim.new_stream(0).unwrap();
    assert!(matches!(
        s.launch_host(Box::new(|| {})),
        Err(Error::Device(_))
    ));
    let alloc = sim.allocator(0).unwrap();
    assert!(matches!(alloc.allocate(8), Err(Error::OutOfMemory { .. })));
    let f = sim.fault_stats();
    assert_eq!((f.kernel_launch_fail, f.alloc_fail, f.total()), (1, 1, 2));
    assert_eq!(sim.heal(), 0);
    s.launch_host(Box::new(|| {})).unwrap();
    let m = alloc.allocate(8).unwrap();
    alloc.free_on(&m, &*s).unwrap();
    s.synchronize().unwrap();
    sim.resume_faults();
    assert!(s.launch_host(Box::new(|| {})).is_err());
    assert_eq!(sim.fault_stats().kernel_launch_fail, 2);
}

#[test]
fn an_event_that_never_completes_holds_back_a_device_side_wait_until_healed() {
    let sim = faulty(SimFaults {
        event_never_completes: 1,
        ..SimFaults::NONE
    });
    let (a, b) = (sim.new_stream(0).unwrap(), sim.new_stream(0).unwrap());
    let e = a.record_event().unwrap();
    // Work after the stuck record still runs.
    let ran = Arc::new(AtomicBool::new(false));
    let r2 = ran.clone();
    a.launch_host(Box::new(move || r2.store(true, SeqCst)))
        .unwrap();
    b.wait_event(&*e).unwrap();
    let seen = Arc::new(AtomicBool::new(false));
    let s2 = seen.clone();
    b.launch_host(Box::new(move || s2.store(true, SeqCst)))
        .unwrap();
    while !ran.load(SeqCst) {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !e.query() && !seen.load(SeqCst),
        "the stuck event held nothing back"
    );
    assert_eq!(sim.stuck_events(), 1);
    assert_eq!(sim.heal(), 1);
    e.synchronize().unwrap();
    b.synchronize().unwrap();
    assert!(seen.load(SeqCst));
    assert_eq!(sim.fault_stats().event_never_completes, 1);
    assert_eq!(sim.stuck_events(), 0);
}

#[test]
fn an_event_error_is_a_stream_error_and_slow_copies_are_counted() {
    let sim = faulty(SimFaults {
        event_error: 1,
        slow_copy: 1,
        ..SimFaults::NONE
    });
    let s = sim.new_stream(0).unwrap();
    let e = s.record_event().unwrap();
    e.synchronize().unwrap();
    let err = s.take_error().expect("the event completed with an error");
    assert!(err.contains("sim fault"), "{err}");
    let h: Arc<dyn DeviceMemory> = Arc::new(HostMemory::from_bytes(&[5; 8]));
    let d: Arc<dyn DeviceMemory> = Arc::new(HostMemory::zeroed(8));
    // SAFETY: nothing else touches these memories.
    unsafe { s.copy(&h, 0, &d, 0, 8) }.unwrap();
    let t0 = Instant::now();
    sim.heal();
    s.synchronize().unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(1));
    assert_eq!(bytes(&d), vec![5; 8]);
    let f = sim.fault_stats();
    assert_eq!((f.event_error, f.slow_copy), (1, 1));
}

#[test]
fn a_failed_copy_copies_nothing_and_is_a_stream_error() {
    let sim = faulty(SimFaults {
        copy_fail: 1,
        ..SimFaults::NONE
    });
    let s = sim.new_stream(0).unwrap();
    let h: Arc<dyn DeviceMemory> = Arc::new(HostMemory::from_bytes(&[5; 8]));
    let d: Arc<dyn DeviceMemory> = Arc::new(HostMemory::zeroed(8));
    // SAFETY: nothing else touches these memories.
    unsafe { s.copy(&h, 0, &d, 0, 8) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(bytes(&d), vec![0; 8]);
    let err = s.take_error().expect("the copy failed");
    assert!(err.contains("copy failed"), "{err}");
    assert_eq!(sim.fault_stats().copy_fail, 1);
    sim.heal();
    // SAFETY: as above.
    unsafe { s.copy(&h, 0, &d, 0, 8) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(bytes(&d), vec![5; 8]);
    assert!(s.take_error().is_none());
}

#[test]
fn a_panicking_host_closure_is_a_stream_error() {
    let sim = adapter(1);
    let s = sim.new_stream(0).unwrap();
    s.launch_host(Box::new(|| panic!("device fault"))).unwrap();
    s.synchronize().unwrap();
    let e = s.take_error().unwrap();
    assert!(e.contains("device fault"), "{e}");
    assert!(s.take_error().is_none());
}
