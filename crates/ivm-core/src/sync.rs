//! The sync facade: the one place ivm takes its atomics, cells and spin hints from.
//!
//! Built normally it re-exports `core`'s types; built with `RUSTFLAGS="--cfg loom"` it
//! re-exports loom's, so a loom model of ivm (or of a crate built on ivm) checks every
//! atomic access ivm makes. The switch is plain `cfg(loom)`, not `all(test, loom)`: the
//! models of ivm-std and of downstream crates need ivm-core's loom types too.
//!
//! Every atomic and cell in ivm's concurrent code must come from here.
#![allow(clippy::missing_const_for_fn)]

#[cfg(not(loom))]
pub use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering, fence};
#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering, fence};

#[cfg(loom)]
pub use loom::cell::UnsafeCell;

/// An `UnsafeCell` with loom's closure-based API (`with` / `with_mut`), so that the same
/// code compiles against `core` and against loom (which tracks every access).
#[cfg(not(loom))]
#[derive(Debug, Default)]
#[repr(transparent)]
pub struct UnsafeCell<T: ?Sized>(core::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    /// Wraps `value`.
    #[inline]
    pub const fn new(value: T) -> Self {
        Self(core::cell::UnsafeCell::new(value))
    }

    /// Unwraps the value.
    #[inline]
    pub fn into_inner(self) -> T {
        self.0.into_inner()
    }
}

#[cfg(not(loom))]
impl<T: ?Sized> UnsafeCell<T> {
    /// Calls `f` with a shared raw pointer to the contents.
    #[inline(always)]
    pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Calls `f` with a mutable raw pointer to the contents.
    #[inline(always)]
    pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// One step of a spin loop: a CPU spin hint, or a yield to the loom scheduler under loom
/// (a loom model that spins without yielding never ends: tokio-rs/loom#162).
#[inline(always)]
pub fn spin_loop() {
    #[cfg(not(loom))]
    core::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// Exponential backoff for spin loops.
///
/// Normally `crossbeam_utils::Backoff`. crossbeam-utils listens to its own cfg, not to
/// `cfg(loom)`, so under loom this yields to the loom scheduler on every step instead.
#[derive(Debug)]
pub struct Backoff {
    #[cfg(not(loom))]
    inner: crossbeam_utils::Backoff,
    #[cfg(loom)]
    steps: core::cell::Cell<u32>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// A fresh backoff.
    #[inline]
    pub fn new() -> Self {
        Self {
            #[cfg(not(loom))]
            inner: crossbeam_utils::Backoff::new(),
            #[cfg(loom)]
            steps: core::cell::Cell::new(0),
        }
    }

    /// Back off in a lock-free loop (another thread made progress; retry soon).
    #[inline]
    pub fn spin(&self) {
        #[cfg(not(loom))]
        self.inner.spin();
        #[cfg(loom)]
        self.step();
    }

    /// Back off in a blocking loop (waiting for another thread to make progress).
    #[inline]
    pub fn snooze(&self) {
        #[cfg(not(loom))]
        self.inner.snooze();
        #[cfg(loom)]
        self.step();
    }

    /// Whether spinning has stopped paying off and the caller should park instead.
    #[inline]
    pub fn is_completed(&self) -> bool {
        #[cfg(not(loom))]
        return self.inner.is_completed();
        #[cfg(loom)]
        return self.steps.get() >= 2;
    }

    /// Starts over.
    #[inline]
    pub fn reset(&self) {
        #[cfg(not(loom))]
        self.inner.reset();
        #[cfg(loom)]
        self.steps.set(0);
    }

    #[cfg(loom)]
    fn step(&self) {
        self.steps.set(self.steps.get().saturating_add(1));
        loom::thread::yield_now();
    }
}

/// Defines a constructor that is `const fn` normally and a plain `fn` under loom (loom's
/// atomics have no const constructors).
macro_rules! loom_const_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $T:ty),* $(,)?) -> $Ret:ty $body:block) => {
        $(#[$meta])*
        #[cfg(not(loom))]
        $vis const fn $name($($arg: $T),*) -> $Ret $body

        $(#[$meta])*
        #[cfg(loom)]
        $vis fn $name($($arg: $T),*) -> $Ret $body
    };
}
pub(crate) use loom_const_fn;
