//! A prompt's batch: up to [`MAX_ROWS`] tokens through the same layer verbs at once, each
//! product over every row at once ([`Device::matmul`]), so the weights are read once per batch
//! rather than once per token.
//!
//! A batch runs every neuron and head: a policy selects per token, at decode steps. A fixed
//! sparse plan runs its prompt token by token. Layers under lazy K/V keep the batch's inputs and
//! fill every head's keys and values from them, those a head missed before the batch included.
use super::rows::{Kept, Want};
use super::step::{block_input, lazy_kv, lookup, post_norm};
use super::DeviceSession;
use crate::exec::model::DeviceModel;
use crate::exec::plan::Sel;
use crate::model::config::Positions;
use crate::Result;
use dejavu_backend_api::{AttnGeom, Device, Product, Rows, StepRow, MAX_ROWS};

/// The activations of a batch of up to `rows` rows (row `r` of each at `r * width`).
pub(super) struct BatchScratch<D: Device> {
    pub(super) rows: usize,
    pub(super) x: D::Buf,
    pub(super) h: D::Buf,
    pub(super) e: D::Buf,
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    att: D::Buf,
    gate: D::Buf,
    up: D::Buf,
    /// Under tensor parallelism, a row-parallel product's partial output (one value else).
    part: D::Buf,
}

impl<D: Device> BatchScratch<D> {
    /// Room for batches of `min(MAX_ROWS, n_ctx)` rows.
    pub(super) fn new(dev: &D, m: &DeviceModel<D>, n_ctx: usize) -> Result<Self> {
        let c = &m.local;
        let rows = MAX_ROWS.min(n_ctx).max(1);
        let z = |w: usize| dev.zeros(rows * w);
        Ok(Self {
            rows,
            x: z(c.d_model)?,
            h: z(c.d_model)?,
            e: z(c.d_embed)?,
            q: z(c.n_heads * c.head_dim)?,
            k: z(c.kv_dim())?,
            v: z(c.kv_dim())?,
            att: z(c.n_heads * c.head_dim)?,
            gate: z(if c.mlp.gated() { c.n_ff } else { 1 })?,
            up: z(c.n_ff)?,
            part: match m.shard.is_whole() {
                true => dev.zeros(1)?,
                false => z(c.d_model)?,
            },
        })
    }
}

impl<D: Device> DeviceSession<'_, D> {
    /// Can the prompt run in batches? Every selection is every unit or predicted per token (a
    /// batch then runs every unit); a fixed sparse selection runs token by token.
    pub(super) fn batchable(&self) -> bool {
        let free = |s: &Sel<D>| !matches!(s, Sel::Fixed { .. });
        self.plan.mlp.iter().chain(&self.plan.heads).all(free)
    }

    /// `tokens` (1 to the scratch's rows) at the next positions as one batch, handing back what
    /// `want` names of it.
    pub(super) fn run_batch(
        &mut self,
        b: &mut BatchScratch<D>,
        tokens: &[u32],
        want: Want,
    ) -> Result<()> {
        let (dev, m, n) = (self.dev, self.model, tokens.len());
        let c = &m.local;
        dev.set_step(tokens, self.len)?;
        lookup(dev, m, &mut b.x, &mut b.e, n, &mut None)?;
        if let Some(p) = &m.proj_in {
            dev.matmul(&b.e, n, &mut [Product::new(p, Rows::All, &mut b.x)])?;
        }
        if let (Positions::Learned { offset }, Some(pe)) = (c.positions, &m.pos_embd) {
            dev.embed(pe, StepRow::Position { offset }, true, &mut b.x, n)?;
        }
        for l in 0..c.n_layers {
            self.batch_attention(b, l, n)?;
            self.batch_mlp(b, l, n)?;
        }
        match want {
            Want::Nothing => Ok(()),
            Want::Last => {
                dev.take_rows(&b.x, n - 1, 1, c.d_model, &mut self.s.x)?;
                self.output(&mut None)
            }
            Want::Rows { rows, hidden } => self.batch_rows(b, rows, hidden),
        }
    }

    fn batch_attention(&mut self, b: &mut BatchScratch<D>, l: usize, n: usize) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw, hd) = (&m.local, &m.layers[l], m.local.head_dim);
        block_input(dev, c, &lw.attn_norm, &b.x, &mut b.h, n)?;
        self.keep(Kept::AttnIn, l, &b.h, n)?;
        let q = Product::new(&lw.wq, Rows::All, &mut b.q).bias(lw.bq.as_ref());
        match &mut self.lazy[l] {
            Some((inputs, valid)) => {
                dev.store_row(&b.h, inputs, n)?;
                dev.matmul(&b.h, n, &mut [q])?;
                if let Some((theta, style)) = c.rope() {
                    dev.rope(&mut b.q, c.n_heads, hd, theta, style, n)?;
                }
                let job = lazy_kv(c, lw, inputs, Rows::All, n);
                dev.kv_fill(job, valid, &mut self.k[l], &mut self.v[l])?;
            }
            None => {
                let k = Product::new(&lw.wk, Rows::All, &mut b.k).bias(lw.bk.as_ref());
                let v = Product::new(&lw.wv, Rows::All, &mut b.v).bias(lw.bv.as_ref());
                dev.matmul(&b.h, n, &mut [q, k, v])?;
                if let Some((theta, style)) = c.rope() {
                    let (nh, nkv) = (c.n_heads, c.n_kv_heads);
                    dev.rope_qk(&mut b.q, nh, &mut b.k, nkv, hd, theta, style, n)?;
                }
                dev.store(&b.k, &b.v, &mut self.k[l], &mut self.v[l], n)?;
            }
        }
        let geom = AttnGeom {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            n_ctx: self.n_ctx,
            rows: n,
        };
        let (kc, vc) = (&self.k[l], &self.v[l]);
        dev.attention(&b.q, kc, vc, Rows::All, geom, &mut b.att)?;
        self.keep(Kept::HeadNorms, l, &b.att, n)?;
        let (wo, bo) = (&lw.wo, lw.bo.as_ref());
        add_row_parallel(dev, m, wo, bo, &b.att, &mut b.x, &mut b.part, n)?;
        post_norm(dev, c, &lw.attn_norm, &mut b.x, &mut b.h, n)
    }

    fn batch_mlp(&mut self, b: &mut BatchScratch<D>, l: usize, n: usize) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let (c, lw) = (&m.local, &m.layers[l]);
        block_input(dev, c, &lw.ffn_norm, &b.x, &mut b.h, n)?;
        self.keep(Kept::MlpIn, l, &b.h, n)?;
        let act = c.mlp.activation();
        let a = match &lw.w_gate {
            Some(wg) => {
                let gate = Product::new(wg, Rows::All, &mut b.gate);
                let up = Product::new(&lw.w_up, Rows::All, &mut b.up);
                dev.matmul(&b.h, n, &mut [gate, up])?;
                dev.glu(act, &mut b.gate, &b.up, n * c.n_ff)?;
                &b.gate
            }
            None => {
                let fc1 = Product::new(&lw.w_up, Rows::All, &mut b.up).bias(lw.b_up.as_ref());
                dev.matmul(&b.h, n, &mut [fc1.act(act)])?;
                &b.up
            }
        };
        let (wd, bd) = (&lw.w_down, lw.b_down.as_ref());
        add_row_parallel(dev, m, wd, bd, a, &mut b.x, &mut b.part, n)?;
        post_norm(dev, c, &lw.ffn_norm, &mut b.x, &mut b.h, n)
    }
}

/// A row-parallel product (W_o, fc2) of `rows` rows of `input`, added to the residual `x`:
/// straight in on a whole model; under tensor parallelism into `part`, summed over the ranks,
/// then added.
#[allow(clippy::too_many_arguments)]
fn add_row_parallel<D: Device>(
    dev: &D,
    m: &DeviceModel<D>,
    w: &D::Mat,
    bias: Option<&D::Buf>,
    input: &D::Buf,
    x: &mut D::Buf,
    part: &mut D::Buf,
    rows: usize,
) -> Result<()> {
    if m.shard.is_whole() {
        let p = Product::new(w, Rows::All, x).bias(bias).accumulate();
        return Ok(dev.matmul(input, rows, &mut [p])?);
    }
    dev.matmul(
        input,
        rows,
        &mut [Product::new(w, Rows::All, part).bias(bias)],
    )?;
    let n = rows * m.local.d_model;
    dev.all_reduce(part, n)?;
    Ok(dev.add(x, part, n)?)
}
