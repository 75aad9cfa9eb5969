//! Tensors: the user's handle ([`Tensor`]) and the internal blob handle that instructions
//! hold ([`Blob`]). Dropping the last user handle enqueues a release instruction; the
//! memory goes when the last instruction holding the blob lets go of it.

use std::sync::Arc;

use ivm_core::sync::AtomicU32;

use crate::model::blob::Blob;
use crate::model::stream::StreamShared;
use crate::runtime::shared::VmShared;
use crate::util::ids::Device;
use ivm_core::list::NIL;

/// A user handle on a tensor (cheap to clone). When the last handle drops, the VM enqueues
/// a release instruction (never blocking, never subject to backpressure); the memory is
/// freed once every instruction that uses it has been released.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Arc<TensorInner>,
}

pub(crate) struct TensorInner {
    pub(crate) blob: Arc<Blob>,
    pub(crate) vm: Arc<VmShared>,
    /// The stream the tensor was created for: its producer stream (its memory came from
    /// that stream's allocator); its release runs there, after a soft sync when it was
    /// last used elsewhere.
    pub(crate) home: Arc<StreamShared>,
    /// Index of the stream that used it last (`NIL`: none yet).
    pub(crate) last_used_stream: AtomicU32,
}

impl TensorInner {
    pub(crate) fn new(blob: Arc<Blob>, vm: Arc<VmShared>, home: Arc<StreamShared>) -> Self {
        Self {
            blob,
            vm,
            home,
            last_used_stream: AtomicU32::new(NIL),
        }
    }
}

impl Drop for TensorInner {
    fn drop(&mut self) {
        self.vm
            .enqueue_release(&self.blob, &self.home, &self.last_used_stream);
    }
}

impl Tensor {
    /// A new tensor of VM `vm` over fresh memory `mem` (a blob with a new id), homed on
    /// `home`.
    pub(crate) fn over(
        vm: Arc<VmShared>,
        home: Arc<StreamShared>,
        mem: Arc<dyn crate::device::DeviceMemory>,
    ) -> Self {
        let id =
            crate::engine::core::NEXT_BLOB_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let blob = Arc::new(Blob::with_memory(vm.id, id, mem));
        Self {
            inner: Arc::new(TensorInner::new(blob, vm, home)),
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.inner.blob.nbytes
    }

    /// The device its memory lives on.
    pub fn device(&self) -> Device {
        self.inner.blob.device
    }

    /// A process-unique id of the underlying blob.
    pub fn id(&self) -> usize {
        self.inner.blob.id
    }

    pub(crate) fn blob(&self) -> &Arc<Blob> {
        &self.inner.blob
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("id", &self.id())
            .field("device", &self.device())
            .field("nbytes", &self.nbytes())
            .finish()
    }
}
