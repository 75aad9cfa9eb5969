//! A [`VirtualMachine`]'s life: starting it (adapters, its scheduler thread and default
//! stream), its configuration and foreign hooks, and shutdown (drain, join, device wait),
//! also on drop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Threads, VirtualMachine};
use crate::device::DeviceAdapter;
use crate::device::cpu::CpuAdapter;
use crate::device::policy::{CpuStreamPolicy, PolicyAnswers};
use crate::engine::core::{NEXT_VM_ID, VmCore, inside};
use crate::model::stream::{DeviceCtx, StreamShared};
use crate::runtime::shared::{Registry, VmShared};
use crate::util::config::{Config, Mode};
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;
use crate::util::hooks::ForeignHooks;
use crate::util::ids::{Device, DeviceKind, StreamId, StreamType};
use crate::util::lock;

impl VirtualMachine {
    /// Starts a VM with the cpu adapter only (in multi-thread mode: its scheduler thread
    /// and the default cpu stream's worker).
    pub fn new(config: Config) -> Result<Self> {
        Self::with_adapters(config, Vec::new())
    }

    /// Starts a VM with the cpu adapter plus `adapters` (one per device kind; the cpu
    /// adapter is built in). Streams and tensors of a device kind without an adapter are
    /// errors ([`Error::UnsupportedStream`]).
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration, a second adapter of one kind or a cpu
    /// adapter; [`Error::Spawn`] if a thread cannot start.
    pub fn with_adapters(config: Config, adapters: Vec<Arc<dyn DeviceAdapter>>) -> Result<Self> {
        Self::start(
            config,
            adapters,
            #[cfg(feature = "fuzzing")]
            ivm_engine::PlantedBug::None,
        )
    }

    /// Starts a VM (see [`with_adapters`](Self::with_adapters)); with the `fuzzing` feature
    /// the equivalence fuzzer's own tests may plant an engine bug.
    pub(crate) fn start(
        config: Config,
        adapters: Vec<Arc<dyn DeviceAdapter>>,
        #[cfg(feature = "fuzzing")] planted: ivm_engine::PlantedBug,
    ) -> Result<Self> {
        config.validate()?;
        let mut all: Vec<Arc<dyn DeviceAdapter>> = vec![Arc::new(CpuAdapter::new())];
        for a in adapters {
            if a.kind() == DeviceKind::CPU {
                return Err(Error::Config("the cpu adapter is built in".into()));
            }
            if !a.kind().is_valid() {
                return Err(Error::Config(format!(
                    "device kind {:?}: a name is ASCII letters, digits, '-' and '_'",
                    a.kind().name()
                )));
            }
            if all.iter().any(|b| b.kind() == a.kind()) {
                return Err(Error::Config(format!(
                    "two adapters for device kind {:?}",
                    a.kind()
                )));
            }
            all.push(a);
        }
        let events = all.iter().any(|a| a.supports_events());
        if config.trace {
            crate::model::trace::set_enabled(true);
        }
        let single = config.mode == Mode::SingleThread;
        let parking = Arc::new(crate::engine::drive::EngineToken::for_mode(single));
        let id = NEXT_VM_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let barrier_stream = Arc::new(StreamShared {
            vm_id: id,
            index: 0,
            id: StreamId {
                device: Device::CPU,
                stream_type: StreamType::Barrier,
                thread_id: 0,
            },
            policy: PolicyAnswers::of(&CpuStreamPolicy(StreamType::Barrier)),
            in_build_order: false,
            thread: None,
            dev: DeviceCtx::cpu(parking.clone(), single),
        });
        let core = Arc::new(VmCore::new(
            id,
            config,
            parking,
            #[cfg(feature = "fuzzing")]
            planted,
        ));
        let shared = Arc::new(VmShared {
            core: core.clone(),
            id,
            registry: Mutex::new(Registry {
                streams: HashMap::new(),
                threads: HashMap::new(),
                handles: Vec::new(),
                next_index: 1,
            }),
            barrier_stream,
            default_cpu: OnceLock::new(),
            lazy: OnceLock::new(),
            adapters: all,
            events,
        });
        let mut threads = Threads {
            scheduler: None,
            drained: false,
            joined: false,
        };
        if !single {
            // Registered here, so that the new thread allocates nothing for it.
            let _ = core.stats().thread(&format!("ivm{id}-scheduler"));
            let s = core.clone();
            let h = std::thread::Builder::new()
                .name(format!("ivm{id}-scheduler"))
                .spawn(move || crate::engine::scheduler::scheduler_loop(s))
                .map_err(|e| Error::Spawn(e.to_string()))?;
            threads.scheduler = Some(h);
        }
        core.token().set_vm(&core);
        let vm = VirtualMachine {
            shared,
            threads: Mutex::new(threads),
        };
        let d = vm.shared.stream(StreamId::default_for(Device::CPU))?;
        let _ = vm.shared.default_cpu.set(d);
        Ok(vm)
    }

    /// The VM's configuration.
    pub fn config(&self) -> &Config {
        self.shared.core.config()
    }

    /// Installs an embedding runtime's hooks ([`ForeignHooks`]: a [`WaitHook`] called
    /// around every blocking wait of a call into this VM, a [`DropSink`] for the captures
    /// of closures the VM drops without running them). Once per VM, best right after
    /// creating it: waits that already started, and closures submitted before, do not
    /// use them.
    ///
    /// # Errors
    /// [`Error::Config`] if hooks were installed before.
    ///
    /// [`WaitHook`]: crate::WaitHook
    /// [`DropSink`]: crate::DropSink
    pub fn set_foreign_hooks(&self, hooks: ForeignHooks) -> Result<()> {
        self.shared.core.set_foreign_hooks(hooks)
    }

    /// Whether `shutdown` has begun.
    pub fn is_shut_down(&self) -> bool {
        self.shared.core.is_shut()
    }

    /// Stops accepting work, drains everything received, then joins every VM thread and
    /// waits for the device work launched. Idempotent; later calls return `Ok` at once.
    ///
    /// # Errors
    /// [`Error::Reentrant`] from a VM thread, kernel, callback or barrier.
    /// [`Error::Timeout`] when the drain makes no progress for one `timeout_period`, or
    /// the device work has not completed one `timeout_period` after it (an event that
    /// never completes: the diagnostic names the instruction or `device work of
    /// <stream>`); the VM accepts no work any more, and a later call retries what is left.
    pub fn shutdown(&self) -> Result<()> {
        // A fork child: the threads to join do not exist here (see `fork.rs`).
        self.shared.core.birth().check()?;
        if inside(self.shared.id) {
            return Err(Error::Reentrant);
        }
        let mut threads = lock(&self.threads);
        if threads.joined {
            return Ok(());
        }
        let _hook = self.shared.core.wait_scope();
        if !threads.drained {
            self.drain_and_join(&mut threads)?;
            threads.drained = true;
        }
        // Device work launched by released instructions (frees included) completes before
        // shutdown returns, within one timeout period (the scheduler has exited: no
        // engine part in the diagnostic).
        let deadline = crate::util::deadline_after(self.shared.core.config().timeout_period);
        self.shared
            .wait_devices(&self.shared.async_streams(), deadline, false)?;
        // Every tensor release has run: give the cached memory back to the devices.
        let _ = self.shared.release_caches(None);
        threads.joined = true;
        Ok(())
    }

    /// Shutdown's first part: closes the gate, drains the engine, joins the threads.
    fn drain_and_join(&self, threads: &mut Threads) -> Result<()> {
        // Then every push of a caller that got in is in the queue (`engine/gate.rs`).
        self.shared.core.close_gate();
        self.shared.core.wait_gate_empty();
        if self.shared.core.single_thread() {
            // Until idle: instructions completed by device events included.
            self.shared
                .core
                .drive_until(|idle| idle == Some(true), None)?;
        } else {
            // The scheduler exits once idle after seeing it.
            self.shared.core.request_stop();
            self.wait_scheduler_exit()?;
            if let Some(h) = threads.scheduler.take() {
                let _ = h.join();
            }
            let (ctxs, handles) = {
                let mut reg = lock(&self.shared.registry);
                let ctxs: Vec<_> = reg.threads.values().cloned().collect();
                (ctxs, std::mem::take(&mut reg.handles))
            };
            for c in &ctxs {
                c.close();
            }
            for h in handles {
                let _ = h.join();
            }
        }
        Ok(())
    }

    /// Waits for the scheduler thread to exit (it does once the engine is idle), failing
    /// with the diagnostic [`Error::Timeout`] after a `timeout_period` in which no
    /// instruction was released (one whose device event never completes keeps it lively).
    fn wait_scheduler_exit(&self) -> Result<()> {
        let core = &self.shared.core;
        let period = core.config().timeout_period;
        let mut last = core.progress();
        loop {
            let deadline = <FutexWait as ivm_core::wait::Wait>::now().saturating_add(period);
            if core.wait_scheduler_exit(deadline) {
                return Ok(());
            }
            let now = core.progress();
            if now == last {
                return Err(Error::Timeout(core.diagnostic()));
            }
            last = now;
        }
    }
}

impl Drop for VirtualMachine {
    fn drop(&mut self) {
        if self.shared.core.birth().is_forked() {
            // A fork child: leak the inherited state (joining threads that do not exist
            // here would hang; their handles must not be detached either).
            std::mem::forget(self.shared.clone());
            let threads = self
                .threads
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            std::mem::forget(threads.scheduler.take());
            return;
        }
        if inside(self.shared.id) {
            // Dropped on one of its own threads: cannot join ourselves. Stop accepting
            // work and let the threads wind down.
            self.shared.core.close_gate();
            self.shared.core.request_stop();
            self.shared.core.mark_handle_dropped();
            return;
        }
        let _ = self.shutdown();
        self.shared.core.mark_handle_dropped();
    }
}
