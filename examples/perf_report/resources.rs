//! Sections 5 and 6 of the report: allocations per steady-state read and instruction (the
//! counting allocator is in `main.rs`), and the CPU the VM's threads use idle and beside a
//! long kernel.

use super::*;

// ---- 5. allocations ------------------------------------------------------------------------

/// Makes sure every thread of `vm` has started (a thread allocates its own bookkeeping
/// when it first runs, which with callers driving the engine can be late).
fn start_threads(vm: &VirtualMachine) {
    let t = vm.new_tensor(8).expect("tensor");
    let s = vm.default_stream();
    vm.run(|b| b.call(&s, &[], &[&t], |k| k.output_u64(0)[0] = 1))
        .expect("run");
    vm.sync().expect("sync");
    vm.blocking_run_probe(|| true).expect("probe");
}

pub(super) fn allocations(rep: &mut Report) {
    // Sync reads/writes: multi-thread (worker path and inline) and single-thread mode.
    let mut reads = 0;
    let mut per_read_total = 0;
    for cfg in [
        config().with_inline_sync_access(false),
        config(),
        Config::single_thread(),
    ] {
        let vm = VirtualMachine::new(cfg).expect("VM starts");
        let t = vm.new_tensor(16).expect("tensor");
        start_threads(&vm);
        let mut buf = [0u8; 8];
        for i in 0..500u64 {
            vm.write_small(&t, 0, &i.to_ne_bytes()).expect("write");
            vm.read_small(&t, 0, &mut buf).expect("read");
        }
        let n = allocs_during(|| {
            for i in 0..2_000u64 {
                vm.write_small(&t, 0, &i.to_ne_bytes()).expect("write");
                vm.read_small(&t, 0, &mut buf).expect("read");
            }
        });
        per_read_total += n;
        reads += 4_000;
        drop(t);
        vm.shutdown().expect("shutdown");
    }
    // Pooled instructions: call (plain fn, 64-byte closure), touch, release, sync access,
    // sync().
    fn plain(k: &mut ivm::ivm_std::KernelCtx<'_>) {
        k.output_u64(0)[0] += 1;
    }
    let vm = VirtualMachine::new(config()).expect("VM starts");
    let s = vm.default_stream();
    let t: Vec<Tensor> = (0..4).map(|_| vm.new_tensor(8).expect("tensor")).collect();
    let mut instrs = 0;
    let round = |vm: &VirtualMachine, spare: &mut Vec<Tensor>, count: bool| {
        let mut n = 0;
        vm.run(|b| {
            for i in 0..32u64 {
                b.call(&s, &[&t[0]], &[&t[1]], plain)?;
                let cap = [i; 8];
                b.call(&s, &[&t[1]], &[&t[2]], move |k| {
                    k.output_u64(0)[0] = cap.iter().sum::<u64>();
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
        .expect("run");
        let mut buf = [0u8; 8];
        vm.read_small(&t[2], 0, &mut buf).expect("read");
        vm.sync().expect("sync");
        if count { n + 2 } else { 0 }
    };
    let mut spare: Vec<Tensor> = (0..600)
        .map(|_| vm.new_tensor(8).expect("tensor"))
        .collect();
    start_threads(&vm);
    for _ in 0..300 {
        round(&vm, &mut spare, false);
    }
    let per_instr_total = allocs_during(|| {
        for _ in 0..200 {
            instrs += round(&vm, &mut spare, true);
        }
    });
    drop(spare);
    drop(t);
    vm.shutdown().expect("shutdown");
    let per_read = per_read_total as f64 / reads as f64;
    let per_instr = per_instr_total as f64 / instrs as f64;
    println!(
        "allocations: {per_read_total} in {reads} sync accesses, {per_instr_total} in {instrs} pooled instructions"
    );
    rep.figure(
        "allocs_per_read",
        per_read,
        "",
        "= 0",
        Some(per_read == 0.0),
    );
    rep.figure(
        "allocs_per_instr",
        per_instr,
        "",
        "= 0",
        Some(per_instr == 0.0),
    );
}

// ---- 6. CPU use ----------------------------------------------------------------------------

fn vm_prefix() -> String {
    // The newest VM's threads are named `ivm<id>-...` (`comm` keeps 15 bytes: the suffix
    // may be cut, the prefix is not).
    let id = thread_cpu()
        .into_values()
        .filter_map(|(n, _)| {
            n.strip_prefix("ivm")?
                .split('-')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
        .expect("a VM thread");
    format!("ivm{id}-")
}

pub(super) fn cpu_use(rep: &mut Report, quick: bool) {
    if std::fs::read_dir("/proc/self/task").is_err() {
        println!("cpu use: /proc/self/task unavailable, skipped");
        return;
    }
    let period = if quick {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    };
    let (vm, t) = vm_with_value(config(), 1);
    let s = vm.default_stream();
    for k in 0..100u64 {
        vm.run(|b| b.call(&s, &[], &[&t], move |c| c.output_u64(0)[0] = k))
            .expect("run");
        black_box(read8(&vm, &t));
    }
    start_threads(&vm);
    let prefix = vm_prefix();
    let tid = my_tid();
    // Idle (starting right after a read: winding down counts).
    black_box(read8(&vm, &t));
    let (a, t0) = (thread_cpu(), Instant::now());
    std::thread::sleep(period);
    let (b, wall) = (thread_cpu(), t0.elapsed());
    let (idle_ns, _, _) = cpu_between(&a, &b, &prefix, tid);
    let idle = idle_ns as f64 / wall.as_nanos() as f64 * 100.0;
    // One kernel sleeps for the period; the caller waits for it with a sync read.
    let (a, t0) = (thread_cpu(), Instant::now());
    vm.run(|bl| {
        bl.call(&s, &[], &[&t], move |c| {
            std::thread::sleep(period);
            c.output_u64(0)[0] = 9;
        })
    })
    .expect("run");
    assert_eq!(read8(&vm, &t), 9);
    let (b, wall) = (thread_cpu(), t0.elapsed());
    let (vm_ns, me_ns, _) = cpu_between(&a, &b, &prefix, tid);
    // The kernel itself sleeps (no CPU); whatever the VM threads used is overhead.
    let busy = (vm_ns + me_ns) as f64 / wall.as_nanos() as f64 * 100.0;
    println!(
        "cpu: idle {idle:.4} % over {:.1} s; busy kernel {busy:.4} % (VM threads {:.1} µs, caller {:.1} µs)",
        period.as_secs_f64(),
        vm_ns as f64 / 1e3,
        me_ns as f64 / 1e3
    );
    vm.shutdown().expect("shutdown");
    rep.figure("idle_cpu_pct", idle, "%", "≤ 0.5", Some(idle <= 0.5));
    rep.figure("busy_kernel_cpu_pct", busy, "%", "≤ 2", Some(busy <= 2.0));
}
