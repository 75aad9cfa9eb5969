//! Release order of lazy-job launches, observed in recorded event order (never in
//! wall-clock time). Where a property says "A happens while B is still running", B's
//! kernel waits on a gate that only A opens: if the VM wrongly held A back until B
//! finished, the gate times out (after seconds) and the test fails.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ivm_graph::{Graph, GraphBuilder, Phase};
use ivm_std::{Config, DebugCounters, Device, StreamId, Tensor, VirtualMachine};

mod common;
use common::tensor;

type Log = Arc<Mutex<Vec<String>>>;

fn push(log: &Log, s: String) {
    log.lock().unwrap().push(s);
}

fn pos(log: &[String], entry: &str) -> usize {
    log.iter()
        .position(|e| e == entry)
        .unwrap_or_else(|| panic!("`{entry}` not in the log: {log:#?}"))
}

/// Traces a graph's actor starts and ends into `log` as `job:actor:iteration:S|E`.
fn traced(g: &mut GraphBuilder, job: &'static str, log: &Log) {
    let l = log.clone();
    g.trace(move |e| {
        let p = if e.phase == Phase::Start { "S" } else { "E" };
        push(&l, format!("{job}:{}:{}:{p}", e.actor, e.iteration));
    });
}

/// Waits (bounded) until `flag` is set; logs a timeout instead of hanging.
fn gate(flag: &AtomicBool, log: &Log, what: &str) {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) {
        if start.elapsed() > Duration::from_secs(10) {
            push(log, format!("TIMEOUT {what}"));
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

#[test]
fn eager_reader_of_first_output_runs_between_its_end_and_the_rest_of_the_graph() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let s0 = vm.default_stream();
    let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
    let log: Log = Arc::default();
    let (read_first, eager_went_on) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );

    let mut g = GraphBuilder::new("g");
    let x = g.input("x", 8);
    let o1 = g.blob("o1", 8);
    let o2 = g.blob("o2", 8);
    g.kernel("first", &[x], &[o1], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    let (l, r, e) = (log.clone(), read_first.clone(), eager_went_on.clone());
    g.kernel("slow", &[o1], &[o2], move |k| {
        // Finishes only after the eager reader of o1 and the eager work after it ran.
        gate(&r, &l, "reader of o1");
        gate(&e, &l, "eager work");
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v * 2;
    });
    g.output("o1", o1);
    g.output("o2", o2);
    traced(&mut g, "g", &log);
    let graph = g.build().unwrap();

    let (xt, o1t, o2t, z, w, r2) = (
        tensor(&vm, 10),
        tensor(&vm, 0),
        tensor(&vm, 0),
        tensor(&vm, 0),
        tensor(&vm, 0),
        tensor(&vm, 0),
    );
    let (l1, l2, l3, l4) = (log.clone(), log.clone(), log.clone(), log.clone());
    let (rf, ew) = (read_first.clone(), eager_went_on.clone());
    vm.run(|b| {
        b.launch_lazy_job(&[&xt], &[&o1t, &o2t], &[], graph.lazy())?;
        // Reads output 1: waits for the input's end and output 1's end only.
        b.call(&s0, &[&o1t], &[&z], move |k| {
            let v = k.input_u64(0)[0];
            push(&l1, format!("eager:read o1={v}"));
            k.output_u64(0)[0] = v;
            rf.store(true, Ordering::Release);
        })?;
        // Eager work on another stream, after the reader: goes on while the graph runs.
        b.call(&s1, &[&z], &[&w], move |k| {
            push(&l2, "eager:went on".into());
            let v = k.input_u64(0)[0];
            k.output_u64(0)[0] = v;
            ew.store(true, Ordering::Release);
        })?;
        // Overwrites the input: must wait for the input's end (the graph saw 10).
        b.call(&s1, &[], &[&xt], move |k| {
            push(&l3, "eager:write x".into());
            k.output_u64(0)[0] = 99;
        })?;
        // Reads output 2: waits for its end.
        b.call(&s0, &[&o2t], &[&r2], move |k| {
            let v = k.input_u64(0)[0];
            push(&l4, format!("eager:read o2={v}"));
            k.output_u64(0)[0] = v;
        })
    })
    .unwrap();
    assert_eq!(read_u64(&vm, &r2), 22);
    assert_eq!(read_u64(&vm, &z), 11);
    vm.sync().unwrap();
    let log = log.lock().unwrap().clone();
    assert!(
        !log.iter().any(|e| e.starts_with("TIMEOUT")),
        "eager work was held back by the graph: {log:#?}"
    );
    let r1 = pos(&log, "eager:read o1=11");
    // After the input's and output 1's critical-section kernels ...
    assert!(pos(&log, "g:input/x:0:S") < r1);
    assert!(pos(&log, "g:output/o1:0:S") < r1);
    // ... before the rest of the graph and the run's callback.
    assert!(r1 < pos(&log, "g:slow:0:E"));
    assert!(r1 < pos(&log, "g:output/o2:0:S"));
    assert!(r1 < pos(&log, "g:callback:0:S"));
    assert!(pos(&log, "eager:went on") < pos(&log, "g:slow:0:E"));
    // The two outputs' end events fire at distinct points: o2's after slow.
    assert!(pos(&log, "g:slow:0:E") < pos(&log, "g:output/o2:0:S"));
    assert!(pos(&log, "g:output/o2:0:S") < pos(&log, "eager:read o2=22"));
    // The input writer came after the graph's input kernel.
    assert!(pos(&log, "g:input/x:0:S") < pos(&log, "eager:write x"));
    drop((xt, o1t, o2t, z, w, r2));
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

#[test]
fn runs_of_one_graph_pipeline() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let log: Log = Arc::default();
    const RUNS: u64 = 4;
    let next_input_started: Arc<Vec<AtomicBool>> =
        Arc::new((0..=RUNS).map(|_| AtomicBool::new(false)).collect());

    let mut g = GraphBuilder::new("p");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    let (l, n) = (log.clone(), next_input_started.clone());
    g.kernel("compute", &[x], &[y], move |k| {
        let i = k.iteration();
        if i + 1 < RUNS {
            // Run i's compute finishes only once run i+1's input kernel has started.
            gate(&n[i as usize + 1], &l, "next run's input kernel");
        }
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + i;
    });
    g.output("y", y);
    let (l, n) = (log.clone(), next_input_started.clone());
    g.trace(move |e| {
        if e.actor == "input/x" && e.phase == Phase::Start {
            n[e.iteration as usize].store(true, Ordering::Release);
        }
        let p = if e.phase == Phase::Start { "S" } else { "E" };
        push(&l, format!("p:{}:{}:{p}", e.actor, e.iteration));
    });
    let graph = g.build().unwrap();

    let x = tensor(&vm, 100);
    let ys: Vec<Tensor> = (0..RUNS).map(|_| tensor(&vm, 0)).collect();
    vm.run(|b| {
        for y in &ys {
            b.launch_lazy_job(&[&x], &[y], &[], graph.lazy())?;
        }
        Ok(())
    })
    .unwrap();
    for (i, y) in ys.iter().enumerate() {
        assert_eq!(read_u64(&vm, y), 100 + i as u64);
    }
    let log = log.lock().unwrap().clone();
    assert!(!log.iter().any(|e| e.starts_with("TIMEOUT")), "{log:#?}");
    for i in 0..RUNS - 1 {
        assert!(
            pos(&log, &format!("p:input/x:{}:S", i + 1)) < pos(&log, &format!("p:callback:{i}:S")),
            "run {} input before run {i}'s callback",
            i + 1
        );
    }
    drop((x, ys));
    vm.shutdown().unwrap();
}

fn tagged_graph(job: &'static str, log: &Log, sleep_ms: u64) -> Graph {
    let mut g = GraphBuilder::new(job);
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("k", &[x], &[y], move |k| {
        std::thread::sleep(Duration::from_millis(sleep_ms));
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    g.output("y", y);
    traced(&mut g, job, log);
    g.build().unwrap()
}

#[test]
fn runs_of_different_graphs_serialise_in_launch_order() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let log: Log = Arc::default();
    let a = tagged_graph("A", &log, 15);
    let b = tagged_graph("B", &log, 1);
    let x = tensor(&vm, 1);
    let outs: Vec<Tensor> = (0..5).map(|_| tensor(&vm, 0)).collect();
    // A A B A B: each run of the other graph starts after every earlier run finished.
    let order = [("A", &a), ("A", &a), ("B", &b), ("A", &a), ("B", &b)];
    vm.run(|bl| {
        for ((_, g), y) in order.iter().zip(&outs) {
            bl.launch_lazy_job(&[&x], &[y], &[], g.lazy())?;
        }
        Ok(())
    })
    .unwrap();
    for y in &outs {
        assert_eq!(read_u64(&vm, y), 2);
    }
    let log = log.lock().unwrap().clone();
    let ticks = |job: &str, it: u64| pos(&log, &format!("{job}:source-tick:{it}:S"));
    let notified = |job: &str, it: u64| pos(&log, &format!("{job}:callback-notifier:{it}:S"));
    // B run 0 after A runs 0 and 1 finished.
    assert!(notified("A", 1) < ticks("B", 0), "{log:#?}");
    // A run 2 after B run 0 finished.
    assert!(notified("B", 0) < ticks("A", 2), "{log:#?}");
    // B run 1 after A run 2 finished.
    assert!(notified("A", 2) < ticks("B", 1), "{log:#?}");
    drop((x, outs));
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

/// Launches of one graph from several threads at once, each over its own tensors: every
/// run copies its own inputs and writes its own outputs. A submission's instructions reach
/// the engine together (`VmShared::receive_list`); pushed one by one, two threads' lists
/// interleaved, so the critical-section begins of two launches landed on the
/// critical-section stream in another order than the launches themselves, and the graph
/// paired run k's job with run k+1's outputs (a wrong value, or "end record was already
/// initialised"). Found by `.ci/sanitizers.sh` (shutdown_under_load, one run in three).
#[test]
fn concurrent_launches_of_one_graph_keep_their_tensors() {
    for config in [Config::default(), Config::single_thread()] {
        // A graph serves one VM.
        let mut g = GraphBuilder::new("plus_1000");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        g.kernel("add", &[x], &[y], |k| {
            let v = k.input_u64(0)[0];
            k.output_u64(0)[0] = v + 1000;
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let vm = VirtualMachine::new(config).unwrap();
        let s = vm.default_stream();
        std::thread::scope(|sc| {
            for t in 0..4u64 {
                let (vm, graph, s) = (&vm, &graph, &s);
                sc.spawn(move || {
                    let c = tensor(vm, t << 32);
                    let ys: Vec<Tensor> = (0..8).map(|_| tensor(vm, 0)).collect();
                    for round in 0..200u64 {
                        // Long submissions: eight launches each, so two threads' lists
                        // are pushed at the same time.
                        vm.run(|bl| {
                            for y in &ys {
                                bl.call(s, &[], &[&c], |k| k.output_u64(0)[0] += 1)?;
                                bl.launch_lazy_job(&[&c], &[y], &[], graph.lazy())?;
                            }
                            Ok(())
                        })
                        .unwrap();
                        for (j, y) in ys.iter().enumerate() {
                            let want = (t << 32) + round * 8 + j as u64 + 1 + 1000;
                            assert_eq!(read_u64(vm, y), want, "thread {t} round {round}");
                        }
                    }
                });
            }
        });
        vm.shutdown().unwrap();
        assert_eq!(vm.debug_counters(), DebugCounters::default());
    }
}
