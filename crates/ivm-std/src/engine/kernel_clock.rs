//! Whether a worker's instructions run long (`ThreadCtx::long_kernels`) or tiny: a worker
//! times some of the instructions it runs and keeps an average; the VM's hand-over rules ask
//! it (`VmCore::after_push`'s hand-back, a worker leaving its releases to a submitting
//! caller, `helping::Owed`), and a worker with tiny ones leaves them to its callers
//! (`preemption::mark_tiny_kernels`).
//!
//! Which instructions are timed is drawn at random (one in [`SAMPLE_ONE_IN`] on average,
//! a xorshift draw per instruction), never by a fixed period: a front end's instructions
//! often repeat with a period of their own, and a fixed sampling period that divides it
//! times the same few instructions over and over. The training demo's step is 24
//! instructions; timed every 8th, a worker would time the same three of them for as long
//! as it ran, and in some phases those three average under [`LONG_KERNEL_NS`] while the
//! whole step's kernels do not (the test below makes such a phase of the demo's step).
//! Such a worker counts its kernels short and drives the engine itself between them,
//! instead of leaving those releases to the submitting caller.
//!
//! The averages are exponential with weight 1/16 per sample: a single short instruction
//! among long ones (the demo's optimizer steps take 0.1 µs beside 5 µs matrix products)
//! does not flip the hint; they follow a change of workload within a few hundred
//! instructions. Two are kept. The tiny rule compares the CPU a worker spends per
//! instruction with what running it on its caller costs, so it takes the plain mean. The
//! long rule asks whether a typical instruction outlasts the engine's work for it, so each
//! sample counts at most [`LONG_SAMPLE_CAP_NS`] there: otherwise one 4 µs instruction among
//! 100 ns ones lifts the average past [`LONG_KERNEL_NS`] for a few dozen instructions
//! (the test below).

use std::time::Instant;

use crate::util::tuning::{LONG_KERNEL_NS, TINY_KERNEL_SAMPLES};

/// One in this many instructions is timed, on average.
pub(crate) const SAMPLE_ONE_IN: u32 = 8;

/// The most one timed instruction counts in the average that decides "long": four times
/// [`LONG_KERNEL_NS`], so that a run of long instructions still reads long within a few
/// samples while a rare one moves that average by a quarter of the threshold at most.
pub(crate) const LONG_SAMPLE_CAP_NS: u64 = 4 * LONG_KERNEL_NS;

/// A worker's sampler of its instructions' durations (one per worker thread, not shared).
#[derive(Debug)]
pub(crate) struct KernelClock {
    /// Which instructions are timed.
    draw: crate::util::OneIn,
    /// Exponential average of the timed instructions' durations, in nanoseconds.
    avg_ns: u64,
    /// The same, each duration capped at [`LONG_SAMPLE_CAP_NS`] (the long rule's).
    capped_avg_ns: u64,
    /// Instructions timed so far (saturating).
    samples: u32,
}

impl Default for KernelClock {
    fn default() -> Self {
        Self {
            draw: crate::util::OneIn::new(),
            avg_ns: 0,
            capped_avg_ns: 0,
            samples: 0,
        }
    }
}

impl KernelClock {
    /// Before an instruction: whether to time it (then pass the start to [`timed`](Self::timed)).
    #[inline]
    pub(crate) fn start(&mut self) -> Option<Instant> {
        self.sample().then(Instant::now)
    }

    /// Whether the next instruction is timed: one in [`SAMPLE_ONE_IN`].
    #[inline]
    fn sample(&mut self) -> bool {
        self.draw.draw(SAMPLE_ONE_IN)
    }

    /// After a timed instruction that started at `t0`: whether the worker's instructions
    /// run long now.
    pub(crate) fn timed(&mut self, t0: Instant) -> bool {
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.record(ns)
    }

    /// Adds one timed duration to the averages; whether the capped one is now at least
    /// [`LONG_KERNEL_NS`].
    fn record(&mut self, ns: u64) -> bool {
        let ema = |avg: u64, ns: u64| (avg.saturating_mul(15).saturating_add(ns)) / 16;
        self.avg_ns = ema(self.avg_ns, ns);
        self.capped_avg_ns = ema(self.capped_avg_ns, ns.min(LONG_SAMPLE_CAP_NS));
        self.samples = self.samples.saturating_add(1);
        self.capped_avg_ns >= LONG_KERNEL_NS
    }

    /// Whether the instructions are tiny: an average under `tiny_ns`
    /// (`Config::tiny_kernel_ns`; 0 never) over at least [`TINY_KERNEL_SAMPLES`] timed ones.
    pub(crate) fn is_tiny(&self, tiny_ns: u64) -> bool {
        self.samples >= TINY_KERNEL_SAMPLES && self.avg_ns < tiny_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::tuning::TINY_KERNEL_NS;

    /// Runs `rounds` repetitions of `period` (instruction durations in ns) through the
    /// sampler; returns the share of instructions after the first `warm_up` for which
    /// the hint said "long".
    fn long_share(period: &[u64], rounds: usize, warm_up: usize) -> f64 {
        let mut c = KernelClock::default();
        let mut long = false;
        let (mut seen, mut said_long) = (0usize, 0usize);
        for i in 0..rounds * period.len() {
            if c.sample() {
                long = c.record(period[i % period.len()]);
            }
            if i >= warm_up {
                seen += 1;
                said_long += usize::from(long);
            }
        }
        said_long as f64 / seen as f64
    }

    /// The training demo's step (its kernels' durations from the demo's trace, rounded): 24
    /// instructions averaging about 1.5 µs, most of the time in a few matrix products,
    /// with short optimizer steps between.
    const DEMO_STEP: [u64; 24] = [
        300, 100, 3_900, 1_400, 800, 5_000, 200, 1_600, 2_300, 3_700, 300, 3_100, 1_500, 6_300,
        1_500, 50, 500, 2_100, 100, 300, 300, 1_200, 50, 100,
    ];

    // Not under Miri: plain arithmetic over tens of thousands of draws (no unsafe, no
    // atomics), which its interpreter would take most of a minute over.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_periodic_stream_is_judged_by_its_average_not_by_one_phase() {
        // The demo's step with the three positions a fixed period of 8 sees (7, 15 and 23)
        // made short: timed every 8th from the 8th on, the hint would say "short" for good
        // (with the 1 µs threshold of the time, the demo's own step did).
        let mut step = DEMO_STEP;
        for i in [7, 15, 23] {
            step[i] = 100;
        }
        let capped =
            |v: &[u64]| v.iter().map(|&n| n.min(LONG_SAMPLE_CAP_NS)).sum::<u64>() / v.len() as u64;
        let phase: Vec<u64> = [7, 15, 23].iter().map(|&i| step[i]).collect();
        assert!(
            capped(&phase) < LONG_KERNEL_NS,
            "the phase of the example is short"
        );
        assert!(capped(&step) >= LONG_KERNEL_NS, "the step averages long");
        let share = long_share(&step, 2_000, 24 * 50);
        assert!(
            share > 0.9,
            "the hint said long for {:.1} % of the instructions",
            share * 100.0
        );
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn short_instructions_are_short_and_a_rare_long_one_does_not_flip_it() {
        // One 4 µs instruction in 64 of 100 ns: 0.16 µs on average.
        let mut period = vec![100u64; 64];
        period[0] = 4_000;
        let share = long_share(&period, 500, 64 * 10);
        assert!(
            share < 0.01,
            "the hint said long for {:.1} % of the instructions",
            share * 100.0
        );
    }

    /// Runs `rounds` repetitions of `period` through the sampler; the share of
    /// instructions after the first `warm_up` for which it judged them tiny.
    fn tiny_share(period: &[u64], rounds: usize, warm_up: usize) -> f64 {
        let mut c = KernelClock::default();
        let (mut seen, mut tiny) = (0usize, 0usize);
        for i in 0..rounds * period.len() {
            if c.sample() {
                c.record(period[i % period.len()]);
            }
            if i >= warm_up {
                seen += 1;
                tiny += usize::from(c.is_tiny(TINY_KERNEL_NS));
            }
        }
        tiny as f64 / seen as f64
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn the_demo_step_is_never_tiny_and_a_flood_of_empty_kernels_is() {
        // From the first instruction on: the average starts at zero, and only enough
        // samples let it judge.
        assert_eq!(tiny_share(&DEMO_STEP, 2_000, 0), 0.0);
        let mut c = KernelClock::default();
        for _ in 1..TINY_KERNEL_SAMPLES {
            c.record(80);
        }
        assert!(!c.is_tiny(TINY_KERNEL_NS), "judged before enough samples");
        c.record(80);
        assert!(c.is_tiny(TINY_KERNEL_NS));
        assert!(!c.is_tiny(0), "0 turns it off");
        // A flood of 80 ns bodies with a 4 µs one among every 64.
        let mut period = vec![80u64; 64];
        period[0] = 4_000;
        let share = tiny_share(&period, 500, 64 * 10);
        assert!(share > 0.9, "tiny for {:.1} %", share * 100.0);
        // The tiny rule takes the plain mean, outliers included: four 50 ns bodies and a
        // 20 µs one average 4 µs (capped as the long rule caps them: 0.28 µs, tiny).
        let period = [50u64, 50, 20_000, 50, 50];
        let share = tiny_share(&period, 10_000, 5 * 50);
        assert!(share < 0.05, "tiny for {:.1} %", share * 100.0);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn about_one_in_eight_is_timed() {
        let mut c = KernelClock::default();
        let timed = (0..80_000).filter(|_| c.sample()).count();
        assert!((9_000..11_000).contains(&timed), "{timed} of 80 000 timed");
    }
}
