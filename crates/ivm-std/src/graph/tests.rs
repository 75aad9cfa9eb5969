//! Graph runtime unit tests, driven by hand: the test plays the VM's part (critical-section
//! begins, launches) through `LazyGraph::begin` / `push_job`, over raw blobs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::doors::lazy::{CsKind, EndEvent, SharedEventRecord};
use crate::model::blob::Blob;
use crate::util::ids::Device;

fn blob(bytes: &[u8]) -> Arc<Blob> {
    let b = Blob::new(0, 0, Device::CPU, bytes.len());
    // SAFETY: not shared yet.
    unsafe { b.bytes_mut() }.copy_from_slice(bytes);
    Arc::new(b)
}

fn read(b: &Blob) -> Vec<u8> {
    // SAFETY: the test reads after the run's records are done (no graph access left).
    unsafe { b.bytes() }.to_vec()
}

fn u64_of(b: &Blob) -> u64 {
    u64::from_ne_bytes(read(b)[..8].try_into().unwrap())
}

type JobResult = Arc<Mutex<Option<Result<(), Error>>>>;

struct Run {
    inputs: Vec<Arc<SharedEventRecord>>,
    outputs: Vec<Arc<SharedEventRecord>>,
    job: JobResult,
}

impl Run {
    fn wait(&self) -> Result<(), Error> {
        for _ in 0..20_000 {
            if let Some(r) = self.job.lock().unwrap().clone() {
                return r;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        panic!("run did not finish");
    }
}

/// What the VM's begins and launch do for one run.
fn launch(g: &Graph, ins: &[&Arc<Blob>], outs: &[&Arc<Blob>], params: &[&Arc<Blob>]) -> Run {
    let lazy = g.lazy();
    let recs = |n: usize, valid: &dyn Fn(usize) -> bool| -> Vec<Arc<SharedEventRecord>> {
        (0..n)
            .map(|i| {
                let r = Arc::new(SharedEventRecord::new());
                if !valid(i) {
                    r.try_init(EndEvent::Done);
                }
                r
            })
            .collect()
    };
    let inputs = recs(ins.len(), &|i| lazy.inputs()[i].valid);
    let outputs = recs(outs.len(), &|i| lazy.outputs()[i].valid);
    lazy.begin(
        CsKind::Input,
        ins.iter().map(|b| (*b).clone()).collect(),
        inputs.clone(),
        true,
    );
    lazy.begin(
        CsKind::Output,
        outs.iter().map(|b| (*b).clone()).collect(),
        outputs.clone(),
        true,
    );
    let job: JobResult = Arc::default();
    let j2 = job.clone();
    lazy.push_job(
        Arc::new(JobInstance::new(
            lazy.job_name().into(),
            params.iter().map(|b| (*b).clone()).collect(),
            Box::new(move |r| *j2.lock().unwrap() = Some(r)),
        )),
        true,
    );
    Run {
        inputs,
        outputs,
        job,
    }
}

fn log_trace(g: &mut GraphBuilder) -> Arc<Mutex<Vec<GraphEvent>>> {
    let log: Arc<Mutex<Vec<GraphEvent>>> = Arc::default();
    let l2 = log.clone();
    g.trace(move |e| l2.lock().unwrap().push(e.clone()));
    log
}

fn pos(log: &[GraphEvent], actor: &str, iteration: u64, phase: Phase) -> usize {
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
    let (x, y) = (blob(&5u64.to_ne_bytes()), blob(&7u64.to_ne_bytes()));
    let (out, out2) = (blob(&[0; 8]), blob(&[0; 8]));
    let run = launch(&graph, &[&x, &y], &[&out, &out2], &[]);
    run.wait().unwrap();
    for r in run.inputs.iter().chain(&run.outputs) {
        assert!(r.is_done());
        assert!(matches!(r.result(), Some(Ok(()))));
    }
    assert_eq!(u64_of(&out), 12);
    assert_eq!(u64_of(&out2), 5);
    assert_eq!(graph.iterations_done(), 1);
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
    let runs: Vec<_> = (0..3u64)
        .map(|i| {
            let (x, e, l) = (blob(&i.to_ne_bytes()), blob(&[0; 8]), blob(&[0; 8]));
            let r = launch(&graph, &[&x], &[&e, &l], &[]);
            (r, e, l)
        })
        .collect();
    for (i, (r, e, l)) in runs.iter().enumerate() {
        r.wait().unwrap();
        assert_eq!(u64_of(e), i as u64 + 1);
        assert_eq!(u64_of(l), (i as u64 + 1) * 10);
    }
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
    let (x0, ok0, bad0) = (blob(&3u64.to_ne_bytes()), blob(&[0; 8]), blob(&[0; 8]));
    let run = launch(&graph, &[&x0], &[&ok0, &bad0], &[]);
    match run.wait() {
        Err(Error::KernelPanicked {
            instruction,
            message,
        }) => {
            assert!(instruction.contains("explode"), "{instruction}");
            assert!(message.contains("kernel exploded"));
        }
        other => panic!("expected KernelPanicked, got {other:?}"),
    }
    assert!(matches!(run.outputs[0].result(), Some(Ok(()))));
    assert!(matches!(
        run.outputs[1].result(),
        Some(Err(Error::KernelPanicked { .. }))
    ));
    assert_eq!(u64_of(&ok0), 3);
    let (ok1, bad1) = (blob(&[0; 8]), blob(&[0; 8]));
    let run = launch(&graph, &[&x0], &[&ok1, &bad1], &[]);
    run.wait().unwrap();
    assert_eq!(u64_of(&bad1), 99);
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
    let param = blob(&1u64.to_ne_bytes());
    let runs: Vec<_> = (1..=6u64)
        .map(|i| {
            let (x, y) = (blob(&i.to_ne_bytes()), blob(&[0; 8]));
            (launch(&graph, &[&x], &[&y], &[&param]), y)
        })
        .collect();
    let mut wv = 1u64;
    for (i, (r, y)) in runs.iter().enumerate() {
        r.wait().unwrap();
        let yv = (i as u64 + 1) * wv;
        assert_eq!(u64_of(y), yv, "run {i}");
        wv += yv % 7 + 1;
    }
    assert_eq!(u64_of(&param), wv);
}

#[test]
fn invalid_interfaces_and_empty_tensors() {
    let mut g = GraphBuilder::new("inv");
    let x = g.input_with("x", 8, false);
    let e = g.input("empty", 0);
    let y = g.blob("y", 8);
    g.kernel("k", &[x, e], &[y], |k| {
        assert_eq!(k.input(0), &[0; 8], "an invalid input's blob stays zero");
        assert!(k.input(1).is_empty());
        k.output_u64(0)[0] = 5;
    });
    g.output_with("y", y, false);
    g.output("y2", y);
    let graph = g.build().unwrap();
    let (xi, ei, yo, y2o) = (blob(&[1; 8]), blob(&[]), blob(&[7; 8]), blob(&[0; 8]));
    let run = launch(&graph, &[&xi, &ei], &[&yo, &y2o], &[]);
    run.wait().unwrap();
    assert_eq!(read(&yo), [7; 8], "an invalid output is never copied");
    assert_eq!(u64_of(&y2o), 5);
}

#[test]
fn size_mismatch_at_copy_fails_the_op() {
    let mut g = GraphBuilder::new("size");
    let x = g.input("x", 8);
    g.output("x", x);
    let graph = g.build().unwrap();
    let (xi, xo) = (blob(&[1; 16]), blob(&[0; 8]));
    let run = launch(&graph, &[&xi], &[&xo], &[]);
    assert!(matches!(
        run.wait(),
        Err(Error::InterfaceSizeMismatch {
            expected: 8,
            got: 16,
            ..
        })
    ));
    assert!(matches!(
        run.inputs[0].result(),
        Some(Err(Error::InterfaceSizeMismatch { .. }))
    ));
    assert!(run.outputs[0].result().is_some_and(|r| r.is_err()));
}

#[test]
fn shutdown_fails_unfinished_runs_and_later_launches() {
    let mut g = GraphBuilder::new("stop");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("slow", &[x], &[y], |_| {
        std::thread::sleep(Duration::from_millis(30))
    });
    g.output("y", y);
    let graph = g.build().unwrap();
    let (xi, yo) = (blob(&[1; 8]), blob(&[0; 8]));
    let runs: Vec<_> = (0..3)
        .map(|_| launch(&graph, &[&xi], &[&yo], &[]))
        .collect();
    std::thread::sleep(Duration::from_millis(10));
    graph.shutdown();
    for r in &runs {
        let res = r.job.lock().unwrap().clone();
        assert!(res.is_some(), "every run finished after shutdown");
        for rec in r.inputs.iter().chain(&r.outputs) {
            assert!(rec.is_done(), "every record is done after shutdown");
        }
    }
    assert!(matches!(
        runs[2].job.lock().unwrap().clone(),
        Some(Err(Error::GraphClosed { .. }))
    ));
    let late = launch(&graph, &[&xi], &[&yo], &[]);
    assert!(matches!(late.wait(), Err(Error::GraphClosed { .. })));
    assert!(late.outputs[0].is_done());
    graph.shutdown();
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
        g.kernel("k", &[BlobId(42)], &[], |_| {});
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
    let (w, y) = (blob(&[0; 8]), blob(&[0; 8]));
    let run = launch(&graph, &[], &[&y], &[&w]);
    match run.wait() {
        Err(Error::KernelPanicked { message, .. }) => {
            assert!(message.contains("param_kernel"), "{message}")
        }
        other => panic!("expected KernelPanicked, got {other:?}"),
    }
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
    g.param_kernel("mul", &[x], &[y], move |k| {
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
    assert_eq!(graph.num_threads(), 1);
    assert!(graph.actors().iter().all(|(_, t)| *t == 0));
    let param = blob(&2u64.to_ne_bytes());
    let mut wv = 2u64;
    for i in 1..=5u64 {
        let (xb, yb) = (blob(&i.to_ne_bytes()), blob(&[0; 8]));
        let run = launch(&graph, &[&xb], &[&yb], &[&param]);
        run.wait().unwrap();
        assert_eq!(u64_of(&yb), i * wv, "run {i}");
        wv += i * wv;
    }
    assert_eq!(u64_of(&param), wv);
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
    let param = blob(&1u64.to_ne_bytes());
    let err = launch(&graph, &[], &[], &[&param]).wait().unwrap_err();
    assert!(
        matches!(&err, Error::KernelPanicked { message, .. } if message.contains("lent mutably")),
        "{err}"
    );
}
