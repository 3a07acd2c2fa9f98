//! A plan on the device: fixed index lists, or predictors and their top-k.
use crate::exec::parallel::Shard;
use crate::model::config::ModelConfig;
use crate::sparsity::policy::Policy;
use crate::sparsity::predictor::LowRankPredictor;
use crate::sparsity::{HeadRule, KvRule, MlpRule, SparsePlan};
use crate::{Error, Result};
use dejavu_backend_api::{Device, Rows};
use std::ops::Range;

/// The selection `pred` writes (its top `k` of the units `units`, an index list on the device)
/// and the predictor, its scores cut to those units.
fn predicted<D: Device>(
    dev: &D,
    pred: &LowRankPredictor,
    units: Range<usize>,
    k: usize,
) -> Result<(Sel<D>, Option<Predictor<D>>)> {
    let idx = dev.upload_idx(&vec![0; k])?;
    Ok((
        Sel::Predicted { idx, k },
        Some(Predictor::upload(dev, pred, units)?),
    ))
}

/// A policy's rule names a predictor its predictors file lacks.
fn missing(what: &str, l: usize) -> Error {
    Error::BadPlan(format!("no {what} predictor for layer {l}"))
}

/// A low-rank predictor on the device: `scores = W2 (W1 h)`, then the top `k`.
pub(super) struct Predictor<D: Device> {
    pub(super) w1: D::Mat,
    pub(super) w2: D::Mat,
    pub(super) rank: usize,
    pub(super) n_out: usize,
    pub(super) bytes: usize,
}

impl<D: Device> Predictor<D> {
    /// `p` scoring the units `units` only (every unit on a whole model; a rank's own under
    /// tensor parallelism, its first layer replicated).
    fn upload(dev: &D, p: &LowRankPredictor, units: Range<usize>) -> Result<Self> {
        if units.end > p.n_out {
            return Err(Error::BadPlan(format!(
                "a predictor of {} units asked for units {units:?}",
                p.n_out
            )));
        }
        let w2 = p.w2().row_range(units.clone())?;
        Ok(Self {
            w1: dev.upload_rows(&p.w1())?,
            w2: dev.upload_rows(&w2)?,
            rank: p.rank,
            n_out: units.len(),
            bytes: p.w1().data.len() + w2.data.len(),
        })
    }
}

/// How one layer's neurons or heads are chosen on the device.
pub(super) enum Sel<D: Device> {
    All,
    /// A fixed list (of a [`SparsePlan`]).
    Fixed {
        idx: D::Idx,
        count: usize,
    },
    /// The top `k` of a predictor, written to `idx` at every step.
    Predicted {
        idx: D::Idx,
        k: usize,
    },
}

impl<D: Device> Sel<D> {
    pub(super) fn rows(&self, group: usize) -> Rows<'_, D::Idx> {
        match self {
            Sel::All => Rows::All,
            Sel::Fixed { idx, count } => Rows::Sel {
                idx,
                count: *count,
                group,
            },
            Sel::Predicted { idx, k } => Rows::Sel {
                idx,
                count: *k,
                group,
            },
        }
    }
    pub(super) fn count(&self, all: usize) -> usize {
        match self {
            Sel::All => all,
            Sel::Fixed { count, .. } => *count,
            Sel::Predicted { k, .. } => *k,
        }
    }
    pub(super) fn is_all(&self) -> bool {
        matches!(self, Sel::All)
    }
}

/// A selection the step makes from the layer's own activations (the rules that read them), into
/// the layer's `Sel::Predicted` list; `Given` for the rest (dense, fixed, predictors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Computed {
    Given,
    /// `gate-first`: the gate in full, the top-k by `|act(gate)|`, up over those.
    Gate,
    /// `up-first`: the up projection in full, the top-k by `|up|`, gate over those.
    Up,
    /// `oracle:KEEP`: the first projections in full, the top-k by `|activation|`; the down
    /// projection over those.
    Oracle,
    /// `relu-exact` and `oracle` of a ReLU model: the first projections in full (the selection
    /// stays `Sel::All`); the down projection skips the rows of zero activations, which the
    /// step counts. Under `oracle` an oracle named the set: the skipped neurons' rows of the
    /// first projections do not count as read either.
    Nonzero {
        oracle: bool,
    },
    /// `attn-norm`: every head's attention, then W_o over the top-k heads by output norm.
    HeadNorm,
}

/// The contextual output head on the device: a rank-`r` preview of the output matrix
/// (`proj`, r x d in f32; `table`, vocab x r in Q8_0) scores every token, and the top
/// `candidates` (written to `idx`) get exact logits.
pub(super) struct OutputHead<D: Device> {
    pub(super) proj: D::Mat,
    pub(super) table: D::Mat,
    pub(super) rank: usize,
    pub(super) candidates: usize,
    pub(super) idx: D::Idx,
    /// The candidates' preview logits (in `idx`'s order), and the host's copies of both and
    /// scratch for the bound (`crate::sparsity::head_bound`).
    pub(super) preview: D::Buf,
    pub(super) host_idx: Vec<u32>,
    pub(super) host_preview: Vec<f32>,
    pub(super) scratch: Vec<f32>,
    pub(super) bytes: usize,
}

/// A plan on the device: per layer, the MLP and head selections, and the predictors that write
/// the predicted ones (`mlp_pred[l]` for layer l's MLP; `head_pred[t]` for layer t's heads,
/// run at layer t - 1, layer 0 at itself).
pub struct DevicePlan<D: Device> {
    pub name: String,
    pub(super) mlp: Vec<Sel<D>>,
    pub(super) heads: Vec<Sel<D>>,
    pub(super) mlp_pred: Vec<Option<Predictor<D>>>,
    pub(super) head_pred: Vec<Option<Predictor<D>>>,
    /// Per layer, how the step makes its MLP and head selections.
    pub(super) mlp_rule: Vec<Computed>,
    pub(super) head_rule: Vec<Computed>,
    /// Lazy K/V: layers with a head selection compute the keys and values of the selected heads
    /// only, and recompute the positions a head missed when it is selected again.
    pub(super) lazy_kv: bool,
    /// Lookahead: the predictors that run at a layer overlap its attention block (a second
    /// lane of the device, `Device::fork`).
    pub(super) lookahead: bool,
    /// The contextual output head (`head:RANK:CANDIDATES`), or the dense one.
    pub(super) output: Option<OutputHead<D>>,
    /// Input sparsity (`teal`, `wina`): per layer, each input group's threshold.
    pub(super) inputs: Option<InputPlan>,
}

/// Input sparsity on the device: the thresholds of each layer's four input groups (in
/// `Group::ALL` order), compared on the device with `|x|` (TEAL) or `|x|` times the model's
/// weight-row norms (WINA).
pub(super) struct InputPlan {
    /// Below 0: the group is kept whole (its dense products over the file's rows).
    pub(super) thresholds: Vec<[f32; 4]>,
    pub(super) wina: bool,
    /// Each group's target sparsity, for the step's expected byte count.
    pub(super) group_sparsity: [f64; 4],
    /// `InputRule::always`: no group kept whole for the device's sake ([`Self::where_it_pays`]).
    pub(super) always: bool,
}

impl InputPlan {
    /// Keep whole each layer's group whose input-sparse products are expected to be slower
    /// than its dense ones: `break_even(l, g)` is the kept fraction below which group `g` of
    /// layer `l` pays (a device's [`Device::input_break_even`]), set against the group's
    /// expected kept fraction; none under `always`.
    pub(crate) fn where_it_pays(&mut self, break_even: impl Fn(usize, usize) -> f64) {
        if self.always {
            return;
        }
        for (l, th) in self.thresholds.iter_mut().enumerate() {
            for (g, t) in th.iter_mut().enumerate() {
                let kept = 1.0 - self.group_sparsity[g];
                if *t >= 0.0 && kept > break_even(l, g) {
                    *t = -1.0;
                }
            }
        }
    }
}

impl<D: Device> DevicePlan<D> {
    /// A fixed plan: its sets uploaded once.
    pub fn fixed(dev: &D, cfg: &ModelConfig, plan: &SparsePlan, name: &str) -> Result<Self> {
        Self::fixed_shard(dev, cfg, Shard::WHOLE, plan, name)
    }

    /// A fixed plan over rank `shard`'s units: each set's members among them, renumbered from
    /// the rank's first (see [`crate::exec::parallel`]).
    pub fn fixed_shard(
        dev: &D,
        cfg: &ModelConfig,
        shard: Shard,
        plan: &SparsePlan,
        name: &str,
    ) -> Result<Self> {
        if plan.layers.len() != cfg.n_layers {
            return Err(Error::BadPlan(format!(
                "{} layer plans for {} layers",
                plan.layers.len(),
                cfg.n_layers
            )));
        }
        let sel = |s: &dejavu_backend_api::IndexSet, n: usize| -> Result<Sel<D>> {
            let own = shard.part(n);
            let v: Vec<u32> = (s.iter().filter(|i| own.contains(i)))
                .map(|i| (i - own.start) as u32)
                .collect();
            Ok(match v.len() == own.len() {
                true => Sel::All,
                false => Sel::Fixed {
                    // An empty list is still a list (the step skips its products).
                    idx: dev.upload_idx(if v.is_empty() { &[0] } else { &v })?,
                    count: v.len(),
                },
            })
        };
        let (mut mlp, mut heads) = (Vec::new(), Vec::new());
        for lp in &plan.layers {
            mlp.push(sel(&lp.mlp, cfg.n_ff)?);
            heads.push(sel(&lp.heads, cfg.n_heads)?);
        }
        let none = || (0..cfg.n_layers).map(|_| None).collect();
        let given = vec![Computed::Given; cfg.n_layers];
        Ok(Self {
            name: name.into(),
            mlp,
            heads,
            mlp_pred: none(),
            head_pred: none(),
            mlp_rule: given.clone(),
            head_rule: given,
            lazy_kv: false,
            lookahead: false,
            output: None,
            inputs: None,
        })
    }

    /// A policy's rules on the device: dense layers, the Deja Vu predictors (`dejavu`,
    /// `dejavu-attn`; with `lookahead` they run on a second lane, overlapped with the layer's
    /// attention), the rules that select from the layer's own activations (`gate-first`,
    /// `up-first`, `oracle`, `relu-exact`, `attn-norm`: `Computed`), `lazy-kv` and the
    /// contextual output head (`head:`).
    pub fn policy(dev: &D, cfg: &ModelConfig, p: &Policy) -> Result<Self> {
        Self::policy_shard(dev, cfg, Shard::WHOLE, p)
    }

    /// A policy's rules over rank `shard`'s units: each predicted selection keeps its share of
    /// K (K / world) among the rank's own units, by the replicated predictor's scores of them.
    pub fn policy_shard(dev: &D, cfg: &ModelConfig, shard: Shard, p: &Policy) -> Result<Self> {
        let local = shard.local_config(cfg)?;
        let unsupported = |what: String| {
            Error::Backend(dejavu_backend_api::BackendError::Unsupported {
                backend: dev.name(),
                what,
            })
        };
        // Each rank would check the head's bound on its own and fall back alone, out of step
        // with the others' all-gather; and the candidates index the whole vocabulary.
        if p.output.is_some() && !shard.is_whole() {
            return Err(unsupported(
                "the contextual output head under tensor parallelism".into(),
            ));
        }
        let output = match &p.output {
            None => None,
            Some(rule) => {
                let pv = &rule.preview;
                Some(OutputHead {
                    proj: dev.upload_mat(&pv.proj())?,
                    table: dev.upload_mat(&pv.table())?,
                    rank: pv.rank,
                    candidates: rule.candidates,
                    idx: dev.upload_idx(&vec![0; rule.candidates])?,
                    preview: dev.zeros(rule.candidates)?,
                    host_idx: Vec::new(),
                    host_preview: Vec::new(),
                    scratch: Vec::new(),
                    bytes: pv.bytes(),
                })
            }
        };
        if p.kv == KvRule::Lazy && cfg.n_kv_heads != cfg.n_heads {
            return Err(unsupported("lazy-kv with grouped-query attention".into()));
        }
        // The device's K/V fill computes keys from kept inputs without the heads' norms.
        if p.kv == KvRule::Lazy && cfg.qk_norm {
            return Err(unsupported(
                "lazy-kv with per-head Q/K norms (qwen3)".into(),
            ));
        }
        let (mut mlp, mut heads, mut mlp_pred, mut head_pred) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut mlp_rule, mut head_rule) = (Vec::new(), Vec::new());
        // A selection the step writes: its top-k list.
        let computed = |k: usize| -> Result<Sel<D>> {
            Ok(Sel::Predicted {
                idx: dev.upload_idx(&vec![0; k])?,
                k,
            })
        };
        let gated = cfg.mlp.gated();
        for l in 0..cfg.n_layers {
            let kept = p.mlp[l].kept(local.n_ff);
            let (m, mp, mr) = match p.mlp[l] {
                MlpRule::Dense => (Sel::All, None, Computed::Given),
                MlpRule::LowRank { .. } => {
                    let pred = p.mlp_predictors.get(l).ok_or_else(|| missing("MLP", l))?;
                    let (m, mp) = predicted(dev, pred, shard.part(cfg.n_ff), kept)?;
                    (m, mp, Computed::Given)
                }
                r @ (MlpRule::GateFirst { .. } | MlpRule::UpFirst { .. }) if !gated => {
                    return Err(Error::BadPlan(format!("{r:?} needs a gated MLP")))
                }
                MlpRule::GateFirst { .. } => (computed(kept)?, None, Computed::Gate),
                MlpRule::UpFirst { .. } => (computed(kept)?, None, Computed::Up),
                MlpRule::Oracle { .. } => (computed(kept)?, None, Computed::Oracle),
                MlpRule::ReluExact => (Sel::All, None, Computed::Nonzero { oracle: false }),
                MlpRule::OracleNonzero => (Sel::All, None, Computed::Nonzero { oracle: true }),
            };
            let kept = p.heads[l].kept(local.n_heads);
            let (h, hp, hr) = match p.heads[l] {
                HeadRule::Dense => (Sel::All, None, Computed::Given),
                HeadRule::LowRank { .. } => {
                    let pred = p.head_predictors.get(l).ok_or_else(|| missing("head", l))?;
                    let (h, hp) = predicted(dev, pred, shard.part(cfg.n_heads), kept)?;
                    (h, hp, Computed::Given)
                }
                HeadRule::Norm { .. } => (computed(kept)?, None, Computed::HeadNorm),
            };
            mlp.push(m);
            heads.push(h);
            mlp_pred.push(mp);
            head_pred.push(hp);
            mlp_rule.push(mr);
            head_rule.push(hr);
        }
        let inputs = match &p.inputs {
            Some(_) if !shard.is_whole() => {
                return Err(unsupported(
                    "input sparsity (teal, wina) under tensor parallelism".into(),
                ))
            }
            Some(r) if r.thresholds.len() != cfg.n_layers => {
                return Err(Error::BadPlan(format!(
                    "input thresholds of {} layers for {}",
                    r.thresholds.len(),
                    cfg.n_layers
                )))
            }
            Some(r) => Some(InputPlan {
                thresholds: r.thresholds.clone(),
                wina: r.score == crate::sparsity::input::Score::Wina,
                group_sparsity: r.group_sparsity,
                always: r.always,
            }),
            None => None,
        };
        if (mlp_rule.iter().chain(&head_rule)).any(|r| *r != Computed::Given) && !shard.is_whole() {
            return Err(unsupported(
                "rules that select from a layer's own activations under tensor parallelism".into(),
            ));
        }
        Ok(Self {
            name: p.name.clone(),
            mlp,
            heads,
            mlp_pred,
            head_pred,
            mlp_rule,
            head_rule,
            lazy_kv: p.kv == KvRule::Lazy,
            lookahead: p.lookahead,
            output,
            inputs,
        })
    }

    /// Every unit of every layer, every input (the output head may still be contextual).
    pub fn is_dense(&self) -> bool {
        self.mlp.iter().chain(&self.heads).all(Sel::is_all) && self.inputs.is_none()
    }

    /// Does a decode step compute its layers as a prompt's batch row does: every unit and
    /// input, through the dense products (no rows of zero activations skipped)? Then, on a
    /// batch-invariant device, a step's keys and values are bit for bit a prompt's. The output
    /// head may still be contextual.
    pub fn layers_dense(&self) -> bool {
        self.is_dense() && !self.needs_layout()
    }

    /// Does a step read the units' sparse layout (a selection, or rows of zero activations
    /// skipped)? Input sparsity reads the inputs' layout instead ([`Self::needs_inputs`]).
    pub fn needs_layout(&self) -> bool {
        let nonzero = |r: &Computed| matches!(r, Computed::Nonzero { .. });
        let units = !self.mlp.iter().chain(&self.heads).all(Sel::is_all);
        self.inputs.is_none() && (units || self.mlp_rule.iter().any(nonzero))
    }

    /// Does a step read the input-major layout too (input sparsity with a group not kept
    /// whole)?
    pub fn needs_inputs(&self) -> bool {
        (self.inputs.as_ref()).is_some_and(|p| p.thresholds.iter().flatten().any(|t| *t >= 0.0))
    }
}
