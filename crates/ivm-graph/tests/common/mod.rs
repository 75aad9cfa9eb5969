//! Helpers the integration tests of ivm-graph share (each test binary uses some of them).
#![allow(dead_code)]

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Error, Tensor, VirtualMachine};

/// The first 8 bytes of `t`, read through the VM.
pub fn read_u64(vm: &VirtualMachine, t: &Tensor) -> Result<u64, Error> {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

/// A cpu tensor holding `v`.
pub fn tensor(vm: &VirtualMachine, v: u64) -> Tensor {
    vm.new_tensor_from(&vm.default_stream(), &v.to_ne_bytes())
        .unwrap()
}

/// y = x * w + b; w += x (a parameter update each run).
pub fn affine() -> Graph {
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
