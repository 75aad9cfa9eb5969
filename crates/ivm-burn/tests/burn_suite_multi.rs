//! burn's own backend conformance suites (burn-tensor's and burn-autodiff's
//! `testgen_all!`) against burn routed through ivm in the VM's multi-thread mode.
//!
//! The macros emit `#[cfg(feature = "std")]` checked against this crate: ivm-burn's
//! default `std` feature keeps their multi-thread tests.
//!
//! Two compute streams on every machine (the default is one per CPU but one, so one on
//! two CPUs): ops then depend on ops of the other stream, and a dependence the channel
//! drops makes burn's tests fail.
extern crate alloc;

#[allow(unused_imports)]
use alloc::{format, vec, vec::Vec};

pub type TestBackend = ivm_burn::IvmBackend<TwoStreams>;

/// The VM's multi-thread mode with two compute streams.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub struct TwoStreams;

impl ivm_burn::VmMode for TwoStreams {
    const MODE: ivm_std::Mode = ivm_std::Mode::MultiThread;
    const INDEX: u32 = 2;
    const STREAMS: Option<usize> = Some(2);
}
pub type TestTensor<const D: usize> = burn_tensor::Tensor<TestBackend, D>;
pub type TestTensorInt<const D: usize> = burn_tensor::Tensor<TestBackend, D, burn_tensor::Int>;
pub type TestTensorBool<const D: usize> = burn_tensor::Tensor<TestBackend, D, burn_tensor::Bool>;

burn_tensor::testgen_all!();
burn_autodiff::testgen_all!();
