//! The VM's shared state above the engine: its [`VmCore`] (what drivers need) plus the
//! registry of streams and worker threads, the device adapters, and the lazy door's
//! per-VM state. Streams are created here (with their worker threads); tensors and
//! streams check that they belong to this VM here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use crate::device::DeviceAdapter;
use crate::device::guarded::{GuardedAllocator, GuardedStream};
use crate::device::policy::{Placement, PolicyAnswers};
use crate::engine::core::VmCore;
use crate::engine::worker::worker_loop;
use crate::model::blob::Blob;
use crate::model::instruction::{Instruction, Kind};
use crate::model::stream::{DeviceCtx, Sticky, Stream, StreamShared};
use crate::model::thread_ctx::ThreadCtx;
use crate::runtime::soft_sync::{self, Use};
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};
use crate::util::ids::{Device, DeviceKind, StreamId, StreamType};
use crate::util::lock;
use crate::util::panics::catch;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ThreadKey {
    Shared(Device, u32),
    Own(DeviceKind, StreamType),
}

pub(crate) struct Registry {
    pub(crate) streams: HashMap<StreamId, Arc<StreamShared>>,
    pub(crate) threads: HashMap<ThreadKey, Arc<ThreadCtx>>,
    pub(crate) handles: Vec<JoinHandle<()>>,
    pub(crate) next_index: u32,
}

/// State shared by the VM handle, its tensors and its streams: the engine-facing
/// [`VmCore`] (workers and the scheduler hold only that) and what sits above it.
pub(crate) struct VmShared {
    pub(crate) core: Arc<VmCore>,
    pub(crate) id: usize,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) barrier_stream: Arc<StreamShared>,
    pub(crate) default_cpu: OnceLock<Arc<StreamShared>>,
    /// The lazy-job door's per-VM state (`lazy::vm_lazy::VmLazy`), created on first use.
    /// Type-erased: the door lives in a layer above this state (ARCHITECTURE.md, "The
    /// module map").
    pub(crate) lazy: OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    /// The registered device adapters (the cpu adapter first), one per device kind.
    pub(crate) adapters: Vec<Arc<dyn DeviceAdapter>>,
    /// Some adapter supports events (soft sync can emit something).
    pub(crate) events: bool,
}

impl VmShared {
    pub(crate) fn check_tensor(&self, t: &Tensor) -> Result<()> {
        self.core.birth().check()?;
        if t.inner.vm.id != self.id {
            return Err(Error::ForeignObject("tensor"));
        }
        Ok(())
    }

    pub(crate) fn check_stream(&self, s: &Stream) -> Result<()> {
        self.core.birth().check()?;
        if s.shared.vm_id != self.id {
            return Err(Error::ForeignObject("stream"));
        }
        Ok(())
    }

    /// The default stream of `device` (sync accesses run there), created on first use.
    pub(crate) fn default_stream_of(self: &Arc<Self>, device: Device) -> Result<Arc<StreamShared>> {
        if device == Device::CPU
            && let Some(s) = self.default_cpu.get()
        {
            return Ok(s.clone());
        }
        self.stream(StreamId::default_for(device))
    }

    /// Cross-stream order before `tensors` are used on `s` (ARCHITECTURE.md, "Cross-stream
    /// order: soft sync"; see `soft_sync.rs`): pushes the stream-wait / record-event instructions it needs
    /// through `push`, then makes `s` their last-used stream.
    pub(crate) fn soft_sync<'a>(
        &self,
        tensors: impl IntoIterator<Item = &'a Tensor>,
        s: &Arc<StreamShared>,
        push: &mut dyn FnMut(Arc<Instruction>),
    ) {
        let uses = tensors.into_iter().map(|t| Use {
            last: &t.inner.last_used_stream,
            blob: &t.inner.blob,
        });
        soft_sync::before_use(self, uses, s, push);
    }

    /// The stream with dense index `index`, if it exists.
    pub(crate) fn stream_by_index(&self, index: u32) -> Option<Arc<StreamShared>> {
        lock(&self.registry)
            .streams
            .values()
            .find(|s| s.index == index)
            .cloned()
    }

    /// Tensor drop: enqueue its release on its producer (home) stream, after a soft sync
    /// when it was last used on another stream (so an asynchronous device frees it only
    /// after that stream's work on it). Never blocks, no backpressure; after shutdown does
    /// nothing (the memory goes with the last blob handle).
    pub(crate) fn enqueue_release(
        &self,
        blob: &Arc<Blob>,
        home: &Arc<StreamShared>,
        last_used: &ivm_core::sync::AtomicU32,
    ) {
        let Ok(token) = self.core.enter() else { return };
        let mut wake = false;
        let mut push = |i: Arc<Instruction>| {
            wake |= self.core.push_counted(i);
        };
        soft_sync::before_use(
            self,
            [Use {
                last: last_used,
                blob,
            }],
            home,
            &mut push,
        );
        let instr = self
            .core
            .pool()
            .instruction("release_tensor", home, Kind::Free);
        // SAFETY: not shared yet; we own the body (ownership step 1).
        unsafe { instr.body_mut() }.outputs.push(blob.clone());
        push(instr);
        self.core.pushed(wake);
        drop(token);
    }

    /// The adapter registered for `kind`.
    fn adapter(&self, kind: DeviceKind) -> Option<&Arc<dyn DeviceAdapter>> {
        self.adapters.iter().find(|a| a.kind() == kind)
    }

    fn new_stream(self: &Arc<Self>, reg: &mut Registry, id: StreamId) -> Result<Arc<StreamShared>> {
        let Some(adapter) = self.adapter(id.device.kind) else {
            return Err(Error::UnsupportedStream(format!(
                "{id}: no adapter for device {}",
                id.device
            )));
        };
        if id.device.index >= adapter.device_count() {
            return Err(Error::UnsupportedStream(format!(
                "{id}: device {} does not exist ({} device(s) of that kind)",
                id.device,
                adapter.device_count()
            )));
        }
        if id.stream_type == StreamType::Barrier {
            return Err(Error::UnsupportedStream(format!(
                "{id}: barrier streams are internal; use barrier()"
            )));
        }
        // The built-in cpu adapter is the VM's own code; any other adapter's objects are
        // called through guards that turn its panics into errors (`device/guarded.rs`).
        let builtin = id.device.kind == DeviceKind::CPU;
        let in_adapter = |call: &str, m: String| {
            Error::Device(format!("the {} adapter's {call} panicked: {m}", id.device))
        };
        let (device_stream, allocator) = catch(|| {
            Ok::<_, Error>((
                adapter.create_stream(id.device.index, id.stream_type)?,
                adapter.allocator(id.device.index)?,
            ))
        })
        .map_err(|m| in_adapter("create_stream or allocator", m))??;
        let (device_stream, mut allocator) = if builtin {
            (device_stream, allocator)
        } else {
            let errors: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
            (
                GuardedStream::wrap(device_stream, errors.clone())?,
                GuardedAllocator::wrap(allocator, id.device, errors),
            )
        };
        let cache = self.core.config().caching_allocator.then(|| {
            Arc::new(
                crate::device::alloc_cache::CachingAllocator::new(
                    allocator.clone(),
                    device_stream.clone(),
                    id.to_string(),
                )
                .with_sync_timeout(self.core.config().timeout_period),
            )
        });
        if let Some(c) = &cache {
            allocator = c.clone();
        }
        let mode = device_stream.kernel_mode();
        let policy = catch(|| {
            PolicyAnswers::of(&*adapter.stream_policy(id.device.index, id.stream_type, mode))
        })
        .map_err(|m| in_adapter("stream_policy", m))?;
        if policy.stream_type() != id.stream_type {
            return Err(Error::UnsupportedStream(format!(
                "{id}: the {} adapter's policy is for {:?} streams",
                id.device.kind,
                policy.stream_type()
            )));
        }
        let thread = if self.core.single_thread() {
            None
        } else {
            let key = match policy.placement() {
                Placement::SharedWorker => Some(ThreadKey::Shared(id.device, id.thread_id)),
                Placement::OwnWorker => Some(ThreadKey::Own(id.device.kind, id.stream_type)),
                Placement::Scheduler => None,
            };
            match key {
                None => None,
                Some(key) => Some(match reg.threads.get(&key) {
                    Some(t) => t.clone(),
                    None => {
                        let name = match key {
                            ThreadKey::Shared(d, t) => format!("ivm{}-{d}-t{t}", self.id),
                            ThreadKey::Own(k, s) => format!("ivm{}-{k:?}-{s:?}", self.id),
                        };
                        let ctx = Arc::new(ThreadCtx::new(name.clone()));
                        // Registered here, so that the new thread allocates nothing for it.
                        let _ = self.core.stats().thread(&name);
                        // Before the thread exists: after the scheduler closed the workers
                        // this fails, and no worker is left unclosed.
                        self.core.register_worker(&ctx)?;
                        let (c, s) = (ctx.clone(), self.core.clone());
                        let h = std::thread::Builder::new()
                            .name(name)
                            .spawn(move || worker_loop(c, s))
                            .map_err(|e| Error::Spawn(e.to_string()))?;
                        reg.handles.push(h);
                        reg.threads.insert(key, ctx.clone());
                        ctx
                    }
                }),
            }
        };
        let index = reg.next_index;
        reg.next_index += 1;
        let s = Arc::new(StreamShared {
            vm_id: self.id,
            index,
            id,
            in_build_order: policy.dispatch_in_build_order(),
            policy,
            thread,
            dev: DeviceCtx {
                stream: device_stream,
                allocator,
                cache,
                mode,
                wake: self.core.token().clone(),
                single_thread: self.core.single_thread(),
                sticky: Sticky::default(),
                drain_bound: self.core.config().timeout_period,
                given_up: self.core.given_up().clone(),
            },
        });
        reg.streams.insert(id, s.clone());
        Ok(s)
    }

    /// Whether the adapter of `kind` copies between two of its devices.
    pub(crate) fn supports_peer_copy(&self, kind: DeviceKind) -> bool {
        self.adapter(kind).is_some_and(|a| a.supports_peer_copy())
    }

    /// Every stream with a caching allocator (of `device` only, if given).
    pub(crate) fn cached_streams(&self, device: Option<Device>) -> Vec<Arc<StreamShared>> {
        lock(&self.registry)
            .streams
            .values()
            .filter(|s| s.dev.cache.is_some() && device.is_none_or(|d| s.id.device == d))
            .cloned()
            .collect()
    }

    /// Returns the cached blocks of every stream (of `device` only, if given) to the
    /// device allocators, each freed in its stream's order, then waits for those streams
    /// so that the devices have reclaimed them. Returns the bytes returned.
    pub(crate) fn release_caches(&self, device: Option<Device>) -> Result<usize> {
        let streams = self.cached_streams(device);
        let mut bytes = 0;
        let mut first = None;
        for s in &streams {
            if let Some(c) = &s.dev.cache {
                match c.release_cached() {
                    Ok(b) => bytes += b,
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
        }
        let deadline = crate::util::deadline_after(self.core.config().timeout_period);
        // Once shut down the scheduler no longer answers a diagnostic request.
        if let Err(e) = self.wait_devices(&streams, deadline, !self.core.is_shut()) {
            first.get_or_insert(e);
        }
        first.map_or(Ok(bytes), Err)
    }

    /// Waits until the device work queued so far on `streams` has completed, at the latest
    /// until `deadline` (`device::wait_streams`): a device whose event never completes
    /// ends the wait with [`Error::Timeout`], whose diagnostic has a `device work of
    /// <stream>` entry per stream that did not complete (after the engine's lively
    /// instructions if `engine`: false once the scheduler has exited, which would not
    /// answer), instead of blocking forever.
    pub(crate) fn wait_devices(
        &self,
        streams: &[Arc<StreamShared>],
        deadline: std::time::Instant,
        engine: bool,
    ) -> Result<()> {
        let devs: Vec<&dyn crate::device::DeviceStream> =
            streams.iter().map(|s| &*s.dev.stream).collect();
        let stuck = crate::device::wait_streams(&devs, deadline)?;
        if stuck.is_empty() {
            return Ok(());
        }
        let mut d = if engine {
            self.core.diagnostic()
        } else {
            crate::util::error::Diagnostic::default()
        };
        for (k, &(i, _)) in stuck.iter().enumerate() {
            d.lively.insert(
                k,
                crate::util::error::LivelyInstruction::device_work(streams[i].id, None),
            );
        }
        Err(Error::Timeout(d))
    }

    /// Every stream whose work completes after its launch (asynchronous devices).
    pub(crate) fn async_streams(&self) -> Vec<Arc<StreamShared>> {
        lock(&self.registry)
            .streams
            .values()
            .filter(|s| s.dev.is_async())
            .cloned()
            .collect()
    }

    pub(crate) fn barrier_stream(&self) -> Arc<StreamShared> {
        self.barrier_stream.clone()
    }

    /// The stream `id`, created on first use (with its worker thread).
    pub(crate) fn stream(self: &Arc<Self>, id: StreamId) -> Result<Arc<StreamShared>> {
        self.core.birth().check()?;
        let mut reg = lock(&self.registry);
        if let Some(s) = reg.streams.get(&id) {
            return Ok(s.clone());
        }
        if self.core.is_shut() {
            return Err(Error::ShutDown);
        }
        self.new_stream(&mut reg, id)
    }
}
