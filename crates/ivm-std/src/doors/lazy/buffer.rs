//! Named, bounded, closable buffers between the VM and a graph runtime.
//!
//! The critical-section begin instructions and the lazy-job launcher push into them; the
//! graph runtime's kernels pop. A push blocks while the buffer is full (the graph is
//! behind); closing a buffer (graph or VM shutdown) fails every blocked and later push and
//! hands back what was left inside, so that the closer can finish it with an error.
//!
//! Waiting is a futex on a sequence word bumped, under the buffer's mutex, on every change;
//! a change wakes sleepers only if some thread is registered as sleeping (no syscall on
//! the fast path). A graph runtime that must not block a thread on one buffer registers a
//! *listener* instead, called after every push and on close.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use ivm_core::sync::{AtomicU32, AtomicUsize, Ordering};
use ivm_core::wait::Wait;

use crate::util::futex::FutexWait;
use crate::util::lock;

/// A push into, or a blocking pop from, a closed [`Buffer`]. A refused push hands its item
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferClosed<T>(pub T);

/// What [`Buffer::try_pop`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryPop<T> {
    /// The oldest item.
    Item(T),
    /// Nothing inside, still open.
    Empty,
    /// Nothing inside and closed: nothing will ever come.
    Closed,
}

/// The bit of [`Buffer`]'s `hint` that says it is closed.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// A callback run after every push and on close (see [`Buffer::set_listener`]).
type Listener = Box<dyn Fn() + Send + Sync>;

struct Inner<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Threads registered as (about to be) sleeping on `seq`.
    sleepers: u32,
}

/// A named, bounded, closable multi-producer multi-consumer FIFO.
///
/// # Examples
///
/// ```
/// use ivm_std::lazy::{Buffer, TryPop};
///
/// let b = Buffer::new("job/source-tick", 2);
/// b.push(1).unwrap();
/// assert!(b.try_push(2).is_ok());
/// assert_eq!(b.try_push(3), Err(3)); // full
/// assert_eq!(b.try_pop(), TryPop::Item(1));
/// assert_eq!(b.close(), vec![2]); // closing hands back what was left
/// assert_eq!(b.try_pop(), TryPop::Closed);
/// assert!(b.push(4).is_err());
/// ```
pub struct Buffer<T> {
    name: String,
    capacity: usize,
    inner: Mutex<Inner<T>>,
    /// Bumped under `inner`'s mutex on every push, pop and close; sleepers wait on it.
    seq: AtomicU32,
    /// The number of items, plus [`CLOSED`] once closed: written under `inner`'s mutex
    /// after every change, so that [`try_pop`](Self::try_pop) on an empty open buffer —
    /// a graph runtime polls its source buffers on every scan — returns without taking
    /// the mutex's line from the pushing thread.
    hint: AtomicUsize,
    listener: OnceLock<Listener>,
}

impl<T> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = lock(&self.inner);
        f.debug_struct("Buffer")
            .field("name", &self.name)
            .field("len", &g.items.len())
            .field("capacity", &self.capacity)
            .field("closed", &g.closed)
            .finish()
    }
}

impl<T> Buffer<T> {
    /// An empty open buffer holding at most `capacity` items (at least 1).
    pub fn new(name: impl Into<String>, capacity: usize) -> Self {
        Self {
            name: name.into(),
            capacity: capacity.max(1),
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                closed: false,
                sleepers: 0,
            }),
            seq: AtomicU32::new(0),
            hint: AtomicUsize::new(0),
            listener: OnceLock::new(),
        }
    }

    /// The buffer's name (`job/kind[/op]`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The most items it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Items inside now.
    pub fn len(&self) -> usize {
        lock(&self.inner).items.len()
    }

    /// Whether nothing is inside now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.inner).closed
    }

    /// Registers `f`, called after every successful push and after close (from the pushing
    /// or closing thread, without the buffer's lock held). At most one listener: a second
    /// registration is refused (returns `false`).
    pub fn set_listener(&self, f: impl Fn() + Send + Sync + 'static) -> bool {
        self.listener.set(Box::new(f)).is_ok()
    }

    /// After a change made under the lock: bump the sequence word, write the item count
    /// and closed bit to `hint`, and report whether a sleeper must be woken.
    fn changed(&self, g: &Inner<T>) -> bool {
        // Relaxed: written under the mutex, which orders it with every sleeper's
        // registration; the futex compare only needs to see *a* change.
        self.seq.fetch_add(1, Ordering::Relaxed);
        // Relaxed: written under the mutex, so the stores follow the changes' order. A
        // thread that learns of a push through anything that happens after it (the
        // listener's notification, a join) reads this store or a later one (coherence):
        // `try_pop`'s fast path never calls a pushed item missing. The item itself is
        // read under the mutex.
        let closed = if g.closed { CLOSED } else { 0 };
        self.hint.store(g.items.len() | closed, Ordering::Relaxed);
        g.sleepers > 0
    }

    fn wake(&self, sleepers: bool) {
        if sleepers {
            FutexWait::wake_all(&self.seq);
        }
    }

    fn notify_listener(&self) {
        if let Some(f) = self.listener.get() {
            f();
        }
    }

    /// Sleeps until the sequence word moves past `seen` (or spuriously). `g` registered us
    /// as a sleeper; we deregister after waking.
    fn sleep(
        &self,
        mut g: std::sync::MutexGuard<'_, Inner<T>>,
    ) -> std::sync::MutexGuard<'_, Inner<T>> {
        g.sleepers += 1;
        // Relaxed: read under the mutex, so every change made before we registered is
        // included; a later change (made under the mutex after we unlock) bumps it.
        let seen = self.seq.load(Ordering::Relaxed);
        drop(g);
        FutexWait::wait(&self.seq, seen, None);
        let mut g = lock(&self.inner);
        g.sleepers -= 1;
        g
    }

    /// Appends `item`, blocking while the buffer is full.
    ///
    /// # Errors
    /// [`BufferClosed`] (with the item) if the buffer is or gets closed first.
    pub fn push(&self, item: T) -> Result<(), BufferClosed<T>> {
        let mut g = lock(&self.inner);
        loop {
            if g.closed {
                return Err(BufferClosed(item));
            }
            if g.items.len() < self.capacity {
                break;
            }
            g = self.sleep(g);
        }
        g.items.push_back(item);
        let wake = self.changed(&g);
        drop(g);
        self.wake(wake);
        self.notify_listener();
        Ok(())
    }

    /// Appends `item` even if the buffer is full (the VM side in single-thread mode, where
    /// blocking the only VM thread could deadlock; the count is still bounded by the VM's
    /// instructions in flight).
    ///
    /// # Errors
    /// [`BufferClosed`] (with the item) if the buffer is closed.
    pub fn force_push(&self, item: T) -> Result<(), BufferClosed<T>> {
        let mut g = lock(&self.inner);
        if g.closed {
            return Err(BufferClosed(item));
        }
        g.items.push_back(item);
        let wake = self.changed(&g);
        drop(g);
        self.wake(wake);
        self.notify_listener();
        Ok(())
    }

    /// [`push`](Self::push) when `block`, [`force_push`](Self::force_push) otherwise.
    ///
    /// # Errors
    /// [`BufferClosed`] (with the item) if the buffer is or gets closed first.
    pub fn push_with(&self, item: T, block: bool) -> Result<(), BufferClosed<T>> {
        if block {
            self.push(item)
        } else {
            self.force_push(item)
        }
    }

    /// Appends `item` if there is room and the buffer is open; hands it back otherwise.
    pub fn try_push(&self, item: T) -> Result<(), T> {
        let mut g = lock(&self.inner);
        if g.closed || g.items.len() >= self.capacity {
            return Err(item);
        }
        g.items.push_back(item);
        let wake = self.changed(&g);
        drop(g);
        self.wake(wake);
        self.notify_listener();
        Ok(())
    }

    /// Takes the oldest item without blocking. On an open buffer that was empty at its
    /// last change it returns [`TryPop::Empty`] without taking the lock.
    pub fn try_pop(&self) -> TryPop<T> {
        // Relaxed: see `changed`; a stale non-zero value only sends us to the lock.
        if self.hint.load(Ordering::Relaxed) == 0 {
            return TryPop::Empty;
        }
        let mut g = lock(&self.inner);
        match g.items.pop_front() {
            Some(item) => {
                let wake = self.changed(&g);
                drop(g);
                self.wake(wake);
                TryPop::Item(item)
            }
            None if g.closed => TryPop::Closed,
            None => TryPop::Empty,
        }
    }

    /// Takes the oldest item, blocking while the buffer is empty.
    ///
    /// # Errors
    /// [`BufferClosed`] once the buffer is closed and empty.
    pub fn pop(&self) -> Result<T, BufferClosed<()>> {
        let mut g = lock(&self.inner);
        loop {
            if let Some(item) = g.items.pop_front() {
                let wake = self.changed(&g);
                drop(g);
                self.wake(wake);
                return Ok(item);
            }
            if g.closed {
                return Err(BufferClosed(()));
            }
            g = self.sleep(g);
        }
    }

    /// Closes the buffer: blocked and later pushes fail, blocked pops fail once it is
    /// empty. Returns the items left inside (the caller finishes them). Idempotent.
    pub fn close(&self) -> Vec<T> {
        let mut g = lock(&self.inner);
        let first = !g.closed;
        g.closed = true;
        let left: Vec<T> = g.items.drain(..).collect();
        let wake = self.changed(&g);
        drop(g);
        self.wake(wake);
        if first {
            self.notify_listener();
        }
        left
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering as O};

    #[test]
    fn fifo_bounded_and_named() {
        let b = Buffer::new("j/wait", 2);
        assert_eq!(b.name(), "j/wait");
        assert!(b.is_empty());
        b.push(1).unwrap();
        b.push(2).unwrap();
        assert_eq!(b.try_push(3), Err(3));
        assert_eq!(b.len(), 2);
        b.force_push(3).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b.try_pop(), TryPop::Item(1));
        assert_eq!(b.try_pop(), TryPop::Item(2));
        b.push_with(1, true).unwrap();
        b.push_with(2, false).unwrap();
        assert_eq!(b.try_pop(), TryPop::Item(3));
        assert_eq!(b.try_pop(), TryPop::Item(1));
        assert_eq!(b.pop(), Ok(2));
        assert_eq!(b.try_pop(), TryPop::Empty);
    }

    #[test]
    fn blocked_push_resumes_after_pop_and_fails_on_close() {
        let b = Arc::new(Buffer::new("j/x", 1));
        b.push(0u32).unwrap();
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.push(1));
        // Let the pusher block, then make room.
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(b.try_pop(), TryPop::Item(0));
        assert_eq!(t.join().unwrap(), Ok(()));
        assert_eq!(b.pop(), Ok(1));
        // A blocked push fails when the buffer closes, handing its item back.
        b.push(5).unwrap();
        let b3 = b.clone();
        let t = std::thread::spawn(move || b3.push(6));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(b.close(), vec![5]);
        assert_eq!(t.join().unwrap(), Err(BufferClosed(6)));
        assert_eq!(b.try_pop(), TryPop::Closed);
        assert_eq!(b.pop(), Err(BufferClosed(())));
        assert!(b.close().is_empty(), "close is idempotent");
    }

    #[test]
    fn blocked_pop_gets_item_or_closed() {
        let b = Arc::new(Buffer::<u8>::new("j/y", 4));
        let b2 = b.clone();
        let t = std::thread::spawn(move || (b2.pop(), b2.pop()));
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.push(9).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.close();
        assert_eq!(t.join().unwrap(), (Ok(9), Err(BufferClosed(()))));
    }

    #[test]
    fn try_pop_sees_every_push_that_happened_before_it() {
        // `try_pop`'s lock-free empty check must never hide an item whose push happened
        // before the call: here, told through the listener, as a graph runtime is.
        let n = if cfg!(miri) { 50 } else { 20_000 };
        let b = Arc::new(Buffer::new("j/hint", 1));
        let told = Arc::new(AtomicUsize::new(0));
        let t2 = told.clone();
        b.set_listener(move || {
            t2.fetch_add(1, O::Release);
        });
        let b2 = b.clone();
        let producer = std::thread::spawn(move || {
            for i in 0..n {
                b2.push(i).unwrap();
            }
        });
        for i in 0..n {
            while told.load(O::Acquire) <= i {
                std::hint::spin_loop();
            }
            assert_eq!(b.try_pop(), TryPop::Item(i), "push {i} was announced");
        }
        producer.join().unwrap();
        assert_eq!(b.try_pop(), TryPop::Empty);
        b.close();
        assert_eq!(
            b.try_pop(),
            TryPop::Closed,
            "closed and empty is not `Empty`"
        );
    }

    #[test]
    fn listener_sees_pushes_and_close() {
        let b = Buffer::new("j/cb", 4);
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        assert!(b.set_listener(move || {
            n2.fetch_add(1, O::Relaxed);
        }));
        assert!(!b.set_listener(|| {}));
        b.push(1).unwrap();
        b.try_push(2).unwrap();
        b.close();
        b.close();
        assert_eq!(n.load(O::Relaxed), 3);
    }

    #[test]
    fn many_producers_many_consumers() {
        let b = Arc::new(Buffer::new("j/mpmc", 3));
        let sum = Arc::new(AtomicUsize::new(0));
        let n = if cfg!(miri) { 20 } else { 2000 };
        std::thread::scope(|s| {
            for p in 0..2 {
                let b = b.clone();
                s.spawn(move || {
                    for i in 0..n {
                        b.push(p * n + i).unwrap();
                    }
                });
            }
            for _ in 0..2 {
                let (b, sum) = (b.clone(), sum.clone());
                s.spawn(move || {
                    while let Ok(v) = b.pop() {
                        sum.fetch_add(v + 1, O::Relaxed);
                    }
                });
            }
            s.spawn(|| {
                while sum.load(O::Relaxed) < (2 * n) * (2 * n + 1) / 2 {
                    std::thread::yield_now();
                }
                b.close();
            });
        });
        assert_eq!(sum.load(O::Relaxed), (2 * n) * (2 * n + 1) / 2);
    }
}
