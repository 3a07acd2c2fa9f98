//! The one layer loop: embedding, each layer's predictors, attention and MLP, for a step of
//! `rows` rows: a decode step (one row, under the plan: its predictors, selections and rules)
//! or a prompt's batch (every unit of every layer, each product over all rows at once through
//! [`Device::matmul`], so the weights are read once per batch); then the output head (dense or
//! contextual) of one row.
use super::inputs::Masked;
use super::rows::{keep, Kept};
use super::{collective, lap, BlockTimes, Clock, DeviceSession, Scratch};
use crate::exec::model::{DeviceModel, Layer, Norm};
use crate::exec::plan::{Computed, Predictor, Sel};
use crate::model::config::{ModelConfig, NormKind, Positions};
use crate::Result;
use dejavu_backend_api::{AttnGeom, Device, LazyKv, Product, Rows, StepRow, TopK};

/// What a pass through the layers is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// A decode step of one row, under the plan.
    Step,
    /// A prompt's batch of `rows` rows (the scratch holds them), every unit; with `steps`, each
    /// row's products as a dense decode step computes them ([`Device::matmul_steps`]: a
    /// speculative draft's verification).
    Batch { rows: usize, steps: bool },
    /// A decode step of several sequences, one row each (see `DeviceSession::step_many`):
    /// every unit, each row's products as its own decode step computes them, and the verbs
    /// that read positions or a cache (learned positions, RoPE, the K/V store, attention) run
    /// row by row against the row's own sequence.
    Seqs { rows: usize },
}

impl Pass {
    fn rows(self) -> usize {
        match self {
            Pass::Step => 1,
            Pass::Batch { rows, .. } | Pass::Seqs { rows } => rows,
        }
    }
}

/// Products of a pass's rows: a decode step's one row through [`Device::matvecs`] (selections
/// allowed), a batch's rows through [`Device::matmul`] (every row of each matrix).
pub(super) fn products<D: Device>(
    dev: &D,
    x: &D::Buf,
    pass: Pass,
    jobs: &mut [Product<'_, D>],
) -> Result<()> {
    match pass {
        Pass::Step => dev.matvecs(x, jobs)?,
        Pass::Batch { rows, steps: false } => dev.matmul(x, rows, jobs)?,
        Pass::Batch { rows, steps: true } | Pass::Seqs { rows } => {
            dev.matmul_steps(x, rows, jobs)?
        }
    }
    Ok(())
}

impl<D: Device> DeviceSession<'_, D> {
    /// The verbs of one decode step and its output head; with a clock, each block timed.
    pub(super) fn run_step(&mut self, clock: &mut Option<Clock>) -> Result<()> {
        self.layers(Pass::Step, clock)?;
        self.output(clock)?;
        lap(clock, self.dev, |t| &mut t.output)
    }

    /// The embedding and every layer of `pass`, into `s.x` (the residual of its rows).
    pub(super) fn layers(&mut self, pass: Pass, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, rows) = (&m.local, pass.rows());
        let s = &mut self.s;
        lookup(dev, m, &mut s.x, &mut s.e, rows, clock)?;
        if let Some(p) = &m.proj_in {
            products(dev, &s.e, pass, &mut [Product::new(p, Rows::All, &mut s.x)])?;
        }
        if let Some(e) = c.embed_scale {
            dev.scale_cap(&mut s.x, rows * c.d_model, e, None)?;
        }
        if let (Positions::Learned { offset }, Some(pe)) = (c.positions, &m.pos_embd) {
            // Each row at its own position (a step of several sequences: `Device::set_steps`).
            dev.embed(pe, StepRow::Position { offset }, true, &mut s.x, rows)?;
        }
        lap(clock, dev, |t| &mut t.embed)?;
        for l in 0..c.n_layers {
            self.attention(l, pass, clock)?;
            self.mlp(l, pass, clock)?;
            lap(clock, dev, |t| &mut t.mlp)?;
        }
        Ok(())
    }

    /// The predictors that run at layer `l`'s attention input `s.h` (see [`predict`]).
    fn predict(&mut self, l: usize) -> Result<()> {
        let p = &mut self.plan;
        let Scratch { h, z, scores, .. } = &mut self.s;
        let sels = (&mut p.mlp[..], &mut p.heads[..]);
        predict(self.dev, (&p.mlp_pred, &p.head_pred), sels, l, h, z, scores)
    }

    fn attention(&mut self, l: usize, pass: Pass, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.local, &m.layers[l]);
        let (hd, rows, step) = (c.head_dim, pass.rows(), pass == Pass::Step);
        block_input(dev, c, &lw.attn_norm, &self.s.x, &mut self.s.h, rows)?;
        keep(dev, m, &mut self.capture, Kept::AttnIn, l, &self.s.h, rows)?;
        let masked = self.batch_thresholds(l, step);
        if let Some(th) = masked {
            self.mask_rows(th[0], Masked::H, rows)?;
        }
        lap(clock, dev, |t| &mut t.attention)?;
        // Lookahead: the predictors on a second lane while this layer's attention (and its
        // all-reduce) runs, unless they pick this layer's own heads (layer 0) or the blocks are
        // being timed. A batch runs every unit: no predictors.
        let own_heads = l == 0 && matches!(self.plan.heads[0], Sel::Predicted { .. });
        let side = step && self.plan.lookahead && clock.is_none() && !own_heads;
        if step {
            if side {
                dev.fork()?;
            }
            self.predict(l)?;
            if side {
                dev.back()?;
            }
            lap(clock, dev, |t| &mut t.predict)?;
        }
        if let Pass::Seqs { .. } = pass {
            self.predict_by_row(l)?;
        }
        // `attn-norm`: every head's attention, then W_o over the top heads by output norm.
        let by_norm = step && self.plan.head_rule[l] == Computed::HeadNorm;
        // Input sparsity (no lazy K/V: the policy refuses both): Q, K and V from the kept
        // inputs here; the rest of the block as without.
        let th = if step { self.input_thresholds(l) } else { None };
        let (th_qkv, th_o) = (sparse_group(th, 0), sparse_group(th, 1));
        if let Some(t) = th_qkv {
            self.input_qkv(l, t, by_norm)?;
        }
        let every = Sel::All;
        let heads = if step { &self.plan.heads[l] } else { &every };
        let s = &mut self.s;
        let n_sel = heads.count(c.n_heads);
        let (q_rows, n_q, attn_rows) = match by_norm {
            true => (Rows::All, c.n_heads, Rows::All),
            false => (heads.rows(hd), n_sel, heads.rows(1)),
        };
        let q = Product::new(&lw.wq, q_rows, &mut s.q).bias(lw.bq.as_ref());
        match &mut self.lazy[l] {
            Some((inputs, valid)) => {
                // Keys and values of the selected heads only, from the kept inputs.
                dev.store_row(&s.h, inputs, rows)?;
                if n_sel > 0 {
                    products(dev, &s.h, pass, &mut [q])?;
                    head_norm(dev, c, lw.q_norm.as_ref(), &mut s.q, &mut s.att, rows * n_q)?;
                    if let Some(r) = m.rotary(l) {
                        dev.rope(&mut s.q, n_q, hd, r, rows)?;
                    }
                    let job = lazy_kv(m, l, inputs, attn_rows, rows);
                    dev.kv_fill(job, valid, &mut self.k[l], &mut self.v[l])?;
                }
            }
            None => {
                if th_qkv.is_none() {
                    let k = Product::new(&lw.wk, Rows::All, &mut s.k).bias(lw.bk.as_ref());
                    let v = Product::new(&lw.wv, Rows::All, &mut s.v).bias(lw.bv.as_ref());
                    match n_sel {
                        0 => products(dev, &s.h, pass, &mut [k, v])?,
                        _ => products(dev, &s.h, pass, &mut [q, k, v])?,
                    }
                }
                if n_sel > 0 {
                    head_norm(dev, c, lw.q_norm.as_ref(), &mut s.q, &mut s.att, rows * n_q)?;
                }
                let nk = rows * c.n_kv_heads;
                head_norm(dev, c, lw.k_norm.as_ref(), &mut s.k, &mut s.att, nk)?;
                if let Pass::Seqs { .. } = pass {
                    // RoPE, the store and attention, row by row into `s.att`.
                    let rs = &mut self.rows_seq;
                    let caches = (&mut self.k[l], &mut self.v[l]);
                    let lead = &self.plan.heads[l];
                    super::many::attend_seqs(dev, m, l, rs, s, caches, lead)?;
                } else {
                    if let Some(r) = m.rotary(l) {
                        let (nkv, (q, k)) = (c.n_kv_heads, (&mut s.q, &mut s.k));
                        dev.rope_qk(q, n_q, k, nkv, hd, r, rows)?;
                    }
                    dev.store(&s.k, &s.v, &mut self.k[l], &mut self.v[l], rows)?;
                }
            }
        }
        let s = &mut self.s;
        let geom = AttnGeom {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            n_ctx: self.n_ctx,
            rows,
            scoring: c.attn.scoring(l, hd),
        };
        let post = lw.post_attn_norm.as_ref();
        let out = residual_out(dev, m, s, pass, post.is_some())?;
        if n_sel > 0 {
            let (kc, vc) = (&self.k[l], &self.v[l]);
            if !matches!(pass, Pass::Seqs { .. }) {
                dev.attention(&s.q, kc, vc, attn_rows, geom, &mut s.att)?;
            }
            if !step {
                keep(dev, m, &mut self.capture, Kept::HeadNorms, l, &s.att, rows)?;
            }
            let gathered = match (by_norm, &mut self.plan.heads[l]) {
                (true, Sel::Predicted { idx, k }) => {
                    dev.group_norms(&s.att, c.n_heads, hd, &mut s.score)?;
                    dev.top_k(&s.score, c.n_heads, *k, idx)?;
                    dev.gather(&s.att, idx, *k, hd, &mut s.full)?;
                    true
                }
                _ => false,
            };
            match th_o {
                Some(t) => {
                    let n = self.plan.heads[l].count(c.n_heads) * hd;
                    self.input_wo(l, t, gathered, n, out)?;
                }
                None => {
                    if let Some(th) = masked {
                        self.mask_rows(th[1], Masked::Att, rows)?;
                    }
                    let s = &mut self.s;
                    let att = if gathered { &s.full } else { &s.att };
                    let heads = if step { &self.plan.heads[l] } else { &every };
                    let y = if out { &mut s.part } else { &mut s.x };
                    match (heads.is_all(), &m.sparse) {
                        (false, Some(sp)) => {
                            dev.axpy(&sp[l].1, heads.rows(hd), att, lw.bo.as_ref(), y)?;
                        }
                        _ => row_parallel(dev, &lw.wo, lw.bo.as_ref(), att, y, out, pass)?,
                    }
                }
            }
        } else if let Some(b) = &lw.bo {
            dev.add(if out { &mut s.part } else { &mut s.x }, b, c.d_model)?;
        }
        let s = &mut self.s;
        reduce_residual(
            dev,
            m,
            s,
            rows,
            clock,
            |t| &mut t.attention,
            out && post.is_none(),
        )?;
        // The predictors read `s.h` and write the MLP's selection: done before either changes.
        if side {
            dev.join()?;
        }
        add_normed(dev, c, post, s, rows)?;
        post_norm(dev, c, &lw.attn_norm, &mut s.x, &mut s.h, rows)?;
        lap(clock, dev, |t| &mut t.attention)
    }

    fn mlp(&mut self, l: usize, pass: Pass, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.local, &m.layers[l]);
        let (rows, step) = (pass.rows(), pass == Pass::Step);
        block_input(dev, c, &lw.ffn_norm, &self.s.x, &mut self.s.h, rows)?;
        keep(dev, m, &mut self.capture, Kept::MlpIn, l, &self.s.h, rows)?;
        let post = lw.post_ffn_norm.as_ref();
        let out = residual_out(dev, m, &mut self.s, pass, post.is_some())?;
        let th = step.then(|| self.input_thresholds(l)).flatten();
        let (t_in, t_down) = (sparse_group(th, 2), sparse_group(th, 3));
        if t_in.is_some() || t_down.is_some() {
            self.input_mlp(l, t_in, t_down, out)?;
            return mlp_out(dev, m, lw, &mut self.s, rows, clock, out);
        }
        if let Some(th) = self.batch_thresholds(l, step) {
            self.mask_rows(th[2], Masked::H, rows)?;
            let gated = first_projections(dev, c, lw, Rows::All, c.n_ff, pass, &mut self.s)?;
            self.mask_rows(th[3], Masked::Act { gated }, rows)?;
            let s = &mut self.s;
            let a = if gated { &s.gate } else { &s.up };
            let y = if out { &mut s.part } else { &mut s.x };
            row_parallel(dev, &lw.w_down, lw.b_down.as_ref(), a, y, out, pass)?;
            return mlp_out(dev, m, lw, s, rows, clock, out);
        }
        if let Pass::Seqs { .. } = pass {
            if let Some(u) = self.mlp_union(l)? {
                return self.mlp_over_union(l, u, pass, out, clock);
            }
        }
        let s = &mut self.s;
        let mut every = Sel::All;
        let n = if step {
            self.plan.mlp[l].count(c.n_ff)
        } else {
            c.n_ff
        };
        if n == 0 {
            if let Some(b) = &lw.b_down {
                dev.add(if out { &mut s.part } else { &mut s.x }, b, c.d_model)?;
            }
            return mlp_out(dev, m, lw, s, rows, clock, out);
        }
        let act = c.mlp.activation();
        let rule = if step {
            self.plan.mlp_rule[l]
        } else {
            Computed::Given
        };
        let sel = if step {
            &mut self.plan.mlp[l]
        } else {
            &mut every
        };
        let a = match (rule, sel, &lw.w_gate) {
            // The first projection in full, the top-k by magnitude, the other over those.
            (Computed::Gate | Computed::Up, Sel::Predicted { idx, k }, Some(wg)) => {
                let (k, n_ff) = (*k, c.n_ff);
                let (first, other) = match rule {
                    Computed::Gate => (wg, &lw.w_up),
                    _ => (&lw.w_up, wg),
                };
                dev.matvec(first, Rows::All, &s.h, None, &mut s.full, false)?;
                dev.copy(&s.full, &mut s.score, n_ff)?;
                if rule == Computed::Gate {
                    dev.activate(act, &mut s.score, n_ff)?;
                }
                dev.abs(&mut s.score, n_ff)?;
                dev.top_k(&s.score, n_ff, k, idx)?;
                let rows = Rows::Sel {
                    idx,
                    count: k,
                    group: 1,
                };
                let (kept, rest) = match rule {
                    Computed::Gate => (&mut s.gate, &mut s.up),
                    _ => (&mut s.up, &mut s.gate),
                };
                dev.gather(&s.full, idx, k, 1, kept)?;
                dev.matvec(other, rows, &s.h, None, rest, false)?;
                dev.glu(act, &mut s.gate, &s.up, k)?;
                &s.gate
            }
            // Every activation, then the top-k of them by magnitude, kept compact.
            (Computed::Oracle, Sel::Predicted { idx, k }, _) => {
                let a = first_projections(dev, c, lw, Rows::All, c.n_ff, pass, s)?;
                let a = if a { &s.gate } else { &s.up };
                dev.copy(a, &mut s.score, c.n_ff)?;
                dev.abs(&mut s.score, c.n_ff)?;
                dev.top_k(&s.score, c.n_ff, *k, idx)?;
                dev.gather(a, idx, *k, 1, &mut s.full)?;
                &s.full
            }
            (_, sel, _) => {
                let a = first_projections(dev, c, lw, sel.rows(1), n, pass, s)?;
                let a = if a { &s.gate } else { &s.up };
                if matches!(rule, Computed::Nonzero { .. }) && self.measure {
                    dev.count_nonzero(a, n, 1, &mut s.nonzero, l)?;
                }
                a
            }
        };
        let sel = if step { &self.plan.mlp[l] } else { &every };
        let y = if out { &mut s.part } else { &mut s.x };
        let skips_zeros = matches!(rule, Computed::Nonzero { .. });
        match (sel.is_all() && !skips_zeros, &m.sparse) {
            // A selection, or every neuron of which the zero ones go unread.
            (false, Some(sp)) => {
                dev.axpy(&sp[l].0, sel.rows(1), a, lw.b_down.as_ref(), y)?;
            }
            _ => row_parallel(dev, &lw.w_down, lw.b_down.as_ref(), a, y, out, pass)?,
        }
        mlp_out(dev, m, lw, s, rows, clock, out)
    }
}

/// The layers whose heads the predictors at layer `l` select: the next layer's (and layer 0's
/// own at layer 0).
pub(super) fn heads_predicted_at(l: usize) -> std::ops::RangeInclusive<usize> {
    (if l == 0 { 0 } else { l + 1 })..=l + 1
}

/// Per layer, its predictor (if any).
type Predictors<'a, D> = &'a [Option<Predictor<D>>];

/// A predictor, the list its top-k goes to, and its `k`.
pub(super) type Run<'p, 's, D> = (&'p Predictor<D>, &'s mut <D as Device>::Idx, usize);

/// The predictors that run at layer `l`, each with the selection it writes among `sels`
/// (`(mlp, heads)`, per layer), in launch order: layer l's MLP's, then the heads' of
/// [`heads_predicted_at`]`(l)`; only selections a predictor chooses (`Sel::Predicted`).
pub(super) fn predicted_runs<'p, 's, D: Device>(
    (mlp_pred, head_pred): (Predictors<'p, D>, Predictors<'p, D>),
    (mlp, heads): (&'s mut [Sel<D>], &'s mut [Sel<D>]),
    l: usize,
) -> Vec<Run<'p, 's, D>> {
    let mut runs = Vec::new();
    if let (Some(pred), Sel::Predicted { idx, k }) = (&mlp_pred[l], &mut mlp[l]) {
        runs.push((pred, idx, *k));
    }
    let both = head_pred.iter().zip(heads.iter_mut()).enumerate();
    for (_, (pred, sel)) in both.filter(|(t, _)| heads_predicted_at(l).contains(t)) {
        if let (Some(pred), Sel::Predicted { idx, k }) = (pred, sel) {
            runs.push((pred, idx, *k));
        }
    }
    runs
}

/// The predictors that run at layer `l`'s attention input `h` (one row): layer l's MLP, the
/// heads of layer l + 1 (and of layer 0 at layer 0); each of their layers, and their top-k, in
/// one launch; each writes its selection in `sels` (`(mlp, heads)`, per layer).
pub(super) fn predict<D: Device>(
    dev: &D,
    (mlp_pred, head_pred): (Predictors<'_, D>, Predictors<'_, D>),
    (mlp, heads): (&mut [Sel<D>], &mut [Sel<D>]),
    l: usize,
    h: &D::Buf,
    z: &mut [D::Buf; 3],
    scores: &mut [D::Buf; 3],
) -> Result<()> {
    let runs = predicted_runs((mlp_pred, head_pred), (mlp, heads), l);
    if runs.is_empty() {
        return Ok(());
    }
    let mut w1: Vec<Product<D>> = (runs.iter().zip(z.iter_mut()))
        .map(|((pred, ..), z)| Product::new(&pred.w1, Rows::All, z))
        .collect();
    dev.matvecs(h, &mut w1)?;
    let mut w2: Vec<Product<D>> = (runs.iter().zip(z.iter()).zip(scores.iter_mut()))
        .map(|(((pred, ..), z), sc)| Product::new(&pred.w2, Rows::All, sc).input(z))
        .collect();
    dev.matvecs(h, &mut w2)?;
    let mut top: Vec<TopK<D>> = (runs.into_iter().zip(scores.iter()))
        .map(|((pred, out, k), scores)| TopK {
            scores,
            row: 0,
            n: pred.n_out,
            k,
            out,
        })
        .collect();
    dev.top_ks(&mut top)?;
    Ok(())
}

impl<D: Device> DeviceSession<'_, D> {
    /// Layer `l`'s MLP of a step of several sequences over the union of their `u` neurons (in
    /// `union_idx`): the first projections over it for every row, then the down projection
    /// over the same rows of the neuron-major layout; the output into the residual.
    fn mlp_over_union(
        &mut self,
        l: usize,
        u: usize,
        pass: Pass,
        out: bool,
        clock: &mut Option<Clock>,
    ) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw, rows) = (&m.local, &m.layers[l], pass.rows());
        let (Some(sp), Some(idx)) = (&m.sparse, &self.union_idx) else {
            return Err(crate::Error::Invalid(
                "a batch's selected neurons need the model's sparse layout".into(),
            ));
        };
        let sel = Rows::Sel {
            idx,
            count: u,
            group: 1,
        };
        let s = &mut self.s;
        if out {
            dev.clear(&mut [(&mut s.part, rows * c.d_model)])?;
        }
        let gated = u > 0 && first_projections(dev, c, lw, sel, u, pass, s)?;
        let a = if gated { &s.gate } else { &s.up };
        let y = if out { &mut s.part } else { &mut s.x };
        dev.axpy_steps(&sp[l].0, sel, a, rows, lw.b_down.as_ref(), y)?;
        mlp_out(dev, m, lw, s, rows, clock, out)
    }
}

/// The MLP's output (in `s.part` when `out`) into the residual: summed over the ranks, normed
/// (Gemma), added; then a post-LN model's norm.
fn mlp_out<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    lw: &Layer<D>,
    s: &mut Scratch<D>,
    rows: usize,
    clock: &mut Option<Clock>,
    out: bool,
) -> Result<()> {
    let (c, post) = (&m.local, lw.post_ffn_norm.as_ref());
    let add = out && post.is_none();
    reduce_residual(dev, m, s, rows, clock, |t| &mut t.mlp, add)?;
    add_normed(dev, c, post, s, rows)?;
    post_norm(dev, c, &lw.ffn_norm, &mut s.x, &mut s.h, rows)
}

/// Each of `n` heads of `x` (`head_dim` wide) RMS-normed with the gains `w` (qwen3's Q and K
/// norms), through `tmp` (free until attention writes it); nothing without gains.
fn head_norm<D: Device>(
    dev: &D,
    c: &ModelConfig,
    w: Option<&D::Buf>,
    x: &mut D::Buf,
    tmp: &mut D::Buf,
    n: usize,
) -> Result<()> {
    let Some(w) = w else { return Ok(()) };
    dev.rmsnorm(x, w, c.norm_eps, tmp, n)?;
    Ok(dev.copy(tmp, x, n * c.head_dim)?)
}

/// A row-parallel product (W_o, fc2) of `input`'s rows added to the residual `y` (`out`: to a
/// tensor-parallel partial, which a decode step zeroed and a batch overwrites).
/// Group `g`'s threshold of a layer's input thresholds when the group is sparse: a group the
/// plan keeps whole (threshold below 0: sparsity 0, as TEAL's allocation gives the attention
/// at low model-wide sparsity) runs the dense products over the file's rows, which read the
/// same bytes faster than the input-major kernels, with no `sparsify`.
fn sparse_group(th: Option<[f32; 4]>, g: usize) -> Option<f32> {
    th.map(|t| t[g]).filter(|&t| t >= 0.0)
}

pub(super) fn row_parallel<D: Device>(
    dev: &D,
    w: &D::Mat,
    bias: Option<&D::Buf>,
    input: &D::Buf,
    y: &mut D::Buf,
    out: bool,
    pass: Pass,
) -> Result<()> {
    let p = Product::new(w, Rows::All, y).bias(bias);
    let p = if out && pass != Pass::Step {
        p
    } else {
        p.accumulate()
    };
    products(dev, input, pass, &mut [p])
}

/// The MLP's first projections of `s.h` over `rows` (`n` outputs a row), for each row of the
/// pass: `act(gate) * up` into `s.gate` (returns `true`), or `act(fc1 + b)` into `s.up`
/// (`false`).
pub(super) fn first_projections<D: Device>(
    dev: &D,
    c: &ModelConfig,
    lw: &Layer<D>,
    rows: Rows<'_, D::Idx>,
    n: usize,
    pass: Pass,
    s: &mut Scratch<D>,
) -> Result<bool> {
    let act = c.mlp.activation();
    match &lw.w_gate {
        Some(wg) => {
            let gate = Product::new(wg, rows, &mut s.gate);
            let up = Product::new(&lw.w_up, rows, &mut s.up);
            products(dev, &s.h, pass, &mut [gate, up])?;
            dev.glu(act, &mut s.gate, &s.up, pass.rows() * n)?;
            Ok(true)
        }
        None => {
            let fc1 = Product::new(&lw.w_up, rows, &mut s.up);
            products(dev, &s.h, pass, &mut [fc1.bias(lw.b_up.as_ref()).act(act)])?;
            Ok(false)
        }
    }
}

/// Where a row-parallel product (W_o, fc2) adds its output: the residual `s.x` itself on a
/// whole model without a norm of the block's output (`false`); else (under tensor parallelism,
/// or `post`: Gemma's norm of the block's output) the partial `s.part` (`true`), which a decode
/// step zeroes here (its sparse products add to it) and a batch overwrites.
fn residual_out<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    s: &mut Scratch<D>,
    pass: Pass,
    post: bool,
) -> Result<bool> {
    if m.shard.is_whole() && !post {
        return Ok(false);
    }
    if pass == Pass::Step {
        dev.clear(&mut [(&mut s.part, m.local.d_model)])?;
    }
    Ok(true)
}

/// Under tensor parallelism: the ranks' partials of `rows` rows summed (the all-reduce timed on
/// its own when the blocks are, after the block `before`); then, if `add`, added to the
/// residual.
fn reduce_residual<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    s: &mut Scratch<D>,
    rows: usize,
    clock: &mut Option<Clock>,
    before: fn(&mut BlockTimes) -> &mut f64,
    add: bool,
) -> Result<()> {
    let n = rows * m.local.d_model;
    if !m.shard.is_whole() {
        collective(clock, dev, before, || Ok(dev.all_reduce(&mut s.part, n)?))?;
    }
    if add {
        dev.add(&mut s.x, &s.part, n)?;
    }
    Ok(())
}

/// Gemma: the block's (summed) output `s.part` normed with `post` into `s.h`, then added to
/// the residual; nothing without `post`. `s.h` must be free (the block input is done with).
fn add_normed<D: Device>(
    dev: &D,
    c: &ModelConfig,
    post: Option<&Norm<D>>,
    s: &mut Scratch<D>,
    rows: usize,
) -> Result<()> {
    if let Some(n) = post {
        norm(dev, c, n, &s.part, &mut s.h, rows)?;
        dev.add(&mut s.x, &s.h, rows * c.d_model)?;
    }
    Ok(())
}

/// The token embeddings of the batch's `rows` rows into `x`, or into `e` when the model
/// projects them (`proj_in`, the caller's to apply). Under tensor parallelism each rank looks
/// up its vocabulary rows (zeros for the other tokens) and the world sums them into the row.
pub(super) fn lookup<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    x: &mut D::Buf,
    e: &mut D::Buf,
    rows: usize,
    clock: &mut Option<Clock>,
) -> Result<()> {
    let c = &m.local;
    let (out, width) = match m.proj_in {
        None => (x, c.d_model),
        Some(_) => (e, c.d_embed),
    };
    let token = StepRow::Token {
        first: m.shard.vocab(c.vocab_size).start,
    };
    dev.embed(&m.token_embd, token, false, out, rows)?;
    collective(
        clock,
        dev,
        |t| &mut t.embed,
        || Ok(dev.all_reduce(out, rows * width)?),
    )
}

/// Layer `l`'s lazy K/V fill of `heads` from the kept `inputs`, through a batch of `rows`.
pub(super) fn lazy_kv<'a, D: Device>(
    m: &'a DeviceModel<D>,
    l: usize,
    inputs: &'a D::Cache,
    heads: Rows<'a, D::Idx>,
    rows: usize,
) -> LazyKv<'a, D> {
    let lw = &m.layers[l];
    LazyKv {
        wk: &lw.wk,
        wv: &lw.wv,
        bk: lw.bk.as_ref(),
        bv: lw.bv.as_ref(),
        inputs,
        heads,
        head_dim: m.local.head_dim,
        rope: m.rotary(l),
        rows,
    }
}

/// The model's norm of each of `rows` rows of `x` into `out`.
pub(super) fn norm<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &D::Buf,
    out: &mut D::Buf,
    rows: usize,
) -> Result<()> {
    match c.norm {
        NormKind::Rms => dev.rmsnorm(x, &n.w, c.norm_eps, out, rows)?,
        NormKind::Layer => dev.layernorm(x, &n.w, n.b.as_ref(), c.norm_eps, out, rows)?,
    }
    Ok(())
}

/// A block's input: `norm(x)` (pre-norm) or `x`, for `rows` rows.
pub(super) fn block_input<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &D::Buf,
    h: &mut D::Buf,
    rows: usize,
) -> Result<()> {
    match c.pre_norm {
        true => norm(dev, c, n, x, h, rows),
        false => Ok(dev.copy(x, h, rows * c.d_model)?),
    }
}

/// Post-norm models: `x = norm(x)` through `tmp` after the residual add, for `rows` rows.
pub(super) fn post_norm<D: Device>(
    dev: &D,
    c: &ModelConfig,
    n: &Norm<D>,
    x: &mut D::Buf,
    tmp: &mut D::Buf,
    rows: usize,
) -> Result<()> {
    if !c.pre_norm {
        norm(dev, c, n, x, tmp, rows)?;
        dev.copy(tmp, x, rows * c.d_model)?;
    }
    Ok(())
}
