//! The small sync accesses of a [`VirtualMachine`]: [`read_small`](VirtualMachine::read_small)
//! and [`write_small`](VirtualMachine::write_small), and the blocking callbacks
//! [`access`](VirtualMachine::access) and [`access_mut`](VirtualMachine::access_mut) (the
//! mechanism is in `doors/sync_access.rs`).

use super::VirtualMachine;
use crate::doors::sync_access::{self, CallbackKind};
use crate::runtime::tensor::Tensor;
#[cfg(doc)]
use crate::util::error::Error;
use crate::util::error::Result;

impl VirtualMachine {
    /// Reads `out.len()` (1, 2, 4, 8 or 16) bytes of `t` at `offset`, after every
    /// instruction received before that writes `t`, and blocks until they are in `out`:
    /// the lowest-latency way to look at a tensor (`perf_report`'s `inline` and `warm` sections
    /// time it).
    ///
    /// # Errors
    /// [`Error::UnsupportedSize`] for a length other than 1, 2, 4, 8 or 16;
    /// [`Error::OutOfBounds`] for a range that does not lie within `t` (`offset + len` past
    /// its end, or overflowing); [`Error::Poisoned`] when a failed instruction wrote `t`; [`Error::Timeout`] with a
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
}
