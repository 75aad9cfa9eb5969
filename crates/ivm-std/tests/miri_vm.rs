//! A reduced VM run small enough for miri (`.ci/miri.sh` runs this file under
//! `cargo +nightly miri test` with strict provenance); it passes under plain `cargo test`
//! too. In both modes it builds a few hundred instructions over a few tensors on two
//! streams (inline and boxed kernels, copies, a barrier), reads and writes through the
//! sync doors (small accesses, callbacks) and lets a kernel panic. That covers the engine
//! wrapper, the instruction pool, the instructions' ownership steps (builder → engine →
//! worker or inline → release → pool), the sync-access ring and a worker's express lane
//! under miri's checks
//! (ivm-graph's `miri_graph` covers the lazy door). The sizes are the same with
//! and without miri.

use std::sync::{Arc, Mutex};

use ivm_std::{Config, DebugCounters, Device, Error, StreamId, Tensor, VirtualMachine};

fn modes() -> [Config; 2] {
    [Config::default(), Config::single_thread()]
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> Result<u64, Error> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn assert_drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(
        vm.debug_counters(),
        DebugCounters::default(),
        "live engine objects after shutdown"
    );
}

/// Rounds of the eager program; each round builds five instructions (plus the soft-sync
/// instructions the VM adds), and every fifth round also reads and writes through the sync
/// doors: a few hundred instructions in all.
const ROUNDS: u64 = 60;

/// The sequential model of one round (what the VM must compute).
fn model_round(i: u64, m: &mut [u64; 4]) {
    // k0 on s0: a -> b
    m[1] = m[0].wrapping_mul(31).wrapping_add(i);
    // k1 on s1: b, c -> c (a closure too big to be stored inline: boxed)
    m[2] = m[2] ^ m[1].rotate_left((i % 63) as u32) ^ (9 * i);
    // copy on s1: c -> d
    m[3] = m[2];
    // k2 on s0: d -> a
    m[0] = m[3].wrapping_add(7);
    // k3 on s1: reads a, writes nothing
}

#[test]
fn eager_rounds_on_two_streams_with_sync_doors() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s0 = vm.default_stream();
        let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
        let ts: Vec<Tensor> = (0..4).map(|_| vm.new_tensor(8).unwrap()).collect();
        let (a, b, c, d) = (&ts[0], &ts[1], &ts[2], &ts[3]);
        let wide = vm.new_tensor(32).unwrap();
        let seen = Arc::new(Mutex::new(0u64));
        let mut m = [0u64; 4];
        for i in 0..ROUNDS {
            let seen2 = seen.clone();
            // 9 * 8 bytes: above the 64-byte inline limit, so this kernel is boxed.
            let table = [i; 9];
            vm.run(|bl| {
                bl.call_named("k0", &s0, &[a], &[b], move |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x.wrapping_mul(31).wrapping_add(i);
                })?;
                bl.call_named("k1", &s1, &[b], &[c], move |k| {
                    let x = k.input_u64(0)[0];
                    let c = &mut k.output_u64(0)[0];
                    *c ^= x.rotate_left((table[0] % 63) as u32) ^ table.iter().sum::<u64>();
                })?;
                bl.copy(&s1, c, d)?;
                bl.call_named("k2", &s0, &[d], &[a], |k| {
                    let x = k.input_u64(0)[0];
                    k.output_u64(0)[0] = x.wrapping_add(7);
                })?;
                bl.call_named("k3", &s1, &[a], &[], move |k| {
                    *seen2.lock().unwrap() = k.input_u64(0)[0];
                })
            })
            .unwrap();
            model_round(i, &mut m);
            if i % 5 == 4 {
                // A sync read of a tensor in flight, then a sync write that the next round
                // reads (the model follows).
                assert_eq!(read_u64(&vm, b).unwrap(), m[1], "round {i}");
                m[2] = m[2].wrapping_add(i);
                vm.write_small(c, 0, &m[2].to_ne_bytes()).unwrap();
                // Every access size, at an offset, through the same ring.
                for len in [1usize, 2, 4, 8, 16] {
                    let data: Vec<u8> = (0..len as u8).map(|x| x ^ i as u8).collect();
                    vm.write_small(&wide, 16 - len, &data).unwrap();
                    let mut out = vec![0u8; len];
                    vm.read_small(&wide, 16 - len, &mut out).unwrap();
                    assert_eq!(out, data);
                }
            }
        }
        vm.sync().unwrap();
        assert_eq!(*seen.lock().unwrap(), m[0]);
        for (t, want) in ts.iter().zip(m) {
            assert_eq!(read_u64(&vm, t).unwrap(), want);
        }
        // Callbacks: a read and a write of the whole blob on the caller's thread.
        let sum = vm
            .access(&wide, |bytes| {
                bytes.iter().map(|&x| u64::from(x)).sum::<u64>()
            })
            .unwrap();
        assert!(sum > 0);
        vm.access_mut(&wide, |bytes| bytes.fill(3)).unwrap();
        let mut out = [0u8; 16];
        vm.read_small(&wide, 16, &mut out).unwrap();
        assert_eq!(out, [3; 16]);
        drop(ts);
        drop(wide);
        assert_drained(&vm);
    }
}

#[test]
fn kernel_panic_is_observed_and_the_vm_keeps_working() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s = vm.default_stream();
        let (a, b, c) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.run(|bl| {
            bl.call_named("boom", &s, &[], &[&a], |_| panic!("kernel exploded"))?;
            bl.call_named("downstream", &s, &[&a], &[&b], |k| k.output_u64(0)[0] = 1)?;
            bl.call_named("independent", &s, &[], &[&c], |k| k.output_u64(0)[0] = 5)
        })
        .unwrap();
        for t in [&a, &b] {
            match read_u64(&vm, t) {
                Err(Error::Poisoned {
                    instruction,
                    message,
                }) => {
                    assert!(instruction.starts_with("boom#"), "{instruction}");
                    assert!(message.contains("kernel exploded"), "{message}");
                }
                other => panic!("expected Poisoned, got {other:?}"),
            }
        }
        assert_eq!(read_u64(&vm, &c).unwrap(), 5);
        let r = vm.access(&c, |_| -> u8 { panic!("callback exploded") });
        assert!(matches!(r, Err(Error::KernelPanicked { .. })), "{r:?}");
        // New work after the failures (a poisoned tensor stays poisoned: a fresh output).
        let d = vm.new_tensor(8).unwrap();
        vm.run(|bl| {
            bl.call(&s, &[&c], &[&d], |k| {
                k.output_u64(0)[0] = k.input_u64(0)[0] * 3
            })
        })
        .unwrap();
        assert_eq!(read_u64(&vm, &d).unwrap(), 15);
        drop((a, b, c, d));
        assert_drained(&vm);
    }
}

/// Small accesses through a polling worker's express lane (`model/express.rs`: with
/// `inline_sync_access` off and nothing in flight, the worker copies for the caller, no
/// instruction): under miri, its raw-pointer copies and the request cell's hand-overs.
/// A kernel that raises a flag wakes the worker first (the lane is open only while it
/// polls); the accesses are repeated, re-waking it, until one went through the lane. A
/// worker that found its CPU shared polls no more for a while (`engine/preemption.rs`),
/// so on a busy machine later rounds wait that while out first.
#[test]
fn small_accesses_through_the_express_lane() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let vm = VirtualMachine::new(Config::default().with_inline_sync_access(false)).unwrap();
    let s = vm.default_stream();
    let t = vm.new_tensor(16).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    for round in 0..100u64 {
        if round >= 10 && !cfg!(miri) {
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        ran.store(false, Ordering::Relaxed);
        let r = ran.clone();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |k| {
                k.output_u64(0)[0] = round;
                // Release: the kernel's write before the flag (Acquire below).
                r.store(true, Ordering::Release);
            })
        })
        .unwrap();
        while !ran.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        for i in 0..4u64 {
            let v = (round << 8) | i;
            let mut w = [0u8; 16];
            w[..8].copy_from_slice(&v.to_ne_bytes());
            w[8..].copy_from_slice(&(!v).to_ne_bytes());
            vm.write_small(&t, 0, &w).unwrap();
            let mut got = [0u8; 16];
            vm.read_small(&t, 0, &mut got).unwrap();
            assert_eq!(got, w, "a read missed the write before it");
        }
        if vm.debug_express_accesses() > 0 {
            break;
        }
    }
    assert!(
        vm.debug_express_accesses() > 0,
        "no access went through the express lane"
    );
    assert_eq!(
        vm.debug_inline_accesses().0,
        0,
        "an access done by its caller"
    );
    drop(t);
    assert_drained(&vm);
}
