//! Shutdown under load, counted: four threads submit instructions, sync reads and lazy
//! launches while a fifth shuts the VM down. Every submission either ran (its effect is
//! observed) or its caller got `Error::ShutDown`; nothing else, no hang, and the VM's live
//! counters are back to zero afterwards. Run in multi-thread and single-thread mode, with
//! several shutdown delays.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::Duration;

use ivm_graph::{Graph, GraphBuilder};
use ivm_std::{Config, DebugCounters, Device, Error, Stream, StreamId, Tensor, VirtualMachine};

mod common;
use common::read_u64;

const SUBMITTERS: usize = 4;
/// Kernels per instruction submission (one `vm.run`).
const BATCH: usize = 16;
/// Upper bound on one repetition (setup, load, shutdown, joins). Not a timing assertion:
/// only a hang gets anywhere near it.
const WATCHDOG: Duration = Duration::from_secs(60);

/// Aborts the process with `what` unless dropped within [`WATCHDOG`].
struct Watchdog(Option<mpsc::Sender<()>>);

impl Watchdog {
    fn arm(what: String) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(WATCHDOG) {
                eprintln!("watchdog: {what} did not finish within {WATCHDOG:?}: a thread hangs");
                std::process::abort();
            }
        });
        Watchdog(Some(tx))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Instruction = 0,
    Read = 1,
    Lazy = 2,
}

const KINDS: [Kind; 3] = [Kind::Instruction, Kind::Read, Kind::Lazy];

/// Per kind: submissions made, those that ran, and those refused with `Error::ShutDown`.
#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    submitted: [u64; 3],
    ran: [u64; 3],
    refused: [u64; 3],
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        for k in 0..3 {
            self.submitted[k] += o.submitted[k];
            self.ran[k] += o.ran[k];
            self.refused[k] += o.refused[k];
        }
    }
}

/// y = x + 1000, counting its runs.
fn plus_1000() -> Graph {
    let mut g = GraphBuilder::new("plus_1000");
    let x = g.input("x", 8);
    let y = g.blob("y", 8);
    g.kernel("add", &[x], &[y], |k| {
        let v = k.input_u64(0)[0];
        k.output_u64(0)[0] = v + 1000;
    });
    g.output("y", y);
    g.threads(1);
    g.build().unwrap()
}

/// What one submitter owns: `c` is incremented by its instructions only (alternately on
/// two streams, so consecutive instructions are a cross-stream use), `y` written by its
/// lazy launches only (`y = c + 1000`).
struct Submitter {
    c: Tensor,
    y: Tensor,
}

/// One submitter's loop: rotates through the kinds (starting at `first`) until a
/// submission is refused; then one more of each kind, each of which must be refused too
/// (shutdown is sticky). Returns its counts and the number of its kernels that ran.
fn submit_until_refused(
    vm: &VirtualMachine,
    graph: &Graph,
    streams: &[Stream; 2],
    own: &Submitter,
    first: usize,
    kernels_ran: &Arc<AtomicU64>,
    accepted: &AtomicU64,
) -> Counts {
    let mut n = Counts::default();
    // Instructions of this thread accepted so far: `c`'s value once they ran.
    let mut c_expected = 0u64;
    // `y`'s value once the last accepted lazy launch ran (0: none yet).
    let mut y_expected = 0u64;
    let mut reads = 0u64;
    let mut refused_once = false;
    let mut step = first;
    let mut after_refusal = 0;
    loop {
        let kind = KINDS[step % 3];
        step += 1;
        n.submitted[kind as usize] += 1;
        let outcome: Result<(), Error> = match kind {
            Kind::Instruction => {
                // One submission: a batch of kernels alternating between two streams,
                // so each is a cross-stream use of `c` (soft sync between them).
                let ran = kernels_ran.clone();
                vm.run(|b| {
                    for j in 0..BATCH {
                        let ran = ran.clone();
                        b.call(&streams[j % 2], &[], &[&own.c], move |k| {
                            k.output_u64(0)[0] += 1;
                            ran.fetch_add(1, Ordering::Relaxed);
                        })?;
                    }
                    Ok(())
                })
                .map(|()| c_expected += BATCH as u64)
            }
            Kind::Read => {
                // Alternately `c` and `y`: a read is ordered after every earlier
                // submission of this thread, so it sees exactly their effect.
                reads += 1;
                if reads.is_multiple_of(2) {
                    read_u64(vm, &own.c).map(|v| assert_eq!(v, c_expected, "c"))
                } else {
                    read_u64(vm, &own.y).map(|v| assert_eq!(v, y_expected, "y"))
                }
            }
            Kind::Lazy => vm
                .run(|b| b.launch_lazy_job(&[&own.c], &[&own.y], &[], graph.lazy()))
                .map(|()| y_expected = c_expected + 1000),
        };
        match outcome {
            Ok(()) => {
                assert!(
                    !refused_once,
                    "{kind:?} accepted after an earlier submission was refused"
                );
                n.ran[kind as usize] += 1;
                accepted.fetch_add(1, Ordering::Relaxed);
            }
            Err(Error::ShutDown) => {
                n.refused[kind as usize] += 1;
                refused_once = true;
            }
            Err(e) => panic!("{kind:?}: expected Ok or Error::ShutDown, got {e:?}"),
        }
        if refused_once {
            after_refusal += 1;
            if after_refusal > 3 {
                return n;
            }
        }
    }
}

/// One repetition: the submitters start together; the shutdown thread waits until at
/// least `min_accepted` submissions were accepted, then `delay`, then shuts down.
fn scenario(config: Config, min_accepted: u64, delay: Duration, label: &str) -> Counts {
    let _watchdog = Watchdog::arm(format!("{label} (min_accepted {min_accepted}, {delay:?})"));
    let vm = Arc::new(VirtualMachine::new(config).unwrap());
    let graph = Arc::new(plus_1000());
    let own: Vec<Submitter> = (0..SUBMITTERS)
        .map(|_| Submitter {
            c: vm.new_tensor(8).unwrap(),
            y: vm.new_tensor(8).unwrap(),
        })
        .collect();
    // Created before the load: a stream first named after shutdown is refused.
    let streams = [
        vm.default_stream(),
        vm.stream(StreamId::compute(Device::CPU, 1)).unwrap(),
    ];
    let kernels_ran = Arc::new(AtomicU64::new(0));
    let accepted = AtomicU64::new(0);
    let start = Barrier::new(SUBMITTERS + 1);
    let mut counts = Counts::default();
    thread::scope(|sc| {
        let handles: Vec<_> = own
            .iter()
            .enumerate()
            .map(|(i, own)| {
                let (vm, graph, streams) = (&vm, &graph, &streams);
                let (kernels_ran, accepted, start) = (&kernels_ran, &accepted, &start);
                sc.spawn(move || {
                    start.wait();
                    submit_until_refused(vm, graph, streams, own, i, kernels_ran, accepted)
                })
            })
            .collect();
        let vm2 = vm.clone();
        let (accepted, start) = (&accepted, &start);
        let shutter = sc.spawn(move || {
            start.wait();
            while accepted.load(Ordering::Relaxed) < min_accepted {
                thread::yield_now();
            }
            thread::sleep(delay);
            vm2.shutdown()
        });
        shutter.join().unwrap().expect("shutdown");
        for h in handles {
            counts.add(&h.join().unwrap());
        }
    });
    for k in KINDS {
        let i = k as usize;
        assert_eq!(
            counts.ran[i] + counts.refused[i],
            counts.submitted[i],
            "{label}: every {k:?} submission either ran or was refused"
        );
    }
    // Every accepted instruction ran exactly once, every accepted launch ran its graph.
    assert_eq!(
        kernels_ran.load(Ordering::Relaxed),
        counts.ran[Kind::Instruction as usize] * BATCH as u64,
        "{label}: kernels that ran vs instructions accepted"
    );
    assert_eq!(
        graph.iterations_done(),
        counts.ran[Kind::Lazy as usize],
        "{label}: graph runs vs launches accepted"
    );
    // After shutdown everything is refused, and a second shutdown is a no-op.
    assert!(vm.is_shut_down());
    assert!(matches!(read_u64(&vm, &own[0].c), Err(Error::ShutDown)));
    vm.shutdown().unwrap();
    drop(own);
    assert_eq!(
        vm.debug_counters(),
        DebugCounters::default(),
        "{label}: every instruction, access and edge released"
    );
    eprintln!(
        "{label}: min_accepted {min_accepted:>3} delay {:>5?}: \
         instructions ran {} refused {}, reads ran {} refused {}, lazy ran {} refused {}",
        delay,
        counts.ran[0],
        counts.refused[0],
        counts.ran[1],
        counts.refused[1],
        counts.ran[2],
        counts.refused[2],
    );
    counts
}

fn repeat(config: Config, label: &str) {
    // (submissions accepted before the shutdown may start, then a delay)
    let plan: [(u64, u64); 8] = [
        (0, 0),
        (0, 1),
        (3, 0),
        (30, 0),
        (30, 2),
        (100, 5),
        (300, 0),
        (1000, 1),
    ];
    let mut all = Counts::default();
    for (min_accepted, ms) in plan.into_iter().cycle().take(3 * plan.len()) {
        let n = scenario(
            config.clone(),
            min_accepted,
            Duration::from_millis(ms),
            label,
        );
        all.add(&n);
    }
    eprintln!("{label}: all repetitions: {all:?}");
    for k in KINDS {
        // Each submitter ends with at least one refusal of every kind.
        assert!(all.refused[k as usize] > 0, "{label}: no {k:?} was refused");
        // At least 1000 submissions were accepted in some repetitions, one in three of
        // each kind per thread.
        assert!(all.ran[k as usize] > 0, "{label}: no {k:?} ran");
    }
}

#[test]
fn shutdown_under_load_multi_thread() {
    repeat(Config::default(), "multi-thread");
}

#[test]
fn shutdown_under_load_tight_backpressure() {
    // Submitters block in backpressure while the shutdown drains.
    let cfg = Config::default()
        .with_high_water_mark(32)
        .with_low_water_mark(16);
    repeat(cfg, "backpressure");
}

#[test]
fn shutdown_under_load_single_thread() {
    repeat(Config::single_thread(), "single-thread");
}
