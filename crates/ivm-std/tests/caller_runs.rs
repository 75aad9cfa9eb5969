//! A waiting caller runs the instructions queued to a sleeping worker itself
//! (ARCHITECTURE.md, "Who may drive the engine"): in stream order, never beside the
//! worker, and with nothing left behind. Whether the caller or the worker runs a given
//! instruction is a race; the tests check the outcome either way, and that the caller's
//! path is taken at all (`VmStats::caller_ran`) within many attempts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use ivm_std::{Config, Device, StreamId, VirtualMachine};

/// The default configuration with `IVM_FUSION` (`1` / `0`) applied, if set: CI's fusion
/// lane runs these tests with the other fusion setting than the default.
fn base() -> Config {
    match std::env::var("IVM_FUSION").as_deref() {
        Ok("1") => Config::default().with_fusion(true),
        Ok("0") => Config::default().with_fusion(false),
        _ => Config::default(),
    }
}

/// A VM whose workers go to sleep almost at once when idle.
fn vm() -> VirtualMachine {
    VirtualMachine::new(base().with_worker_poll_window(Duration::from_micros(1))).unwrap()
}

/// Checks, inside each kernel of one stream, that no other kernel of it runs at the same
/// time and that they run in submission order.
#[derive(Default)]
struct Order {
    busy: AtomicBool,
    next: AtomicU64,
    off_worker: AtomicUsize,
}

impl Order {
    fn enter(&self, seq: u64) {
        assert!(
            !self.busy.swap(true, Ordering::AcqRel),
            "two kernels of one stream ran at once"
        );
        assert_eq!(
            self.next.load(Ordering::Acquire),
            seq,
            "out of stream order"
        );
        let on_worker = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("ivm"));
        if !on_worker {
            self.off_worker.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn leave(&self) {
        self.next.fetch_add(1, Ordering::AcqRel);
        self.busy.store(false, Ordering::Release);
    }
}

/// A chain of kernels, then a read of its result, after the worker fell asleep: the
/// reading caller finds them queued and runs them itself (sooner or later), in order.
#[test]
fn a_waiting_reader_runs_the_queued_chain() {
    let vm = vm();
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    let order = Arc::new(Order::default());
    let mut seq = 0u64;
    for round in 0..400u64 {
        std::thread::sleep(Duration::from_micros(300));
        vm.run(|b| {
            for _ in 0..4 {
                let (o, me) = (order.clone(), seq);
                seq += 1;
                b.call(&s, &[], &[&x], move |k| {
                    o.enter(me);
                    k.output_u64(0)[0] = me + 1;
                    o.leave();
                })?;
            }
            Ok(())
        })
        .unwrap();
        let mut out = [0u8; 8];
        vm.read_small(&x, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), seq, "round {round}");
        if round >= 50 && vm.stats().unwrap().caller_ran > 0 {
            break;
        }
    }
    assert!(
        vm.stats().unwrap().caller_ran > 0,
        "the caller never ran queued work"
    );
    assert!(order.off_worker.load(Ordering::Relaxed) > 0);
    vm.sync().unwrap();
}

/// `sync` waits for everything: a caller in `sync` runs what sleeping workers have queued,
/// on several streams, each in its own order.
#[test]
fn sync_runs_queued_work_of_every_stream() {
    let vm = vm();
    let streams: Vec<_> = (0..2)
        .map(|t| vm.stream(StreamId::compute(Device::CPU, t)).unwrap())
        .collect();
    let xs: Vec<_> = (0..2).map(|_| vm.new_tensor(8).unwrap()).collect();
    let orders: Vec<_> = (0..2).map(|_| Arc::new(Order::default())).collect();
    let mut seq = [0u64; 2];
    for _round in 0..300 {
        std::thread::sleep(Duration::from_micros(300));
        vm.run(|b| {
            for k in 0..2 {
                for _ in 0..3 {
                    let (o, me) = (orders[k].clone(), seq[k]);
                    seq[k] += 1;
                    b.call(&streams[k], &[], &[&xs[k]], move |c| {
                        o.enter(me);
                        c.output_u64(0)[0] = me + 1;
                        o.leave();
                    })?;
                }
            }
            Ok(())
        })
        .unwrap();
        vm.sync().unwrap();
        for k in 0..2 {
            assert_eq!(orders[k].next.load(Ordering::Acquire), seq[k]);
        }
        if vm.stats().unwrap().caller_ran > 0 {
            break;
        }
    }
    assert!(vm.stats().unwrap().caller_ran > 0);
}

/// Several callers and the worker race for one stream's queue: every kernel runs once, in
/// order, never two at once, and every read sees its own stream's latest value.
#[test]
fn racing_callers_keep_stream_order() {
    let vm = Arc::new(vm());
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let s = vm.stream(StreamId::compute(Device::CPU, t % 2)).unwrap();
                let x = vm.new_tensor(8).unwrap();
                let order = Arc::new(Order::default());
                let mut seq = 0u64;
                for round in 0..300 {
                    if round % 3 == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    vm.run(|b| {
                        for _ in 0..3 {
                            let (o, me) = (order.clone(), seq);
                            seq += 1;
                            b.call(&s, &[], &[&x], move |k| {
                                o.enter(me);
                                k.output_u64(0)[0] = me + 1;
                                o.leave();
                            })?;
                        }
                        Ok(())
                    })
                    .unwrap();
                    let mut out = [0u8; 8];
                    vm.read_small(&x, 0, &mut out).unwrap();
                    assert_eq!(u64::from_ne_bytes(out), seq);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    vm.sync().unwrap();
}

/// A blocking wait on a completion for one access runs that stream's queued work up to
/// it; `sync_async`'s wait runs any worker's queue.
#[test]
fn completion_waits_run_queued_work() {
    let vm = vm();
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    let order = Arc::new(Order::default());
    let mut seq = 0u64;
    for round in 0..400u64 {
        std::thread::sleep(Duration::from_micros(300));
        vm.run(|b| {
            for _ in 0..3 {
                let (o, me) = (order.clone(), seq);
                seq += 1;
                b.call(&s, &[], &[&x], move |k| {
                    o.enter(me);
                    k.output_u64(0)[0] = me + 1;
                    o.leave();
                })?;
            }
            Ok(())
        })
        .unwrap();
        if round % 2 == 0 {
            let v = vm
                .access_async(&x, |b| u64::from_ne_bytes(b[..8].try_into().unwrap()))
                .wait()
                .unwrap();
            assert_eq!(v, seq, "round {round}");
        } else {
            vm.sync_async().wait().unwrap();
            assert_eq!(order.next.load(Ordering::Acquire), seq, "round {round}");
        }
        if round >= 50 && vm.stats().unwrap().caller_ran > 0 {
            break;
        }
    }
    assert!(vm.stats().unwrap().caller_ran > 0);
}

/// A read that finds its worker asleep is run by its caller, and nobody wakes the worker
/// for it: the push that queued it left the wake to the caller, who ran it (ARCHITECTURE.md,
/// "A wake left to the waiting caller"). Without the deferral every such read woke the
/// worker (a futex wake, 15–20 µs of syscall on a small VM). Each round lets the worker
/// fall asleep first; the bound leaves room for rounds where it had not yet (then it runs
/// the read itself, and nothing needs waking either) or where the caller stopped looking.
#[test]
fn a_read_that_finds_its_worker_asleep_wakes_nobody() {
    let vm = VirtualMachine::new(
        base()
            .with_worker_poll_window(Duration::ZERO)
            .with_inline_sync_access(false),
    )
    .unwrap();
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 7))
        .unwrap();
    vm.sync().unwrap();
    let worker_wakes = |vm: &VirtualMachine| -> usize {
        let st = vm.stats().unwrap();
        st.threads
            .iter()
            .filter(|t| t.name.contains("cpu:0"))
            .map(|t| t.wakes)
            .sum()
    };
    let (wakes0, ran0) = (worker_wakes(&vm), vm.stats().unwrap().caller_ran);
    let rounds = 40;
    for _ in 0..rounds {
        std::thread::sleep(Duration::from_millis(2));
        let mut b = [0u8; 8];
        vm.read_small(&x, 0, &mut b).unwrap();
        assert_eq!(u64::from_ne_bytes(b), 7);
    }
    let (wakes, ran) = (
        worker_wakes(&vm) - wakes0,
        vm.stats().unwrap().caller_ran - ran0,
    );
    assert!(ran > 0, "no read ran on its caller in {rounds} rounds");
    assert!(
        wakes <= rounds / 4,
        "{wakes} worker wakes for {rounds} reads ({ran} run by the caller)"
    );
}
