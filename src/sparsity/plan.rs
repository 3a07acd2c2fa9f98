//! Contextual sparsity as data. A [`SparsePlan`] says, per layer, which MLP neurons and which query
//! heads to compute; the dense plan is the plan with full sets, so the executor has one path.
//! Policies that produce plans (predictors, oracle, lookahead) build on these types.
use crate::model::config::ModelConfig;
use crate::{Error, Result};
use dejavu_backend_api::IndexSet;

/// What one layer computes. Invariants (checked by [`LayerPlan::new`]): `mlp` is a set over
/// `0..n_ff`, `heads` over `0..n_heads`; `q_rows` is `heads` expanded to rows of W_q.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub mlp: IndexSet,
    pub heads: IndexSet,
    q_rows: IndexSet,
}

impl LayerPlan {
    pub fn new(cfg: &ModelConfig, mlp: IndexSet, heads: IndexSet) -> Result<Self> {
        if mlp.universe() != cfg.n_ff {
            return Err(Error::BadPlan(format!(
                "MLP set over {} neurons, model has {}",
                mlp.universe(),
                cfg.n_ff
            )));
        }
        if heads.universe() != cfg.n_heads {
            return Err(Error::BadPlan(format!(
                "head set over {} heads, model has {}",
                heads.universe(),
                cfg.n_heads
            )));
        }
        let q_rows = head_rows(&heads, cfg.head_dim);
        Ok(Self { mlp, heads, q_rows })
    }

    pub fn dense(cfg: &ModelConfig) -> Self {
        Self {
            mlp: IndexSet::full(cfg.n_ff),
            heads: IndexSet::full(cfg.n_heads),
            q_rows: IndexSet::full(cfg.n_heads * cfg.head_dim),
        }
    }

    /// Rows of W_q (and entries of its bias) that belong to the selected heads.
    pub fn q_rows(&self) -> &IndexSet {
        &self.q_rows
    }
}

/// A plan for every layer of one forward step.
#[derive(Debug, Clone, PartialEq)]
pub struct SparsePlan {
    pub layers: Vec<LayerPlan>,
}

impl SparsePlan {
    pub fn dense(cfg: &ModelConfig) -> Self {
        Self {
            layers: vec![LayerPlan::dense(cfg); cfg.n_layers],
        }
    }

    pub fn new(cfg: &ModelConfig, layers: Vec<LayerPlan>) -> Result<Self> {
        if layers.len() != cfg.n_layers {
            return Err(Error::BadPlan(format!(
                "{} layer plans for {} layers",
                layers.len(),
                cfg.n_layers
            )));
        }
        Ok(Self { layers })
    }

    pub fn is_dense(&self) -> bool {
        self.layers
            .iter()
            .all(|l| l.mlp.is_full() && l.heads.is_full())
    }

    /// Mean fraction of MLP neurons kept over layers.
    pub fn mlp_density(&self) -> f64 {
        self.layers.iter().map(|l| l.mlp.density()).sum::<f64>() / self.layers.len().max(1) as f64
    }
}

/// How one layer's MLP neurons are chosen at a decode step. `keep` is the fraction of the layer's
/// `n_ff` neurons kept, in `(0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MlpRule {
    Dense,
    /// The true top-k by `|silu(gate) * up|`: computes both projections in full and skips only the
    /// down projection's rows. The ceiling every predictor is measured against.
    Oracle {
        keep: f32,
    },
    /// The gate projection in full, then the top-k neurons by `|silu(gate)|`; up and down over
    /// those only (a cheap predictor that is exact where it matters: CATS-style thresholding).
    GateFirst {
        keep: f32,
    },
    /// The up projection in full, top-k by `|up|`; gate and down over those only.
    UpFirst {
        keep: f32,
    },
    /// Deja Vu: the layer's low-rank [`crate::sparsity::predictor::MlpPredictor`] scores the neurons
    /// from the layer's attention input; gate, up and down over the top-k only.
    LowRank {
        keep: f32,
    },
    /// ReLU models only: the first projection (fc1, or the gate of a gated ReLU) in full, then
    /// the rest only for the neurons ReLU leaves nonzero. Exact (zero error); saves the down
    /// projection's (and a gated model's up projection's) rows of the zero neurons.
    ReluExact,
    /// ReLU models only: the true nonzero set at no predictor cost, the ceiling of every
    /// predictor. Computed as `ReluExact`, but the step counts only the selected rows of the
    /// first projection (as if an oracle had named them): a bound for research, not a speedup.
    OracleNonzero,
}

impl MlpRule {
    /// Neurons kept out of `n`, at least 1 (`ReluExact`: all, as a bound; it keeps the nonzero).
    pub fn kept(&self, n: usize) -> usize {
        match *self {
            MlpRule::Dense | MlpRule::ReluExact | MlpRule::OracleNonzero => n,
            MlpRule::Oracle { keep }
            | MlpRule::GateFirst { keep }
            | MlpRule::UpFirst { keep }
            | MlpRule::LowRank { keep } => ((keep as f64 * n as f64).round() as usize).clamp(1, n),
        }
    }
}

/// How one layer's query heads are chosen at a decode step (`keep`: fraction of `n_heads`).
/// A skipped head skips its rows of W_q, its attention and its columns of W_o (rows of the
/// head-major W_o of the sparse layout); its keys and values follow the policy's [`KvRule`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HeadRule {
    Dense,
    /// Every head's attention is computed (W_q in full), then the top-k heads by the norm of
    /// their attention output go through W_o: saves W_o bytes only, exact where it matters.
    Norm {
        keep: f32,
    },
    /// Deja Vu: the previous layer's [`crate::sparsity::predictor::HeadPredictor`] scores the heads from
    /// the previous layer's attention input (layer 0: its own); W_q, attention and W_o over
    /// the top-k only.
    LowRank {
        keep: f32,
    },
}

impl HeadRule {
    /// Heads kept out of `n`, at least 1.
    pub fn kept(&self, n: usize) -> usize {
        match *self {
            HeadRule::Dense => n,
            HeadRule::Norm { keep } | HeadRule::LowRank { keep } => {
                ((keep as f64 * n as f64).round() as usize).clamp(1, n)
            }
        }
    }
}

/// Which keys and values a decode step computes when it skips query heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRule {
    /// Every KV head's, every step (the cache stays complete; needed for grouped-query
    /// attention, where query heads share KV heads).
    #[default]
    All,
    /// The paper's lazy recompute (multi-head attention only): only the selected heads'; a head
    /// selected again later first computes the positions it missed, from the layer inputs the
    /// cache keeps, in the same product (its rows are read once). Saves the skipped heads' W_k
    /// and W_v rows; costs one kept input row of `d_model` per position and layer.
    Lazy,
}

/// `heads` (a set over `n_heads`) expanded to the rows `h * head_dim .. (h + 1) * head_dim`.
pub fn head_rows(heads: &IndexSet, head_dim: usize) -> IndexSet {
    let n = heads.universe() * head_dim;
    if heads.is_full() {
        return IndexSet::full(n);
    }
    let rows = heads
        .iter()
        .flat_map(|h| (h * head_dim..(h + 1) * head_dim).map(|r| r as u32))
        .collect();
    IndexSet::new(n, rows).expect("rows of distinct heads are distinct and below n")
}

/// The `k` indices of largest `score` as a set (ties in any order); `idx` is scratch space
/// (see [`dejavu_backend_cpu::top_k`]).
pub fn top_k(score: &[f32], k: usize, idx: &mut Vec<u32>) -> IndexSet {
    let mut sel = Vec::with_capacity(k.min(score.len()));
    dejavu_backend_cpu::top_k::top_k(score, k, &mut sel, idx);
    IndexSet::new(score.len(), sel).expect("distinct indices below n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_the_largest() {
        let s = [0.5, -3.0, 9.0, 1.0, 2.0, 7.0];
        let mut idx = Vec::new();
        assert_eq!(top_k(&s, 3, &mut idx).iter().collect::<Vec<_>>(), [2, 4, 5]);
        assert!(top_k(&s, 6, &mut idx).is_full());
        assert!(top_k(&s, 0, &mut idx).is_empty());
        assert_eq!(top_k(&s, 1, &mut idx).iter().collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn kept_counts() {
        assert_eq!(MlpRule::GateFirst { keep: 0.5 }.kept(10), 5);
        assert_eq!(MlpRule::Oracle { keep: 0.01 }.kept(10), 1);
        assert_eq!(MlpRule::Dense.kept(7), 7);
        assert_eq!(HeadRule::Norm { keep: 0.8 }.kept(9), 7);
        assert_eq!(HeadRule::LowRank { keep: 0.01 }.kept(9), 1);
        let rows = head_rows(&IndexSet::new(3, vec![0, 2]).unwrap(), 2);
        assert_eq!(rows.iter().collect::<Vec<_>>(), [0, 1, 4, 5]);
    }
}
