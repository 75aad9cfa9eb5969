//! What the engine's pools hold: one slot type per pool ([`Node`], [`AccessSlot`],
//! [`Edge`], [`StreamSlot`]), the tags naming the lists threaded through their hooks, and
//! [`NodeState`].
//!
//! Separate from the engine's steps so that the data every step reads — and the table of
//! lists in `engine.rs` — can be read in one place; the fields are `pub(super)`: only the
//! engine's own modules touch them.

use core::ptr::NonNull;

use ivm_core::list::{IndexLinks, IndexList};

use crate::dependence::Dependence;
use crate::pool::{Free, hook};

/// Tag: the lively list (nodes, oldest first).
pub(crate) enum LivelyTag {}
/// Tag: pending, ready, held, running and barrier lists (a node is on one at a time).
pub(crate) enum Queue {}
/// Tag: a node's out-edges.
pub(crate) enum Out {}
/// Tag: a node's accesses.
pub(crate) enum OnNode {}
/// Tag: a dependence's accesses since its last write.
pub(crate) enum OnDep {}
/// Tag: the list of streams with a non-empty running list.
pub(crate) enum Active {}

/// Where a lively instruction is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeState {
    /// Received, not yet handled (no dependences consumed).
    #[default]
    Pending,
    /// Waiting for in-edges.
    Waiting,
    /// Ready: will be dispatched by the next step.
    Ready,
    /// Ready, but held back behind a claimed instruction of its stream.
    Held,
    /// Handed to its stream's executor.
    Dispatched,
    /// A barrier waiting to be the oldest lively instruction.
    Barrier,
}

/// A pool slot for one instruction (engine-internal; public only so that a
/// [`Storage`] can name its container).
///
/// [`Storage`]: crate::pool::Storage
pub struct Node<I> {
    pub(super) instr: Option<I>,
    pub(super) stream: u32,
    pub(super) state: NodeState,
    /// In-edges whose source is neither released nor (non-strictly) dispatched on this
    /// node's stream.
    pub(super) blocking: u32,
    /// In-edges whose source is not released.
    pub(super) in_edges: u32,
    pub(super) out: IndexList<Out>,
    pub(super) accesses: IndexList<OnNode>,
    lively: IndexLinks,
    queue: IndexLinks,
    /// Its same-stream out-edges are strict ([`Instruction::strict_edges`]).
    ///
    /// [`Instruction::strict_edges`]: crate::Instruction::strict_edges
    pub(super) strict_out: bool,
}

impl<I> Default for Node<I> {
    fn default() -> Self {
        Self {
            instr: None,
            stream: 0,
            state: NodeState::Pending,
            blocking: 0,
            in_edges: 0,
            out: IndexList::new(),
            accesses: IndexList::new(),
            lively: IndexLinks::new(),
            queue: IndexLinks::new(),
            strict_out: false,
        }
    }
}

macro_rules! node_hook {
    ($tag:ty, $field:ident) => {
        impl<I> ivm_core::list::IndexLinked<$tag> for Node<I> {
            #[inline]
            fn links(&self) -> &IndexLinks {
                &self.$field
            }
            #[inline]
            fn links_mut(&mut self) -> &mut IndexLinks {
                &mut self.$field
            }
        }
    };
}
node_hook!(LivelyTag, lively);
node_hook!(Free, lively);
node_hook!(Queue, queue);

/// A pool slot for one edge (engine-internal).
#[derive(Default)]
pub struct Edge {
    pub(super) dst: u32,
    /// No longer counted in `dst.blocking` (source dispatched on `dst`'s stream).
    pub(super) satisfied: bool,
    /// A same-stream edge that dispatch order does not satisfy
    /// ([`StreamPolicy::strict_same_stream_edges`]).
    ///
    /// [`StreamPolicy::strict_same_stream_edges`]: crate::StreamPolicy::strict_same_stream_edges
    pub(super) strict: bool,
    out: IndexLinks,
}
hook!(Edge, Out, out);
hook!(Edge, Free, out);

/// Which dependence an access is to.
#[derive(Clone, Copy, Default)]
pub(super) enum DepRef {
    #[default]
    None,
    /// An instruction's operand (alive while the instruction is lively: the
    /// [`Instruction`] contract).
    ///
    /// [`Instruction`]: crate::Instruction
    External(NonNull<Dependence>),
    /// A stream's schedule dependence (in the engine's stream pool).
    Stream(u32),
}

/// A pool slot for one access of an instruction to a dependence (engine-internal).
#[derive(Default)]
pub struct AccessSlot {
    pub(super) node: u32,
    pub(super) dep: DepRef,
    pub(super) write: bool,
    on_node: IndexLinks,
    pub(super) on_dep: IndexLinks,
}
hook!(AccessSlot, OnNode, on_node);
hook!(AccessSlot, Free, on_node);
hook!(AccessSlot, OnDep, on_dep);

// SAFETY: the only non-`Send` part is `DepRef::External`'s pointer. It is dereferenced only
// by the engine that owns this slot, through `&mut Engine` (single owner; whoever moves the
// engine between threads orders the moves), the `Dependence` it points to is `Sync`, and
// the `Instruction` contract keeps it alive while the access exists. So an engine — and its
// pools — may move to another thread with the instructions it holds (`I: Send`).
unsafe impl Send for AccessSlot {}

/// A pool slot for one stream (engine-internal).
#[derive(Default)]
pub struct StreamSlot {
    pub(super) known: bool,
    pub(super) strict: bool,
    /// Its policy lets consecutive instructions fuse ([`StreamPolicy::may_fuse`]).
    ///
    /// [`StreamPolicy::may_fuse`]: crate::StreamPolicy::may_fuse
    pub(super) fuse: bool,
    pub(super) running: IndexList<Queue>,
    /// A node handed to its waiting caller ([`Dispatched::Claimed`]) and not yet released:
    /// later nodes wait in `held`, in dispatch order, until its release.
    ///
    /// [`Dispatched::Claimed`]: crate::Dispatched::Claimed
    pub(super) claimed: u32,
    pub(super) held: IndexList<Queue>,
    /// The stream's schedule dependence: accesses since its last stream-sequential write.
    pub(super) schedule: IndexList<OnDep>,
    active: IndexLinks,
}
hook!(StreamSlot, Active, active);
