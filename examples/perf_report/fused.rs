//! Section 8 of the report: fused runs (`Config::fusion`). A `vm.run` of `k` ops on one
//! stream, `k` = 1, 4, 24, 100, the ops independent (op `j` writes tensor `j`) or dependent
//! (op `j` reads tensor `j` and writes `j + 1`), repeated until `sync()`; the same VM setup
//! with fusion on and off, interleaved (on, off, on, off...), with the channel bound of the
//! throughput section measured between them, and a single-thread-mode VM (fusion on) as
//! the reference of what one thread does. Medians, and the spread (max − min over the
//! median) of the rounds. Beside each rate, the process's CPU time per instruction
//! (`CLOCK_PROCESS_CPUTIME_ID`; the other VMs of the section are idle meanwhile): a rate
//! times that figure near the machine's core count means the flood is bound by CPU, not by
//! waiting.

use super::*;
use ivm::ivm_std::Mode;

/// The ks of the section.
const KS: [usize; 4] = [1, 4, 24, 100];

struct OneStream {
    vm: VirtualMachine,
    s: Stream,
    t: Vec<Tensor>,
}

/// One round of [`OneStream::rate`]: instructions/s, and the process's CPU ns per
/// instruction.
struct Rate {
    per_s: f64,
    cpu_ns: f64,
}

impl OneStream {
    fn new(cfg: Config) -> Self {
        let vm = VirtualMachine::new(cfg).expect("VM starts");
        let s = vm
            .stream(StreamId::compute(Device::CPU, 0))
            .expect("stream");
        let t = (0..=KS[KS.len() - 1])
            .map(|_| vm.new_tensor(8).expect("tensor"))
            .collect();
        Self { vm, s, t }
    }

    /// `runs` `vm.run`s of `k` ops each, until `sync()`.
    fn rate(&self, k: usize, dependent: bool, runs: usize) -> Rate {
        let before = process_cpu_ns();
        let start = Instant::now();
        for _ in 0..runs {
            self.vm
                .run(|b| {
                    for j in 0..k {
                        let inputs: &[&Tensor] = if dependent { &[&self.t[j]] } else { &[] };
                        let out = if dependent { j + 1 } else { j };
                        b.call(&self.s, inputs, &[&self.t[out]], |_k| {})?;
                    }
                    Ok(())
                })
                .expect("run");
        }
        self.vm.sync().expect("sync");
        let wall = start.elapsed();
        let n = (runs * k) as f64;
        Rate {
            per_s: n / wall.as_secs_f64(),
            cpu_ns: (process_cpu_ns() - before) as f64 / n,
        }
    }
}

impl Drop for OneStream {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
}

/// CPU time this process has used, all threads together, in ns.
fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Median and spread ((max − min) / median) of `v`.
fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_unstable_by(f64::total_cmp);
    let m = v[v.len() / 2];
    (m, (v[v.len() - 1] - v[0]) / m)
}

pub(super) fn fused_runs(rep: &mut Report, quick: bool) {
    let n = if quick { 8_000 } else { 48_000 };
    let rounds = if quick { 3 } else { 7 };
    let on = OneStream::new(config().with_fusion(true));
    let off = OneStream::new(config().with_fusion(false));
    let single = OneStream::new(config().with_fusion(true).with_mode(Mode::SingleThread));
    // Warm them: pools, caches, the workers' first wake.
    for vm in [&on, &off, &single] {
        vm.rate(24, false, 200);
    }
    println!(
        "fused runs (k ops per vm.run on one stream; medians of {rounds} interleaved rounds, \
         spread = (max - min) / median; cpu = the process's CPU ns per instruction; \
         single = single-thread mode, fusion on):"
    );
    println!(
        "| k | ops | fusion on instr/s | spread | vs channel | cpu | fusion off instr/s | spread | vs channel | cpu | on/off | single instr/s | vs channel | cpu |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for k in KS {
        for dependent in [false, true] {
            let runs = (n / k).max(1);
            let (mut r_on, mut r_off, mut r_single, mut chan) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                r_on.push(on.rate(k, dependent, runs));
                chan.push(super::throughput::channel_bound(runs * k));
                r_off.push(off.rate(k, dependent, runs));
                r_single.push(single.rate(k, dependent, runs));
            }
            let (chan, _) = median_spread(chan);
            let [
                (m_on, s_on, c_on),
                (m_off, s_off, c_off),
                (m_single, _, c_single),
            ] = [r_on, r_off, r_single].map(|r| {
                let cpu = median_spread(r.iter().map(|x| x.cpu_ns).collect()).0;
                let (m, s) = median_spread(r.into_iter().map(|x| x.per_s).collect());
                (m, s, cpu)
            });
            let ops = if dependent {
                "dependent"
            } else {
                "independent"
            };
            println!(
                "| {k} | {ops} | {m_on:.0} | {:.0} % | {:.3} | {c_on:.0} | {m_off:.0} | {:.0} % | {:.3} | {c_off:.0} | {:.3} | {m_single:.0} | {:.3} | {c_single:.0} |",
                s_on * 100.0,
                m_on / chan,
                s_off * 100.0,
                m_off / chan,
                m_on / m_off,
                m_single / chan,
            );
            let name = |what: &str| -> &'static str {
                Box::leak(format!("fused_k{k}_{ops}_{what}").into_boxed_str())
            };
            rep.figure(name("on_per_s"), m_on, "instr/s", "(report)", None);
            rep.figure(name("off_per_s"), m_off, "instr/s", "(report)", None);
            if k == 24 {
                let r = m_on / chan;
                rep.ratio(name("on_vs_channel_bound"), r, "≥ 0.6", r >= 0.6);
                rep.figure(name("on_cpu_ns"), c_on, "ns/instr", "(report)", None);
                rep.figure(name("single_per_s"), m_single, "instr/s", "(report)", None);
                rep.figure(
                    name("single_cpu_ns"),
                    c_single,
                    "ns/instr",
                    "(report)",
                    None,
                );
            } else if k == 1 {
                let r = m_on / m_off;
                rep.ratio(name("on_vs_off"), r, "≥ 0.95", r >= 0.95);
            }
        }
    }
    let st = on.vm.stats().expect("stats");
    println!(
        "fusion on: {} fused runs, {} instructions in them (mean {:.1}), longest {}\n",
        st.fused_runs,
        st.fused_instructions,
        st.fused_instructions as f64 / st.fused_runs.max(1) as f64,
        st.longest_fused_run
    );
}
