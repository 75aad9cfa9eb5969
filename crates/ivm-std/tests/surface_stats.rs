//! Introspection: stats snapshots and the lively-DAG dump.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ivm_std::{Config, Device, NodeState, StreamId, VirtualMachine, VmStats};

/// Opens the gate when dropped, so that a failing assertion does not hang the shutdown.
struct Open(Arc<AtomicBool>);
impl Drop for Open {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// The first snapshot that satisfies `ok` (within a few seconds).
fn eventually(vm: &VirtualMachine, ok: impl Fn(&VmStats) -> bool) -> VmStats {
    for _ in 0..3000 {
        let st = vm.stats().unwrap();
        if ok(&st) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = vm.stats().unwrap();
    assert!(ok(&st), "{st:?}");
    st
}

#[test]
fn stats_and_dag_while_a_stream_is_blocked() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let s0 = vm.default_stream();
    let s1 = vm.stream(StreamId::compute(Device::CPU, 1)).unwrap();
    let (x, y) = (vm.new_tensor(8).unwrap(), vm.new_tensor(8).unwrap());
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    let _open = Open(gate.clone());
    vm.run(|b| {
        b.call_named("producer", &s0, &[], &[&x], move |k| {
            while !g.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            k.output_u64(0)[0] = 1;
        })?;
        b.call_named("consumer", &s1, &[&x], &[&y], |k| {
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1
        })
    })
    .unwrap();
    // Wait until the engine has handled both.
    let st = eventually(&vm, |st| st.lively >= 2);
    assert!(st.flying >= 2, "{st:?}");
    assert!(st.lively >= 2, "{st:?}");
    assert_eq!(st.received, st.released + st.flying);
    let running0 = st.streams.iter().find(|r| r.id == s0.id()).unwrap();
    assert_eq!(running0.running, 1, "{st:?}");
    // A VM thread registers its counters once it has started.
    eventually(&vm, |st| {
        st.threads.iter().any(|t| t.name.ends_with("-scheduler"))
    });

    let dag = vm.dump_dag().unwrap();
    let p = dag
        .nodes
        .iter()
        .find(|n| n.name.starts_with("producer#"))
        .unwrap();
    let c = dag
        .nodes
        .iter()
        .find(|n| n.name.starts_with("consumer#"))
        .unwrap();
    assert_eq!(p.state, NodeState::Dispatched);
    assert_eq!(c.state, NodeState::Waiting);
    assert!(dag.edges.iter().any(|e| e.from == p.id && e.to == c.id));
    let text = dag.to_text();
    assert!(
        text.contains("consumer#") && text.contains("after [producer#"),
        "{text}"
    );
    let dot = dag.to_dot();
    assert!(dot.starts_with("digraph ivm {"), "{dot}");
    assert!(dot.contains(&format!("n{} -> n{}", p.id, c.id)), "{dot}");

    gate.store(true, Ordering::Release);
    vm.sync().unwrap();
    // `sync` returns when its own barrier ran, just before the engine releases it.
    let st = eventually(&vm, |st| st.flying == 0);
    assert_eq!(st.received, st.released);
    assert!(st.streams.iter().all(|r| r.running == 0), "{st:?}");
    assert!(vm.dump_dag().unwrap().nodes.is_empty());
    // Workers slept and were woken at some point; counters only grow.
    let parks: usize = st.threads.iter().map(|t| t.parks).sum();
    let wakes: usize = st.threads.iter().map(|t| t.wakes).sum();
    assert!(wakes <= parks, "{st:?}");
    vm.shutdown().unwrap();
    // Stats still work after shutdown (final counters); the DAG dump does not.
    assert_eq!(vm.stats().unwrap().flying, 0);
    assert!(vm.dump_dag().is_err());
}

#[test]
fn single_thread_dag_and_stats() {
    let vm = VirtualMachine::new(Config::single_thread()).unwrap();
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 1))
        .unwrap();
    vm.sync().unwrap();
    let st = vm.stats().unwrap();
    assert_eq!(st.flying, 0);
    assert!(st.released >= 1);
    assert!(vm.dump_dag().unwrap().nodes.is_empty());
}
