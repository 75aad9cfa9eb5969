//! Fork policy: a VM never survives `fork()`.
//!
//! `fork()` copies only the calling thread into the child. A VM inherited by the child has
//! no scheduler and no workers there, its mutexes may be held by threads that do not exist,
//! and its device streams belong to the parent. So every VM records the process's *fork
//! generation* when it is created, and every entry point of a VM whose generation differs
//! from the current one returns [`Error::Forked`] before touching any of its state:
//! `run`, the `sync*` family (blocking, `_timeout` and `_async`), `stream`, `new_tensor*`,
//! `blocking_run_probe`, `shutdown`, `stats`, `dump_dag*`, and awaiting a completion.
//! Dropping the inherited VM (or its tensors) in the child does nothing: its state is leaked
//! on purpose, since joining threads that do not exist would hang. A VM created *in* the
//! child (single-thread mode is a good fit there) works normally.
//!
//! The generation is a process-wide counter bumped by a `pthread_atfork` child handler
//! (registered when the first VM is created), so the check on every entry point is one
//! Relaxed load and a compare, not a `getpid` system call.
//!
//! ```
//! use ivm_std::{Config, VirtualMachine};
//!
//! let vm = VirtualMachine::new(Config::single_thread())?;
//! // In this process the VM is not forked: its entry points work.
//! assert!(!vm.is_forked());
//! assert_eq!(vm.creator_pid(), std::process::id());
//! # Ok::<(), ivm_std::Error>(())
//! ```

use std::sync::Once;

use crate::util::error::{Error, Result};

/// The process's fork generation: bumped in every child right after `fork()`. A plain std
/// atomic on purpose: it lives in a `static` and is written by an atfork handler (no loom
/// model covers `fork`). Nothing is published through it: Relaxed everywhere.
static GENERATION: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

static REGISTER: Once = Once::new();

extern "C" fn bump_generation() {
    // Relaxed: a counter compared with itself; an atomic RMW is async-signal-safe, as an
    // atfork child handler must be.
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Where and when (fork-wise) a VM was created.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Birth {
    generation: usize,
    pid: u32,
}

impl Birth {
    /// The current process and generation; registers the atfork handler on first use.
    pub(crate) fn now() -> Self {
        REGISTER.call_once(|| {
            // SAFETY: `bump_generation` is an `extern "C"` function that only performs an
            // atomic increment, which is async-signal-safe (required of atfork child
            // handlers); the null handlers are allowed by POSIX.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(bump_generation)) };
            // Without the handler we cannot detect forks cheaply; fall back to pid checks.
            if rc != 0 {
                PID_FALLBACK.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
        Self {
            // Relaxed: see `GENERATION`.
            generation: GENERATION.load(std::sync::atomic::Ordering::Relaxed),
            pid: std::process::id(),
        }
    }

    /// Whether this process is a fork child of the one that created the VM.
    pub(crate) fn is_forked(&self) -> bool {
        // Relaxed: see `GENERATION`.
        if GENERATION.load(std::sync::atomic::Ordering::Relaxed) != self.generation {
            return true;
        }
        PID_FALLBACK.load(std::sync::atomic::Ordering::Relaxed) && std::process::id() != self.pid
    }

    /// `Err(Error::Forked)` in a fork child.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        if self.is_forked() {
            Err(Error::Forked)
        } else {
            Ok(())
        }
    }

    /// The id of the process that created the VM.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}

/// Set when `pthread_atfork` failed: forks are then detected by comparing process ids.
static PID_FALLBACK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_birth_is_not_forked() {
        let b = Birth::now();
        assert!(!b.is_forked());
        assert!(b.check().is_ok());
        assert_eq!(b.pid(), std::process::id());
    }
}
