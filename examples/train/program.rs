//! A training step as a program: buffers plus a list of ops, each op a kernel that reads
//! some buffers and writes exactly one. The three modes run this same list:
//!
//! * plain: each op called directly, in order;
//! * eager: each op an ivm instruction naming its reads (inputs) and its write (output);
//! * lazy: each op a kernel of one compiled graph (state buffers are the graph's
//!   parameters, the batch its inputs, the loss its output).
//!
//! Activations and gradients are written once per step (SSA), so the graph can run them
//! as a dataflow; only state (weights, Adam moments, the step counter) is updated in place.

use std::sync::Arc;

use crate::data::SplitMix;
use crate::kernels::{self, Adam};

/// What a buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Part of the batch, written by the data loader before each step (`x`, `y`).
    Input,
    /// Persistent, updated in place (weights, biases, Adam moments, the step counter).
    State,
    /// Written once per step, read later in the step (activations, gradients).
    Temp,
    /// A `Temp` the host reads after each step (the loss).
    Output,
}

/// One buffer of `len` `f32`s.
#[derive(Debug, Clone)]
pub struct Buf {
    /// Its name (graph blob / parameter / interface names).
    pub name: String,
    /// Number of `f32`s.
    pub len: usize,
    /// What it is for.
    pub role: Role,
    /// Initial contents of a state buffer (empty: zeros).
    pub init: Vec<f32>,
}

/// A kernel: reads, then the one buffer it writes (which holds its previous contents, so
/// state updates read-modify-write it).
pub type Kernel = Arc<dyn Fn(&[&[f32]], &mut [f32]) + Send + Sync>;

/// One op of the step.
#[derive(Clone)]
pub struct Op {
    /// The instruction / graph kernel name.
    pub name: &'static str,
    /// Buffers read.
    pub reads: Vec<usize>,
    /// The buffer written.
    pub write: usize,
    /// The computation.
    pub kernel: Kernel,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("name", &self.name)
            .field("reads", &self.reads)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

/// A whole training step of a fully connected classifier.
#[derive(Debug, Clone)]
pub struct Program {
    /// Every buffer.
    pub bufs: Vec<Buf>,
    /// The ops, in program order.
    pub ops: Vec<Op>,
    /// Layer widths: inputs, hidden layers..., classes.
    pub layers: Vec<usize>,
    /// Rows per batch.
    pub batch: usize,
    /// The batch's features (`batch × layers[0]`).
    pub x: usize,
    /// The batch's labels (`batch`).
    pub y: usize,
    /// The loss (1).
    pub loss: usize,
    /// Per layer: (weight, bias) buffers.
    pub weights: Vec<(usize, usize)>,
}

struct Builder {
    bufs: Vec<Buf>,
    ops: Vec<Op>,
}

impl Builder {
    fn buf(&mut self, name: String, len: usize, role: Role) -> usize {
        self.bufs.push(Buf {
            name,
            len,
            role,
            init: Vec::new(),
        });
        self.bufs.len() - 1
    }

    fn op(
        &mut self,
        name: &'static str,
        reads: &[usize],
        write: usize,
        f: impl Fn(&[&[f32]], &mut [f32]) + Send + Sync + 'static,
    ) {
        self.ops.push(Op {
            name,
            reads: reads.to_vec(),
            write,
            kernel: Arc::new(f),
        });
    }
}

impl Program {
    /// The training step of a classifier with widths `layers` (`[features, hidden...,
    /// classes]`; `[features, classes]` is logistic regression) on batches of `batch`
    /// rows, Adam with `adam`, weights initialised from `seed` (He-uniform; zero biases).
    pub fn classifier(layers: &[usize], batch: usize, adam: Adam, seed: u64) -> Program {
        assert!(layers.len() >= 2, "a classifier needs inputs and classes");
        let mut b = Builder {
            bufs: Vec::new(),
            ops: Vec::new(),
        };
        let m = batch;
        let x = b.buf("x".into(), m * layers[0], Role::Input);
        let y = b.buf("y".into(), m, Role::Input);
        let mut rng = SplitMix(seed);
        let mut weights = Vec::new();
        for (l, w) in layers.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let wi = b.buf(format!("w{l}"), fan_in * fan_out, Role::State);
            let limit = (6.0 / fan_in as f32).sqrt();
            b.bufs[wi].init = (0..fan_in * fan_out)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * limit)
                .collect();
            let bi = b.buf(format!("b{l}"), fan_out, Role::State);
            weights.push((wi, bi));
        }
        let t = b.buf("t".into(), 1, Role::State);

        // Forward: per layer matmul, bias add, and ReLU except on the last layer.
        let last = weights.len() - 1;
        let mut act = x; // the current activation
        let mut pre = Vec::new(); // per hidden layer: its pre-activation (ReLU input)
        let mut acts = vec![x]; // per layer: its input activation
        for (l, &(wi, bi)) in weights.iter().enumerate() {
            let (k, n) = (layers[l], layers[l + 1]);
            let mm = b.buf(format!("mm{l}"), m * n, Role::Temp);
            b.op("matmul", &[act, wi], mm, move |r, o| {
                kernels::matmul(r[0], r[1], o, m, k, n)
            });
            let z = b.buf(format!("z{l}"), m * n, Role::Temp);
            b.op("bias_add", &[mm, bi], z, move |r, o| {
                kernels::bias_add(r[0], r[1], o, m, n)
            });
            if l < last {
                let a = b.buf(format!("a{l}"), m * n, Role::Temp);
                b.op("relu", &[z], a, |r, o| kernels::relu(r[0], o));
                pre.push(z);
                acts.push(a);
                act = a;
            } else {
                act = z;
            }
        }
        let logits = act;
        let c = layers[layers.len() - 1];
        let loss = b.buf("loss".into(), 1, Role::Output);
        b.op("xent_loss", &[logits, y], loss, move |r, o| {
            kernels::xent_loss(r[0], r[1], o, m, c)
        });
        let mut dz = b.buf("dlogits".into(), m * c, Role::Temp);
        b.op("xent_grad", &[logits, y], dz, move |r, o| {
            kernels::xent_grad(r[0], r[1], o, m, c)
        });

        // Backward, last layer first.
        let mut grads = vec![(0, 0); weights.len()];
        for l in (0..weights.len()).rev() {
            let (k, n) = (layers[l], layers[l + 1]);
            let (wi, _) = weights[l];
            let dw = b.buf(format!("dw{l}"), k * n, Role::Temp);
            b.op("matmul_dw", &[acts[l], dz], dw, move |r, o| {
                kernels::matmul_tn(r[0], r[1], o, m, k, n)
            });
            let db = b.buf(format!("db{l}"), n, Role::Temp);
            b.op("bias_grad", &[dz], db, move |r, o| {
                kernels::bias_grad(r[0], o, m, n)
            });
            grads[l] = (dw, db);
            if l > 0 {
                let da = b.buf(format!("da{}", l - 1), m * k, Role::Temp);
                b.op("matmul_dx", &[dz, wi], da, move |r, o| {
                    kernels::matmul_nt(r[0], r[1], o, m, n, k)
                });
                let dzp = b.buf(format!("dz{}", l - 1), m * k, Role::Temp);
                b.op("relu_grad", &[da, pre[l - 1]], dzp, |r, o| {
                    kernels::relu_grad(r[0], r[1], o)
                });
                dz = dzp;
            }
        }

        // Update: advance t, then Adam on every weight and bias.
        b.op("tick", &[], t, |_, o| kernels::tick(o));
        for (l, &(wi, bi)) in weights.iter().enumerate() {
            let (dw, db) = grads[l];
            for (p, g) in [(wi, dw), (bi, db)] {
                let name = format!("{}.adam", b.bufs[p].name);
                let mv = b.buf(name, 2 * b.bufs[p].len, Role::State);
                b.op("adam_moments", &[g], mv, move |r, o| {
                    kernels::adam_moments(r[0], o, adam)
                });
                b.op("adam_update", &[mv, t], p, move |r, o| {
                    kernels::adam_update(r[0], r[1], o, adam)
                });
            }
        }
        Program {
            bufs: b.bufs,
            ops: b.ops,
            layers: layers.to_vec(),
            batch,
            x,
            y,
            loss,
            weights,
        }
    }

    /// Indices of the state buffers, in order (the lazy graph's parameters).
    pub fn state(&self) -> Vec<usize> {
        (0..self.bufs.len())
            .filter(|&i| self.bufs[i].role == Role::State)
            .collect()
    }

    /// The initial contents of buffer `i`.
    pub fn initial(&self, i: usize) -> Vec<f32> {
        let b = &self.bufs[i];
        if b.init.is_empty() {
            vec![0.0; b.len]
        } else {
            b.init.clone()
        }
    }

    /// Number of trainable parameters.
    pub fn num_params(&self) -> usize {
        self.weights
            .iter()
            .map(|&(w, b)| self.bufs[w].len + self.bufs[b].len)
            .sum()
    }
}

/// Classification accuracy of a classifier with widths `layers` and per-layer `(weight,
/// bias)` values on `rows` rows of `x` with labels `y` (the same kernels, one big batch).
pub fn accuracy(layers: &[usize], weights: &[(Vec<f32>, Vec<f32>)], x: &[f32], y: &[f32]) -> f64 {
    let rows = y.len();
    let mut act = x.to_vec();
    for (l, (w, b)) in weights.iter().enumerate() {
        let (k, n) = (layers[l], layers[l + 1]);
        let mut mm = vec![0.0; rows * n];
        kernels::matmul(&act, w, &mut mm, rows, k, n);
        let mut z = vec![0.0; rows * n];
        kernels::bias_add(&mm, b, &mut z, rows, n);
        if l + 1 < weights.len() {
            let mut a = vec![0.0; rows * n];
            kernels::relu(&z, &mut a);
            act = a;
        } else {
            act = z;
        }
    }
    let c = layers[layers.len() - 1];
    let pred = kernels::argmax_rows(&act, rows, c);
    let right = pred
        .iter()
        .zip(y)
        .filter(|&(&p, &t)| p == t as usize)
        .count();
    right as f64 / rows.max(1) as f64
}
