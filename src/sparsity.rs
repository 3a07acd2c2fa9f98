//! Contextual sparsity as data. A [`SparsePlan`] says, per layer, which MLP neurons and which query
//! heads to compute; the dense plan is the plan with full sets, so the executor has one path.
//! Policies that produce plans (predictors, oracle, lookahead) build on these types.
use crate::config::ModelConfig;
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
        let hd = cfg.head_dim;
        let q_rows = if heads.is_full() {
            IndexSet::full(cfg.n_heads * hd)
        } else {
            let rows = heads
                .iter()
                .flat_map(|h| (h * hd..(h + 1) * hd).map(|r| r as u32))
                .collect();
            IndexSet::new(cfg.n_heads * hd, rows).map_err(|e| Error::BadPlan(e.to_string()))?
        };
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
