//! ivm-core on bare metal: no allocator, no OS, everything in `static`s.
//!
//! Built for `thumbv7em-none-eabihf` in CI (`cargo build -p ivm-core --target
//! thumbv7em-none-eabihf --example bare_metal`); on a hosted target it runs the same
//! [`demo`] from `main`. A "front end" queues statically allocated jobs on an intrusive list
//! and rings a [`Notifier`]; a "worker" (an interrupt handler on a real board, a plain call
//! here) takes them, runs them and completes each job's [`BlockingThenBusy`] handshake, and
//! the front end waits for the result with the spin backend. Every job is at the same time
//! in the queue and in an "all jobs" list, through two hooks.
#![cfg_attr(target_os = "none", no_std)]
#![cfg_attr(target_os = "none", no_main)]

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, Ordering};
use core::time::Duration;

use ivm_core::btb::BlockingThenBusy;
use ivm_core::list::{Linked, Links, List};
use ivm_core::notifier::Notifier;

/// A job the front end hands to the worker: input, output and its handshake.
struct Job {
    input: u32,
    output: AtomicU32,
    done: BlockingThenBusy,
    queue: Links<Job>,
    all: Links<Job>,
}

/// Tag of the worker's queue hook.
enum Queue {}
/// Tag of the "every job ever queued" hook.
enum All {}

macro_rules! static_linked {
    ($tag:ty, $field:ident) => {
        // SAFETY: jobs live in `static`s (never move, never freed); `links` projects the
        // hook named by this tag without creating a reference; each tag has its own hook.
        unsafe impl Linked<$tag> for Job {
            type Handle = &'static Job;
            fn into_ptr(job: &'static Job) -> NonNull<Job> {
                NonNull::from(job)
            }
            unsafe fn from_ptr(ptr: NonNull<Job>) -> &'static Job {
                // SAFETY: `ptr` came from `into_ptr` of a `&'static Job`.
                unsafe { ptr.as_ref() }
            }
            unsafe fn links(ptr: NonNull<Job>) -> NonNull<Links<Job>> {
                // SAFETY: `ptr` points to a live `Job`, so the field address is non-null.
                unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).$field) }
            }
        }
    };
}
static_linked!(Queue, queue);
static_linked!(All, all);

macro_rules! job {
    ($input:expr) => {
        Job {
            input: $input,
            output: AtomicU32::new(0),
            done: BlockingThenBusy::new(),
            queue: Links::new(),
            all: Links::new(),
        }
    };
}

static JOBS: [Job; 3] = [job!(3), job!(4), job!(5)];
/// Rung by the front end when it queued work (the worker's doorbell).
static DOORBELL: Notifier = Notifier::new();

/// The worker: one pass over its queue, as an interrupt handler would do it.
fn worker_pass(queue: &mut List<Job, Queue>) -> u32 {
    let mut ran = 0;
    while let Some(job) = queue.pop_front() {
        let _ = job.done.notify(); // started
        // Relaxed: the handshake's decrease() (Release) publishes it.
        job.output.store(job.input * job.input, Ordering::Relaxed);
        job.done.decrease(); // finished
        ran += 1;
    }
    ran
}

/// Runs the demo twice (the second round reuses every job and handshake) and returns the
/// sum of all results.
pub fn demo() -> u32 {
    let mut queue: List<Job, Queue> = List::new();
    let mut all: List<Job, All> = List::new();
    let mut sum = 0;
    for round in 0..2 {
        for job in &JOBS {
            queue.push_back(job);
            if round == 0 {
                all.push_back(job);
            }
        }
        let _ = DOORBELL.notify();
        // The interrupt fires: the worker sees the doorbell and drains its queue.
        if DOORBELL.wait_and_clear().is_ok() {
            worker_pass(&mut queue);
        }
        queue.assert_valid();
        for job in &JOBS {
            // Little in flight: take the notify-skip fast path, then wait.
            job.done.skip_blocking();
            job.done
                .wait_until_done(Duration::MAX, || false)
                .expect("the worker finished the job");
            sum += job.output.load(Ordering::Relaxed);
            job.done.reset();
        }
    }
    assert_eq!(all.len(), JOBS.len());
    while all.pop_front().is_some() {}
    sum
}

#[cfg(target_os = "none")]
#[unsafe(no_mangle)]
/// The entry point a board's runtime would call.
pub extern "C" fn ivm_bare_metal_main() -> u32 {
    demo()
}

#[cfg(target_os = "none")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {
        core::hint::spin_loop();
    }
}

#[cfg(not(target_os = "none"))]
fn main() {
    let sum = demo();
    assert_eq!(sum, 2 * (9 + 16 + 25));
    println!("bare-metal demo: two rounds of 3 jobs, sum of results = {sum}");
}
