//! NCCL through cudarc (feature `cuda`): CUDA tensors of one GPU per rank, the
//! communicator bootstrapped over MPI (rank 0's unique id is broadcast to the others).
//!
//! A collective is *enqueued* on the collective stream's CUDA stream and the call returns
//! (the stream is done at launch; readers on other streams wait for an event recorded
//! after it, through soft sync). The header exchange before it runs over MPI with the
//! deadline, so ranks that disagree, fail or do not arrive are errors before NCCL is
//! touched; a peer that fails *inside* NCCL leaves the device work incomplete, which the
//! VM's bounded device waits (`sync`, `global_sync`) report as a timeout naming the
//! collective stream.
//!
//! A device collective is a custom instruction like a host one: a poisoned operand on one
//! rank is announced to its peers ([`InstructionPolicy::poisoned`](ivm_std::InstructionPolicy::poisoned)),
//! which fail instead of waiting in NCCL.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use cudarc::nccl::{result, sys};
use ivm_device::cuda::CudaDeviceStream;
use ivm_std::{Device, Error, Result};

use crate::comm::{Communicator, DType, Dst, HEADER_BYTES, Src, TransportError};
use crate::mpi::MpiCommunicator;

/// An NCCL communicator over one GPU per rank (see the [module docs](self)).
pub struct NcclCommunicator {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    device: Device,
    bootstrap: Arc<MpiCommunicator>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("device", &self.device)
            .field("rank", &self.bootstrap.rank())
            .finish()
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; ivm-ccl calls it from one thread at a time (the collective stream's thread).
unsafe impl Send for NcclCommunicator {}
// SAFETY: as above.
unsafe impl Sync for NcclCommunicator {}

fn derr(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Collective(format!("nccl: {what}: {e:?}"))
}

impl NcclCommunicator {
    /// Creates the NCCL communicator of this rank over `device` (a CUDA device, one per
    /// rank), with the ranks of `bootstrap` (every rank calls this, in the same order).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a device that is not CUDA's; [`Error::Collective`]
    /// when CUDA or NCCL cannot be loaded or the bootstrap fails.
    pub fn new(bootstrap: Arc<MpiCommunicator>, device: Device) -> Result<Arc<Self>> {
        if device.kind != ivm_device::cuda::CUDA {
            return Err(Error::DeviceMismatch(format!(
                "NCCL moves CUDA memory; {device} is not a CUDA device"
            )));
        }
        let ctx = CudaContext::new(device.index as usize).map_err(|e| derr("context", e))?;
        ctx.bind_to_thread().map_err(|e| derr("bind", e))?;
        let mut id = [0u8; 128];
        if bootstrap.rank() == 0 {
            let uid = result::get_uniqueid().map_err(|e| derr("unique id", e))?;
            for (b, c) in id.iter_mut().zip(uid.internal.iter()) {
                *b = *c as u8;
            }
        }
        let deadline = Instant::now() + crate::DEFAULT_TIMEOUT;
        bootstrap
            .broadcast(Dst::Host(&mut id), 0, deadline)
            .map_err(|e| derr("bootstrap broadcast", e))?;
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (c, b) in uid.internal.iter_mut().zip(id.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let mut comm = std::ptr::null_mut();
        let nranks = i32::try_from(bootstrap.size()).map_err(|e| derr("size", e))?;
        let rank = i32::try_from(bootstrap.rank()).map_err(|e| derr("rank", e))?;
        // SAFETY: `comm` is a valid out-pointer; the id is the one rank 0 created, the same
        // on every rank; every rank makes this call (the constructor's contract).
        unsafe { result::comm_init_rank(&mut comm, nranks, uid, rank) }
            .map_err(|e| derr("init", e))?;
        Ok(Arc::new(Self {
            comm,
            ctx,
            device,
            bootstrap,
        }))
    }

    fn device_side(
        &self,
        ptr: u64,
        stream: &dyn ivm_std::DeviceStream,
    ) -> std::result::Result<(*mut c_void, sys::cudaStream_t), TransportError> {
        let s = stream
            .as_any()
            .downcast_ref::<CudaDeviceStream>()
            .ok_or_else(|| TransportError::Failed("not a CUDA stream of ivm-device".into()))?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| TransportError::Failed(format!("bind: {e:?}")))?;
        Ok((
            ptr as *mut c_void,
            s.cuda().cu_stream() as sys::cudaStream_t,
        ))
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is ours and no call on it is in flight (we are its last
        // owner); enqueued collectives complete before the destruction takes effect.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

fn nccl_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
    }
}

fn failed(e: impl std::fmt::Debug) -> TransportError {
    TransportError::Failed(format!("nccl: {e:?}"))
}

fn device<'a>(
    d: Dst<'a>,
) -> std::result::Result<(u64, usize, &'a dyn ivm_std::DeviceStream), TransportError> {
    match d {
        Dst::Device { ptr, len, stream } => Ok((ptr, len, stream)),
        Dst::Host(_) => Err(TransportError::Failed(
            "NCCL moves device memory only".into(),
        )),
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    fn size(&self) -> usize {
        self.bootstrap.size()
    }

    fn device(&self) -> Device {
        self.device
    }

    fn transport(&self) -> &'static str {
        "nccl"
    }

    fn exchange_headers(
        &self,
        mine: &[u8; HEADER_BYTES],
        deadline: Instant,
    ) -> std::result::Result<Vec<[u8; HEADER_BYTES]>, TransportError> {
        self.bootstrap.exchange_headers(mine, deadline)
    }

    fn all_reduce_sum(
        &self,
        buf: Dst<'_>,
        dtype: DType,
        _deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        let (ptr, len, stream) = device(buf)?;
        let (p, s) = self.device_side(ptr, stream)?;
        // SAFETY: `p` is `len` bytes of device memory of this communicator's device,
        // written by this instruction only until the enqueued collective completes in
        // stream order (the VM's engine and soft sync); in place is allowed by NCCL.
        unsafe {
            result::all_reduce(
                p,
                p,
                len / dtype.size(),
                nccl_type(dtype),
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                s,
            )
        }
        .map(drop)
        .map_err(failed)
    }

    fn broadcast(
        &self,
        buf: Dst<'_>,
        root: usize,
        _deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        let (ptr, len, stream) = device(buf)?;
        let (p, s) = self.device_side(ptr, stream)?;
        let root = i32::try_from(root).map_err(failed)?;
        // SAFETY: as in `all_reduce_sum`.
        unsafe {
            result::broadcast(
                p,
                p,
                len,
                sys::ncclDataType_t::ncclUint8,
                root,
                self.comm,
                s,
            )
        }
        .map(drop)
        .map_err(failed)
    }

    fn all_gather(
        &self,
        send: Src<'_>,
        recv: Dst<'_>,
        _deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        let Src::Device { ptr: sp, len, .. } = send else {
            return Err(TransportError::Failed(
                "NCCL moves device memory only".into(),
            ));
        };
        let (rp, _, stream) = device(recv)?;
        let (r, s) = self.device_side(rp, stream)?;
        // SAFETY: as in `all_reduce_sum`; the input is only read, the output (`size()`
        // times as long, checked by the front end) only written by this instruction.
        unsafe {
            result::all_gather(
                sp as *const c_void,
                r,
                len,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                s,
            )
        }
        .map(drop)
        .map_err(failed)
    }
}
