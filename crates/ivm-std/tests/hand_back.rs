//! The hand-back (ARCHITECTURE.md, "Who may drive the engine"): callers submitting one
//! instruction at a time behind workers busy with kernels of a few microseconds ask the
//! driving worker for the engine and drive their submissions themselves. The protocol is
//! loom-checked (`loom_wake_path.rs`); this checks the VM end to end under that pattern:
//! every kernel runs once, in its stream's order, one at a time, and a chain of values
//! through a tensor comes out right, with two callers submitting at once. Whether a given
//! submission meets a driving worker is a race; with the pacing below one run saw 28
//! submissions find the engine held and 6 hand-overs (counted in a scratch build).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ivm_std::{Config, Device, StreamId, StreamType, VirtualMachine};

/// Kernels of one stream: one at a time, in submission order.
#[derive(Default)]
struct Order {
    busy: AtomicBool,
    next: AtomicU64,
}

impl Order {
    fn run(&self, seq: u64, spin: Duration) {
        assert!(
            !self.busy.swap(true, Ordering::AcqRel),
            "two kernels of one stream ran at once"
        );
        assert_eq!(
            self.next.load(Ordering::Acquire),
            seq,
            "out of stream order"
        );
        // Long enough for the worker to count as running long kernels (1 µs on average).
        self::spin(spin);
        self.next.store(seq + 1, Ordering::Release);
        self.busy.store(false, Ordering::Release);
    }
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

#[test]
fn single_instruction_runs_behind_long_kernels_lose_nothing() {
    const N: u64 = 1000;
    let vm = Arc::new(VirtualMachine::new(Config::default()).unwrap());
    let callers: Vec<_> = (1..=2u32)
        .map(|thread_id| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let s = vm
                    .stream(StreamId {
                        device: Device::CPU,
                        stream_type: StreamType::Compute,
                        thread_id,
                    })
                    .unwrap();
                let t = vm.new_tensor(8).unwrap();
                let order = Arc::new(Order::default());
                for seq in 0..N {
                    let order = order.clone();
                    // Each kernel adds its sequence number to the running sum in `t`.
                    vm.run(|b| {
                        b.call(&s, &[], &[&t], move |k| {
                            order.run(seq, Duration::from_micros(20));
                            k.output_u64(0)[0] += seq;
                        })
                    })
                    .unwrap();
                    // The caller's own work between two submissions (an eager front end
                    // building its next op): it stays a little ahead of the worker, so
                    // its submissions keep meeting the worker's drives after kernels.
                    spin(Duration::from_micros(15));
                }
                let mut out = [0u8; 8];
                vm.read_small(&t, 0, &mut out).unwrap();
                assert_eq!(u64::from_ne_bytes(out), N * (N - 1) / 2);
                assert_eq!(order.next.load(Ordering::Acquire), N);
            })
        })
        .collect();
    for c in callers {
        c.join().unwrap();
    }
    vm.sync().unwrap();
}
