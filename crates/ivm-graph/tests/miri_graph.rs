//! A reduced lazy-job run small enough for miri (`.ci/miri.sh` runs this file under
//! `cargo +nightly miri test` with strict provenance, beside ivm-std's `miri_vm`); it
//! passes under plain `cargo test` too. In both VM modes, three launches of a graph with a
//! parameter mixed with eager kernels on the same tensors: ivm-std's lazy door
//! (critical sections, records, the launch instruction) and this crate's runtime (actors,
//! register slots, parameter kernels) under miri's checks.

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Config, DebugCounters, Error, Tensor, VirtualMachine};

fn modes() -> [Config; 2] {
    [Config::default(), Config::single_thread()]
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> Result<u64, Error> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn assert_drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(
        vm.debug_counters(),
        DebugCounters::default(),
        "live engine objects after shutdown"
    );
}

/// y = x * w + b; w += x (a parameter update each run).
fn affine() -> Graph {
    let mut g = GraphBuilder::new("affine");
    let x = g.input("x", 8);
    let b = g.input("b", 8);
    let w = g.param("w", 8);
    let y = g.blob("y", 8);
    g.param_kernel("fwd", &[x, b], &[y], move |k| {
        let v = k.input_u64(0)[0] * k.param_u64(w)[0] + k.input_u64(1)[0];
        k.output_u64(0)[0] = v;
    });
    g.param_kernel("upd", &[x], &[], move |k| {
        let d = k.input_u64(0)[0];
        k.param_u64_mut(w)[0] += d;
    });
    g.output("y", y);
    g.build().unwrap()
}

#[test]
fn lazy_launches_mix_with_eager_work() {
    for cfg in modes() {
        let vm = VirtualMachine::new(cfg).unwrap();
        let s = vm.default_stream();
        let graph = affine();
        let tensor = |v: u64| vm.new_tensor_from(&s, &v.to_ne_bytes()).unwrap();
        let (x, b, w, y) = (tensor(3), tensor(1), tensor(2), tensor(0));
        const LAUNCHES: u64 = 3;
        for _ in 0..LAUNCHES {
            vm.run(|bl| {
                bl.launch_lazy_job(&[&x, &b], &[&y], &[&w], graph.lazy())?;
                bl.call(&s, &[&y], &[&b], |k| {
                    let v = k.input_u64(0)[0];
                    k.output_u64(0)[0] = v % 5;
                })?;
                bl.call(&s, &[], &[&x], |k| k.output_u64(0)[0] += 1)
            })
            .unwrap();
        }
        let (mut xs, mut bs, mut ws, mut ys) = (3u64, 1u64, 2u64, 0u64);
        for _ in 0..LAUNCHES {
            ys = xs * ws + bs;
            ws += xs;
            bs = ys % 5;
            xs += 1;
        }
        assert_eq!(read_u64(&vm, &y).unwrap(), ys);
        assert_eq!(read_u64(&vm, &w).unwrap(), ws);
        assert_eq!(read_u64(&vm, &b).unwrap(), bs);
        assert_eq!(read_u64(&vm, &x).unwrap(), xs);
        assert_eq!(graph.iterations_done(), LAUNCHES);
        drop((x, b, w, y));
        assert_drained(&vm);
    }
}
