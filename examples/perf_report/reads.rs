//! Sections 1–3 of the report: warm reads through the worker (against a spin ping-pong
//! and a polling channel), cold reads after the VM sat idle (against a futex wake), and
//! reads run inline by their caller.

use super::*;

// ---- 1. warm reads -------------------------------------------------------------------------

pub(super) fn warm_reads(rep: &mut Report, quick: bool) {
    let per_chunk = if quick { 1_000 } else { 5_000 };
    let cfg = config().with_inline_sync_access(false);
    let (vm, t) = vm_with_value(cfg, 0xABCD);
    // The worker sleeps after the ping-pongs between chunks; a read that finds it asleep
    // runs on its caller and leaves it asleep (ARCHITECTURE.md, "A wake left to the waiting
    // caller"). A kernel first wakes it, so that the reads measure the worker path, with
    // the worker within its poll window.
    // `sync()` would not do: a waiting caller runs the kernel itself while the worker is
    // still waking, and the worker, woken to an empty queue, sleeps again at once. So the
    // kernel raises a flag that this thread spins on, outside the VM.
    let s = vm.default_stream();
    let ran = Arc::new(AtomicBool::new(false));
    let wake_worker = || {
        ran.store(false, Ordering::Relaxed);
        let r = ran.clone();
        vm.run(|b| {
            b.call(&s, &[], &[&t], move |k| {
                k.output_u64(0)[0] = 0xABCD;
                // Release: the kernel's write before the flag (read below with Acquire).
                r.store(true, Ordering::Release);
            })
        })
        .expect("run");
        while !ran.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
    };
    wake_worker();
    for _ in 0..2_000 {
        black_box(read8(&vm, &t));
    }
    let ran_before = vm.stats().map_or(0, |s| s.caller_ran);
    let express_before = vm.debug_express_accesses();
    let (mut spin, mut warm, mut chan) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..4 {
        spin.extend(spin_pingpong(per_chunk));
        for k in 0..per_chunk {
            // Re-woken every 500 reads: a worker that went to sleep meanwhile (its caller
            // descheduled past the poll window) stays asleep while callers run its work,
            // and the rest of the chunk would time the caller, not the worker path.
            if k % 500 == 0 {
                wake_worker();
            }
            let s = Instant::now();
            black_box(read8(&vm, &t));
            warm.push(s.elapsed());
        }
        chan.extend(channel_pingpong(per_chunk));
    }
    let inline_before = vm.debug_inline_accesses();
    let inline_before = inline_before.0 + inline_before.1;
    let express = vm.debug_express_accesses() - express_before;
    // Measured reads that found the worker asleep anyway and ran on their caller.
    let on_caller = vm.stats().map_or(0, |s| s.caller_ran) - ran_before;
    let chan50 = pct(&mut chan, 0.5);
    let spin50 = pct(&mut spin, 0.5);
    let warm50 = pct(&mut warm, 0.5);
    let warm99 = pct(&mut warm, 0.99);
    assert_eq!(
        inline_before, 0,
        "inline accesses with inline_sync_access off"
    );
    vm.shutdown().expect("shutdown");
    println!(
        "warm reads: p50 {:.3} µs, p99 {:.2} µs; spin ping-pong p50 {:.3} µs; crossbeam request/response with a polling worker p50 {:.3} µs ({} samples each; {express} of the reads went through the worker's express lane, {on_caller} found the worker asleep and ran on their caller)",
        us(warm50),
        us(warm99),
        us(spin50),
        us(chan50),
        warm.len()
    );
    let r = warm50.as_secs_f64() / spin50.as_secs_f64();
    rep.ratio("warm_read_vs_spin_floor", r, "≤ 2.5", r <= 2.5);
    rep.figure(
        "warm_read_p99_us",
        us(warm99),
        "µs",
        "≤ 20",
        Some(us(warm99) <= 20.0),
    );
    rep.figure("spin_pingpong_p50_us", us(spin50), "µs", "(baseline)", None);
    let rc = warm50.as_secs_f64() / chan50.as_secs_f64();
    rep.ratio("warm_read_vs_channel_polling", rc, "(report)", rc <= 2.5);
    op_then_read(rep, quick);
}

/// One op (a kernel writing a tensor) then a read of that tensor, timed from before the
/// op's `run` to after the read.
fn op_read(vm: &VirtualMachine, t: &Tensor, v: u64) -> Duration {
    let s = vm.default_stream();
    let start = Instant::now();
    vm.run(|b| b.call(&s, &[], &[t], move |k| k.output_u64(0)[0] = v))
        .expect("run");
    let got = read8(vm, t);
    let d = start.elapsed();
    assert_eq!(got, v);
    d
}

/// One op then a read, back to back: the default configuration against single-thread
/// mode, in interleaved chunks. Beside a busy thread (`contended`) this is the issue's
/// "op + read" of a front end that reads a scalar after each op.
fn op_then_read(rep: &mut Report, quick: bool) {
    let (chunk, chunks) = if quick { (250, 4) } else { (1_000, 5) };
    let (multi_vm, multi_t) = vm_with_value(config(), 1);
    let (single_vm, single_t) = vm_with_value(config().with_mode(ivm_std::Mode::SingleThread), 1);
    let (mut multi, mut single) = (Vec::new(), Vec::new());
    let mut v = 0u64;
    for _ in 0..chunks {
        for _ in 0..chunk {
            v += 1;
            multi.push(op_read(&multi_vm, &multi_t, v));
        }
        for _ in 0..chunk {
            v += 1;
            single.push(op_read(&single_vm, &single_t, v));
        }
    }
    multi_vm.shutdown().expect("shutdown");
    single_vm.shutdown().expect("shutdown");
    let (m50, s50) = (pct(&mut multi, 0.5), pct(&mut single, 0.5));
    println!(
        "op then read, back to back: default config p50 {:.2} µs (p90 {:.2}); single-thread mode p50 {:.2} µs (p90 {:.2}); {} samples each, in interleaved chunks of {chunk}",
        us(m50),
        us(pct(&mut multi, 0.9)),
        us(s50),
        us(pct(&mut single, 0.9)),
        multi.len(),
    );
    rep.figure("op_read_p50_us", us(m50), "µs", "(report)", None);
    let r = m50.as_secs_f64() / s50.as_secs_f64();
    rep.figure("op_read_vs_single_thread", r, "", "(report)", None);
}

/// `n` request/response round trips over two crossbeam channels with a worker that polls
/// (`try_recv` + spin-loop hint), answering 8 bytes: the baseline of
/// `warm_read_vs_channel_polling`.
fn channel_pingpong(n: usize) -> Vec<Duration> {
    let (req_tx, req_rx) = bounded::<usize>(1);
    let (resp_tx, resp_rx) = bounded::<u64>(1);
    let worker = std::thread::spawn(move || {
        let data = [0xABCDu64; 2];
        loop {
            match req_rx.try_recv() {
                Ok(i) => {
                    if resp_tx.send(data[i]).is_err() {
                        return;
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            }
        }
    });
    let mut samples = Vec::with_capacity(n);
    for k in 0..n + 100 {
        let s = Instant::now();
        req_tx.send(black_box(0)).expect("worker");
        black_box(resp_rx.recv().expect("worker"));
        if k >= 100 {
            samples.push(s.elapsed());
        }
    }
    drop(req_tx);
    worker.join().expect("worker");
    samples
}

// ---- 2. cold reads -------------------------------------------------------------------------

pub(super) fn cold_reads(rep: &mut Report, quick: bool) {
    let n = if quick { 40 } else { 200 };
    let idle = Duration::from_millis(10);
    let worker = config().with_inline_sync_access(false);
    let (vm, t) = vm_with_value(worker, 7);
    let ran0 = vm.stats().map_or(0, |s| s.caller_ran);
    let (vm_in, t_in) = vm_with_value(config(), 7);
    let (d0, i0) = vm_in.debug_inline_accesses();
    let base = FutexBaseline::new();
    let (mut cold, mut cold_inline, mut wake) = (Vec::new(), Vec::new(), Vec::new());
    for k in 1..=n as u32 {
        std::thread::sleep(idle);
        let s = Instant::now();
        black_box(read8(&vm, &t));
        cold.push(s.elapsed());
        std::thread::sleep(idle);
        wake.push(base.round(k));
        std::thread::sleep(idle);
        let s = Instant::now();
        black_box(read8(&vm_in, &t_in));
        cold_inline.push(s.elapsed());
    }
    drop(base);
    let on_caller = vm.stats().map_or(0, |s| s.caller_ran) - ran0;
    let (d1, i1) = vm_in.debug_inline_accesses();
    let inline_runs = (d1 - d0) + (i1 - i0);
    let c50 = pct(&mut cold, 0.5);
    let w50 = pct(&mut wake, 0.5);
    let i50 = pct(&mut cold_inline, 0.5);
    println!(
        "cold reads after {idle:?} idle: default config (inline: {inline_runs} of {n} ran in the caller, no wake) p50 {:.1} µs (p90 {:.1}); worker path ({on_caller} of {n} run by their caller, the worker left asleep) p50 {:.1} µs (p90 {:.1}); futex wake p50 {:.1} µs (p90 {:.1}); {n} samples each",
        us(i50),
        us(pct(&mut cold_inline, 0.9)),
        us(c50),
        us(pct(&mut cold, 0.9)),
        us(w50),
        us(pct(&mut wake, 0.9)),
    );
    vm.shutdown().expect("shutdown");
    vm_in.shutdown().expect("shutdown");
    // The headline: the default configuration, where a cold read finds nothing in flight
    // and runs in the caller (zero wakes on the critical path).
    let r = i50.as_secs_f64() / w50.as_secs_f64();
    rep.ratio("cold_read_vs_futex_wake", r, "≤ 1.2", r <= 1.2);
    let rw = c50.as_secs_f64() / w50.as_secs_f64();
    rep.ratio(
        "cold_read_worker_vs_futex_wake",
        rw,
        "(report: inline off, queued to the sleeping worker)",
        rw <= 1.2,
    );
    rep.figure("futex_wake_p50_us", us(w50), "µs", "(baseline)", None);
    idle_op_then_read(rep, quick);
}

/// After 1 ms idle, one op (a kernel writing a tensor) then a read of that tensor: the
/// default (multi-thread) configuration against single-thread mode, interleaved.
fn idle_op_then_read(rep: &mut Report, quick: bool) {
    let n = if quick { 100 } else { 400 };
    let idle = Duration::from_millis(1);
    let single = config().with_mode(ivm_std::Mode::SingleThread);
    let (multi_vm, multi_t) = vm_with_value(config(), 1);
    let (single_vm, single_t) = vm_with_value(single, 1);
    let ran0 = multi_vm.stats().map_or(0, |s| s.caller_ran);
    let (mut multi, mut single) = (Vec::new(), Vec::new());
    for k in 0..n as u64 {
        std::thread::sleep(idle);
        multi.push(op_read(&multi_vm, &multi_t, k));
        std::thread::sleep(idle);
        single.push(op_read(&single_vm, &single_t, k));
    }
    let on_caller = multi_vm.stats().map_or(0, |s| s.caller_ran) - ran0;
    let (m50, s50) = (pct(&mut multi, 0.5), pct(&mut single, 0.5));
    println!(
        "op then read after {idle:?} idle: default config p50 {:.2} µs (p90 {:.2}; {on_caller} of {} instructions run by their caller); single-thread mode p50 {:.2} µs (p90 {:.2}); {n} interleaved samples each",
        us(m50),
        us(pct(&mut multi, 0.9)),
        2 * n,
        us(s50),
        us(pct(&mut single, 0.9)),
    );
    multi_vm.shutdown().expect("shutdown");
    single_vm.shutdown().expect("shutdown");
    let r = m50.as_secs_f64() / s50.as_secs_f64();
    rep.ratio("idle_op_read_vs_single_thread", r, "≤ 2", r <= 2.0);
    rep.figure("idle_op_read_p50_us", us(m50), "µs", "(report)", None);
}

// ---- 3. inline reads -----------------------------------------------------------------------

pub(super) fn inline_reads(rep: &mut Report, quick: bool) {
    let n = if quick { 5_000 } else { 20_000 };
    let (vm, t) = vm_with_value(config(), 3);
    for _ in 0..1_000 {
        black_box(read8(&vm, &t));
    }
    let (d0, i0) = vm.debug_inline_accesses();
    let mut s = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        black_box(read8(&vm, &t));
        s.push(t0.elapsed());
    }
    let (d1, i1) = vm.debug_inline_accesses();
    let inline = (d1 - d0) + (i1 - i0);
    vm.shutdown().expect("shutdown");
    let p50 = pct(&mut s, 0.5).as_nanos() as f64;
    println!("inline reads: p50 {p50:.0} ns; {inline} of {n} ran inline");
    rep.figure(
        "inline_read_ns",
        p50,
        "ns",
        "< 1000 (stretch)",
        Some(p50 < 1000.0),
    );
}
