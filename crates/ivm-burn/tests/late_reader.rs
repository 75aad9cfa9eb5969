//! burn's router counts a tensor's handles with relaxed atomics: a thread can take an
//! op's read of a tensor, drop its own handle, and register the op only after another
//! thread dropped the last handle (and its `Drop` reached the client). The client still
//! serves that read. Here the interleaving is played in one thread, on the client itself.

use std::task::{Context, Poll, Waker};

use burn_ir::{NumericOperationIr, OperationIr, ScalarIr, ScalarOpIr, TensorStatus};
use burn_router::RunnerClient;
use burn_tensor::{DType, Shape, TensorData};
use ivm_burn::{IvmChannel, MultiThread, SingleThread, VmMode};

fn read_after_drop<M: VmMode>() {
    let client = burn_router::get_client::<IvmChannel<M>>(&Default::default());
    let a = client.register_tensor_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]));
    let last = a.clone();
    // The op's view of `a`, taken while another handle exists: a shared read.
    let lhs = a.into_ir();
    assert_eq!(lhs.status, TensorStatus::ReadOnly);
    // The other thread drops the last handle: the client receives `Drop` first.
    drop(last);
    let out = client.register_empty_tensor(Shape::new([3]), DType::F32);
    let mut out_ir = out.clone().into_ir();
    out_ir.status = TensorStatus::NotInit;
    client.register(OperationIr::NumericFloat(
        DType::F32,
        NumericOperationIr::MulScalar(ScalarOpIr {
            lhs,
            rhs: ScalarIr::F32(2.0),
            out: out_ir,
        }),
    ));
    let mut read = client.read_tensor(out.into_ir());
    let Poll::Ready(data) = read.as_mut().poll(&mut Context::from_waker(Waker::noop())) else {
        panic!("the client's read is ready when it returns");
    };
    assert_eq!(data.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0]);
}

#[test]
fn a_read_registered_after_the_drop_multi_thread() {
    read_after_drop::<MultiThread>();
}

#[test]
fn a_read_registered_after_the_drop_single_thread() {
    read_after_drop::<SingleThread>();
}
