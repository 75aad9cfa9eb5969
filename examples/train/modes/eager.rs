//! Eager: every op an ivm instruction on one stream, the loss read each step.

use std::sync::Arc;
use std::time::Duration;

use ivm::ivm_std::{Result, Stream, VirtualMachine};

use crate::program::Program;
use crate::trace::{self, Cat};

use super::*;

use super::device::Device;

/// Eager: every op an instruction on one stream, the loss read each step with
/// `read_small`.
pub struct Eager<'vm> {
    dev: Device<'vm>,
}

impl<'vm> Eager<'vm> {
    /// An eager trainer running on `stream` of `vm`. With `copy`, the dataset stays on
    /// the host and each batch is copied to the device on `copy` (see [`Staging`]).
    pub fn new(
        vm: &'vm VirtualMachine,
        stream: Stream,
        prog: Arc<Program>,
        rows: &TrainRows,
        copy: Option<Stream>,
    ) -> Result<Self> {
        Ok(Self {
            dev: Device::new(vm, stream, prog, rows, copy)?,
        })
    }
}

impl Trainer for Eager<'_> {
    fn step(&mut self, batch: &Batch, next: Option<&Batch>) -> Result<f32> {
        let slot = self.dev.begin_step(batch)?;
        let d = &self.dev;
        trace::span("run", Cat::Submit, || d.submit_step(batch, next, slot))?;
        self.dev.read_loss()
    }

    fn weights(&mut self) -> Result<Weights> {
        self.dev.weights()
    }

    fn read_latencies(&self) -> &[Duration] {
        &self.dev.lat
    }

    fn sync(&self) -> Result<()> {
        self.dev.vm.sync()
    }
}
