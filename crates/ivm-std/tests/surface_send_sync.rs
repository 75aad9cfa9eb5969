//! The thread-safety contract (`ivm_std::contract`), checked at compile time.

use ivm_std::{
    Completion, Config, Dag, Device, Diagnostic, Error, ReadSmallMem, Stream, StreamId, Tensor,
    VirtualMachine, VmStats,
};

fn send_sync<T: Send + Sync>() {}
fn send<T: Send>() {}
fn unpin<T: Unpin>() {}

#[test]
fn public_types_are_send_and_sync() {
    send_sync::<VirtualMachine>();
    send_sync::<Tensor>();
    send_sync::<Stream>();
    send_sync::<StreamId>();
    send_sync::<Device>();
    send_sync::<Config>();
    send_sync::<Error>();
    send_sync::<Diagnostic>();
    send_sync::<VmStats>();
    send_sync::<Dag>();
    send_sync::<ivm_std::InstructionsBuilder<'static>>();
    send_sync::<std::sync::Arc<dyn ivm_std::DeviceAdapter>>();
    send_sync::<std::sync::Arc<dyn ivm_std::DeviceStream>>();
    send_sync::<std::sync::Arc<dyn ivm_std::Event>>();
    send_sync::<std::sync::Arc<dyn ivm_std::DeviceMemory>>();
    send_sync::<std::sync::Arc<dyn ivm_std::DeviceAllocator>>();
}

#[test]
fn completions_are_send_sync_and_unpin() {
    send_sync::<Completion<u64>>();
    send_sync::<Completion<()>>();
    send_sync::<ReadSmallMem<'static>>();
    unpin::<Completion<u64>>();
    unpin::<ReadSmallMem<'static>>();
    // A completion of a `Send` but not `Sync` value is still `Send + Sync`: the value
    // sits behind a mutex until it is taken.
    send_sync::<Completion<std::cell::Cell<u8>>>();
    send::<Completion<std::cell::Cell<u8>>>();
}

/// A VM handle moves to another thread and is used from there.
#[test]
fn vm_moves_and_is_shared_across_threads() {
    let vm = std::sync::Arc::new(VirtualMachine::new(Config::default()).unwrap());
    let x = vm.new_tensor(8).unwrap();
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let (vm, x) = (vm.clone(), x.clone());
            std::thread::spawn(move || {
                vm.write_small(&x, 0, &[i as u8]).unwrap();
                let mut out = [0u8; 1];
                vm.read_small(&x, 0, &mut out).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let moved = std::sync::Arc::try_unwrap(vm).unwrap();
    std::thread::spawn(move || moved.shutdown().unwrap())
        .join()
        .unwrap();
}
