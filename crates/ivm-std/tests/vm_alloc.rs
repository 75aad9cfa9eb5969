//! A counting global allocator proves that sync small-memory reads and writes allocate
//! nothing in steady state (the thread-local ring reuses instructions; the engine's pools
//! keep their capacity).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ivm_std::{Config, VirtualMachine};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to `System`, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs_during(f: impl FnOnce()) -> usize {
    ALLOCS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCS.load(Ordering::Relaxed)
}

/// One test (both modes in sequence): the counter is process-wide.
#[test]
fn sync_small_access_allocates_nothing_in_steady_state() {
    for cfg in [Config::single_thread(), Config::default()] {
        let vm = VirtualMachine::new(cfg).unwrap();
        let t = vm.new_tensor(16).unwrap();
        let mut buf = [0u8; 8];
        for i in 0..200u64 {
            vm.sync_write_small_mem(&t, &i.to_ne_bytes()).unwrap();
            vm.sync_read_small_mem(&t, &mut buf).unwrap();
        }
        vm.sync().unwrap();
        let n = allocs_during(|| {
            for i in 0..1000u64 {
                vm.sync_write_small_mem(&t, &i.to_ne_bytes()).unwrap();
                vm.sync_read_small_mem(&t, &mut buf).unwrap();
                assert_eq!(u64::from_ne_bytes(buf), i);
            }
        });
        assert_eq!(
            n,
            0,
            "allocations during 2000 steady-state sync accesses ({:?})",
            vm.config().mode
        );
        drop(t);
        vm.shutdown().unwrap();
    }
}
