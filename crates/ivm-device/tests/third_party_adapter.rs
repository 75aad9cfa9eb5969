//! A device adapter written only against ivm-std's public API, as a third party would:
//! it wraps the sim adapter, and chooses the policy of each of its stream types itself
//! (`DeviceAdapter::stream_policy`). The VM asks it, not a built-in table: its compute
//! streams get a worker thread of their own (visible in `VirtualMachine::stats`), and the
//! results still equal a sequential run. Device kinds are names: the sim's `"sim"` and
//! the cuda adapter's `"cuda"` are defined in ivm-device, not in ivm-std; a VM refuses a
//! second adapter for a name, the name `"cpu"` and malformed names.

use std::sync::Arc;

use ivm_device::sim::{SIM, SimAdapter, SimConfig, sim_device};
use ivm_std::{
    Config, DeviceAdapter, DeviceAllocator, DeviceKind, DeviceStream, DeviceStreamPolicy, Error,
    KernelMode, Placement, Result, StreamId, StreamPolicy, StreamType, VirtualMachine,
};

/// The sim, with compute streams on threads of their own.
#[derive(Debug)]
struct OwnThreadCompute {
    inner: Arc<SimAdapter>,
}

/// A compute policy as the sim's, placed on a worker of its own.
#[derive(Debug)]
struct OwnWorker(DeviceStreamPolicy);

impl StreamPolicy for OwnWorker {
    fn stream_type(&self) -> StreamType {
        self.0.stream_type()
    }
    fn placement(&self) -> Placement {
        Placement::OwnWorker
    }
    fn done_at_launch(&self) -> bool {
        self.0.done_at_launch()
    }
    fn supports_events(&self) -> bool {
        // Soft sync would otherwise order this stream on the device through its sibling
        // streams' shared thread; a stream on a thread of its own uses host-observed
        // events instead, which `supports_events` keeps.
        self.0.supports_events()
    }
}

impl DeviceAdapter for OwnThreadCompute {
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }
    fn supports_events(&self) -> bool {
        self.inner.supports_events()
    }
    fn supports_peer_copy(&self) -> bool {
        self.inner.supports_peer_copy()
    }
    fn stream_policy(
        &self,
        index: u32,
        stream_type: StreamType,
        mode: KernelMode,
    ) -> Box<dyn StreamPolicy> {
        let base = DeviceStreamPolicy::new(stream_type, mode, self.supports_events());
        match stream_type {
            StreamType::Compute => Box::new(OwnWorker(base)),
            _ => self.inner.stream_policy(index, stream_type, mode),
        }
    }
    fn create_stream(&self, index: u32, stream_type: StreamType) -> Result<Arc<dyn DeviceStream>> {
        self.inner.create_stream(index, stream_type)
    }
    fn allocator(&self, index: u32) -> Result<Arc<dyn DeviceAllocator>> {
        self.inner.allocator(index)
    }
}

#[test]
fn an_adapter_chooses_its_stream_policies_and_the_vm_follows_them() {
    let sim = SimAdapter::new(SimConfig::random(1, 0x5eed));
    let adapter = Arc::new(OwnThreadCompute { inner: sim });
    let vm = VirtualMachine::with_adapters(Config::default(), vec![adapter]).unwrap();
    let s = vm.stream(StreamId::compute(sim_device(0), 0)).unwrap();
    let (a, b) = (
        vm.new_tensor_on(&s, 8).unwrap(),
        vm.new_tensor_on(&s, 8).unwrap(),
    );
    for i in 0..20u64 {
        vm.run(|bl| {
            bl.call(&s, &[], &[&a], move |k| k.output_u64(0)[0] = i)?;
            bl.call(&s, &[&a], &[&b], |k| {
                let x = k.input_u64(0)[0];
                k.output_u64(0)[0] = 3 * x + 1;
            })
        })
        .unwrap();
        let mut out = [0u8; 8];
        vm.read_small(&b, 0, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 3 * i + 1);
    }
    let threads: Vec<String> = vm
        .stats()
        .unwrap()
        .threads
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(
        threads.iter().any(|t| t.contains("-sim-Compute")),
        "the compute stream has a thread of its own: {threads:?}"
    );
    assert!(
        !threads.iter().any(|t| t.contains("sim:0-t0")),
        "and does not share the device's thread: {threads:?}"
    );
    vm.shutdown().unwrap();
}

#[test]
fn device_kinds_are_names_registered_once() {
    assert_eq!(SIM.name(), "sim");
    assert_eq!(sim_device(2).to_string(), "sim:2");
    let two = vec![
        SimAdapter::new(SimConfig::default()) as Arc<dyn DeviceAdapter>,
        SimAdapter::new(SimConfig::default()),
    ];
    assert!(matches!(
        VirtualMachine::with_adapters(Config::default(), two),
        Err(Error::Config(_))
    ));

    /// The sim under another name.
    #[derive(Debug)]
    struct Renamed(Arc<SimAdapter>, DeviceKind);
    impl DeviceAdapter for Renamed {
        fn kind(&self) -> DeviceKind {
            self.1
        }
        fn device_count(&self) -> u32 {
            self.0.device_count()
        }
        fn create_stream(&self, i: u32, t: StreamType) -> Result<Arc<dyn DeviceStream>> {
            self.0.create_stream(i, t)
        }
        fn allocator(&self, i: u32) -> Result<Arc<dyn DeviceAllocator>> {
            self.0.allocator(i)
        }
    }
    for bad in ["cpu", "", "np u", "npu:0"] {
        let a = Arc::new(Renamed(
            SimAdapter::new(SimConfig::default()),
            DeviceKind::named(bad),
        ));
        assert!(
            matches!(
                VirtualMachine::with_adapters(Config::default(), vec![a]),
                Err(Error::Config(_))
            ),
            "{bad:?} is refused"
        );
    }
}
