//! Deja Vu's predictors: a low-rank linear map `scores = W2 (W1 h)` (d -> r -> n_out) from a
//! layer's normed attention input to one score per unit; the executor keeps the top-k units.
//! - [`MlpPredictor`] (n_out = n_ff): the MLP neurons of the same layer. On ReLU models the
//!   paper's labels: neuron i is positive when `ReLU(fc1 x)_i > 0` ([`Labels::Positive`]). On
//!   SwiGLU (no neuron is ever exactly zero): positive when `|silu(g_i) * u_i|` is among the
//!   token's top `label_keep` fraction.
//! - [`HeadPredictor`] (n_out = n_heads): the query heads of the *next* layer, labelled by the
//!   norm of each head's attention output.
//!
//! Both read the attention input of the layer they run at, so they can run as soon as a layer
//! starts, on a spare thread, while the layer computes (the paper's asynchronous *lookahead*;
//! see `crate::sparsity::lookahead`). Trained here, in Rust: binary cross-entropy, positives weighted up to
//! balance them, Adam. Stored as Q8_0 (`W1`: r rows of d; `W2`: n_out rows of r), so a
//! prediction reads `(r d + n_out r) * 34/32` bytes.
use crate::{Error, Result};
use dejavu_backend_api::quant::QK;
use dejavu_backend_api::{quantize, QuantType, Weight};
use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};

#[derive(Clone)]
pub struct LowRankPredictor {
    pub rank: usize,
    pub d: usize,
    pub n_out: usize,
    pub(crate) w1: Vec<u8>,
    pub(crate) w2: Vec<u8>,
}

/// Which units a training row labels positive.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Labels {
    /// The top `label_keep` fraction by importance (SwiGLU neurons are never exactly zero; the
    /// heads of the paper's attention labels).
    #[default]
    TopK,
    /// Every unit whose importance is above zero: the paper's MLP labels on ReLU models,
    /// `ReLU(fc1 x) > 0`.
    Positive,
}

/// Training settings.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub rank: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f32,
    /// Fraction of neurons labelled positive per token (`Labels::TopK`).
    pub label_keep: f32,
    pub labels: Labels,
    pub seed: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            rank: 64,
            epochs: 8,
            batch: 256,
            lr: 3e-3,
            label_keep: 0.3,
            labels: Labels::TopK,
            seed: 11,
        }
    }
}

/// Scores MLP neurons (one per layer).
pub type MlpPredictor = LowRankPredictor;
/// Scores the query heads of the next layer (one per layer; the last layer's is unused).
pub type HeadPredictor = LowRankPredictor;

impl LowRankPredictor {
    /// From raw Q8_0 bytes (a predictors file); checks the sizes.
    pub fn from_parts(
        rank: usize,
        d: usize,
        n_out: usize,
        w1: Vec<u8>,
        w2: Vec<u8>,
    ) -> Result<Self> {
        let q = QuantType::Q8_0;
        if rank == 0
            || n_out == 0
            || !rank.is_multiple_of(QK)
            || !d.is_multiple_of(QK)
            || w1.len() != rank * q.row_bytes(d)
            || w2.len() != n_out * q.row_bytes(rank)
        {
            return Err(Error::Invalid(format!(
                "predictor: sizes do not match rank {rank}, d {d}, n_out {n_out}"
            )));
        }
        Ok(Self {
            rank,
            d,
            n_out,
            w1,
            w2,
        })
    }

    pub fn w1(&self) -> Weight<'_> {
        // The sizes were checked when the predictor was built or loaded.
        Weight::new(QuantType::Q8_0, self.rank, self.d, &self.w1)
            .expect("predictor sizes are checked at load")
    }
    pub fn w2(&self) -> Weight<'_> {
        // The sizes were checked when the predictor was built or loaded.
        Weight::new(QuantType::Q8_0, self.n_out, self.rank, &self.w2)
            .expect("predictor sizes are checked at load")
    }
    pub fn bytes(&self) -> usize {
        self.w1.len() + self.w2.len()
    }

    /// Train on `x` (`n x d`, the inputs) against `act` (`n x n_out`, the true importance of each
    /// unit, e.g. `|silu(g) * u|`, or a ReLU's output). Returns the predictor and its held-out
    /// recall (on the last eighth of the rows): the fraction of positive labels its top-k finds,
    /// k the mean number of positives per row (`TopK`: `label_keep * n_out`; `Positive`: the
    /// layer's mean count of nonzero units, its density).
    pub fn train(
        x: &[f32],
        act: &[f32],
        d: usize,
        n_out: usize,
        o: &TrainOptions,
    ) -> Result<(Self, f64)> {
        let n = x.len() / d;
        if n < 16 || act.len() != n * n_out || !o.rank.is_multiple_of(QK) || o.rank == 0 {
            return Err(Error::Invalid(format!(
                "predictor training: {n} rows, rank {}",
                o.rank
            )));
        }
        let (labels, k) = match o.labels {
            Labels::TopK => {
                let k = ((o.label_keep * n_out as f32).round() as usize).clamp(1, n_out);
                (top_labels(act, n_out, k), k)
            }
            Labels::Positive => {
                let l: Vec<f32> = act.iter().map(|&a| (a > 0.0) as u8 as f32).collect();
                let mean = l.iter().sum::<f32>() / n as f32;
                (l, (mean.round() as usize).clamp(1, n_out))
            }
        };
        let keep = (labels.iter().sum::<f32>() / labels.len() as f32).clamp(1e-3, 0.999);
        let n_train = n - n / 8;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(o.seed);
        let r = o.rank;
        let mut w1 =
            DMatrix::<f32>::from_fn(r, d, |_, _| rng.gen_range(-1.0f32..1.0) / (d as f32).sqrt());
        let mut w2 = DMatrix::<f32>::from_fn(n_out, r, |_, _| {
            rng.gen_range(-1.0f32..1.0) / (r as f32).sqrt()
        });
        let (mut m1, mut v1) = (DMatrix::zeros(r, d), DMatrix::zeros(r, d));
        let (mut m2, mut v2) = (DMatrix::zeros(n_out, r), DMatrix::zeros(n_out, r));
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        // Positives are a fraction of the labels: weight them up to balance the loss.
        let pos_w = (1.0 - keep) / keep;
        let mut order: Vec<usize> = (0..n_train).collect();
        let mut t = 0i32;
        for _ in 0..o.epochs {
            use rand::seq::SliceRandom;
            order.shuffle(&mut rng);
            for batch in order.chunks(o.batch) {
                let b = batch.len();
                let xb = DMatrix::from_fn(b, d, |i, j| x[batch[i] * d + j]);
                let z = &xb * w1.transpose(); // b x r
                let logits = &z * w2.transpose(); // b x n_out
                                                  // dL/dlogit for weighted BCE: w * (sigmoid - y).
                let g = DMatrix::from_fn(b, n_out, |i, j| {
                    let y = labels[batch[i] * n_out + j];
                    let p = 1.0 / (1.0 + (-logits[(i, j)]).exp());
                    let w = if y > 0.5 { pos_w } else { 1.0 };
                    w * (p - y) / b as f32
                });
                let gw2 = g.transpose() * &z; // n_out x r
                let gz = &g * &w2; // b x r
                let gw1 = gz.transpose() * &xb; // r x d
                t += 1;
                let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
                for (w, gw, m, v) in [
                    (&mut w1, &gw1, &mut m1, &mut v1),
                    (&mut w2, &gw2, &mut m2, &mut v2),
                ] {
                    m.zip_apply(gw, |m, g| *m = b1 * *m + (1.0 - b1) * g);
                    v.zip_apply(gw, |v, g| *v = b2 * *v + (1.0 - b2) * g * g);
                    let step = m.zip_map(v, |m: f32, v: f32| {
                        o.lr * (m / c1) / ((v / c2).sqrt() + eps)
                    });
                    *w -= step;
                }
            }
        }
        // Held-out recall at the label budget.
        let (mut hit, mut total) = (0usize, 0usize);
        let mut idx = Vec::new();
        for i in n_train..n {
            let xi = DMatrix::from_row_slice(1, d, &x[i * d..(i + 1) * d]);
            let s = (xi * w1.transpose()) * w2.transpose();
            let pred = crate::sparsity::top_k(s.as_slice(), k, &mut idx);
            let row = &labels[i * n_out..(i + 1) * n_out];
            hit += pred.iter().filter(|&j| row[j] > 0.5).count();
            total += row.iter().filter(|&&y| y > 0.5).count();
        }
        let recall = hit as f64 / total.max(1) as f64;
        let q = |m: &DMatrix<f32>| {
            let mut out = Vec::new();
            for row in 0..m.nrows() {
                let v: Vec<f32> = m.row(row).iter().copied().collect();
                quantize::quantize_row(QuantType::Q8_0, &v, &mut out)
                    .expect("rows of whole blocks");
            }
            out
        };
        let p = Self::from_parts(r, d, n_out, q(&w1), q(&w2))?;
        Ok((p, recall))
    }
}

/// 1.0 for each row's `k` largest entries of `act`, else 0.0.
fn top_labels(act: &[f32], n_out: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; act.len()];
    let mut idx = Vec::new();
    for (a, o) in act.chunks_exact(n_out).zip(out.chunks_exact_mut(n_out)) {
        for j in crate::sparsity::top_k(a, k, &mut idx).iter() {
            o[j] = 1.0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Neurons whose activation is a linear function of the input are predictable: a rank-32
    /// predictor reaches a held-out recall far above chance (0.3 = the label fraction).
    #[test]
    fn learns_a_linear_activation_pattern() {
        let (d, ff, n) = (32, 64, 2048);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let w: Vec<f32> = (0..ff * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let x: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let act: Vec<f32> = (0..n)
            .flat_map(|i| {
                let (x, w) = (&x, &w);
                (0..ff).map(move |j| {
                    (0..d)
                        .map(|k| x[i * d + k] * w[j * d + k])
                        .sum::<f32>()
                        .max(0.0)
                })
            })
            .collect();
        let o = TrainOptions {
            rank: 32,
            epochs: 20,
            ..Default::default()
        };
        let (p, recall) = MlpPredictor::train(&x, &act, d, ff, &o).unwrap();
        assert!(recall > 0.8, "recall {recall}");
        assert_eq!(
            p.bytes(),
            QuantType::Q8_0.row_bytes(d) * 32 + QuantType::Q8_0.row_bytes(32) * ff
        );
        assert!(MlpPredictor::train(&x[..d * 4], &act[..ff * 4], d, ff, &o).is_err());
    }
}
