//! The sim adapter on its own (no VM).

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

use super::*;
use ivm_std::CpuAdapter;

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
    s.launch_host(Box::new(|| std::thread::sleep(Duration::from_millis(30))))
        .unwrap();
    let e = s.record_event().unwrap();
    assert!(
        !e.query(),
        "done right after record with work queued before it"
    );
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
    // Freeing twice is a no-op.
    alloc.free_on(&mem, &*freer).unwrap();
    freer.synchronize().unwrap();
    assert_eq!(sim.allocator_stats(0).unwrap().frees, 1);
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
