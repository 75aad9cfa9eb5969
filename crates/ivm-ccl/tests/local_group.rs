//! The collective scenarios over the in-process group: 2 and 3 ranks as threads, each
//! with a VM of its own. The same scenarios run over MPI in `mpi_collectives.rs`.

mod scenarios;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ivm_ccl::{Collectives, DType, LocalGroup};
use ivm_std::{Config, Error, VirtualMachine};

use scenarios::Scenario;

/// Runs `f` on every rank of a fresh group of `size`, each on its own thread.
fn on_ranks(size: usize, f: Scenario) {
    let handles: Vec<_> = LocalGroup::ranks(size)
        .into_iter()
        .map(|c| thread::spawn(move || f(c)))
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        if let Err(m) = h.join().expect("a rank panicked") {
            panic!("rank {rank} of {size}: {m}");
        }
    }
}

#[test]
fn collectives_reach_the_transport_in_build_order() {
    on_ranks(2, scenarios::order_across_streams);
    on_ranks(3, scenarios::order_across_streams);
}

#[test]
fn a_collective_racing_compute_on_its_tensor() {
    on_ranks(2, scenarios::racing_compute);
}

#[test]
fn broadcast_all_gather_and_barrier() {
    on_ranks(3, scenarios::broadcast_and_gather);
}

#[test]
fn a_bucket_is_summed_in_one_call() {
    on_ranks(2, scenarios::bucket_all_reduce);
    on_ranks(3, scenarios::bucket_all_reduce);
}

#[test]
fn a_poisoned_operand_fails_the_collective_on_every_rank() {
    on_ranks(2, scenarios::poison_fails_every_rank);
    on_ranks(3, scenarios::poison_fails_every_rank);
}

#[test]
fn ranks_that_disagree_on_a_size_fail_naming_both_sides() {
    on_ranks(2, scenarios::size_mismatch);
}

#[test]
fn a_tensor_of_a_device_the_transport_does_not_serve_is_refused() {
    on_ranks(1, scenarios::wrong_device_refused);
}

/// Rank 1 never arrives: rank 0's collective fails within its timeout with an error
/// naming the collective and the rank count, its tensor is poisoned with it, its
/// `global_sync` fails too (the group is unusable), and nothing hangs.
#[test]
fn a_peer_that_never_arrives_is_a_timeout_error_not_a_hang() {
    let mut comms = LocalGroup::ranks(2);
    let _absent = comms.pop();
    let comm = comms.pop().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let ccl = Collectives::new(&vm, comm)
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let t = vm.new_tensor(8).unwrap();
    let start = Instant::now();
    vm.run(|b| ccl.broadcast(b, &t, 0)).unwrap();
    let mut out = [0u8; 8];
    let err = vm.read_small(&t, 0, &mut out).unwrap_err().to_string();
    assert!(
        err.contains("broadcast") && err.contains("over 2 ranks") && err.contains("did not")
            || err.contains("not every rank arrived"),
        "{err}"
    );
    assert!(err.contains("over 2 ranks"), "{err}");
    assert!(matches!(ccl.global_sync(&vm), Err(Error::Collective(_))));
    // Bounded by the timeout, not by a test runner's patience (a loose bound: no timing
    // is asserted beyond "it returned").
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// The collective stream dispatches in build order even within one rank: a later
/// collective whose operand is ready first still waits for the earlier one.
#[test]
fn one_rank_keeps_build_order() {
    let comm = LocalGroup::ranks(1).pop().unwrap();
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let ccl = Collectives::new(&vm, comm).unwrap();
    let s = vm.default_stream();
    let slow = vm.new_tensor(8).unwrap();
    let fast = vm.new_tensor(8).unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (o1, o2) = (order.clone(), order.clone());
    vm.run(|b| {
        b.call(&s, &[], &[&slow], |_| {
            thread::sleep(Duration::from_millis(50))
        })?;
        ccl.all_reduce_sum(b, &slow, DType::I64)?;
        ccl.all_reduce_sum(b, &fast, DType::I64)?;
        // Readers record when each collective's result became readable.
        b.call(&ccl.stream().clone(), &[&slow], &[], move |_| {
            o1.lock().unwrap().push("slow")
        })?;
        b.call(&ccl.stream().clone(), &[&fast], &[], move |_| {
            o2.lock().unwrap().push("fast")
        })
    })
    .unwrap();
    vm.sync().unwrap();
    assert_eq!(*order.lock().unwrap(), ["slow", "fast"]);
}
