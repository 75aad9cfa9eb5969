//! The dataset: red-wine quality from `linfa-datasets` (shipped inside the crate, nothing is
//! downloaded), split into train and test deterministically, features standardised with
//! the training set's mean and standard deviation, quality mapped to a class index.

/// splitmix64: a tiny seedable generator (shuffles, weight init). Deterministic across
/// platforms, so every mode sees the same numbers.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 24 bits (exact in `f32`).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n` (`n > 0`; the tiny modulo bias does not matter here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A Fisher–Yates permutation of `0..n`.
pub fn permutation(n: usize, rng: &mut SplitMix) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        p.swap(i, rng.below(i + 1));
    }
    p
}

/// The order in which epoch `epoch` visits the training rows.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<u32> {
    let mut rng = SplitMix(seed ^ (epoch as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    permutation(n, &mut rng)
}

/// One split: row-major features (`rows × features`) and class labels stored as `f32`
/// (exact small integers, so every kernel buffer is `f32`).
#[derive(Debug, Clone)]
pub struct Split {
    /// Features, row-major.
    pub x: Vec<f32>,
    /// Class index per row.
    pub y: Vec<f32>,
    /// Number of rows.
    pub rows: usize,
}

/// The dataset after the split and standardisation.
#[derive(Debug, Clone)]
pub struct Data {
    /// Training rows.
    pub train: Split,
    /// Test rows.
    pub test: Split,
    /// Features per row (11).
    pub features: usize,
    /// Number of classes (distinct quality scores, lowest = class 0).
    pub classes: usize,
    /// The lowest quality score (class 0).
    pub min_quality: usize,
}

/// Loads the winequality dataset and splits it: `test_fraction` of the rows (shuffled with
/// `seed`) form the test set.
pub fn load(seed: u64, test_fraction: f64) -> Data {
    let ds = linfa_datasets::winequality();
    let records = &ds.records;
    let targets = &ds.targets;
    let (n, features) = records.dim();
    let min_q = targets.iter().copied().min().unwrap_or(0);
    let max_q = targets.iter().copied().max().unwrap_or(0);
    let classes = max_q - min_q + 1;

    let order = permutation(n, &mut SplitMix(seed));
    let n_test = ((n as f64) * test_fraction).round() as usize;
    let (test_rows, train_rows) = order.split_at(n_test);

    // Standardise with the training rows' statistics only (no test leakage).
    let mut mean = vec![0f64; features];
    let mut var = vec![0f64; features];
    for &r in train_rows {
        for (j, m) in mean.iter_mut().enumerate() {
            *m += records[[r as usize, j]];
        }
    }
    for m in &mut mean {
        *m /= train_rows.len() as f64;
    }
    for &r in train_rows {
        for (j, v) in var.iter_mut().enumerate() {
            let d = records[[r as usize, j]] - mean[j];
            *v += d * d;
        }
    }
    let std: Vec<f64> = var
        .iter()
        .map(|v| (v / train_rows.len() as f64).sqrt().max(1e-12))
        .collect();

    let split = |rows: &[u32]| {
        let mut x = Vec::with_capacity(rows.len() * features);
        let mut y = Vec::with_capacity(rows.len());
        for &r in rows {
            let r = r as usize;
            for j in 0..features {
                x.push(((records[[r, j]] - mean[j]) / std[j]) as f32);
            }
            y.push((targets[r] - min_q) as f32);
        }
        Split {
            x,
            y,
            rows: rows.len(),
        }
    };
    Data {
        train: split(train_rows),
        test: split(test_rows),
        features,
        classes,
        min_quality: min_q,
    }
}
