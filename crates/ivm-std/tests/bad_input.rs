//! Sizes no host can provide are `Error::OutOfMemory`, never a panic or an abort: tensors,
//! host memory (ivm-graph's `bad_input` test covers graph blobs).
//!
//! On Linux with overcommit a large zeroed allocation may "succeed" lazily, so the sizes
//! here are beyond what any allocator can hand out: past `isize::MAX` bytes (refused
//! before asking the allocator) or past the address space of the machine (`1 << 50`
//! bytes, a PiB: more than 47-bit user space).

use std::time::Duration;

use ivm_std::{Config, CpuAllocator, DeviceAllocator, Error, HostMemory, Tensor, VirtualMachine};

/// Sizes that must be refused. `1 << 50` only where `usize` has room for it.
fn impossible_sizes() -> Vec<usize> {
    let mut v = vec![usize::MAX, usize::MAX / 2, isize::MAX as usize + 1];
    if usize::BITS >= 64 {
        v.push(1usize << (usize::BITS - 14));
    }
    v
}

fn assert_oom<T: std::fmt::Debug>(what: &str, n: usize, r: ivm_std::Result<T>) {
    match r {
        Err(Error::OutOfMemory { nbytes, .. }) => assert_eq!(nbytes, n, "{what}({n})"),
        other => panic!("{what}({n}): expected OutOfMemory, got {other:?}"),
    }
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> u64 {
    let mut b = [0u8; 8];
    vm.read_small(t, 0, &mut b).unwrap();
    u64::from_ne_bytes(b)
}

#[test]
fn impossible_tensor_sizes_are_out_of_memory_and_the_vm_goes_on() {
    for config in [Config::default(), Config::single_thread()] {
        for caching_allocator in [true, false] {
            let vm = VirtualMachine::new(
                config
                    .clone()
                    .with_caching_allocator(caching_allocator)
                    .with_timeout_period(Duration::from_secs(20)),
            )
            .unwrap();
            for n in impossible_sizes() {
                assert_oom("new_tensor", n, vm.new_tensor(n));
                assert_oom(
                    "new_tensor_on",
                    n,
                    vm.new_tensor_on(&vm.default_stream(), n),
                );
            }
            // Nothing leaked into the VM: it still works.
            let t = vm
                .new_tensor_from(&vm.default_stream(), &7u64.to_ne_bytes())
                .unwrap();
            assert_eq!(read_u64(&vm, &t), 7);
            drop(t);
            vm.shutdown().unwrap();
        }
    }
}

#[test]
fn host_memory_and_the_cpu_allocator_refuse_impossible_sizes() {
    let a = CpuAllocator;
    for n in impossible_sizes() {
        assert_oom("CpuAllocator::allocate", n, a.allocate(n));
        assert_oom("HostMemory::try_zeroed", n, HostMemory::try_zeroed(n));
    }
    let m = HostMemory::try_from_bytes(&[1, 2, 3]).unwrap();
    assert_eq!(ivm_std::DeviceMemory::nbytes(&m), 3);
    assert_eq!(
        ivm_std::DeviceMemory::nbytes(&HostMemory::try_zeroed(0).unwrap()),
        0
    );
}

/// A zero-byte tensor (a pure dependence) and one shorter than a word have no whole
/// `u64`: their word views are empty. Before, an empty tensor's view was cast from a
/// dangling, unaligned pointer, and the debug check aborted the process.
#[test]
fn word_views_of_tensors_without_a_whole_word_are_empty() {
    for config in [Config::default(), Config::single_thread()] {
        let vm = VirtualMachine::new(config.with_timeout_period(Duration::from_secs(20))).unwrap();
        let s = vm.default_stream();
        let (empty, short, word) = (
            vm.new_tensor(0).unwrap(),
            vm.new_tensor(5).unwrap(),
            vm.new_tensor(8).unwrap(),
        );
        vm.run(|b| {
            b.call(&s, &[&empty, &short], &[&word], |k| {
                let n = k.input_u64(0).len() + k.input_u64(1).len();
                k.output_u64(0)[0] = n as u64 + 100;
            })?;
            b.call(&s, &[&word], &[&empty, &short], |k| {
                let n = k.output_u64(0).len() + k.output_u64(1).len();
                assert_eq!(n, 0, "no whole word to write");
                k.output(1).copy_from_slice(&[1, 2, 3, 4, 5]);
            })
        })
        .unwrap();
        assert_eq!(read_u64(&vm, &word), 100);
        let mut b = [0u8; 4];
        vm.read_small(&short, 1, &mut b).unwrap();
        assert_eq!(b, [2, 3, 4, 5], "the second kernel ran");
        vm.shutdown().unwrap();
    }
}
