//! A [`VirtualMachine`]'s streams: one by id, created on first use, and the cpu default
//! stream.

use super::VirtualMachine;
use crate::model::stream::Stream;
use crate::util::error::Result;
use crate::util::ids::StreamId;

impl VirtualMachine {
    /// The stream `id`, created on first use (with its worker thread, in multi-thread
    /// mode). Only cpu streams exist until device adapters are registered.
    pub fn stream(&self, id: StreamId) -> Result<Stream> {
        Ok(Stream {
            shared: self.shared.stream(id)?,
        })
    }

    /// The cpu device's default stream (compute, thread 0).
    pub fn default_stream(&self) -> Stream {
        Stream {
            shared: self
                .shared
                .default_cpu
                .get()
                .expect("default stream is created in `new`")
                .clone(),
        }
    }
}
