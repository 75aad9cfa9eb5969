//! A [`VirtualMachine`]'s view of its streams' caching allocators
//! ([`crate::device::alloc_cache`]): returning their memory and their counters.

use super::VirtualMachine;
use crate::model::stream::Stream;
#[cfg(doc)]
use crate::util::config::Config;
#[cfg(doc)]
use crate::util::error::Error;
use crate::util::error::Result;

impl VirtualMachine {
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
}
