//! The VM equivalence programs on the cpu plus two sim devices with injected faults
//! (`SimFaults`: failing launches, events that never complete or complete with an error,
//! failing allocations, 100× slower copies), checked by `Runner::run_with_faults`: every
//! failed instruction's outputs are poisoned and their readers get an error naming it,
//! every observation no failure reaches equals the sequential interpreter's, a stuck event
//! ends in `Error::Timeout` (a 250 ms timeout period, far below libFuzzer's `-timeout`)
//! whose diagnostic names stuck work, and after each program the healed VM drains and the
//! sim allocator holds no live allocation, double free or use after free.
//!
//! Kernel panics are stripped (libFuzzer aborts on any panic). `IVM_FUZZ_STATS=1` prints,
//! every 256 programs and at exit, the campaign's counts: programs, outcomes, and the
//! faults injected by kind.
#![no_main]

use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::Duration;

use ivm_device::sim::{Latency, SimAdapter, SimConfig, SimFaults, sim_device};
use ivm_std::fuzzing::{FaultCampaign, FaultControl, HashKernels, Program, Runner, Topology};
use ivm_graph::fuzzing::launch_graphs;
use ivm_std::{Config, DeviceAdapter};
use libfuzzer_sys::fuzz_target;

struct Sim(Arc<SimAdapter>);

impl FaultControl for Sim {
    fn heal(&self) {
        self.0.heal();
    }
    fn resume(&self) {
        self.0.resume_faults();
    }
    fn stuck_events(&self) -> usize {
        self.0.stuck_events()
    }
    fn check_memory(&self) -> Result<(), String> {
        for dev in 0..self.0.config().devices {
            let st = self.0.allocator_stats(dev).expect("a sim device");
            if (st.live_allocations, st.double_frees, st.use_after_free) != (0, 0, 0) {
                return Err(format!("sim:{dev}: {st:?}"));
            }
        }
        Ok(())
    }
}

static STATE: OnceLock<(Runner, Sim)> = OnceLock::new();
static CAMPAIGN: Mutex<FaultCampaign> = Mutex::new(FaultCampaign {
    programs: 0,
    aborted: 0,
    timeouts: 0,
    compared: 0,
    values: 0,
    poisoned: 0,
    own_failures: 0,
    roots: 0,
    sync_errors: 0,
    cut: 0,
});

fn state() -> (Runner, Sim) {
    let us = Duration::from_micros;
    let sim = SimAdapter::new(SimConfig {
        devices: 2,
        launch_latency: Latency::between(us(0), us(40)),
        kernel_latency: Latency::between(us(0), us(80)),
        copy_latency: Latency::between(us(0), us(40)),
        seed: 0xfa_5eed,
        faults: SimFaults {
            seed: 0xfa17,
            kernel_launch_fail: 16,
            event_never_completes: 64,
            event_error: 16,
            alloc_fail: 8,
            slow_copy: 8,
            copy_fail: 16,
        },
        ..SimConfig::default()
    });
    let a: Arc<dyn DeviceAdapter> = sim.clone();
    let runner = Runner::with_topology(
        ivm_std::fuzzing::ci_lane(Config::default())
            .with_timeout_period(Duration::from_millis(250)),
        vec![a],
        Topology::with_devices(&[sim_device(0), sim_device(1)]),
        HashKernels,
    )
    .and_then(|r| r.with_launch_graphs(launch_graphs()?))
    .expect("start the VM");
    (runner, Sim(sim))
}

fn report() {
    let Some((_, sim)) = STATE.get() else { return };
    let c = *CAMPAIGN.lock().unwrap_or_else(|e| e.into_inner());
    let f = sim.0.fault_stats();
    eprintln!(
        "ivm-fuzz vm_faults: {c}; faults injected: {} (launch failed {}, event never \
         completed {}, event error {}, allocation failed {}, slow copy {}, copy failed {})",
        f.total(),
        f.kernel_launch_fail,
        f.event_never_completes,
        f.event_error,
        f.alloc_fail,
        f.slow_copy,
        f.copy_fail
    );
}

extern "C" fn report_at_exit() {
    report();
}

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

fn stats_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var_os("IVM_FUZZ_STATS").is_some_and(|v| v != "0");
        if on {
            static ONCE: Once = Once::new();
            // SAFETY: registers a plain `extern "C"` function with no preconditions; it
            // only reads the counters and writes to stderr.
            ONCE.call_once(|| unsafe {
                atexit(report_at_exit);
            });
        }
        on
    })
}

fuzz_target!(|program: Program| {
    let (runner, sim) = STATE.get_or_init(state);
    let program = program.without_panics();
    match runner.run_with_faults(&program, sim) {
        Ok(o) => {
            if stats_on() {
                let n = {
                    let mut c = CAMPAIGN.lock().unwrap_or_else(|e| e.into_inner());
                    c.record(&o);
                    c.programs
                };
                if n.is_multiple_of(256) {
                    report();
                }
            }
        }
        Err(mismatch) => panic!("{mismatch}"),
    }
});
