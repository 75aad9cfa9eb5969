//! NCCL on a GPU (feature `cuda`): ignored without one. Run on a GPU machine with
//! `cargo test -p ivm-ccl --features cuda --test nccl -- --ignored` (one rank: MPI starts
//! as a singleton without mpirun), or under `mpirun -np 2` for two ranks on two GPUs.
#![cfg(feature = "cuda")]

use ivm_ccl::nccl::NcclCommunicator;
use ivm_ccl::{Collectives, Communicator, DType};
use ivm_device::cuda::{CUDA, CudaAdapter};
use ivm_std::{Config, Device, StreamId, StreamType, VirtualMachine};

#[test]
#[ignore = "needs a CUDA GPU with libnccl"]
fn all_reduce_and_broadcast_on_cuda_tensors() {
    let (_mpi, boot) = ivm_ccl::mpi::init().unwrap();
    let (rank, size) = (boot.rank(), boot.size());
    let gpu = Device {
        kind: CUDA,
        index: 0,
    };
    let vm = VirtualMachine::with_adapters(Config::default(), vec![CudaAdapter::new().unwrap()])
        .unwrap();
    let comm = NcclCommunicator::new(boot, gpu).unwrap();
    let ccl = Collectives::new(&vm, comm).unwrap();
    let compute = vm.stream(StreamId::compute(gpu, 0)).unwrap();
    let h2d = vm
        .stream(StreamId {
            device: gpu,
            stream_type: StreamType::HostToDevice,
            thread_id: 0,
        })
        .unwrap();
    let x = (rank + 1) as f32;
    let host = vm
        .new_tensor_from(&vm.default_stream(), &[x.to_ne_bytes(); 4].concat())
        .unwrap();
    let t = vm.new_tensor_on(&compute, 16).unwrap();
    vm.run(|b| {
        b.copy(&h2d, &host, &t)?;
        ccl.all_reduce_sum(b, &t, DType::F32)
    })
    .unwrap();
    let mut out = [0u8; 4];
    vm.read_small(&t, 12, &mut out).unwrap();
    let n = size as f32;
    assert_eq!(f32::from_ne_bytes(out), n * (n + 1.0) / 2.0);
    ccl.global_sync(&vm).unwrap();
}
