//! Independent burn operations go to more than one compute stream (each chain follows the
//! stream of its first input; a chain's first op goes round robin), and the results are
//! burn-ndarray's, bit for bit.
//!
//! Two streams whatever the machine (`common::TwoStreams`).

mod common;

use burn_tensor::Tensor;
use common::TwoStreams;
use ivm_burn::{Inner, IvmBackend, IvmChannel, MultiThread, SingleThread, VmMode};

fn chains<B: burn_tensor::backend::Backend>(seed: f32) -> Vec<Vec<f32>> {
    let dev = Default::default();
    (0..4)
        .map(|k| {
            let v: Vec<f32> = (0..64)
                .map(|i| (i as f32 * 0.37 + k as f32 + seed).sin())
                .collect();
            let a: Tensor<B, 2> = Tensor::<B, 1>::from_floats(v.as_slice(), &dev).reshape([8, 8]);
            let y = (a.clone().matmul(a.clone()) + 1.0).exp().sum_dim(1)
                / a.abs().sum_dim(1).sum_dim(0);
            y.into_data().to_vec::<f32>().unwrap()
        })
        .collect()
}

fn spreads_and_agrees<M: VmMode>() {
    let client = burn_router::get_client::<IvmChannel<M>>(&Default::default());
    let before = client.ops_per_stream();
    assert_eq!(before.len(), 2, "two compute streams (TwoStreams)");
    let got = chains::<IvmBackend<M>>(0.5);
    let after = client.ops_per_stream();
    for (s, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(
            a > b,
            "stream {s} ran none of the independent chains: {before:?} -> {after:?}"
        );
    }
    let want = chains::<Inner>(0.5);
    let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        v.iter()
            .map(|c| c.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(
        bits(&got),
        bits(&want),
        "results differ from burn-ndarray's"
    );
}

#[test]
fn independent_ops_use_both_streams_multi_thread() {
    spreads_and_agrees::<TwoStreams<MultiThread>>();
}

#[test]
fn independent_ops_use_both_streams_single_thread() {
    spreads_and_agrees::<TwoStreams<SingleThread>>();
}
