//! Busy neighbours: threads that keep running beside a VM's threads (a busy loop, another
//! job's thread, a data loader), seen from outside by the states the kernel reports
//! (Linux, not under Miri), as ARCHITECTURE.md says under "When another thread takes a
//! core".
//!
//! The VM's other senses (`preemption.rs`) see contention from inside a running thread,
//! and need it to be preempted. Beside one busy thread the multi-thread VM lost a third
//! of the demo's speed with none of them firing: its callers ran nearly every kernel
//! themselves while the worker polled between steps on the busy thread's CPU, the busy
//! thread then preempting the caller (`docs/perf-2026-12-06.md`). Forcing the workers into
//! the contended regime there brought the demo to plain's speed, and cost a third on a
//! quiet machine: the regime needs a signal, and signals that measure load (runnable
//! counts, waiting shares, busy time) also fire on a front end's own bursts. What tells a
//! busy neighbour apart is that it never sleeps: a caller's looks, [`LOOK_EVERY`] apart,
//! read each thread of the process that is not its VM's, and count those runnable at
//! [`BUSY_LOOKS`] of the last [`LOOKS`] looks, and likewise the runnable threads of other
//! processes (the machine's count less this process's).

use std::time::{Duration, Instant};

/// The least time between two looks of one VM.
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(40);

/// Looks remembered per thread.
pub(crate) const LOOKS: u32 = 5;

/// Looks, of the last [`LOOKS`], at which a thread must have been runnable to count as a
/// busy neighbour.
pub(crate) const BUSY_LOOKS: u32 = 4;

/// Threads remembered per VM; beyond it, new threads are not watched.
const WATCHED: usize = 128;

/// What one VM remembers of its looks. Nothing here allocates: a look runs inside a
/// caller's call into the VM, whose steady state allocates nothing
/// (`tests/alloc_counts.rs`).
#[derive(Debug, Default)]
pub(crate) struct Neighbours {
    at: Option<Instant>,
    /// Threads of this process that are not the VM's: (id, whether runnable at each of
    /// the last looks, newest in bit 0).
    threads: heapless::Vec<(usize, u32), WATCHED>,
    /// How many threads of other processes were runnable, at each of the last looks.
    foreign: [usize; LOOKS as usize],
    /// Looks taken so far (up to [`LOOKS`]).
    looks: u32,
}

impl Neighbours {
    /// A look at `now` (at most one per [`LOOK_EVERY`]: `None` between looks, and where
    /// `/proc` cannot be read), skipping the threads `own` (the VM's workers and the
    /// looking caller) and graph threads: how many busy neighbours there are (none until
    /// [`LOOKS`] looks were taken).
    ///
    /// The threads are read only when the machine's runnable threads, with every worker
    /// counted as running (`parked` of them are not now), outnumber its `cpus`: else
    /// nobody waits for a CPU, and the look counts every thread as not runnable (one small
    /// read then, against one per thread of the process).
    pub(crate) fn look(
        &mut self,
        now: Instant,
        own: &[usize],
        parked: usize,
        cpus: usize,
    ) -> Option<usize> {
        if self
            .at
            .is_some_and(|at| now.saturating_duration_since(at) < LOOK_EVERY)
        {
            return None;
        }
        self.at = Some(now);
        let machine = runnable_on_machine()?;
        self.begin();
        if machine + parked <= cpus {
            return Some(self.end(0));
        }
        let mut runnable_here = 0usize;
        let serving = crate::util::lock(&SERVING).clone();
        for_each_thread(|tid, runnable| {
            runnable_here += usize::from(runnable);
            if !own.contains(&tid) && !serving.contains(&tid) {
                self.saw(tid, runnable);
            }
        })?;
        // The fewer of the counts before and after the threads were read: one of ours
        // that went to sleep meanwhile is not taken for another process's.
        let machine = machine.min(runnable_on_machine()?);
        Some(self.end(machine.saturating_sub(runnable_here)))
    }

    /// Whether [`LOOKS`] looks were taken: a count of 0 from here on means no busy
    /// neighbour, not too few looks to tell.
    pub(crate) fn warm(&self) -> bool {
        self.looks >= LOOKS
    }

    /// A look starts: every history moves on, as not runnable until seen.
    fn begin(&mut self) {
        let window = (1u32 << LOOKS) - 1;
        for (_, h) in self.threads.iter_mut() {
            *h = (*h << 1) & window;
        }
    }

    /// Thread `tid` of this process, not the VM's, was `runnable` at this look.
    fn saw(&mut self, tid: usize, runnable: bool) {
        match self.threads.iter_mut().find(|(t, _)| *t == tid) {
            Some((_, h)) => *h |= u32::from(runnable),
            // Only a runnable thread is watched from its first look, so that sleeping
            // ones never fill the list; full, a new one is not (a process of over a
            // hundred threads runnable at once).
            None if runnable => {
                let _ = self.threads.push((tid, 1));
            }
            None => {}
        }
    }

    /// A look ends, with `foreign_runnable` threads of other processes runnable: the busy
    /// neighbours from here. Threads runnable at none of the remembered looks are
    /// forgotten (gone, or asleep: seen again if they wake).
    fn end(&mut self, foreign_runnable: usize) -> usize {
        self.threads.retain(|(_, h)| *h != 0);
        self.foreign.rotate_right(1);
        self.foreign[0] = foreign_runnable;
        self.looks = (self.looks + 1).min(LOOKS);
        if self.looks < LOOKS {
            return 0;
        }
        let busy = |h: u32| h.count_ones() >= BUSY_LOOKS;
        // Other processes' threads cannot be told apart: as many count as were runnable
        // at [`BUSY_LOOKS`] of the looks (the count that many looks reached at least).
        let mut counts = self.foreign;
        counts.sort_unstable();
        let foreign = counts[(LOOKS - BUSY_LOOKS) as usize];
        self.threads.iter().filter(|(_, h)| busy(*h)).count() + foreign
    }

    /// [`begin`](Self::begin), [`saw`](Self::saw) each of `seen`, [`end`](Self::end).
    #[cfg(test)]
    fn record(&mut self, seen: &[(usize, bool)], foreign_runnable: usize) -> usize {
        self.begin();
        for &(tid, runnable) in seen {
            self.saw(tid, runnable);
        }
        self.end(foreign_runnable)
    }
}

/// The threads that serve VMs without being a VM's worker: graph runtimes' threads
/// (`lazy::mark_graph_thread`). They run a front end's work in bursts, not beside it.
/// A std mutex, not the sync facade's: a process-wide static (loom's types live inside a
/// model), and a hint no protocol depends on. Fixed capacity, so a look copies it to its
/// stack and holds the lock only for the copy, not through its scan of `/proc`.
static SERVING: std::sync::Mutex<heapless::Vec<usize, SERVING_MAX>> =
    std::sync::Mutex::new(heapless::Vec::new());

/// The most [`SERVING`] remembers (the oldest go first: their ids may be reused).
const SERVING_MAX: usize = 64;

/// Notes the calling thread as one that serves VMs (`lazy::mark_graph_thread`).
pub(crate) fn note_serving_thread() {
    let tid = current_tid();
    if tid == 0 {
        return;
    }
    let mut v = crate::util::lock(&SERVING);
    if !v.contains(&tid) {
        if v.is_full() {
            v.remove(0);
        }
        // Room was made above.
        let _ = v.push(tid);
    }
}

/// Whether `busy` neighbours leave a caller and its `workers` workers fewer of the
/// machine's `cpus` than they would use, but one at least: then the caller doing the work
/// alone has a CPU of its own, and the neighbours the rest. With none left (as many busy
/// neighbours as CPUs) every thread takes turns, and the VM's threads together get more
/// turns than its caller alone: measured beside two busy threads on two CPUs, the
/// regime cost eager 14 points (`docs/perf-2026-12-06.md`).
pub(crate) fn crowded(busy: usize, workers: usize, cpus: usize) -> bool {
    busy > 0 && busy < cpus && 1 + workers > cpus - busy
}

/// The calling thread's id (Linux, not under Miri), else 0.
pub(crate) fn current_tid() -> usize {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        // SAFETY: the `gettid` system call has no preconditions (called through
        // `syscall`: the libc wrapper needs glibc 2.30).
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        usize::try_from(tid).unwrap_or(0)
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    0
}

/// The CPUs online (looked up once).
pub(crate) fn cpus_online() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| {
        #[cfg(all(target_os = "linux", not(miri)))]
        {
            // SAFETY: `sysconf` reads a system value; no pointers.
            let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
            if let Ok(n) = usize::try_from(n)
                && n > 0
            {
                return n;
            }
        }
        std::thread::available_parallelism().map_or(1, usize::from)
    })
}

/// Calls `f(tid, runnable)` for each thread of this process (`/proc/self/task`), without
/// allocating: the directory is read with `getdents64` into a stack buffer, each thread's
/// `stat` through a path built on the stack.
fn for_each_thread(mut f: impl FnMut(usize, bool)) -> Option<()> {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        struct Fd(libc::c_int);
        impl Drop for Fd {
            fn drop(&mut self) {
                // SAFETY: the descriptor was opened below and is closed once, here.
                unsafe { libc::close(self.0) };
            }
        }
        // SAFETY: a NUL-terminated path; plain flags.
        let fd = unsafe {
            libc::open(
                c"/proc/self/task".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        let dir = Fd(fd);
        let mut entries = [0u8; 4096];
        let mut stat = [0u8; 512];
        loop {
            // SAFETY: `entries` is valid for writes of its length; `dir` is an open
            // directory; the kernel writes whole records only.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_getdents64,
                    dir.0,
                    entries.as_mut_ptr(),
                    entries.len(),
                )
            };
            let n = usize::try_from(n).ok()?;
            if n == 0 {
                return Some(());
            }
            for name in dirent_names(&entries[..n]) {
                let Some(tid) = std::str::from_utf8(name).ok().and_then(|s| s.parse().ok()) else {
                    continue;
                };
                let mut path = [0u8; 64];
                let Some(path) = task_stat_path(&mut path, tid) else {
                    continue;
                };
                // A thread that exited since the listing is skipped.
                if let Some(k) = read_start(path, &mut stat)
                    && let Some(state) = stat_state(&stat[..k])
                {
                    f(tid, state == b'R');
                }
            }
        }
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    {
        let _ = &mut f;
        None
    }
}

/// The names in a buffer of `linux_dirent64` records (inode u64, offset i64, record
/// length u16, type u8, then the NUL-terminated name).
fn dirent_names(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut off = 0usize;
    std::iter::from_fn(move || {
        let head = buf.get(off..off + 19)?;
        let len = usize::from(u16::from_ne_bytes([head[16], head[17]]));
        let record = buf.get(off..off + len).filter(|_| len > 19)?;
        off += len;
        let name = &record[19..];
        Some(&name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())])
    })
}

/// "/proc/self/task/<tid>/stat" written into `buf`.
fn task_stat_path(buf: &mut [u8; 64], tid: usize) -> Option<&str> {
    use std::io::Write;
    let mut w = &mut buf[..];
    write!(w, "/proc/self/task/{tid}/stat").ok()?;
    let len = 64 - w.len();
    std::str::from_utf8(&buf[..len]).ok()
}

/// Whether the thread `tid` of this process is runnable now (running, or waiting for a
/// CPU), from its `stat`; `None` where that cannot be read (not Linux, Miri, an exited
/// thread). A thread blocked in a system call or asleep is not. No allocation.
pub(crate) fn thread_runnable(tid: usize) -> Option<bool> {
    let mut path = [0u8; 64];
    let path = task_stat_path(&mut path, tid)?;
    let mut stat = [0u8; 512];
    let k = read_start(path, &mut stat)?;
    stat_state(&stat[..k]).map(|state| state == b'R')
}

/// Threads runnable on the whole machine now: the numerator of `/proc/loadavg`'s fourth
/// field.
fn runnable_on_machine() -> Option<usize> {
    let mut buf = [0u8; 128];
    let n = read_start("/proc/loadavg", &mut buf)?;
    loadavg_running(&buf[..n])
}

/// Reads the start of a `/proc` file (Linux, not under Miri).
pub(crate) fn read_start(path: &str, buf: &mut [u8]) -> Option<usize> {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        use std::io::Read;
        std::fs::File::open(path).ok()?.read(buf).ok()
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    {
        let _ = (path, buf);
        None
    }
}

/// The state letter of a `stat` line ("pid (comm) S ..."; the name may hold spaces and
/// parentheses, so the state follows the last `)`).
fn stat_state(line: &[u8]) -> Option<u8> {
    let close = line.iter().rposition(|b| *b == b')')?;
    line.get(close + 2).copied()
}

/// The running count of a `/proc/loadavg` line ("0.84 1.46 1.60 2/345 12345").
fn loadavg_running(line: &[u8]) -> Option<usize> {
    let field = line.split(|b| *b == b' ').nth(3)?;
    let running = field.split(|b| *b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_records_and_paths_are_parsed() {
        let mut buf = Vec::new();
        for name in [&b"."[..], b"..", b"1234", b"77"] {
            let len = (19 + name.len() + 1).next_multiple_of(8);
            let mut rec = vec![0u8; len];
            rec[16..18].copy_from_slice(&(len as u16).to_ne_bytes());
            rec[19..19 + name.len()].copy_from_slice(name);
            buf.extend(rec);
        }
        let names: Vec<&[u8]> = dirent_names(&buf).collect();
        assert_eq!(names, [&b"."[..], b"..", b"1234", b"77"]);
        // A truncated record ends the walk.
        assert_eq!(dirent_names(&buf[..buf.len() - 3]).count(), 3);
        let mut p = [0u8; 64];
        assert_eq!(
            task_stat_path(&mut p, 4242),
            Some("/proc/self/task/4242/stat")
        );
    }

    #[test]
    fn proc_lines_are_parsed() {
        assert_eq!(stat_state(b"27910 (cat) R 27908 27908"), Some(b'R'));
        assert_eq!(stat_state(b"12 (a (b) c) S 1 2"), Some(b'S'));
        assert_eq!(stat_state(b"12 no paren"), None);
        assert_eq!(loadavg_running(b"2.11 1.96 1.79 3/112 27914\n"), Some(3));
        assert_eq!(loadavg_running(b"2.11 1.96"), None);
        #[cfg(all(target_os = "linux", not(miri)))]
        {
            let me = current_tid();
            let mut found = None;
            for_each_thread(|tid, runnable| {
                if tid == me {
                    found = Some(runnable);
                }
            })
            .expect("this process's threads");
            assert_eq!(found, Some(true), "the looking thread runs");
            // A count only: the kernel sums its run queues without a lock, so a thread
            // moving between CPUs meanwhile may be missed (this test saw 0 once).
            assert!(runnable_on_machine().is_some());
        }
    }

    #[test]
    fn a_thread_blocked_on_a_channel_is_not_runnable() {
        #[cfg(all(target_os = "linux", not(miri)))]
        {
            assert_eq!(
                thread_runnable(current_tid()),
                Some(true),
                "this thread runs"
            );
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let t = std::thread::spawn(move || {
                tid_tx.send(current_tid()).unwrap();
                let _ = go_rx.recv();
            });
            let tid = tid_rx.recv().unwrap();
            // It blocks in `recv` soon after sending; until then it may still run.
            let start = std::time::Instant::now();
            while thread_runnable(tid) != Some(false) {
                assert!(start.elapsed().as_secs() < 10, "never seen blocked");
                std::thread::yield_now();
            }
            go_tx.send(()).unwrap();
            t.join().unwrap();
            // `join` returns before the kernel removes the thread from `/proc`.
            let start = std::time::Instant::now();
            while thread_runnable(tid).is_some() {
                assert!(
                    start.elapsed().as_secs() < 10,
                    "an exited thread has no state"
                );
                std::thread::yield_now();
            }
        }
    }

    #[test]
    fn a_thread_runnable_at_nearly_every_look_is_a_busy_neighbour() {
        let mut n = Neighbours::default();
        // A busy loop (7), a thread that runs now and then (8), another process's loop.
        let pattern = [true, true, false, true, true, true];
        let mut busy = Vec::new();
        for (k, &hog) in pattern.iter().enumerate() {
            busy.push(n.record(&[(7, hog), (8, k % 3 == 0)], 1));
        }
        // Nothing is judged before five looks; then the loop and the other process.
        assert_eq!(busy, [0, 0, 0, 0, 2, 2]);
        assert!(n.warm());
        // A zero before the fifth look says nothing (`warm`): no quiet machine counted.
        let mut early = Neighbours::default();
        for _ in 0..4 {
            assert_eq!(early.record(&[(7, true)], 0), 0);
            assert!(!early.warm());
        }
        assert_eq!(early.record(&[(7, true)], 0), 1);
        assert!(early.warm());
        // Two other processes' threads at every look count as two.
        let mut two = Neighbours::default();
        let busy: Vec<usize> = (0..5).map(|_| two.record(&[], 2)).collect();
        assert_eq!(busy, [0, 0, 0, 0, 2]);
        // A thread that is gone is forgotten; a quiet process has no busy neighbour.
        let mut quiet = Neighbours::default();
        for k in 0..10 {
            assert_eq!(quiet.record(&[(8, k % 2 == 0)], usize::from(k == 3)), 0);
        }
    }

    #[test]
    fn crowded_needs_a_busy_neighbour_and_too_few_cpus_but_one() {
        assert!(!crowded(0, 1, 2));
        // One busy thread on two CPUs: the caller alone keeps one.
        assert!(crowded(1, 1, 2));
        // Two on two: nothing to keep, every thread takes turns.
        assert!(!crowded(2, 1, 2));
        assert!(!crowded(1, 1, 4));
        assert!(crowded(3, 1, 4));
        assert!(crowded(2, 2, 4));
    }
}
