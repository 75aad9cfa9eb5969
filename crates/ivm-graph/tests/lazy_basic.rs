//! Lazy-job launches through the VM: values, bad input, failures, shutdown.

use std::sync::Arc;
use std::time::Duration;

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Config, DebugCounters, Device, Error, StreamId, Tensor, VirtualMachine};

mod common;
use common::{affine, read_u64, tensor};

fn assert_drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}

#[test]
fn launches_mix_with_eager_work() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let s = vm.default_stream();
    let graph = affine();
    let (x, b, w, y) = (
        tensor(&vm, 3),
        tensor(&vm, 1),
        tensor(&vm, 2),
        tensor(&vm, 0),
    );
    for _ in 0..20 {
        vm.run(|bl| {
            bl.launch_lazy_job(&[&x, &b], &[&y], &[&w], graph.lazy())?;
            // Eager work on the output and the input right after the launch.
            bl.call(&s, &[&y], &[&b], |k| {
                let v = k.input_u64(0)[0];
                k.output_u64(0)[0] = v % 5;
            })?;
            bl.call(&s, &[], &[&x], |k| k.output_u64(0)[0] += 1)
        })
        .unwrap();
    }
    // Recompute sequentially.
    let (mut xs, mut bs, mut ws) = (3u64, 1u64, 2u64);
    let mut ys = 0;
    for _ in 0..20 {
        ys = xs * ws + bs;
        ws += xs;
        bs = ys % 5;
        xs += 1;
    }
    assert_eq!(read_u64(&vm, &y).unwrap(), ys);
    assert_eq!(read_u64(&vm, &w).unwrap(), ws);
    assert_eq!(read_u64(&vm, &b).unwrap(), bs);
    assert_eq!(read_u64(&vm, &x).unwrap(), xs);
    assert_eq!(graph.iterations_done(), 20);
    drop((x, b, w, y));
    assert_drained(&vm);
}

/// A run whose parameter a failed eager instruction poisoned computes nothing from it:
/// its outputs are poisoned with the error naming that instruction (before the fix the
/// graph used the poisoned parameter in place and its output read `Ok`).
#[test]
fn a_poisoned_parameter_poisons_the_runs_outputs() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let graph = affine();
    let s = vm.default_stream();
    let (x, b, w, y) = (
        tensor(&vm, 3),
        tensor(&vm, 1),
        tensor(&vm, 2),
        tensor(&vm, 0),
    );
    vm.run(|bl| {
        bl.call_named("spoil_w", &s, &[], &[&w], |_| panic!("w is spoiled"))?;
        bl.launch_lazy_job(&[&x, &b], &[&y], &[&w], graph.lazy())
    })
    .unwrap();
    for t in [&y, &w] {
        match read_u64(&vm, t) {
            Err(Error::Poisoned {
                instruction,
                message,
            }) => {
                assert!(instruction.contains("spoil_w"), "{instruction}");
                assert!(message.contains("w is spoiled"), "{message}");
            }
            other => panic!("expected Poisoned, got {other:?}"),
        }
    }
    // The graph keeps serving runs with a good parameter (and a good output: a poisoned
    // tensor stays poisoned, writes into it fail).
    let (w2, y2) = (tensor(&vm, 5), tensor(&vm, 0));
    vm.run(|bl| bl.launch_lazy_job(&[&x, &b], &[&y2], &[&w2], graph.lazy()))
        .unwrap();
    assert_eq!(read_u64(&vm, &y2).unwrap(), 16);
    drop((x, b, w, y, w2, y2));
    assert_drained(&vm);
}

#[test]
fn bad_launches_are_errors() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let graph = affine();
    let (x, b, w, y) = (
        tensor(&vm, 3),
        tensor(&vm, 1),
        tensor(&vm, 2),
        tensor(&vm, 0),
    );
    let big = vm.new_tensor(16).unwrap();
    let launch = |i: &[&Tensor], o: &[&Tensor], p: &[&Tensor]| {
        vm.run(|bl| bl.launch_lazy_job(i, o, p, graph.lazy()))
    };
    assert!(matches!(
        launch(&[&x], &[&y], &[&w]),
        Err(Error::InterfaceCountMismatch {
            what: "inputs",
            expected: 2,
            got: 1,
            ..
        })
    ));
    assert!(matches!(
        launch(&[&x, &b], &[], &[&w]),
        Err(Error::InterfaceCountMismatch {
            what: "outputs",
            ..
        })
    ));
    assert!(matches!(
        launch(&[&x, &b], &[&y], &[]),
        Err(Error::InterfaceCountMismatch {
            what: "parameters",
            ..
        })
    ));
    match launch(&[&x, &big], &[&y], &[&w]) {
        Err(Error::InterfaceSizeMismatch {
            name,
            expected: 8,
            got: 16,
            ..
        }) => assert_eq!(name, "b"),
        other => panic!("expected InterfaceSizeMismatch, got {other:?}"),
    }
    assert!(matches!(
        launch(&[&x, &b], &[&y], &[&big]),
        Err(Error::InterfaceSizeMismatch { .. })
    ));
    assert!(matches!(
        launch(&[&x, &b], &[&x], &[&w]),
        Err(Error::AliasedOperand)
    ));
    assert!(matches!(
        launch(&[&x, &b], &[&w], &[&w]),
        Err(Error::AliasedOperand)
    ));
    // The same tensor twice as input is fine (both are reads).
    launch(&[&x, &x], &[&y], &[&w]).unwrap();
    assert_eq!(read_u64(&vm, &y).unwrap(), 3 * 2 + 3);
    let other = VirtualMachine::new(Config::default()).unwrap();
    let foreign = tensor(&other, 1);
    assert!(matches!(
        launch(&[&x, &foreign], &[&y], &[&w]),
        Err(Error::ForeignObject(_))
    ));
    // A graph serves one VM.
    let (ox, ob, ow, oy) = (
        tensor(&other, 1),
        tensor(&other, 1),
        tensor(&other, 1),
        tensor(&other, 1),
    );
    assert!(matches!(
        other.run(|bl| bl.launch_lazy_job(&[&ox, &ob], &[&oy], &[&ow], graph.lazy())),
        Err(Error::InvalidGraph { .. })
    ));
    drop((ox, ob, ow, oy));
    drop((x, b, w, y, big, foreign));
    assert_drained(&vm);
}

#[test]
fn invalid_interfaces_and_empty_tensors_complete_at_once() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let mut g = GraphBuilder::new("inv");
    let x = g.input_with("x", 8, false);
    let e = g.input("e", 0);
    let y = g.blob("y", 8);
    g.kernel("k", &[x, e], &[y], |k| k.output_u64(0)[0] = 9);
    g.output_with("unused", y, false);
    g.output("y", y);
    let graph = g.build().unwrap();
    // An invalid interface's tensor may have any size: the graph never touches it.
    let (xi, ei, un, yo) = (
        vm.new_tensor(3).unwrap(),
        vm.new_tensor(0).unwrap(),
        tensor(&vm, 7),
        tensor(&vm, 0),
    );
    vm.run(|bl| bl.launch_lazy_job(&[&xi, &ei], &[&un, &yo], &[], graph.lazy()))
        .unwrap();
    assert_eq!(read_u64(&vm, &yo).unwrap(), 9);
    assert_eq!(
        read_u64(&vm, &un).unwrap(),
        7,
        "an invalid output is untouched"
    );
    drop((xi, ei, un, yo));
    assert_drained(&vm);
}

#[test]
fn graph_kernel_panic_reaches_every_waiting_eager_instruction() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let mut g = GraphBuilder::new("boom");
    let x = g.input("x", 8);
    let w = g.param("w", 8);
    let good = g.blob("good", 8);
    let bad = g.blob("bad", 8);
    g.kernel("copy", &[x], &[good], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v;
    });
    g.param_kernel("explode", &[x], &[bad], move |k| {
        if k.input_u64(0)[0] == 13 {
            panic!("unlucky input");
        }
        k.param_u64_mut(w)[0] += 1;
        k.output_u64(0)[0] = 1;
    });
    g.output("good", good);
    g.output("bad", bad);
    let graph = g.build().unwrap();
    let s = vm.default_stream();
    let (xi, wp, go, bo, after) = (
        tensor(&vm, 13),
        tensor(&vm, 0),
        tensor(&vm, 0),
        tensor(&vm, 0),
        tensor(&vm, 0),
    );
    vm.run(|bl| {
        bl.launch_lazy_job(&[&xi], &[&go, &bo], &[&wp], graph.lazy())?;
        bl.call_named("after_bad", &s, &[&bo], &[&after], |k| {
            k.output_u64(0)[0] = 1
        })
    })
    .unwrap();
    assert_eq!(
        read_u64(&vm, &go).unwrap(),
        13,
        "an unaffected output arrives"
    );
    for t in [&bo, &wp, &after] {
        match read_u64(&vm, t) {
            Err(Error::Poisoned {
                instruction,
                message,
            }) => {
                assert!(instruction.contains("explode"), "{instruction}");
                assert!(message.contains("unlucky input"), "{message}");
            }
            other => panic!("expected Poisoned, got {other:?}"),
        }
    }
    // The VM and the graph keep serving.
    let (x2, w2, g2, b2) = (
        tensor(&vm, 1),
        tensor(&vm, 5),
        tensor(&vm, 0),
        tensor(&vm, 0),
    );
    vm.run(|bl| bl.launch_lazy_job(&[&x2], &[&g2, &b2], &[&w2], graph.lazy()))
        .unwrap();
    assert_eq!(read_u64(&vm, &b2).unwrap(), 1);
    assert_eq!(read_u64(&vm, &w2).unwrap(), 6);
    drop((xi, wp, go, bo, after, x2, w2, g2, b2));
    assert_drained(&vm);
}

fn slow_graph(name: &str, ms: u64) -> Graph {
    let mut g = GraphBuilder::new(name);
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("slow", &[x], &[y], move |k| {
        std::thread::sleep(Duration::from_millis(ms));
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    g.output("y", y);
    g.build().unwrap()
}

#[test]
fn graph_shutdown_while_running_fails_its_runs_without_hanging() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let graph = slow_graph("stopped", 40);
    let x = tensor(&vm, 1);
    let ys: Vec<Tensor> = (0..4).map(|_| tensor(&vm, 0)).collect();
    vm.run(|bl| {
        for y in &ys {
            bl.launch_lazy_job(&[&x], &[y], &[], graph.lazy())?;
        }
        Ok(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(10));
    graph.shutdown();
    let mut closed = 0;
    for y in &ys {
        match read_u64(&vm, y) {
            Ok(v) => assert_eq!(v, 2),
            Err(Error::Poisoned { message, .. }) => {
                assert!(message.contains("shut down"), "{message}");
                closed += 1;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert!(closed >= 1, "the last run cannot have finished");
    // Launching the closed graph fails the run instead of waiting.
    let z = tensor(&vm, 0);
    vm.run(|bl| bl.launch_lazy_job(&[&x], &[&z], &[], graph.lazy()))
        .unwrap();
    assert!(matches!(read_u64(&vm, &z), Err(Error::Poisoned { .. })));
    // Eager work goes on.
    let s = vm.default_stream();
    vm.run(|bl| bl.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 8))
        .unwrap();
    assert_eq!(read_u64(&vm, &x).unwrap(), 8);
    drop((x, ys, z));
    assert_drained(&vm);
}

#[test]
fn vm_shutdown_while_a_graph_runs_drains_it() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let graph = Arc::new(slow_graph("drained", 30));
    let x = tensor(&vm, 1);
    let y = tensor(&vm, 0);
    vm.run(|bl| {
        bl.launch_lazy_job(&[&x], &[&y], &[], graph.lazy())?;
        bl.launch_lazy_job(&[&x], &[&y], &[], graph.lazy())
    })
    .unwrap();
    drop((x, y));
    assert_drained(&vm);
    assert_eq!(graph.iterations_done(), 2);
}

#[test]
fn single_thread_mode_runs_lazy_jobs() {
    let vm = VirtualMachine::new(Config::single_thread()).unwrap();
    let graph = affine();
    let (x, b, w, y) = (
        tensor(&vm, 3),
        tensor(&vm, 1),
        tensor(&vm, 2),
        tensor(&vm, 0),
    );
    for _ in 0..3 {
        vm.run(|bl| bl.launch_lazy_job(&[&x, &b], &[&y], &[&w], graph.lazy()))
            .unwrap();
    }
    assert_eq!(read_u64(&vm, &y).unwrap(), 3 * 8 + 1);
    assert_eq!(read_u64(&vm, &w).unwrap(), 11);
    drop((x, b, w, y));
    assert_drained(&vm);
}

#[test]
fn launch_streams_are_their_own() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let graph = slow_graph("streams", 0);
    let x = tensor(&vm, 1);
    let y = tensor(&vm, 0);
    vm.run(|bl| bl.launch_lazy_job(&[&x], &[&y], &[], graph.lazy()))
        .unwrap();
    assert_eq!(read_u64(&vm, &y).unwrap(), 2);
    for t in [
        ivm_std::StreamType::CriticalSection,
        ivm_std::StreamType::LazyJobLauncher,
    ] {
        let s = vm
            .stream(StreamId {
                device: Device::CPU,
                stream_type: t,
                thread_id: 0,
            })
            .unwrap();
        assert_eq!(s.id().stream_type, t);
    }
    drop((x, y));
    assert_drained(&vm);
}

/// A training-loop shape: each step the host fills the input with a sync callback (it
/// waits for the previous run to have copied it in), launches a one-thread graph, and
/// reads the output, which leaves the graph before its parameter update. The protocol
/// steps run inline in whichever thread drives the VM, completions drive it from the
/// graph's thread, and the caller helps while it waits: values must follow run order, in
/// both VM modes.
#[test]
fn host_loader_launch_read_loop_on_a_one_thread_graph() {
    for cfg in [Config::default(), Config::single_thread()] {
        let cfg = cfg.with_timeout_period(Duration::from_secs(10));
        let vm = VirtualMachine::new(cfg).unwrap();
        let mut g = GraphBuilder::new("loop");
        let x = g.input("x", 8);
        let w = g.param("w", 8);
        let y = g.blob("y", 8);
        g.param_kernel("fwd", &[x], &[y], move |k| {
            let v = k.input_u64(0)[0] * k.param_u64(w)[0];
            k.output_u64(0)[0] = v;
        });
        g.param_kernel("upd", &[y], &[], move |k| {
            let d = k.input_u64(0)[0] % 5 + 1;
            k.param_u64_mut(w)[0] += d;
        });
        g.output("y", y);
        g.threads(1).pipeline_depth(1);
        let graph = g.build().unwrap();
        let (xt, wt, yt) = (tensor(&vm, 0), tensor(&vm, 1), tensor(&vm, 0));
        let mut wv = 1u64;
        for i in 1..=300u64 {
            vm.access_mut(&xt, move |b| {
                b[..8].copy_from_slice(&i.to_ne_bytes());
            })
            .unwrap();
            vm.run(|b| b.launch_lazy_job(&[&xt], &[&yt], &[&wt], graph.lazy()))
                .unwrap();
            assert_eq!(read_u64(&vm, &yt).unwrap(), i * wv, "step {i}");
            wv += (i * wv) % 5 + 1;
        }
        vm.sync().unwrap();
        assert_eq!(read_u64(&vm, &wt).unwrap(), wv);
        drop(graph);
        assert_drained(&vm);
    }
}
