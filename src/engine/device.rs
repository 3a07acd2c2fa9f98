//! The device-resident decoder: the executor's layer loop (see `executor`) over the verbs of a
//! [`Device`], for backends whose memory is their own (CUDA). Weights are uploaded once
//! ([`DeviceModel::upload`]); the KV cache, the activations and the plan's index lists stay on
//! the device; a decode step is recorded once and replayed at every position; the host reads
//! back only the logits. The code names no backend: `HostDevice` (the scalar reference) runs it
//! on any machine, and the tests hold it to the host executor.
//!
//! The plan ([`DevicePlan`]) is the host's, on the device: a fixed [`SparsePlan`] becomes index
//! lists uploaded once; a [`Policy`]'s Deja Vu rules become the low-rank predictors and a device
//! top-k writing fixed-K lists at every step, with no round trip to the host. Full sets are
//! `Rows::All`: the dense plan is the sparse plan with full sets. Selections are compact (see
//! `dejavu_backend_api::device`): the sparse MLP computes `K` neurons and its down projection
//! reads those `K` rows of the neuron-major layout; selected heads compute their rows of W_q,
//! their attention and their rows of the head-major W_o. Keys and values of every head are
//! computed (the `KvRule::All` of the host).
use crate::engine::config::{ModelConfig, NormKind, Positions};
use crate::engine::weights::{Model, NormWeights, WeightRef};
use crate::sparsity::layout::SparseLayout;
use crate::sparsity::policy::Policy;
use crate::sparsity::predictor::LowRankPredictor;
use crate::sparsity::{HeadRule, KvRule, MlpRule, SparsePlan};
use crate::{Error, Result};
use dejavu_backend_api::{AttnGeom, Device, Product, Rows, StepRow};

/// A norm's gain and bias on the device.
struct Norm<D: Device> {
    w: D::Buf,
    b: Option<D::Buf>,
}

struct Layer<D: Device> {
    attn_norm: Norm<D>,
    wq: D::Mat,
    wk: D::Mat,
    wv: D::Mat,
    bq: Option<D::Buf>,
    bk: Option<D::Buf>,
    bv: Option<D::Buf>,
    wo: D::Mat,
    bo: Option<D::Buf>,
    ffn_norm: Norm<D>,
    w_gate: Option<D::Mat>,
    w_up: D::Mat,
    b_up: Option<D::Buf>,
    w_down: D::Mat,
    b_down: Option<D::Buf>,
}

/// Every weight of a model on the device (plus, for sparse plans, the neuron-major down
/// projections and head-major W_o of the [`SparseLayout`]).
pub struct DeviceModel<D: Device> {
    pub config: ModelConfig,
    token_embd: D::Mat,
    pos_embd: Option<D::Mat>,
    /// Rows of the learned position table (0 without one).
    pos_rows: usize,
    proj_in: Option<D::Mat>,
    proj_out: Option<D::Mat>,
    output_norm: Option<Norm<D>>,
    output: D::Mat,
    layers: Vec<Layer<D>>,
    /// Per layer `(down_t, wo_t)`.
    sparse: Option<Vec<(D::Mat, D::Mat)>>,
    /// Weight bytes of a dense step, and per layer those of one MLP neuron (its rows of the
    /// MLP's matrices) and of one head (its rows of W_q and W_o), for the step's byte count.
    dense_bytes: usize,
    unit_bytes: Vec<(usize, usize)>,
}

impl<D: Device> DeviceModel<D> {
    /// Upload `model` (in its file's row layout: load it without repacking) and, when given,
    /// the sparse layout that sparse plans read.
    pub fn upload(dev: &D, model: &Model, layout: Option<&SparseLayout>) -> Result<Self> {
        if let Some(w) = model
            .matrices()
            .into_iter()
            .find(|w| !dev.supports(w.qtype))
        {
            return Err(Error::UnsupportedType {
                tensor: w.name.clone(),
                qtype: format!("{} on {}", w.qtype.name(), dev.name()),
            });
        }
        let mat = |w: &WeightRef| Ok::<_, Error>(dev.upload_mat(&model.weight(w))?);
        let vec = |v: &Option<Vec<f32>>| v.as_deref().map(|v| dev.upload(v)).transpose();
        let norm = |n: &NormWeights| {
            Ok::<_, Error>(Norm {
                w: dev.upload(&n.weight)?,
                b: vec(&n.bias)?,
            })
        };
        let progress = crate::progress::bar(model.layers.len() as u64, "upload");
        let mut layers = Vec::with_capacity(model.layers.len());
        for lw in &model.layers {
            layers.push(Layer {
                attn_norm: norm(&lw.attn_norm)?,
                wq: mat(&lw.wq)?,
                wk: mat(&lw.wk)?,
                wv: mat(&lw.wv)?,
                bq: vec(&lw.bq)?,
                bk: vec(&lw.bk)?,
                bv: vec(&lw.bv)?,
                wo: mat(&lw.wo)?,
                bo: vec(&lw.bo)?,
                ffn_norm: norm(&lw.ffn_norm)?,
                w_gate: lw.w_gate.as_ref().map(mat).transpose()?,
                w_up: mat(&lw.w_up)?,
                b_up: vec(&lw.b_up)?,
                w_down: mat(&lw.w_down)?,
                b_down: vec(&lw.b_down)?,
            });
            progress.inc(1);
        }
        let sparse = match layout {
            Some(lay) => Some(
                (0..model.layers.len())
                    .map(|l| {
                        Ok((
                            dev.upload_mat(&lay.down_t(l))?,
                            dev.upload_mat(&lay.wo_t(l))?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };
        progress.finish_and_clear();
        Ok(Self {
            config: model.config.clone(),
            token_embd: mat(&model.token_embd)?,
            pos_embd: model.pos_embd.as_ref().map(mat).transpose()?,
            pos_rows: model.pos_embd.as_ref().map_or(0, |p| p.rows),
            proj_in: model.proj_in.as_ref().map(mat).transpose()?,
            proj_out: model.proj_out.as_ref().map(mat).transpose()?,
            output_norm: model.output_norm.as_ref().map(norm).transpose()?,
            output: mat(&model.output)?,
            layers,
            sparse,
            dense_bytes: model.dense_bytes_per_token(),
            unit_bytes: model
                .layers
                .iter()
                .map(|lw| {
                    let mlp = lw.w_gate.as_ref().map_or(0, |w| w.n_bytes())
                        + lw.w_up.n_bytes()
                        + lw.w_down.n_bytes();
                    let c = &model.config;
                    (
                        mlp / c.n_ff,
                        (lw.wq.n_bytes() + lw.wo.n_bytes()) / c.n_heads,
                    )
                })
                .collect(),
        })
    }
}

/// A low-rank predictor on the device: `scores = W2 (W1 h)`, then the top `k`.
struct Predictor<D: Device> {
    w1: D::Mat,
    w2: D::Mat,
    rank: usize,
    n_out: usize,
    bytes: usize,
}

impl<D: Device> Predictor<D> {
    fn upload(dev: &D, p: &LowRankPredictor) -> Result<Self> {
        Ok(Self {
            w1: dev.upload_mat(&p.w1())?,
            w2: dev.upload_mat(&p.w2())?,
            rank: p.rank,
            n_out: p.n_out,
            bytes: p.bytes(),
        })
    }
}

/// How one layer's neurons or heads are chosen on the device.
enum Sel<D: Device> {
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
    fn rows(&self, group: usize) -> Rows<'_, D::Idx> {
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
    fn count(&self, all: usize) -> usize {
        match self {
            Sel::All => all,
            Sel::Fixed { count, .. } => *count,
            Sel::Predicted { k, .. } => *k,
        }
    }
    fn is_all(&self) -> bool {
        matches!(self, Sel::All)
    }
}

/// A plan on the device: per layer, the MLP and head selections, and the predictors that write
/// the predicted ones (`mlp_pred[l]` for layer l's MLP; `head_pred[t]` for layer t's heads,
/// run at layer t - 1, layer 0 at itself).
pub struct DevicePlan<D: Device> {
    pub name: String,
    mlp: Vec<Sel<D>>,
    heads: Vec<Sel<D>>,
    mlp_pred: Vec<Option<Predictor<D>>>,
    head_pred: Vec<Option<Predictor<D>>>,
}

impl<D: Device> DevicePlan<D> {
    /// A fixed plan: its sets uploaded once.
    pub fn fixed(dev: &D, cfg: &ModelConfig, plan: &SparsePlan, name: &str) -> Result<Self> {
        if plan.layers.len() != cfg.n_layers {
            return Err(Error::BadPlan(format!(
                "{} layer plans for {} layers",
                plan.layers.len(),
                cfg.n_layers
            )));
        }
        let sel = |s: &dejavu_backend_api::IndexSet| -> Result<Sel<D>> {
            Ok(match s.is_full() {
                true => Sel::All,
                false => {
                    let v: Vec<u32> = s.iter().map(|i| i as u32).collect();
                    Sel::Fixed {
                        idx: dev.upload_idx(&v)?,
                        count: v.len(),
                    }
                }
            })
        };
        let (mut mlp, mut heads) = (Vec::new(), Vec::new());
        for lp in &plan.layers {
            mlp.push(sel(&lp.mlp)?);
            heads.push(sel(&lp.heads)?);
        }
        let none = || (0..cfg.n_layers).map(|_| None).collect();
        Ok(Self {
            name: name.into(),
            mlp,
            heads,
            mlp_pred: none(),
            head_pred: none(),
        })
    }

    /// A policy's rules on the device: dense layers and the Deja Vu predictors (`dejavu`,
    /// `dejavu-attn`; `lookahead` is implied: the predictors run in the step's stream). Rules
    /// that need the host's view of the activations are refused.
    pub fn policy(dev: &D, cfg: &ModelConfig, p: &Policy) -> Result<Self> {
        let unsupported = |what: String| {
            Error::Backend(dejavu_backend_api::BackendError::Unsupported {
                backend: dev.name(),
                what,
            })
        };
        if p.output.is_some() {
            return Err(unsupported("the contextual output head (head:...)".into()));
        }
        if p.kv == KvRule::Lazy {
            return Err(unsupported("lazy-kv".into()));
        }
        let (mut mlp, mut heads, mut mlp_pred, mut head_pred) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for l in 0..cfg.n_layers {
            let (m, mp) = match p.mlp[l] {
                MlpRule::Dense => (Sel::All, None),
                r @ MlpRule::LowRank { .. } => {
                    let k = r.kept(cfg.n_ff);
                    let pred = Predictor::upload(dev, &p.mlp_predictors[l])?;
                    (
                        Sel::Predicted {
                            idx: dev.upload_idx(&vec![0; k])?,
                            k,
                        },
                        Some(pred),
                    )
                }
                r => return Err(unsupported(format!("the MLP rule {r:?}"))),
            };
            let (h, hp) = match p.heads[l] {
                HeadRule::Dense => (Sel::All, None),
                r @ HeadRule::LowRank { .. } => {
                    let k = r.kept(cfg.n_heads);
                    let pred = Predictor::upload(dev, &p.head_predictors[l])?;
                    (
                        Sel::Predicted {
                            idx: dev.upload_idx(&vec![0; k])?,
                            k,
                        },
                        Some(pred),
                    )
                }
                r => return Err(unsupported(format!("the head rule {r:?}"))),
            };
            mlp.push(m);
            heads.push(h);
            mlp_pred.push(mp);
            head_pred.push(hp);
        }
        Ok(Self {
            name: p.name.clone(),
            mlp,
            heads,
            mlp_pred,
            head_pred,
        })
    }

    fn is_dense(&self) -> bool {
        self.mlp.iter().chain(&self.heads).all(Sel::is_all)
    }
}

/// The activations of one step.
struct Scratch<D: Device> {
    x: D::Buf,
    h: D::Buf,
    e: D::Buf,
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    att: D::Buf,
    gate: D::Buf,
    up: D::Buf,
    z: D::Buf,
    scores: D::Buf,
    logits: D::Buf,
}

impl<D: Device> crate::text::generate::Decoder for DeviceSession<'_, D> {
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.forward(tokens)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn truncate(&mut self, len: usize) {
        DeviceSession::truncate(self, len)
    }
}

/// Where an eagerly run step's time goes, in seconds summed over the steps profiled (see
/// [`DeviceSession::profile`]).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct BlockTimes {
    pub steps: usize,
    /// Embedding lookup.
    pub embed: f64,
    /// The low-rank predictors and their top-k.
    pub predict: f64,
    pub attention: f64,
    pub mlp: f64,
    /// The final norm and the output head.
    pub output: f64,
}

/// Times the blocks of a step: the device is synchronized at every block's end.
struct Clock<'t> {
    times: &'t mut BlockTimes,
    at: std::time::Instant,
}

impl Clock<'_> {
    fn lap<D: Device>(&mut self, dev: &D, block: fn(&mut BlockTimes) -> &mut f64) -> Result<()> {
        dev.sync()?;
        let now = std::time::Instant::now();
        *block(self.times) += (now - self.at).as_secs_f64();
        self.at = now;
        Ok(())
    }
}

fn lap<D: Device>(
    clock: &mut Option<Clock>,
    dev: &D,
    block: fn(&mut BlockTimes) -> &mut f64,
) -> Result<()> {
    match clock {
        Some(c) => c.lap(dev, block),
        None => Ok(()),
    }
}

/// One layer's selected `(neurons, heads)`, each sorted (`None`: every unit).
pub type Selections = (Option<Vec<u32>>, Option<Vec<u32>>);

/// One sequence on the device: its KV cache, its activations and its recorded step.
pub struct DeviceSession<'a, D: Device> {
    dev: &'a D,
    model: &'a DeviceModel<D>,
    plan: DevicePlan<D>,
    k: Vec<D::Cache>,
    v: Vec<D::Cache>,
    n_ctx: usize,
    len: usize,
    s: Scratch<D>,
    graph: Option<D::Graph>,
    logits: Vec<f32>,
    /// Weight bytes one step reads under the plan.
    step_bytes: usize,
}

impl<'a, D: Device> DeviceSession<'a, D> {
    pub fn new(
        dev: &'a D,
        model: &'a DeviceModel<D>,
        plan: DevicePlan<D>,
        n_ctx: usize,
    ) -> Result<Self> {
        let c = &model.config;
        if !plan.is_dense() && model.sparse.is_none() {
            return Err(Error::Invalid(
                "a sparse plan on the device needs the model uploaded with its sparse layout"
                    .into(),
            ));
        }
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..c.n_layers {
            k.push(dev.cache(n_ctx, c.kv_dim())?);
            v.push(dev.cache(n_ctx, c.kv_dim())?);
        }
        let rank = (plan.mlp_pred.iter().chain(&plan.head_pred))
            .flatten()
            .map(|p| p.rank)
            .max()
            .unwrap_or(1);
        let wide = c.d_model.max(c.d_embed);
        let s = Scratch {
            x: dev.zeros(wide)?,
            h: dev.zeros(wide)?,
            e: dev.zeros(wide)?,
            q: dev.zeros(c.n_heads * c.head_dim)?,
            k: dev.zeros(c.kv_dim())?,
            v: dev.zeros(c.kv_dim())?,
            att: dev.zeros(c.n_heads * c.head_dim)?,
            gate: dev.zeros(c.n_ff)?,
            up: dev.zeros(c.n_ff)?,
            z: dev.zeros(rank)?,
            scores: dev.zeros(c.n_ff.max(c.n_heads))?,
            logits: dev.zeros(c.vocab_size)?,
        };
        let step_bytes = step_bytes(model, &plan);
        Ok(Self {
            dev,
            model,
            plan,
            k,
            v,
            n_ctx,
            len: 0,
            s,
            graph: None,
            logits: vec![0.0; c.vocab_size],
            step_bytes,
        })
    }

    /// The last step's selections per layer, `(neurons, heads)`, each sorted (`None`: every
    /// unit); read back from the device (for tests and reports).
    pub fn selections(&self) -> Result<Vec<Selections>> {
        let read = |sel: &Sel<D>| -> Result<Option<Vec<u32>>> {
            let (idx, n) = match sel {
                Sel::All => return Ok(None),
                Sel::Fixed { idx, count } => (idx, *count),
                Sel::Predicted { idx, k } => (idx, *k),
            };
            let mut v = vec![0; n];
            self.dev.download_idx(idx, &mut v)?;
            v.sort_unstable();
            Ok(Some(v))
        };
        (self.plan.mlp.iter().zip(&self.plan.heads))
            .map(|(m, h)| Ok((read(m)?, read(h)?)))
            .collect()
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Forget positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Weight bytes one step reads under the plan (predictors included).
    pub fn step_bytes(&self) -> usize {
        self.step_bytes
    }
    pub fn plan_name(&self) -> &str {
        &self.plan.name
    }
    /// Mean fraction of MLP neurons and of heads the plan computes per layer.
    pub fn densities(&self) -> (f64, f64) {
        let c = &self.model.config;
        let mean = |sels: &[Sel<D>], n: usize| {
            sels.iter()
                .map(|s| s.count(n) as f64 / n as f64)
                .sum::<f64>()
                / sels.len().max(1) as f64
        };
        (
            mean(&self.plan.mlp, c.n_ff),
            mean(&self.plan.heads, c.n_heads),
        )
    }

    /// Run `tokens` one position at a time; returns the logits of the last.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        if tokens.is_empty() {
            return Err(Error::Invalid("forward called with no tokens".into()));
        }
        if self.len + tokens.len() > self.n_ctx {
            return Err(Error::ContextOverflow {
                n_tokens: self.len + tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        for &t in tokens {
            self.step(t)?;
        }
        self.dev.download(&self.s.logits, &mut self.logits)?;
        Ok(&mut self.logits)
    }

    /// One token at the next position, its logits left on the device.
    fn step(&mut self, token: u32) -> Result<()> {
        self.check_token(token)?;
        self.dev.set_step(token, self.len)?;
        if self.graph.is_none() && self.dev.begin_capture()? {
            let recorded = self.encode();
            let graph = self.dev.end_capture();
            recorded?;
            self.graph = Some(graph?);
        }
        match &self.graph {
            Some(g) => self.dev.replay(g)?,
            None => self.encode()?,
        }
        self.len += 1;
        Ok(())
    }

    /// `token` is in the vocabulary, and the next position in the position table.
    fn check_token(&self, token: u32) -> Result<()> {
        let c = &self.model.config;
        if token as usize >= c.vocab_size {
            return Err(Error::Invalid(format!(
                "token id {token} out of range (vocab {})",
                c.vocab_size
            )));
        }
        if let Positions::Learned { offset } = c.positions {
            let rows = self.model.pos_rows;
            if self.len + offset >= rows {
                return Err(Error::ContextOverflow {
                    n_tokens: self.len + 1,
                    n_ctx: rows.saturating_sub(offset),
                });
            }
        }
        Ok(())
    }

    /// Run `tokens` eagerly (not replayed), synchronizing the device at every block's end, and
    /// add each block's wall time to `times`. Slower than [`Self::forward`] by the waits; for
    /// where the time goes, not for speed.
    pub fn profile(&mut self, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        if self.len + tokens.len() > self.n_ctx {
            return Err(Error::ContextOverflow {
                n_tokens: self.len + tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        for &t in tokens {
            self.check_token(t)?;
            self.dev.set_step(t, self.len)?;
            self.dev.sync()?;
            let mut clock = Some(Clock {
                times: &mut *times,
                at: std::time::Instant::now(),
            });
            self.run_step(&mut clock)?;
            self.len += 1;
            times.steps += 1;
        }
        Ok(())
    }

    /// The verbs of one decode step (run, or recorded).
    fn encode(&mut self) -> Result<()> {
        self.run_step(&mut None)
    }

    /// The verbs of one step; with a clock, each block timed.
    fn run_step(&mut self, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let c = &m.config;
        let s = &mut self.s;
        match &m.proj_in {
            None => dev.embed(&m.token_embd, StepRow::Token, false, &mut s.x)?,
            Some(p) => {
                dev.embed(&m.token_embd, StepRow::Token, false, &mut s.e)?;
                dev.matvec(p, Rows::All, &s.e, None, &mut s.x, false)?;
            }
        }
        if let (Positions::Learned { offset }, Some(pe)) = (c.positions, &m.pos_embd) {
            dev.embed(pe, StepRow::Position { offset }, true, &mut s.x)?;
        }
        lap(clock, dev, |t| &mut t.embed)?;
        for l in 0..c.n_layers {
            self.attention(l, clock)?;
            self.mlp(l)?;
            lap(clock, dev, |t| &mut t.mlp)?;
        }
        let (m, s) = (self.model, &mut self.s);
        let head_in = match &m.output_norm {
            Some(n) => {
                norm(dev, c, n, &s.x, &mut s.h)?;
                &s.h
            }
            None => &s.x,
        };
        let head_in = match &m.proj_out {
            Some(p) => {
                dev.matvec(p, Rows::All, head_in, None, &mut s.e, false)?;
                &s.e
            }
            None => head_in,
        };
        dev.matvec(&m.output, Rows::All, head_in, None, &mut s.logits, false)?;
        lap(clock, dev, |t| &mut t.output)
    }

    /// The predictors that run at layer `l`'s attention input `s.h`: layer l's MLP, the heads
    /// of layer l + 1 (and of layer 0 at layer 0).
    fn predict(&mut self, l: usize) -> Result<()> {
        let (dev, s, p) = (self.dev, &mut self.s, &mut self.plan);
        let n = p.heads.len();
        let mut run = |pred: &Predictor<D>, sel: &mut Sel<D>| -> Result<()> {
            if let Sel::Predicted { idx, k } = sel {
                dev.matvec(&pred.w1, Rows::All, &s.h, None, &mut s.z, false)?;
                dev.matvec(&pred.w2, Rows::All, &s.z, None, &mut s.scores, false)?;
                dev.top_k(&s.scores, pred.n_out, *k, idx)?;
            }
            Ok(())
        };
        if let Some(pred) = &p.mlp_pred[l] {
            run(pred, &mut p.mlp[l])?;
        }
        let first = if l == 0 { 0 } else { l + 1 };
        for t in (first..=l + 1).filter(|&t| t < n) {
            if let Some(pred) = &p.head_pred[t] {
                run(pred, &mut p.heads[t])?;
            }
        }
        Ok(())
    }

    fn attention(&mut self, l: usize, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.config, &m.layers[l]);
        let hd = c.head_dim;
        block_input(dev, c, &lw.attn_norm, &self.s.x, &mut self.s.h)?;
        lap(clock, dev, |t| &mut t.attention)?;
        self.predict(l)?;
        lap(clock, dev, |t| &mut t.predict)?;
        let (s, heads) = (&mut self.s, &self.plan.heads[l]);
        let n_sel = heads.count(c.n_heads);
        dev.matvecs(
            &s.h,
            &mut [
                Product::new(&lw.wq, heads.rows(hd), &mut s.q).bias(lw.bq.as_ref()),
                Product::new(&lw.wk, Rows::All, &mut s.k).bias(lw.bk.as_ref()),
                Product::new(&lw.wv, Rows::All, &mut s.v).bias(lw.bv.as_ref()),
            ],
        )?;
        if let Some((theta, style)) = c.rope() {
            dev.rope(&mut s.q, n_sel, hd, theta, style)?;
            dev.rope(&mut s.k, c.n_kv_heads, hd, theta, style)?;
        }
        dev.store(&s.k, &s.v, &mut self.k[l], &mut self.v[l])?;
        let geom = AttnGeom {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            n_ctx: self.n_ctx,
        };
        dev.attention(
            &s.q,
            &self.k[l],
            &self.v[l],
            heads.rows(1),
            geom,
            &mut s.att,
        )?;
        match (heads.is_all(), &m.sparse) {
            (false, Some(sp)) => {
                dev.axpy(&sp[l].1, heads.rows(hd), &s.att, &mut s.x)?;
                if let Some(b) = &lw.bo {
                    dev.add(&mut s.x, b, c.d_model)?;
                }
            }
            _ => dev.matvec(&lw.wo, Rows::All, &s.att, lw.bo.as_ref(), &mut s.x, true)?,
        }
        post_norm(dev, c, &lw.attn_norm, &mut s.x, &mut s.h)?;
        lap(clock, dev, |t| &mut t.attention)
    }

    fn mlp(&mut self, l: usize) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw, s) = (&m.config, &m.layers[l], &mut self.s);
        let sel = &self.plan.mlp[l];
        let n = sel.count(c.n_ff);
        block_input(dev, c, &lw.ffn_norm, &s.x, &mut s.h)?;
        let act = c.mlp.activation();
        let a = match &lw.w_gate {
            Some(wg) => {
                dev.matvecs(
                    &s.h,
                    &mut [
                        Product::new(wg, sel.rows(1), &mut s.gate),
                        Product::new(&lw.w_up, sel.rows(1), &mut s.up),
                    ],
                )?;
                dev.glu(act, &mut s.gate, &s.up, n)?;
                &s.gate
            }
            None => {
                let fc1 = Product::new(&lw.w_up, sel.rows(1), &mut s.up);
                dev.matvecs(&s.h, &mut [fc1.bias(lw.b_up.as_ref()).act(act)])?;
                &s.up
            }
        };
        match (sel.is_all(), &m.sparse) {
            (false, Some(sp)) => {
                dev.axpy(&sp[l].0, sel.rows(1), a, &mut s.x)?;
                if let Some(b) = &lw.b_down {
                    dev.add(&mut s.x, b, c.d_model)?;
                }
            }
            _ => dev.matvec(&lw.w_down, Rows::All, a, lw.b_down.as_ref(), &mut s.x, true)?,
        }
        post_norm(dev, c, &lw.ffn_norm, &mut s.x, &mut s.h)
    }
}

/// The model's norm of `x` into `out`.
fn norm<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &D::Buf,
    out: &mut D::Buf,
) -> Result<()> {
    match c.norm {
        NormKind::Rms => dev.rmsnorm(x, &n.w, c.norm_eps, out)?,
        NormKind::Layer => dev.layernorm(x, &n.w, n.b.as_ref(), c.norm_eps, out)?,
    }
    Ok(())
}

/// A block's input: `norm(x)` (pre-norm) or `x`.
fn block_input<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &D::Buf,
    h: &mut D::Buf,
) -> Result<()> {
    match c.pre_norm {
        true => norm(dev, c, n, x, h),
        false => Ok(dev.copy(x, h, c.d_model)?),
    }
}

/// Post-norm models: `x = norm(x)` through `tmp` after the residual add.
fn post_norm<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &mut D::Buf,
    tmp: &mut D::Buf,
) -> Result<()> {
    if !c.pre_norm {
        norm(dev, c, n, x, tmp)?;
        dev.copy(tmp, x, c.d_model)?;
    }
    Ok(())
}

/// Weight bytes one step reads under `plan`: the dense model's, less the skipped neurons' and
/// heads' rows, plus the predictors.
fn step_bytes<D: Device>(m: &DeviceModel<D>, p: &DevicePlan<D>) -> usize {
    let c = &m.config;
    let mut bytes = m.dense_bytes;
    for (l, &(per_neuron, per_head)) in m.unit_bytes.iter().enumerate() {
        let (nm, nh) = (p.mlp[l].count(c.n_ff), p.heads[l].count(c.n_heads));
        bytes -= (c.n_ff - nm) * per_neuron + (c.n_heads - nh) * per_head;
    }
    bytes
        + (p.mlp_pred.iter().chain(&p.head_pred))
            .flatten()
            .map(|p| p.bytes)
            .sum::<usize>()
}
