//! A kernel: what it sees when it runs ([`KernelCtx`]: its operands' bytes and device
//! pointers, the device stream it was launched on) and how its closure is kept
//! ([`KernelFn`]: stored inline in its instruction when it is small, at most
//! [`INLINE_BYTES`] bytes with alignment at most 8, boxed otherwise). With pooled
//! instructions (`pool.rs`) a `call` with a plain `fn` or a small closure allocates
//! nothing.

use core::marker::PhantomData;
use core::mem::{ManuallyDrop, MaybeUninit, align_of, size_of};

use std::sync::Arc;

use crate::device::DeviceStream;
use crate::model::blob::Blob;
use crate::util::hooks::{Captures, DropSink};

/// What a kernel sees: its input and output tensors' bytes (host-accessible memory: the
/// cpu, the sim), their device pointers, and the device stream it was launched on.
///
/// On a [`KernelMode::Launcher`](crate::KernelMode::Launcher) device (cuda, the sim with
/// `launcher` set) the body runs on the VM's worker *ahead of* the device: work enqueued
/// on the stream before it may still be running, so the body does not touch the operands'
/// bytes ([`input`](Self::input) and [`output`](Self::output) panic there, failing the
/// kernel); it enqueues device work on [`device_stream`](Self::device_stream), or host
/// work over the bytes with [`on_host`](Self::on_host).
pub struct KernelCtx<'a> {
    pub(crate) inputs: &'a [Arc<Blob>],
    pub(crate) outputs: &'a [Arc<Blob>],
    pub(crate) stream: Option<&'a dyn DeviceStream>,
    /// The instruction whose body runs on a launcher device's worker (`None` elsewhere):
    /// what [`on_host`](Self::on_host) enqueues host work for.
    pub(crate) launcher: Option<&'a dyn HostEnqueue>,
}

/// Enqueues host kernels for an instruction running on a launcher device's worker, in its
/// device stream's order (implemented by the engine, `engine/device_launch/`: the model
/// does not reach up to it).
pub(crate) trait HostEnqueue {
    /// Enqueues `f` over `inputs` and `outputs`.
    fn enqueue_host(
        &self,
        inputs: &[Arc<Blob>],
        outputs: &[Arc<Blob>],
        f: KernelFn,
    ) -> crate::Result<()>;
}

impl<'a> KernelCtx<'a> {
    /// Number of inputs.
    pub fn num_inputs(&self) -> usize {
        self.inputs.len()
    }

    /// Number of outputs.
    pub fn num_outputs(&self) -> usize {
        self.outputs.len()
    }

    /// The bytes of input `i`. Panics (caught: the instruction fails) if out of range, and
    /// on a launcher device's worker (see the type's docs).
    pub fn input(&self, i: usize) -> &'a [u8] {
        self.check_host_bytes();
        // SAFETY: this body reads input `i` (engine-ordered invariant: no writer runs
        // concurrently); the builder rejects a blob that is both input and output.
        unsafe { self.inputs[i].bytes() }
    }

    /// The bytes of output `i`. Panics (caught: the instruction fails) if out of range, and
    /// on a launcher device's worker (see the type's docs).
    pub fn output(&mut self, i: usize) -> &mut [u8] {
        self.check_host_bytes();
        // SAFETY: this body writes output `i` exclusively (engine-ordered invariant);
        // outputs are distinct blobs and `&mut self` allows one at a time.
        unsafe { self.outputs[i].bytes_mut() }
    }

    /// The device address of input `i` (for kernels that launch real device work).
    pub fn input_device_ptr(&self, i: usize) -> u64 {
        self.inputs[i].mem.device_ptr()
    }

    /// The device address of output `i`.
    pub fn output_device_ptr(&self, i: usize) -> u64 {
        self.outputs[i].mem.device_ptr()
    }

    /// The memory of input `i` (for kernels that enqueue copies on
    /// [`device_stream`](Self::device_stream)).
    pub fn input_memory(&self, i: usize) -> &'a Arc<dyn crate::device::DeviceMemory> {
        &self.inputs[i].mem
    }

    /// The memory of output `i`.
    pub fn output_memory(&self, i: usize) -> &'a Arc<dyn crate::device::DeviceMemory> {
        &self.outputs[i].mem
    }

    /// The device stream the kernel runs on. On a [`KernelMode::Launcher`] device (cuda)
    /// the kernel enqueues its device work here; it is `None` for kernels that run inside
    /// the device queue ([`KernelMode::Queued`], the sim). On the cpu's synchronous
    /// streams it is `Some` too: check [`DeviceStream::kernel_mode`] before enqueueing.
    ///
    /// [`KernelMode::Launcher`]: crate::KernelMode::Launcher
    /// [`KernelMode::Queued`]: crate::KernelMode::Queued
    pub fn device_stream(&self) -> Option<&'a dyn DeviceStream> {
        self.stream
    }

    /// Runs `f` over this kernel's operands where host code may touch their bytes: at once
    /// where the body itself runs in the device's order (the cpu; a queued device such as
    /// the sim, whose kernel bodies run in its queue), and on a launcher device (cuda) as a
    /// host closure enqueued on [`device_stream`](Self::device_stream), which runs after
    /// every work item enqueued on the stream before it. There, like a queued device's
    /// kernel, the closure sees the stream's earlier failure or a poisoned operand and then
    /// does not run (the outputs are poisoned), and a panic in it poisons the outputs and
    /// fails the stream's next host-observed completion. (Device-only memory has no bytes
    /// on the host: there, `f` fails when it asks for them.)
    ///
    /// # Errors
    /// The device's refusal of the closure ([`DeviceStream::launch_host`]); `f` then never
    /// runs, so a kernel fails itself with it (panics) unless it has another way.
    ///
    /// # Examples
    ///
    /// ```
    /// # let vm = ivm_std::VirtualMachine::new(ivm_std::Config::default())?;
    /// # let (s, x) = (vm.default_stream(), vm.new_tensor(8)?);
    /// vm.run(|b| {
    ///     b.call(&s, &[], &[&x], |k| {
    ///         k.on_host(|k| k.output_u64(0)[0] = 7)
    ///             .unwrap_or_else(|e| panic!("{e}"))
    ///     })
    /// })?;
    /// # let mut out = [0u8; 8];
    /// # vm.read_small(&x, 0, &mut out)?;
    /// # assert_eq!(u64::from_ne_bytes(out), 7);
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn on_host<F>(&mut self, f: F) -> crate::Result<()>
    where
        F: FnOnce(&mut KernelCtx<'_>) + Send + 'static,
    {
        match self.launcher {
            None => {
                f(self);
                Ok(())
            }
            Some(l) => l.enqueue_host(self.inputs, self.outputs, KernelFn::new(f)),
        }
    }

    fn check_host_bytes(&self) {
        if self.launcher.is_some() {
            panic!(
                "ivm: a kernel on a launcher device runs ahead of the device and must not \
                 touch its operands' bytes; enqueue the work with KernelCtx::on_host or on \
                 KernelCtx::device_stream"
            );
        }
    }

    /// Input `i` as `u64`s (tensor memory is 8-byte aligned; a trailing partial word is
    /// left out).
    pub fn input_u64(&self, i: usize) -> &'a [u64] {
        words(self.input(i))
    }

    /// Output `i` as `u64`s (a trailing partial word is left out).
    pub fn output_u64(&mut self, i: usize) -> &mut [u64] {
        words_mut(self.output(i))
    }
}

fn words(b: &[u8]) -> &[u64] {
    if b.len() < 8 {
        // No whole word; and an empty tensor's slice is dangling (address 1), not aligned.
        return &[];
    }
    // SAFETY: a tensor's host memory is 8-byte aligned (the `DeviceMemory` contract; the
    // cpu's `HostMemory` is 128-byte aligned), so `b` is; `len / 8` whole words lie inside
    // it and every bit pattern is a valid u64.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u64>(), b.len() / 8) }
}

fn words_mut(b: &mut [u8]) -> &mut [u64] {
    if b.len() < 8 {
        // As in `words`.
        return &mut [];
    }
    // SAFETY: as in `words`, and `b` is borrowed mutably for the returned lifetime.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u64>(), b.len() / 8) }
}

/// Captured bytes a kernel closure may have and still be stored inline.
pub const INLINE_BYTES: usize = 64;

type Words = [u64; INLINE_BYTES / 8];

enum Repr {
    /// The closure's bytes, and how to call it (consuming it) or drop it.
    Inline {
        buf: MaybeUninit<Words>,
        call: unsafe fn(*mut Words, &mut KernelCtx<'_>),
        /// `None` once the closure was called in place ([`KernelFn::call_in_place`]): the
        /// bytes are spent, nothing is left to drop or box.
        drop: Option<unsafe fn(*mut Words)>,
        /// Moves the closure into a box (for a [`DropSink`]).
        boxed: unsafe fn(*mut Words) -> Box<dyn Send>,
    },
    /// Too big or over-aligned.
    Boxed(Box<dyn FnOnce(&mut KernelCtx<'_>) + Send>),
}

/// A kernel: runs once, on its stream's thread, over its inputs and outputs.
pub(crate) struct KernelFn {
    repr: Repr,
    /// Where the closure goes if it is dropped without running ([`route_drops`]).
    ///
    /// [`route_drops`]: Self::route_drops
    sink: Option<Arc<dyn DropSink>>,
    /// `Send` (every stored closure is), never `Sync`: one owner at a time.
    _not_sync: PhantomData<core::cell::Cell<()>>,
}

// SAFETY: `new` only accepts `F: Send`; the inline bytes are such an `F`, moved, never
// shared.
unsafe impl Send for KernelFn {}

/// Calls the `F` stored in `buf`, consuming it.
///
/// # Safety
/// `buf` holds an initialised `F` that nobody uses afterwards.
unsafe fn call_inline<F: FnOnce(&mut KernelCtx<'_>)>(buf: *mut Words, ctx: &mut KernelCtx<'_>) {
    // SAFETY: by the contract, `buf` holds an `F` (written by `new`, suitably aligned:
    // `Words` is 8-aligned and `align_of::<F>() <= 8`); we move it out exactly once.
    let f = unsafe { buf.cast::<F>().read() };
    f(ctx);
}

/// Moves the `F` stored in `buf` into a box.
///
/// # Safety
/// As for [`call_inline`].
unsafe fn box_inline<F: Send + 'static>(buf: *mut Words) -> Box<dyn Send> {
    // SAFETY: as in `call_inline`: an initialised `F`, moved out exactly once.
    Box::new(unsafe { buf.cast::<F>().read() })
}

/// Drops the `F` stored in `buf`.
///
/// # Safety
/// As for [`call_inline`].
unsafe fn drop_inline<F>(buf: *mut Words) {
    // SAFETY: as in `call_inline`: an initialised `F`, dropped exactly once.
    unsafe { buf.cast::<F>().drop_in_place() };
}

impl KernelFn {
    /// Stores `f` inline if it fits, boxes it otherwise.
    pub(crate) fn new<F>(f: F) -> Self
    where
        F: FnOnce(&mut KernelCtx<'_>) + Send + 'static,
    {
        let repr = if size_of::<F>() <= INLINE_BYTES && align_of::<F>() <= align_of::<Words>() {
            let mut buf = MaybeUninit::<Words>::uninit();
            // SAFETY: `buf` is large enough and aligned enough for `F` (checked above).
            unsafe { buf.as_mut_ptr().cast::<F>().write(f) };
            Repr::Inline {
                buf,
                call: call_inline::<F>,
                drop: Some(drop_inline::<F>),
                boxed: box_inline::<F>,
            }
        } else {
            Repr::Boxed(Box::new(f))
        };
        Self {
            repr,
            sink: None,
            _not_sync: PhantomData,
        }
    }

    /// If this kernel is dropped without running, its closure (and so what it captured)
    /// goes to `sink` instead of being dropped here.
    pub(crate) fn route_drops(&mut self, sink: Arc<dyn DropSink>) {
        self.sink = Some(sink);
    }

    /// Whether the closure is stored inline (no allocation).
    #[cfg(test)]
    pub(crate) fn is_inline(&self) -> bool {
        matches!(self.repr, Repr::Inline { .. })
    }

    /// Runs the kernel (once: consumes it).
    pub(crate) fn call(self, ctx: &mut KernelCtx<'_>) {
        let me = ManuallyDrop::new(self);
        // SAFETY: `me` is never used nor dropped after these reads: the closure and the
        // sink move out (plain movable values), each consumed below exactly once (the
        // sink is dropped unused: a kernel that runs drops its own captures).
        let (repr, _sink) = unsafe { (core::ptr::read(&me.repr), core::ptr::read(&me.sink)) };
        match repr {
            Repr::Inline {
                mut buf,
                call,
                drop: Some(_),
                ..
            } => {
                // SAFETY: `buf` holds the `F` written by `new`, moved here intact (`drop`
                // is still `Some`: not called in place).
                unsafe { call(buf.as_mut_ptr(), ctx) }
            }
            // Spent by `call_in_place`.
            Repr::Inline { drop: None, .. } => {}
            Repr::Boxed(f) => f(ctx),
        }
    }

    /// Runs the kernel where it lies (once: afterwards it holds nothing to run or drop),
    /// without moving it: the inline bytes are read out by the call itself, the closure's
    /// own size and no more.
    pub(crate) fn call_in_place(&mut self, ctx: &mut KernelCtx<'_>) {
        // Dropped unused after the call, as in `call`: a kernel that runs drops its own
        // captures.
        let _sink = self.sink.take();
        match &mut self.repr {
            Repr::Inline {
                buf, call, drop, ..
            } => {
                // Taken before the call: `call_inline` moves the closure out first, so
                // from here on a drop of `self` (after the call, or after a panic in it)
                // leaves the bytes alone. A spent kernel runs nothing.
                if drop.take().is_none() {
                    return;
                }
                // SAFETY: `buf` holds the `F` written by `new`, not moved out yet: `drop`
                // was still `Some`, and only this method takes it (`call` consumes
                // `self`, `Drop` runs last).
                unsafe { call(buf.as_mut_ptr(), ctx) }
            }
            Repr::Boxed(f) => {
                // A zero-sized stand-in: no allocation.
                let f = core::mem::replace(f, Box::new(|_: &mut KernelCtx<'_>| {}));
                f(ctx);
            }
        }
    }
}

/// Hands an unrun closure's captures to the sink. The sink and the captures' `Drop` are
/// user code: their panics are caught, so that dropping a kernel never unwinds (it happens
/// on VM threads, inside engine steps).
fn send_to(sink: Arc<dyn DropSink>, captures: Box<dyn Send>) {
    let _ = crate::util::panics::catch(move || sink.send(Captures::new(captures)));
}

impl Drop for KernelFn {
    fn drop(&mut self) {
        let sink = self.sink.take();
        match (&mut self.repr, sink) {
            (Repr::Inline { drop: None, .. }, _) => {}
            (Repr::Inline { buf, boxed, .. }, Some(sink)) => {
                // SAFETY: not called: `call` never drops `self`, and `drop` is still `Some`,
                // so `call_in_place` has not run either; `buf` still holds the `F`, moved
                // out exactly once here, never dropped in place.
                let b = unsafe { boxed(buf.as_mut_ptr()) };
                send_to(sink, b);
            }
            (
                Repr::Inline {
                    buf,
                    drop: Some(drop),
                    ..
                },
                None,
            ) => {
                let (buf, drop) = (buf.as_mut_ptr(), *drop);
                // SAFETY: as above; dropped exactly once here (a panicking drop has
                // dropped what it could: the bytes are never touched again).
                let _ = crate::util::panics::catch(|| unsafe { drop(buf) });
            }
            (Repr::Boxed(_), sink) => {
                // A zero-sized stand-in: no allocation.
                let empty = Repr::Boxed(Box::new(|_: &mut KernelCtx<'_>| {}));
                if let Repr::Boxed(f) = core::mem::replace(&mut self.repr, empty) {
                    match sink {
                        Some(sink) => send_to(sink, Box::new(f)),
                        None => {
                            let _ = crate::util::panics::drop_caught(f);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn ctx_call(f: KernelFn) {
        let mut ctx = KernelCtx {
            inputs: &[],
            outputs: &[],
            stream: None,
            launcher: None,
        };
        f.call(&mut ctx);
    }

    #[test]
    fn small_closures_inline_big_ones_boxed_all_called_once() {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let small = KernelFn::new(move |c: &mut KernelCtx<'_>| {
            assert_eq!(c.num_inputs(), 0);
            h.fetch_add(1, Ordering::Relaxed);
        });
        assert!(small.is_inline());
        ctx_call(small);
        let h = hits.clone();
        let big = [7u64; 16];
        let boxed = KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            h.fetch_add(big[3] as usize, Ordering::Relaxed);
        });
        assert!(!boxed.is_inline());
        ctx_call(boxed);
        fn plain(_c: &mut KernelCtx<'_>) {}
        assert!(KernelFn::new(plain).is_inline());
        assert_eq!(hits.load(Ordering::Relaxed), 8);
        assert_eq!(
            Arc::strong_count(&hits),
            1,
            "captures dropped after the call"
        );
    }

    #[test]
    fn dropped_uncalled_closures_drop_their_captures() {
        let hits = Arc::new(AtomicUsize::new(0));
        let (a, b) = (hits.clone(), hits.clone());
        drop(KernelFn::new(move |_c: &mut KernelCtx<'_>| drop(a)));
        let big = [0u8; 100];
        drop(KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            let _ = (&b, big);
        }));
        assert_eq!(Arc::strong_count(&hits), 1);
    }

    /// Collects what it is sent.
    struct Keep(std::sync::Mutex<Vec<crate::Captures>>);

    impl DropSink for Keep {
        fn send(&self, captures: crate::Captures) {
            self.0.lock().unwrap().push(captures);
        }
    }

    #[test]
    fn routed_closures_go_to_the_sink_unless_called() {
        let hits = Arc::new(AtomicUsize::new(0));
        let sink = Arc::new(Keep(std::sync::Mutex::new(Vec::new())));
        let big = [0u8; 100];
        let (a, b, c) = (hits.clone(), hits.clone(), hits.clone());
        let mut inline = KernelFn::new(move |_c: &mut KernelCtx<'_>| drop(a));
        let mut boxed = KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            let _ = (&b, big);
        });
        let mut called = KernelFn::new(move |_c: &mut KernelCtx<'_>| drop(c));
        assert!(inline.is_inline() && !boxed.is_inline());
        for k in [&mut inline, &mut boxed, &mut called] {
            k.route_drops(sink.clone());
        }
        drop((inline, boxed));
        ctx_call(called);
        assert_eq!(sink.0.lock().unwrap().len(), 2, "the two uncalled ones");
        assert_eq!(
            Arc::strong_count(&hits),
            3,
            "their captures are alive in the sink"
        );
        sink.0.lock().unwrap().clear();
        assert_eq!(Arc::strong_count(&hits), 1, "dropped with the captures");
        assert_eq!(
            Arc::strong_count(&sink),
            1,
            "a called kernel let go of the sink"
        );
    }

    #[test]
    fn called_in_place_runs_once_and_drops_captures_once() {
        let hits = Arc::new(AtomicUsize::new(0));
        let sink = Arc::new(Keep(std::sync::Mutex::new(Vec::new())));
        let big = [1u64; 16];
        let (a, b, c) = (hits.clone(), hits.clone(), hits.clone());
        let mut inline = KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            a.fetch_add(1, Ordering::Relaxed);
        });
        let mut boxed = KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            b.fetch_add(big[0] as usize, Ordering::Relaxed);
        });
        let mut panics = KernelFn::new(move |_c: &mut KernelCtx<'_>| {
            let _c = &c;
            panic!("kernel");
        });
        assert!(inline.is_inline() && !boxed.is_inline() && panics.is_inline());
        let mut ctx = KernelCtx {
            inputs: &[],
            outputs: &[],
            stream: None,
            launcher: None,
        };
        for k in [&mut inline, &mut boxed, &mut panics] {
            k.route_drops(sink.clone());
        }
        inline.call_in_place(&mut ctx);
        boxed.call_in_place(&mut ctx);
        assert!(crate::util::panics::catch(|| panics.call_in_place(&mut ctx)).is_err());
        assert_eq!(hits.load(Ordering::Relaxed), 2);
        assert_eq!(Arc::strong_count(&hits), 1, "captures dropped by the calls");
        // A spent kernel runs nothing again, in place or consumed, and drops nothing more.
        inline.call_in_place(&mut ctx);
        boxed.call_in_place(&mut ctx);
        inline.call(&mut ctx);
        drop((boxed, panics));
        assert_eq!(hits.load(Ordering::Relaxed), 2);
        assert!(
            sink.0.lock().unwrap().is_empty(),
            "called kernels send nothing"
        );
        assert_eq!(Arc::strong_count(&sink), 1, "and let go of the sink");
    }
}
