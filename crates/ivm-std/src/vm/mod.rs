//! The virtual machine: its public entry points and its threads' lifecycle.
//!
//! `VirtualMachine` is defined here; its methods live in one file per concept:
//! `lifecycle.rs` (start, configuration, shutdown and drop), `streams.rs`, `tensors.rs`
//! (creating tensors), `caches.rs` (the caching allocators), `submit.rs` (`run`, `sync`,
//! probes), `access.rs` (the small sync accesses), `async_api.rs` (their `_async` and
//! `_timeout` forms), `counters.rs`, `introspect.rs` (stats, the DAG dump) and `fork.rs`.

mod access;
mod async_api;
mod caches;
mod counters;
mod fork;
mod introspect;
mod lifecycle;
mod streams;
mod submit;
mod tensors;

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::runtime::shared::VmShared;

pub(crate) use submit::sync_devices;

/// The instruction virtual machine.
///
/// `run` builds instructions with an [`InstructionsBuilder`] and hands them to the
/// engine; `read_small` / `write_small` read or write a few bytes of a
/// tensor synchronously; `sync` waits for everything submitted before it; `shutdown` (or
/// drop) drains the VM and joins every thread.
///
/// # Examples
///
/// ```
/// use ivm_std::{Config, VirtualMachine};
///
/// let vm = VirtualMachine::new(Config::default())?;
/// let s = vm.default_stream();
/// let x = vm.new_tensor(8)?;
/// vm.run(|b| {
///     b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] = 41)?;
///     b.call(&s, &[], &[&x], |k| k.output_u64(0)[0] += 1)
/// })?;
/// let mut out = [0u8; 8];
/// vm.read_small(&x, 0, &mut out)?;
/// assert_eq!(u64::from_ne_bytes(out), 42);
/// vm.shutdown()?;
/// # Ok::<(), ivm_std::Error>(())
/// ```
///
/// [`InstructionsBuilder`]: crate::InstructionsBuilder
pub struct VirtualMachine {
    shared: Arc<VmShared>,
    threads: Mutex<Threads>,
}

struct Threads {
    scheduler: Option<JoinHandle<()>>,
    /// The VM's threads were joined (the device wait may still be owed).
    drained: bool,
    /// Shutdown completed.
    joined: bool,
}

impl std::fmt::Debug for VirtualMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualMachine")
            .field("id", &self.shared.id)
            .field("mode", &self.shared.core.config().mode)
            .finish()
    }
}

impl VirtualMachine {
    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<VmShared> {
        &self.shared
    }

    /// The shared state, for the entry points defined in the other files of `vm/`
    /// (`introspect.rs`, `async_api.rs`, `fork.rs`).
    pub(crate) fn shared_state(&self) -> &Arc<VmShared> {
        &self.shared
    }
}
