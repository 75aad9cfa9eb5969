//! burn's router sends ReLU as a comparison then a mask fill, and its backward pass the
//! same way; the client runs each such pair as one kernel. The results are the pair's on
//! burn-ndarray bit for bit (NaN and signed zeros included, and the output's memory layout,
//! which a later sum's rounding follows), and a comparison that is not followed by its
//! fill (read, kept, or used by another op) still runs as itself.
//!
//! burn-ndarray's own ReLU is not the pair: it keeps -0.0 and a view's layout, so the
//! references below spell the pair out where that shows.

mod common;

use burn_autodiff::Autodiff;
use burn_tensor::activation::relu;
use burn_tensor::backend::Backend;
use burn_tensor::{Bool, Tensor, TensorData};
use common::TwoStreams;
use ivm_burn::{Inner, IvmBackend, IvmChannel, MultiThread, SingleThread, VmMode};

/// Finite values of both signs, or with `edges` also NaN, both zeros and both infinities.
fn values(n: usize, salt: f32, edges: bool) -> Vec<f32> {
    let special = [f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY];
    (0..n)
        .map(|i| match i % 11 {
            k if edges && k < special.len() => special[k],
            _ => ((i as f32) * 0.37 + salt).sin(),
        })
        .collect()
}

fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    let v = t.into_data().to_vec::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// ReLU as burn's router sends it: `relu` through ivm, the pair spelled out on
/// burn-ndarray.
fn pair_relu<B: Backend, const D: usize>(x: Tensor<B, D>, spelled: bool) -> Tensor<B, D> {
    if spelled {
        let mask = x.clone().lower_equal_elem(0.0);
        x.mask_fill(mask, 0.0)
    } else {
        relu(x)
    }
}

/// Two layers with ReLU, forward and backward, and a ReLU of the edge values: the outputs
/// and the gradients, as bits.
fn layer<B: Backend>(spelled: bool) -> Vec<Vec<u32>> {
    type A<B> = Autodiff<B>;
    let dev = Default::default();
    // Row 3 of `x` is zeros: its ReLU inputs are exactly 0, where `<=` and `<` part.
    let xv: Vec<f32> = values(8 * 16, 0.5, false)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i / 16 == 3 { 0.0 } else { v })
        .collect();
    let x = Tensor::<A<B>, 2>::from_data(TensorData::new(xv, [8, 16]), &dev).require_grad();
    let w =
        Tensor::<A<B>, 2>::from_data(TensorData::new(values(16 * 4, 0.25, false), [16, 4]), &dev)
            .require_grad();
    let u = Tensor::<A<B>, 2>::from_data(TensorData::new(values(8 * 3, 1.5, false), [8, 3]), &dev);
    // The second ReLU's input comes from a transposed operand; its gradient reaches the
    // first ReLU's backward pass through a matmul, so each pass's mask matters.
    let h = relu(x.clone().matmul(w.clone()));
    let y = relu(h.clone().transpose().matmul(u)).sum();
    let grads = y.backward();
    let gx = x.grad(&grads).unwrap();
    let gw = w.grad(&grads).unwrap();
    let edges = Tensor::<B, 1>::from_data(TensorData::new(values(44, 0.1, true), [44]), &dev);
    vec![
        bits(h.inner()),
        bits(gx),
        bits(gw),
        bits(pair_relu(edges, spelled)),
    ]
}

/// A comparison whose mask is read, kept for a second fill, or turned into ints.
fn unfused<B: Backend>() -> Vec<Vec<u32>> {
    let dev = Default::default();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values(6 * 5, 3.0, true), [6, 5]), &dev);
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
    let got = layer::<IvmBackend<M>>(false);
    let fused = client.fused_pairs() - before;
    let want = layer::<Inner>(true);
    assert_eq!(got, want, "ReLU through ivm differs from burn-ndarray");
    // Not degenerate: each ReLU output has zeros and positive values.
    for out in [&want[0], &want[3]] {
        let v: Vec<f32> = out.iter().map(|b| f32::from_bits(*b)).collect();
        assert!(v.contains(&0.0) && v.iter().any(|x| *x > 0.0), "{v:?}");
    }
    // Three ReLUs forward and two backward, unless the fusion is off.
    let on = std::env::var("IVM_BURN_FUSE").map_or(true, |v| v.trim() != "0");
    assert_eq!(fused, if on { 5 } else { 0 }, "pairs run as one kernel");

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

/// ReLU of a view with gaps, then a sum, which walks its input by memory layout: the fused
/// kernel's output must have the pair's layout, or the sum rounds differently.
fn sliced_relu_sum<B: Backend>(salt: f32, spelled: bool) -> Vec<Vec<u32>> {
    let dev = Default::default();
    let v: Vec<f32> = values(8 * 32, salt, false)
        .iter()
        .enumerate()
        .map(|(i, x)| x * (1 << (i % 12)) as f32)
        .collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(v, [8, 32]), &dev);
    let y = pair_relu(x.slice([0..8, 0..13]), spelled);
    vec![bits(y.clone().sum()), bits(y)]
}

/// Mode `M` on a client of its own (two streams): the test that switches the fusion off
/// and on must not do it under another test's feet.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
struct Switched<M>(std::marker::PhantomData<M>);

impl<M: VmMode> VmMode for Switched<M> {
    const MODE: ivm_std::Mode = M::MODE;
    // Beside `M`'s own devices and `TwoStreams<M>`'s in burn's registry.
    const INDEX: u32 = M::INDEX + 4;
    const STREAMS: Option<usize> = Some(2);
}

fn fused_and_unfused_agree_downstream<M: VmMode>() {
    let client = burn_router::get_client::<IvmChannel<M>>(&Default::default());
    let was = client.fusion();
    for k in 0..20 {
        let salt = k as f32 * 0.61;
        client.set_fusion(true);
        let before = client.fused_pairs();
        let fused = sliced_relu_sum::<IvmBackend<M>>(salt, false);
        assert_eq!(client.fused_pairs() - before, 1);
        client.set_fusion(false);
        let unfused = sliced_relu_sum::<IvmBackend<M>>(salt, false);
        assert_eq!(fused, unfused, "salt {salt}");
        assert_eq!(fused, sliced_relu_sum::<Inner>(salt, true), "salt {salt}");
    }
    client.set_fusion(was);
}

#[test]
fn a_fused_relu_keeps_the_pairs_layout_multi_thread() {
    fused_and_unfused_agree_downstream::<Switched<MultiThread>>();
}

#[test]
fn a_fused_relu_keeps_the_pairs_layout_single_thread() {
    fused_and_unfused_agree_downstream::<Switched<SingleThread>>();
}

/// A comparison held back while enough `Drop`s arrive to flush the client (its input's
/// among them): the flush registers the comparison before it forgets the input.
fn held_across_a_flush<M: VmMode>() {
    let dev = Default::default();
    let x = Tensor::<IvmBackend<M>, 1>::from_floats([-1.0, 0.0, 2.0], &dev);
    let many: Vec<_> = (0..100)
        .map(|i| Tensor::<IvmBackend<M>, 1>::from_floats([i as f32], &dev))
        .collect();
    let mask = x.clone().lower_equal_elem(0.0);
    drop(x);
    drop(many);
    assert_eq!(
        mask.int().into_data().to_vec::<i64>().unwrap(),
        vec![1, 1, 0]
    );
}

#[test]
fn a_held_comparison_survives_a_flush_multi_thread() {
    held_across_a_flush::<TwoStreams<MultiThread>>();
}

#[test]
fn a_held_comparison_survives_a_flush_single_thread() {
    held_across_a_flush::<TwoStreams<SingleThread>>();
}
