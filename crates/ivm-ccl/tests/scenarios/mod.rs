//! Collective scenarios every rank runs, over any communicator: the in-process group
//! (`local_group.rs`, in `cargo test`) and MPI (`mpi_collectives.rs`, under `mpirun`).
//! Each returns what went wrong on this rank.

#![allow(dead_code)] // each test binary uses a subset

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use ivm_ccl::{Collectives, Communicator, DType};
use ivm_device::sim::{SIM, SimAdapter, SimConfig};
use ivm_std::{
    Config, Device, Done, Error, KernelCtx, Mode, Stream, StreamId, Tensor, VirtualMachine,
};

pub type Outcome = Result<(), String>;

/// A scenario: what every rank runs with its communicator.
pub type Scenario = fn(Arc<dyn Communicator>) -> Outcome;

thread_local! {
    /// For a communicator of a sim device: whether the rank's sim has launcher streams,
    /// and the VM's mode ([`on_sim`]).
    static SIM_TARGET: Cell<(bool, Mode)> = const { Cell::new((false, Mode::MultiThread)) };
}

/// Runs `f` (a rank's scenario) with the VM of a sim communicator on a sim whose streams
/// are launcher streams (`launcher`) or queued ones, in `mode`.
pub fn on_sim<T>(launcher: bool, mode: Mode, f: impl FnOnce() -> T) -> T {
    SIM_TARGET.with(|t| t.set((launcher, mode)));
    f()
}

/// A VM and the collectives of `comm` on it (a 30 s timeout: a hang is a failure), and
/// the compute stream of the communicator's device that the scenario works on (the
/// default stream for the cpu; for a sim device, a VM with a sim as [`on_sim`] says, with
/// random latencies).
fn setup(comm: Arc<dyn Communicator>) -> Result<(VirtualMachine, Collectives, Stream), String> {
    let dev = comm.device();
    let vm = if dev.kind == SIM {
        let (launcher, mode) = SIM_TARGET.with(Cell::get);
        let sim = SimAdapter::new(SimConfig {
            launcher,
            ..SimConfig::random(1, 0xcc1 + comm.rank() as u64)
        });
        VirtualMachine::with_adapters(Config::default().with_mode(mode), vec![sim])
    } else {
        VirtualMachine::new(Config::default())
    }
    .map_err(|e| e.to_string())?;
    let s = vm
        .stream(StreamId::compute(dev, 0))
        .map_err(|e| e.to_string())?;
    let ccl = Collectives::new(&vm, comm)
        .map_err(|e| e.to_string())?
        .with_timeout(Duration::from_secs(30));
    Ok((vm, ccl, s))
}

/// A kernel whose body `f` touches its operands' bytes: at once where the body runs in
/// device order (the cpu, a queued sim), enqueued from the worker on a launcher device
/// (`KernelCtx::on_host`).
fn host(
    f: impl FnOnce(&mut KernelCtx<'_>) + Send + 'static,
) -> impl FnOnce(&mut KernelCtx<'_>) + Send + 'static {
    move |k| {
        k.on_host(f)
            .unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e.to_string())))
    }
}

fn read_f32(vm: &VirtualMachine, t: &Tensor, i: usize) -> Result<f32, Error> {
    let mut b = [0u8; 4];
    vm.read_small(t, 4 * i, &mut b)?;
    Ok(f32::from_ne_bytes(b))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Outcome {
    if cond { Ok(()) } else { Err(what()) }
}

/// Two collectives built in one order on every rank, whose operands become ready in
/// opposite orders on even and odd ranks (a slow producer on one of two compute
/// streams): the transport still sees them in build order on every rank — a mismatch
/// would fail the header check (or, without it, sum the wrong tensors).
pub fn order_across_streams(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s0) = setup(comm)?;
    let (rank, size) = (ccl.rank(), ccl.size());
    let s1 = vm
        .stream(StreamId::compute(s0.id().device, 1))
        .map_err(|e| e.to_string())?;
    let e = |e: Error| e.to_string();
    for round in 0..4u32 {
        let a = vm.new_tensor_on(&s0, 64).map_err(e)?;
        let b = vm.new_tensor_on(&s0, 32).map_err(e)?;
        let slow_a = (rank + round as usize).is_multiple_of(2);
        vm.run(|bld| {
            let (va, vb) = (rank as f32 + 1.0, 10.0 * (rank as f32 + 1.0));
            bld.call(
                &s1,
                &[],
                &[&a],
                host(move |k| {
                    if slow_a {
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    k.output(0).copy_from_slice(&f32s(&[va; 16]));
                }),
            )?;
            bld.call(
                &s0,
                &[],
                &[&b],
                host(move |k| {
                    if !slow_a {
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    k.output(0).copy_from_slice(&f32s(&[vb; 8]));
                }),
            )?;
            ccl.all_reduce_sum(bld, &a, DType::F32)?;
            ccl.all_reduce_sum(bld, &b, DType::F32)
        })
        .map_err(e)?;
        let n = size as f32;
        let want_a = n * (n + 1.0) / 2.0;
        let got_a = read_f32(&vm, &a, 15).map_err(e)?;
        let got_b = read_f32(&vm, &b, 7).map_err(e)?;
        check(got_a == want_a && got_b == 10.0 * want_a, || {
            format!(
                "round {round}: a = {got_a} (want {want_a}), b = {got_b} (want {})",
                10.0 * want_a
            )
        })?;
    }
    ccl.global_sync(&vm).map_err(e)
}

/// Compute writes a tensor, the collective reduces it in place, compute reads it, many
/// times over: the engine orders the three on the one tensor.
pub fn racing_compute(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let (rank, size) = (ccl.rank(), ccl.size());
    let e = |e: Error| e.to_string();
    let t = vm.new_tensor_on(&s, 8).map_err(e)?;
    let acc = vm.new_tensor_on(&s, 8).map_err(e)?;
    for i in 0..50i64 {
        vm.run(|b| {
            b.call(
                &s,
                &[],
                &[&t],
                host(move |k| {
                    k.output(0)
                        .copy_from_slice(&(rank as i64 + i).to_ne_bytes());
                }),
            )?;
            ccl.all_reduce_sum(b, &t, DType::I64)?;
            b.call(
                &s,
                &[&t],
                &[&acc],
                host(|k| {
                    let x = i64::from_ne_bytes(k.input(0).try_into().unwrap());
                    let a = i64::from_ne_bytes(k.output(0).try_into().unwrap());
                    k.output(0).copy_from_slice(&(a + x).to_ne_bytes());
                }),
            )
        })
        .map_err(e)?;
    }
    let mut out = [0u8; 8];
    vm.read_small(&acc, 0, &mut out).map_err(e)?;
    let n = size as i64;
    let want: i64 = (0..50).map(|i| n * i + n * (n - 1) / 2).sum();
    check(i64::from_ne_bytes(out) == want, || {
        format!("accumulated {} want {want}", i64::from_ne_bytes(out))
    })?;
    ccl.global_sync(&vm).map_err(e)
}

/// Broadcast and all-gather move the right bytes; a barrier and `global_sync` pass.
pub fn broadcast_and_gather(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let (rank, size) = (ccl.rank(), ccl.size());
    let e = |e: Error| e.to_string();
    let root = size - 1;
    let t = vm.new_tensor_from(&s, &[rank as u8; 16]).map_err(e)?;
    let mine = vm.new_tensor_from(&s, &[rank as u8 + 1; 8]).map_err(e)?;
    let all = vm.new_tensor_on(&s, 8 * size).map_err(e)?;
    vm.run(|b| {
        ccl.broadcast(b, &t, root)?;
        ccl.all_gather(b, &mine, &all)?;
        ccl.barrier(b)
    })
    .map_err(e)?;
    let mut got = [0u8; 16];
    vm.read_small(&t, 0, &mut got).map_err(e)?;
    check(got == [root as u8; 16], || {
        format!("broadcast gave {got:?}")
    })?;
    for r in 0..size {
        let mut g = [0u8; 8];
        vm.read_small(&all, 8 * r, &mut g).map_err(e)?;
        check(g == [r as u8 + 1; 8], || {
            format!("all_gather slot {r}: {g:?}")
        })?;
    }
    ccl.global_sync(&vm).map_err(e)
}

/// A bucket of two tensors of different sizes is summed in one transport call, each in
/// place.
pub fn bucket_all_reduce(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let (rank, size) = (ccl.rank(), ccl.size());
    let e = |e: Error| e.to_string();
    let r = rank as f32;
    let a = vm.new_tensor_from(&s, &f32s(&[r; 6])).map_err(e)?;
    let b = vm
        .new_tensor_from(&s, &f32s(&[10.0 * r + 1.0; 3]))
        .map_err(e)?;
    vm.run(|bld| ccl.all_reduce_sum_bucket(bld, &[&a, &b], DType::F32))
        .map_err(e)?;
    let n = size as f32;
    let ranks = n * (n - 1.0) / 2.0;
    let (ga, gb) = (
        read_f32(&vm, &a, 5).map_err(e)?,
        read_f32(&vm, &b, 2).map_err(e)?,
    );
    check(ga == ranks && gb == 10.0 * ranks + n, || {
        format!(
            "bucket gave a = {ga} (want {ranks}), b = {gb} (want {})",
            10.0 * ranks + n
        )
    })?;
    ccl.global_sync(&vm).map_err(e)
}

/// The last rank's operand is poisoned (its producer panics): every rank's all-reduce
/// fails, naming that rank, and every rank's `global_sync` fails; none hangs.
pub fn poison_fails_every_rank(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let (rank, size) = (ccl.rank(), ccl.size());
    let e = |e: Error| e.to_string();
    let t = vm.new_tensor_on(&s, 16).map_err(e)?;
    let bad = size - 1;
    vm.run(|b| {
        b.custom_named(
            "producer",
            &s,
            &[],
            &[&t],
            move |_k: &mut KernelCtx<'_>, done: Done| {
                let _ = if rank == bad {
                    done.fail(format!("the producer fails on rank {rank}"))
                } else {
                    done.complete()
                };
            },
        )?;
        ccl.all_reduce_sum(b, &t, DType::F32)
    })
    .map_err(e)?;
    let r = read_f32(&vm, &t, 0);
    let msg = match r {
        Err(err) => err.to_string(),
        Ok(v) => {
            return Err(format!(
                "the all-reduce succeeded ({v}) although rank {bad} failed"
            ));
        }
    };
    let want = if rank == bad {
        "producer".to_string()
    } else {
        format!("rank {bad} failed")
    };
    check(msg.contains(&want), || {
        format!("error {msg:?} does not name {want:?}")
    })?;
    match ccl.global_sync(&vm) {
        Err(err) => check(err.to_string().contains("all_reduce_sum"), || {
            format!("global_sync's error does not name the collective: {err}")
        }),
        Ok(()) => Err("global_sync passed although a collective failed".into()),
    }?;
    // The failure was reported once: the next global_sync passes everywhere.
    ccl.global_sync(&vm).map_err(e)
}

/// Rank 0 reduces 16 bytes, the others 32: every rank fails with an error naming both
/// sides, before the transport is touched.
pub fn size_mismatch(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let rank = ccl.rank();
    let e = |e: Error| e.to_string();
    let t = vm
        .new_tensor_on(&s, if rank == 0 { 16 } else { 32 })
        .map_err(e)?;
    vm.run(|b| ccl.all_reduce_sum(b, &t, DType::F32))
        .map_err(e)?;
    match read_f32(&vm, &t, 0) {
        Ok(v) => Err(format!("a mismatched all-reduce succeeded ({v})")),
        Err(err) => {
            let m = err.to_string();
            check(
                m.contains("disagree") && m.contains("16 bytes") && m.contains("32 bytes"),
                || format!("the mismatch error does not name both sides: {m}"),
            )
        }
    }?;
    check(ccl.global_sync(&vm).is_err(), || {
        "global_sync passed after a mismatch".into()
    })?;
    ccl.global_sync(&vm).map_err(e)
}

/// Zero-byte tensors (pure dependences) through every collective: nothing to move, each
/// completes, and work after it runs. Before, the MPI transport cast an empty tensor's
/// dangling, unaligned slice to its element type, and the debug check aborted the rank.
pub fn zero_byte_tensors(comm: Arc<dyn Communicator>) -> Outcome {
    let (vm, ccl, s) = setup(comm)?;
    let size = ccl.size();
    let e = |e: Error| e.to_string();
    let (t, gathered) = (
        vm.new_tensor_on(&s, 0).map_err(e)?,
        vm.new_tensor_on(&s, 0).map_err(e)?,
    );
    let after = vm.new_tensor_from(&s, &[ccl.rank() as u8; 8]).map_err(e)?;
    vm.run(|b| {
        ccl.all_reduce_sum(b, &t, DType::F32)?;
        ccl.all_reduce_sum(b, &t, DType::F64)?;
        ccl.broadcast(b, &t, size - 1)?;
        ccl.all_gather(b, &t, &gathered)?;
        ccl.broadcast(b, &after, size - 1)
    })
    .map_err(e)?;
    let mut got = [0u8; 8];
    vm.read_small(&after, 0, &mut got).map_err(e)?;
    check(got == [size as u8 - 1; 8], || {
        format!("a broadcast after the empty collectives: {got:?}")
    })?;
    ccl.global_sync(&vm).map_err(e)
}

/// A collective on a tensor of a device the transport does not serve is refused when it
/// is built, before anything reaches the transport.
pub fn wrong_device_refused(comm: Arc<dyn Communicator>) -> Outcome {
    let sim = SimAdapter::new(SimConfig::default());
    let vm =
        VirtualMachine::with_adapters(Config::default(), vec![sim]).map_err(|e| e.to_string())?;
    let ccl = Collectives::new(&vm, comm).map_err(|e| e.to_string())?;
    let s = vm
        .stream(StreamId::compute(
            Device {
                kind: SIM,
                index: 0,
            },
            0,
        ))
        .map_err(|e| e.to_string())?;
    let t = vm.new_tensor_on(&s, 8).map_err(|e| e.to_string())?;
    match vm.run(|b| ccl.all_reduce_sum(b, &t, DType::F32)) {
        Err(Error::DeviceMismatch(m)) => check(m.contains("sim:0"), || m),
        r => Err(format!("a collective on sim:0 gave {r:?}")),
    }
}
