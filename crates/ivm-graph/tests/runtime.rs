//! The graph runtime through the VM: values, pipelining, failures, parameters, one-thread
//! graphs and bad graphs. Each run is launched with `launch_lazy_job` and observed
//! through the VM's sync reads, as a user sees it (`lazy_basic` covers the door's own
//! checks: interface sizes and counts, invalid interfaces, shutdown).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ivm_graph::*;
use ivm_std::{Config, DebugCounters, Error, Result, Tensor, VirtualMachine};

fn tensor(vm: &VirtualMachine, bytes: &[u8]) -> Tensor {
    vm.new_tensor_from(&vm.default_stream(), bytes).unwrap()
}

fn u64_of(vm: &VirtualMachine, t: &Tensor) -> Result<u64> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

/// One run of `g` over `ins`, `outs` and `params`, queued (not waited for).
fn launch(vm: &VirtualMachine, g: &Graph, ins: &[&Tensor], outs: &[&Tensor], params: &[&Tensor]) {
    vm.run(|b| b.launch_lazy_job(ins, outs, params, g.lazy()))
        .unwrap();
}

fn assert_drained(vm: VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

/// A [`GraphEvent`] kept (events borrow the actor's name from the graph).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ev {
    actor: String,
    iteration: u64,
    phase: Phase,
    failed: bool,
}

impl From<&GraphEvent<'_>> for Ev {
    fn from(e: &GraphEvent<'_>) -> Self {
        Ev {
            actor: e.actor.to_owned(),
            iteration: e.iteration,
            phase: e.phase,
            failed: e.failed,
        }
    }
}

fn log_trace(g: &mut GraphBuilder) -> Arc<Mutex<Vec<Ev>>> {
    let log: Arc<Mutex<Vec<Ev>>> = Arc::default();
    let l2 = log.clone();
    g.trace(move |e| l2.lock().unwrap().push(Ev::from(e)));
    log
}

fn pos(log: &[Ev], actor: &str, iteration: u64, phase: Phase) -> usize {
    log.iter()
        .position(|e| &*e.actor == actor && e.iteration == iteration && e.phase == phase)
        .unwrap_or_else(|| panic!("no {actor} {iteration} {phase:?} in trace"))
}

#[test]
fn copies_in_computes_and_copies_out() {
    let mut g = GraphBuilder::new("add");
    let a = g.input("a", 8);
    let b = g.input("b", 8);
    let s = g.blob("s", 8);
    g.kernel("add", &[a, b], &[s], |k| {
        let v = k.input_u64(0)[0] + k.input_u64(1)[0];
        k.output_u64(0)[0] = v;
    });
    g.output("s", s);
    g.output("a_again", a);
    let graph = g.build().unwrap();
    assert!(graph.num_threads() >= 2);
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (x, y) = (
        tensor(&vm, &5u64.to_ne_bytes()),
        tensor(&vm, &7u64.to_ne_bytes()),
    );
    let (out, out2) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    launch(&vm, &graph, &[&x, &y], &[&out, &out2], &[]);
    assert_eq!(u64_of(&vm, &out).unwrap(), 12);
    assert_eq!(u64_of(&vm, &out2).unwrap(), 5);
    vm.sync().unwrap();
    assert_eq!(graph.iterations_done(), 1);
    drop((x, y, out, out2));
    assert_drained(vm);
}

#[test]
fn runs_pipeline_and_outputs_leave_before_the_callback() {
    let mut g = GraphBuilder::new("pipe");
    let x = g.input("x", 8);
    let early = g.blob("early", 8);
    let late = g.blob("late", 8);
    let log = log_trace(&mut g);
    g.kernel("fast", &[x], &[early], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    let seen = log.clone();
    g.kernel("slow", &[early], &[late], move |k| {
        let v = k.input_u64(0)[0];
        // A long kernel, without assuming how long is long enough (a sleep of 20 ms is a
        // few thousand basic blocks on miri's virtual clock): it lasts until what the
        // assertions below expect to happen during it has happened (run i's early output
        // copied out, run i+1's input started), at most 10 s, so a regression fails them
        // instead of hanging.
        let i = v - 1;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            let log = seen.lock().unwrap();
            let has = |actor: &str, iteration: u64, phase: Phase| {
                log.iter()
                    .any(|e| &*e.actor == actor && e.iteration == iteration && e.phase == phase)
            };
            if has("output/early", i, Phase::End) && (i >= 2 || has("input/x", i + 1, Phase::Start))
            {
                break;
            }
            drop(log);
            std::thread::yield_now();
        }
        k.output_u64(0)[0] = v * 10;
    });
    g.output("early", early);
    g.output("late", late);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let runs: Vec<_> = (0..3u64)
        .map(|i| {
            let x = tensor(&vm, &i.to_ne_bytes());
            let (e, l) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
            launch(&vm, &graph, &[&x], &[&e, &l], &[]);
            (x, e, l)
        })
        .collect();
    for (i, (_, e, l)) in runs.iter().enumerate() {
        assert_eq!(u64_of(&vm, e).unwrap(), i as u64 + 1);
        assert_eq!(u64_of(&vm, l).unwrap(), (i as u64 + 1) * 10);
    }
    vm.sync().unwrap();
    drop(runs);
    assert_drained(vm);
    let log = log.lock().unwrap();
    for i in 0..3 {
        // The early output is copied out before the slow kernel of the same run ends.
        assert!(pos(&log, "output/early", i, Phase::End) < pos(&log, "slow", i, Phase::End));
    }
    for i in 0..2 {
        // Run i+1's input kernel starts before run i's callback.
        assert!(pos(&log, "input/x", i + 1, Phase::Start) < pos(&log, "callback", i, Phase::Start));
    }
}

#[test]
fn kernel_panic_fails_downstream_only_and_the_graph_keeps_serving() {
    let mut g = GraphBuilder::new("boom");
    let x = g.input("x", 8);
    let ok = g.blob("ok", 8);
    let bad = g.blob("bad", 8);
    g.kernel("copy", &[x], &[ok], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v;
    });
    g.kernel("explode", &[x], &[bad], |k| {
        if k.iteration() == 0 {
            panic!("kernel exploded");
        }
        k.output_u64(0)[0] = 99;
    });
    g.output("ok", ok);
    g.output("bad", bad);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x0 = tensor(&vm, &3u64.to_ne_bytes());
    let (ok0, bad0) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    launch(&vm, &graph, &[&x0], &[&ok0, &bad0], &[]);
    // The output downstream of the panic is poisoned with it, naming the graph kernel;
    // the other output of the same run is written.
    match u64_of(&vm, &bad0) {
        Err(Error::Poisoned { message, .. }) => {
            assert!(message.contains("explode"), "{message}");
            assert!(message.contains("kernel exploded"), "{message}");
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert_eq!(u64_of(&vm, &ok0).unwrap(), 3);
    // The graph keeps serving.
    let (ok1, bad1) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    launch(&vm, &graph, &[&x0], &[&ok1, &bad1], &[]);
    assert_eq!(u64_of(&vm, &bad1).unwrap(), 99);
    drop((x0, ok0, bad0, ok1, bad1));
    assert_drained(vm);
}

/// A panic value whose drop panics again, `0` more times after the first.
struct PanicsOnDrop(u32);

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        if self.0 > 0 {
            std::panic::panic_any(PanicsOnDrop(self.0 - 1));
        }
        panic!("the panic value's drop panicked");
    }
}

/// Panics whose values panic again when dropped, in a kernel (twice nested) and in the
/// trace callback: the kernel's output is poisoned, the trace's panic ignored, and the
/// graph's threads live on: the next runs are served. Before, dropping the payload
/// outside a catch killed the graph thread, and every later run timed out.
#[test]
fn panic_values_that_panic_when_dropped_kill_no_graph_thread() {
    let mut g = GraphBuilder::new("nested-panics");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("k", &[x], &[y], |k| {
        if k.iteration() == 0 {
            std::panic::panic_any(PanicsOnDrop(1));
        }
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    g.output("y", y);
    g.trace(|ev| {
        if ev.iteration == 1 {
            std::panic::panic_any(PanicsOnDrop(0));
        }
    });
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default().with_timeout_period(Duration::from_secs(20)))
        .unwrap();
    let x0 = tensor(&vm, &3u64.to_ne_bytes());
    let ys: Vec<Tensor> = (0..3).map(|_| tensor(&vm, &[0; 8])).collect();
    for y in &ys {
        launch(&vm, &graph, &[&x0], &[y], &[]);
    }
    match u64_of(&vm, &ys[0]) {
        Err(Error::Poisoned {
            instruction,
            message,
        }) => {
            assert!(
                instruction.contains("`k`") || message.contains("`k`"),
                "{instruction}: {message}"
            );
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert_eq!(
        u64_of(&vm, &ys[1]).unwrap(),
        4,
        "the run whose trace panicked"
    );
    assert_eq!(u64_of(&vm, &ys[2]).unwrap(), 4);
    drop((x0, ys));
    assert_drained(vm);
}

#[test]
fn parameter_kernels_update_in_run_order() {
    let mut g = GraphBuilder::new("sgd");
    let x = g.input("x", 8);
    let w = g.param("w", 8);
    let y = g.blob("y", 8);
    let fwd = g.param_kernel("forward", &[x], &[y], move |k| {
        let v = k.input_u64(0)[0] * k.param_u64(w)[0];
        k.output_u64(0)[0] = v;
    });
    g.param_kernel("update", &[y], &[], move |k| {
        let v = k.input_u64(0)[0];
        k.param_u64_mut(w)[0] += v % 7 + 1;
    });
    g.on_thread(fwd, 1);
    g.threads(3);
    g.output("y", y);
    let graph = g.build().unwrap();
    assert_eq!(graph.num_threads(), 3);
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let param = tensor(&vm, &1u64.to_ne_bytes());
    let runs: Vec<_> = (1..=6u64)
        .map(|i| {
            let (x, y) = (tensor(&vm, &i.to_ne_bytes()), tensor(&vm, &[0; 8]));
            launch(&vm, &graph, &[&x], &[&y], &[&param]);
            (x, y)
        })
        .collect();
    let mut wv = 1u64;
    for (i, (_, y)) in runs.iter().enumerate() {
        let yv = (i as u64 + 1) * wv;
        assert_eq!(u64_of(&vm, y).unwrap(), yv, "run {i}");
        wv += yv % 7 + 1;
    }
    assert_eq!(u64_of(&vm, &param).unwrap(), wv);
    drop((runs, param));
    assert_drained(vm);
}

#[test]
fn bad_graphs_are_errors() {
    let build = |f: &dyn Fn(&mut GraphBuilder)| {
        let mut g = GraphBuilder::new("bad");
        f(&mut g);
        g.build().map(|_| ())
    };
    let invalid = |r: Result<()>| matches!(r, Err(Error::InvalidGraph { .. }));
    assert!(invalid(build(&|g| {
        let y = g.blob("y", 8);
        let z = g.blob("z", 8);
        g.kernel("k", &[y], &[z], |_| {});
    })));
    assert!(invalid(build(&|g| {
        let x = g.input("x", 8);
        g.kernel("k", &[], &[x], |_| {});
    })));
    assert!(invalid(build(&|g| {
        let y = g.blob("y", 8);
        g.kernel("k1", &[], &[y], |_| {});
        g.kernel("k2", &[], &[y], |_| {});
    })));
    assert!(invalid(build(&|g| {
        let y = g.blob("y", 8);
        g.kernel("k", &[], &[y, y], |_| {});
    })));
    assert!(invalid(build(&|g| {
        let y = g.blob("y", 8);
        g.output("y", y);
    })));
    assert!(invalid(build(&|g| {
        let y = g.blob("y", 8);
        let k = g.kernel("k", &[], &[y], |_| {});
        g.on_thread(k, 0);
    })));
    assert!(invalid(build(&|g| {
        // A blob of another builder, past the end of this one's.
        let mut other = GraphBuilder::new("other");
        let foreign = (0..43).map(|i| other.blob(format!("b{i}"), 8)).last();
        g.kernel("k", &[foreign.unwrap()], &[], |_| {});
    })));
    assert!(matches!(
        build(&|g| {
            g.input("x", 8);
            g.input("x", 8);
        }),
        Err(Error::DuplicateInterfaceName { .. })
    ));
    let mut g = GraphBuilder::new("ok");
    let y = g.blob("y", 8);
    let k = g.kernel("k", &[], &[y], |k| k.output(0).fill(1));
    g.on_thread(k, 1)
        .threads(2)
        .pipeline_depth(3)
        .buffer_runs(4);
    g.output("y", y);
    let graph = g.build().unwrap();
    let names: Vec<String> = graph.actors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "source-tick",
            "wait",
            "k",
            "output/y",
            "callback",
            "callback-notifier"
        ]
    );
    assert_eq!(graph.lazy().buffers().source_tick.capacity(), 4);
}

#[test]
fn parameter_use_outside_param_kernel_fails_the_run() {
    let mut g = GraphBuilder::new("p");
    g.param("w", 8);
    let y = g.blob("y", 8);
    g.kernel("k", &[], &[y], |k| {
        let _ = k.param(0);
    });
    g.output("y", y);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (w, y) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    launch(&vm, &graph, &[], &[&y], &[&w]);
    match u64_of(&vm, &y) {
        Err(Error::Poisoned { message, .. }) => {
            assert!(message.contains("param_kernel"), "{message}")
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
    drop((w, y));
    assert_drained(vm);
}

/// y = w * x; w += y, with every operand borrowed at once (`GraphCtx::io`), on a
/// one-thread graph (protocol actors and kernels share it) that sleeps as soon as it is
/// idle (no poll window): values follow run order, and outputs still leave before the
/// run's callback.
#[test]
fn one_thread_graph_with_io_and_no_poll_window() {
    let mut g = GraphBuilder::new("io");
    let x = g.input("x", 8);
    let w = g.param("w", 8);
    let y = g.blob("y", 8);
    let z = g.blob("z", 8);
    // Through the VM the output's critical section may reach the graph after `mul` ran;
    // `mul` waits for it (at most 10 s), so that what is checked is the order the graph
    // picks when both the output and the update can fire.
    let lazy: Arc<std::sync::OnceLock<ivm_std::LazyGraph>> = Arc::default();
    let lazy2 = lazy.clone();
    g.param_kernel("mul", &[x], &[y], move |k| {
        let out = lazy2.get().unwrap().buffers().outputs[0].as_ref().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while out.is_empty() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        let io = k.io(None);
        let v = u64::from_ne_bytes(io.inputs[0][..8].try_into().unwrap())
            * u64::from_ne_bytes(io.params.get(w)[..8].try_into().unwrap());
        io.outputs[0][..8].copy_from_slice(&v.to_ne_bytes());
    });
    g.param_kernel("upd", &[y], &[z], move |k| {
        let mut io = k.io(Some(w));
        let p = io.param_mut.take().unwrap();
        let v = u64::from_ne_bytes(p[..8].try_into().unwrap())
            + u64::from_ne_bytes(io.inputs[0][..8].try_into().unwrap());
        p[..8].copy_from_slice(&v.to_ne_bytes());
        io.outputs[0][..8].copy_from_slice(&v.to_ne_bytes());
    });
    g.output("y", y);
    g.threads(1).poll_window(Duration::ZERO).pipeline_depth(1);
    let log = log_trace(&mut g);
    let graph = g.build().unwrap();
    lazy.set(graph.lazy().clone()).unwrap();
    assert_eq!(graph.num_threads(), 1);
    assert!(graph.actors().iter().all(|(_, t)| *t == 0));
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let param = tensor(&vm, &2u64.to_ne_bytes());
    let mut wv = 2u64;
    for i in 1..=5u64 {
        let (xb, yb) = (tensor(&vm, &i.to_ne_bytes()), tensor(&vm, &[0; 8]));
        launch(&vm, &graph, &[&xb], &[&yb], &[&param]);
        assert_eq!(u64_of(&vm, &yb).unwrap(), i * wv, "run {i}");
        wv += i * wv;
    }
    assert_eq!(u64_of(&vm, &param).unwrap(), wv);
    vm.sync().unwrap();
    drop(param);
    assert_drained(vm);
    let log = log.lock().unwrap();
    for it in 0..5 {
        // The output fires right after the kernel that produced it, before the update.
        assert!(pos(&log, "output/y", it, Phase::End) < pos(&log, "upd", it, Phase::Start));
        assert!(pos(&log, "output/y", it, Phase::End) < pos(&log, "callback", it, Phase::End));
    }
}

#[test]
fn io_refuses_the_parameter_it_lends_mutably() {
    let mut g = GraphBuilder::new("alias");
    let w = g.param("w", 8);
    g.param_kernel("both", &[], &[], move |k| {
        let io = k.io(Some(w));
        let _ = io.params.get(w);
    });
    g.threads(1);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let param = tensor(&vm, &1u64.to_ne_bytes());
    launch(&vm, &graph, &[], &[], &[&param]);
    // The run's failure poisons the parameter it writes.
    let err = u64_of(&vm, &param).unwrap_err();
    assert!(
        matches!(&err, Error::Poisoned { message, .. } if message.contains("lent mutably")),
        "{err}"
    );
    drop(param);
    assert_drained(vm);
}

/// `run_on_caller`: a caller waiting for a run does the graph's ready work itself. Results
/// are the sequential ones in both modes, and kernels run on the caller's thread (seen
/// within the first few runs: the caller looks before the graph's sleeping thread has
/// woken; in single-thread mode, before it sleeps on the VM).
#[test]
fn a_waiting_caller_runs_an_on_caller_graph() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let caller = std::thread::current().id();
    for config in [Config::default(), Config::single_thread()] {
        let on_caller = Arc::new(AtomicUsize::new(0));
        let seen = on_caller.clone();
        let mut g = GraphBuilder::new("on_caller");
        let x = g.input("x", 8);
        let w = g.param("w", 8);
        let y = g.blob("y", 8);
        g.param_kernel("fwd", &[x], &[y], move |k| {
            if std::thread::current().id() == caller {
                seen.fetch_add(1, Relaxed);
            }
            let v = k.input_u64(0)[0] * 2 + k.param_u64(w)[0];
            k.output_u64(0)[0] = v;
            k.param_u64_mut(w)[0] += 1;
        });
        g.output("y", y);
        g.threads(1).poll_window(Duration::ZERO).run_on_caller(true);
        let graph = g.build().unwrap();
        // The graph offered its helper and its progress probe already: second ones are
        // refused.
        assert!(!graph.lazy().set_caller_helper(|| false));
        assert!(!graph.lazy().set_progress_probe(|| 0));
        let mode = config.mode;
        let vm = VirtualMachine::new(config).unwrap();
        let (xt, wt, yt) = (
            tensor(&vm, &[0; 8]),
            tensor(&vm, &[0; 8]),
            tensor(&vm, &[0; 8]),
        );
        let mut runs = 0u64;
        while runs < 20 || (on_caller.load(Relaxed) == 0 && runs < 2000) {
            vm.write_small(&xt, 0, &runs.to_ne_bytes()).unwrap();
            launch(&vm, &graph, &[&xt], &[&yt], &[&wt]);
            // w was `runs` before this run (one increment per run, from 0).
            assert_eq!(u64_of(&vm, &yt).unwrap(), runs * 3, "run {runs}");
            runs += 1;
        }
        assert!(
            on_caller.load(Relaxed) > 0,
            "{mode:?}: no kernel ran on the waiting caller in {runs} runs"
        );
        drop((xt, wt, yt));
        assert_drained(vm);
    }
}

/// A helping caller stops once the output it waits for is out: the kernels after it (a
/// backward pass, say) are left to the graph's thread, overlapping what the caller does
/// next. Without the stop, a caller that fired `fwd` ran the whole chain after it in the
/// same scan, every run. A few may still run there (a caller whose read a worker took
/// looks at the graph again while the read runs), so the bound is loose.
#[test]
fn a_helping_caller_leaves_the_work_after_its_output_to_the_graph() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    const POST: usize = 16;
    const RUNS: u64 = 40;
    let caller = std::thread::current().id();
    let fwd_here = Arc::new(AtomicUsize::new(0));
    let post_here = Arc::new(AtomicUsize::new(0));
    let post_all = Arc::new(AtomicUsize::new(0));
    let mut g = GraphBuilder::new("stop_at_output");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    let f = fwd_here.clone();
    g.kernel("fwd", &[x], &[y], move |k| {
        if std::thread::current().id() == caller {
            f.fetch_add(1, Relaxed);
        }
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
    });
    g.output("y", y);
    let mut prev = y;
    for i in 0..POST {
        let b = g.blob(format!("post{i}"), 8);
        let (p, all) = (post_here.clone(), post_all.clone());
        g.kernel(format!("post{i}"), &[prev], &[b], move |k| {
            if std::thread::current().id() == caller {
                p.fetch_add(1, Relaxed);
            }
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
            all.fetch_add(1, Relaxed);
        });
        prev = b;
    }
    g.threads(1).poll_window(Duration::ZERO).run_on_caller(true);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (xt, yt) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    for run in 0..RUNS {
        vm.write_small(&xt, 0, &run.to_ne_bytes()).unwrap();
        launch(&vm, &graph, &[&xt], &[&yt], &[]);
        assert_eq!(u64_of(&vm, &yt).unwrap(), run + 1);
        // The graph's thread runs the chain meanwhile: the next wait would find what is
        // left of it ready and rightly run it (the next run depends on it in a real graph).
        // Waited for outside the VM, however long a loaded machine takes.
        let start = std::time::Instant::now();
        while post_all.load(Relaxed) < (run as usize + 1) * POST {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the chain never ran"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    let (fwd, post) = (fwd_here.load(Relaxed), post_here.load(Relaxed));
    assert!(
        post <= 4 * fwd.max(1),
        "the caller ran fwd {fwd} times and {post} of the kernels after the output \
         (at most {} expected)",
        4 * fwd.max(1)
    );
    drop((xt, yt));
    drop(graph);
    assert_drained(vm);
}

/// A graph dropped from one of its own kernels while that kernel runs on a helping caller
/// (`run_on_caller`): the drop does not wait for the graph's thread (which waits for the
/// actors the caller is scanning), the waiting read returns, and the VM goes on. A
/// watchdog aborts the test binary if the drop deadlocks.
#[test]
fn a_graph_dropped_from_its_kernel_on_a_helping_caller() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let finished = Arc::new(AtomicBool::new(false));
    let watch = finished.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(120));
        if !watch.load(SeqCst) {
            eprintln!("a_graph_dropped_from_its_kernel_on_a_helping_caller: deadlocked");
            std::process::abort();
        }
    });
    let caller = std::thread::current().id();
    let slot: Arc<Mutex<Option<Graph>>> = Arc::default();
    let dropped = Arc::new(AtomicBool::new(false));
    let mut g = GraphBuilder::new("dropped_on_caller");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    let (s2, d2) = (slot.clone(), dropped.clone());
    g.kernel("k", &[x], &[y], move |k| {
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
        if std::thread::current().id() == caller {
            // The last handle, dropped here, on the helping caller.
            let g = s2.lock().unwrap().take();
            if g.is_some() {
                drop(g);
                d2.store(true, SeqCst);
            }
        }
    });
    g.output("y", y);
    g.threads(1).poll_window(Duration::ZERO).run_on_caller(true);
    *slot.lock().unwrap() = Some(g.build().unwrap());
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let (xt, yt) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
    let mut runs = 0;
    while !dropped.load(SeqCst) && runs < 2000 {
        {
            let g = slot.lock().unwrap();
            let Some(g) = g.as_ref() else { break };
            vm.write_small(&xt, 0, &5u64.to_ne_bytes()).unwrap();
            launch(&vm, g, &[&xt], &[&yt], &[]);
        }
        // Ok(6), or the run failed because its graph went away during it.
        match u64_of(&vm, &yt) {
            Ok(v) => assert_eq!(v, 6),
            Err(e) => assert!(dropped.load(SeqCst), "run {runs}: {e}"),
        }
        runs += 1;
    }
    assert!(
        dropped.load(SeqCst),
        "no kernel ran on the waiting caller in {runs} runs"
    );
    // The VM goes on.
    vm.write_small(&xt, 0, &9u64.to_ne_bytes()).unwrap();
    assert_eq!(u64_of(&vm, &xt).unwrap(), 9);
    drop((xt, yt));
    assert_drained(vm);
    finished.store(true, SeqCst);
}

/// The first launch seals a graph's offer to run on the caller: an offer after it is
/// refused (it could no longer be registered), in both VM modes.
#[test]
fn an_offer_to_run_on_the_caller_after_the_first_launch_is_refused() {
    for config in [Config::default(), Config::single_thread()] {
        let mut g = GraphBuilder::new("sealed");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        g.kernel("k", &[x], &[y], |k| {
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let vm = VirtualMachine::new(config).unwrap();
        let (xt, yt) = (tensor(&vm, &[0; 8]), tensor(&vm, &[0; 8]));
        launch(&vm, &graph, &[&xt], &[&yt], &[]);
        assert_eq!(u64_of(&vm, &yt).unwrap(), 1);
        assert!(!graph.lazy().set_caller_helper(|| false));
        drop((xt, yt));
        assert_drained(vm);
    }
}

/// A launch that does not finish shows in a timeout's diagnostic as one lively
/// instruction; the graph's state probe adds what the graph was doing: its runs, each
/// thread's actors, each actor's finished iterations and the buffers holding records.
#[test]
fn a_timeout_diagnostic_says_what_the_graph_was_doing() {
    let mut g = GraphBuilder::new("stuck");
    let x = g.input("x", 8);
    let h = g.blob("h", 8);
    let y = g.blob("y", 8);
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    g.kernel("first", &[x], &[h], |k| {
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
    });
    let open = gate.clone();
    g.kernel("blocked", &[h], &[y], move |k| {
        // Until the test has its diagnostic (at most 20 s, so a regression fails instead
        // of hanging).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !open.load(std::sync::atomic::Ordering::Acquire)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        k.output_u64(0)[0] = k.input_u64(0)[0];
    });
    g.output("y", y);
    let graph = g.build().unwrap();
    let vm = VirtualMachine::new(Config::default().with_timeout_period(Duration::from_millis(300)))
        .unwrap();
    let (xt, yt) = (tensor(&vm, &5u64.to_ne_bytes()), vm.new_tensor(8).unwrap());
    launch(&vm, &graph, &[&xt], &[&yt], &[]);
    let r = u64_of(&vm, &yt);
    gate.store(true, std::sync::atomic::Ordering::Release);
    let Err(Error::Timeout(d)) = r else {
        panic!("expected a timeout, got {r:?}")
    };
    assert_eq!(d.graphs.len(), 1, "{d}");
    let state = &d.graphs[0];
    assert!(
        state.starts_with("stuck: 0 run(s) finished, 1 started"),
        "{state}"
    );
    assert!(state.contains("thread 0: actors"), "{state}");
    assert!(state.contains(" first=1 "), "{state}");
    assert!(state.contains(" blocked=0"), "{state}");
    assert!(d.to_string().contains("graph stuck: "), "{d}");
    // The look at the threads' actors lost no wake: the run finishes.
    assert_eq!(u64_of(&vm, &yt).unwrap(), 6);
    drop((xt, yt));
    assert_drained(vm);
}
