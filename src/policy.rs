//! Sparsity policies: what `--sparsity POLICY[:PARAMS]` names, turned into per-layer rules the
//! executor applies at every decode step (the plan itself is built per token from the
//! activations; see `executor`).
//!
//! Grammar: `dense`, `recommended` (the setting stored by `dejavu calibrate`), or parts joined
//! by `+`:
//! - `oracle:KEEP[:EDGE]`, `gate-first:KEEP[:EDGE]`, `up-first:KEEP[:EDGE]`, `dejavu:KEEP[:EDGE]`
//!   (the trained low-rank predictors; needs a predictors file): MLP selection keeping the
//!   fraction KEEP of each layer's neurons; the first and last EDGE layers stay dense;
//! - `head:RANK:CANDIDATES`: the contextual output head (needs a predictors file): a rank-RANK
//!   preview of the output matrix picks CANDIDATES tokens whose logits are computed exactly.
//!
//! Contextual rules apply to single-token steps (decoding); batches (prompt processing) are dense.
use crate::config::ModelConfig;
use crate::mlp_predictor::MlpPredictor;
use crate::predictors::{OutputPreview, Predictors};
use crate::sparsity::MlpRule;
use crate::{Error, Result};
use std::sync::Arc;

pub struct OutputRule {
    /// Shared with the predictors it came from when the rank is the stored one.
    pub preview: Arc<OutputPreview>,
    pub candidates: usize,
}

pub struct Policy {
    /// The spec it was parsed from (`recommended` resolved to its setting).
    pub name: String,
    pub mlp: Vec<MlpRule>,
    pub output: Option<OutputRule>,
    /// One per layer for `dejavu` rules (empty otherwise).
    pub mlp_predictors: Arc<[MlpPredictor]>,
}

impl Policy {
    pub fn dense(cfg: &ModelConfig) -> Self {
        Self {
            name: "dense".into(),
            mlp: vec![MlpRule::Dense; cfg.n_layers],
            output: None,
            mlp_predictors: Arc::new([]),
        }
    }

    pub fn is_dense(&self) -> bool {
        self.output.is_none() && self.mlp.iter().all(|r| *r == MlpRule::Dense)
    }

    /// Whether any layer skips MLP neurons (and so reads the neuron-major down projection).
    pub fn sparse_mlp(&self) -> bool {
        self.mlp.iter().any(|r| *r != MlpRule::Dense)
    }

    /// Parse a spec (see the module docs). `predictors` is needed by `recommended` and `head:`.
    pub fn parse(spec: &str, cfg: &ModelConfig, predictors: Option<&Predictors>) -> Result<Self> {
        let bad = |why: String| Error::Invalid(format!("--sparsity `{spec}`: {why}"));
        let spec = spec.trim();
        if spec == "recommended" {
            let p = predictors.ok_or_else(|| {
                bad("no predictors file: run `dejavu calibrate` first or pass --predictors".into())
            })?;
            let rec = p
                .recommended()
                .ok_or_else(|| bad("the predictors file holds no recommended setting".into()))?;
            let mut pol = Self::parse(rec, cfg, predictors)?;
            pol.name = format!("recommended ({rec})");
            return Ok(pol);
        }
        let mut pol = Self::dense(cfg);
        pol.name = spec.to_string();
        if spec == "dense" {
            return Ok(pol);
        }
        let mut mlp_set = false;
        for part in spec.split('+') {
            let mut it = part.split(':');
            let kind = it.next().unwrap_or_default();
            let args: Vec<&str> = it.collect();
            let num = |i: usize, what: &str| -> Result<f64> {
                args.get(i)
                    .ok_or_else(|| bad(format!("`{kind}` needs {what}")))?
                    .parse::<f64>()
                    .map_err(|_| bad(format!("`{kind}`: {what} must be a number")))
            };
            match kind {
                "oracle" | "gate-first" | "up-first" | "dejavu" => {
                    if mlp_set || args.is_empty() || args.len() > 2 {
                        return Err(bad(format!(
                            "one MLP rule, as `{kind}:KEEP[:EDGE]`"
                        )));
                    }
                    mlp_set = true;
                    let keep = num(0, "KEEP")? as f32;
                    if !(keep > 0.0 && keep <= 1.0) {
                        return Err(bad(format!("KEEP {keep} must be in (0, 1]")));
                    }
                    let edge = if args.len() == 2 { num(1, "EDGE")? } else { 0.0 };
                    if edge < 0.0 || edge.fract() != 0.0 || 2.0 * edge > cfg.n_layers as f64 {
                        return Err(bad(format!(
                            "EDGE must be a whole number of layers, at most {}",
                            cfg.n_layers / 2
                        )));
                    }
                    let rule = match kind {
                        "oracle" => MlpRule::Oracle { keep },
                        "gate-first" => MlpRule::GateFirst { keep },
                        "dejavu" => {
                            let p = predictors.filter(|p| p.mlp.len() == cfg.n_layers).ok_or_else(|| {
                                bad("`dejavu` needs a predictors file with MLP predictors (dejavu calibrate)".into())
                            })?;
                            pol.mlp_predictors = p.mlp.clone();
                            MlpRule::LowRank { keep }
                        }
                        _ => MlpRule::UpFirst { keep },
                    };
                    let edge = edge as usize;
                    for (l, r) in pol.mlp.iter_mut().enumerate() {
                        let inner = l >= edge && l < cfg.n_layers - edge;
                        *r = if inner && keep < 1.0 { rule } else { MlpRule::Dense };
                    }
                }
                "head" => {
                    if pol.output.is_some() || args.len() != 2 {
                        return Err(bad("one output rule, as `head:RANK:CANDIDATES`".into()));
                    }
                    let (rank, cand) = (num(0, "RANK")?, num(1, "CANDIDATES")?);
                    let full = predictors.and_then(|p| p.output.as_ref()).ok_or_else(|| {
                        bad("`head` needs a predictors file with an output preview (dejavu calibrate)".into())
                    })?;
                    if cand < 1.0 || cand.fract() != 0.0 || rank.fract() != 0.0 {
                        return Err(bad("RANK and CANDIDATES must be whole numbers".into()));
                    }
                    pol.output = Some(OutputRule {
                        preview: full.truncated(rank as usize)?,
                        candidates: (cand as usize).min(cfg.vocab_size),
                    });
                }
                _ => {
                    return Err(bad(format!(
                        "unknown part `{kind}` (dense, recommended, oracle, gate-first, up-first, dejavu, head)"
                    )))
                }
            }
        }
        Ok(pol)
    }
}
