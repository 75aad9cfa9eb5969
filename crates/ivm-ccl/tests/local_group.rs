//! The collective scenarios over the in-process group: 2 and 3 ranks as threads, each
//! with a VM of its own. The same scenarios run over MPI in `mpi_collectives.rs`.
//!
//! They run on the cpu, and on a sim device (an asynchronous device with events: the
//! collective stream records an event after each collective for its readers) through
//! [`SimGroup`], on queued streams and on launcher ones (the kernel mode cuda's streams
//! have: the collective is enqueued on the device stream, as NCCL enqueues it), the
//! latter in both VM modes.

mod scenarios;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ivm_ccl::{
    Collectives, Communicator, DType, Dst, HEADER_BYTES, LocalGroup, Src, TransportError,
};
use ivm_device::sim::sim_device;
use ivm_std::{Config, Device, Error, Mode, VirtualMachine};

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

/// The local group as the transport of `sim:0` on every rank: sim memory is host memory,
/// addressed on the device by its host address. The headers go through one group; the
/// data through another, because on a launcher device the data moves later, in a host
/// closure enqueued on the collective's device stream (stream order, as NCCL enqueues
/// it), while the next collective's header may be exchanged at its launch meanwhile. A
/// failure there is the device's error, reported by the stream's next host-observed
/// completion. On a queued device the collective runs in the stream's order and hands
/// host bytes, moved at once.
#[derive(Debug)]
struct SimGroup {
    headers: Arc<dyn Communicator>,
    data: Arc<dyn Communicator>,
}

impl SimGroup {
    fn ranks(size: usize) -> Vec<Arc<dyn Communicator>> {
        LocalGroup::ranks(size)
            .into_iter()
            .zip(LocalGroup::ranks(size))
            .map(|(headers, data)| Arc::new(SimGroup { headers, data }) as Arc<dyn Communicator>)
            .collect()
    }

    /// Runs `f` on the data group over host bytes: at once for host memory, in stream
    /// order for device memory.
    fn enqueue(
        &self,
        buf: Dst<'_>,
        f: impl FnOnce(&dyn Communicator, Dst<'_>) -> Result<(), TransportError> + Send + 'static,
    ) -> Result<(), TransportError> {
        let (ptr, len, stream) = match buf {
            Dst::Host(b) => return f(&*self.data, Dst::Host(b)),
            Dst::Device { ptr, len, stream } => (ptr as usize, len, stream),
        };
        let data = self.data.clone();
        stream
            .launch_host(Box::new(move || {
                // SAFETY: sim memory is host memory whose device address is its host
                // address, `len` bytes long; the VM gives the collective its operands
                // exclusively until its stream has run this closure (stream order), and
                // the memory lives until then (the stream's later frees are ordered after).
                let b = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                if let Err(e) = f(&*data, Dst::Host(b)) {
                    panic!("local group on sim: {e}");
                }
            }))
            .map_err(|e| TransportError::Failed(e.to_string()))
    }
}

impl Communicator for SimGroup {
    fn rank(&self) -> usize {
        self.headers.rank()
    }
    fn size(&self) -> usize {
        self.headers.size()
    }
    fn device(&self) -> Device {
        sim_device(0)
    }
    fn transport(&self) -> &'static str {
        "local-sim"
    }
    fn exchange_headers(
        &self,
        mine: &[u8; HEADER_BYTES],
        deadline: Instant,
    ) -> Result<Vec<[u8; HEADER_BYTES]>, TransportError> {
        self.headers.exchange_headers(mine, deadline)
    }
    fn all_reduce_sum(
        &self,
        buf: Dst<'_>,
        dtype: DType,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.enqueue(buf, move |c, b| c.all_reduce_sum(b, dtype, deadline))
    }
    fn broadcast(
        &self,
        buf: Dst<'_>,
        root: usize,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.enqueue(buf, move |c, b| c.broadcast(b, root, deadline))
    }
    fn all_gather(
        &self,
        send: Src<'_>,
        recv: Dst<'_>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let send = match send {
            Src::Host(b) => b.to_vec(),
            Src::Device { ptr, len, .. } => {
                // The input is read in stream order too: on a launcher device its writer
                // may not have run yet when the collective is launched.
                let (ptr, len) = (ptr as usize, len);
                return self.enqueue(recv, move |c, b| {
                    // SAFETY: as in `enqueue`: sim memory addressed by its host address,
                    // `len` bytes, the collective's input, not written until its stream
                    // has run this closure (stream order: its writer ran before).
                    let send = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
                    c.all_gather(Src::Host(send), b, deadline)
                });
            }
        };
        self.enqueue(recv, move |c, b| {
            c.all_gather(Src::Host(&send), b, deadline)
        })
    }
}

/// Runs `f` on every rank of a fresh sim group of `size`, each on its own thread, with a
/// sim of launcher streams (`launcher`) or queued ones, its VM in `mode`.
fn on_sim_ranks(size: usize, launcher: bool, mode: Mode, f: Scenario) {
    let handles: Vec<_> = SimGroup::ranks(size)
        .into_iter()
        .map(|c| thread::spawn(move || scenarios::on_sim(launcher, mode, || f(c))))
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        if let Err(m) = h.join().expect("a rank panicked") {
            panic!("rank {rank} of {size} (launcher: {launcher}, {mode:?}): {m}");
        }
    }
}

/// The scenarios on a sim device (buckets are host tensors only; the refused device is
/// the cpu's test).
fn sim_scenarios(launcher: bool, mode: Mode) {
    for size in [2, 3] {
        on_sim_ranks(size, launcher, mode, scenarios::order_across_streams);
        on_sim_ranks(size, launcher, mode, scenarios::poison_fails_every_rank);
    }
    on_sim_ranks(2, launcher, mode, scenarios::racing_compute);
    on_sim_ranks(3, launcher, mode, scenarios::broadcast_and_gather);
    on_sim_ranks(2, launcher, mode, scenarios::size_mismatch);
    on_sim_ranks(2, launcher, mode, scenarios::zero_byte_tensors);
}

#[test]
fn the_scenarios_on_a_queued_sim_device() {
    sim_scenarios(false, Mode::MultiThread);
}

#[test]
fn the_scenarios_on_a_launcher_sim_device() {
    sim_scenarios(true, Mode::MultiThread);
}

#[test]
fn the_scenarios_on_a_launcher_sim_device_single_thread() {
    sim_scenarios(true, Mode::SingleThread);
}

#[test]
fn collectives_reach_the_transport_in_build_order() {
    on_ranks(2, scenarios::order_across_streams);
    on_ranks(3, scenarios::order_across_streams);
}

#[test]
fn zero_byte_tensors_through_every_collective() {
    on_ranks(2, scenarios::zero_byte_tensors);
    on_ranks(3, scenarios::zero_byte_tensors);
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
