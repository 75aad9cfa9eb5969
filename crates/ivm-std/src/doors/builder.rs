//! [`InstructionsBuilder`]: how a front end turns operations into instructions inside
//! [`VirtualMachine::run`](crate::VirtualMachine::run).

use std::cell::RefCell;
use std::sync::Arc;

use crate::doors::custom::InstructionPolicy;
use crate::model::instruction::{Callback, Deferred, Instruction, KernelCtx, Kind};
use crate::model::instruction::{ReadFn, WriteFn};
use crate::model::stream::{Stream, StreamShared};
use crate::runtime::shared::VmShared;
use crate::runtime::tensor::Tensor;
use crate::util::error::{Error, Result};

/// A builder's two lists, kept between `run`s.
struct Spare {
    list: Vec<Arc<Instruction>>,
    released: Vec<Tensor>,
}

thread_local! {
    /// Spare lists per thread, so a `run` allocates no list in steady state (one
    /// thread-local for both: each look costs as much as a list's move).
    static SPARE: RefCell<Spare> = const {
        RefCell::new(Spare {
            list: Vec::new(),
            released: Vec::new(),
        })
    };
}

/// Collects the instructions of one [`run`](crate::VirtualMachine::run); they are handed
/// to the VM together when the closure returns `Ok`.
pub struct InstructionsBuilder<'vm> {
    vm: &'vm Arc<VmShared>,
    list: Vec<Arc<Instruction>>,
    /// Handles given up with [`release_tensor`](Self::release_tensor), dropped once `list`
    /// was received (their releases must follow this builder's instructions).
    released: Vec<Tensor>,
    /// Instructions built from now on may join a fused run ([`Self::set_fusable`]).
    fusable: bool,
}

impl std::fmt::Debug for InstructionsBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstructionsBuilder")
            .field("instructions", &self.list.len())
            .finish()
    }
}

impl<'vm> InstructionsBuilder<'vm> {
    pub(crate) fn new(vm: &'vm Arc<VmShared>) -> Self {
        let (list, released) = SPARE
            .try_with(|s| {
                s.try_borrow_mut()
                    .map(|mut s| {
                        let s = &mut *s;
                        (std::mem::take(&mut s.list), std::mem::take(&mut s.released))
                    })
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        Self {
            vm,
            list,
            released,
            fusable: true,
        }
    }

    /// Whether the instructions this builder builds from now on may join a fused run
    /// ([`Config::fusion`](crate::Config::fusion)); `true` at the start of each
    /// [`run`](crate::VirtualMachine::run). An instruction kept out runs as a hand-over of
    /// its own, and ends the run before it — for a kernel that must start as early as it
    /// can, or one timed alone.
    pub fn set_fusable(&mut self, fusable: bool) {
        self.fusable = fusable;
    }

    /// Hands the collected instructions to the VM, then drops the handles given up with
    /// [`release_tensor`](Self::release_tensor) (their releases follow the instructions).
    pub(crate) fn submit(&mut self) -> Result<()> {
        let r = self.vm.core.receive_run(&mut self.list);
        self.released.clear();
        r
    }

    /// Single-thread mode: runs the collected instructions here and now where the VM can
    /// (`VmCore::run_at_rest`), then drops the handles given up with
    /// [`release_tensor`](Self::release_tensor); else [`submit`](Self::submit)s them.
    /// Returns whether they ran here.
    pub(crate) fn run_at_rest_or_submit(&mut self) -> Result<bool> {
        let (ran, hook) = self.vm.core.run_at_rest(&mut self.list);
        let r = if ran {
            self.released.clear();
            Ok(true)
        } else {
            self.submit().map(|()| false)
        };
        // Closed once the run's work ran or was submitted: a wait hook that panicked
        // re-raises here, with nothing lost.
        drop(hook);
        r
    }

    /// Number of instructions collected so far.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether nothing was collected yet.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn check(&self, stream: &Stream, inputs: &[&Tensor], outputs: &[&Tensor]) -> Result<()> {
        self.check_operands(stream, inputs, outputs)?;
        let d = stream.id().device;
        if let Some(t) = inputs
            .iter()
            .chain(outputs)
            .find(|t| !same_device(t.device(), d))
        {
            return Err(Error::DeviceMismatch(format!(
                "a tensor on {} used on stream {} (copy it first)",
                t.device(),
                stream.id()
            )));
        }
        Ok(())
    }

    fn check_operands(
        &self,
        stream: &Stream,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
    ) -> Result<()> {
        self.vm.check_stream(stream)?;
        for t in inputs.iter().chain(outputs) {
            self.vm.check_tensor(t)?;
        }
        for (k, o) in outputs.iter().enumerate() {
            let b = o.blob();
            if outputs[..k]
                .iter()
                .chain(inputs)
                .any(|t| Arc::ptr_eq(t.blob(), b))
            {
                return Err(Error::AliasedOperand);
            }
        }
        Ok(())
    }

    fn push(
        &mut self,
        name: &'static str,
        stream: &Arc<StreamShared>,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        kind: Kind,
    ) {
        let list = &mut self.list;
        self.vm
            .soft_sync(inputs.iter().chain(outputs).copied(), stream, &mut |i| {
                list.push(i)
            });
        // Pooled: no allocation in steady state (`pool.rs`).
        let instr = self.vm.core.pool().instruction(name, stream, kind);
        {
            // SAFETY: not shared yet; the builder owns the body (ownership step 1).
            let body = unsafe { instr.body_mut() };
            body.fusable = self.fusable;
            for t in inputs {
                body.inputs.push(t.blob().clone());
            }
            for t in outputs {
                body.outputs.push(t.blob().clone());
            }
        }
        self.list.push(instr);
    }

    /// The VM this builder submits to (lazy-job launches: `lazy::launch`).
    pub(crate) fn vm(&self) -> &'vm Arc<VmShared> {
        self.vm
    }

    /// Appends a ready-made instruction (lazy-job launches).
    pub(crate) fn push_instr(&mut self, instr: Arc<Instruction>) {
        self.list.push(instr);
    }

    /// Soft-syncs `tensors` onto `stream`, appending the instructions it needs (lazy-job
    /// launches).
    pub(crate) fn soft_sync_onto(&mut self, tensors: &[&Tensor], stream: &Arc<StreamShared>) {
        let list = &mut self.list;
        self.vm
            .soft_sync(tensors.iter().copied(), stream, &mut |i| list.push(i));
    }

    /// A kernel on `stream` that reads `inputs` and writes `outputs` (a tensor may not be
    /// both, nor appear twice among outputs). The kernel runs once, on the stream's thread,
    /// after every earlier writer of its inputs and every earlier access of its outputs.
    pub fn call(
        &mut self,
        stream: &Stream,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        kernel: impl FnOnce(&mut KernelCtx<'_>) + Send + 'static,
    ) -> Result<()> {
        self.call_named("call", stream, inputs, outputs, kernel)
    }

    /// A custom instruction ([`InstructionPolicy`]): runs `policy` on `stream`'s thread
    /// after every earlier writer of `inputs` and every earlier access of `outputs`; it is
    /// complete when its [`Done`](crate::Done) handle fires, now or later, from any thread.
    /// See [`crate::custom`].
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub fn custom(
        &mut self,
        stream: &Stream,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        policy: impl InstructionPolicy,
    ) -> Result<()> {
        self.custom_named("custom", stream, inputs, outputs, policy)
    }

    /// [`custom`](Self::custom) with a name (shown in errors and diagnostics).
    ///
    /// # Errors
    /// As [`custom`](Self::custom).
    pub fn custom_named(
        &mut self,
        name: &'static str,
        stream: &Stream,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        policy: impl InstructionPolicy,
    ) -> Result<()> {
        self.check(stream, inputs, outputs)?;
        let during_launch = policy.completes_during_launch();
        // On a launcher device (cuda) the policy enqueues its device work on the stream's
        // device stream, lent to it through `KernelCtx::device_stream`.
        let device_stream = (stream.shared.dev.mode == crate::device::KernelMode::Launcher)
            .then(|| stream.shared.dev.stream.clone());
        let policy =
            Callback::<dyn InstructionPolicy>::routed(Box::new(policy), self.vm.core.drop_sink());
        let vm = Arc::downgrade(&self.vm.core);
        // The policy's own `Instruction`, outside the pool: its deferred body owns clones
        // of the operands, lent to `launch` while the instruction runs.
        self.push(name, &stream.shared, inputs, outputs, Kind::Noop);
        let instr = self.list.last_mut().expect("ivm: just pushed");
        let mut own = Instruction::new(name, stream.shared.clone(), Kind::Noop);
        own.strict_edges = !during_launch;
        {
            // SAFETY: neither is shared yet; the builder owns both bodies (ownership
            // step 1).
            let (from, to) = unsafe { (instr.body_mut(), own.body_mut()) };
            let ops = (from.inputs.clone(), from.outputs.clone());
            to.inputs = std::mem::take(&mut from.inputs);
            to.outputs = std::mem::take(&mut from.outputs);
            to.deferred = Some(Deferred {
                run: Box::new(move |c, _may_block| {
                    let stream = device_stream.as_deref();
                    crate::doors::custom::run(policy, ops, c, vm, during_launch, stream)
                }),
                // User code that may block: always on its stream's thread.
                ready_now: Some(Box::new(|| false)),
            });
        }
        *instr = Arc::new(own);
        Ok(())
    }

    /// [`call`](Self::call) with a name (shown in errors and diagnostics).
    pub fn call_named(
        &mut self,
        name: &'static str,
        stream: &Stream,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        kernel: impl FnOnce(&mut KernelCtx<'_>) + Send + 'static,
    ) -> Result<()> {
        self.check(stream, inputs, outputs)?;
        let mut kernel = crate::model::kernel::KernelFn::new(kernel);
        if let Some(sink) = self.vm.core.drop_sink() {
            kernel.route_drops(sink.clone());
        }
        self.push(name, &stream.shared, inputs, outputs, Kind::Kernel(kernel));
        Ok(())
    }

    /// Copies all of `src` into `dst` on `stream`: host to device on a host-to-device
    /// stream, device to host on a device-to-host stream, within a device (or within the
    /// host) on any stream, and device to device between two devices of one kind when
    /// their adapter [supports peer copies](crate::DeviceAdapter::supports_peer_copy)
    /// (preferably on a copy stream of either device). Each tensor must be on the stream's
    /// device, on the cpu, or (peer copies) on another device of the stream's kind.
    ///
    /// Soft sync orders the copy after the work of other streams on either tensor (a
    /// device-side wait on the same device, a host-observed event across devices), and
    /// later work on other streams after the copy. On an asynchronous device the copy is
    /// done when an event recorded after it completes (copy streams) or at launch
    /// (compute streams, ordered by the device queue).
    ///
    /// # Errors
    /// [`Error::SizeMismatch`] when the sizes differ; [`Error::DeviceMismatch`] for a
    /// tensor of a device the stream cannot copy; [`Error::AliasedOperand`] when `src` is
    /// `dst`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_std::{Config, Error, VirtualMachine};
    ///
    /// let vm = VirtualMachine::new(Config::default())?;
    /// let s = vm.default_stream();
    /// let a = vm.new_tensor_from(&s, &[1, 2, 3, 4])?;
    /// let b = vm.new_tensor(4)?;
    /// vm.run(|bld| bld.copy(&s, &a, &b))?;
    /// let mut out = [0u8; 4];
    /// vm.read_small(&b, 0, &mut out)?;
    /// assert_eq!(out, [1, 2, 3, 4]);
    /// let c = vm.new_tensor(8)?;
    /// let r = vm.run(|bld| bld.copy(&s, &a, &c));
    /// assert!(matches!(r, Err(Error::SizeMismatch { src: 4, dst: 8 })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn copy(&mut self, stream: &Stream, src: &Tensor, dst: &Tensor) -> Result<()> {
        self.copy_named("copy", stream, src, dst)
    }

    /// [`copy`](Self::copy) under `name`, which errors and diagnostics show (as
    /// `name#id`): a failed copy poisons `dst` with an error naming it.
    ///
    /// # Errors
    /// As [`copy`](Self::copy).
    ///
    /// # Examples
    ///
    /// ```
    /// use ivm_std::{Config, VirtualMachine};
    ///
    /// let vm = VirtualMachine::new(Config::default())?;
    /// let s = vm.default_stream();
    /// let a = vm.new_tensor_from(&s, &[7; 8])?;
    /// let b = vm.new_tensor(8)?;
    /// vm.run(|bld| bld.copy_named("weights_to_b", &s, &a, &b))?;
    /// let mut out = [0u8; 8];
    /// vm.read_small(&b, 0, &mut out)?;
    /// assert_eq!(out, [7; 8]);
    /// # Ok::<(), ivm_std::Error>(())
    /// ```
    pub fn copy_named(
        &mut self,
        name: &'static str,
        stream: &Stream,
        src: &Tensor,
        dst: &Tensor,
    ) -> Result<()> {
        self.check_operands(stream, &[src], &[dst])?;
        if src.nbytes() != dst.nbytes() {
            return Err(Error::SizeMismatch {
                src: src.nbytes(),
                dst: dst.nbytes(),
            });
        }
        let d = stream.id().device;
        let peer = |t: &Tensor| {
            t.device().kind == d.kind
                && t.device() != crate::Device::CPU
                && self.vm.supports_peer_copy(d.kind)
        };
        for t in [src, dst] {
            if t.device() != d && t.device() != crate::Device::CPU && !peer(t) {
                return Err(Error::DeviceMismatch(format!(
                    "a tensor on {} copied on stream {} (each side must be on {d}, the cpu, \
                     or a device of {d}'s kind whose adapter supports peer copies)",
                    t.device(),
                    stream.id()
                )));
            }
        }
        self.push(
            name,
            &stream.shared,
            &[src],
            &[dst],
            Kind::Copy {
                src_offset: 0,
                dst_offset: 0,
                len: src.nbytes(),
            },
        );
        Ok(())
    }

    /// Marks `tensors` as produced on `stream` (a write that does nothing: later readers
    /// order after it). Their memory is allocated when they are created.
    pub fn allocate_tensors(&mut self, stream: &Stream, tensors: &[&Tensor]) -> Result<()> {
        self.check(stream, &[], tensors)?;
        self.push("allocate_tensors", &stream.shared, &[], tensors, Kind::Noop);
        Ok(())
    }

    /// A read of `tensors` on `stream` that does nothing: keeps them alive and ordered
    /// until `stream` reaches it.
    pub fn touch_tensors(&mut self, stream: &Stream, tensors: &[&Tensor]) -> Result<()> {
        self.check(stream, tensors, &[])?;
        self.push("touch_tensors", &stream.shared, tensors, &[], Kind::Noop);
        Ok(())
    }

    /// Gives up this handle. The handle is dropped when the batch is submitted, after
    /// this builder's instructions were received: when it was the last one, the release
    /// instruction then follows every instruction of this batch that uses the tensor
    /// (enqueuing it at once would let the memory be freed, or recycled by a caching
    /// allocator, before them).
    pub fn release_tensor(&mut self, tensor: Tensor) -> Result<()> {
        self.vm.check_tensor(&tensor)?;
        self.released.push(tensor);
        Ok(())
    }

    /// Runs `f` on `tensor`'s bytes on its device's default stream, after every earlier
    /// writer. Does not wait.
    pub fn access_blob_by_callback(
        &mut self,
        tensor: &Tensor,
        f: impl FnOnce(&[u8]) + Send + 'static,
    ) -> Result<()> {
        self.vm.check_tensor(tensor)?;
        let s = self.vm.default_stream_of(tensor.device())?;
        self.push(
            "access_blob_by_callback",
            &s,
            &[tensor],
            &[],
            Kind::Read(ReadFn::routed(Box::new(f), self.vm.core.drop_sink())),
        );
        Ok(())
    }

    /// Runs `f` on `tensor`'s bytes, mutably, on its device's default stream, after every
    /// earlier access. Does not wait.
    pub fn access_blob_by_callback_mut(
        &mut self,
        tensor: &Tensor,
        f: impl FnOnce(&mut [u8]) + Send + 'static,
    ) -> Result<()> {
        self.vm.check_tensor(tensor)?;
        let s = self.vm.default_stream_of(tensor.device())?;
        self.push(
            "access_blob_by_callback_mut",
            &s,
            &[],
            &[tensor],
            Kind::Write(WriteFn::routed(Box::new(f), self.vm.core.drop_sink())),
        );
        Ok(())
    }

    /// A barrier: `f` runs on the scheduler thread once every instruction received before
    /// it has been released. Later instructions are not held back by it.
    pub fn barrier(&mut self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let mut instr = Instruction::new(
            "barrier",
            self.vm.barrier_stream(),
            Kind::Barrier(Box::new(f)),
        );
        instr.barrier = true;
        self.list.push(Arc::new(instr));
        Ok(())
    }
}

/// `a == b`, without a call to `memcmp` for the usual case: the kinds' names are the very
/// same `&'static str`, or few bytes compared inline (another crate's copy of the literal
/// has another address). Every operand of every instruction is checked.
fn same_device(a: crate::Device, b: crate::Device) -> bool {
    let (x, y) = (a.kind.name().as_bytes(), b.kind.name().as_bytes());
    a.index == b.index
        && (std::ptr::eq(x, y) || (x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p == q)))
}

impl Drop for InstructionsBuilder<'_> {
    fn drop(&mut self) {
        self.list.clear();
        // After the list was received (or discarded): their releases come after it.
        self.released.clear();
        let (list, released) = (
            std::mem::take(&mut self.list),
            std::mem::take(&mut self.released),
        );
        let _ = SPARE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                if s.list.capacity() < list.capacity() {
                    s.list = list;
                }
                if s.released.capacity() < released.capacity() {
                    s.released = released;
                }
            }
        });
    }
}
