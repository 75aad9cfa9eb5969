//! Blocking waits in single-thread mode (checked in multi-thread mode too, which already
//! behaves so): a waiting caller lets go of the engine while it sleeps, so another thread
//! (a graph kernel calling the VM, which the thread-safety contract allows) can drive it;
//! and a per-call deadline ends the wait even while the VM waits for a graph.
//!
//! Timing is asserted only coarsely: results and error kinds, the graph's progress when a
//! call returned, and bounds of seconds against waits of a few hundred milliseconds.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Config, Error, VirtualMachine};

mod common;
use common::{read_u64, tensor};

fn configs(period: Duration) -> [(&'static str, Config); 2] {
    [
        (
            "single",
            Config::single_thread().with_timeout_period(period),
        ),
        ("multi", Config::default().with_timeout_period(period)),
    ]
}

/// `y = x + 1` after sleeping `ms` in the kernel.
fn slow_graph(name: &str, ms: u64) -> Graph {
    let mut g = GraphBuilder::new(name);
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("slow", &[x], &[y], move |k| {
        std::thread::sleep(Duration::from_millis(ms));
        k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
    });
    g.output("y", y);
    g.build().unwrap()
}

/// The caller waits for a launch's output while the graph's kernel reads another tensor
/// through the VM: both reads succeed (the caller used to hold the engine while it
/// slept, so the kernel stalled until the caller timed out).
#[test]
fn a_graph_kernel_reading_the_vm_does_not_stall_the_caller_waiting_for_it() {
    for (mode, config) in configs(Duration::from_secs(3)) {
        let vm = Arc::new(VirtualMachine::new(config).unwrap());
        let other = tensor(&vm, 40);
        let seen: Arc<Mutex<Option<Result<u64, Error>>>> = Arc::new(Mutex::new(None));
        let mut g = GraphBuilder::new("reads-the-vm");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        let (v, o, s) = (vm.clone(), other.clone(), seen.clone());
        g.kernel("read-other", &[x], &[y], move |k| {
            // Let the caller get to its wait first.
            std::thread::sleep(Duration::from_millis(100));
            let r = read_u64(&v, &o);
            k.output_u64(0)[0] = k.input_u64(0)[0] + r.as_ref().map_or(0, |v| *v);
            *s.lock().unwrap() = Some(r);
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let (xt, yt) = (tensor(&vm, 2), tensor(&vm, 0));
        vm.run(|b| b.launch_lazy_job(&[&xt], &[&yt], &[], graph.lazy()))
            .unwrap();
        let r = read_u64(&vm, &yt);
        let inner = seen.lock().unwrap().take();
        assert!(
            matches!(inner, Some(Ok(40))),
            "{mode}: the kernel's read: {inner:?}"
        );
        assert!(matches!(r, Ok(42)), "{mode}: the caller's read: {r:?}");
        drop(graph);
        drop((xt, yt, other));
        vm.shutdown().unwrap();
    }
}

/// A per-call deadline ends a read waiting for a slow graph's output (it used to return
/// `Ok` once the graph finished, after the whole 1.5 s); the value arrives later.
#[test]
fn a_read_deadline_ends_the_wait_for_a_slow_graph() {
    for (mode, config) in configs(Duration::from_secs(20)) {
        let vm = VirtualMachine::new(config).unwrap();
        let graph = slow_graph("slow-read", 1500);
        let (x, y) = (tensor(&vm, 1), tensor(&vm, 0));
        vm.run(|b| b.launch_lazy_job(&[&x], &[&y], &[], graph.lazy()))
            .unwrap();
        let mut out = [0u8; 8];
        let r = vm.read_small_timeout(&y, 0, &mut out, Duration::from_millis(100));
        let iterations = graph.iterations_done();
        assert!(matches!(r, Err(Error::Timeout(_))), "{mode}: {r:?}");
        assert_eq!(
            iterations, 0,
            "{mode}: the read returned only after the graph finished"
        );
        // A later wait (and one with a deadline long enough) gets the value.
        assert_eq!(read_u64(&vm, &y).unwrap(), 2, "{mode}");
        vm.read_small_timeout(&y, 0, &mut out, Duration::from_secs(20))
            .unwrap();
        assert_eq!(u64::from_ne_bytes(out), 2, "{mode}");
        drop(graph);
        drop((x, y));
        vm.shutdown().unwrap();
    }
}

/// `sync_timeout` inside a graph kernel (which the sync itself waits for) ends at its own
/// deadline, not after the VM-wide timeout period; the run then completes.
#[test]
fn a_sync_deadline_inside_a_graph_kernel_is_honoured() {
    let period = Duration::from_secs(8);
    for (mode, config) in configs(period) {
        let vm = Arc::new(VirtualMachine::new(config).unwrap());
        let (tx, rx) = mpsc::channel::<(Result<(), Error>, Duration)>();
        let tx = Mutex::new(tx);
        let mut g = GraphBuilder::new("syncs-the-vm");
        let x = g.input("x", 8);
        let y = g.blob("y", 8);
        let v = vm.clone();
        g.kernel("sync", &[x], &[y], move |k| {
            let t0 = Instant::now();
            let r = v.sync_timeout(Duration::from_millis(300));
            let _ = tx.lock().unwrap().send((r, t0.elapsed()));
            k.output_u64(0)[0] = k.input_u64(0)[0] + 1;
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let (xt, yt) = (tensor(&vm, 6), tensor(&vm, 0));
        vm.run(|b| b.launch_lazy_job(&[&xt], &[&yt], &[], graph.lazy()))
            .unwrap();
        // This thread does not touch the VM until the kernel reports.
        let (r, waited) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(matches!(r, Err(Error::Timeout(_))), "{mode}: {r:?}");
        assert!(
            waited < period / 2,
            "{mode}: sync_timeout(300 ms) returned after {waited:?} (timeout period {period:?})"
        );
        assert_eq!(read_u64(&vm, &yt).unwrap(), 7, "{mode}");
        drop(graph);
        drop((xt, yt));
        vm.shutdown().unwrap();
    }
}
