//! The device section (`--device sim|sim-launcher|cuda`; without `--device` it does not
//! run): the same kinds of figure on one device of an adapter, informational (no target:
//! they are the device's as much as the VM's). A GPU machine runs it on cuda
//! (`.ci/gpu.sh`).
//!
//! | figure | what |
//! |---|---|
//! | `device_read_us` | p50 of back-to-back 8-byte `read_small` of a device tensor (through the stream's pinned buffer), after a kernel wrote it |
//! | `device_read_p99_us` | p99 of those reads |
//! | `device_instr_per_s` | empty kernels on the device's compute stream (on a launcher device each enqueues one host function), `run` batches of 64, until `sync()` returns |
//! | `device_copy_mb_per_s` | 1 MiB host-to-device copies on the host-to-device stream, until `sync()` returns |

use ivm::ivm_device::sim::{SIM, SimAdapter, SimConfig};
use ivm::ivm_std::{DeviceAdapter, StreamType};

use super::*;

/// The adapter and the device `name` selects.
fn adapter(name: &str) -> Result<(Arc<dyn DeviceAdapter>, Device), String> {
    let sim = |launcher: bool| -> (Arc<dyn DeviceAdapter>, Device) {
        let a: Arc<dyn DeviceAdapter> = SimAdapter::new(SimConfig {
            launcher,
            host_visible: !launcher,
            ..SimConfig::default()
        });
        (
            a,
            Device {
                kind: SIM,
                index: 0,
            },
        )
    };
    match name {
        "sim" => Ok(sim(false)),
        "sim-launcher" => Ok(sim(true)),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let a = ivm::ivm_device::cuda::CudaAdapter::new().map_err(|e| e.to_string())?;
            Ok((a, ivm::ivm_device::cuda::cuda_device(0)))
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err("--device cuda: build perf_report with `--features cuda`".into()),
        other => Err(format!(
            "--device `{other}`: expected sim, sim-launcher or cuda"
        )),
    }
}

/// Runs the device section on device `name` (see the module docs).
pub(crate) fn device_figures(rep: &mut Report, quick: bool, name: &str) -> Result<(), String> {
    let (a, dev) = adapter(name)?;
    let e = |e: ivm::Error| e.to_string();
    let vm = VirtualMachine::with_adapters(config(), vec![a]).map_err(e)?;
    let s = vm.stream(StreamId::compute(dev, 0)).map_err(e)?;
    let t = vm.new_tensor_on(&s, 8).map_err(e)?;
    vm.write_small(&t, 0, &7u64.to_ne_bytes()).map_err(e)?;
    // Reads after a kernel on the tensor (a launcher kernel enqueues an empty host
    // function: no bytes touched, so it runs on device-only memory too).
    vm.run(|b| {
        b.call(&s, &[], &[&t], |k| {
            if let Some(d) = k.device_stream() {
                d.launch_host(Box::new(|| {}))
                    .unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e.to_string())));
            }
        })
    })
    .map_err(e)?;
    let n = if quick { 500 } else { 5_000 };
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let mut out = [0u8; 8];
        vm.read_small(&t, 0, &mut out).map_err(e)?;
        samples.push(t0.elapsed());
    }
    rep.figure("device_read_us", us(pct(&mut samples, 0.5)), "µs", "", None);
    rep.figure(
        "device_read_p99_us",
        us(pct(&mut samples, 0.99)),
        "µs",
        "",
        None,
    );

    let n = if quick { 2_000 } else { 20_000 };
    let start = Instant::now();
    let mut i = 0;
    while i < n {
        vm.run(|b| {
            for _ in 0..64.min(n - i) {
                b.call(&s, &[], &[&t], |k| {
                    if let Some(d) = k.device_stream() {
                        d.launch_host(Box::new(|| {}))
                            .unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e.to_string())));
                    }
                })?;
            }
            Ok(())
        })
        .map_err(e)?;
        i += 64;
    }
    vm.sync().map_err(e)?;
    rep.figure(
        "device_instr_per_s",
        n as f64 / start.elapsed().as_secs_f64(),
        "instr/s",
        "",
        None,
    );

    let h2d = vm
        .stream(StreamId {
            device: dev,
            stream_type: StreamType::HostToDevice,
            thread_id: 0,
        })
        .map_err(e)?;
    const MIB: usize = 1 << 20;
    let src = vm.new_tensor(MIB).map_err(e)?;
    let dst = vm.new_tensor_on(&h2d, MIB).map_err(e)?;
    let copies = if quick { 20 } else { 200 };
    let start = Instant::now();
    for _ in 0..copies {
        vm.run(|b| b.copy(&h2d, &src, &dst)).map_err(e)?;
    }
    vm.sync().map_err(e)?;
    rep.figure(
        "device_copy_mb_per_s",
        copies as f64 * MIB as f64 / 1e6 / start.elapsed().as_secs_f64(),
        "MB/s",
        "",
        None,
    );
    drop((t, src, dst));
    vm.shutdown().map_err(e)
}
