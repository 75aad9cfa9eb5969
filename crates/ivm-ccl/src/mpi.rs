//! MPI through rsmpi (feature `mpi`): host tensors, one rank per process.
//!
//! ```no_run
//! use ivm_ccl::{Collectives, DType};
//! use ivm_std::{Config, VirtualMachine};
//!
//! let (_mpi, comm) = ivm_ccl::mpi::init()?; // keep `_mpi` alive until the end of main
//! let vm = VirtualMachine::new(Config::default())?;
//! let ccl = Collectives::new(&vm, comm)?;
//! let t = vm.new_tensor_from(&vm.default_stream(), &1.0f32.to_ne_bytes())?;
//! vm.run(|b| ccl.all_reduce_sum(b, &t, DType::F32))?;
//! ccl.global_sync(&vm)?;
//! # Ok::<(), ivm_std::Error>(())
//! ```
//!
//! Run it with `mpirun -np 2 target/debug/<program>`.
//!
//! Every operation is started non-blocking and then tested until it completes or its
//! deadline passes: a short spin first (a collective whose peers are already there
//! completes in microseconds), then sleeps that double up to [`MAX_PAUSE`], so that a
//! rank waiting for a slow peer does not burn a core. A deadline that passes leaves the
//! operation started (MPI cannot cancel a collective): its buffers are leaked, as
//! [`TransportError::Timeout`] says, and the communicator takes no further calls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Root as _};

use ivm_std::{Device, Error, Result};

use crate::comm::{Communicator, DType, Dst, HEADER_BYTES, Src, TransportError};

/// How long a wait spins (testing the request) before it starts to sleep.
const SPIN: Duration = Duration::from_micros(100);
/// The longest sleep between two tests of a request.
pub const MAX_PAUSE: Duration = Duration::from_micros(200);

/// The MPI environment of this process: MPI is finalised when it drops. Keep it alive (in
/// `main`) until every VM that uses its communicator has shut down; a communicator used
/// after that returns errors.
pub struct MpiUniverse {
    universe: Universe,
}

impl std::fmt::Debug for MpiUniverse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiUniverse").finish_non_exhaustive()
    }
}

impl MpiUniverse {
    /// The world communicator's size.
    pub fn size(&self) -> usize {
        usize::try_from(self.universe.world().size()).unwrap_or(0)
    }
}

impl Drop for MpiUniverse {
    fn drop(&mut self) {
        FINALIZED.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Set (Release) just before MPI is finalised; read (Acquire) before every MPI call.
static FINALIZED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Initialises MPI with full thread support (the collective stream's thread and the
/// thread calling [`Collectives::global_sync`](crate::Collectives::global_sync) both call
/// it) and returns the environment and a communicator over every process of the job.
///
/// # Errors
/// [`Error::Collective`] when MPI was already initialised, or when the library does not
/// provide `MPI_THREAD_MULTIPLE`.
pub fn init() -> Result<(MpiUniverse, Arc<MpiCommunicator>)> {
    let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| Error::Collective("MPI is already initialised".into()))?;
    if level < mpi::Threading::Multiple {
        return Err(Error::Collective(format!(
            "the MPI library provides thread level {level:?}; ivm-ccl needs Multiple"
        )));
    }
    let world = universe.world();
    let comm = MpiCommunicator {
        rank: usize::try_from(world.rank()).unwrap_or(0),
        size: usize::try_from(world.size()).unwrap_or(1),
        world,
    };
    Ok((MpiUniverse { universe }, Arc::new(comm)))
}

/// The world communicator of an MPI job (see the [module docs](self)).
pub struct MpiCommunicator {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE (`init` refuses less), so any
// thread may call into the communicator; ivm-ccl's calls on one communicator come from one
// thread at a time (the collective stream's, or `global_sync`'s after the VM drained).
unsafe impl Sync for MpiCommunicator {}
// SAFETY: as above: the handle is a plain MPI communicator, usable from any thread.
unsafe impl Send for MpiCommunicator {}

fn live() -> std::result::Result<(), TransportError> {
    if FINALIZED.load(std::sync::atomic::Ordering::Acquire) {
        return Err(TransportError::Failed("MPI has been finalised".into()));
    }
    Ok(())
}

/// Tests `req` until it completes or `deadline` passes. On a timeout the request is
/// forgotten (it stays started; its buffers must stay valid: the caller leaks them).
fn wait<D: ?Sized>(
    mut req: Request<'static, D, StaticScope>,
    deadline: Instant,
) -> std::result::Result<(), TransportError> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(5);
    loop {
        match req.test() {
            Ok(_) => return Ok(()),
            Err(r) => req = r,
        }
        let now = Instant::now();
        if now >= deadline {
            std::mem::forget(req);
            return Err(TransportError::Timeout { abandoned: true });
        }
        if now.duration_since(start) < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

/// A buffer the transport may hold past a timeout: leaked into `'static` for the request,
/// reclaimed once it completed.
struct Leaked<T: 'static>(*mut [T]);

impl<T: Clone + 'static> Leaked<T> {
    fn new(v: Vec<T>) -> Self {
        Leaked(Box::into_raw(v.into_boxed_slice()))
    }

    /// # Safety
    /// No other reference to the buffer is alive while the returned one is.
    unsafe fn get(&self) -> &'static mut [T] {
        // SAFETY: the pointer came from `Box::into_raw` and is freed only by `reclaim`;
        // exclusivity is the caller's contract.
        unsafe { &mut *self.0 }
    }

    /// # Safety
    /// The transport no longer references the buffer (its request completed), and no
    /// reference from [`get`](Self::get) is alive.
    unsafe fn reclaim(self) -> Box<[T]> {
        // SAFETY: from `Box::into_raw`, reclaimed once (this consumes `self`).
        unsafe { Box::from_raw(self.0) }
    }
}

/// `bytes` as a `'static` slice of `T` for a request.
///
/// # Safety
/// `bytes` is aligned for `T` and holds whole `T`s, every bit pattern is a valid `T`, and
/// the memory stays valid and untouched by anyone else until the request completes — or
/// forever, when the request is abandoned (the caller leaks the memory then).
unsafe fn as_static<T>(bytes: &mut [u8]) -> &'static mut [T] {
    let n = bytes.len() / std::mem::size_of::<T>();
    // SAFETY: the caller's contract; the length is in whole `T`s inside `bytes`.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), n) }
}

fn host<'a>(d: Dst<'a>) -> std::result::Result<&'a mut [u8], TransportError> {
    match d {
        Dst::Host(b) => Ok(b),
        Dst::Device { .. } => Err(TransportError::Failed(
            "MPI moves host memory only (use the NCCL transport for device memory)".into(),
        )),
    }
}

impl MpiCommunicator {
    /// Sums over all ranks `buf`, seen as `T`s, in place (through a copy: the send buffer).
    fn reduce_typed<T>(
        &self,
        buf: &mut [u8],
        deadline: Instant,
    ) -> std::result::Result<(), TransportError>
    where
        T: mpi::datatype::Equivalence + Copy + Default + 'static,
    {
        if buf.as_ptr().align_offset(std::mem::align_of::<T>()) != 0 {
            return Err(TransportError::Failed("a misaligned buffer".into()));
        }
        // SAFETY: aligned (checked) and in whole `T`s (the front end checked the size);
        // the numeric `T`s accept every bit pattern; `buf` is this call's exclusively
        // until the request completes, or leaked by the caller on a timeout.
        let recv: &'static mut [T] = unsafe { as_static(buf) };
        let send = Leaked::new(recv.to_vec());
        // SAFETY: `send` is referenced by this request only.
        let send_ref: &'static [T] = unsafe { send.get() };
        let req = self.world.immediate_all_reduce_into(
            StaticScope,
            send_ref,
            recv,
            SystemOperation::sum(),
        );
        wait(req, deadline)?;
        // SAFETY: the request completed; `send_ref` is not used again.
        drop(unsafe { send.reclaim() });
        Ok(())
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device(&self) -> Device {
        Device::CPU
    }

    fn transport(&self) -> &'static str {
        "mpi"
    }

    fn exchange_headers(
        &self,
        mine: &[u8; HEADER_BYTES],
        deadline: Instant,
    ) -> std::result::Result<Vec<[u8; HEADER_BYTES]>, TransportError> {
        live()?;
        let send = Leaked::new(mine.to_vec());
        let recv = Leaked::new(vec![0u8; HEADER_BYTES * self.size]);
        // SAFETY: each buffer is referenced by this request only; on a timeout neither is
        // reclaimed (they leak with the abandoned request).
        let (s, r) = unsafe { (&*send.get(), recv.get()) };
        wait(
            self.world.immediate_all_gather_into(StaticScope, s, r),
            deadline,
        )?;
        // SAFETY: the request completed; `s` and `r` are not used again.
        let (_, all) = unsafe { (send.reclaim(), recv.reclaim()) };
        Ok(all
            .chunks_exact(HEADER_BYTES)
            .map(|c| {
                let mut h = [0u8; HEADER_BYTES];
                h.copy_from_slice(c);
                h
            })
            .collect())
    }

    fn all_reduce_sum(
        &self,
        buf: Dst<'_>,
        dtype: DType,
        deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        live()?;
        let buf = host(buf)?;
        match dtype {
            DType::U8 => self.reduce_typed::<u8>(buf, deadline),
            DType::I32 => self.reduce_typed::<i32>(buf, deadline),
            DType::I64 => self.reduce_typed::<i64>(buf, deadline),
            DType::F32 => self.reduce_typed::<f32>(buf, deadline),
            DType::F64 => self.reduce_typed::<f64>(buf, deadline),
        }
    }

    fn broadcast(
        &self,
        buf: Dst<'_>,
        root: usize,
        deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        live()?;
        let buf = host(buf)?;
        let root = i32::try_from(root)
            .map_err(|_| TransportError::Failed(format!("root {root} is not an MPI rank")))?;
        // SAFETY: bytes (any alignment, any pattern); exclusively this call's until the
        // request completes, or leaked by the caller on a timeout.
        let b: &'static mut [u8] = unsafe { as_static(buf) };
        let req = self
            .world
            .process_at_rank(root)
            .immediate_broadcast_into(StaticScope, b);
        wait(req, deadline)
    }

    fn all_gather(
        &self,
        send: Src<'_>,
        recv: Dst<'_>,
        deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        live()?;
        let Src::Host(send) = send else {
            return Err(TransportError::Failed("MPI moves host memory only".into()));
        };
        let recv = host(recv)?;
        let s = Leaked::new(send.to_vec());
        // SAFETY: `s` is referenced by this request only; `recv` as in `broadcast`.
        let (sr, r): (&'static [u8], &'static mut [u8]) = unsafe { (&*s.get(), as_static(recv)) };
        wait(
            self.world.immediate_all_gather_into(StaticScope, sr, r),
            deadline,
        )?;
        // SAFETY: the request completed; `sr` is not used again.
        drop(unsafe { s.reclaim() });
        Ok(())
    }
}
