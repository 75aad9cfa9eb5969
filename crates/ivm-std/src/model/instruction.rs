//! Instructions: what runs, on which stream, over which blobs; and how a body is executed.

use std::ptr::NonNull;
use std::sync::Arc;

use ivm_core::mpsc;
use ivm_core::sync::{AtomicU32, Ordering, UnsafeCell};

use crate::device::Event;
use crate::model::blob::Blob;
use crate::model::stream::StreamShared;
use crate::util::error::Failure;
use crate::util::futex::FutexWait;
use ivm_core::BlockingThenBusy;

/// Status bits of an instruction (`Instruction::status`).
pub(crate) mod status {
    /// Handed to its stream's executor by the engine.
    pub(crate) const DISPATCHED: u32 = 1;
    /// Its body started.
    pub(crate) const LAUNCHED: u32 = 2;
    /// Its body finished (for done-at-launch streams: done).
    pub(crate) const DONE: u32 = 4;
    /// Its body failed (panicked or refused poisoned input); `failure` is set.
    pub(crate) const FAILED: u32 = 8;
    /// Its deferred body returned (it completes later): the executor is done with it.
    pub(crate) const BODY_RAN: u32 = 16;
    /// Handed by the engine to its waiting caller, who runs it (a sync callback on an idle
    /// stream: see `Engine::can_hand_to_caller`).
    pub(crate) const CLAIMED: u32 = 32;
    /// Its caller will wait for it and run it itself if its worker sleeps: the push that
    /// queues it to a sleeping worker may leave the wake to that caller
    /// (`thread_ctx::skip_wake`, `thread_ctx::withdraw_defer`).
    pub(crate) const DEFER_WAKE: u32 = 64;
    /// The push that queued it found the queue empty and left the wake to its caller.
    pub(crate) const WAKE_SKIPPED: u32 = 128;
    /// The engine holds something back until its release (`ivm_engine::Instruction::awaited`):
    /// the worker that finishes it must not leave the release for later
    /// (`helping::Owed::leave_unless_awaited`). Set by the engine's holder.
    pub(crate) const AWAITED: u32 = 256;

    const NAMES: [(u32, &str); 9] = [
        (DISPATCHED, "DISPATCHED"),
        (LAUNCHED, "LAUNCHED"),
        (DONE, "DONE"),
        (FAILED, "FAILED"),
        (BODY_RAN, "BODY_RAN"),
        (CLAIMED, "CLAIMED"),
        (DEFER_WAKE, "DEFER_WAKE"),
        (WAKE_SKIPPED, "WAKE_SKIPPED"),
        (AWAITED, "AWAITED"),
    ];

    /// A status word as its `Debug` shows it: the names of its bits, `DISPATCHED |
    /// LAUNCHED` (`(none)` for none, unknown bits in hex).
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub(crate) struct Bits(pub(crate) u32);

    impl std::fmt::Debug for Bits {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let mut rest = self.0;
            let mut first = true;
            for (bit, name) in NAMES {
                if rest & bit != 0 {
                    f.write_str(if first { "" } else { " | " })?;
                    f.write_str(name)?;
                    rest &= !bit;
                    first = false;
                }
            }
            if rest != 0 {
                write!(f, "{}{rest:#x}", if first { "" } else { " | " })?;
            } else if first {
                f.write_str("(none)")?;
            }
            Ok(())
        }
    }
}

/// Operands inline up to 4, spilled to the heap beyond.
#[derive(Clone)]
pub(crate) enum Operands {
    Inline(heapless::Vec<Arc<Blob>, 4>),
    Spilled(Vec<Arc<Blob>>),
}

impl Default for Operands {
    fn default() -> Self {
        Operands::Inline(heapless::Vec::new())
    }
}

impl Operands {
    pub(crate) fn as_slice(&self) -> &[Arc<Blob>] {
        match self {
            Operands::Inline(v) => v,
            Operands::Spilled(v) => v,
        }
    }

    pub(crate) fn push(&mut self, b: Arc<Blob>) {
        match self {
            Operands::Inline(v) => {
                if let Err(b) = v.push(b) {
                    let mut spilled: Vec<Arc<Blob>> = v.drain(..).collect();
                    spilled.push(b);
                    *self = Operands::Spilled(spilled);
                }
            }
            Operands::Spilled(v) => v.push(b),
        }
    }

    pub(crate) fn clear(&mut self) {
        match self {
            Operands::Inline(v) => v.clear(),
            Operands::Spilled(v) => v.clear(),
        }
    }
}

/// A kernel: runs once, on its stream's thread, over its inputs and outputs (stored
/// inline in the instruction when small, see `kernel.rs`).
pub(crate) use crate::model::kernel::{KernelCtx, KernelFn};

/// A callback reading a blob's bytes.
pub(crate) type ReadFn = Callback<dyn FnOnce(&[u8]) + Send>;
/// A callback writing a blob's bytes.
pub(crate) type WriteFn = Callback<dyn FnOnce(&mut [u8]) + Send>;

/// A boxed callback that runs at most once. Dropped without running, it goes to the VM's
/// [`DropSink`](crate::DropSink) if one was given ([`routed`](Self::routed)) instead of
/// being dropped on whichever VM thread drops it.
pub(crate) struct Callback<F: ?Sized + Send + 'static> {
    f: Option<Box<F>>,
    sink: Option<Arc<dyn crate::DropSink>>,
}

impl<F: ?Sized + Send + 'static> Callback<F> {
    /// A callback of the VM's own (captures nothing an embedder cares where it drops).
    pub(crate) fn new(f: Box<F>) -> Self {
        Self {
            f: Some(f),
            sink: None,
        }
    }

    /// A user's callback: dropped unrun, it goes to `sink` (when there is one).
    pub(crate) fn routed(f: Box<F>, sink: Option<&Arc<dyn crate::DropSink>>) -> Self {
        Self {
            f: Some(f),
            sink: sink.cloned(),
        }
    }

    /// The closure, borrowed (to tell it something without running it: it still drops,
    /// or goes to the sink, as an unrun callback).
    pub(crate) fn get_mut(&mut self) -> Option<&mut F> {
        self.f.as_deref_mut()
    }

    /// The closure, to run it.
    pub(crate) fn take(mut self) -> Box<F> {
        self.f
            .take()
            .expect("ivm: a callback's closure is taken once, by `take`, which consumes it")
    }
}

impl<F: ?Sized + Send + 'static> Drop for Callback<F> {
    fn drop(&mut self) {
        // The sink and the closure's captures are user code: a panic is caught (dropping
        // a callback happens on VM threads, inside engine steps).
        match (self.f.take(), self.sink.take()) {
            (Some(f), Some(sink)) => {
                let _ = crate::util::panics::catch(move || {
                    sink.send(crate::Captures::new(Box::new(f)));
                });
            }
            (Some(f), None) => {
                let _ = crate::util::panics::drop_caught(f);
            }
            (None, _) => {}
        }
    }
}

/// What an instruction does when it runs.
pub(crate) enum Kind {
    /// Nothing (allocate, touch, release: their effect is their dependences).
    Noop,
    /// A kernel.
    Kernel(KernelFn),
    /// A callback reading the first input.
    Read(ReadFn),
    /// A callback writing the first output.
    Write(WriteFn),
    /// Copy `len` bytes at `offset` of the first input into the instruction's small buffer.
    SmallRead { offset: usize, len: usize },
    /// Copy `len` bytes of the small buffer to `offset` of the first output.
    SmallWrite { offset: usize, len: usize },
    /// A barrier's callback (scheduler thread).
    Barrier(Box<dyn FnOnce() + Send>),
    /// Copy `len` bytes from the first input at `src_offset` to the first output at
    /// `dst_offset` (host, host-to-device, device-to-host or device-to-device).
    Copy {
        src_offset: usize,
        dst_offset: usize,
        len: usize,
    },
    /// A tensor's release: frees the first output's memory in this stream's order.
    Free,
    /// Soft sync in one instruction (both streams on one worker thread): record an event
    /// on `from` and make this stream wait for it on the device.
    StreamWait { from: Arc<StreamShared> },
    /// Soft sync: record an event on this stream, into `slot` for a later `WaitEvent` (done
    /// at launch), or with `slot: None` host-observed (done when the event completes).
    RecordEvent { slot: Option<Arc<EventSlot>> },
    /// Soft sync: this stream waits, on the device, for the event in `slot`.
    WaitEvent { slot: Arc<EventSlot> },
}

/// Where a soft sync's record-event instruction leaves its event for the wait-event one
/// (written once by the recorder; the engine orders the waiter after it).
pub(crate) type EventSlot = std::sync::OnceLock<Arc<dyn Event>>;

impl Kind {
    /// A soft-sync instruction (orders streams; touches no tensor memory).
    pub(crate) fn is_sync_op(&self) -> bool {
        matches!(
            self,
            Kind::StreamWait { .. } | Kind::RecordEvent { .. } | Kind::WaitEvent { .. }
        )
    }
}

/// The parts of an instruction that its current owner mutates: the builder before it is
/// received, the engine while handling it, the executor while running it, the engine again
/// at release, a sync-access ring owner between uses.
pub(crate) struct Body {
    pub(crate) kind: Kind,
    pub(crate) inputs: Operands,
    pub(crate) outputs: Operands,
    /// A deferred body (critical sections, lazy-job launches): run instead of `kind`, it
    /// completes the instruction later through a [`Completion`].
    pub(crate) deferred: Option<Deferred>,
    /// Told the instruction's outcome once its writes have landed where the tensor lives:
    /// after the body on a synchronous device, in stream order after the body (and a
    /// device-only tensor's copy back) on an asynchronous one. An async write resolves its
    /// completion here. Dropped unrun with an instruction that never ran. The VM's own
    /// code, never a user's.
    pub(crate) landed: Option<Landed>,
    /// The builder let it join a fused run (`InstructionsBuilder::set_fusable`); whether
    /// it does is the engine's (`ivm_engine::Instruction::fusable`).
    pub(crate) fusable: bool,
    /// The next member of the fused run this instruction belongs to: linked by the engine
    /// at dispatch, before the run's first member is handed over (ownership step 2), and
    /// taken by the executor before it runs this one (step 3), so a released instruction
    /// holds none.
    pub(crate) fused_next: Option<Arc<Instruction>>,
}

impl Body {
    /// What the engine drops when it releases the instruction (ownership step 4): the
    /// operands (so their tensors can go), the kernel and `landed`. The rest is reset when
    /// the pool renews the instruction.
    pub(crate) fn release(&mut self) {
        self.inputs.clear();
        self.outputs.clear();
        self.kind = Kind::Noop;
        self.landed = None;
    }

    /// A body that does `kind`, with no operands yet (the builder adds them).
    fn new(kind: Kind) -> Self {
        Body {
            kind,
            inputs: Operands::default(),
            outputs: Operands::default(),
            deferred: None,
            landed: None,
            fusable: true,
            fused_next: None,
        }
    }
}

/// See [`Body::landed`]: `None` when the writes landed, else why they did not.
pub(crate) type Landed = Box<dyn FnOnce(Option<Failure>) + Send>;

/// Tag of the hook that queues an instruction on the VM's pending queue.
pub(crate) struct PendingTag;
/// Tag of the hook that queues an instruction on a worker's queue.
pub(crate) struct WorkerTag;

/// One instruction. Shared (`Arc`) by whoever submitted it, the engine and the executor.
///
/// Ownership of the cells, in time order (each step happens-before the next):
/// 1. the builder fills `body` (and `small` for writes), then pushes to the pending queue
///    (Release/Acquire through the MPSC queue);
/// 2. the engine reads `body` operands while handling it, then dispatches it (worker queue
///    push: Release/Acquire) or runs it inline;
/// 3. the executor owns `body`, `small` and `failure` until it sets `DONE` (Release);
/// 4. the engine, after reading `DONE` (Acquire), clears `body` at release; the sync
///    waiter, after its `Waiter` wait (Acquire), reads `small` and `failure` (never
///    `body`);
/// 5. a ring owner reuses the instruction only through `Arc::get_mut` (exclusive).
pub(crate) struct Instruction {
    pending_link: mpsc::Links<Instruction>,
    worker_link: mpsc::Links<Instruction>,
    /// Process-unique sequence number (diagnostics, traces).
    pub(crate) id: usize,
    pub(crate) name: &'static str,
    pub(crate) stream: Arc<StreamShared>,
    /// Writes the stream's schedule dependence.
    pub(crate) stream_sequential: bool,
    /// Never prescheduled: same-stream edges from or to it wait for their source's
    /// release (`ivm_engine::Instruction::strict_edges`; custom instructions that
    /// complete after their launch).
    pub(crate) strict_edges: bool,
    /// A barrier (consumes no dependences; runs on the scheduler when oldest).
    pub(crate) barrier: bool,
    /// `status::*` bits.
    pub(crate) status: AtomicU32,
    /// Set for instructions a caller waits on (sync access): the executor notifies it when
    /// it starts and decreases it when it has finished.
    pub(crate) waiter: Option<Waiter>,
    pub(crate) body: UnsafeCell<Body>,
    /// The small-access buffer (sync read/write); the executor copies through it, never
    /// through the caller's memory.
    pub(crate) small: UnsafeCell<[u8; 16]>,
    pub(crate) failure: UnsafeCell<Option<Failure>>,
}

// SAFETY: the cells follow the ownership steps documented on `Instruction`: one owner at a
// time, each hand-over a Release/Acquire pair (queue push/pop, `DONE`, the waiter's
// counter) or `Arc::get_mut`. Closures and operands inside are `Send`.
unsafe impl Sync for Instruction {}
// SAFETY: as above.
unsafe impl Send for Instruction {}

/// Its label, stream and status bits: what a debugger or a log needs (the body belongs
/// to its current owner and is not shown).
impl std::fmt::Debug for Instruction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instruction")
            .field("label", &format_args!("{}", self.label()))
            .field("stream", &format_args!("{}", self.stream.id))
            .field("status", &self.status_bits())
            .finish()
    }
}

/// An id generator, not part of any synchronisation protocol: a plain std atomic on
/// purpose (loom atomics cannot live in a `static`, and a model gains nothing from it).
static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

pub(crate) fn next_id() -> usize {
    // Relaxed: a unique number, nothing is published through it.
    NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The id the next instruction will get (ids only grow): brackets the instructions a call
/// creates (the fault harness learns which fill belongs to which new tensor), or those
/// built before a call (a read runs no queued work built after it began).
pub(crate) fn peek_next_id() -> usize {
    // Relaxed: as above.
    NEXT_ID.load(std::sync::atomic::Ordering::Relaxed)
}

impl Instruction {
    pub(crate) fn new(name: &'static str, stream: Arc<StreamShared>, kind: Kind) -> Self {
        Self {
            pending_link: mpsc::Links::new(),
            worker_link: mpsc::Links::new(),
            id: next_id(),
            name,
            barrier: false,
            stream_sequential: stream.in_build_order,
            strict_edges: false,
            stream,
            status: AtomicU32::new(0),
            waiter: None,
            body: UnsafeCell::new(Body::new(kind)),
            small: UnsafeCell::new([0; 16]),
            failure: UnsafeCell::new(None),
        }
    }

    /// Makes this instruction, held by nobody else (a pooled one, through `Arc::get_mut`),
    /// what [`new`](Self::new) would make, keeping its stream's `Arc` when it is already
    /// `stream`: no reference count of the stream is touched (the stream's counts share a
    /// cache line with what its worker reads of it), and the old instruction is not moved.
    /// Every field is named, so a new one must be decided here.
    pub(crate) fn renew(&mut self, name: &'static str, stream: &Arc<StreamShared>, kind: Kind) {
        let Self {
            pending_link,
            worker_link,
            id,
            name: my_name,
            stream: my_stream,
            stream_sequential,
            strict_edges,
            barrier,
            status,
            waiter,
            body,
            small,
            failure,
        } = self;
        *pending_link = mpsc::Links::new();
        *worker_link = mpsc::Links::new();
        *id = next_id();
        *my_name = name;
        if !Arc::ptr_eq(my_stream, stream) {
            *my_stream = stream.clone();
        }
        *stream_sequential = stream.in_build_order;
        *strict_edges = false;
        *barrier = false;
        *status = AtomicU32::new(0);
        *waiter = None;
        *body = UnsafeCell::new(Body::new(kind));
        *small = UnsafeCell::new([0; 16]);
        *failure = UnsafeCell::new(None);
    }

    /// Its status bits, by name (a snapshot).
    pub(crate) fn status_bits(&self) -> status::Bits {
        // Relaxed: a diagnostic snapshot.
        status::Bits(self.status.load(Ordering::Relaxed))
    }

    /// `name#id`.
    pub(crate) fn label(&self) -> String {
        format!("{}#{}", self.name, self.id)
    }

    /// Access to the body for its current owner.
    ///
    /// # Safety
    /// The caller is the body's current owner (see the type's docs) and no other reference
    /// obtained from this function is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn body_mut(&self) -> &mut Body {
        // SAFETY: exclusive ownership by the caller's contract.
        self.body.with_mut(|p| unsafe { &mut *p })
    }

    /// Shared access to the body (the engine reading operands).
    ///
    /// # Safety
    /// The caller owns the body (no concurrent `body_mut`).
    pub(crate) unsafe fn body(&self) -> &Body {
        // SAFETY: by the caller's contract no one mutates the body meanwhile.
        self.body.with(|p| unsafe { &*p })
    }

    /// Whether the engine told it that something waits for its release
    /// ([`status::AWAITED`]). Relaxed: a worker asks after its mark of the engine token,
    /// whose Acquire read the unlock (Release) of the holder that set the bit; a holder
    /// that sets it later releases the instruction itself (see `Owed::leave_unless_awaited`).
    /// A caller running a worker's queue asks it as a hint only (`worker::WaitingCaller`):
    /// it has the engine release what it ran either way.
    pub(crate) fn is_awaited(&self) -> bool {
        self.status.load(Ordering::Relaxed) & status::AWAITED != 0
    }

    pub(crate) fn status(&self) -> u32 {
        // Acquire: pairs with the executor's Release `fetch_or(DONE)`; a caller that sees
        // DONE sees everything the body wrote.
        self.status.load(Ordering::Acquire)
    }
}

/// An instruction's hook in one of its two MPSC queues (the pending queue, a worker's
/// queue): the same impl over another field.
macro_rules! linked_by {
    ($tag:ty, $field:ident) => {
        // SAFETY: `into_ptr`/`from_ptr` are `Arc::into_raw`/`Arc::from_raw`, so the node
        // stays put while queued; `links` projects to a field used by this tag only,
        // without creating a reference to the node.
        unsafe impl mpsc::Linked<$tag> for Instruction {
            type Handle = Arc<Instruction>;
            fn into_ptr(h: Arc<Instruction>) -> NonNull<Instruction> {
                // SAFETY: `Arc::into_raw` never returns null.
                unsafe { NonNull::new_unchecked(Arc::into_raw(h).cast_mut()) }
            }
            unsafe fn from_ptr(p: NonNull<Instruction>) -> Arc<Instruction> {
                // SAFETY: `p` came from `into_ptr` (the trait's contract).
                unsafe { Arc::from_raw(p.as_ptr()) }
            }
            unsafe fn links(p: NonNull<Instruction>) -> NonNull<mpsc::Links<Instruction>> {
                // SAFETY: `p` points to a live instruction; a field projection of it is
                // non-null.
                unsafe { NonNull::new_unchecked(&raw mut (*p.as_ptr()).$field) }
            }
        }
    };
}

linked_by!(PendingTag, pending_link);
linked_by!(WorkerTag, worker_link);

/// The handshake between an executor and the caller waiting for one instruction.
pub(crate) struct Waiter {
    pub(crate) btb: BlockingThenBusy<FutexWait>,
}

impl Waiter {
    pub(crate) fn new() -> Self {
        Self {
            btb: BlockingThenBusy::new(),
        }
    }

    /// Executor, at start.
    pub(crate) fn started(&self) {
        // Err(Closed): the waiter gave up; finishing the round is still correct.
        let _ = self.btb.notify();
    }

    /// Executor, at the end (Release: publishes `small`, `failure` and tensor writes).
    pub(crate) fn finished(&self) {
        self.btb.decrease();
    }
}

/// A deferred instruction body (see the module docs): called with the right to finish the
/// instruction and whether it may block (`false` when the engine runs it inline on the
/// driving thread).
pub(crate) type DeferredFn = Box<dyn FnOnce(Completion, bool) + Send>;

/// A deferred body and whether it can do its work right now without blocking.
pub(crate) struct Deferred {
    pub(crate) run: DeferredFn,
    /// `None`: it never blocks. Otherwise: whether every buffer it pushes to has room now
    /// (then a non-blocking run keeps the buffers' bounds). Only the instruction's own
    /// stream pushes to those buffers, one instruction at a time, so the answer holds
    /// until the body runs.
    pub(crate) ready_now: Option<Box<dyn Fn() -> bool + Send>>,
}

impl Deferred {
    /// A body that never blocks.
    pub(crate) fn never_blocks(run: DeferredFn) -> Self {
        Self {
            run,
            ready_now: None,
        }
    }

    /// Whether the engine may run it inline now (it would not block).
    pub(crate) fn runs_without_blocking(&self) -> bool {
        self.ready_now.as_ref().is_none_or(|f| f())
    }
}

/// The right to finish one instruction whose body is deferred.
/// Completing it, or dropping it unfired (which fails the instruction), is in
/// `execute.rs`.
pub(crate) struct Completion {
    pub(crate) instr: Option<Arc<Instruction>>,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::status::{Bits, DISPATCHED, DONE, LAUNCHED};

    #[test]
    fn status_bits_show_their_names() {
        assert_eq!(format!("{:?}", Bits(0)), "(none)");
        assert_eq!(
            format!("{:?}", Bits(DISPATCHED | LAUNCHED | DONE)),
            "DISPATCHED | LAUNCHED | DONE"
        );
        assert_eq!(format!("{:?}", Bits(DONE | 1 << 20)), "DONE | 0x100000");
    }
}
