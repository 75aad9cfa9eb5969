//! A short training loop mixing eager kernels, lazy graph launches and a sync read of the
//! loss each step: fit `y = w·x + b` by gradient descent.
//!
//! * eager kernels make each step's batch (`x`, `t = 3x + 1` plus noise);
//! * the lazy graph `train_step` computes predictions and the loss, outputs the loss as
//!   soon as it is known, and updates its parameters `w`, `b` in place;
//! * an eager kernel keeps a running average of the loss;
//! * the host reads the loss with `read_small` every step.
//!
//! ```text
//! cargo run --release -p ivm-graph --example lazy_training
//! ```

use ivm_graph::GraphBuilder;
use ivm_std::{Config, Tensor, VirtualMachine};

const BATCH: usize = 8;

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn put(b: &mut [u8], v: &[f32]) {
    for (c, x) in b.chunks_exact_mut(4).zip(v) {
        c.copy_from_slice(&x.to_ne_bytes());
    }
}

fn main() -> ivm_std::Result<()> {
    let mut g = GraphBuilder::new("train_step");
    let x = g.input("x", 4 * BATCH);
    let t = g.input("t", 4 * BATCH);
    let w = g.param("w", 4);
    let b = g.param("b", 4);
    let err = g.blob("err", 4 * BATCH);
    let loss = g.blob("loss", 4);
    // Forward: err = w·x + b − t.
    g.param_kernel("forward", &[x, t], &[err], move |k| {
        let (wv, bv) = (f32s(k.param(w))[0], f32s(k.param(b))[0]);
        let (xs, ts) = (f32s(k.input(0)), f32s(k.input(1)));
        let e: Vec<f32> = xs.iter().zip(&ts).map(|(x, t)| wv * x + bv - t).collect();
        put(k.output(0), &e);
    });
    // Loss: mean squared error (output as soon as it is computed).
    g.kernel("loss", &[err], &[loss], |k| {
        let e = f32s(k.input(0));
        let l = e.iter().map(|e| e * e).sum::<f32>() / e.len() as f32;
        put(k.output(0), &[l]);
    });
    // Backward + SGD step on the parameters, in place.
    g.param_kernel("sgd", &[x, err], &[], move |k| {
        let (xs, es) = (f32s(k.input(0)), f32s(k.input(1)));
        let n = xs.len() as f32;
        let gw = xs.iter().zip(&es).map(|(x, e)| 2.0 * x * e).sum::<f32>() / n;
        let gb = es.iter().map(|e| 2.0 * e).sum::<f32>() / n;
        let lr = 0.15;
        let wv = f32s(k.param(w))[0] - lr * gw;
        let bv = f32s(k.param(b))[0] - lr * gb;
        put(k.param_mut(w), &[wv]);
        put(k.param_mut(b), &[bv]);
    });
    g.output("loss", loss);
    let graph = g.build()?;

    let vm = VirtualMachine::new(Config::default())?;
    let s = vm.default_stream();
    let new = |n: usize| -> ivm_std::Result<Tensor> { vm.new_tensor(n) };
    let (xt, tt, wt, bt, lt, avg) = (
        new(4 * BATCH)?,
        new(4 * BATCH)?,
        new(4)?,
        new(4)?,
        new(4)?,
        new(4)?,
    );
    for step in 0..60u32 {
        vm.run(|bl| {
            // Eager: this step's batch.
            bl.call_named("make_batch", &s, &[], &[&xt, &tt], move |k| {
                let xs: Vec<f32> = (0..BATCH)
                    .map(|i| ((step as usize * 7 + i * 13) % 17) as f32 / 8.0 - 1.0)
                    .collect();
                let noise = |i: usize| ((step as usize + i) % 3) as f32 * 0.01;
                let ts: Vec<f32> = xs
                    .iter()
                    .enumerate()
                    .map(|(i, x)| 3.0 * x + 1.0 + noise(i))
                    .collect();
                put(k.output(0), &xs);
                put(k.output(1), &ts);
            })?;
            // Lazy: one training step.
            bl.launch_lazy_job(&[&xt, &tt], &[&lt], &[&wt, &bt], graph.lazy())?;
            // Eager: running average of the loss (waits for the loss only).
            bl.call_named("average", &s, &[&lt], &[&avg], |k| {
                let l = f32s(k.input(0))[0];
                let a = f32s(k.output(0))[0];
                put(k.output(0), &[0.9 * a + 0.1 * l]);
            })
        })?;
        let mut buf = [0u8; 4];
        vm.read_small(&lt, 0, &mut buf)?;
        if step % 10 == 0 || step == 59 {
            println!("step {step:2}: loss {:.5}", f32::from_ne_bytes(buf));
        }
    }
    let mut buf = [0u8; 4];
    vm.read_small(&wt, 0, &mut buf)?;
    let wv = f32::from_ne_bytes(buf);
    vm.read_small(&bt, 0, &mut buf)?;
    let bv = f32::from_ne_bytes(buf);
    vm.read_small(&avg, 0, &mut buf)?;
    println!(
        "fitted w = {wv:.3}, b = {bv:.3} (true 3, 1); running loss {:.5}",
        f32::from_ne_bytes(buf)
    );
    assert!(
        (wv - 3.0).abs() < 0.1 && (bv - 1.0).abs() < 0.1,
        "did not converge"
    );
    Ok(())
}
