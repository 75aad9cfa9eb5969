//! Foreign-runtime hooks, through the public API only: a front end that holds a global
//! lock (a stand-in for a language binding's interpreter lock) while it calls the VM, and
//! kernels that need that lock too.
//!
//! * With a [`WaitHook`] that releases the lock around the VM's waits, every blocking call
//!   (a read, a write, a callback access, `sync`, a completion's `wait`, backpressure in
//!   `run`) gets its result, in both modes, and the caller holds the lock again after
//!   each call; the hook's calls come in pairs on the caller's thread.
//! * Without it, the kernel cannot get the lock while the caller waits: the read fails
//!   (the kernel gives up after a while) instead of returning the value — the deadlock
//!   the hook exists for.
//! * With a [`DropSink`], a kernel or callback that never runs (its input was poisoned)
//!   hands its captures to the sink, and they are dropped on the embedder's thread;
//!   without one they are dropped on a VM thread.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use ivm_std::{
    Captures, Config, DropSink, Error, ForeignHooks, Mode, Tensor, VirtualMachine, WaitHook,
};

/// A non-reentrant lock with an owner, acquired and released explicitly (like an
/// interpreter lock that a binding saves and restores).
struct Gil {
    owner: Mutex<Option<ThreadId>>,
    cv: Condvar,
}

impl Gil {
    const fn new() -> Self {
        Self {
            owner: Mutex::new(None),
            cv: Condvar::new(),
        }
    }

    /// Takes the lock, waiting at most `patience`; whether it got it.
    fn acquire_within(&self, patience: Duration) -> bool {
        let me = std::thread::current().id();
        let g = self.owner.lock().unwrap();
        let (mut g, _) = self
            .cv
            .wait_timeout_while(g, patience, |o| o.is_some())
            .unwrap();
        if g.is_some() {
            return false;
        }
        *g = Some(me);
        true
    }

    fn acquire(&self) {
        assert!(
            self.acquire_within(Duration::from_secs(60)),
            "lock not free"
        );
    }

    /// Releases the lock if this thread holds it; whether it did.
    fn release(&self) -> bool {
        let mut g = self.owner.lock().unwrap();
        if *g == Some(std::thread::current().id()) {
            *g = None;
            self.cv.notify_all();
            true
        } else {
            false
        }
    }

    fn held_by_me(&self) -> bool {
        *self.owner.lock().unwrap() == Some(std::thread::current().id())
    }
}

/// Releases the test's lock around the VM's waits, and counts its calls.
struct ReleaseAroundWaits {
    gil: &'static Gil,
    before: AtomicUsize,
    after: AtomicUsize,
    /// Calls made on another thread than the one that installed the hook's test.
    foreign_thread_calls: AtomicUsize,
    caller: ThreadId,
}

thread_local! {
    static RELEASED: Cell<bool> = const { Cell::new(false) };
}

impl WaitHook for ReleaseAroundWaits {
    fn before_wait(&self) {
        self.before.fetch_add(1, Ordering::Relaxed);
        if std::thread::current().id() != self.caller {
            self.foreign_thread_calls.fetch_add(1, Ordering::Relaxed);
        }
        RELEASED.with(|r| r.set(self.gil.release()));
    }

    fn after_wait(&self) {
        self.after.fetch_add(1, Ordering::Relaxed);
        if std::thread::current().id() != self.caller {
            self.foreign_thread_calls.fetch_add(1, Ordering::Relaxed);
        }
        if RELEASED.with(|r| r.replace(false)) {
            self.gil.acquire();
        }
    }
}

fn config(mode: Mode) -> Config {
    Config::default()
        .with_mode(mode)
        .with_timeout_period(Duration::from_secs(20))
}

/// A kernel that needs the lock to write `value` into `t`'s first word; it gives up
/// (panics: the instruction fails, `t` is poisoned) after `patience`.
fn locked_write(
    vm: &VirtualMachine,
    gil: &'static Gil,
    t: &Tensor,
    value: u64,
    patience: Duration,
) -> ivm_std::Result<()> {
    vm.run(|b| {
        b.call(&vm.default_stream(), &[], &[t], move |k| {
            assert!(
                gil.acquire_within(patience),
                "the kernel never got the lock"
            );
            k.output_u64(0)[0] = value;
            gil.release();
        })
    })
}

fn read(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

#[test]
fn a_wait_hook_lets_kernels_take_the_callers_lock_in_every_blocking_call() {
    static GIL: Gil = Gil::new();
    for mode in [Mode::MultiThread, Mode::SingleThread] {
        let vm = VirtualMachine::new(config(mode).with_high_water_mark(8).with_low_water_mark(4))
            .unwrap();
        let hook = Arc::new(ReleaseAroundWaits {
            gil: &GIL,
            before: AtomicUsize::new(0),
            after: AtomicUsize::new(0),
            foreign_thread_calls: AtomicUsize::new(0),
            caller: std::thread::current().id(),
        });
        vm.set_foreign_hooks(ForeignHooks::default().with_wait_hook(hook.clone()))
            .unwrap();
        let patience = Duration::from_secs(20);
        let t = vm.new_tensor(8).unwrap();
        GIL.acquire();

        // A read after a kernel that needs the lock.
        locked_write(&vm, &GIL, &t, 1, patience).unwrap();
        assert_eq!(read(&vm, &t).unwrap(), 1, "{mode:?}");
        assert!(
            GIL.held_by_me(),
            "{mode:?}: the caller holds its lock again"
        );

        // A write, a callback access and a timed read behind such a kernel.
        locked_write(&vm, &GIL, &t, 2, patience).unwrap();
        vm.write_small(&t, 0, &3u64.to_ne_bytes()).unwrap();
        locked_write(&vm, &GIL, &t, 4, patience).unwrap();
        let seen = vm.access(&t, |b| b[0]).unwrap();
        assert_eq!(seen, 4, "{mode:?}");
        locked_write(&vm, &GIL, &t, 5, patience).unwrap();
        let mut out = [0u8; 8];
        vm.read_small_timeout(&t, 0, &mut out, Duration::from_secs(20))
            .unwrap();
        assert_eq!(u64::from_ne_bytes(out), 5, "{mode:?}");

        // `sync` and a completion's `wait`.
        locked_write(&vm, &GIL, &t, 6, patience).unwrap();
        vm.sync().unwrap();
        let ((), done) = vm
            .run_async(|b| {
                b.call(&vm.default_stream(), &[], &[&t], |k| {
                    assert!(GIL.acquire_within(Duration::from_secs(20)));
                    k.output_u64(0)[0] = 7;
                    GIL.release();
                })
            })
            .unwrap();
        done.wait().unwrap();
        assert_eq!(read(&vm, &t).unwrap(), 7, "{mode:?}");

        // Backpressure: 64 batches of kernels that need the lock, 8 in flight at most
        // (multi-thread mode; single-thread mode runs each batch in `run`).
        for i in 0..64u64 {
            locked_write(&vm, &GIL, &t, 100 + i, patience).unwrap();
        }
        assert_eq!(read(&vm, &t).unwrap(), 163, "{mode:?}");
        assert!(GIL.held_by_me(), "{mode:?}");

        GIL.release();
        vm.shutdown().unwrap();
        let (before, after) = (
            hook.before.load(Ordering::Relaxed),
            hook.after.load(Ordering::Relaxed),
        );
        assert!(before > 0, "{mode:?}: the hook was called");
        assert_eq!(before, after, "{mode:?}: calls come in pairs");
        assert_eq!(
            hook.foreign_thread_calls.load(Ordering::Relaxed),
            0,
            "{mode:?}: only on the calling thread"
        );
    }
}

#[test]
fn without_the_hook_a_kernel_needing_the_callers_lock_cannot_run_while_it_waits() {
    static GIL: Gil = Gil::new();
    // Multi-thread mode: the kernel runs on a worker while the caller waits holding the
    // lock. (Single-thread mode would run it on the caller's own thread, where a
    // non-reentrant lock deadlocks outright.)
    let vm = VirtualMachine::new(config(Mode::MultiThread)).unwrap();
    let t = vm.new_tensor(8).unwrap();
    GIL.acquire();
    locked_write(&vm, &GIL, &t, 1, Duration::from_millis(300)).unwrap();
    match read(&vm, &t) {
        Err(Error::Poisoned { message, .. } | Error::KernelPanicked { message, .. }) => {
            assert!(message.contains("never got the lock"), "{message}")
        }
        other => panic!("expected the kernel to give up, got {other:?}"),
    }
    GIL.release();
    vm.shutdown().unwrap();
}

/// Something a kernel captures whose drop must happen on a chosen thread.
struct Tracked {
    dropped_on: Arc<Mutex<Vec<String>>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let t = std::thread::current();
        let name = t.name().unwrap_or("unnamed").to_string();
        self.dropped_on.lock().unwrap().push(name);
    }
}

struct ToChannel(Mutex<mpsc::Sender<Captures>>);

impl DropSink for ToChannel {
    fn send(&self, captures: Captures) {
        let _ = self.0.lock().unwrap().send(captures);
    }
}

/// Submits a kernel that fails (poisoning `t`), then a kernel, a builder callback and a
/// blocking callback access that read `t` and capture a [`Tracked`] each: none of them
/// runs.
fn unrun_closures(vm: &VirtualMachine, dropped_on: &Arc<Mutex<Vec<String>>>) -> usize {
    let t = vm.new_tensor(8).unwrap();
    let u = vm.new_tensor(8).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let s = vm.default_stream();
    let (r1, r2, r3) = (ran.clone(), ran.clone(), ran.clone());
    let (a, b, c) = (
        Tracked {
            dropped_on: dropped_on.clone(),
        },
        Tracked {
            dropped_on: dropped_on.clone(),
        },
        Tracked {
            dropped_on: dropped_on.clone(),
        },
    );
    vm.run(|bl| {
        bl.call(&s, &[], &[&t], |_| panic!("fails on purpose"))?;
        bl.call(&s, &[&t], &[&u], move |_| {
            let _keep = &a;
            r1.fetch_add(1, Ordering::Relaxed);
        })?;
        bl.access_blob_by_callback(&t, move |_| {
            let _keep = &b;
            r2.fetch_add(1, Ordering::Relaxed);
        })
    })
    .unwrap();
    let r = vm.access(&t, move |_| {
        let _keep = &c;
        r3.fetch_add(1, Ordering::Relaxed);
    });
    assert!(r.is_err(), "the access reads a poisoned tensor: {r:?}");
    vm.sync().unwrap();
    assert_eq!(ran.load(Ordering::Relaxed), 0, "none of them ran");
    3
}

#[test]
fn a_drop_sink_gets_the_captures_of_closures_that_never_run() {
    for mode in [Mode::MultiThread, Mode::SingleThread] {
        let vm = VirtualMachine::new(config(mode)).unwrap();
        let (tx, rx) = mpsc::channel::<Captures>();
        vm.set_foreign_hooks(
            ForeignHooks::default().with_drop_sink(Arc::new(ToChannel(Mutex::new(tx)))),
        )
        .unwrap();
        let dropped_on = Arc::new(Mutex::new(Vec::new()));
        let n = unrun_closures(&vm, &dropped_on);
        vm.shutdown().unwrap();
        // The embedder's thread drops them.
        let embedder = std::thread::Builder::new()
            .name("embedder".into())
            .spawn(move || rx.try_iter().count())
            .unwrap();
        let received = embedder.join().unwrap();
        assert!(
            received >= n,
            "{mode:?}: {received} captures sent for {n} closures"
        );
        let names = dropped_on.lock().unwrap().clone();
        assert_eq!(
            names.len(),
            n,
            "{mode:?}: every capture dropped once: {names:?}"
        );
        assert!(
            names.iter().all(|t| t == "embedder"),
            "{mode:?}: dropped on {names:?}"
        );
    }
}

/// Without a sink, each capture is dropped once, where the VM drops the closure: on one
/// of its threads, or on the caller when a waiting caller ran the queued work itself
/// (`caller_runs`; which of the two is a matter of scheduling, so both are allowed).
#[test]
fn without_a_drop_sink_unrun_captures_are_dropped_by_the_vm() {
    let vm = VirtualMachine::new(config(Mode::MultiThread)).unwrap();
    let dropped_on = Arc::new(Mutex::new(Vec::new()));
    let n = unrun_closures(&vm, &dropped_on);
    vm.shutdown().unwrap();
    let names = dropped_on.lock().unwrap().clone();
    assert_eq!(names.len(), n, "every capture dropped once: {names:?}");
    let me = std::thread::current()
        .name()
        .unwrap_or_default()
        .to_string();
    assert!(
        names.iter().all(|t| t.starts_with("ivm") || *t == me),
        "dropped on a VM thread or on the caller ({me}): {names:?}"
    );
}

#[test]
fn hooks_are_installed_once() {
    let vm = VirtualMachine::new(Config::default()).unwrap();
    vm.set_foreign_hooks(ForeignHooks::default()).unwrap();
    assert!(matches!(
        vm.set_foreign_hooks(ForeignHooks::default()),
        Err(Error::Config(_))
    ));
}
