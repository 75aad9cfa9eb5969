//! Async completions: awaited under tokio's current-thread runtime and under a minimal
//! hand-written executor.
#![cfg(not(loom))] // tokio is not a dev-dependency under loom (see Cargo.toml)

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use ivm_std::{Config, Error, Tensor, VirtualMachine};

/// The smallest executor: parks the thread until the waker unparks it.
struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        // A lost wake-up would hang here; the timeout catches it as a failure.
        std::thread::park_timeout(Duration::from_secs(10));
    }
}

/// Blocks `x`'s stream until the returned gate is opened (then writes 9).
fn block(vm: &VirtualMachine, x: &Tensor) -> Arc<AtomicBool> {
    let gate = Arc::new(AtomicBool::new(false));
    let g = gate.clone();
    let s = vm.default_stream();
    vm.run(|b| {
        b.call_named("gate", &s, &[], &[x], move |k| {
            while !g.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            k.output_u64(0)[0] = 9;
        })
    })
    .unwrap();
    gate
}

fn open_later(gate: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        gate.store(true, Ordering::Release);
    })
}

#[tokio::test(flavor = "current_thread")]
async fn tokio_current_thread_awaits_reads_writes_and_batches() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let s = vm.default_stream();
    let x = vm.new_tensor(16).unwrap();
    // The runtime's only thread sleeps until the VM wakes it.
    let opener = open_later(block(&vm, &x));
    let mut out = [0u8; 8];
    vm.read_small_async(&x, 0, &mut out).await.unwrap();
    assert_eq!(u64::from_ne_bytes(out), 9);
    opener.join().unwrap();

    vm.write_small_async(&x, 8, &5u64.to_ne_bytes())
        .await
        .unwrap();
    let mut hi = [0u8; 8];
    vm.read_small_async(&x, 8, &mut hi).await.unwrap();
    assert_eq!(u64::from_ne_bytes(hi), 5);

    let (n, done) = vm
        .run_async(|b| {
            b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 40)?;
            b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] += 2)?;
            Ok(b.len())
        })
        .unwrap();
    assert_eq!(n, 2);
    done.await.unwrap();
    // Everything before the batch's completion barrier is released (the barrier itself
    // is released right after its callback).
    assert!(vm.flying_instruction_count() <= 1);
    let sum = vm
        .access_async(&x, |b| b.iter().map(|&v| u64::from(v)).sum::<u64>())
        .await
        .unwrap();
    assert_eq!(sum, 42 + 5);
    vm.sync_async().await.unwrap();

    // Several reads in flight at once, awaited together.
    let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
    let (ra, rb) = tokio::join!(
        vm.read_small_async(&x, 0, &mut a),
        vm.read_small_async(&x, 8, &mut b)
    );
    ra.unwrap();
    rb.unwrap();
    assert_eq!((u64::from_ne_bytes(a), u64::from_ne_bytes(b)), (42, 5));
}

#[test]
fn minimal_executor_is_woken_by_the_vm() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x = vm.new_tensor(8).unwrap();
    for _ in 0..20 {
        let opener = open_later(block(&vm, &x));
        let mut out = [0u8; 8];
        block_on(vm.read_small_async(&x, 0, &mut out)).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 9);
        opener.join().unwrap();
    }
    // The blocking handle works too.
    let c = vm.access_async(&x, |b| b[0]);
    assert_eq!(c.wait().unwrap(), 9);
}

#[test]
fn single_thread_mode_futures_drive_the_engine() {
    let vm = VirtualMachine::new(Config::single_thread()).unwrap();
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    let ((), done) = vm
        .run_async(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 11))
        .unwrap();
    block_on(done).unwrap();
    let mut out = [0u8; 8];
    block_on(vm.read_small_async(&x, 0, &mut out)).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 11);
    let c = vm.write_small_async(&x, 0, &[1; 8]);
    c.wait_timeout(Duration::from_secs(10)).unwrap();
}

#[test]
fn errors_resolve_the_future_never_panic_or_hang() {
    let vm = Arc::new(VirtualMachine::new(Config::default()).unwrap());
    let s = vm.default_stream();
    let x = vm.new_tensor(8).unwrap();
    let mut three = [0u8; 3];
    assert!(matches!(
        block_on(vm.read_small_async(&x, 0, &mut three)),
        Err(Error::UnsupportedSize(3))
    ));
    let mut out = [0u8; 8];
    assert!(matches!(
        block_on(vm.read_small_async(&x, 1, &mut out)),
        Err(Error::OutOfBounds { .. })
    ));
    // A panicking callback.
    assert!(matches!(
        block_on(vm.access_async(&x, |_| -> u8 { panic!("boom") })),
        Err(Error::KernelPanicked { .. })
    ));
    // A poisoned tensor: the read is dropped without running, the future says why.
    let p = vm.new_tensor(8).unwrap();
    vm.run(|b| b.call(&s, &[], &[&p], |_| panic!("producer failed")))
        .unwrap();
    assert!(matches!(
        block_on(vm.read_small_async(&p, 0, &mut out)),
        Err(Error::Poisoned { .. })
    ));
    // From inside a kernel of the same VM: Reentrant, through the future.
    let (vm2, x2) = (vm.clone(), x.clone());
    let inner = vm
        .access(&x, move |_| {
            let mut o = [0u8; 8];
            let mut f = pin!(vm2.read_small_async(&x2, 0, &mut o));
            let mut cx = Context::from_waker(Waker::noop());
            matches!(f.as_mut().poll(&mut cx), Poll::Ready(Err(Error::Reentrant)))
        })
        .unwrap();
    assert!(inner);
    // Dropping a future abandons the wait, not the work.
    let gate = block(&vm, &x);
    drop(vm.read_small_async(&x, 0, &mut out));
    drop(vm.write_small_async(&x, 0, &3u64.to_ne_bytes()));
    gate.store(true, Ordering::Release);
    vm.read_small(&x, 0, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 3);
    // Polling again after Ready is an error, not a panic.
    let mut c = vm.sync_async();
    let mut cx = Context::from_waker(Waker::noop());
    let first = loop {
        if let Poll::Ready(r) = std::pin::Pin::new(&mut c).poll(&mut cx) {
            break r;
        }
        std::thread::yield_now();
    };
    first.unwrap();
    assert!(matches!(
        std::pin::Pin::new(&mut c).poll(&mut cx),
        Poll::Ready(Err(Error::InvalidArgument(_)))
    ));
}

#[test]
fn awaiting_after_shutdown_is_an_error() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    let x = vm.new_tensor(8).unwrap();
    let mut out = [0u8; 8];
    let pending = vm.read_small_async(&x, 0, &mut out);
    let batch = vm.sync_async();
    vm.shutdown().unwrap();
    assert!(matches!(block_on(pending), Err(Error::ShutDown)));
    assert!(matches!(block_on(batch), Err(Error::ShutDown)));
    let mut out2 = [0u8; 8];
    assert!(matches!(
        block_on(vm.read_small_async(&x, 0, &mut out2)),
        Err(Error::ShutDown)
    ));
    assert!(matches!(
        vm.access_async(&x, |b| b[0]).wait(),
        Err(Error::ShutDown)
    ));
    assert!(matches!(vm.run_async(|_| Ok(())), Err(Error::ShutDown)));
}
