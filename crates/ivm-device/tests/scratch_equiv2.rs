use std::sync::Arc;
use ivm_device::sim::{SimAdapter, SimConfig, sim_device};
use ivm_std::fuzzing::{self, HashKernels, Op, Program, Runner, Topology};
use ivm_std::{Config, DeviceAdapter};

fn fails(r: &Runner, p: &Program, n: usize) -> bool { (0..n).any(|_| r.run(p).is_err()) }

#[test]
fn scratch() {
    fuzzing::silence_planned_panics();
    let topo = Topology::with_devices(&[sim_device(0), sim_device(1)]);
    let sim: Arc<dyn DeviceAdapter> = SimAdapter::new(SimConfig::random(2, 7));
    let r = Runner::with_topology(Config { caching_allocator: false, ..Config::default() }, vec![sim], topo.clone(), HashKernels).unwrap();
    let mut found = None;
    for seed in 0..3000 {
        let mut p = topo.fit(&Program::from_seed(seed));
        p.ops.retain(|op| !matches!(op, Op::Launch(_)));
        if r.run(&p).is_err() && fails(&r, &p, 10) { found = Some(p); break; }
    }
    let mut p = found.expect("none");
    loop {
        let mut progress = false;
        let mut i = 0;
        while i < p.ops.len() {
            let mut q = p.clone();
            q.ops.remove(i);
            if fails(&r, &q, 10) { p = q; progress = true; } else { i += 1; }
        }
        if !progress { break; }
    }
    let n = (0..50).filter(|_| r.run(&p).is_err()).count();
    println!("minimal fails {n}/50\n{}", r.run(&p).err().map(|m| m.to_string()).unwrap_or_else(|| format!("{p}")));
}
