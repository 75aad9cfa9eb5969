//! Where the demo's threads run (Linux; elsewhere nothing is pinned). On a shared 2-vCPU
//! host the two vCPUs differ in speed at the same moment (the plain loop pinned to one and
//! then the other, alternately: 11.7 against 16.0 K steps/s, then 15.4 against 12.5 K a few
//! seconds later), so a mode whose kernels ran on the other vCPU than plain's would be
//! measured against a different machine. With `pin`, every mode's kernels run on one vCPU
//! (the *kernel CPU*: the VMs' threads, the graph's thread, and the plain loop) and the
//! host code that drives the VM on the other (the *caller CPU*: the main thread while a VM
//! mode trains).
//!
//! A thread inherits its creator's CPU mask, so the VMs and graphs are built while the main
//! thread sits on the kernel CPU; threads the VMs start later (on the caller CPU) are moved
//! after the first epochs (`adopt`), and `misplaced` lists any left at the end. Each epoch
//! starts after a short untimed pause, so that the threads of the mode before it have
//! stopped polling the kernel CPU.

/// The CPU mask the main thread started with (read once, before any pinning).
#[cfg(target_os = "linux")]
fn original() -> Option<libc::cpu_set_t> {
    static ORIGINAL: std::sync::OnceLock<Option<libc::cpu_set_t>> = std::sync::OnceLock::new();
    *ORIGINAL.get_or_init(|| {
        // SAFETY: `cpu_set_t` is plain data; all-zero is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, writable `cpu_set_t` of the size passed.
        let r =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        (r == 0).then_some(set)
    })
}

/// The two CPUs: `(caller, kernels)`, the first two of the process's original CPU mask, or
/// `None` with fewer than two (or off Linux).
#[cfg(target_os = "linux")]
pub fn cpus() -> Option<(usize, usize)> {
    let set = original()?;
    // SAFETY: `set` was filled by `sched_getaffinity`.
    let mut allowed =
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) });
    Some((allowed.next()?, allowed.next()?))
}

/// Gives the calling thread back the original mask (after a pinned run).
#[cfg(target_os = "linux")]
pub fn restore() {
    if let Some(set) = original() {
        // SAFETY: `set` is a valid `cpu_set_t` of the size passed; 0 is the calling thread.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    }
}

#[cfg(not(target_os = "linux"))]
pub fn restore() {}

#[cfg(not(target_os = "linux"))]
pub fn cpus() -> Option<(usize, usize)> {
    None
}

/// Moves thread `tid` (0: the calling thread) to `cpu`; threads it creates from now on
/// start there. Whether it worked.
#[cfg(target_os = "linux")]
fn set(tid: libc::pid_t, cpu: usize) -> bool {
    // SAFETY: `cpu_set_t` is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE (it came from `cpus`); `set` is a valid `cpu_set_t`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid `cpu_set_t` of the size passed.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

/// Moves the calling thread to `cpu` (and threads it creates from now on start there).
/// Whether it worked.
#[cfg(target_os = "linux")]
pub fn to(cpu: usize) -> bool {
    set(0, cpu)
}

#[cfg(not(target_os = "linux"))]
pub fn to(_cpu: usize) -> bool {
    false
}

/// Moves every thread of the process but the calling one to `cpu` (threads that the VMs
/// started lazily, on the caller's CPU: a lazy job's critical-section and launcher
/// workers start at the first launch).
#[cfg(target_os = "linux")]
pub fn adopt(cpu: usize) {
    for (tid, _, _) in off(cpu) {
        set(tid, cpu);
    }
}

#[cfg(not(target_os = "linux"))]
pub fn adopt(_cpu: usize) {}

/// The process's threads but the calling one and the busy threads of `--hog`, whose CPU
/// mask is not `{cpu}`: `(tid, name, Cpus_allowed_list)`.
#[cfg(target_os = "linux")]
fn off(cpu: usize) -> Vec<(libc::pid_t, String, String)> {
    let want = cpu.to_string();
    // SAFETY: `gettid` has no preconditions.
    let me = unsafe { libc::gettid() };
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|t| {
            let tid: libc::pid_t = t.file_name().to_str()?.parse().ok()?;
            if tid == me {
                return None;
            }
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let field = |k: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(k))
                    .map(|v| v.trim().to_string())
            };
            let name = field("Name:").unwrap_or_default();
            if name.starts_with("hog") {
                // The busy threads of `--hog` stay where the OS puts them (`hog.rs`).
                return None;
            }
            let cpus = field("Cpus_allowed_list:")?;
            (cpus != want).then_some((tid, name, cpus))
        })
        .collect()
}

/// The process's threads, but the calling one, whose CPU mask is not `{kernels}`: their
/// names and masks (empty when all are there, or off Linux).
#[cfg(target_os = "linux")]
pub fn misplaced(kernels: usize) -> Vec<String> {
    off(kernels)
        .into_iter()
        .map(|(_, name, cpus)| format!("{name} (CPUs {cpus})"))
        .collect()
}

#[cfg(not(target_os = "linux"))]
pub fn misplaced(_kernels: usize) -> Vec<String> {
    Vec::new()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A thread spawned after `to` starts on that CPU; `adopt` moves one that started
    /// elsewhere; `misplaced` names neither afterwards, and names a thread elsewhere.
    #[test]
    fn threads_inherit_and_adopt_moves_them() {
        let Some((caller, kernels)) = cpus() else {
            eprintln!("skipped: fewer than two CPUs");
            return;
        };
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let stop_rx = std::sync::Arc::new(std::sync::Mutex::new(stop_rx));
        // Returns once the thread runs (it names itself when it starts).
        let park = |name: &str| {
            let rx = stop_rx.clone();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
            let h = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    let _ = ready_tx.send(());
                    let _ = rx.lock().unwrap().recv();
                })
                .unwrap();
            ready_rx.recv().unwrap();
            h
        };
        assert!(to(kernels));
        let inherited = park("pin-inherit");
        assert!(to(caller));
        let elsewhere = park("pin-elsewhere");
        // Other tests' threads may run meanwhile: look at ours only.
        let ours = |v: Vec<String>| {
            v.into_iter()
                .filter(|n| n.starts_with("pin-"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ours(misplaced(kernels)),
            vec![format!("pin-elsewhere (CPUs {caller})")]
        );
        adopt(kernels);
        assert!(ours(misplaced(kernels)).is_empty());
        drop(stop_tx);
        inherited.join().unwrap();
        elsewhere.join().unwrap();
        restore();
    }
}
