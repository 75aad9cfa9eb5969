//! What the VM is made of, above the devices and below the engine: streams and their
//! policies, blobs, instructions (their data, their ownership steps), the worker queue
//! each stream's thread drains, the instruction pool, the trace ring. Nothing here drives
//! the engine or names the VM's shared state (`.ci/layers.sh` checks it).

pub(crate) mod blob;
pub(crate) mod dependence;
pub(crate) mod express;
pub(crate) mod hand_over;
pub(crate) mod instruction;
pub(crate) mod kernel;
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod thread_ctx;
pub mod trace;
