//! A decode step of several sequences (continuous batching): one row per sequence, each at its
//! own position over its own KV cache, in one pass through the layer loop ([`Pass::Seqs`]).
//! The products run over every row at once, so each weight is read once for the whole step
//! ([`Device::matmul_steps`]: on the CPU each row's outputs are bit for bit those of its own
//! decode step, whatever else is in the batch); the verbs that read a position or a cache run
//! row by row, the step set to that row's token and position ([`Device::set_step`]).
//!
//! The first sequence leads: its scratch holds the batch's rows and runs the pass; the others
//! lend it their caches for the step ([`RowSeq`]) and get them back after it, failed or not.
use super::step::Pass;
use super::DeviceSession;
use crate::{Error, Result};
use dejavu_backend_api::{AttnGeom, Device, Rows, StepRow, MAX_ROWS};

/// One row of a step of several sequences: its token, its sequence's length and context, and
/// (but for the leader's own row 0) the caches that sequence lent and one row of scratch.
pub(super) struct RowSeq<D: Device> {
    token: u32,
    len: usize,
    n_ctx: usize,
    lent: Option<Lent<D>>,
}

/// A sequence's caches, lent to the leader for one step, and the leader's scratch for its row.
pub(super) struct Lent<D: Device> {
    k: Vec<D::Cache>,
    v: Vec<D::Cache>,
    row: RowScratch<D>,
}

/// One row's `x`, `q`, `k`, `v` and attention output.
pub(super) struct RowScratch<D: Device> {
    x: D::Buf,
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    att: D::Buf,
}

impl<'a, D: Device> DeviceSession<'a, D> {
    /// Can this sequence's steps join a batch of several? Its plan runs every unit (a batch
    /// computes every neuron and head; per-sequence selections are not batched yet) and
    /// nothing records or changes its batches.
    pub fn batches(&self) -> bool {
        let p = &self.plan;
        p.is_dense()
            && p.output.is_none()
            && !p.lazy_kv
            && self.model.shard.is_whole()
            && self.capture.is_none()
            && !self.mask_batches
    }

    /// One decode step of several sequences: `tokens[i]` at the next position of `seqs[i]`.
    /// Returns the logits, `[n][vocab]`. On the CPU, row `i` is bit for bit the logits
    /// `seqs[i].forward(&[tokens[i]])` gives (batch invariance). Every sequence
    /// [`batches`](Self::batches), on the same device and model; a bad token or a full context
    /// is an error before any runs. One sequence is its own decode step (replayed where the
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
            lead.spare.push(lent.row);
        }
        ran?;
        seqs.iter_mut().for_each(|s| s.len += 1);
        Ok(std::mem::take(&mut seqs[0].rows_out))
    }

    /// The pass of [`Self::step_many`] over the rows lent, and every row's logits into
    /// `rows_out`.
    fn run_seqs(&mut self, tokens: &[u32]) -> Result<()> {
        let (dev, n) = (self.dev, tokens.len());
        if self.s.grow(dev, self.model, n, self.n_ctx)? {
            self.graph = None;
        }
        dev.set_step(tokens, 0)?;
        self.layers(Pass::Seqs { rows: n }, &mut None)?;
        self.rows_out.clear();
        self.batch_rows(0..n, false, true)
    }

    /// Learned positions, added to each row of `s.x` at its own sequence's position.
    pub(super) fn positions_by_row(&mut self, table: &D::Mat, offset: usize) -> Result<()> {
        let (dev, d) = (self.dev, self.model.local.d_model);
        let which = StepRow::Position { offset };
        let x = &mut self.s.x;
        for (r, seq) in self.rows_seq.iter_mut().enumerate() {
            dev.set_step(&[seq.token], seq.len)?;
            match &mut seq.lent {
                None => dev.embed(table, which, true, x, 1)?,
                Some(l) => {
                    dev.take_rows(x, r, 1, d, &mut l.row.x)?;
                    dev.embed(table, which, true, &mut l.row.x, 1)?;
                    dev.put_rows(&l.row.x, r, 1, d, x)?;
                }
            }
        }
        self.restore_step()
    }

    /// The step of every row again (the products after a row-by-row verb read all of them).
    fn restore_step(&self) -> Result<()> {
        restore_step(self.dev, &self.rows_seq)
    }
}

fn restore_step<D: Device>(dev: &D, rows: &[RowSeq<D>]) -> Result<()> {
    let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
    Ok(dev.set_step(&tokens, 0)?)
}

/// Layer `l`'s RoPE, K/V store and attention of every head, row by row: each row's queries,
/// keys and values (in `s.q`, `s.k`, `s.v`) at its sequence's position, against its sequence's
/// cache (the leader's own are `kc`, `vc`), into its row of `s.att`.
pub(super) fn attend_by_row<D: Device>(
    dev: &D,
    m: &crate::exec::DeviceModel<D>,
    l: usize,
    rows: &mut [RowSeq<D>],
    s: &mut super::Scratch<D>,
    (kc, vc): (&mut D::Cache, &mut D::Cache),
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
                dev.attention(&s.q, kc, vc, Rows::All, geom, &mut s.att)?;
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
                    dev.attention(&row.q, kc, vc, Rows::All, geom, &mut row.att)?;
                    Ok::<_, Error>(dev.put_rows(&row.att, r, 1, qd, &mut s.att)?)
                })();
                seq.lent = Some(lent);
                ran?;
            }
        }
    }
    restore_step(dev, rows)
}

impl<D: Device> RowScratch<D> {
    fn new(dev: &D, m: &crate::exec::DeviceModel<D>) -> Result<Self> {
        let c = &m.local;
        let (wide, qd) = (c.d_model.max(c.d_embed), c.n_heads * c.head_dim);
        Ok(Self {
            x: dev.zeros(wide)?,
            q: dev.zeros(qd)?,
            k: dev.zeros(c.kv_dim())?,
            v: dev.zeros(c.kv_dim())?,
            att: dev.zeros(qd)?,
        })
    }
}
