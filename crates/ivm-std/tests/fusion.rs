//! Fused runs through the public API: a run's members are each done, poisoned and counted
//! on their own, a failing member poisons only what depends on it, and the builder's
//! opt-out keeps an instruction out of runs. Both fusion settings give the same results.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ivm_std::{Config, Error, Tensor, VirtualMachine};

fn vm(fusion: bool) -> VirtualMachine {
    VirtualMachine::new(
        Config::default()
            .with_fusion(fusion)
            .with_timeout_period(Duration::from_secs(10)),
    )
    .unwrap()
}

fn read_u64(vm: &VirtualMachine, t: &Tensor) -> ivm_std::Result<u64> {
    let mut out = [0u8; 8];
    vm.read_small(t, 0, &mut out)?;
    Ok(u64::from_ne_bytes(out))
}

/// One `run` on one stream: `a` panics writing `x`; `b` writes `y`; `c` reads `x` (so it
/// fails by `a`'s poison); `d` reads `y`; `e` reads `d`'s output. With fusion on they are
/// one run of five.
#[test]
fn a_failing_member_poisons_only_what_reads_it() {
    for fusion in [true, false] {
        let vm = vm(fusion);
        let s = vm.default_stream();
        let t: Vec<Tensor> = (0..5).map(|_| vm.new_tensor(8).unwrap()).collect();
        let (x, y, z, w, v) = (&t[0], &t[1], &t[2], &t[3], &t[4]);
        vm.run(|b| {
            b.call(&s, &[], &[x], |_| panic!("member a"))?;
            b.call(&s, &[], &[y], |k| k.output_u64(0)[0] = 3)?;
            b.call(&s, &[x], &[z], |k| k.output_u64(0)[0] = 4)?;
            b.call(&s, &[y], &[w], |k| {
                let v = k.input_u64(0)[0];
                k.output_u64(0)[0] = v + 1;
            })?;
            b.call(&s, &[w], &[v], |k| {
                let v = k.input_u64(0)[0];
                k.output_u64(0)[0] = v * 10;
            })
        })
        .unwrap();
        for (name, r) in [("x", read_u64(&vm, x)), ("z", read_u64(&vm, z))] {
            assert!(
                matches!(&r, Err(Error::Poisoned { message, .. } | Error::KernelPanicked { message, .. })
                    if message.contains("member a")),
                "fusion {fusion}: {name} carries a's poison, got {r:?}"
            );
        }
        assert_eq!(read_u64(&vm, y).unwrap(), 3, "fusion {fusion}");
        assert_eq!(read_u64(&vm, w).unwrap(), 4, "fusion {fusion}");
        assert_eq!(read_u64(&vm, v).unwrap(), 40, "fusion {fusion}");
        let st = vm.stats().unwrap();
        if fusion {
            assert_eq!(
                (st.fused_runs, st.fused_instructions, st.longest_fused_run),
                (1, 5, 5),
                "one run of the five kernels"
            );
        } else {
            assert_eq!(st.fused_runs, 0, "fusion off: no run");
        }
    }
}

/// `set_fusable(false)` keeps an instruction out of runs and ends the run before it; the
/// run length bound holds.
#[test]
fn the_opt_out_and_the_bound_split_runs() {
    let vm =
        VirtualMachine::new(Config::default().with_fusion(true).with_max_fused_run(3)).unwrap();
    let s = vm.default_stream();
    let t: Vec<Tensor> = (0..10).map(|_| vm.new_tensor(8).unwrap()).collect();
    let ran = std::sync::Arc::new(AtomicUsize::new(0));
    vm.run(|b| {
        for (k, out) in t.iter().enumerate() {
            // Members 0..=4 may fuse (runs of 3 and 2), 5 is kept out, 6..=9 fuse (3 + 1).
            b.set_fusable(k != 5);
            let ran = ran.clone();
            b.call(&s, &[], &[out], move |c| {
                c.output_u64(0)[0] = k as u64;
                ran.fetch_add(1, Ordering::Relaxed);
            })?;
        }
        Ok(())
    })
    .unwrap();
    vm.sync().unwrap();
    assert_eq!(ran.load(Ordering::Relaxed), 10);
    for (k, out) in t.iter().enumerate() {
        assert_eq!(read_u64(&vm, out).unwrap(), k as u64);
    }
    let st = vm.stats().unwrap();
    assert_eq!(
        (st.fused_runs, st.fused_instructions, st.longest_fused_run),
        (3, 8, 3),
        "runs 0-2, 3-4, 6-8; 5 and 9 alone"
    );
}
