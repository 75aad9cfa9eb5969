//! The numeric kernels, over `ndarray` views of plain `f32` slices. Every mode (plain,
//! eager instructions, lazy graph) calls exactly these functions in the same order on the
//! same bits, so their results are bit-identical.
//!
//! Shapes are row-major; a batch of `m` rows of `k` features is an `m × k` matrix.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis, Zip};

fn view(s: &[f32], rows: usize, cols: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((rows, cols), s).expect("kernel operand has the wrong size")
}

fn view_mut(s: &mut [f32], rows: usize, cols: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((rows, cols), s).expect("kernel output has the wrong size")
}

/// `out (m×n) = a (m×k) · b (k×n)`.
pub fn matmul(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let mut o = view_mut(out, m, n);
    general_mat_mul(1.0, &view(a, m, k), &view(b, k, n), 0.0, &mut o);
}

/// `out (k×n) = aᵀ · b` with `a` of `m×k` and `b` of `m×n` (a weight gradient: `Xᵀ·dZ`).
pub fn matmul_tn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let mut o = view_mut(out, k, n);
    general_mat_mul(1.0, &view(a, m, k).t(), &view(b, m, n), 0.0, &mut o);
}

/// `out (m×k) = a · bᵀ` with `a` of `m×n` and `b` of `k×n` (an input gradient: `dZ·Wᵀ`).
pub fn matmul_nt(a: &[f32], b: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
    let mut o = view_mut(out, m, k);
    general_mat_mul(1.0, &view(a, m, n), &view(b, k, n).t(), 0.0, &mut o);
}

/// `out (m×n) = z + b` with the bias `b` (n) broadcast over rows.
pub fn bias_add(z: &[f32], b: &[f32], out: &mut [f32], m: usize, n: usize) {
    let b = ArrayView1::from(b);
    Zip::from(view_mut(out, m, n).rows_mut())
        .and(view(z, m, n).rows())
        .for_each(|o, z| {
            Zip::from(o).and(z).and(&b).for_each(|o, &z, &b| *o = z + b);
        });
}

/// `out = max(z, 0)`.
pub fn relu(z: &[f32], out: &mut [f32]) {
    Zip::from(ArrayViewMut1::from(out))
        .and(ArrayView1::from(z))
        .for_each(|o, &z| *o = z.max(0.0));
}

/// `out = da · [z > 0]` (the gradient through a ReLU whose input was `z`).
pub fn relu_grad(da: &[f32], z: &[f32], out: &mut [f32]) {
    Zip::from(ArrayViewMut1::from(out))
        .and(ArrayView1::from(da))
        .and(ArrayView1::from(z))
        .for_each(|o, &d, &z| *o = if z > 0.0 { d } else { 0.0 });
}

/// `out (n) = Σ_rows dz` (a bias gradient), rows summed in order.
pub fn bias_grad(dz: &[f32], out: &mut [f32], m: usize, n: usize) {
    let mut o = ArrayViewMut1::from(out);
    o.fill(0.0);
    for row in view(dz, m, n).axis_iter(Axis(0)) {
        o += &row;
    }
}

fn log_softmax_row(row: ArrayView1<'_, f32>) -> (f32, f32) {
    let max = row.fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f32 = row.fold(0.0, |a, &b| a + (b - max).exp());
    (max, sum)
}

/// The mean softmax cross-entropy of `logits (m×c)` against class indices `labels (m)`,
/// written to `out[0]`.
pub fn xent_loss(logits: &[f32], labels: &[f32], out: &mut [f32], m: usize, c: usize) {
    let mut total = 0f64;
    for (row, &y) in view(logits, m, c).axis_iter(Axis(0)).zip(labels) {
        let (max, sum) = log_softmax_row(row);
        let lse = max + sum.ln();
        total += f64::from(lse - row[y as usize]);
    }
    out[0] = (total / m as f64) as f32;
}

/// The gradient of [`xent_loss`] with respect to the logits: `(softmax − onehot) / m`.
pub fn xent_grad(logits: &[f32], labels: &[f32], out: &mut [f32], m: usize, c: usize) {
    let inv_m = 1.0 / m as f32;
    Zip::from(view_mut(out, m, c).rows_mut())
        .and(view(logits, m, c).rows())
        .and(ArrayView1::from(labels))
        .for_each(|mut o, row, &y| {
            let (max, sum) = log_softmax_row(row);
            Zip::from(&mut o)
                .and(&row)
                .for_each(|o, &l| *o = (l - max).exp() / sum * inv_m);
            o[y as usize] -= inv_m;
        });
}

/// Adam hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct Adam {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator guard.
    pub eps: f32,
}

impl Default for Adam {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// Updates Adam's moments `mv = [m; v]` (2n) in place from the gradient `g` (n).
pub fn adam_moments(g: &[f32], mv: &mut [f32], h: Adam) {
    let (m, v) = mv.split_at_mut(g.len());
    Zip::from(ArrayViewMut1::from(m))
        .and(ArrayViewMut1::from(v))
        .and(ArrayView1::from(g))
        .for_each(|m, v, &g| {
            *m = h.beta1 * *m + (1.0 - h.beta1) * g;
            *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
        });
}

/// Applies one bias-corrected Adam step to `w` (n) from the moments `mv` (2n) at step
/// `t[0]` (1-based).
pub fn adam_update(mv: &[f32], t: &[f32], w: &mut [f32], h: Adam) {
    let (m, v) = mv.split_at(w.len());
    let t = t[0] as i32;
    let c1 = 1.0 - h.beta1.powi(t);
    let c2 = 1.0 - h.beta2.powi(t);
    Zip::from(ArrayViewMut1::from(w))
        .and(ArrayView1::from(m))
        .and(ArrayView1::from(v))
        .for_each(|w, &m, &v| {
            *w -= h.lr * (m / c1) / ((v / c2).sqrt() + h.eps);
        });
}

/// Advances the step counter `t[0]`.
pub fn tick(t: &mut [f32]) {
    t[0] += 1.0;
}

/// Copies rows `idx` of `all` (rows of `width`) into `out`, in order.
pub fn gather(all: &[f32], idx: &[u32], out: &mut [f32], width: usize) {
    for (o, &r) in out.chunks_exact_mut(width).zip(idx) {
        let r = r as usize * width;
        o.copy_from_slice(&all[r..r + width]);
    }
}

/// The index of the largest logit of each row.
pub fn argmax_rows(logits: &[f32], m: usize, c: usize) -> Vec<usize> {
    view(logits, m, c)
        .axis_iter(Axis(0))
        .map(|row| {
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                    if v > bv { (i, v) } else { (bi, bv) }
                })
                .0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xent_grad_matches_finite_differences() {
        let (m, c) = (3, 4);
        let logits: Vec<f32> = (0..m * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let labels = [1.0, 3.0, 0.0];
        let mut g = vec![0.0; m * c];
        xent_grad(&logits, &labels, &mut g, m, c);
        for i in 0..m * c {
            let (mut lp, mut lm) = (logits.clone(), logits.clone());
            lp[i] += 1e-2;
            lm[i] -= 1e-2;
            let (mut a, mut b) = ([0.0], [0.0]);
            xent_loss(&lp, &labels, &mut a, m, c);
            xent_loss(&lm, &labels, &mut b, m, c);
            assert!(((a[0] - b[0]) / 2e-2 - g[i]).abs() < 1e-3);
        }
    }
}
