//! A reduced lazy-job run small enough for miri (`.ci/miri.sh` runs this file under
//! `cargo +nightly miri test` with strict provenance, beside ivm-std's `miri_vm`); it
//! passes under plain `cargo test` too. In both VM modes, three launches of a graph with a
//! parameter mixed with eager kernels on the same tensors: ivm-std's lazy door
//! (critical sections, records, the launch instruction) and this crate's runtime (actors,
//! register slots, parameter kernels) under miri's checks.

use ivm_std::{Config, DebugCounters, VirtualMachine};

mod common;
use common::{affine, read_u64};

fn modes() -> [Config; 2] {
    [Config::default(), Config::single_thread()]
}

fn assert_drained(vm: &VirtualMachine) {
    vm.shutdown().unwrap();
    assert_eq!(
        vm.debug_counters(),
        DebugCounters::default(),
        "live engine objects after shutdown"
    );
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
