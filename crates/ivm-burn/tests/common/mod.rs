//! What the test binaries share: a VM mode with two compute streams on every machine.

use std::marker::PhantomData;

use ivm_burn::VmMode;

/// Mode `M` with two compute streams whatever the machine (the default is one per CPU but
/// one, so one on two CPUs): ops then depend on ops of the other stream, and a dependence
/// the channel drops makes burn's tests fail.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub struct TwoStreams<M>(PhantomData<M>);

impl<M: VmMode> VmMode for TwoStreams<M> {
    const MODE: ivm_std::Mode = M::MODE;
    // Beside `M`'s own devices (0 and 1 for the crate's modes) in burn's registry.
    const INDEX: u32 = M::INDEX + 2;
    const STREAMS: Option<usize> = Some(2);
}
