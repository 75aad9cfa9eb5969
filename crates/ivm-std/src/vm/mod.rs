//! The virtual machine: its public entry points and its threads' lifecycle.

mod async_api;
mod fork;
mod introspect;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use ivm_core::counter::BlockingCounter;
use ivm_core::sync::Ordering;

use crate::device::cpu::{CpuAdapter, HostMemory};
use crate::device::policy::CpuStreamPolicy;
use crate::device::{DeviceAdapter, DeviceMemory};
use crate::doors::builder::InstructionsBuilder;
use crate::doors::sync_access::{self, CallbackKind};
use crate::engine::DebugCounters;
use crate::engine::core::{NEXT_BLOB_ID, NEXT_VM_ID, Probe, ReentryGuard, SHUT, VmCore, inside};
use crate::model::blob::Blob;
use crate::model::instruction::Kind;
use crate::model::stream::{DeviceCtx, Stream, StreamShared};
use crate::runtime::shared::{Registry, VmShared};
use crate::runtime::tensor::Tensor;
use crate::util::config::{Config, Mode};
use crate::util::error::{Error, Result};
use crate::util::futex::FutexWait;
use crate::util::hooks::ForeignHooks;
use crate::util::ids::{Device, DeviceKind, StreamId, StreamType};
use crate::util::lock;

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
            .field("mode", &self.shared.core.config.mode)
            .finish()
    }
}

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
            policy: Box::new(CpuStreamPolicy(StreamType::Barrier)),
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
            let _ = core.stats.thread(&format!("ivm{id}-scheduler"));
            let s = core.clone();
            let h = std::thread::Builder::new()
                .name(format!("ivm{id}-scheduler"))
                .spawn(move || crate::engine::scheduler::scheduler_loop(s))
                .map_err(|e| Error::Spawn(e.to_string()))?;
            threads.scheduler = Some(h);
        }
        core.parking.set_vm(&core);
        let vm = VirtualMachine {
            shared,
            threads: Mutex::new(threads),
        };
        let d = vm.shared.stream(StreamId::default_for(Device::CPU))?;
        let _ = vm.shared.default_cpu.set(d);
        Ok(vm)
    }

    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<VmShared> {
        &self.shared
    }

    /// The shared state, for the entry points defined in the other files of `vm/`
    /// (`introspect.rs`, `async_api.rs`, `fork.rs`).
    pub(crate) fn shared_state(&self) -> &Arc<VmShared> {
        &self.shared
    }

    /// The VM's configuration.
    pub fn config(&self) -> &Config {
        &self.shared.core.config
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
        self.shared
            .core
            .foreign
            .set(hooks)
            .map_err(|_| Error::Config("foreign hooks are installed once per VM".into()))
    }

    /// The stream `id`, created on first use (with its worker thread, in multi-thread
    /// mode). Only cpu streams exist until device adapters are registered.
    pub fn stream(&self, id: StreamId) -> Result<Stream> {
        Ok(Stream {
            shared: self.shared.stream(id)?,
        })
    }

    /// The cpu device's default stream (compute, thread 0).
    pub fn default_stream(&self) -> Stream {
        Stream {
            shared: self
                .shared
                .default_cpu
                .get()
                .expect("default stream is created in `new`")
                .clone(),
        }
    }

    /// A zero-filled cpu tensor of `nbytes` bytes, homed on the default stream.
    pub fn new_tensor(&self, nbytes: usize) -> Result<Tensor> {
        self.new_tensor_on(&self.default_stream(), nbytes)
    }

    /// A zero-filled tensor of `nbytes` bytes on `stream`'s device, homed on `stream` (its
    /// release runs there).
    pub fn new_tensor_on(&self, stream: &Stream, nbytes: usize) -> Result<Tensor> {
        self.tensor_with(stream, nbytes, &[])
    }

    /// A tensor on `stream`'s device holding a copy of `data`.
    pub fn new_tensor_from(&self, stream: &Stream, data: &[u8]) -> Result<Tensor> {
        self.tensor_with(stream, data.len(), data)
    }

    fn tensor_with(&self, stream: &Stream, nbytes: usize, data: &[u8]) -> Result<Tensor> {
        self.shared.check_stream(stream)?;
        if self.shared.core.is_shut() {
            return Err(Error::ShutDown);
        }
        let dev = &stream.shared.dev;
        let (mem, reused) = self.allocate_on(&stream.shared, nbytes)?;
        if mem.nbytes() != nbytes || mem.device() != stream.id().device {
            return Err(Error::Device(format!(
                "the allocator of {} returned {} bytes on {} for {nbytes} bytes",
                stream.id().device,
                mem.nbytes(),
                mem.device()
            )));
        }
        if reused {
            return self.tensor_on_reused_block(stream, mem, data);
        }
        if !data.is_empty() {
            if let Some(p) = mem.host_ptr() {
                // SAFETY: fresh memory of `nbytes` bytes that no instruction or device work
                // can reach yet (the `DeviceMemory` contract makes `p` valid).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr(), nbytes) };
            } else {
                let src: Arc<dyn DeviceMemory> = Arc::new(HostMemory::try_from_bytes(data)?);
                // SAFETY: nothing else can reach either memory until the copy completed
                // (we wait for it below).
                unsafe { dev.stream.copy(&src, 0, &mem, 0, nbytes) }?;
                dev.stream.record_event()?.synchronize()?;
            }
        }
        Ok(Tensor::over(
            self.shared.clone(),
            stream.shared.clone(),
            mem,
        ))
    }

    /// Memory for a tensor homed on `s`: through its caching allocator when it has one
    /// (`true`: a reused block, stale and ready in `s`'s order only). Out of memory with
    /// blocks cached on the device: returns them (waiting for their streams) and retries
    /// once — not from one of this VM's threads, where waiting could deadlock.
    fn allocate_on(
        &self,
        s: &Arc<StreamShared>,
        nbytes: usize,
    ) -> Result<(Arc<dyn DeviceMemory>, bool)> {
        let name = |e: Error| match e {
            Error::OutOfMemory { detail, .. } => Error::OutOfMemory {
                nbytes,
                stream: format!("stream {}", s.id),
                detail,
            },
            e => e,
        };
        let Some(cache) = &s.dev.cache else {
            return s
                .dev
                .allocator
                .allocate(nbytes)
                .map(|m| (m, false))
                .map_err(name);
        };
        let cached_on_device = || {
            self.shared
                .cached_streams(Some(s.id.device))
                .iter()
                .filter_map(|t| t.dev.cache.as_ref())
                .any(|c| c.stats().cached_blocks > 0)
        };
        let a = match cache.allocate_on_stream(nbytes) {
            Err(Error::OutOfMemory { .. }) if !inside(self.shared.id) && cached_on_device() => {
                self.shared.release_caches(Some(s.id.device))?;
                cache.allocate_on_stream(nbytes)?
            }
            r => r?,
        };
        Ok((a.mem, a.reused))
    }

    /// A tensor over a block reused from `stream`'s cache: its bytes are stale and the
    /// previous owner's work may still be queued on the stream, so it is filled (zeros or
    /// `data`) in the stream's order — at once on a synchronous device, where nothing is
    /// queued; otherwise by a fill instruction on the stream that writes the tensor, and
    /// the stream becomes the tensor's last user, so soft sync orders other streams after
    /// the fill.
    fn tensor_on_reused_block(
        &self,
        stream: &Stream,
        mem: Arc<dyn DeviceMemory>,
        data: &[u8],
    ) -> Result<Tensor> {
        let s = &stream.shared;
        let nbytes = mem.nbytes();
        let host = mem.host_ptr();
        if s.dev.mode == crate::KernelMode::Synchronous
            && let Some(p) = host
        {
            // SAFETY: a synchronous stream freed the block only after every access to it
            // completed, and nothing else can reach it yet; `p` is valid for `nbytes`.
            unsafe {
                if data.is_empty() {
                    std::ptr::write_bytes(p.as_ptr(), 0, nbytes);
                } else {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr(), nbytes);
                }
            }
            return Ok(Tensor::over(
                self.shared.clone(),
                stream.shared.clone(),
                mem,
            ));
        }
        let (kind, source) = if host.is_some() {
            let bytes: Box<[u8]> = data.into();
            let fill = crate::model::instruction::WriteFn::new(Box::new(move |b: &mut [u8]| {
                if bytes.is_empty() {
                    b.fill(0);
                } else {
                    b.copy_from_slice(&bytes);
                }
            }));
            (Kind::Write(fill), None)
        } else {
            // Device-only memory: a copy from host memory, in stream order.
            let src = if data.is_empty() {
                HostMemory::try_zeroed(nbytes)?
            } else {
                HostMemory::try_from_bytes(data)?
            };
            let src = Blob::with_memory(
                self.shared.id,
                NEXT_BLOB_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                Arc::new(src),
            );
            let copy = Kind::Copy {
                src_offset: 0,
                dst_offset: 0,
                len: nbytes,
            };
            (copy, Some(Arc::new(src)))
        };
        let t = Tensor::over(self.shared.clone(), stream.shared.clone(), mem);
        let instr = self
            .shared
            .core
            .cell
            .pool
            .instruction("fill_reused_block", s, kind);
        {
            // SAFETY: not shared yet; we own the body (ownership step 1).
            let body = unsafe { instr.body_mut() };
            if let Some(src) = source {
                body.inputs.push(src);
            }
            body.outputs.push(t.blob().clone());
        }
        // Relaxed: bookkeeping that follows the build order (as in `soft_sync.rs`).
        t.inner.last_used_stream.store(s.index, Ordering::Relaxed);
        t.inner.producer_stream.store(s.index, Ordering::Relaxed);
        self.shared.core.receive_one(instr, false)?;
        Ok(t)
    }

    /// Returns the memory cached by every stream's caching allocator
    /// ([`crate::device::alloc_cache`]) to the device allocators, and the bytes returned.
    ///
    /// It **waits** rather than failing while streams are busy: first, like
    /// [`sync`](Self::sync), until every instruction received before this call has been
    /// released and the device work of every stream has completed (so the blocks of
    /// tensors dropped before the call are in the caches too); then it frees every cached
    /// block in its stream's order and waits for those streams, so the devices have
    /// reclaimed the memory when it returns. Other threads may keep submitting work
    /// meanwhile: a block is either in a cache (and returned here) or handed out (and not
    /// touched here), and the frees are stream-ordered.
    ///
    /// # Errors
    /// As [`sync`](Self::sync) ([`Error::Reentrant`] from a VM thread, kernel, callback or
    /// barrier; [`Error::ShutDown`]; a sticky device failure); a device allocator's error.
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_std::{Config, VirtualMachine};
    ///
    /// let vm = VirtualMachine::new(Config::default())?;
    /// let x = vm.new_tensor(1000)?;
    /// drop(x); // its 1024-byte block goes back to the default stream's cache
    /// vm.sync()?;
    /// assert_eq!(vm.cache_stats().cached_bytes, 1024);
    /// let y = vm.new_tensor(1000)?; // served from the cache
    /// assert_eq!(vm.cache_stats().hits, 1);
    /// drop(y);
    /// assert_eq!(vm.shrink_all_mem()?, 1024);
    /// assert_eq!(vm.cache_stats().cached_bytes, 0);
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn shrink_all_mem(&self) -> Result<usize> {
        self.sync()?;
        self.shared.release_caches(None)
    }

    /// The counters of every stream's caching allocator, summed (all zero when
    /// [`Config::caching_allocator`] is off).
    pub fn cache_stats(&self) -> crate::device::alloc_cache::CacheStats {
        self.shared
            .cached_streams(None)
            .iter()
            .filter_map(|s| s.dev.cache.as_ref().map(|c| c.stats()))
            .fold(
                Default::default(),
                crate::device::alloc_cache::CacheStats::merged,
            )
    }

    /// The counters of `stream`'s caching allocator (`None` without one).
    ///
    /// # Errors
    /// [`Error::ForeignObject`] for a stream of another VM.
    pub fn stream_cache_stats(
        &self,
        stream: &Stream,
    ) -> Result<Option<crate::device::alloc_cache::CacheStats>> {
        self.shared.check_stream(stream)?;
        Ok(stream.shared.dev.cache.as_ref().map(|c| c.stats()))
    }

    /// Builds instructions with `f` and hands them to the VM. If `f` returns an error,
    /// nothing is submitted. Blocks while more than the high-water mark are in flight.
    ///
    /// # Errors
    /// [`Error::Reentrant`] from a VM thread, kernel, callback or barrier;
    /// [`Error::ShutDown`]; whatever `f` returns.
    pub fn run<R>(&self, f: impl FnOnce(&mut InstructionsBuilder<'_>) -> Result<R>) -> Result<R> {
        self.shared.core.check_caller()?;
        let mut b = InstructionsBuilder::new(&self.shared);
        let r = f(&mut b)?;
        b.submit()?;
        self.shared.core.drive()?;
        Ok(r)
    }

    /// Waits until every instruction received before this call has been released and the
    /// device work of every asynchronous device stream has completed.
    ///
    /// # Errors
    /// Besides the usual ones: a sticky asynchronous failure of a device stream (a kernel
    /// that failed after its instruction was done at launch), reported once and cleared,
    /// or an error the device reported. [`Error::Timeout`] when the device work has not
    /// completed one `timeout_period` after the release (an event that never completes):
    /// its diagnostic has a `device work of <stream>` entry per stream still waited for.
    pub fn sync(&self) -> Result<()> {
        self.shared.core.check_caller()?;
        // A reusable barrier from this thread's ring: no allocation in steady state.
        let instr = sync_access::sync_barrier(&self.shared);
        sync_access::sync_wait(&self.shared, instr)?;
        let deadline = std::time::Instant::now() + self.shared.core.config.timeout_period;
        sync_devices(&self.shared, deadline)
    }

    /// Reads `out.len()` (1, 2, 4, 8 or 16) bytes of `t` at `offset`, after every
    /// instruction received before that writes `t`, and blocks until they are in `out`:
    /// the lowest-latency way to look at a tensor (see the README's latency figures).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another length or a range outside `t`;
    /// [`Error::Poisoned`] when a failed instruction wrote `t`; [`Error::Timeout`] with a
    /// diagnostic after a timeout period without progress; [`Error::Reentrant`] from one
    /// of this VM's own kernels or callbacks; [`Error::ShutDown`],
    /// [`Error::ForeignObject`], [`Error::Forked`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_std::{Config, VirtualMachine};
    ///
    /// let vm = VirtualMachine::new(Config::default())?;
    /// let t = vm.new_tensor(16)?;
    /// vm.write_small(&t, 8, &7u64.to_ne_bytes())?;
    /// let mut out = [0u8; 8];
    /// vm.read_small(&t, 8, &mut out)?;
    /// assert_eq!(u64::from_ne_bytes(out), 7);
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn read_small(&self, t: &Tensor, offset: usize, out: &mut [u8]) -> Result<()> {
        sync_access::small_access(&self.shared, t, offset, Some(out), None)
    }

    /// Writes `data` (1, 2, 4, 8 or 16 bytes) into `t` at `offset`, after every
    /// instruction received before that accesses `t`, and blocks until it is written.
    ///
    /// # Errors
    /// As [`read_small`](Self::read_small).
    pub fn write_small(&self, t: &Tensor, offset: usize, data: &[u8]) -> Result<()> {
        sync_access::small_access(&self.shared, t, offset, None, Some(data))
    }

    /// Runs `f` on `t`'s bytes (after every earlier writer) on its device's default stream
    /// and returns its result.
    pub fn access<R: Send + 'static>(
        &self,
        t: &Tensor,
        f: impl FnOnce(&[u8]) -> R + Send + 'static,
    ) -> Result<R> {
        sync_access::sync_callback(&self.shared, t, CallbackKind::Read(Box::new(f)))
    }

    /// Runs `f` on `t`'s bytes, mutably (after every earlier access), and returns its
    /// result.
    pub fn access_mut<R: Send + 'static>(
        &self,
        t: &Tensor,
        f: impl FnOnce(&mut [u8]) -> R + Send + 'static,
    ) -> Result<R> {
        sync_access::sync_callback(&self.shared, t, CallbackKind::Write(Box::new(f)))
    }

    /// Polls `probe` on the scheduler thread until it returns true, and waits for that.
    pub fn blocking_run_probe(
        &self,
        mut probe: impl FnMut() -> bool + Send + 'static,
    ) -> Result<()> {
        self.shared.core.check_caller()?;
        let panicked: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        if self.shared.core.single_thread() {
            loop {
                self.shared.core.drive()?;
                let _reentry = ReentryGuard::enter(self.shared.id);
                match catch_unwind(AssertUnwindSafe(&mut probe)) {
                    Ok(true) => return Ok(()),
                    Ok(false) => std::thread::yield_now(),
                    Err(_) => {
                        return Err(Error::KernelPanicked {
                            instruction: "probe".into(),
                            message: "probe panicked".into(),
                        });
                    }
                }
            }
        }
        let _hook = self.shared.core.wait_scope();
        let done = Arc::new(BlockingCounter::<FutexWait>::new(1));
        let (d2, p2) = (done.clone(), panicked.clone());
        self.shared.core.submit_probe(Probe::User(Box::new(move || {
            let r = match catch_unwind(AssertUnwindSafe(&mut probe)) {
                Ok(r) => r,
                Err(_) => {
                    *lock(&p2) = Some("probe panicked".into());
                    true
                }
            };
            if r {
                // Release: publishes the probe's effects to the waiting caller.
                d2.decrease();
            }
            r
        })));
        let _ = done.wait_until_zero(Duration::MAX, || false);
        match lock(&panicked).take() {
            Some(m) => Err(Error::KernelPanicked {
                instruction: "probe".into(),
                message: m,
            }),
            None => Ok(()),
        }
    }

    /// Instructions received and not yet released.
    pub fn flying_instruction_count(&self) -> usize {
        self.shared.core.flying()
    }

    /// Whether `shutdown` has begun.
    pub fn is_shut_down(&self) -> bool {
        self.shared.core.is_shut()
    }

    /// How many small sync accesses ran without a worker (see
    /// [`Config::inline_sync_access`]): `(direct, inline)` — done by their caller with no
    /// instruction at all (nothing in flight), or run as an instruction by the thread that
    /// drove the engine. For tests and benchmarks.
    #[doc(hidden)]
    pub fn debug_inline_accesses(&self) -> (usize, usize) {
        (
            self.shared.core.cell.direct_runs(),
            self.shared.core.cell.inline_runs(),
        )
    }

    /// How many small sync accesses the VM's polling workers did through their express
    /// lanes (`model/express.rs`: no instruction, the engine at rest). For tests and
    /// benchmarks.
    #[doc(hidden)]
    pub fn debug_express_accesses(&self) -> usize {
        let mut n = 0;
        let mut k = 0;
        while let Some(ctx) = self.shared.core.worker(k) {
            // Relaxed: a statistic.
            n += ctx.express_served.load(Ordering::Relaxed);
            k += 1;
        }
        n
    }

    /// Live engine objects and instructions in flight. After `shutdown` all are zero.
    #[doc(hidden)]
    pub fn debug_counters(&self) -> DebugCounters {
        DebugCounters {
            instructions: self.shared.core.live[0].load(Ordering::Relaxed),
            accesses: self.shared.core.live[1].load(Ordering::Relaxed),
            edges: self.shared.core.live[2].load(Ordering::Relaxed),
            flying: self.shared.core.flying(),
        }
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
        self.shared.core.birth.check()?;
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
        let deadline = std::time::Instant::now() + self.shared.core.config.timeout_period;
        self.shared
            .wait_devices(&self.shared.async_streams(), deadline, false)?;
        // Every tensor release has run: give the cached memory back to the devices.
        let _ = self.shared.release_caches(None);
        threads.joined = true;
        Ok(())
    }

    /// Shutdown's first part: closes the gate, drains the engine, joins the threads.
    fn drain_and_join(&self, threads: &mut Threads) -> Result<()> {
        // AcqRel: pairs with callers' Acquire `enter`; see `CallerToken`.
        self.shared.core.state.fetch_or(SHUT, Ordering::AcqRel);
        // Acquire: pairs with `CallerToken::drop`; their pushes are then in the queue.
        while self.shared.core.state.load(Ordering::Acquire) >> 1 != 0 {
            std::thread::yield_now();
        }
        if self.shared.core.single_thread() {
            // Until idle: instructions completed by device events included.
            self.shared
                .core
                .drive_until(|idle| idle == Some(true), None)?;
        } else {
            // Release: the scheduler exits once idle after seeing it.
            self.shared.core.stop.store(true, Ordering::Release);
            self.shared.core.parking.unpark();
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
        let period = core.config.timeout_period;
        let mut last = core.progress();
        loop {
            let deadline = <FutexWait as ivm_core::wait::Wait>::now().saturating_add(period);
            // Acquire inside: pairs with the scheduler's Release decrease at its exit.
            if let Ok(ivm_core::notifier::Timed::Notified) =
                core.scheduler_running.timed_wait_until_zero(deadline)
            {
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

/// The device half of `sync`: instructions on asynchronous devices are released when
/// launched, so it waits for their device work too, until `deadline` at the latest. A
/// host-observed completion: reports (and clears) sticky failures and device errors,
/// except after a timeout, which leaves them to the next observation.
pub(crate) fn sync_devices(shared: &VmShared, deadline: std::time::Instant) -> Result<()> {
    let streams = shared.async_streams();
    let _hook = (!streams.is_empty()).then(|| shared.core.wait_scope());
    shared.wait_devices(&streams, deadline, true)?;
    let mut first = None;
    for s in &streams {
        let f = s.dev.sticky.take().map(|f| f.poison_error());
        let e = s.dev.stream.take_error().map(Error::Device);
        if first.is_none() {
            first = f.or(e);
        }
    }
    first.map_or(Ok(()), Err)
}

impl Drop for VirtualMachine {
    fn drop(&mut self) {
        if self.shared.core.birth.is_forked() {
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
            self.shared.core.state.fetch_or(SHUT, Ordering::AcqRel);
            self.shared.core.stop.store(true, Ordering::Release);
            self.shared.core.parking.unpark();
            return;
        }
        let _ = self.shutdown();
    }
}
