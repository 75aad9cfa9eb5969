//! Allocation counts in steady state, asserted (the targets `allocs_per_read` = 0 and
//! `allocs_per_instr` = 0 of `perf_report`), by a process-wide counting global allocator:
//!
//! * sync small reads and writes — multi-thread mode with the worker path
//!   (`inline_sync_access` off), with inline accesses (the default), and single-thread
//!   mode: the thread-local ring waits for its oldest entry instead of allocating;
//! * pooled instructions: `call` with a plain `fn` and with a 64-byte closure (stored
//!   inline), `touch_tensors`, `release_tensor` (a tensor's last handle), a sync read and
//!   `sync()` — released instructions go back to the VM's pool, builders take them there.
//!
//! Everything runs in one `#[test]` (the counter is process-wide), the same rounds first
//! unmeasured (warm-up: rings, pools and engine slabs reach their steady size), then
//! measured.

use std::sync::atomic::{AtomicBool, Ordering};

use ivm_std::{Config, KernelCtx, Tensor, VirtualMachine};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::allocs_during;

fn sync_accesses(vm: &VirtualMachine, t: &Tensor, n: u64) {
    let mut buf = [0u8; 8];
    for i in 0..n {
        vm.write_small(t, 0, &i.to_ne_bytes()).unwrap();
        vm.read_small(t, 0, &mut buf).unwrap();
        assert_eq!(u64::from_ne_bytes(buf), i);
    }
}

/// Makes sure every VM thread has started (a thread allocates its own bookkeeping when it
/// first runs, which with callers driving the engine can be late): a kernel on the
/// default stream's worker, and a probe on the scheduler thread.
fn start_threads(vm: &VirtualMachine) {
    let t = vm.new_tensor(8).unwrap();
    let s = vm.default_stream();
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
        .unwrap();
    vm.sync().unwrap();
    vm.blocking_run_probe(|| true).unwrap();
}

fn plain(k: &mut KernelCtx<'_>) {
    let x = k.input_u64(0)[0];
    k.output_u64(0)[0] = x + 1;
}

/// One round: 32 × (call with a plain fn, call with a 64-byte closure, touch), a release,
/// a sync read, `sync()`. Returns the instructions it submitted.
fn pooled_round(vm: &VirtualMachine, t: &[Tensor], spare: &mut Vec<Tensor>) -> usize {
    let s = vm.default_stream();
    let mut n = 0;
    vm.run(|b| {
        for i in 0..32u64 {
            b.call(&s, &[&t[0]], &[&t[1]], plain)?;
            let captured = [i; 8]; // 64 bytes: stored inline in the instruction
            b.call(&s, &[&t[1]], &[&t[2]], move |k| {
                k.output_u64(0)[0] = captured.iter().sum::<u64>();
            })?;
            b.touch_tensors(&s, &[&t[2], &t[3]])?;
            n += 3;
        }
        if let Some(x) = spare.pop() {
            b.release_tensor(x)?;
            n += 1;
        }
        Ok(())
    })
    .unwrap();
    let mut buf = [0u8; 8];
    vm.read_small(&t[2], 0, &mut buf).unwrap();
    vm.sync().unwrap();
    n + 2
}

#[test]
fn steady_state_allocates_nothing() {
    // Sync reads and writes.
    for cfg in [
        Config::default().with_inline_sync_access(false),
        Config::default(),
        Config::single_thread(),
    ] {
        let mode = format!("{:?}, inline {}", cfg.mode, cfg.inline_sync_access);
        let vm = VirtualMachine::new(cfg).unwrap();
        let t = vm.new_tensor(16).unwrap();
        start_threads(&vm);
        sync_accesses(&vm, &t, 500);
        vm.sync().unwrap();
        let n = allocs_during(|| sync_accesses(&vm, &t, 1_000));
        assert_eq!(
            n, 0,
            "allocations in 2000 steady-state sync accesses ({mode})"
        );
        drop(t);
        vm.shutdown().unwrap();
    }

    // With inline accesses off, accesses that went through the worker's express lane (no
    // instruction) warm the instruction ring all the same: one that later falls back to an
    // instruction (here: the worker asleep, its lane closed) allocates nothing either.
    {
        let vm = VirtualMachine::new(Config::default().with_inline_sync_access(false)).unwrap();
        let t = vm.new_tensor(16).unwrap();
        start_threads(&vm);
        let s = vm.default_stream();
        let ran = std::sync::Arc::new(AtomicBool::new(false));
        let mut all_express = false;
        for _ in 0..20 {
            // A kernel that raises a flag wakes the worker (its lane opens while it polls).
            ran.store(false, Ordering::Relaxed);
            let r = ran.clone();
            vm.run(|b| b.call(&s, &[], &[&t], move |_| r.store(true, Ordering::Release)))
                .unwrap();
            while !ran.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            let before = vm.debug_express_accesses();
            sync_accesses(&vm, &t, 1);
            if vm.debug_express_accesses() - before == 2 {
                all_express = true;
                break;
            }
        }
        if all_express {
            // Long past the worker's poll window: it sleeps, and the lane is closed.
            std::thread::sleep(std::time::Duration::from_millis(50));
            let n = allocs_during(|| sync_accesses(&vm, &t, 10));
            assert_eq!(
                n, 0,
                "allocations in accesses that fell back from the express lane to instructions"
            );
        } else {
            eprintln!("no round of accesses went all through the express lane: skipped");
        }
        drop(t);
        vm.shutdown().unwrap();
    }

    // Pooled instruction kinds.
    for cfg in [Config::default(), Config::single_thread()] {
        let mode = format!("{:?}", cfg.mode);
        let vm = VirtualMachine::new(cfg).unwrap();
        let t: Vec<Tensor> = (0..4).map(|_| vm.new_tensor(8).unwrap()).collect();
        let mut spare: Vec<Tensor> = (0..400).map(|_| vm.new_tensor(8).unwrap()).collect();
        start_threads(&vm);
        for _ in 0..200 {
            pooled_round(&vm, &t, &mut spare);
        }
        let mut instrs = 0;
        let n = allocs_during(|| {
            for _ in 0..100 {
                instrs += pooled_round(&vm, &t, &mut spare);
            }
        });
        assert_eq!(
            n, 0,
            "allocations in {instrs} steady-state pooled instructions ({mode})"
        );
        drop((t, spare));
        vm.shutdown().unwrap();
        let c = vm.debug_counters();
        assert_eq!(
            (c.instructions, c.accesses, c.edges, c.flying),
            (0, 0, 0, 0)
        );
    }
}
