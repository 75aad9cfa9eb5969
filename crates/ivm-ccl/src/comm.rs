//! The communicator trait a transport implements, and what ranks exchange before they
//! touch it (the [`Header`]).

use std::fmt;
use std::time::Instant;

use ivm_std::{Device, DeviceStream};

/// The element type of a collective's buffers (what an all-reduce adds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// Bytes (broadcast and all-gather move any type as bytes).
    U8,
    /// 32-bit signed integers.
    I32,
    /// 64-bit signed integers.
    I64,
    /// 32-bit floats.
    F32,
    /// 64-bit floats.
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    fn code(self) -> u8 {
        match self {
            DType::U8 => 0,
            DType::I32 => 1,
            DType::I64 => 2,
            DType::F32 => 3,
            DType::F64 => 4,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => DType::U8,
            1 => DType::I32,
            2 => DType::I64,
            3 => DType::F32,
            4 => DType::F64,
            _ => return None,
        })
    }
}

/// What a collective does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CollectiveKind {
    /// Every rank's buffer becomes the element-wise sum over all ranks (in place).
    AllReduceSum,
    /// Every rank's buffer becomes the root's (in place).
    Broadcast {
        /// The rank whose buffer is copied.
        root: usize,
    },
    /// Every rank's output becomes the concatenation of all ranks' inputs, in rank order.
    AllGather,
    /// No data: every rank arrives before any leaves.
    Barrier,
}

impl CollectiveKind {
    /// The name diagnostics and instruction labels use.
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduceSum => "all_reduce_sum",
            CollectiveKind::Broadcast { .. } => "broadcast",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

/// Bytes of an encoded [`Header`]: what every rank contributes to the exchange that
/// starts each collective.
pub const HEADER_BYTES: usize = 128;

/// Bytes of a failure message a header carries (longer messages are cut).
const MESSAGE_BYTES: usize = HEADER_BYTES - 32;

const MAGIC: u32 = 0x6976_6d63; // "ivmc"

/// What one rank is about to do, exchanged among all ranks before the transport is
/// touched: so that ranks that disagree on a collective (its sequence number, kind, type
/// or size) get an error naming both sides instead of corrupt data or a hang, and so that
/// a rank whose operand failed tells its peers, which then fail too instead of waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The collective's number in its communicator's build order (0, 1, ...).
    pub seq: u64,
    /// What it does.
    pub kind: CollectiveKind,
    /// Its element type.
    pub dtype: DType,
    /// Bytes of its input (its buffer, for in-place collectives).
    pub bytes: u64,
    /// `Some` when this rank will not take part: why (a poisoned operand, a local error).
    pub failure: Option<String>,
}

impl Header {
    /// The header as [`HEADER_BYTES`] bytes (little-endian; a long failure message is cut).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        let (kind, root) = match self.kind {
            CollectiveKind::AllReduceSum => (0u8, 0u64),
            CollectiveKind::Broadcast { root } => (1, root as u64),
            CollectiveKind::AllGather => (2, 0),
            CollectiveKind::Barrier => (3, 0),
        };
        b[4] = kind;
        b[5] = self.dtype.code();
        b[6] = u8::from(self.failure.is_some());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.bytes.to_le_bytes());
        b[24..32].copy_from_slice(&root.to_le_bytes());
        if let Some(m) = &self.failure {
            let mut n = m.len().min(MESSAGE_BYTES);
            while !m.is_char_boundary(n) {
                n -= 1;
            }
            b[32..32 + n].copy_from_slice(&m.as_bytes()[..n]);
        }
        b
    }

    /// Decodes a header; `None` for bytes that are not one (a peer that is not running
    /// this protocol).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[r]);
            u64::from_le_bytes(w)
        };
        if b[0..4] != MAGIC.to_le_bytes() {
            return None;
        }
        let kind = match b[4] {
            0 => CollectiveKind::AllReduceSum,
            1 => CollectiveKind::Broadcast {
                root: usize::try_from(word(24..32)).ok()?,
            },
            2 => CollectiveKind::AllGather,
            3 => CollectiveKind::Barrier,
            _ => return None,
        };
        let failure = (b[6] != 0).then(|| {
            let m = &b[32..];
            let end = m.iter().position(|&c| c == 0).unwrap_or(m.len());
            String::from_utf8_lossy(&m[..end]).into_owned()
        });
        Some(Header {
            seq: word(8..16),
            kind,
            dtype: DType::from_code(b[5])?,
            bytes: word(16..24),
            failure,
        })
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}", self.seq, self.kind.name())?;
        if let CollectiveKind::Broadcast { root } = self.kind {
            write!(f, "(root {root})")?;
        }
        write!(f, " of {} bytes of {:?}", self.bytes, self.dtype)
    }
}

/// A buffer a collective reads.
#[derive(Debug)]
pub enum Src<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory: its address and length, and the device stream to enqueue on.
    Device {
        /// The device address.
        ptr: u64,
        /// Its length in bytes.
        len: usize,
        /// The stream the collective is enqueued on.
        stream: &'a dyn DeviceStream,
    },
}

/// A buffer a collective writes (or reads and writes, in place).
#[derive(Debug)]
pub enum Dst<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// Device memory, as in [`Src::Device`].
    Device {
        /// The device address.
        ptr: u64,
        /// Its length in bytes.
        len: usize,
        /// The stream the collective is enqueued on.
        stream: &'a dyn DeviceStream,
    },
}

/// Why a transport call did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The transport reported an error.
    #[error("{0}")]
    Failed(String),
    /// Not every rank arrived before the deadline. When `abandoned`, the transport still
    /// references the buffers it was given (a started operation cannot be cancelled): the
    /// caller must keep them alive and untouched for as long as the process lives, and the
    /// communicator takes no further calls.
    #[error("not every rank arrived before the deadline")]
    Timeout {
        /// The transport still references the buffers.
        abandoned: bool,
    },
    /// An earlier timeout left the communicator unusable.
    #[error("the communicator is unusable after an earlier timeout")]
    Broken,
}

/// A group of ranks that run collectives together: the door of one transport (MPI, NCCL)
/// for one device of each rank.
///
/// Every call is collective: each rank of the group makes the same calls in the same
/// order (the [`Collectives`](crate::Collectives) front end guarantees that for the
/// collectives built on a VM, and checks it with the header exchange). Calls come from
/// one thread at a time (the device's collective stream), but not always the same one.
///
/// Calls are bounded by `deadline` where the transport allows it, so that a peer that
/// never arrives is an error, never a hang; a transport whose operations cannot be waited
/// for with a deadline documents that.
pub trait Communicator: Send + Sync + fmt::Debug + 'static {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn size(&self) -> usize;

    /// The device whose tensors this communicator moves (one per rank: the cpu for a host
    /// transport, the rank's GPU for a device transport). Collectives on tensors of
    /// another device are refused before the transport is touched.
    fn device(&self) -> Device;

    /// A short name for diagnostics (`"mpi"`, `"nccl"`, `"local"`).
    fn transport(&self) -> &'static str;

    /// Gathers every rank's header, in rank order. Every collective starts with it.
    ///
    /// # Errors
    /// [`TransportError::Timeout`] when not every rank arrived by `deadline` (the
    /// communicator may be [`Broken`](TransportError::Broken) afterwards).
    fn exchange_headers(
        &self,
        mine: &[u8; HEADER_BYTES],
        deadline: Instant,
    ) -> Result<Vec<[u8; HEADER_BYTES]>, TransportError>;

    /// Sums `buf` (elements of `dtype`) over all ranks, in place, on every rank.
    ///
    /// # Errors
    /// As the transport reports; [`TransportError::Timeout`] past `deadline`.
    fn all_reduce_sum(
        &self,
        buf: Dst<'_>,
        dtype: DType,
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// Copies `root`'s `buf` into every other rank's, in place.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum).
    fn broadcast(&self, buf: Dst<'_>, root: usize, deadline: Instant)
    -> Result<(), TransportError>;

    /// Writes the concatenation of every rank's `send` (all of one length), in rank
    /// order, into `recv` (`size()` times as long) on every rank.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum).
    fn all_gather(
        &self,
        send: Src<'_>,
        recv: Dst<'_>,
        deadline: Instant,
    ) -> Result<(), TransportError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_survives_encoding() {
        let h = Header {
            seq: 41,
            kind: CollectiveKind::Broadcast { root: 2 },
            dtype: DType::F32,
            bytes: 4096,
            failure: Some("tensor poisoned by `matmul#7`: it panicked".into()),
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let long = Header {
            seq: 0,
            kind: CollectiveKind::AllReduceSum,
            dtype: DType::U8,
            bytes: 1,
            failure: Some("é".repeat(200)),
        };
        let back = Header::decode(&long.encode()).unwrap();
        assert!(back.failure.unwrap().chars().all(|c| c == 'é'));
        assert_eq!(Header::decode(&[0u8; HEADER_BYTES]), None);
    }
}
