//! The collective scenarios over MPI. Run under mpirun (`.ci/mpi.sh` does):
//!
//! ```text
//! cargo build -p ivm-ccl --features mpi --tests
//! mpirun -np 2 --oversubscribe target/debug/deps/mpi_collectives-<hash> [scenario]
//! ```
//!
//! Every rank runs every scenario (or the one named) in the same order and prints one
//! line per scenario; the process exits non-zero if any failed on this rank.

mod scenarios;

use std::sync::Arc;
use std::time::Duration;

use ivm_ccl::{Collectives, Communicator, HEADER_BYTES};
use ivm_std::{Config, VirtualMachine};

use scenarios::{Outcome, Scenario};

/// Rank 0 broadcasts with a short timeout; rank 1 arrives only after it: rank 0's
/// collective fails naming the collective and the rank count, never hangs. Rank 1 then
/// completes the header exchange rank 0 abandoned, so that MPI finalises cleanly.
/// Runs last: it leaves the communicator unusable on rank 0.
fn late_peer(comm: Arc<dyn Communicator>) -> Outcome {
    let (rank, size) = (comm.rank(), comm.size());
    if rank == 0 {
        let vm = VirtualMachine::new(Config::default()).map_err(|e| e.to_string())?;
        let ccl = Collectives::new(&vm, comm)
            .map_err(|e| e.to_string())?
            .with_timeout(Duration::from_millis(300));
        let t = vm.new_tensor(8).map_err(|e| e.to_string())?;
        vm.run(|b| ccl.broadcast(b, &t, 0))
            .map_err(|e| e.to_string())?;
        let mut out = [0u8; 8];
        match vm.read_small(&t, 0, &mut out) {
            Ok(()) => Err("the broadcast succeeded without its peers".into()),
            Err(e) => {
                let m = e.to_string();
                let want = format!("broadcast(root 0) of 8 bytes of U8 over {size} ranks");
                if m.contains(&want) && m.contains("not every rank arrived") {
                    Ok(())
                } else {
                    Err(format!("the timeout error does not say {want:?}: {m}"))
                }
            }
        }
    } else {
        std::thread::sleep(Duration::from_secs(2));
        comm.exchange_headers(
            &[0u8; HEADER_BYTES],
            std::time::Instant::now() + Duration::from_secs(30),
        )
        .map(drop)
        .map_err(|e| format!("completing rank 0's abandoned exchange: {e}"))
    }
}

fn main() {
    let (universe, comm) = ivm_ccl::mpi::init().expect("MPI initialises");
    let (rank, size) = (comm.rank(), comm.size());
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let all: [(&str, Scenario); 9] = [
        ("order_across_streams", scenarios::order_across_streams),
        ("racing_compute", scenarios::racing_compute),
        ("broadcast_and_gather", scenarios::broadcast_and_gather),
        ("bucket_all_reduce", scenarios::bucket_all_reduce),
        (
            "poison_fails_every_rank",
            scenarios::poison_fails_every_rank,
        ),
        ("size_mismatch", scenarios::size_mismatch),
        ("wrong_device_refused", scenarios::wrong_device_refused),
        ("zero_byte_tensors", scenarios::zero_byte_tensors),
        ("late_peer", late_peer),
    ];
    let mut failed = 0;
    for (name, f) in all {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        match f(comm.clone()) {
            Ok(()) => println!("rank {rank}/{size}: {name} ... ok"),
            Err(m) => {
                failed += 1;
                println!("rank {rank}/{size}: {name} ... FAILED: {m}");
            }
        }
    }
    drop(comm);
    drop(universe);
    std::process::exit(i32::from(failed > 0));
}
