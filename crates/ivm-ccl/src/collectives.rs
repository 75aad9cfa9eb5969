//! The front end: collectives built like any instruction, on the device's collective
//! stream, in build order; and [`Collectives::global_sync`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ivm_std::{
    Done, Error, InstructionPolicy, InstructionsBuilder, KernelCtx, Result, Stream, StreamId,
    StreamType, Tensor, VirtualMachine,
};

use crate::comm::{
    CollectiveKind, Communicator, DType, Dst, HEADER_BYTES, Header, Src, TransportError,
};

/// How long a collective waits for every rank to arrive by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Collectives of one [`Communicator`] on one VM (see the [crate docs](crate)).
///
/// Each collective is an instruction on the collective stream of the communicator's device
/// ([`StreamType::Collective`]: a thread of its own, so a transport call waiting for a slow
/// peer never holds up compute; while that thread shares its CPU, as when `mpirun` binds
/// each rank to one CPU, the caller that waits for a collective runs it instead of waking
/// the thread). It reads and writes its tensors like any instruction, so
/// the engine orders it against compute; and the stream dispatches in build order
/// ([`ivm_std::StreamPolicy::dispatch_in_build_order`]), so the collectives reach the
/// transport in the order they were built on every rank, whichever operands become ready
/// first.
///
/// # Examples
///
/// One rank (a [`LocalGroup`](crate::LocalGroup) of one): the all-reduce of one rank is
/// the identity.
///
/// ```
/// use ivm_ccl::{Collectives, DType, LocalGroup};
/// use ivm_std::{Config, VirtualMachine};
///
/// let vm = VirtualMachine::new(Config::default())?;
/// let comm = LocalGroup::ranks(1).pop().unwrap();
/// let ccl = Collectives::new(&vm, comm)?;
/// let s = vm.default_stream();
/// let t = vm.new_tensor_from(&s, &2.5f32.to_ne_bytes())?;
/// vm.run(|b| ccl.all_reduce_sum(b, &t, DType::F32))?;
/// let mut out = [0u8; 4];
/// vm.read_small(&t, 0, &mut out)?;
/// assert_eq!(f32::from_ne_bytes(out), 2.5);
/// ccl.global_sync(&vm)?;
/// # Ok::<(), ivm_std::Error>(())
/// ```
#[derive(Debug)]
pub struct Collectives {
    comm: Arc<dyn Communicator>,
    stream: Stream,
    /// The next collective's number in build order (the header's `seq`). Relaxed: a
    /// number, published to the collective's thread by the instruction's submission.
    seq: AtomicU64,
    timeout: Duration,
    /// Set when a transport call was abandoned after a timeout: the communicator takes no
    /// further calls (every later collective fails at once, on this rank). Relaxed: it
    /// guards the transport's own state, not memory; a late read delays the refusal by
    /// one call.
    broken: Arc<AtomicBool>,
    /// The first collective that failed on this rank since the last `global_sync`.
    failed: Arc<Mutex<Option<String>>>,
    /// Where collectives record their spans, while recording is on.
    spans: Arc<Mutex<Option<Vec<Span>>>>,
}

/// When one collective ran on this rank: from the start of its header exchange to the
/// return of its transport call (see [`Collectives::record_spans`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Its number in build order.
    pub seq: u64,
    /// What it did.
    pub kind: CollectiveKind,
    /// Bytes it moved (its input's size).
    pub bytes: u64,
    /// When its header exchange started.
    pub start: Instant,
    /// When its transport call returned (for a device transport: when it was enqueued).
    pub end: Instant,
}

impl Collectives {
    /// Collectives of `comm` on `vm`, on the collective stream of `comm`'s device.
    ///
    /// # Errors
    /// [`Error::UnsupportedStream`] when `vm` has no adapter for the communicator's device.
    pub fn new(vm: &VirtualMachine, comm: Arc<dyn Communicator>) -> Result<Self> {
        let stream = vm.stream(StreamId {
            device: comm.device(),
            stream_type: StreamType::Collective,
            thread_id: 0,
        })?;
        Ok(Self {
            comm,
            stream,
            seq: AtomicU64::new(0),
            timeout: DEFAULT_TIMEOUT,
            broken: Arc::new(AtomicBool::new(false)),
            failed: Arc::default(),
            spans: Arc::default(),
        })
    }

    /// These collectives, waiting at most `timeout` for every rank to arrive at each one
    /// (default [`DEFAULT_TIMEOUT`]).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How many ranks the group has.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The collective stream the collectives run on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Starts (or stops) recording when each collective runs on this rank, for timelines
    /// and overlap figures ([`take_spans`](Self::take_spans)). Off by default.
    pub fn record_spans(&self, on: bool) {
        *lock(&self.spans) = on.then(Vec::new);
    }

    /// The spans recorded since recording started or since the last call, in the order the
    /// collectives finished.
    pub fn take_spans(&self) -> Vec<Span> {
        lock(&self.spans)
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Sums `t` (elements of `dtype`) over all ranks, in place: after every earlier writer
    /// of `t`, before every later access.
    ///
    /// # Errors
    /// Before anything is submitted: [`Error::DeviceMismatch`] for a tensor of another
    /// device than the communicator's; [`Error::InvalidArgument`] when `t`'s size is not a
    /// whole number of `dtype` elements. A failure while it runs (a peer's, a disagreement
    /// between ranks, a timeout) poisons `t`: its readers get the error, naming the
    /// collective.
    pub fn all_reduce_sum(
        &self,
        b: &mut InstructionsBuilder<'_>,
        t: &Tensor,
        dtype: DType,
    ) -> Result<()> {
        self.check_device(t)?;
        if !t.nbytes().is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "all_reduce_sum: a {}-byte tensor is not a whole number of {dtype:?} elements",
                t.nbytes()
            )));
        }
        self.submit(
            b,
            CollectiveKind::AllReduceSum,
            dtype,
            &[],
            &[t],
            t.nbytes(),
        )
    }

    /// Sums every tensor of `bucket` (elements of `dtype`) over all ranks, in place, in
    /// one transport call: the tensors side by side in one buffer, as data-parallel
    /// training buckets its gradients (one header exchange and one all-reduce for the
    /// bucket instead of one per tensor). Host (cpu) tensors only.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum), for each tensor;
    /// [`Error::InvalidArgument`] for an empty bucket, or a bucket of device tensors.
    pub fn all_reduce_sum_bucket(
        &self,
        b: &mut InstructionsBuilder<'_>,
        bucket: &[&Tensor],
        dtype: DType,
    ) -> Result<()> {
        if bucket.is_empty() || self.comm.device().kind != ivm_std::DeviceKind::CPU {
            return Err(Error::InvalidArgument(
                "all_reduce_sum_bucket: a bucket of one or more host tensors".into(),
            ));
        }
        let mut total = 0;
        for t in bucket {
            self.check_device(t)?;
            if !t.nbytes().is_multiple_of(dtype.size()) {
                return Err(Error::InvalidArgument(format!(
                    "all_reduce_sum_bucket: a {}-byte tensor is not a whole number of \
                     {dtype:?} elements",
                    t.nbytes()
                )));
            }
            total += t.nbytes();
        }
        self.submit(b, CollectiveKind::AllReduceSum, dtype, &[], bucket, total)
    }

    /// Copies rank `root`'s `t` into every other rank's `t`.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum); [`Error::InvalidArgument`] when `root`
    /// is not a rank.
    pub fn broadcast(
        &self,
        b: &mut InstructionsBuilder<'_>,
        t: &Tensor,
        root: usize,
    ) -> Result<()> {
        self.check_device(t)?;
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "broadcast: root {root} of a group of {} ranks",
                self.size()
            )));
        }
        let kind = CollectiveKind::Broadcast { root };
        self.submit(b, kind, DType::U8, &[], &[t], t.nbytes())
    }

    /// Writes every rank's `input`, in rank order, into `output` (`size()` times as long).
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum); [`Error::SizeMismatch`] when `output`
    /// is not `size()` times `input`.
    pub fn all_gather(
        &self,
        b: &mut InstructionsBuilder<'_>,
        input: &Tensor,
        output: &Tensor,
    ) -> Result<()> {
        self.check_device(input)?;
        self.check_device(output)?;
        if Some(output.nbytes()) != input.nbytes().checked_mul(self.size()) {
            return Err(Error::SizeMismatch {
                src: input.nbytes().saturating_mul(self.size()),
                dst: output.nbytes(),
            });
        }
        let kind = CollectiveKind::AllGather;
        self.submit(b, kind, DType::U8, &[input], &[output], input.nbytes())
    }

    /// A barrier in the collective stream's order: it runs when every collective built
    /// before it has, and every rank has reached it.
    ///
    /// # Errors
    /// As [`InstructionsBuilder::custom`].
    pub fn barrier(&self, b: &mut InstructionsBuilder<'_>) -> Result<()> {
        self.submit(b, CollectiveKind::Barrier, DType::U8, &[], &[], 0)
    }

    /// Every rank's VM drained, then a cross-rank barrier: returns when every rank has
    /// finished everything it submitted before its call, and `Ok` only if every rank did so
    /// without an error. Call it on every rank, at the same point of the collective order,
    /// with no other thread building collectives on this communicator meanwhile.
    ///
    /// # Errors
    /// This rank's own error from draining its VM (after telling its peers); or
    /// [`Error::Collective`] naming the first rank that failed (its VM did not drain, or
    /// one of its collectives failed since the last `global_sync`) and its error, the
    /// ranks that disagree on the collective order, or the rank count when not every rank
    /// arrived within the timeout.
    pub fn global_sync(&self, vm: &VirtualMachine) -> Result<()> {
        let local = vm.sync_timeout(self.timeout);
        let failed = lock(&self.failed).take();
        let header = Header {
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            kind: CollectiveKind::Barrier,
            dtype: DType::U8,
            bytes: 0,
            failure: match (&local, failed) {
                (Err(e), _) => Some(format!("rank {}: global_sync: {e}", self.rank())),
                (Ok(()), Some(f)) => Some(f),
                (Ok(()), None) => None,
            },
        };
        let what = Label(&header, &*self.comm);
        let r = exchange(&*self.comm, &self.broken, &header, self.timeout, &what);
        local?;
        r.map_err(Error::Collective)
    }

    fn check_device(&self, t: &Tensor) -> Result<()> {
        let d = self.comm.device();
        if t.device() != d {
            return Err(Error::DeviceMismatch(format!(
                "{} serves tensors of {d}; a collective was asked to move a tensor of {}",
                self.comm.transport(),
                t.device()
            )));
        }
        Ok(())
    }

    fn submit(
        &self,
        b: &mut InstructionsBuilder<'_>,
        kind: CollectiveKind,
        dtype: DType,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        bytes: usize,
    ) -> Result<()> {
        // Relaxed: a number in build order; the builder's submission publishes it.
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let op = CollectiveOp {
            comm: self.comm.clone(),
            broken: self.broken.clone(),
            failed: self.failed.clone(),
            spans: self.spans.clone(),
            header: Header {
                seq,
                kind,
                dtype,
                bytes: bytes as u64,
                failure: None,
            },
            timeout: self.timeout,
        };
        // On a launcher device (cuda) the policy finds the device stream to enqueue on in
        // its `KernelCtx`; on the cpu it runs the host transport on the stream's thread.
        b.custom_named(kind.name(), &self.stream, inputs, outputs, op)
    }
}

/// How diagnostics name one collective: `collective #seq kind of N bytes of T over R ranks
/// (mpi)`. Formatted only when an error needs it.
struct Label<'a>(&'a Header, &'a dyn Communicator);

impl std::fmt::Display for Label<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Label(h, comm) = self;
        write!(
            f,
            "collective {h} over {} ranks ({})",
            comm.size(),
            comm.transport()
        )
    }
}

/// One collective instruction: its header, and the communicator to run it on.
#[derive(Debug)]
struct CollectiveOp {
    comm: Arc<dyn Communicator>,
    broken: Arc<AtomicBool>,
    failed: Arc<Mutex<Option<String>>>,
    spans: Arc<Mutex<Option<Vec<Span>>>>,
    header: Header,
    timeout: Duration,
}

impl CollectiveOp {
    /// Runs the collective, recording its span when recording is on.
    fn run(&self, k: &mut KernelCtx<'_>) -> std::result::Result<(), String> {
        let start = Instant::now();
        let r = self.run_inner(k);
        if let Some(v) = lock(&self.spans).as_mut() {
            v.push(Span {
                seq: self.header.seq,
                kind: self.header.kind,
                bytes: self.header.bytes,
                start,
                end: Instant::now(),
            });
        }
        r
    }

    /// Exchanges headers, then runs the transport call on the operands.
    fn run_inner(&self, k: &mut KernelCtx<'_>) -> std::result::Result<(), String> {
        let what = Label(&self.header, &*self.comm);
        exchange(&*self.comm, &self.broken, &self.header, self.timeout, &what)
            .map_err(|m| self.record(m))?;
        let deadline = deadline_after(self.timeout);
        let stream = k.device_stream();
        let r = match self.header.kind {
            // Nothing to move, and every rank knows it (the headers agreed on the size), so
            // every rank skips the transport. Transports need not take an empty tensor's
            // dangling slice: MPI refuses it as an invalid argument and aborts the rank.
            _ if self.header.bytes == 0 => Ok(()),
            CollectiveKind::AllReduceSum if k.num_outputs() > 1 => {
                // A bucket: the tensors side by side in one buffer, one transport call.
                let total: usize = (0..k.num_outputs()).map(|i| k.output(i).len()).sum();
                let mut words = vec![0u64; total.div_ceil(8)];
                let bytes = as_bytes_mut(&mut words, total);
                let mut at = 0;
                for i in 0..k.num_outputs() {
                    let o = k.output(i);
                    bytes[at..at + o.len()].copy_from_slice(o);
                    at += o.len();
                }
                let r = self
                    .comm
                    .all_reduce_sum(Dst::Host(bytes), self.header.dtype, deadline);
                if matches!(r, Err(TransportError::Timeout { abandoned: true })) {
                    // The transport still references the bucket.
                    std::mem::forget(words);
                } else if r.is_ok() {
                    let mut at = 0;
                    for i in 0..k.num_outputs() {
                        let o = k.output(i);
                        let n = o.len();
                        o.copy_from_slice(&as_bytes_mut(&mut words, total)[at..at + n]);
                        at += n;
                    }
                }
                r
            }
            CollectiveKind::AllReduceSum => {
                let dst = dst(k, 0, stream);
                self.comm.all_reduce_sum(dst, self.header.dtype, deadline)
            }
            CollectiveKind::Broadcast { root } => {
                let dst = dst(k, 0, stream);
                self.comm.broadcast(dst, root, deadline)
            }
            CollectiveKind::AllGather => {
                let src = match stream {
                    Some(stream) => Src::Device {
                        ptr: k.input_device_ptr(0),
                        len: k.input_memory(0).nbytes(),
                        stream,
                    },
                    None => Src::Host(k.input(0)),
                };
                let dst = dst(k, 0, stream);
                self.comm.all_gather(src, dst, deadline)
            }
            CollectiveKind::Barrier => Ok(()),
        };
        let r = match r {
            Ok(()) => Ok(()),
            Err(e) => {
                if matches!(e, TransportError::Timeout { abandoned: true }) {
                    // The transport still references the operands' memory: it must stay
                    // allocated, and nothing may reuse it, for as long as the process
                    // lives. Leak one reference to each memory, and refuse later calls.
                    for i in 0..k.num_inputs() {
                        std::mem::forget(k.input_memory(i).clone());
                    }
                    for i in 0..k.num_outputs() {
                        std::mem::forget(k.output_memory(i).clone());
                    }
                    self.broken.store(true, Ordering::Relaxed);
                }
                Err(describe(&what, &e, self.timeout))
            }
        };
        r.map_err(|m| self.record(m))
    }

    /// Remembers the first failure for `global_sync`, and returns it.
    fn record(&self, m: String) -> String {
        lock(&self.failed).get_or_insert_with(|| m.clone());
        m
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The first `len` bytes of `words` (an 8-byte aligned bucket).
fn as_bytes_mut(words: &mut [u64], len: usize) -> &mut [u8] {
    let all = words.as_mut_ptr().cast::<u8>();
    assert!(len <= words.len() * 8);
    // SAFETY: `len` bytes lie inside `words` (checked), u8 has no alignment or validity
    // requirement, and the slice borrows `words` mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(all, len) }
}

fn dst<'a>(
    k: &'a mut KernelCtx<'_>,
    i: usize,
    stream: Option<&'a dyn ivm_std::DeviceStream>,
) -> Dst<'a> {
    match stream {
        Some(stream) => Dst::Device {
            ptr: k.output_device_ptr(i),
            len: k.output_memory(i).nbytes(),
            stream,
        },
        None => Dst::Host(k.output(i)),
    }
}

fn describe(what: &Label<'_>, e: &TransportError, timeout: Duration) -> String {
    match e {
        TransportError::Timeout { .. } => {
            format!("{what}: not every rank arrived within {timeout:?}")
        }
        e => format!("{what}: {e}"),
    }
}

/// Exchanges `mine` with every rank and checks that they agree: the same collective, no
/// rank failed. The error names the collective, the rank count, and the rank that failed
/// or disagrees.
fn exchange(
    comm: &dyn Communicator,
    broken: &AtomicBool,
    mine: &Header,
    timeout: Duration,
    what: &Label<'_>,
) -> std::result::Result<(), String> {
    // Relaxed: a flag this communicator's own earlier call set; the transport's own
    // state is what it protects, and a late read only delays the refusal by one call.
    if broken.load(Ordering::Relaxed) {
        return Err(describe(what, &TransportError::Broken, timeout));
    }
    let all = match comm.exchange_headers(&mine.encode(), deadline_after(timeout)) {
        Ok(all) => all,
        Err(e) => {
            if matches!(e, TransportError::Timeout { .. } | TransportError::Broken) {
                broken.store(true, Ordering::Relaxed);
            }
            return Err(describe(what, &e, timeout));
        }
    };
    let me = comm.rank();
    let mut first_failure = None;
    for (rank, bytes) in all.iter().enumerate() {
        let bytes: &[u8; HEADER_BYTES] = bytes;
        let Some(theirs) = Header::decode(bytes) else {
            return Err(format!(
                "{what}: rank {rank} sent a header that is not an ivm-ccl header"
            ));
        };
        if let Some(m) = &theirs.failure {
            first_failure.get_or_insert_with(|| format!("{what}: rank {rank} failed: {m}"));
            continue;
        }
        if rank != me && mine.failure.is_none() && !same_collective(mine, &theirs) {
            return Err(format!(
                "{what}: the ranks disagree on the collective: rank {me} is at {mine}, \
                 rank {rank} at {theirs}"
            ));
        }
    }
    match (first_failure, &mine.failure) {
        (Some(f), _) => Err(f),
        (None, Some(m)) => Err(m.clone()),
        (None, None) => Ok(()),
    }
}

/// `timeout` from now (a year when that overflows the clock).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// Whether two headers name the same collective (what ranks must agree on: all but the
/// failure).
fn same_collective(a: &Header, b: &Header) -> bool {
    (a.seq, a.kind, a.dtype, a.bytes) == (b.seq, b.kind, b.dtype, b.bytes)
}

impl InstructionPolicy for CollectiveOp {
    fn launch(self: Box<Self>, ctx: &mut KernelCtx<'_>, done: Done) {
        let _ = match self.run(ctx) {
            Ok(()) => done.complete(),
            Err(m) => done.fail(m),
        };
    }

    /// Fires during `launch`: the transport call has returned when `launch` does.
    fn completes_during_launch(&self) -> bool {
        true
    }

    /// A poisoned operand on this rank: tell the peers (they fail with this error
    /// instead of waiting in the transport for this rank).
    fn poisoned(&mut self, error: &Error) {
        let mut h = self.header.clone();
        h.failure = Some(error.to_string());
        let what = Label(&h, &*self.comm);
        let _ = exchange(&*self.comm, &self.broken, &h, self.timeout, &what);
        self.record(format!("{what}: {error}"));
    }
}
