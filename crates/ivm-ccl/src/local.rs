//! [`LocalGroup`]: the ranks of a group as threads of one process, each with a VM of its
//! own — for tests and examples of collective programs on a machine without MPI, and for
//! a single-rank run (`LocalGroup::ranks(1)`). Not a transport between processes.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use ivm_std::Device;

use crate::comm::{Communicator, DType, Dst, HEADER_BYTES, Src, TransportError};

/// One rank of an in-process group: the ranks are threads of one process, each with a VM
/// of its own — for tests and examples of collective programs on a machine without MPI,
/// and for a single-rank run (`LocalGroup::ranks(1)`); not a transport between processes.
/// Serves host (cpu) tensors. Sums add contributions in rank order, so every rank gets
/// the same bits.
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Rendezvous>,
}

#[derive(Debug)]
struct Rendezvous {
    size: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    /// Completed rounds so far; a rank waits until this moves past the round it joined.
    generation: u64,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// The contributions of the last completed round, in rank order.
    last: Arc<Vec<Vec<u8>>>,
    /// A rank gave up waiting: the group takes no further calls.
    broken: bool,
}

impl LocalGroup {
    /// A group of `size` ranks: one communicator per rank, rank `i` at index `i`. Give
    /// each to the thread that plays that rank.
    pub fn ranks(size: usize) -> Vec<Arc<dyn Communicator>> {
        let shared = Arc::new(Rendezvous {
            size,
            state: Mutex::new(Round {
                slots: vec![None; size],
                ..Round::default()
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| {
                Arc::new(LocalGroup {
                    rank,
                    shared: shared.clone(),
                }) as Arc<dyn Communicator>
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Every rank's `data`, in rank order, once every rank has contributed.
    fn gather(
        &self,
        data: Vec<u8>,
        deadline: Instant,
    ) -> Result<Arc<Vec<Vec<u8>>>, TransportError> {
        let mut st = self.lock();
        if st.broken {
            return Err(TransportError::Broken);
        }
        let joined = st.generation;
        st.slots[self.rank] = Some(data);
        st.arrived += 1;
        if st.arrived == self.shared.size {
            let all = st.slots.iter_mut().map(|s| s.take().unwrap_or_default());
            st.last = Arc::new(all.collect());
            st.arrived = 0;
            st.generation += 1;
            self.shared.changed.notify_all();
            return Ok(st.last.clone());
        }
        // The round this rank joined completes only when every rank has contributed, and
        // the next one only after that (this rank is part of it): `last` is this round's.
        while st.generation == joined && !st.broken {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                st.broken = true;
                self.shared.changed.notify_all();
                return Err(TransportError::Timeout { abandoned: false });
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if st.generation == joined {
            return Err(TransportError::Broken);
        }
        Ok(st.last.clone())
    }
}

fn host_mut<'a>(d: Dst<'a>) -> Result<&'a mut [u8], TransportError> {
    match d {
        Dst::Host(b) => Ok(b),
        Dst::Device { .. } => Err(TransportError::Failed(
            "the local group moves host memory only".into(),
        )),
    }
}

fn add<const N: usize>(acc: &mut [u8], x: &[u8], f: impl Fn([u8; N], [u8; N]) -> [u8; N]) {
    for (a, b) in acc.chunks_exact_mut(N).zip(x.chunks_exact(N)) {
        let (mut l, mut r) = ([0u8; N], [0u8; N]);
        l.copy_from_slice(a);
        r.copy_from_slice(b);
        a.copy_from_slice(&f(l, r));
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn device(&self) -> Device {
        Device::CPU
    }

    fn transport(&self) -> &'static str {
        "local"
    }

    fn exchange_headers(
        &self,
        mine: &[u8; HEADER_BYTES],
        deadline: Instant,
    ) -> Result<Vec<[u8; HEADER_BYTES]>, TransportError> {
        let all = self.gather(mine.to_vec(), deadline)?;
        all.iter()
            .map(|h| {
                <[u8; HEADER_BYTES]>::try_from(h.as_slice())
                    .map_err(|_| TransportError::Failed("a header of the wrong size".into()))
            })
            .collect()
    }

    fn all_reduce_sum(
        &self,
        buf: Dst<'_>,
        dtype: DType,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let buf = host_mut(buf)?;
        let all = self.gather(buf.to_vec(), deadline)?;
        // From rank 0's contribution, adding the others in rank order (starting from the
        // first contribution, not from zero, keeps a float sum of -0.0 values -0.0).
        buf.copy_from_slice(&all[0]);
        for x in &all[1..] {
            match dtype {
                DType::U8 => add::<1>(buf, x, |a, b| [a[0].wrapping_add(b[0])]),
                DType::I32 => add::<4>(buf, x, |a, b| {
                    i32::from_ne_bytes(a)
                        .wrapping_add(i32::from_ne_bytes(b))
                        .to_ne_bytes()
                }),
                DType::I64 => add::<8>(buf, x, |a, b| {
                    i64::from_ne_bytes(a)
                        .wrapping_add(i64::from_ne_bytes(b))
                        .to_ne_bytes()
                }),
                DType::F32 => add::<4>(buf, x, |a, b| {
                    (f32::from_ne_bytes(a) + f32::from_ne_bytes(b)).to_ne_bytes()
                }),
                DType::F64 => add::<8>(buf, x, |a, b| {
                    (f64::from_ne_bytes(a) + f64::from_ne_bytes(b)).to_ne_bytes()
                }),
            }
        }
        Ok(())
    }

    fn broadcast(
        &self,
        buf: Dst<'_>,
        root: usize,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let buf = host_mut(buf)?;
        let all = self.gather(buf.to_vec(), deadline)?;
        buf.copy_from_slice(&all[root]);
        Ok(())
    }

    fn all_gather(
        &self,
        send: Src<'_>,
        recv: Dst<'_>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let Src::Host(send) = send else {
            return Err(TransportError::Failed(
                "the local group moves host memory only".into(),
            ));
        };
        let recv = host_mut(recv)?;
        let all = self.gather(send.to_vec(), deadline)?;
        for (chunk, x) in recv.chunks_exact_mut(send.len().max(1)).zip(all.iter()) {
            chunk.copy_from_slice(x);
        }
        Ok(())
    }
}
