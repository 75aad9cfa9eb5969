//! burn's own backend conformance suites (burn-tensor's and burn-autodiff's
//! `testgen_all!`) against burn routed through ivm in the VM's multi-thread mode.
//!
//! The macros emit `#[cfg(feature = "std")]` checked against this crate: ivm-burn's
//! default `std` feature keeps their multi-thread tests.
//!
//! Two compute streams on every machine (`common::TwoStreams`).
extern crate alloc;

#[allow(unused_imports)]
use alloc::{format, vec, vec::Vec};

mod common;

pub type TestBackend = ivm_burn::IvmBackend<common::TwoStreams<ivm_burn::MultiThread>>;
pub type TestTensor<const D: usize> = burn_tensor::Tensor<TestBackend, D>;
pub type TestTensorInt<const D: usize> = burn_tensor::Tensor<TestBackend, D, burn_tensor::Int>;
pub type TestTensorBool<const D: usize> = burn_tensor::Tensor<TestBackend, D, burn_tensor::Bool>;

burn_tensor::testgen_all!();
burn_autodiff::testgen_all!();
