//! A kernel that panics inside burn-ndarray poisons what it writes: a later `into_data`
//! of it, or of anything computed from it, panics with the kernel's own message (burn's
//! way to report a failed read), in both VM modes, instead of hanging or returning the
//! bytes the tensor held before.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn_tensor::backend::Backend;
use burn_tensor::{Int, Tensor};
use ivm_burn::{Ivm, IvmSingle};

/// The message of the panic `f` raises.
fn panic_message(f: impl FnOnce()) -> String {
    let e = catch_unwind(AssertUnwindSafe(f)).expect_err("the read should panic");
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn poisoned_reads_name_the_root_cause<B: Backend>() {
    let dev = Default::default();
    let x = Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0], &dev);
    // Index 7 of 3 rows: burn's shape inference accepts it, ndarray's kernel panics.
    let bad = Tensor::<B, 1, Int>::from_ints([7], &dev);
    let picked = x.clone().select(0, bad);
    // Downstream of the failure: never runs, poisoned too.
    let shifted = picked.clone() + 1.0;
    // Writes into `x`'s last handle (ndarray may reuse its buffer in place): the result
    // must not read as `x`'s old values.
    // burn takes one range per dimension: an array of one range is meant.
    #[allow(clippy::single_range_in_vec_init)]
    let assigned = x.slice_assign([0..1], picked.clone());

    for (what, t) in [
        ("picked", picked),
        ("shifted", shifted),
        ("assigned", assigned),
    ] {
        let msg = panic_message(|| {
            t.into_data();
        });
        assert!(
            msg.contains("poisoned") && msg.contains("out of bounds"),
            "{what}: the panic should name the kernel's failure, got {msg:?}"
        );
    }

    // The client still works after the failure.
    let ok = Tensor::<B, 1>::from_floats([1.0, 2.0], &dev) * 3.0;
    assert_eq!(ok.into_data().to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
}

#[test]
fn a_panicking_kernel_poisons_its_outputs_multi_thread() {
    poisoned_reads_name_the_root_cause::<Ivm>();
}

#[test]
fn a_panicking_kernel_poisons_its_outputs_single_thread() {
    poisoned_reads_name_the_root_cause::<IvmSingle>();
}
