//! A worker's express lane: one small access at a time, handed straight to a polling
//! worker while the engine is at rest (ARCHITECTURE.md, "The express lane").
//!
//! A sync small access on a worker stream normally becomes an instruction: a ring entry,
//! an engine step, a push onto the worker's queue, the worker's run, its release. When the
//! engine holder finds the engine at rest (nothing lively, nothing received: what the
//! inline path of `try_direct` needs) and the stream's worker is polling, none of that is
//! needed to order the access: the holder posts the access (an address, a length, up to
//! 16 bytes) to the worker's lane, the worker copies, answers, and the holder lets go of
//! the engine. One cache line travels there and back; everything the access needs lives
//! in it.
//!
//! # Protocol
//!
//! One state word, beside the request in the same line:
//!
//! | state | who moves it out, to what |
//! |---|---|
//! | `CLOSED` | the worker, [`open`](ExpressLane::open): → `OPEN` |
//! | `OPEN` | the poster: → `POSTED`; the worker, [`close`](ExpressLane::close): → `CLOSED` |
//! | `POSTED` | the worker, [`serve`](ExpressLane::serve): → `TAKEN`; the poster, withdrawing: → `OPEN` |
//! | `TAKEN` | the worker, once the copy is done: → `ANSWERED` |
//! | `ANSWERED` | as `OPEN` (the next poster posts from it; the worker closes it) |
//!
//! The poster leaves an answered lane `ANSWERED` rather than writing it back to `OPEN`:
//! one write of the shared line less per access (the line is the whole cost of the lane).
//!
//! * Only one thread posts at a time: the engine's holder (callers are told so under
//!   `# Safety`). The worker reads the request, and writes a read's bytes into it, only
//!   in `TAKEN`; the poster writes it only in `OPEN`, `ANSWERED` or `CLOSED`.
//! * `open`, `serve` and `close` are the worker's, called from its own thread only.
//! * The worker opens its lane while it polls its queue and closes it before it sleeps or
//!   exits; closing serves a request that is posted, so nothing posted is ever stranded.
//!   A poster that finds the lane closed (the worker sleeps) takes another path.
//! * A poster that waited long enough (the worker was descheduled) withdraws with a
//!   compare-exchange `POSTED → OPEN`; if that fails the worker has taken the request and
//!   is copying: the answer comes within a few instructions.
//! * Once it has posted, the poster reads any state other than `POSTED` / `TAKEN` as
//!   "answered": `ANSWERED`, or `CLOSED` / `OPEN` when the worker closed (and reopened)
//!   after answering. The answer and the reopening are Release stores, and the closing
//!   is a read-modify-write, which continues the release sequence of the store it reads
//!   (the answer's, or the reopening's), so whichever of them the poster's Acquire load
//!   reads, the worker's copy happens before it.
//!
//! The loom model `tests/loom_express.rs` checks that every access the lane reports done
//! was done by the worker exactly once (a count of what the worker served), that the
//! worker's copy and a poster's own access of the bytes never overlap (a loom cell stands
//! for the tensor), that a read returns the bytes written (never a buffer nobody filled),
//! and that a poster that never gives up is never stranded; with planted bugs.

use ivm_core::sync::{AtomicU32, Ordering, UnsafeCell};

const CLOSED: u32 = 0;
const OPEN: u32 = 1;
const POSTED: u32 = 2;
const TAKEN: u32 = 3;
const ANSWERED: u32 = 4;

/// The largest access the lane carries (the sync small accesses' largest size).
pub const EXPRESS_MAX: usize = 16;

/// What a posted access came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Express {
    /// The worker did it.
    Done,
    /// The lane was closed (the worker sleeps, or is gone): nothing was done.
    Closed,
    /// The poster gave up before the worker took it: nothing was done.
    Withdrawn,
}

/// Planted bugs for the loom model (each must be caught).
#[cfg(loom)]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planted {
    None,
    /// `open` with a Relaxed store: a poster that reads the reopened lane as "answered"
    /// is not ordered after the worker's copy (a data race on the buffer).
    OpenRelaxed,
    /// `close` with a plain store: a posted request is dropped, and its poster reads a
    /// buffer nobody wrote.
    CloseByStore,
    /// The poster reads the answer through a Relaxed load.
    AnswerRelaxed,
    /// The poster withdraws with a plain store instead of a compare-exchange: the worker
    /// may have taken the request, and copies while the poster does the access itself.
    WithdrawByStore,
}

struct Request {
    /// The tensor's bytes (host memory).
    at: *mut u8,
    len: usize,
    write: bool,
    /// A write's bytes on the way in; a read's on the way out.
    buf: [u8; EXPRESS_MAX],
}

/// One worker's express lane (module docs). Lives in the worker's `ThreadCtx`.
#[repr(align(64))]
pub struct ExpressLane {
    state: AtomicU32,
    req: UnsafeCell<Request>,
    #[cfg(loom)]
    planted: Planted,
    /// Loom model only: a cell standing for the tensor's bytes, accessed where the worker
    /// copies (so that loom checks the copy against the poster's own accesses).
    #[cfg(loom)]
    memory: Option<&'static UnsafeCell<()>>,
}

// SAFETY: `req` (with its raw pointer) is written by the one poster only while the state
// is `OPEN`, `ANSWERED` or `CLOSED`, which the worker never reads it in, and read and
// written by the worker only in `TAKEN`; the hand-overs are the Release/Acquire pairs of
// the module docs. The pointer is the poster's to hand over (`read` / `write`'s contract).
unsafe impl Sync for ExpressLane {}
// SAFETY: as above; the lane owns nothing the pointer points to.
unsafe impl Send for ExpressLane {}

impl Default for ExpressLane {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ExpressLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Relaxed: diagnostic only.
        let state = match self.state.load(Ordering::Relaxed) {
            CLOSED => "closed",
            OPEN => "open",
            POSTED => "posted",
            TAKEN => "taken",
            ANSWERED => "answered",
            _ => "invalid",
        };
        f.debug_struct("ExpressLane")
            .field("state", &format_args!("{state}"))
            .finish()
    }
}

impl ExpressLane {
    /// A closed lane.
    pub fn new() -> Self {
        Self {
            state: AtomicU32::new(CLOSED),
            req: UnsafeCell::new(Request {
                at: std::ptr::null_mut(),
                len: 0,
                write: false,
                buf: [0; EXPRESS_MAX],
            }),
            #[cfg(loom)]
            planted: Planted::None,
            #[cfg(loom)]
            memory: None,
        }
    }

    /// A closed lane with a planted bug, whose worker's copies access `memory` (loom model
    /// only).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn with_planted(planted: Planted, memory: &'static UnsafeCell<()>) -> Self {
        Self {
            planted,
            memory: Some(memory),
            ..Self::new()
        }
    }

    /// Planted: `open` with a Relaxed store.
    #[cfg(loom)]
    fn planted_open_relaxed(&self) {
        self.state.store(OPEN, Ordering::Relaxed);
    }

    /// Planted: a withdrawal by plain store, whatever the worker did meanwhile.
    #[cfg(loom)]
    fn planted_withdraw_by_store(&self) -> Express {
        self.state.store(OPEN, Ordering::Relaxed);
        Express::Withdrawn
    }

    /// Planted: `close` with a plain store (a posted request dropped).
    #[cfg(loom)]
    fn planted_close_by_store(&self) -> usize {
        self.state.store(CLOSED, Ordering::Release);
        0
    }

    #[cfg(loom)]
    fn planted(&self, bug: Planted) -> bool {
        self.planted == bug
    }

    /// Worker: opens the lane (it polls now). Only the worker moves the lane out of
    /// `CLOSED`, so a plain store.
    pub fn open(&self) {
        // Relaxed: only the worker leaves CLOSED, and this thread closed it.
        debug_assert_eq!(
            self.state.load(Ordering::Relaxed),
            CLOSED,
            "ivm: an express lane opened twice"
        );
        #[cfg(loom)]
        if self.planted(Planted::OpenRelaxed) {
            return self.planted_open_relaxed();
        }
        // Release: a poster that posted before we closed, and reads this reopened lane as
        // its answer, must see the copy we did before closing (module docs).
        self.state.store(OPEN, Ordering::Release);
    }

    /// Worker, after each look at its queue while the lane is open: does a posted access.
    /// Returns whether it did one.
    pub fn serve(&self) -> bool {
        // Relaxed: a cheap look every poll step; the compare-exchange below acquires.
        if self.state.load(Ordering::Relaxed) != POSTED {
            return false;
        }
        // Acquire: pairs with the poster's Release `OPEN → POSTED`, publishing the request
        // (and a write's bytes). Fails if the poster withdrew meanwhile.
        if self
            .state
            .compare_exchange(POSTED, TAKEN, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        #[cfg(loom)]
        if let Some(memory) = self.memory {
            // The model's stand-in for the tensor's bytes: the copy below touches them.
            memory.with_mut(|_| ());
        }
        self.req.with_mut(|r| {
            // SAFETY: in `TAKEN` the worker owns the request (module docs); `at..at+len`
            // is valid and nobody else's until we answer (`read` / `write`'s contract).
            unsafe {
                let r = &mut *r;
                if r.write {
                    std::ptr::copy_nonoverlapping(r.buf.as_ptr(), r.at, r.len);
                } else {
                    std::ptr::copy_nonoverlapping(r.at, r.buf.as_mut_ptr(), r.len);
                }
            }
        });
        // Release: the copy (into the buffer, or into the tensor) before the answer.
        self.state.store(ANSWERED, Ordering::Release);
        true
    }

    /// Worker, before it sleeps or exits: closes the lane, doing posted accesses first (one
    /// may be posted while it closes the last). Returns how many it did.
    pub fn close(&self) -> usize {
        #[cfg(loom)]
        if self.planted(Planted::CloseByStore) {
            return self.planted_close_by_store();
        }
        let mut served = 0;
        loop {
            // Relaxed: the compare-exchange below decides.
            let s = self.state.load(Ordering::Relaxed);
            match s {
                CLOSED => return served,
                // `TAKEN` is the worker's own, never seen here; a posted access is done
                // first (and may be withdrawn meanwhile: then the look comes back OPEN).
                POSTED | TAKEN => served += usize::from(self.serve()),
                // OPEN or ANSWERED. Relaxed: a read-modify-write continues the release
                // sequence of the store it reads (our ANSWERED, or our reopening), so a
                // poster whose Acquire load reads CLOSED as its answer still synchronises
                // with that store and sees our copy; nothing else is published (the
                // ordering mutant of a Release here survives the loom model for that
                // reason).
                _ => {
                    if self
                        .state
                        .compare_exchange(s, CLOSED, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                    {
                        return served;
                    }
                }
            }
            ivm_core::sync::spin_loop();
        }
    }

    /// Whether the lane is open (a hint: the worker polls).
    pub fn is_open(&self) -> bool {
        // Relaxed: a hint; `post` decides with a compare-exchange.
        matches!(self.state.load(Ordering::Relaxed), OPEN | ANSWERED)
    }

    /// Poster: reads `out.len()` bytes at `at` through the worker; `give_up()` is asked
    /// between looks while the worker has not taken the request.
    ///
    /// # Safety
    /// The caller is the only thread posting to this lane until this returns (the
    /// engine's holder); `out.len() <= EXPRESS_MAX`; `at..at + out.len()` is valid for
    /// reads and written by nobody until this returns.
    pub unsafe fn read(
        &self,
        at: *const u8,
        out: &mut [u8],
        give_up: impl FnMut() -> bool,
    ) -> Express {
        let len = out.len();
        // SAFETY: forwarded (a read never writes through `at`).
        let r = unsafe { self.post(at.cast_mut(), len, false, &[], give_up) };
        if r == Express::Done {
            self.req.with(|q| {
                // SAFETY: answered: the worker is done with the request (the Acquire in
                // `post`), and only a new post, ours, makes it touch it again.
                unsafe { out.copy_from_slice(&(&(*q).buf)[..len]) }
            });
        }
        r
    }

    /// Poster: writes `src` at `at` through the worker (see [`read`](Self::read)).
    ///
    /// # Safety
    /// As [`read`](Self::read), and `at..at + src.len()` is valid for writes and accessed
    /// by nobody else until this returns.
    pub unsafe fn write(&self, at: *mut u8, src: &[u8], give_up: impl FnMut() -> bool) -> Express {
        // SAFETY: forwarded.
        unsafe { self.post(at, src.len(), true, src, give_up) }
    }

    /// # Safety
    /// As [`write`](Self::write) (for a write) or [`read`](Self::read).
    unsafe fn post(
        &self,
        at: *mut u8,
        len: usize,
        write: bool,
        src: &[u8],
        mut give_up: impl FnMut() -> bool,
    ) -> Express {
        assert!(len <= EXPRESS_MAX, "ivm: an express access of {len} bytes");
        // Relaxed: a look before we write the line; the compare-exchange decides.
        let open = self.state.load(Ordering::Relaxed);
        if !matches!(open, OPEN | ANSWERED) {
            return Express::Closed;
        }
        self.req.with_mut(|q| {
            // SAFETY: we are the only poster and have posted nothing: the state is OPEN,
            // ANSWERED or CLOSED, in which the worker never touches the request; its last
            // use of it (serving our, or an earlier poster's, request) happened before the
            // answer that poster acquired, and the engine's hand-over orders posters.
            let q = unsafe { &mut *q };
            q.at = at;
            q.len = len;
            q.write = write;
            if write {
                q.buf[..len].copy_from_slice(src);
            } else {
                // Loom model only: a read whose request is dropped would return this.
                #[cfg(loom)]
                q.buf.fill(0xEE);
            }
        });
        // Release: publishes the request to the worker's Acquire in `serve`.
        if self
            .state
            .compare_exchange(open, POSTED, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return Express::Closed;
        }
        #[cfg(loom)]
        let planted_relaxed = self.planted(Planted::AnswerRelaxed);
        #[cfg(not(loom))]
        let planted_relaxed = false;
        let answer_order = if planted_relaxed {
            Ordering::Relaxed
        } else {
            Ordering::Acquire
        };
        loop {
            // Acquire: pairs with the worker's Release answer (or its closing RMW, or its
            // reopening store, both after the answer): the copy is visible.
            match self.state.load(answer_order) {
                POSTED => {
                    #[cfg(loom)]
                    if self.planted(Planted::WithdrawByStore) {
                        if give_up() {
                            return self.planted_withdraw_by_store();
                        }
                        ivm_core::sync::spin_loop();
                        continue;
                    }
                    // Relaxed: a withdrawn request was never read; nothing to order.
                    if give_up()
                        && self
                            .state
                            .compare_exchange(POSTED, OPEN, Ordering::Relaxed, Ordering::Relaxed)
                            .is_ok()
                    {
                        return Express::Withdrawn;
                    }
                }
                // The worker is copying; `give_up` also yields our CPU once the spin is
                // over (a worker preempted mid-copy may need it). Too late to withdraw.
                TAKEN => {
                    let _ = give_up();
                }
                // ANSWERED (left so: it is as open as OPEN), or CLOSED / OPEN after the
                // worker closed (and reopened).
                _ => return Express::Done,
            }
            ivm_core::sync::spin_loop();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn debug_names_the_state() {
        let lane = ExpressLane::new();
        assert_eq!(format!("{lane:?}"), "ExpressLane { state: closed }");
        lane.open();
        assert_eq!(format!("{lane:?}"), "ExpressLane { state: open }");
        lane.close();
    }
}
