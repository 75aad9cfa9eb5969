//! Hooks for an embedding runtime whose objects live under rules of their own — a
//! language binding with a global interpreter lock, a managed runtime whose references
//! may only be dropped on attached threads ([`ForeignHooks`], installed with
//! [`VirtualMachine::set_foreign_hooks`](crate::VirtualMachine::set_foreign_hooks)).
//!
//! * A [`WaitHook`] is told, on the calling thread, right before a call into the VM
//!   starts to wait (to sleep or to spin) and right after the wait ends, so that the
//!   binding can release its global lock meanwhile: a kernel on a worker (or, in
//!   single-thread mode, on the waiting thread itself) that needs that lock can then run.
//! * A [`DropSink`] receives the captures of every kernel and callback closure that the
//!   VM would otherwise drop without running it (its instruction failed before it ran: a
//!   poisoned operand, a failed launch; or the VM shut down) on one of its own threads.
//!   The embedder drops them on a thread of its choice.

use std::fmt;
use std::sync::Arc;

/// Called around every blocking wait of a call into a VM (see [`ForeignHooks`]).
///
/// For one call, [`before_wait`](Self::before_wait) and
/// [`after_wait`](Self::after_wait) come in pairs, on the calling thread, in that order,
/// never nested for one VM (a wait inside a wait of the same VM does not call the hook
/// again). In multi-thread mode a call that does not need to wait — the result was
/// ready, or the access ran inline — calls neither; in single-thread mode every call that
/// runs the engine on the calling thread (kernels included) calls both around it. While
/// the calling thread waits it may still run VM work itself (single-thread mode runs
/// kernels on it; in multi-thread mode it may run a ready small access, its own callback,
/// or the kernels queued to a worker that sleeps, a small read also before it waits),
/// between the two calls: that work must take the foreign lock itself if it needs it, as
/// it would on a worker thread.
///
/// The hook must not call into the VM. If it panics, the wait goes on regardless (the
/// VM's work may borrow the caller's memory), `after_wait` is still called, and the panic
/// resumes on the calling thread when the call's wait is over; the hook stays installed
/// and is called around the next wait as before.
///
/// # Examples
///
/// A stand-in global lock released while a read waits for a kernel that needs it:
///
/// ```
/// use std::sync::{Arc, Mutex, MutexGuard};
/// use ivm_std::{Config, ForeignHooks, VirtualMachine, WaitHook};
///
/// static GIL: Mutex<()> = Mutex::new(());
/// thread_local! {
///     static HELD: std::cell::RefCell<Option<MutexGuard<'static, ()>>> =
///         const { std::cell::RefCell::new(None) };
/// }
/// fn acquire() { HELD.with(|h| *h.borrow_mut() = Some(GIL.lock().unwrap())); }
/// fn release() -> bool { HELD.with(|h| h.borrow_mut().take().is_some()) }
///
/// struct ReleaseGil;
/// thread_local! { static RELEASED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) }; }
/// impl WaitHook for ReleaseGil {
///     fn before_wait(&self) { RELEASED.with(|r| r.set(release())); }
///     fn after_wait(&self) { if RELEASED.with(|r| r.replace(false)) { acquire(); } }
/// }
///
/// let vm = VirtualMachine::new(Config::default())?;
/// vm.set_foreign_hooks(ForeignHooks::default().with_wait_hook(Arc::new(ReleaseGil)))?;
/// let t = vm.new_tensor(8)?;
/// acquire(); // the front end holds its global lock while it calls the VM
/// vm.run(|b| b.call(&vm.default_stream(), &[], &[&t], |k| {
///     let _gil = GIL.lock().unwrap(); // the kernel needs the lock too
///     k.output_u64(0)[0] = 42;
/// }))?;
/// let mut out = [0u8; 8];
/// vm.read_small(&t, 0, &mut out)?; // waits without the lock: no deadlock
/// assert_eq!(u64::from_ne_bytes(out), 42);
/// assert!(release(), "the lock is held again after the call");
/// # Ok::<(), ivm_std::Error>(())
/// ```
pub trait WaitHook: Send + Sync {
    /// The calling thread is about to wait for the VM.
    fn before_wait(&self);
    /// The wait that [`before_wait`](Self::before_wait) announced is over (done, failed
    /// or timed out).
    fn after_wait(&self);
}

/// Receives the captures of closures the VM drops without running them (see
/// [`ForeignHooks`]). Called on a VM thread, possibly while it drives the engine: it must
/// not block for long and must not call into the VM; a channel send is the intended body.
///
/// # Examples
///
/// ```
/// use std::sync::{mpsc, Arc, Mutex};
/// use ivm_std::{Captures, DropSink};
///
/// /// Sends captures to the embedder's thread, which drops them.
/// struct ToMyThread(Mutex<mpsc::Sender<Captures>>);
/// impl DropSink for ToMyThread {
///     fn send(&self, captures: Captures) {
///         // If the receiver is gone the captures come back in the error and drop here.
///         let _ = self.0.lock().unwrap().send(captures);
///     }
/// }
/// let (tx, rx) = mpsc::channel();
/// let sink = Arc::new(ToMyThread(Mutex::new(tx)));
/// # let _ = (sink, rx);
/// ```
pub trait DropSink: Send + Sync {
    /// Takes `captures`; dropping them (anywhere) drops what the closure captured.
    fn send(&self, captures: Captures);
}

/// The captured state of a kernel or callback that will never run, handed to a
/// [`DropSink`]: dropping it drops what the closure captured, on the dropping thread.
pub struct Captures {
    /// Held only to be dropped.
    _held: Box<dyn Send>,
}

impl Captures {
    pub(crate) fn new(b: Box<dyn Send>) -> Self {
        Self { _held: b }
    }
}

impl fmt::Debug for Captures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Captures(..)")
    }
}

/// Hooks an embedding runtime installs on one VM (see the module docs of
/// [`WaitHook`] and [`DropSink`]). Start from `ForeignHooks::default()` (no hook).
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct ForeignHooks {
    /// Called around every blocking wait of a call into the VM.
    pub wait: Option<Arc<dyn WaitHook>>,
    /// Receives the captures of closures the VM drops without running them.
    pub drops: Option<Arc<dyn DropSink>>,
}

impl ForeignHooks {
    /// These hooks with `hook` called around blocking waits.
    pub fn with_wait_hook(mut self, hook: Arc<dyn WaitHook>) -> Self {
        self.wait = Some(hook);
        self
    }

    /// These hooks with unrun closures' captures sent to `sink`.
    pub fn with_drop_sink(mut self, sink: Arc<dyn DropSink>) -> Self {
        self.drops = Some(sink);
        self
    }
}

impl fmt::Debug for ForeignHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignHooks")
            .field("wait", &self.wait.is_some())
            .field("drops", &self.drops.is_some())
            .finish()
    }
}
