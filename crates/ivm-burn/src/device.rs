//! The burn device of the ivm-routed backend, one per VM mode.

use std::fmt::Debug;
use std::marker::PhantomData;

use burn_common::device::{Device, DeviceId};
use burn_tensor::backend::DeviceOps;
use ivm_std::Mode;

/// Which VM mode a backend's client runs: a type, so both modes can live in one process
/// (burn keeps one client per channel type and device for the whole process).
pub trait VmMode: Clone + Copy + Default + Debug + PartialEq + Send + Sync + 'static {
    /// The VM's mode.
    const MODE: Mode;
    /// Distinguishes the devices of the two modes in burn's client registry.
    const INDEX: u32;
    /// How many compute streams the mode's client spreads operations over; `None` (the
    /// default): `IVM_BURN_STREAMS`, else one per CPU but one.
    ///
    /// A mode that fixes it keeps that count on every machine, e.g. to test ordering
    /// across streams where the default would be one:
    ///
    /// ```
    /// use ivm_burn::VmMode;
    ///
    /// #[derive(Clone, Copy, Default, Debug, PartialEq)]
    /// struct TwoStreams;
    ///
    /// impl VmMode for TwoStreams {
    ///     const MODE: ivm_std::Mode = ivm_std::Mode::MultiThread;
    ///     const INDEX: u32 = 2;
    ///     const STREAMS: Option<usize> = Some(2);
    /// }
    /// type Backend = ivm_burn::IvmBackend<TwoStreams>;
    /// ```
    const STREAMS: Option<usize> = None;
}

/// The VM's multi-thread mode: a scheduler and a worker thread per stream.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct MultiThread;

/// The VM's single-thread mode: the caller runs the engine and every kernel.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct SingleThread;

impl VmMode for MultiThread {
    const MODE: Mode = Mode::MultiThread;
    const INDEX: u32 = 0;
}

impl VmMode for SingleThread {
    const MODE: Mode = Mode::SingleThread;
    const INDEX: u32 = 1;
}

/// The cpu of one VM mode.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct IvmDevice<M: VmMode>(PhantomData<M>);

/// burn's type id of these devices (any number that no other device of this channel uses).
const TYPE_ID: u16 = 0x1b;

impl<M: VmMode> Device for IvmDevice<M> {
    fn from_id(_: DeviceId) -> Self {
        Self::default()
    }

    fn to_id(&self) -> DeviceId {
        DeviceId::new(TYPE_ID, M::INDEX)
    }

    fn device_count(_: u16) -> usize {
        1
    }
}

impl<M: VmMode> DeviceOps for IvmDevice<M> {}
