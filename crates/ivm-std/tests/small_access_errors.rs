//! The errors the small accesses document, through every door (blocking, `_timeout`,
//! `_async`; read and write) in both modes: `UnsupportedSize` for a length other than
//! 1, 2, 4, 8 or 16 bytes, `OutOfBounds` (with the request and the tensor's size) for a
//! range outside the tensor, and the VM serving as before afterwards.

use std::time::Duration;

use ivm_std::{Config, Error, Result, Tensor, VirtualMachine};

const SIZE: usize = 32;

/// Every door's result for a `len`-byte access of `t` at `offset`.
fn every_door(
    vm: &VirtualMachine,
    t: &Tensor,
    offset: usize,
    len: usize,
) -> Vec<(&'static str, Result<()>)> {
    let long = Duration::from_secs(30);
    let data = vec![5u8; len];
    let mut out = vec![0u8; len];
    vec![
        ("read_small", vm.read_small(t, offset, &mut out)),
        ("write_small", vm.write_small(t, offset, &data)),
        (
            "read_small_timeout",
            vm.read_small_timeout(t, offset, &mut out, long),
        ),
        (
            "write_small_timeout",
            vm.write_small_timeout(t, offset, &data, long),
        ),
        (
            "read_small_async",
            vm.read_small_async(t, offset, &mut out).wait_timeout(long),
        ),
        (
            "write_small_async",
            vm.write_small_async(t, offset, &data).wait_timeout(long),
        ),
    ]
}

#[test]
fn bad_lengths_and_ranges_give_the_documented_errors_through_every_door() {
    for config in [Config::default(), Config::single_thread()] {
        let vm = VirtualMachine::new(config).unwrap();
        let t = vm.new_tensor(SIZE).unwrap();
        for len in [0, 3, 5, 12, 17, 32] {
            for (door, r) in every_door(&vm, &t, 0, len) {
                assert!(
                    matches!(r, Err(Error::UnsupportedSize(n)) if n == len),
                    "{door} of {len} bytes: {r:?}"
                );
            }
        }
        for (offset, len) in [(SIZE - 3, 4), (SIZE, 1), (SIZE + 8, 8), (usize::MAX, 16)] {
            for (door, r) in every_door(&vm, &t, offset, len) {
                assert!(
                    matches!(
                        r,
                        Err(Error::OutOfBounds { len: l, offset: o, size: SIZE })
                            if l == len && o == offset
                    ),
                    "{door} of {len} bytes at {offset}: {r:?}"
                );
            }
        }
        // Refused before reaching the VM: it serves every door as before, up to the
        // tensor's last byte.
        for (door, r) in every_door(&vm, &t, SIZE - 16, 16) {
            r.unwrap_or_else(|e| panic!("{door}: {e}"));
        }
        let mut out = [0u8; 16];
        vm.read_small(&t, SIZE - 16, &mut out).unwrap();
        assert_eq!(out, [5u8; 16]);
        drop(t);
        vm.shutdown().unwrap();
    }
}
