//! Several independent VMs in one process.

use std::time::Duration;

use ivm_std::{Config, Error, VirtualMachine};

/// Names of this process's threads that belong to VM `id` (`ivm<id>-...`).
fn vm_threads(id: usize) -> usize {
    let prefix = format!("ivm{id}-");
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .filter(|c| c.trim_end().starts_with(&prefix))
                .count()
        })
        .unwrap_or(0)
}

fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

#[test]
fn independent_vms_do_not_share_instructions() {
    let a = VirtualMachine::new(Config::default()).unwrap();
    let b = VirtualMachine::new(Config::default()).unwrap();
    let (sa, sb) = (a.default_stream(), b.default_stream());
    let (xa, xb) = (a.new_tensor(8).unwrap(), b.new_tensor(8).unwrap());
    // A tensor of one VM is refused by the other.
    let mut out = [0u8; 8];
    assert!(matches!(
        a.read_small(&xb, 0, &mut out),
        Err(Error::ForeignObject("tensor"))
    ));
    assert!(matches!(
        b.run(|bld| bld.call(&sa, &[], &[&xb], |_| {})),
        Err(Error::ForeignObject(_))
    ));
    // Block VM B's stream; reads on A must not wait for it.
    let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let g = gate.clone();
    b.run(|bld| {
        bld.call(&sb, &[], &[&xb], move |k| {
            while !g.load(std::sync::atomic::Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            k.output_u64(0)[0] = 7;
        })
    })
    .unwrap();
    for i in 0..200u64 {
        a.run(|bld| bld.call(&sa, &[], &[&xa], move |k| k.output_u64(0)[0] = i))
            .unwrap();
        a.read_small(&xa, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), i);
    }
    assert!(b.flying_instruction_count() >= 1, "B is still blocked");
    assert!(a.flying_instruction_count() <= 2);
    gate.store(true, std::sync::atomic::Ordering::Release);
    b.read_small(&xb, 0, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 7);
}

#[test]
fn many_vms_used_from_many_threads() {
    let vms: Vec<_> = (0..4)
        .map(|k| {
            let c = if k % 2 == 0 {
                Config::default()
            } else {
                Config::single_thread()
            };
            VirtualMachine::new(c).unwrap()
        })
        .collect();
    std::thread::scope(|sc| {
        for t in 0..3u64 {
            let vms = &vms;
            sc.spawn(move || {
                // Each thread interleaves sync reads over every VM (thread-local rings
                // keyed by VM).
                let xs: Vec<_> = vms.iter().map(|vm| vm.new_tensor(8).unwrap()).collect();
                for round in 0..50u64 {
                    for (vm, x) in vms.iter().zip(&xs) {
                        let v = t * 1000 + round;
                        vm.write_small(x, 0, &v.to_ne_bytes()).unwrap();
                        let mut out = [0u8; 8];
                        vm.read_small(x, 0, &mut out).unwrap();
                        assert_eq!(u64::from_ne_bytes(out), v);
                    }
                }
            });
        }
    });
    for vm in &vms {
        vm.sync().unwrap();
        // `sync` waits for what was received before it; its own instruction may still be
        // on its way out when it returns (seen under ThreadSanitizer): everything must be
        // released soon after, within a generous bound.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while vm.flying_instruction_count() != 0 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(vm.flying_instruction_count(), 0);
    }
}

#[test]
fn dropping_a_vm_joins_its_threads_and_leaves_others_running() {
    let keep = VirtualMachine::new(Config::default()).unwrap();
    let gone = VirtualMachine::new(Config::default()).unwrap();
    let id = gone.stats().unwrap().vm_id;
    let keep_id = keep.stats().unwrap().vm_id;
    let x = gone.new_tensor(8).unwrap();
    let s = gone.default_stream();
    gone.run(|b| b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 3))
        .unwrap();
    // A new thread names itself once it starts: wait for that.
    assert!(
        wait_for(|| vm_threads(id) >= 2),
        "scheduler and worker are running"
    );
    // Work in flight at drop is drained; a tensor outliving its VM stays harmless.
    drop(gone);
    assert!(
        wait_for(|| vm_threads(id) == 0),
        "every thread of the dropped VM exited"
    );
    drop(x);
    let y = keep.new_tensor(8).unwrap();
    keep.write_small(&y, 0, &5u64.to_ne_bytes()).unwrap();
    let mut out = [0u8; 8];
    keep.read_small(&y, 0, &mut out).unwrap();
    assert_eq!(u64::from_ne_bytes(out), 5);
    assert!(wait_for(|| vm_threads(keep_id) >= 2));
    keep.shutdown().unwrap();
    assert!(wait_for(|| vm_threads(keep_id) == 0));
}

/// VMs nest on one thread: a kernel of VM A drives single-thread VM B, whose kernel runs
/// right there and makes blocking calls into A. Those would wait for A's kernel, which is
/// this very thread: `Reentrant` at once, as from A's kernel directly. Before, entering B
/// replaced A as the thread's VM, and the call waited for a whole timeout period (for
/// ever with no timeout). Calls into B from B's kernel stay `Reentrant` too, and A's
/// kernel still uses B normally once B's kernel has returned.
#[test]
fn blocking_calls_into_an_outer_vm_from_a_nested_vm_are_reentrant() {
    for a_config in [Config::default(), Config::single_thread()] {
        let long = Duration::from_secs(60);
        let a =
            std::sync::Arc::new(VirtualMachine::new(a_config.with_timeout_period(long)).unwrap());
        let b = std::sync::Arc::new(
            VirtualMachine::new(Config::single_thread().with_timeout_period(long)).unwrap(),
        );
        let (ta, tb) = (a.new_tensor(8).unwrap(), b.new_tensor(8).unwrap());
        let sa = a.default_stream();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let (a2, b2, ta2, tb2) = (a.clone(), b.clone(), ta.clone(), tb.clone());
        let start = std::time::Instant::now();
        a.run(|bl| {
            bl.call(&sa, &[], &[&ta], move |k| {
                let sb = b2.default_stream();
                let (a3, b3, ta3, tx2) = (a2.clone(), b2.clone(), ta2.clone(), tx.clone());
                b2.run(|bl| {
                    bl.call(&sb, &[], &[&tb2], move |k| {
                        let mut buf = [0u8; 8];
                        let outer = [
                            ("A.sync", a3.sync()),
                            ("A.read_small", a3.read_small(&ta3, 0, &mut buf)),
                            ("B.sync", b3.sync()),
                        ];
                        for (what, r) in outer {
                            if !matches!(r, Err(Error::Reentrant)) {
                                tx2.send(format!("{what}: {r:?}")).unwrap();
                            }
                        }
                        k.output_u64(0)[0] = 5;
                    })
                })
                .unwrap();
                let mut out = [0u8; 8];
                b2.read_small(&tb2, 0, &mut out).unwrap();
                k.output_u64(0)[0] = u64::from_ne_bytes(out) + 1;
            })
        })
        .unwrap();
        let mut out = [0u8; 8];
        a.read_small(&ta, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 6, "both kernels ran");
        if let Ok(m) = rx.try_recv() {
            panic!("a blocking call from the nested kernel was not Reentrant: {m}");
        }
        assert!(start.elapsed() < long / 2, "nothing waited for a timeout");
        drop((ta, tb));
        b.shutdown().unwrap();
        a.shutdown().unwrap();
    }
}
