//! A decode step of several sequences (continuous batching): one row per sequence, each at its
//! own position over its own KV cache, in one pass through the layer loop ([`Pass::Seqs`]).
//! The products run over every row at once, so each weight is read once for the whole step
//! ([`Device::matmul_steps`]: on the CPU each row's outputs are bit for bit those of its own
//! decode step, whatever else is in the batch); the verbs that read a position or a cache
//! (RoPE, the K/V store, attention) run each row against its own sequence: in one call where
//! the device has [`Device::attend_rows`] (the CPU's tiers: one pool dispatch of every row's
//! heads), else row by row, the step set to that row's token and position
//! ([`Device::set_step`]). Learned positions are looked up for every row at once, each at its
//! own ([`Device::set_steps`]).
//!
//! A device that records steps (CUDA graphs) records a step of several sequences too, once per
//! leader and row count, where the plan selects nothing per step (every unit of every layer):
//! the rows' caches, positions and contexts are written before each replay
//! ([`Device::set_seq_rows`]), so the recorded launches read them on the device.
//!
//! The first sequence leads: its scratch holds the batch's rows and runs the pass; the others
//! lend it their caches and their selections for the step ([`RowSeq`]) and get them back after
//! it, failed or not.
//!
//! Under a sparse plan (the Deja Vu predictors, or fixed sets) each row selects for its own
//! sequence: its predictors run on its own row, and its attention runs over its own heads (the
//! other heads' outputs zero, W_o over every head). The MLP runs over the union of the rows'
//! neurons (the paper's Fig. 8: the union of a small batch stays sparse), so a row computes at
//! least the neurons its own step would.
use super::step::{predicted_runs, Pass};
use super::DeviceSession;
use crate::exec::plan::{Computed, Predictor, Sel};
use crate::{Error, Result};
use dejavu_backend_api::{
    AttnGeom, BackendError, Device, Product, Rows, SeqRow, SeqRows, TopK, MAX_ROWS,
};

/// One row of a step of several sequences: its token, its sequence's length and context, and
/// (but for the leader's own row 0) the caches that sequence lent and one row of scratch.
pub(super) struct RowSeq<D: Device> {
    token: u32,
    len: usize,
    n_ctx: usize,
    lent: Option<Lent<D>>,
}

/// A sequence's caches and selections, lent to the leader for one step, and the leader's
/// scratch for its row.
pub(super) struct Lent<D: Device> {
    k: Vec<D::Cache>,
    v: Vec<D::Cache>,
    mlp: Vec<Sel<D>>,
    heads: Vec<Sel<D>>,
    row: RowScratch<D>,
}

/// One row's `q`, `k`, `v` and attention output.
pub(super) struct RowScratch<D: Device> {
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    att: D::Buf,
}

impl<'a, D: Device> DeviceSession<'a, D> {
    /// Can this sequence's steps join a batch of several? Its plan selects with its predictors
    /// or fixed sets (or runs every unit; `relu-exact` computes every neuron), with neither
    /// the rules that select from a layer's own activations, nor input sparsity, lazy K/V or
    /// the contextual head; and nothing records or changes its batches.
    pub fn batches(&self) -> bool {
        let p = &self.plan;
        let given = |r: &Computed| matches!(r, Computed::Given | Computed::Nonzero { .. });
        p.mlp_rule.iter().all(given)
            && p.head_rule.iter().all(|r| *r == Computed::Given)
            && p.inputs.is_none()
            && p.output.is_none()
            && !p.lazy_kv
            && self.model.shard.is_whole()
            && self.capture.is_none()
            && !self.mask_batches
    }

    /// One decode step of several sequences: `tokens[i]` at the next position of `seqs[i]`.
    /// Returns the logits, `[n][vocab]`. On the CPU under a dense plan, row `i` is bit for bit
    /// the logits `seqs[i].forward(&[tokens[i]])` gives (batch invariance); under a sparse one
    /// the row's MLP covers the union of the rows' neurons (its own among them). Every
    /// sequence [`batches`](Self::batches), on the same device, model and plan; a bad token or
    /// a full context is an error before any runs. One sequence is its own decode step (replayed where the
    /// device records).
    pub fn step_many(seqs: &mut [&mut Self], tokens: &[u32]) -> Result<Vec<f32>> {
        let n = seqs.len();
        if n == 0 || n != tokens.len() || n > MAX_ROWS {
            return Err(Error::Invalid(format!(
                "a step of {n} sequences with {} tokens (1 to {MAX_ROWS})",
                tokens.len()
            )));
        }
        let (dev, model) = (seqs[0].dev, seqs[0].model);
        for (s, &t) in seqs.iter().zip(tokens) {
            if !std::ptr::eq(s.dev, dev) || !std::ptr::eq(s.model, model) {
                return Err(Error::Invalid(
                    "a step of several sequences runs on one device and model".into(),
                ));
            }
            if !s.batches() {
                return Err(Error::Invalid(format!(
                    "plan `{}` does not run in a batch of sequences",
                    s.plan.name
                )));
            }
            if s.plan.name != seqs[0].plan.name {
                return Err(Error::Invalid(format!(
                    "a step of several sequences runs one plan (`{}` and `{}`)",
                    seqs[0].plan.name, s.plan.name
                )));
            }
            s.check(&[t])?;
        }
        if n == 1 {
            return Ok(seqs[0].forward(tokens)?.to_vec());
        }
        let (lead, rest) = seqs.split_first_mut().expect("n > 1");
        // Every row's scratch first: a failed allocation then takes no cache.
        while lead.spare.len() < rest.len() {
            lead.spare.push(RowScratch::new(dev, model)?);
        }
        lead.rows_seq.clear();
        lead.rows_seq.push(RowSeq {
            token: tokens[0],
            len: lead.len,
            n_ctx: lead.n_ctx,
            lent: None,
        });
        for (s, &token) in rest.iter_mut().zip(&tokens[1..]) {
            let row = lead.spare.pop().expect("allocated above");
            lead.rows_seq.push(RowSeq {
                token,
                len: s.len,
                n_ctx: s.n_ctx,
                lent: Some(Lent {
                    k: std::mem::take(&mut s.k),
                    v: std::mem::take(&mut s.v),
                    mlp: std::mem::take(&mut s.plan.mlp),
                    heads: std::mem::take(&mut s.plan.heads),
                    row,
                }),
            });
        }
        let ran = lead.run_seqs(tokens);
        // The caches go back whatever happened.
        let rows = std::mem::take(&mut lead.rows_seq);
        for (s, r) in rest.iter_mut().zip(rows.into_iter().skip(1)) {
            let lent = r.lent.expect("lent by every row but the first");
            (s.k, s.v) = (lent.k, lent.v);
            (s.plan.mlp, s.plan.heads) = (lent.mlp, lent.heads);
            lead.spare.push(lent.row);
        }
        ran?;
        seqs.iter_mut().for_each(|s| s.len += 1);
        Ok(std::mem::take(&mut seqs[0].rows_out))
    }

    /// The pass of [`Self::step_many`] over the rows lent, and every row's logits into
    /// `rows_out`: recorded once per row count and replayed where the device records and the
    /// plan selects nothing per step ([`Self::records_seqs`]), else run as it goes.
    fn run_seqs(&mut self, tokens: &[u32]) -> Result<()> {
        let (dev, n, vocab) = (self.dev, tokens.len(), self.model.local.vocab_size);
        if self.s.grow(dev, self.model, n, self.n_ctx)? {
            self.forget_graphs();
        }
        if self.seq_logits.as_ref().is_none_or(|l| l.1 < n) {
            self.seq_logits = Some((dev.zeros(n * vocab)?, n));
            self.forget_graphs(); // the recorded steps name the old logits
        }
        let positions: Vec<usize> = self.rows_seq.iter().map(|r| r.len).collect();
        dev.set_steps(tokens, &positions)?;
        let set = dev.set_seq_rows(self.model.local.n_heads, &self.seq_rows())?;
        let at = self.seq_graphs.iter().position(|g| g.0 == n);
        match (set && self.records_seqs(), at) {
            (true, Some(i)) => dev.replay(&self.seq_graphs[i].1)?,
            (true, None) if dev.begin_capture()? => {
                let recorded = self.encode_seqs(n);
                let graph = dev.end_capture();
                recorded?;
                self.seq_graphs.push((n, graph?));
                dev.replay(&self.seq_graphs.last().expect("pushed").1)?;
            }
            _ => self.encode_seqs(n)?,
        }
        self.rows_out.resize(n * vocab, 0.0);
        let (logits, _) = self.seq_logits.as_ref().expect("made above");
        Ok(dev.download(logits, &mut self.rows_out)?)
    }

    /// The verbs of a step of `n` sequences (the rows lent), their logits into `seq_logits`.
    fn encode_seqs(&mut self, n: usize) -> Result<()> {
        self.layers(Pass::Seqs { rows: n }, &mut None)?;
        let mut logits = self.seq_logits.take().expect("made by run_seqs");
        let ran = self.head_rows(0..n, true, &mut logits.0);
        self.seq_logits = Some(logits);
        ran
    }

    /// Does a step of several sequences this one leads record? Its plan selects nothing per
    /// step (every neuron and head of every layer: no predictor runs, no union is read back),
    /// and the step is not timed or captured for calibration. The rows run the leader's plan.
    fn records_seqs(&self) -> bool {
        let p = &self.plan;
        let every = |sels: &[Sel<D>]| sels.iter().all(|s| matches!(s, Sel::All));
        every(&p.mlp) && every(&p.heads) && p.mlp_pred.is_empty() && p.head_pred.is_empty()
    }

    /// Each row's caches of every layer, position, context and heads, for
    /// [`Device::set_seq_rows`] (the leader's own first).
    fn seq_rows(&self) -> Vec<SeqRows<'_, D>> {
        fn heads<D: Device>(sels: &[Sel<D>]) -> Vec<Rows<'_, D::Idx>> {
            sels.iter().map(|s| s.rows(1)).collect()
        }
        (self.rows_seq.iter())
            .map(|seq| {
                let (k, v, h) = match &seq.lent {
                    None => (&self.k[..], &self.v[..], heads(&self.plan.heads)),
                    Some(l) => (&l.k[..], &l.v[..], heads(&l.heads)),
                };
                SeqRows {
                    k,
                    v,
                    pos: seq.len,
                    n_ctx: seq.n_ctx,
                    heads: h,
                }
            })
            .collect()
    }

    /// The predictors that run at layer `l`, for every row at once: their first layers as one
    /// product of every row of `s.h`, their second layers likewise ([`Device::matmul_steps`]:
    /// on the CPU each row's scores are its own step's bit for bit), then each row's top-k
    /// into its own sequence's selections, in one call ([`TopK::row`]).
    pub(super) fn predict_by_row(&mut self, l: usize) -> Result<()> {
        let (dev, rows) = (self.dev, self.rows_seq.len());
        let p = &mut self.plan;
        let preds = (&p.mlp_pred[..], &p.head_pred[..]);
        let mut lead = Some((&mut p.mlp[..], &mut p.heads[..]));
        let mut runs = Vec::with_capacity(rows);
        for seq in self.rows_seq.iter_mut() {
            let sels = match &mut seq.lent {
                None => (lead.take()).ok_or_else(|| Error::Invalid("two leading rows".into()))?,
                Some(lent) => (&mut lent.mlp[..], &mut lent.heads[..]),
            };
            runs.push(predicted_runs(preds, sels, l));
        }
        // The rows run one plan: the same predictors, in the same order.
        let used: Vec<&Predictor<D>> = (runs.first().into_iter().flatten()).map(|r| r.0).collect();
        if used.is_empty() {
            return Ok(());
        }
        if runs.iter().any(|r| r.len() != used.len()) {
            return Err(Error::Invalid(
                "the rows of one step select with different predictors".into(),
            ));
        }
        if self.s.predictor_rows < rows {
            self.s.grow_predictors(dev, &self.model.local, rows)?;
            // The recorded steps name the old buffers.
            (self.graph, self.seq_graphs) = (None, Vec::new());
        }
        let s = &mut self.s;
        let mut w1: Vec<Product<D>> = (used.iter().zip(s.z.iter_mut()))
            .map(|(pred, z)| Product::new(&pred.w1, Rows::All, z))
            .collect();
        dev.matmul_steps(&s.h, rows, &mut w1)?;
        let mut w2: Vec<Product<D>> = (used.iter().zip(&s.z).zip(s.scores.iter_mut()))
            .map(|((pred, z), sc)| Product::new(&pred.w2, Rows::All, sc).input(z))
            .collect();
        dev.matmul_steps(&s.h, rows, &mut w2)?;
        let mut jobs = Vec::new();
        for (r, row_runs) in runs.into_iter().enumerate() {
            for ((pred, out, k), scores) in row_runs.into_iter().zip(&s.scores) {
                let n = pred.n_out;
                jobs.push(TopK {
                    scores,
                    row: r,
                    n,
                    k,
                    out,
                });
            }
        }
        Ok(dev.top_ks(&mut jobs)?)
    }

    /// The union of the rows' neurons at layer `l`'s MLP, written to `union_idx` (sorted);
    /// its size, or `None` when a row runs every neuron or the union is every neuron (the
    /// layer is dense for the batch; a whole union still counts in `union_counts`).
    /// Each row's list is read back to the host (a wait for the device, per layer).
    pub(super) fn mlp_union(&mut self, l: usize) -> Result<Option<usize>> {
        let (dev, n_ff) = (self.dev, self.model.local.n_ff);
        let mut on = vec![false; n_ff];
        let mut list = Vec::new();
        for seq in &self.rows_seq {
            let sel = match &seq.lent {
                None => &self.plan.mlp[l],
                Some(lent) => &lent.mlp[l],
            };
            let (idx, count) = match sel {
                Sel::All => return Ok(None),
                Sel::Fixed { idx, count } => (idx, *count),
                Sel::Predicted { idx, k } => (idx, *k),
            };
            list.resize(count, 0);
            if count > 0 {
                dev.download_idx(idx, &mut list)?;
            }
            for &i in &list {
                let i = i as usize;
                if i >= n_ff {
                    return Err(Error::Invalid(format!("neuron {i} of {n_ff} selected")));
                }
                on[i] = true;
            }
        }
        let union: Vec<u32> = (0..n_ff as u32).filter(|&i| on[i as usize]).collect();
        self.union_counts.0 += union.len();
        self.union_counts.1 += n_ff;
        if union.len() == n_ff {
            return Ok(None);
        }
        let idx = match &mut self.union_idx {
            Some(idx) => idx,
            None => self.union_idx.insert(dev.upload_idx(&vec![0; n_ff])?),
        };
        dev.write_idx(idx, &union)?;
        Ok(Some(union.len()))
    }

    /// Forget every position and give the caches' memory back to the system where the device
    /// can (see [`Device::release`]).
    pub fn release(&mut self) -> Result<()> {
        self.truncate(0);
        let lazy = self.lazy.iter_mut().flatten().map(|(inputs, _)| inputs);
        for c in self.k.iter_mut().chain(self.v.iter_mut()).chain(lazy) {
            self.dev.release(c)?;
        }
        Ok(())
    }

    /// The MLP unions the steps of several sequences this one led computed since the last
    /// call: their neurons, and those of their layers (a layer no row selected in is not
    /// counted).
    pub fn take_union_counts(&mut self) -> (usize, usize) {
        std::mem::take(&mut self.union_counts)
    }
}

fn restore_step<D: Device>(dev: &D, rows: &[RowSeq<D>]) -> Result<()> {
    let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
    let positions: Vec<usize> = rows.iter().map(|r| r.len).collect();
    Ok(dev.set_steps(&tokens, &positions)?)
}

/// Layer `l`'s RoPE, K/V store and attention of every row against its own sequence (see
/// [`attend_by_row`]): in one call where the device has it ([`Device::attend_rows`]), else row
/// by row.
pub(super) fn attend_seqs<D: Device>(
    dev: &D,
    m: &crate::exec::DeviceModel<D>,
    l: usize,
    rows: &mut [RowSeq<D>],
    s: &mut super::Scratch<D>,
    (kc, vc): (&mut D::Cache, &mut D::Cache),
    lead: &Sel<D>,
) -> Result<()> {
    let c = &m.local;
    let geom = AttnGeom {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        n_ctx: 0,
        rows: rows.len(),
        scoring: c.attn.scoring(l, c.head_dim),
    };
    let mut own = Some((&mut *kc, &mut *vc));
    let mut seq_rows = Vec::with_capacity(rows.len());
    for seq in rows.iter_mut() {
        let (k, v, heads) = match &mut seq.lent {
            None => {
                let lost = || Error::Invalid("two rows without their own caches".into());
                let (k, v) = own.take().ok_or_else(lost)?;
                (k, v, lead.rows(1))
            }
            Some(lent) => (&mut lent.k[l], &mut lent.v[l], lent.heads[l].rows(1)),
        };
        seq_rows.push(SeqRow {
            k,
            v,
            pos: seq.len,
            n_ctx: seq.n_ctx,
            heads,
        });
    }
    let (q, k, v, att) = (&mut s.q, &mut s.k, &s.v, &mut s.att);
    match dev.attend_rows(q, k, v, m.rotary(l), geom, l, &mut seq_rows, att) {
        Ok(()) => Ok(()),
        Err(BackendError::Unsupported { .. }) => {
            drop(seq_rows);
            attend_by_row(dev, m, l, rows, s, (kc, vc), lead)
        }
        Err(e) => Err(e.into()),
    }
}

/// Layer `l`'s RoPE, K/V store and attention, row by row: each row's queries, keys and values
/// (in `s.q`, `s.k`, `s.v`, every head) at its sequence's position, against its sequence's
/// cache (the leader's own are `kc`, `vc`), over its sequence's heads (the leader's `lead`),
/// into its row of `s.att` (every head; zeros for the heads a row did not select).
pub(super) fn attend_by_row<D: Device>(
    dev: &D,
    m: &crate::exec::DeviceModel<D>,
    l: usize,
    rows: &mut [RowSeq<D>],
    s: &mut super::Scratch<D>,
    (kc, vc): (&mut D::Cache, &mut D::Cache),
    lead: &Sel<D>,
) -> Result<()> {
    let c = &m.local;
    let (hd, nq, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
    let (qd, kvd) = (nq * hd, c.kv_dim());
    let one = |seq: &RowSeq<D>, q: &mut D::Buf, k: &mut D::Buf| {
        dev.set_step(&[seq.token], seq.len)?;
        if let Some(rot) = m.rotary(l) {
            dev.rope_qk(q, nq, k, nkv, hd, rot, 1)?;
        }
        Ok::<_, Error>(AttnGeom {
            n_heads: nq,
            n_kv_heads: nkv,
            head_dim: hd,
            n_ctx: seq.n_ctx,
            rows: 1,
            scoring: c.attn.scoring(l, hd),
        })
    };
    for (r, seq) in rows.iter_mut().enumerate() {
        match seq.lent.take() {
            // The leader's row 0 in place.
            None => {
                let geom = one(seq, &mut s.q, &mut s.k)?;
                dev.store(&s.k, &s.v, kc, vc, 1)?;
                attend_one(dev, lead, &mut s.q, (kc, vc), geom, &mut s.att, hd)?;
            }
            Some(mut lent) => {
                let row = &mut lent.row;
                dev.take_rows(&s.q, r, 1, qd, &mut row.q)?;
                dev.take_rows(&s.k, r, 1, kvd, &mut row.k)?;
                dev.take_rows(&s.v, r, 1, kvd, &mut row.v)?;
                let ran = (|| {
                    let geom = one(seq, &mut row.q, &mut row.k)?;
                    let (kc, vc) = (&mut lent.k[l], &mut lent.v[l]);
                    dev.store(&row.k, &row.v, kc, vc, 1)?;
                    let heads = &lent.heads[l];
                    attend_one(dev, heads, &mut row.q, (kc, vc), geom, &mut row.att, hd)?;
                    Ok::<_, Error>(dev.put_rows(&row.att, r, 1, qd, &mut s.att)?)
                })();
                seq.lent = Some(lent);
                ran?;
            }
        }
    }
    restore_step(dev, rows)
}

/// One row's attention over `heads` (every head, or a selection): `q` (the row's queries of
/// every head; left undefined) against the caches, into `att` (every head's place, `head_dim`
/// values each; zeros for the heads not selected). A selection's queries go compact into
/// `att`, their outputs compact into `q`, then each to its head's place in `att`.
fn attend_one<D: Device>(
    dev: &D,
    heads: &Sel<D>,
    q: &mut D::Buf,
    (kc, vc): (&D::Cache, &D::Cache),
    geom: AttnGeom,
    att: &mut D::Buf,
    hd: usize,
) -> Result<()> {
    let idx = match heads {
        Sel::All => return Ok(dev.attention(q, kc, vc, Rows::All, geom, att)?),
        Sel::Fixed { idx, .. } | Sel::Predicted { idx, .. } => idx,
    };
    let k = heads.count(geom.n_heads);
    if k > 0 {
        dev.gather(q, idx, k, hd, att)?;
        dev.attention(att, kc, vc, heads.rows(1), geom, q)?;
    }
    dev.clear(&mut [(att, geom.n_heads * hd)])?;
    if k > 0 {
        dev.scatter(q, idx, k, hd, att)?;
    }
    Ok(())
}

impl<D: Device> RowScratch<D> {
    fn new(dev: &D, m: &crate::exec::DeviceModel<D>) -> Result<Self> {
        let c = &m.local;
        let qd = c.n_heads * c.head_dim;
        Ok(Self {
            q: dev.zeros(qd)?,
            k: dev.zeros(c.kv_dim())?,
            v: dev.zeros(c.kv_dim())?,
            att: dev.zeros(qd)?,
        })
    }
}
