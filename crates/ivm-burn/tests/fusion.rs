//! burn's router sends ReLU as a comparison then a mask fill, and its backward pass the
//! same way; the client runs each such pair as one kernel. The results are burn-ndarray's
//! bit for bit (NaN and signed zeros included), and a comparison that is not followed by
//! its fill (read, kept, or used by another op) still runs as itself.

mod common;

use burn_autodiff::Autodiff;
use burn_tensor::activation::relu;
use burn_tensor::backend::Backend;
use burn_tensor::{Bool, Tensor, TensorData};
use common::TwoStreams;
use ivm_burn::{Inner, IvmBackend, IvmChannel, MultiThread, SingleThread, VmMode};

fn values(n: usize, salt: f32) -> Vec<f32> {
    let edges = [f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY];
    (0..n)
        .map(|i| match i % 11 {
            k if k < edges.len() && salt > 1.0 => edges[k],
            _ => ((i as f32) * 0.37 + salt).sin(),
        })
        .collect()
}

fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    let v = t.into_data().to_vec::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// A layer with ReLU, forward and backward: the output and both gradients, as bits.
fn layer<B: Backend>() -> Vec<Vec<u32>> {
    type A<B> = Autodiff<B>;
    let dev = Default::default();
    let x = Tensor::<A<B>, 2>::from_data(TensorData::new(values(8 * 16, 2.5), [8, 16]), &dev)
        .require_grad();
    let w = Tensor::<A<B>, 2>::from_data(TensorData::new(values(16 * 4, 0.25), [16, 4]), &dev)
        .require_grad();
    // The transposed matmul gives ReLU an input in another memory order.
    let h = relu(x.clone().matmul(w.clone()));
    let y = relu(h.clone().transpose()).sum();
    let grads = y.backward();
    let gx = x.grad(&grads).unwrap();
    let gw = w.grad(&grads).unwrap();
    vec![bits(h.inner()), bits(gx), bits(gw)]
}

/// A comparison whose mask is read, kept for a second fill, or turned into ints.
fn unfused<B: Backend>() -> Vec<Vec<u32>> {
    let dev = Default::default();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values(6 * 5, 3.0), [6, 5]), &dev);
    let mask: Tensor<B, 2, Bool> = x.clone().lower_equal_elem(0.1);
    let read: Vec<u32> = mask
        .clone()
        .into_data()
        .to_vec::<bool>()
        .unwrap()
        .into_iter()
        .map(u32::from)
        .collect();
    let a = x.clone().mask_fill(mask.clone(), 7.0);
    let b = (x.clone() * 2.0).mask_fill(mask.clone(), -1.0);
    let ints = mask.int().float();
    // A comparison whose mask burn drops unread, then another op.
    drop(x.clone().lower_equal_elem(0.0));
    let c = x.exp();
    vec![read, bits(a), bits(b), bits(ints), bits(c)]
}

fn fuses_and_agrees<M: VmMode>() {
    let client = burn_router::get_client::<IvmChannel<M>>(&Default::default());
    let before = client.fused_pairs();
    let got = layer::<IvmBackend<M>>();
    let fused = client.fused_pairs() - before;
    assert_eq!(
        got,
        layer::<Inner>(),
        "ReLU through ivm differs from burn-ndarray"
    );
    // Two ReLUs forward and two backward, unless the fusion is off.
    let on = std::env::var("IVM_BURN_FUSE").map_or(true, |v| v.trim() != "0");
    assert_eq!(fused, if on { 4 } else { 0 }, "pairs run as one kernel");

    let before = client.fused_pairs();
    assert_eq!(unfused::<IvmBackend<M>>(), unfused::<Inner>());
    assert_eq!(
        client.fused_pairs(),
        before,
        "no mask there is consumed by its fill"
    );
}

#[test]
fn relu_runs_as_one_kernel_multi_thread() {
    fuses_and_agrees::<TwoStreams<MultiThread>>();
}

#[test]
fn relu_runs_as_one_kernel_single_thread() {
    fuses_and_agrees::<TwoStreams<SingleThread>>();
}
