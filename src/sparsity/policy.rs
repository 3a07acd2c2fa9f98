//! Sparsity policies: what `--sparsity POLICY[:PARAMS]` names, turned into per-layer rules the
//! executor applies at every decode step (the plan itself is built per token from the
//! activations; see `executor`).
//!
//! Grammar: `dense`, `recommended` (the setting stored by `dejavu calibrate`), `paper` (the
//! paper's plan, [`PAPER`] with layer 0 dense), `paper+lazy-kv` (the same with lazy K/V), or
//! parts joined by `+`:
//! - `oracle:KEEP[:EDGE]`, `gate-first:KEEP[:EDGE]`, `up-first:KEEP[:EDGE]`, `dejavu:KEEP[:EDGE]`
//!   (the trained low-rank predictors; needs a predictors file): MLP selection keeping the
//!   fraction KEEP of each layer's neurons; the first and last EDGE layers stay dense;
//! - `relu-exact` (ReLU models): the first MLP projection in full, the rest only for the
//!   neurons ReLU leaves nonzero (exact; see [`MlpRule::ReluExact`]); `oracle` without KEEP
//!   (ReLU models): the true nonzero set at no predictor cost ([`MlpRule::OracleNonzero`]);
//! - `dejavu:auto[:SCALE]`: per-layer budgets, each layer's predictors keeping SCALE (default 1)
//!   times the layer's density measured at calibration (layers at 100% stay dense);
//! - `attn-norm:KEEP[:EDGE]`, `dejavu-attn:KEEP[:EDGE]` (needs a predictors file): query-head
//!   selection keeping the fraction KEEP of each layer's heads (see [`HeadRule`]);
//! - `head:RANK:CANDIDATES`: the contextual output head (needs a predictors file): a rank-RANK
//!   preview of the output matrix picks CANDIDATES tokens whose logits are computed exactly;
//! - `teal:S` and `wina:S` (input sparsity, needs calibrated thresholds: [`InputRule`]): every
//!   projection reads only the inputs whose score exceeds its calibrated threshold, each input
//!   of each layer at sparsity S (`teal`: by magnitude, `wina`: by magnitude times the weight
//!   column's norm); the MLP's and W_o's inputs included, so no other MLP rule. `teal:S` takes
//!   the allocation across the inputs that calibration found, where it stored one
//!   (`crate::tune::allocation`); `teal:S:uniform` keeps every input at S. A group of inputs
//!   whose sparse products would be slower than its dense ones on the device, at its expected
//!   kept fraction, runs dense (see [`InputRule::always`]); `teal:S:always` runs every group
//!   sparse;
//! - `lookahead`: run the `dejavu` predictors on a spare thread, overlapped with the layer's
//!   attention (needs a `dejavu` rule; same plans, so the same output, as without it);
//! - `lazy-kv` (multi-head attention, with a head rule): compute keys and values for the selected
//!   heads only, recomputing a head's missed positions when it is selected again
//!   ([`KvRule::Lazy`]).
//!
//! Contextual rules apply to single-token steps (decoding); batches (prompt processing) are dense.
use crate::model::config::ModelConfig;
use crate::sparsity::input::{Group, InputStats, Score};
use crate::sparsity::predictor::{HeadPredictor, MlpPredictor};
use crate::sparsity::predictors_file::{OutputPreview, Predictors};
use crate::sparsity::{HeadRule, KvRule, MlpRule};
use crate::{Error, Result};
use std::sync::Arc;

/// The Deja Vu paper's plan (`--sparsity paper`): the top 10% of MLP neurons and 50% of heads
/// by the low-rank predictors, in layers 1..L-1 (layer 0 dense), with lookahead. Keys and values
/// of every head are computed: lazy K/V (`+lazy-kv`) reads a third fewer attention bytes, but
/// on synthetic:opt-6.7b Q8_0 at 2 threads its attention block is no faster (69.0 against 67.4
/// ms per token, `dejavu bench ... -r 5`; random selections leave most selected heads positions
/// to recompute, one more product each), and its decode rate moved from -10% to +12% of full
/// K/V between runs (docs/sparsity.md).
pub const PAPER: &str = "dejavu:0.1+dejavu-attn:0.5+lookahead";

pub struct OutputRule {
    /// Shared with the predictors it came from when the rank is the stored one.
    pub preview: Arc<OutputPreview>,
    pub candidates: usize,
}

/// Input sparsity (`teal:S`, `wina:S`): per layer, the threshold of each input [`Group`] (in
/// `Group::ALL` order), from the calibration statistics at sparsity `sparsity`.
#[derive(Debug, Clone, PartialEq)]
pub struct InputRule {
    pub score: Score,
    pub sparsity: f64,
    pub thresholds: Vec<[f32; 4]>,
    /// Each group's target sparsity (what its thresholds drop on average), in `Group::ALL`
    /// order: the fraction of the group's inputs a step is expected to keep is 1 minus it.
    pub group_sparsity: [f64; 4],
    /// Every group sparse on every device (`teal:S:always`). Without it, a session keeps a
    /// group whole (its dense products over the file's rows) on a device whose input-sparse
    /// products of that group's matrices would take longer than the dense ones at the group's
    /// expected kept fraction (`Device::input_break_even`): sparsity that costs time is not
    /// run.
    pub always: bool,
}

impl InputRule {
    /// Every layer's groups at `sparsity` by `stats`.
    pub fn uniform(score: Score, sparsity: f64, stats: &InputStats) -> Self {
        Self::groups(score, sparsity, [sparsity; 4], stats)
    }

    /// Model-wide `sparsity` as `stats` allocates it across the groups (see
    /// [`InputStats::group_sparsity`]).
    pub fn allocated(score: Score, sparsity: f64, stats: &InputStats) -> Self {
        Self::groups(
            score,
            sparsity,
            stats.group_sparsity(score, sparsity),
            stats,
        )
    }

    /// Every layer's group `g` at sparsity `per_group[g]` (model-wide `sparsity`).
    pub fn groups(score: Score, sparsity: f64, per_group: [f64; 4], stats: &InputStats) -> Self {
        let thresholds = (0..stats.n_layers)
            .map(|l| {
                let mut th = [0f32; 4];
                for (gi, g) in Group::ALL.into_iter().enumerate() {
                    th[gi] = stats.threshold(score, l, g, per_group[gi]);
                }
                th
            })
            .collect();
        Self {
            score,
            sparsity,
            thresholds,
            group_sparsity: per_group,
            always: false,
        }
    }
}

pub struct Policy {
    /// The spec it was parsed from (`recommended` resolved to its setting).
    pub name: String,
    pub mlp: Vec<MlpRule>,
    pub output: Option<OutputRule>,
    /// One per layer for `dejavu` rules (empty otherwise).
    pub mlp_predictors: Arc<[MlpPredictor]>,
    pub heads: Vec<HeadRule>,
    /// One per layer for `dejavu-attn` rules (empty otherwise).
    pub head_predictors: Arc<[HeadPredictor]>,
    /// Run the low-rank predictors on a spare thread (`crate::sparsity::lookahead`).
    pub lookahead: bool,
    /// Keys and values of skipped heads (`lazy-kv`: the paper's recompute).
    pub kv: KvRule,
    /// Input sparsity (`teal`, `wina`).
    pub inputs: Option<InputRule>,
}

impl Policy {
    pub fn dense(cfg: &ModelConfig) -> Self {
        Self {
            name: "dense".into(),
            mlp: vec![MlpRule::Dense; cfg.n_layers],
            output: None,
            mlp_predictors: Arc::new([]),
            heads: vec![HeadRule::Dense; cfg.n_layers],
            head_predictors: Arc::new([]),
            lookahead: false,
            kv: KvRule::All,
            inputs: None,
        }
    }

    /// The mean fraction of a layer's `n_ff` neurons the policy keeps (1 for dense rules).
    pub fn mean_mlp_density(&self, n_ff: usize) -> f64 {
        let kept = |r: &MlpRule| r.kept(n_ff.max(1)) as f64 / n_ff.max(1) as f64;
        self.mlp.iter().map(kept).sum::<f64>() / self.mlp.len().max(1) as f64
    }
    pub fn is_dense(&self) -> bool {
        self.output.is_none() && !self.sparse_mlp() && !self.sparse_heads() && self.inputs.is_none()
    }

    /// Whether any layer skips query heads (and so reads the head-major W_o).
    pub fn sparse_heads(&self) -> bool {
        self.heads.iter().any(|r| *r != HeadRule::Dense)
    }

    /// Whether the policy runs learned predictors (what `lookahead` overlaps).
    pub fn uses_predictors(&self) -> bool {
        self.mlp
            .iter()
            .any(|r| matches!(r, MlpRule::LowRank { .. }))
            || self
                .heads
                .iter()
                .any(|r| matches!(r, HeadRule::LowRank { .. }))
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
        if let Some(rest) = spec.strip_prefix("paper") {
            // `paper`, or `paper+lazy-kv`: the same plan with the paper's recompute of K/V.
            let full = match rest {
                "" => PAPER.to_string(),
                "+lazy-kv" => format!("{PAPER}+lazy-kv"),
                _ => return Err(bad("`paper` takes only `+lazy-kv`".into())),
            };
            let mut pol = Self::parse(&full, cfg, predictors)?;
            // Layer 0 stays dense (its neurons are much denser than the rest).
            pol.mlp[0] = MlpRule::Dense;
            pol.heads[0] = HeadRule::Dense;
            pol.name = format!("paper{rest} ({full}, layer 0 dense)");
            return Ok(pol);
        }
        let mut pol = Self::dense(cfg);
        pol.name = spec.to_string();
        if spec == "dense" {
            return Ok(pol);
        }
        let (mut mlp_set, mut heads_set) = (false, false);
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
            // KEEP[:EDGE] of a selection rule: the fraction kept, and whether each layer is inner
            // (the first and last EDGE layers stay dense).
            let keep_edge = |set: &mut bool| -> Result<(f32, Vec<bool>)> {
                if *set || args.is_empty() || args.len() > 2 {
                    return Err(bad(format!(
                        "one rule of this kind, as `{kind}:KEEP[:EDGE]`"
                    )));
                }
                *set = true;
                let keep = num(0, "KEEP")? as f32;
                if !(keep > 0.0 && keep <= 1.0) {
                    return Err(bad(format!("KEEP {keep} must be in (0, 1]")));
                }
                let edge = if args.len() == 2 {
                    num(1, "EDGE")?
                } else {
                    0.0
                };
                if edge < 0.0 || edge.fract() != 0.0 || 2.0 * edge > cfg.n_layers as f64 {
                    return Err(bad(format!(
                        "EDGE must be a whole number of layers, at most {}",
                        cfg.n_layers / 2
                    )));
                }
                let edge = edge as usize;
                let inner = (0..cfg.n_layers)
                    .map(|l| keep < 1.0 && l >= edge && l < cfg.n_layers - edge)
                    .collect();
                Ok((keep, inner))
            };
            match kind {
                "relu-exact" => {
                    if mlp_set || !args.is_empty() {
                        return Err(bad("one MLP rule, and `relu-exact` takes no arguments".into()));
                    }
                    if cfg.mlp.activation() != dejavu_backend_api::Activation::Relu {
                        return Err(bad(format!(
                            "`relu-exact` needs a ReLU MLP; this model's is {}",
                            cfg.mlp.name()
                        )));
                    }
                    mlp_set = true;
                    pol.mlp.iter_mut().for_each(|r| *r = MlpRule::ReluExact);
                }
                "oracle" if args.is_empty() => {
                    if mlp_set || cfg.mlp.activation() != dejavu_backend_api::Activation::Relu {
                        return Err(bad(
                            "`oracle` without KEEP (the nonzero set) needs a ReLU MLP and is the only MLP rule".into(),
                        ));
                    }
                    mlp_set = true;
                    pol.mlp.iter_mut().for_each(|r| *r = MlpRule::OracleNonzero);
                }
                "dejavu" if args.first() == Some(&"auto") => {
                    // Per-layer budgets: each layer keeps SCALE times its measured density.
                    if mlp_set || args.len() > 2 {
                        return Err(bad("one MLP rule, as `dejavu:auto[:SCALE]`".into()));
                    }
                    mlp_set = true;
                    let scale = if args.len() == 2 { num(1, "SCALE")? } else { 1.0 };
                    let p = predictors.filter(|p| p.mlp.len() == cfg.n_layers).ok_or_else(|| {
                        bad("`dejavu` needs a predictors file with MLP predictors (dejavu calibrate)".into())
                    })?;
                    let density = p.mlp_density().ok_or_else(|| {
                        bad("`dejavu:auto` needs per-layer densities: recalibrate with this version".into())
                    })?;
                    if scale.is_nan() || scale <= 0.0 {
                        return Err(bad("SCALE must be positive".into()));
                    }
                    if density.len() != cfg.n_layers {
                        return Err(bad(format!(
                            "the predictors file has {} layer densities for {} layers",
                            density.len(),
                            cfg.n_layers
                        )));
                    }
                    pol.mlp_predictors = p.mlp.clone();
                    for (r, dl) in pol.mlp.iter_mut().zip(density) {
                        let keep = (scale * dl).min(1.0) as f32;
                        *r = match keep < 1.0 {
                            true => MlpRule::LowRank { keep: keep.max(1e-3) },
                            false => MlpRule::Dense,
                        };
                    }
                }
                "oracle" | "gate-first" | "up-first" | "dejavu" => {
                    if matches!(kind, "gate-first" | "up-first") && !cfg.mlp.gated() {
                        return Err(bad(format!(
                            "`{kind}` needs a gated MLP; this model's is plain {} (use oracle or dejavu)",
                            cfg.mlp.name()
                        )));
                    }
                    let (keep, inner) = keep_edge(&mut mlp_set)?;
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
                    for (r, inner) in pol.mlp.iter_mut().zip(inner) {
                        *r = if inner { rule } else { MlpRule::Dense };
                    }
                }
                "attn-norm" | "dejavu-attn" => {
                    let (keep, inner) = keep_edge(&mut heads_set)?;
                    let rule = if kind == "attn-norm" {
                        HeadRule::Norm { keep }
                    } else {
                        let p = predictors.filter(|p| p.heads.len() == cfg.n_layers).ok_or_else(|| {
                            bad("`dejavu-attn` needs a predictors file with head predictors (dejavu calibrate)".into())
                        })?;
                        pol.head_predictors = p.heads.clone();
                        HeadRule::LowRank { keep }
                    };
                    for (r, inner) in pol.heads.iter_mut().zip(inner) {
                        *r = if inner { rule } else { HeadRule::Dense };
                    }
                }
                "teal" | "wina" => {
                    let (mut uniform, mut always) = (false, false);
                    let mut ok = !mlp_set && pol.inputs.is_none() && !args.is_empty();
                    for m in args.iter().skip(1) {
                        match *m {
                            "uniform" if !uniform && !always => uniform = true,
                            "always" if !always => always = true,
                            _ => ok = false,
                        }
                    }
                    if !ok {
                        return Err(bad(format!(
                            "one `{kind}:S` rule (or `{kind}:S:uniform`, `:always`, `:uniform:always`), and no other MLP rule (it sparsifies the MLP's inputs)"
                        )));
                    }
                    mlp_set = true;
                    let s = num(0, "S")?;
                    if !(0.0..1.0).contains(&s) {
                        return Err(bad(format!("sparsity S {s} must be in [0, 1)")));
                    }
                    let stats = predictors.and_then(|p| p.inputs.as_ref()).ok_or_else(|| {
                        bad(format!("`{kind}` needs input thresholds: run `dejavu calibrate` (this version) first"))
                    })?;
                    if stats.n_layers != cfg.n_layers {
                        return Err(bad(format!(
                            "input thresholds of {} layers for {} layers",
                            stats.n_layers, cfg.n_layers
                        )));
                    }
                    let score = if kind == "teal" { Score::Teal } else { Score::Wina };
                    let mut rule = match uniform {
                        true => InputRule::uniform(score, s, stats),
                        false => InputRule::allocated(score, s, stats),
                    };
                    rule.always = always;
                    pol.inputs = Some(rule);
                }
                "lookahead" if args.is_empty() => pol.lookahead = true,
                "lazy-kv" if args.is_empty() => {
                    if cfg.n_kv_heads != cfg.n_heads {
                        return Err(bad(format!(
                            "`lazy-kv` needs multi-head attention; this model groups {} query heads per KV head",
                            cfg.n_heads / cfg.n_kv_heads
                        )));
                    }
                    pol.kv = KvRule::Lazy;
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
                        "unknown part `{kind}` (dense, recommended, paper, oracle, gate-first, up-first, dejavu, relu-exact, teal, wina, attn-norm, dejavu-attn, lazy-kv, head, lookahead)"
                    )))
                }
            }
        }
        if pol.kv == KvRule::Lazy && !pol.sparse_heads() {
            return Err(bad(
                "`lazy-kv` needs a head rule (attn-norm or dejavu-attn)".into(),
            ));
        }
        if let Some(r) = &pol.inputs {
            if pol.kv == KvRule::Lazy {
                return Err(bad(
                    "`lazy-kv` recomputes keys from whole inputs: not with input sparsity".into(),
                ));
            }
            if r.score == Score::Wina && pol.sparse_heads() {
                return Err(bad(
                    "`wina` with a head rule: W_o's compact input has no column norms; use `teal`"
                        .into(),
                ));
            }
        }
        if pol.lookahead && !pol.uses_predictors() {
            return Err(bad(
                "`lookahead` needs a `dejavu` or `dejavu-attn` rule".into()
            ));
        }
        Ok(pol)
    }
}
