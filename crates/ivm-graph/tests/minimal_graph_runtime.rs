//! A second graph runtime, written only against the public lazy-job protocol
//! (`ivm_std::lazy`): one thread that serves a job's buffers in order — source tick, the
//! input critical section, the wait, the kernel (which reads and updates a parameter in
//! place), the output critical section, the callbacks, the callback notifier. The VM
//! launches it through critical sections exactly as it launches ivm-graph's: eager
//! reads see each run's output, the parameter's updates are ordered with eager work, and
//! closing the graph ends the runtime's thread. Both modes. A second test gives the VM a
//! progress probe (`LazyGraph::set_progress_probe`) and sees a waiting caller use it.

use std::sync::Arc;
use std::thread::JoinHandle;

use ivm_std::lazy::{LazyGraph, mark_graph_thread};
use ivm_std::{Config, Tensor, VirtualMachine};

/// y = x * w, then w += 1 (in place); `work` runs first in each run's kernel.
fn serve(lazy: LazyGraph, work: impl Fn() + Send + 'static) -> JoinHandle<u64> {
    std::thread::spawn(move || {
        mark_graph_thread();
        let b = lazy.buffers();
        let mut runs = 0;
        // The buffers close when the graph is closed: the loop ends there.
        while let Ok(job) = b.source_tick.pop() {
            let input = b.inputs[0].as_ref().expect("valid input").pop().unwrap();
            let mut x = [0u8; 8];
            input.copy_input(0, &mut x).unwrap();
            // Both critical sections of the run reach the wait buffer once begun.
            let waits = (b.wait.pop().unwrap(), b.wait.pop().unwrap());
            // SAFETY: between this run's pop from the source tick and its `finish` below,
            // the parameter belongs to the run, and this is its only slice.
            let w = unsafe { job.param_mut(0) };
            work();
            let wv = u64::from_ne_bytes(w[..8].try_into().unwrap());
            let y = u64::from_ne_bytes(x) * wv;
            w[..8].copy_from_slice(&(wv + 1).to_ne_bytes());
            let output = b.outputs[0].as_ref().expect("valid output").pop().unwrap();
            output.copy_output(0, &y.to_ne_bytes()).unwrap();
            drop(waits);
            for _ in 0..2 {
                b.callback.pop().unwrap().finish();
            }
            let done = b.callback_notifier.pop().unwrap();
            assert!(Arc::ptr_eq(&done, &job), "one run at a time, in order");
            done.finish(Ok(()));
            runs += 1;
        }
        runs
    })
}

fn read(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out).unwrap();
    u64::from_ne_bytes(out)
}

#[test]
fn a_graph_runtime_written_against_the_public_protocol_runs_lazy_launches() {
    for config in [Config::default(), Config::single_thread()] {
        let mode = config.mode;
        let vm = VirtualMachine::new(config).unwrap();
        let lazy = LazyGraph::builder("scale")
            .input("x", 8)
            .output("y", 8)
            .param("w", 8)
            .build()
            .unwrap();
        let runtime = serve(lazy.clone(), || {});
        let (x, y, w) = (
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.write_small(&w, 0, &2u64.to_ne_bytes()).unwrap();
        let s = vm.default_stream();
        for i in 0..20u64 {
            vm.run(|b| {
                b.call(&s, &[], &[&x], move |k| k.output_u64(0)[0] = i + 1)?;
                b.launch_lazy_job(&[&x], &[&y], &[&w], &lazy)
            })
            .unwrap();
            assert_eq!(read(&vm, &y), (i + 1) * (i + 2), "{mode:?}: run {i}");
        }
        // The parameter's last update is ordered before this eager read.
        assert_eq!(read(&vm, &w), 22, "{mode:?}");
        vm.sync().unwrap();
        lazy.close();
        assert_eq!(runtime.join().unwrap(), 20, "{mode:?}");
        vm.shutdown().unwrap();
        let c = vm.debug_counters();
        assert_eq!((c.instructions, c.flying), (0, 0), "{mode:?}");
    }
}

/// A graph that computes for a long time in many small steps, each counted by its
/// progress probe: a caller waiting for its output asks the probe when its spinning starts
/// and again when no instruction has finished for a while (so that it can tell a
/// computing graph from a stalled one, and spin instead of sleeping). The graph computes
/// until the run's wait has asked twice, or for 20 ms at most, and yields between its
/// steps, so that a caller sharing its core is not preempted through the whole of its
/// spinning (it would then sleep, rightly, without a second look: on a loaded machine
/// that failed a third of the runs of the former fixed 1 ms of work); a few more runs are
/// allowed should a wait still not ask twice.
#[test]
fn a_waiting_caller_asks_the_graphs_progress_probe() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::time::{Duration, Instant};
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let lazy = LazyGraph::builder("slow")
        .input("x", 8)
        .output("y", 8)
        .param("w", 8)
        .build()
        .unwrap();
    let (steps, asked) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // The probe's count of asks when the current run was submitted.
    let base = Arc::new(AtomicU64::new(0));
    let (count, calls) = (steps.clone(), asked.clone());
    let (asks, run_base) = (asked.clone(), base.clone());
    assert!(lazy.set_progress_probe(move || {
        calls.fetch_add(1, Relaxed);
        count.load(Relaxed)
    }));
    let runtime = serve(lazy.clone(), move || {
        // Work, 10 µs at a time, until the waiting caller asked twice (or 20 ms passed).
        let start = Instant::now();
        while asks.load(Relaxed) < run_base.load(Relaxed) + 2
            && start.elapsed() < Duration::from_millis(20)
        {
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(10) {
                std::hint::spin_loop();
            }
            steps.fetch_add(1, Relaxed);
            // Should the waiting caller share this core (a loaded machine), it gets its
            // turn: preempted for longer than its spinning lasts, it would sleep instead.
            std::thread::yield_now();
        }
    });
    let (x, y, w) = (
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
        vm.new_tensor(8).unwrap(),
    );
    vm.write_small(&w, 0, &1u64.to_ne_bytes()).unwrap();
    let s = vm.default_stream();
    let mut runs = 0u64;
    let mut most = 0;
    while runs < 20 && most < 2 {
        let before = asked.load(Relaxed);
        base.store(before, Relaxed);
        vm.run(|b| {
            b.call(&s, &[], &[&x], move |k| k.output_u64(0)[0] = 3)?;
            b.launch_lazy_job(&[&x], &[&y], &[&w], &lazy)
        })
        .unwrap();
        assert_eq!(read(&vm, &y), 3 * (runs + 1), "run {runs}");
        most = most.max(asked.load(Relaxed) - before);
        runs += 1;
    }
    assert!(
        most >= 2,
        "no wait asked the probe at a stall in {runs} runs (most asks in one run: {most})"
    );
    // The first launch sealed the offer.
    assert!(!lazy.set_progress_probe(|| 0));
    vm.sync().unwrap();
    lazy.close();
    assert_eq!(runtime.join().unwrap(), runs);
    vm.shutdown().unwrap();
}

/// A runtime's state probe (`LazyGraph::set_state_probe`) speaks in a timeout's
/// diagnostic, on either mode; one that panics is reported there instead of unwinding
/// out of the wait, and the VM goes on (closing the graph fails the launch).
#[test]
fn a_timeout_diagnostic_carries_the_graphs_state_probe() {
    use std::time::Duration;
    for (config, panics) in [
        (Config::default(), false),
        (Config::single_thread(), false),
        (Config::default(), true),
        (Config::single_thread(), true),
    ] {
        let vm =
            VirtualMachine::new(config.with_timeout_period(Duration::from_millis(200))).unwrap();
        // Nobody serves this graph: its first launch never finishes.
        let lazy = LazyGraph::builder("unserved")
            .output("y", 8)
            .build()
            .unwrap();
        assert!(lazy.set_state_probe(move || {
            assert!(!panics, "probe boom");
            "no thread serves me".to_string()
        }));
        let y = vm.new_tensor(8).unwrap();
        vm.run(|b| b.launch_lazy_job(&[], &[&y], &[], &lazy))
            .unwrap();
        let mut out = [0u8; 8];
        let r = vm.read_small(&y, 0, &mut out);
        let Err(ivm_std::Error::Timeout(d)) = r else {
            panic!("expected a timeout, got {r:?}")
        };
        let want = if panics {
            "unserved: (its state probe panicked: probe boom)"
        } else {
            "unserved: no thread serves me"
        };
        assert_eq!(d.graphs, [want.to_string()], "{d}");
        assert!(!lazy.set_state_probe(String::new), "sealed by the launch");
        lazy.close();
        assert!(vm.read_small(&y, 0, &mut out).is_err(), "the run failed");
        drop(y);
        vm.sync().ok();
        vm.shutdown().unwrap();
    }
}

/// A state probe that calls into the VM (which its docs forbid) is refused at once: it
/// would otherwise wait, time out, and build a diagnostic that calls it again.
#[test]
fn a_state_probe_that_calls_into_the_vm_is_refused() {
    use std::time::Duration;
    for config in [Config::default(), Config::single_thread()] {
        let vm = Arc::new(
            VirtualMachine::new(config.with_timeout_period(Duration::from_millis(200))).unwrap(),
        );
        let lazy = LazyGraph::builder("calls_back")
            .output("y", 8)
            .build()
            .unwrap();
        let weak = Arc::downgrade(&vm);
        assert!(lazy.set_state_probe(move || {
            let vm = weak.upgrade().expect("the VM outlives its diagnostics");
            format!("sync from the probe: {:?}", vm.sync())
        }));
        let y = vm.new_tensor(8).unwrap();
        vm.run(|b| b.launch_lazy_job(&[], &[&y], &[], &lazy))
            .unwrap();
        let Err(ivm_std::Error::Timeout(d)) = vm.sync() else {
            panic!("expected a timeout")
        };
        assert_eq!(
            d.graphs,
            ["calls_back: sync from the probe: Err(Reentrant)".to_string()],
            "{d}"
        );
        lazy.close();
        drop(y);
        vm.sync().ok();
        vm.shutdown().unwrap();
    }
}
