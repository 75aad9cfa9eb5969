//! Lazy-job launches over sim tensors: eager kernels run on a simulated asynchronous
//! device with random latencies, the graph runtime copies through critical sections.
//! Values are checked against a sequential model; order is checked through recorded
//! events and gates (never wall-clock time).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ivm_device::{SimAdapter, SimConfig};
use ivm_graph::{GraphBuilder, Phase};
use ivm_std::{Config, DebugCounters, Device, StreamId, Tensor, VirtualMachine};

const SIM: Device = Device {
    kind: ivm_device::sim::SIM,
    index: 0,
};

fn vm(seed: u64) -> VirtualMachine {
    VirtualMachine::with_adapters(
        Config::default(),
        vec![SimAdapter::new(SimConfig::random(1, seed))],
    )
    .unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

#[test]
fn sim_tensors_through_a_graph_equal_the_sequential_model() {
    for seed in [1u64, 2, 3] {
        let vm = vm(seed);
        let s0 = vm.stream(StreamId::compute(SIM, 0)).unwrap();
        let s1 = vm.stream(StreamId::compute(SIM, 1)).unwrap();
        let mut g = GraphBuilder::new("sim_affine");
        let x = g.input("x", 8);
        let w = g.param("w", 8);
        let y = g.blob("y", 8);
        g.param_kernel("fwd", &[x], &[y], move |k| {
            let v = k.input_u64(0)[0] * 3 + k.param_u64(w)[0];
            k.output_u64(0)[0] = v;
            k.param_u64_mut(w)[0] += 1;
        });
        g.output("y", y);
        let graph = g.build().unwrap();
        let xt = vm.new_tensor_on(&s0, 8).unwrap();
        let yt = vm.new_tensor_on(&s0, 8).unwrap();
        let wt = vm.new_tensor_on(&s0, 8).unwrap();
        let acc = vm.new_tensor_on(&s1, 8).unwrap();
        for step in 0..40u64 {
            vm.run(|b| {
                // Produce the input on one sim stream, consume the output on another.
                b.call(&s0, &[], &[&xt], move |k| k.output_u64(0)[0] = step)?;
                b.launch_lazy_job(&[&xt], &[&yt], &[&wt], graph.lazy())?;
                b.call(&s1, &[&yt], &[&acc], |k| {
                    let v = k.input_u64(0)[0];
                    k.output_u64(0)[0] += v;
                })?;
                if step % 10 == 9 {
                    // Eager writes to the parameter between launches.
                    b.call(&s1, &[], &[&wt], |k| k.output_u64(0)[0] *= 2)?;
                }
                Ok(())
            })
            .unwrap();
        }
        let (mut w_m, mut acc_m) = (0u64, 0u64);
        for step in 0..40u64 {
            acc_m += step * 3 + w_m;
            w_m += 1;
            if step % 10 == 9 {
                w_m *= 2;
            }
        }
        assert_eq!(read_u64(&vm, &acc), acc_m, "seed {seed}");
        assert_eq!(read_u64(&vm, &wt), w_m, "seed {seed}");
        drop((xt, yt, wt, acc));
        vm.shutdown().unwrap();
        assert_eq!(vm.debug_counters(), DebugCounters::default());
    }
}

type Log = Arc<Mutex<Vec<String>>>;

fn gate(flag: &AtomicBool, log: &Log) {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) {
        if start.elapsed() > Duration::from_secs(10) {
            log.lock().unwrap().push("TIMEOUT".into());
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

#[test]
fn sim_eager_work_goes_on_while_the_graph_computes() {
    let vm = vm(11);
    let s0 = vm.stream(StreamId::compute(SIM, 0)).unwrap();
    let log: Log = Arc::default();
    let reader_ran = Arc::new(AtomicBool::new(false));
    let mut g = GraphBuilder::new("sim_order");
    let x = g.input("x", 8);
    let o1 = g.blob("o1", 8);
    let o2 = g.blob("o2", 8);
    g.kernel("first", &[x], &[o1], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1;
    });
    let (l, r) = (log.clone(), reader_ran.clone());
    g.kernel("slow", &[o1], &[o2], move |k| {
        gate(&r, &l);
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v * 2;
    });
    g.output("o1", o1);
    g.output("o2", o2);
    let l = log.clone();
    g.trace(move |e| {
        let p = if e.phase == Phase::Start { "S" } else { "E" };
        l.lock()
            .unwrap()
            .push(format!("g:{}:{}:{p}", e.actor, e.iteration));
    });
    let graph = g.build().unwrap();
    let xt = vm.new_tensor_on(&s0, 8).unwrap();
    let (o1t, o2t, z, z2) = (
        vm.new_tensor_on(&s0, 8).unwrap(),
        vm.new_tensor_on(&s0, 8).unwrap(),
        vm.new_tensor_on(&s0, 8).unwrap(),
        vm.new_tensor_on(&s0, 8).unwrap(),
    );
    let (l1, l2, rr) = (log.clone(), log.clone(), reader_ran.clone());
    vm.run(|b| {
        b.call(&s0, &[], &[&xt], |k| k.output_u64(0)[0] = 20)?;
        b.launch_lazy_job(&[&xt], &[&o1t, &o2t], &[], graph.lazy())?;
        // A sim kernel reading output 1: runs on the sim stream while `slow` waits for it.
        b.call(&s0, &[&o1t], &[&z], move |k| {
            let v = k.input_u64(0)[0];
            l1.lock().unwrap().push(format!("sim:read o1={v}"));
            k.output_u64(0)[0] = v;
            rr.store(true, Ordering::Release);
        })?;
        b.call(&s0, &[&o2t], &[&z2], move |k| {
            let v = k.input_u64(0)[0];
            l2.lock().unwrap().push(format!("sim:read o2={v}"));
            k.output_u64(0)[0] = v;
        })
    })
    .unwrap();
    assert_eq!(read_u64(&vm, &z2), 42);
    assert_eq!(read_u64(&vm, &z), 21);
    vm.sync().unwrap();
    let log = log.lock().unwrap().clone();
    let pos = |s: &str| {
        log.iter()
            .position(|e| e == s)
            .unwrap_or_else(|| panic!("{s} missing: {log:#?}"))
    };
    assert!(!log.iter().any(|e| e == "TIMEOUT"), "{log:#?}");
    assert!(pos("g:output/o1:0:S") < pos("sim:read o1=21"));
    assert!(pos("sim:read o1=21") < pos("g:slow:0:E"));
    assert!(pos("sim:read o1=21") < pos("g:callback:0:S"));
    assert!(pos("g:output/o2:0:S") < pos("sim:read o2=42"));
    drop((xt, o1t, o2t, z, z2));
    vm.shutdown().unwrap();
    assert_eq!(vm.debug_counters(), DebugCounters::default());
}
