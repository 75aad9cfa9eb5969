//! Sections 4 and 7 of the report: instructions per second on one stream, on two and in a
//! fan-out (against boxed closures over a channel), and the caller's own compute rate
//! while the VM streams instructions for it.

use super::*;

// ---- 4. throughput -------------------------------------------------------------------------

const TENSORS: usize = 8;

struct Chain {
    vm: VirtualMachine,
    streams: Vec<Stream>,
    t: Vec<Tensor>,
}

impl Chain {
    fn new(streams: u32) -> Self {
        let vm = VirtualMachine::new(config()).expect("VM starts");
        let streams = (0..streams)
            .map(|i| {
                vm.stream(StreamId::compute(Device::CPU, i))
                    .expect("stream")
            })
            .collect();
        let t = (0..TENSORS)
            .map(|_| vm.new_tensor(8).expect("tensor"))
            .collect();
        Self { vm, streams, t }
    }

    /// `n` instructions (instruction `i` reads tensor `i % 8`, writes `(i + 1) % 8`, on
    /// stream `i % streams`) in `run`s of `batch`, until `sync()`; instructions/s.
    fn rate(&self, n: usize, batch: usize) -> f64 {
        let start = Instant::now();
        let mut i = 0usize;
        while i < n {
            self.vm
                .run(|b| {
                    for _ in 0..batch.min(n - i) {
                        let s = &self.streams[i % self.streams.len()];
                        b.call(
                            s,
                            &[&self.t[i % TENSORS]],
                            &[&self.t[(i + 1) % TENSORS]],
                            |_k| {},
                        )?;
                        i += 1;
                    }
                    Ok(())
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
        n as f64 / start.elapsed().as_secs_f64()
    }

    /// Fan-out/fan-in groups: a source writes `a`; four kernels on alternating streams
    /// read it and write `b[k]`; a sink reads the four and writes `c`. Instructions/s.
    fn fan_rate(&self, groups: usize) -> f64 {
        let (a, b, c) = (&self.t[0], &self.t[1..5], &self.t[5]);
        let start = Instant::now();
        for g in 0..groups {
            self.vm
                .run(|bl| {
                    let s0 = &self.streams[0];
                    bl.call(s0, &[c], &[a], move |k| k.output_u64(0)[0] = g as u64)?;
                    for (k, bk) in b.iter().enumerate() {
                        let s = &self.streams[k % self.streams.len()];
                        bl.call(s, &[a], &[bk], |kc| {
                            let x = kc.input_u64(0)[0];
                            kc.output_u64(0)[0] = x + 1;
                        })?;
                    }
                    let s1 = &self.streams[1 % self.streams.len()];
                    bl.call(s1, &[&b[0], &b[1], &b[2], &b[3]], &[c], |kc| {
                        let sum = (0..4).map(|i| kc.input_u64(i)[0]).sum::<u64>();
                        kc.output_u64(0)[0] = sum;
                    })
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
        (groups * 6) as f64 / start.elapsed().as_secs_f64()
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

/// One worker running `n` boxed closures capturing 32 bytes, sent over an unbounded
/// crossbeam channel, then one answering closure; closures/s.
pub(super) fn channel_bound(n: usize) -> f64 {
    type Job = Box<dyn FnOnce() + Send>;
    let (jobs, rx) = unbounded::<Job>();
    let (done_tx, done_rx) = bounded::<()>(1);
    let worker = std::thread::spawn(move || {
        for job in rx {
            job();
        }
    });
    let start = Instant::now();
    for i in 0..n as u64 {
        let captured = [i, i ^ 1, i ^ 2, i ^ 3];
        jobs.send(Box::new(move || {
            black_box(captured);
        }))
        .expect("worker");
    }
    let d = done_tx.clone();
    jobs.send(Box::new(move || d.send(()).expect("caller")))
        .expect("worker");
    done_rx.recv().expect("answer");
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(jobs);
    worker.join().expect("worker");
    rate
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(super) fn throughput(rep: &mut Report, quick: bool) {
    let n = if quick { 20_000 } else { 200_000 };
    let rounds = if quick { 1 } else { 3 };
    let one = Chain::new(1);
    let two = Chain::new(2);
    one.rate(4_096, 64);
    two.rate(4_096, 64);
    let (mut vm1, mut chan, mut single, mut chain2, mut fan) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        vm1.push(one.rate(n, 64));
        chan.push(channel_bound(n));
        single.push(one.rate(n / 4, 1));
        chain2.push(two.rate(n / 4, 64));
        fan.push(two.fan_rate(n / 24));
    }
    drop((one, two));
    let (vm1, chan, single, chain2, fan) = (
        median(vm1),
        median(chan),
        median(single),
        median(chain2),
        median(fan),
    );
    println!(
        "throughput (median of {rounds}): one stream {vm1:.0}/s, channel bound {chan:.0}/s, one per run {single:.0}/s, two-stream chain {chain2:.0}/s, fan-out/fan-in {fan:.0}/s"
    );
    rep.figure(
        "instr_per_s",
        vm1,
        "instr/s",
        "≥ 2 000 000",
        Some(vm1 >= 2e6),
    );
    let r = vm1 / chan;
    rep.ratio("instr_vs_channel_bound", r, "≥ 0.25", r >= 0.25);
    rep.figure(
        "instr_per_s_single",
        single,
        "instr/s",
        "≥ 500 000",
        Some(single >= 5e5),
    );
    rep.figure(
        "channel_bound_per_s",
        chan,
        "closures/s",
        "(baseline)",
        None,
    );
    rep.figure(
        "two_stream_chain_per_s",
        chain2,
        "instr/s",
        "(report)",
        None,
    );
    rep.figure("fan_out_fan_in_per_s", fan, "instr/s", "(report)", None);
}

// ---- 7. caller work ------------------------------------------------------------------------

/// A fixed compute loop (`rounds` xorshift steps; 4 000 ≈ 10 µs): the caller's own work.
fn work_chunk(seed: u64, rounds: u32) -> u64 {
    let mut x = seed | 1;
    for _ in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    x
}

/// Work chunks per second of time spent in them, over `dur`; with `vm`, a `run` of 16
/// kernels, each 1/16 of a chunk's work, is submitted before each chunk, so the VM's
/// worker is about as busy as the caller (the VM streams them meanwhile).
fn work_rate(vm: Option<&Chain>, dur: Duration) -> (f64, f64) {
    let start = Instant::now();
    let (mut chunks, mut in_work) = (0u64, Duration::ZERO);
    let mut acc = 0u64;
    let mut i = 0usize;
    while start.elapsed() < dur {
        if let Some(c) = vm {
            c.vm.run(|b| {
                for _ in 0..16 {
                    b.call(
                        &c.streams[0],
                        &[&c.t[i % TENSORS]],
                        &[&c.t[(i + 1) % TENSORS]],
                        |k| {
                            let x = k.input_u64(0)[0];
                            k.output_u64(0)[0] = work_chunk(x, 250) & 0xFF;
                        },
                    )?;
                    i += 1;
                }
                Ok(())
            })
            .expect("run");
        }
        let t = Instant::now();
        acc = acc.wrapping_add(work_chunk(chunks, 4_000));
        in_work += t.elapsed();
        chunks += 1;
    }
    black_box(acc);
    if let Some(c) = vm {
        c.vm.sync().expect("sync");
    }
    (
        chunks as f64 / in_work.as_secs_f64(),
        in_work.as_secs_f64() / start.elapsed().as_secs_f64(),
    )
}

pub(super) fn caller_work(rep: &mut Report, quick: bool) {
    let dur = if quick {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(1)
    };
    let c = Chain::new(1);
    c.rate(4_096, 64);
    let (mut idle, mut busy, mut share) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        idle.push(work_rate(None, dur).0);
        let (r, f) = work_rate(Some(&c), dur);
        busy.push(r);
        share.push(f);
    }
    let (idle, busy, share) = (median(idle), median(busy), median(share));
    let st = c.vm.stats().expect("stats");
    drop(c);
    let r = busy / idle;
    println!(
        "caller work: {busy:.0} chunks/s with the VM streaming ({:.0} % of the caller's wall time in its own work), {idle:.0} chunks/s with the VM idle; {} instructions run by the caller, {} tiny-kernel marks",
        share * 100.0,
        st.caller_ran,
        st.tiny_kernel_marks
    );
    rep.ratio("caller_work_ratio", r, "≥ 0.8", r >= 0.8);
}
