//! The VM above its engine: [`VmShared`](shared::VmShared) (the engine-facing core plus
//! the registry of streams and threads, the adapters and the lazy door's state), the
//! user's [`Tensor`](crate::Tensor) handle, and soft sync (the cross-stream instructions a
//! tensor's use on a new stream needs). Nothing in `engine/` names this layer: workers and
//! the scheduler hold only the core.

pub(crate) mod shared;
pub(crate) mod soft_sync;
pub(crate) mod tensor;
