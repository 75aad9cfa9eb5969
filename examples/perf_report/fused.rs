//! Section 8 of the report: fused runs (`Config::fusion`). A `vm.run` of `k` ops on one
//! stream, `k` = 1, 4, 24, 100, the ops independent (op `j` writes tensor `j`) or dependent
//! (op `j` reads tensor `j` and writes `j + 1`), repeated until `sync()`; the same VM setup
//! with fusion on and off, interleaved (on, off, on, off...), with the channel bound of the
//! throughput section measured between them. Medians, and the spread (max − min over the
//! median) of the rounds.

use super::*;

/// The ks of the section.
const KS: [usize; 4] = [1, 4, 24, 100];

struct OneStream {
    vm: VirtualMachine,
    s: Stream,
    t: Vec<Tensor>,
}

impl OneStream {
    fn new(fusion: bool) -> Self {
        let vm = VirtualMachine::new(config().with_fusion(fusion)).expect("VM starts");
        let s = vm
            .stream(StreamId::compute(Device::CPU, 0))
            .expect("stream");
        let t = (0..=KS[KS.len() - 1])
            .map(|_| vm.new_tensor(8).expect("tensor"))
            .collect();
        Self { vm, s, t }
    }

    /// `runs` `vm.run`s of `k` ops each, until `sync()`; instructions/s.
    fn rate(&self, k: usize, dependent: bool, runs: usize) -> f64 {
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
        (runs * k) as f64 / start.elapsed().as_secs_f64()
    }
}

impl Drop for OneStream {
    fn drop(&mut self) {
        self.vm.shutdown().expect("shutdown");
    }
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
    let on = OneStream::new(true);
    let off = OneStream::new(false);
    // Warm both: pools, caches, the workers' first wake.
    for vm in [&on, &off] {
        vm.rate(24, false, 200);
    }
    println!(
        "fused runs (k ops per vm.run on one stream; medians of {rounds} interleaved rounds, \
         spread = (max - min) / median):"
    );
    println!(
        "| k | ops | fusion on instr/s | spread | vs channel | fusion off instr/s | spread | vs channel | on/off |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for k in KS {
        for dependent in [false, true] {
            let runs = (n / k).max(1);
            let (mut r_on, mut r_off, mut chan) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                r_on.push(on.rate(k, dependent, runs));
                chan.push(super::throughput::channel_bound(runs * k));
                r_off.push(off.rate(k, dependent, runs));
            }
            let ((m_on, s_on), (m_off, s_off)) = (median_spread(r_on), median_spread(r_off));
            let (chan, _) = median_spread(chan);
            let ops = if dependent {
                "dependent"
            } else {
                "independent"
            };
            println!(
                "| {k} | {ops} | {m_on:.0} | {:.0} % | {:.3} | {m_off:.0} | {:.0} % | {:.3} | {:.3} |",
                s_on * 100.0,
                m_on / chan,
                s_off * 100.0,
                m_off / chan,
                m_on / m_off
            );
            let name = |what: &str| -> &'static str {
                Box::leak(format!("fused_k{k}_{ops}_{what}").into_boxed_str())
            };
            rep.figure(name("on_per_s"), m_on, "instr/s", "(report)", None);
            rep.figure(name("off_per_s"), m_off, "instr/s", "(report)", None);
            if k == 24 {
                let r = m_on / chan;
                rep.ratio(name("on_vs_channel_bound"), r, "≥ 0.6", r >= 0.6);
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
