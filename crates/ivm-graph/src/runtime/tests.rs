//! A graph thread that consumes a wake while a helper holds its actors (the helper's last
//! scan came before what the wake announced) must still scan them: `thread_loop`'s `owed`.
//! The tests hold a graph thread's actor lock as a helping caller preempted in its last
//! scan, or a diagnostic's look, would; each hung for ever before that rule (a vm_program
//! fuzz run once timed out this way).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::lock;
use crate::{GraphBuilder, Phase};
use ivm_std::{Config, Error, VirtualMachine};

/// Waits (at most `limit`) until `cond`; whether it held.
fn eventually(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    while !cond() {
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// The graph `h = x + 1`, built after `configure`.
fn increment(job: &str, configure: impl FnOnce(&mut GraphBuilder)) -> crate::Graph {
    let mut g = GraphBuilder::new(job);
    let x = g.input("x", 8);
    let h = g.blob("h", 8);
    g.kernel("inc", &[x], &[h], |k| {
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
    });
    g.output("h", h);
    configure(&mut g);
    g.build().unwrap()
}

/// An input tensor holding 5 and an output tensor.
fn five_and_out(vm: &VirtualMachine) -> (ivm_std::Tensor, ivm_std::Tensor) {
    let i = vm
        .new_tensor_from(&vm.default_stream(), &5u64.to_ne_bytes())
        .unwrap();
    (i, vm.new_tensor(8).unwrap())
}

#[test]
fn a_wake_consumed_while_a_helper_holds_the_actors_is_not_lost() {
    let graph = increment("lost_wake", |_| {});
    let s = graph.shared.clone();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (i, o) = five_and_out(&vm);
    {
        let held = lock(&s.threads[0]);
        vm.run(|b| b.launch_lazy_job(&[&i], &[&o], &[], graph.lazy()))
            .unwrap();
        // The launch and the critical sections' begins push to the job's buffers, which
        // notify thread 0; it wakes, consumes the wake and finds its actors held.
        let bufs = s.lazy.buffers();
        assert!(eventually(Duration::from_secs(10), || {
            !bufs.source_tick.is_empty() && bufs.wait.len() >= 2 && s.notifiers[0].pending() == 0
        }));
        // Well past the poll window: the thread would be asleep by now.
        std::thread::sleep(Duration::from_millis(100));
        drop(held);
    }
    let finished = eventually(Duration::from_secs(10), || graph.iterations_done() == 1);
    // Unstick a stalled graph, so that a failure ends instead of hanging.
    let _ = s.notifiers[0].notify();
    assert!(
        finished,
        "graph thread 0 slept on a run whose wake it consumed"
    );
    let mut b = [0u8; 8];
    vm.read_small(&o, 0, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), 6);
}

/// The fuzz run's shape, end to end: `fuzz_a`'s kernel thread consumes the wake of the
/// run's input while a helper holds its actors; a sync write of the parameter then looks,
/// finds nothing to help with, and waits; the helper lets go without notifying.
#[test]
fn a_sync_write_behind_a_helped_run_does_not_time_out() {
    let mut a = GraphBuilder::new("fuzz_a_like");
    let x = a.input("a", 8);
    let w = a.param("w", 8);
    let h = a.blob("h", 8);
    let (o0, o1) = (a.blob("o0", 8), a.blob("o1", 8));
    a.param_kernel("fwd", &[x], &[h], move |k| {
        k.output_u64(0)[0] = k.input_u64(0)[0] ^ k.param_u64(w)[0];
    });
    a.kernel("out", &[h], &[o0, o1], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v;
        k.output_u64(1)[0] = v + 2;
    });
    a.param_kernel("upd", &[h], &[], move |k| {
        k.param_u64_mut(w)[0] += k.input_u64(0)[0];
    });
    a.output("o0", o0);
    a.output("o1", o1);
    a.run_on_caller(true);
    let input_in = Arc::new(AtomicBool::new(false));
    let seen = input_in.clone();
    a.trace(move |e| {
        if e.actor.starts_with("input/") && e.phase == Phase::End {
            seen.store(true, Ordering::Release);
        }
    });
    let graph = a.build().unwrap();
    let s = graph.shared.clone();
    let kernels = (0..s.threads.len())
        .find(|&t| s.actors.iter().any(|a| a.thread == t && &*a.name == "fwd"))
        .unwrap();
    let vm =
        VirtualMachine::new(Config::default().with_timeout_period(Duration::from_secs(5))).unwrap();
    let t = |v: u64| {
        vm.new_tensor_from(&vm.default_stream(), &v.to_ne_bytes())
            .unwrap()
    };
    let (i, o0t, o1t, p) = (t(5), t(0), t(0), t(1));
    let result = std::thread::scope(|sc| {
        let held = lock(&s.threads[kernels]);
        vm.run(|b| b.launch_lazy_job(&[&i], &[&o0t, &o1t], &[&p], graph.lazy()))
            .unwrap();
        assert!(eventually(Duration::from_secs(10), || input_in.load(Ordering::Acquire)));
        std::thread::sleep(Duration::from_millis(20));
        let writer = sc.spawn(|| vm.write_small(&p, 0, &7u64.to_ne_bytes()));
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
        writer.join().unwrap()
    });
    let _ = s.notifiers[kernels].notify();
    assert!(
        !matches!(result, Err(Error::Timeout(_))),
        "the sync write timed out: {result:?}"
    );
    result.unwrap();
    let mut b = [0u8; 8];
    vm.read_small(&o1t, 0, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), (5 ^ 1) + 2);
}

/// A diagnostic's look at a thread's actors (`describe`) right after the thread's own
/// productive scan: a one-thread graph with no poll window fires its input, and the look
/// makes the rescan's lock fail; its kernel, readied by its own input without a
/// notification, must still run. (Before `owed` counted productive scans, a run stalled
/// after a few thousand; this checks for 3 s.)
#[test]
fn a_look_at_the_actors_after_a_productive_scan_loses_no_rescan() {
    let graph = increment("looked_at", |g| {
        g.threads(1).poll_window(Duration::ZERO);
    });
    let s = graph.shared.clone();
    let vm =
        VirtualMachine::new(Config::default().with_timeout_period(Duration::from_secs(2))).unwrap();
    let (i, o) = five_and_out(&vm);
    let quit = Arc::new(AtomicBool::new(false));
    let looker = {
        let (s, quit) = (s.clone(), quit.clone());
        std::thread::spawn(move || {
            while !quit.load(Ordering::Relaxed) {
                let _ = s.describe();
                std::thread::yield_now();
            }
        })
    };
    let t0 = Instant::now();
    let mut result = Ok(());
    while t0.elapsed() < Duration::from_secs(3) && result.is_ok() {
        vm.run(|b| b.launch_lazy_job(&[&i], &[&o], &[], graph.lazy()))
            .unwrap();
        let mut b = [0u8; 8];
        result = vm.read_small(&o, 0, &mut b);
    }
    quit.store(true, Ordering::Relaxed);
    looker.join().unwrap();
    let _ = s.notifiers[0].notify();
    result.unwrap();
}

/// A graph thread lets go of its actors between two kernels when a helping caller knocks
/// (`scan_until`, `Stop::Knock`; a caller knocks only while the VM counts as crowded,
/// `lazy::helping_caller_crowded`), and takes them back once the caller lets go: the test
/// knocks as a spinning caller that found them taken does, gets them while the run's
/// chain is under way, lets go with the rest left (notifying, as `Shared::help` does), and
/// the run completes with its result.
#[test]
fn a_graph_thread_lets_a_knocking_caller_in_between_kernels() {
    use std::sync::atomic::AtomicUsize;
    const LINKS: usize = 8;
    let ran = Arc::new(AtomicUsize::new(0));
    let mut g = GraphBuilder::new("knock");
    let x = g.input("x", 8);
    let mut h = x;
    for k in 0..LINKS {
        let next = g.blob(format!("h{k}"), 8);
        let ran = ran.clone();
        g.kernel(format!("inc{k}"), &[h], &[next], move |k| {
            // Started (Release: the test reads it with Acquire), then long enough for the
            // test to knock while it runs.
            ran.fetch_add(1, Ordering::Release);
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(5) {
                std::hint::spin_loop();
            }
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
        });
        h = next;
    }
    g.output("h", h);
    let graph = g.build().unwrap();
    let s = graph.shared.clone();
    let t = (0..s.threads.len())
        .find(|&t| s.actors.iter().any(|a| a.thread == t && &*a.name == "inc0"))
        .unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (i, o) = five_and_out(&vm);
    vm.run(|b| b.launch_lazy_job(&[&i], &[&o], &[], graph.lazy()))
        .unwrap();
    // The chain's first kernel runs on the graph's thread, which holds its actors.
    assert!(eventually(Duration::from_secs(10), || ran
        .load(Ordering::Acquire)
        > 0));
    let start = Instant::now();
    let held = loop {
        if let Some(held) = super::try_lock(&s.threads[t]) {
            break held;
        }
        s.knock();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the graph's thread never let go of its actors"
        );
        std::hint::spin_loop();
    };
    let started = ran.load(Ordering::Acquire);
    assert!(
        started < LINKS,
        "the actors came free only after the chain ({started} of {LINKS} kernels started)"
    );
    drop(held);
    let _ = s.notifiers[t].notify();
    let mut b = [0u8; 8];
    vm.read_small(&o, 0, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), 5 + LINKS as u64);
}
