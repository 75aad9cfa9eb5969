//! burn's tensor backend routed through ivm.
//!
//! [`Ivm`] is burn's [`BackendRouter`](burn_router::BackendRouter) over [`IvmChannel`]:
//! burn does the shape inference and sends every operation as one
//! [`burn_ir::OperationIr`]; the channel's client ([`IvmClient`]) turns each into one ivm
//! instruction (its reads are the op's input tensors, its writes the outputs and every
//! consuming last use) and returns before the kernel runs. The kernels run burn-ndarray's
//! ops, except that a comparison and the mask fill that consumes its mask (burn's ReLU,
//! forward and backward) run as one kernel of the client's with the same results
//! ([`IvmClient::set_fusion`]). `into_data` waits through the VM's sync door,
//! `Backend::sync` is the VM's `sync`. ARCHITECTURE.md ("ivm-burn") says where a tensor's
//! memory lives and why.
//!
//! ```
//! use burn_tensor::Tensor;
//! use ivm_burn::Ivm;
//!
//! let device = Default::default();
//! let a = Tensor::<Ivm, 1>::from_floats([1.0, 2.0, 3.0], &device);
//! let b = (a.clone() * 2.0 + a).sum();
//! assert_eq!(b.into_scalar(), 18.0);
//! ```

#![warn(missing_docs)]

mod client;
mod device;
mod dispatch;
mod fuse;
mod job;

use std::marker::PhantomData;

use burn_ir::TensorIr;
use burn_ndarray::NdArrayTensor;
use burn_router::{MultiBackendBridge, RouterTensor, RunnerChannel};
use burn_tensor::{DType, Shape};

pub use client::IvmClient;
pub use device::{IvmDevice, MultiThread, SingleThread, VmMode};
pub use dispatch::Inner;

/// burn routed through ivm in the VM's multi-thread mode.
pub type Ivm = IvmBackend<MultiThread>;
/// burn routed through ivm in the VM's single-thread mode.
pub type IvmSingle = IvmBackend<SingleThread>;
/// burn routed through ivm in mode `M`.
pub type IvmBackend<M> = burn_router::BackendRouter<IvmChannel<M>>;

/// The [`RunnerChannel`] whose client submits to ivm.
#[derive(Clone, Copy, Default, Debug)]
pub struct IvmChannel<M: VmMode>(PhantomData<M>);

/// The bridge between devices: there is one device per mode, so a tensor never changes
/// backend; its handle is burn-ndarray's.
#[derive(Clone, Copy, Default, Debug)]
pub struct IvmBridge<M: VmMode>(PhantomData<M>);

impl<M: VmMode> MultiBackendBridge for IvmBridge<M> {
    type TensorHandle = NdArrayTensor;
    type Device = IvmDevice<M>;

    fn change_backend_float(t: NdArrayTensor, _: Shape, _: &IvmDevice<M>) -> NdArrayTensor {
        t
    }

    fn change_backend_int(t: NdArrayTensor, _: Shape, _: &IvmDevice<M>) -> NdArrayTensor {
        t
    }

    fn change_backend_bool(t: NdArrayTensor, _: Shape, _: &IvmDevice<M>) -> NdArrayTensor {
        t
    }
}

impl<M: VmMode> RunnerChannel for IvmChannel<M> {
    type Device = IvmDevice<M>;
    type Bridge = IvmBridge<M>;
    type Client = IvmClient<M>;
    type FloatElem = f32;
    type IntElem = i64;
    type BoolElem = bool;

    fn name(_: &Self::Device) -> String {
        format!("ivm<{:?}>", M::MODE)
    }

    fn init_client(_: &Self::Device) -> Self::Client {
        IvmClient::new()
    }

    fn get_tensor_handle(tensor: &TensorIr, client: &Self::Client) -> NdArrayTensor {
        client.handle(tensor)
    }

    fn register_tensor(
        client: &Self::Client,
        handle: NdArrayTensor,
        shape: Shape,
        dtype: DType,
    ) -> RouterTensor<Self::Client> {
        client.adopt(handle, shape, dtype)
    }
}
