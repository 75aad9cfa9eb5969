//! The three ways to run a [`Program`]: plain (no VM), eager (every op an ivm
//! instruction) and lazy (the whole step one compiled graph launched through critical
//! sections). Each trainer takes the epoch's row order and a batch start, and returns the
//! step's loss, read back on the host.

mod device;
mod eager;
mod lazy;
mod plain;

use std::sync::Arc;
use std::time::Duration;

use ivm::ivm_std::Result;

pub use eager::Eager;
pub use lazy::Lazy;
pub use plain::Plain;

/// The `f32`s of tensor bytes.
pub fn f32s(b: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid `f32`; `align_to` only yields a middle part
    // that is properly aligned, and the asserts below check that it covers every byte
    // (ivm tensor memory and graph blobs are 8-byte aligned, sizes are multiples of 4).
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "tensor bytes are not f32s"
    );
    mid
}

/// The `f32`s of tensor bytes, mutably.
pub fn f32s_mut(b: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `f32s`; the result borrows `b` mutably.
    let (pre, mid, post) = unsafe { b.align_to_mut::<f32>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "tensor bytes are not f32s"
    );
    mid
}

/// The bytes of `f32`s.
pub fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Per layer: (weights, biases), read back on the host.
pub type Weights = Vec<(Vec<f32>, Vec<f32>)>;

/// The rows of one batch: `order[start..start + batch size]`.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The epoch's row order.
    pub order: Arc<[u32]>,
    /// Where the batch starts in it.
    pub start: usize,
}

/// One way of running training steps.
pub trait Trainer {
    /// Runs one step on `batch` and returns its loss; `next` is the batch of the following
    /// step, if any (a trainer may start moving it while this step computes).
    fn step(&mut self, batch: &Batch, next: Option<&Batch>) -> Result<f32>;
    /// The trained weights.
    fn weights(&mut self) -> Result<Weights>;
    /// Latency of each step's host read of the loss (empty without a VM).
    fn read_latencies(&self) -> &[Duration] {
        &[]
    }
    /// Waits until everything submitted so far has finished.
    fn sync(&self) -> Result<()> {
        Ok(())
    }
}

/// The dataset's training rows, shared by every mode.
#[derive(Debug, Clone)]
pub struct TrainRows {
    /// Features, row-major.
    pub x: Arc<Vec<f32>>,
    /// Labels.
    pub y: Arc<Vec<f32>>,
    /// Features per row.
    pub width: usize,
}
