//! The CPU device's attention verbs: the lazy K/V fill, attention over a cache, and the
//! attention block of a step of several sequences (`Device::kv_fill`, `Device::attention`,
//! `Device::attend_rows`).
use super::{need, rope_factors, rows_of, shape, CpuCache, CpuDevice};
use crate::{attention, matmul, ops};
use dejavu_backend_api::{
    AttnGeom, AttnShape, BackendError, IndexSet, LazyKv, MatmulJob, Rotary, Rows, SeqRow,
};

impl CpuDevice {
    pub(super) fn fill_kv(
        &self,
        job: LazyKv<'_, Self>,
        valid: &mut [u32],
        kc: &mut CpuCache,
        vc: &mut CpuCache,
    ) -> Result<(), BackendError> {
        self.rows("kv_fill", job.rows)?;
        let (pos, hd) = (self.pos() + job.rows - 1, job.head_dim);
        let n_heads = job.wk.rows / hd.max(1);
        let d = job.inputs.width;
        let fits = hd > 0
            && job.wk.rows == n_heads * hd
            && job.wv.rows == job.wk.rows
            && job.wk.cols == d
            && job.wv.cols == d
            && kc.width == job.wk.rows
            && vc.width == kc.width
            && pos < kc.n_ctx.min(vc.n_ctx).min(job.inputs.n_ctx);
        if !fits {
            return Err(shape(format!(
                "lazy K/V of {n_heads} heads of {hd} over {d} inputs at position {pos}"
            )));
        }
        need("kv_fill valid", valid.len(), n_heads)?;
        for b in [job.bk, job.bv].into_iter().flatten() {
            need("kv_fill bias", b.len(), kc.width)?;
        }
        // Heads grouped by their first missing position: one product of both matrices per
        // group, over its positions' kept inputs and its heads' rows.
        let heads = rows_of(job.heads, n_heads)?;
        let mut groups = std::collections::BTreeMap::<usize, Vec<usize>>::new();
        for &h in heads.iter().filter(|&&h| valid[h] as usize <= pos) {
            groups.entry(valid[h] as usize).or_default().push(h);
        }
        let (wk, wv, width) = (job.wk.weight()?, job.wv.weight()?, kc.width);
        for (from, hs) in groups {
            let m = pos + 1 - from;
            let mut x = vec![0.0; m * d];
            for (i, xr) in x.chunks_exact_mut(d).enumerate() {
                job.inputs.read(from + i, xr);
            }
            let rows: Vec<u32> = (hs.iter())
                .flat_map(|&h| (h * hd) as u32..((h + 1) * hd) as u32)
                .collect();
            let rows = IndexSet::from_unsorted(width, rows).map_err(|e| shape(e.to_string()))?;
            let (mut k, mut v) = (vec![0.0; m * width], vec![0.0; m * width]);
            let mut jobs = [
                MatmulJob {
                    w: wk,
                    rows: &rows,
                    y: &mut k,
                },
                MatmulJob {
                    w: wv,
                    rows: &rows,
                    y: &mut v,
                },
            ];
            let run = match self.invariant {
                true => matmul::matmul_shared_steps,
                false => matmul::matmul_shared,
            };
            run(&self.cpu.kernels, &self.cpu.pool, &x, &mut jobs);
            for (i, (kr, vr)) in k
                .chunks_exact_mut(width)
                .zip(v.chunks_exact_mut(width))
                .enumerate()
            {
                let p = from + i;
                for &h in &hs {
                    let at = h * hd..(h + 1) * hd;
                    for (out, b, c, rope) in [
                        (&mut kr[at.clone()], job.bk, &mut *kc, job.rope),
                        (&mut vr[at.clone()], job.bv, &mut *vc, None),
                    ] {
                        if let Some(b) = b {
                            (out.iter_mut().zip(&b[at.clone()])).for_each(|(o, b)| *o += b);
                        }
                        if let Some(r) = rope {
                            let f = super::rope_factors(&r, hd)?;
                            ops::rope(out, 1, hd, p, r.theta, r.style, f);
                        }
                        c.put(p, h * hd, out);
                    }
                }
            }
        }
        for h in heads {
            valid[h] = pos as u32 + 1;
        }
        Ok(())
    }

    pub(super) fn attend(
        &self,
        q: &[f32],
        k: &CpuCache,
        v: &CpuCache,
        heads: Rows<'_, Vec<u32>>,
        g: AttnGeom,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let (hd, pos, rows) = (g.head_dim, self.pos(), g.rows);
        let width = g.n_kv_heads * hd;
        self.rows("attention", rows)?;
        g.scoring.check().map_err(shape)?;
        if g.n_kv_heads == 0 || !g.n_heads.is_multiple_of(g.n_kv_heads) || pos + rows > g.n_ctx {
            return Err(shape(format!(
                "attention of {} heads over {} KV heads at position {pos} of {}",
                g.n_heads, g.n_kv_heads, g.n_ctx
            )));
        }
        for c in [k, v] {
            if c.width != width || c.n_ctx < g.n_ctx {
                return Err(shape(format!("cache of {}x{}", c.n_ctx, c.width)));
            }
        }
        let hs = rows_of(heads, g.n_heads)?;
        let (cw, fw) = (hs.len() * hd, g.n_heads * hd);
        need("attention queries", q.len(), rows * cw)?;
        need("attention output", out.len(), rows * cw)?;
        // The CPU reference over full-width queries, then the selected heads back to compact.
        let mut qf = vec![0.0; rows * fw];
        for r in 0..rows {
            for (j, &h) in hs.iter().enumerate() {
                let src = &q[r * cw + j * hd..r * cw + (j + 1) * hd];
                qf[r * fw + h * hd..r * fw + (h + 1) * hd].copy_from_slice(src);
            }
        }
        let set = IndexSet::from_unsorted(g.n_heads, hs.iter().map(|&h| h as u32).collect())
            .map_err(|e| shape(e.to_string()))?;
        let mut of = vec![0.0; rows * fw];
        let n = (pos + rows) * width;
        let shape = AttnShape {
            n_heads: g.n_heads,
            n_kv_heads: g.n_kv_heads,
            head_dim: hd,
            pos0: pos,
            n_tokens: rows,
            scoring: g.scoring,
        };
        let run = match self.invariant {
            true => attention::attention_steps,
            false => attention::attention,
        };
        run(
            &self.cpu.kernels,
            &self.cpu.pool,
            &qf,
            k.slice(n),
            v.slice(n),
            &set,
            shape,
            &mut of,
        );
        for r in 0..rows {
            for (j, &h) in hs.iter().enumerate() {
                let src = &of[r * fw + h * hd..r * fw + (h + 1) * hd];
                out[r * cw + j * hd..r * cw + (j + 1) * hd].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

impl CpuDevice {
    /// `Device::attend_rows`: each row's RoPE at its own position and its keys and values into
    /// its own caches (the one-row verbs' own functions), then one pool dispatch of every
    /// (row, head) over each row's own cache, so each row's output is bit for bit its decode
    /// step's attention.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_seqs(
        &self,
        q: &mut [f32],
        k: &mut [f32],
        v: &[f32],
        rope: Option<Rotary<'_, Vec<f32>>>,
        g: AttnGeom,
        rows: &mut [SeqRow<'_, Self>],
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let n = rows.len();
        let (nq, nkv, hd) = (g.n_heads, g.n_kv_heads, g.head_dim);
        let (qd, kvd) = (nq * hd, nkv * hd);
        self.rows("attend_rows", n)?;
        g.scoring.check().map_err(shape)?;
        if nkv == 0 || !nq.is_multiple_of(nkv) {
            return Err(shape(format!("{nq} query heads over {nkv} KV heads")));
        }
        need("attention queries", q.len(), n * qd)?;
        need("attention keys", k.len(), n * kvd)?;
        need("attention values", v.len(), n * kvd)?;
        need("attention output", out.len(), n * qd)?;
        let mut sets = Vec::with_capacity(n);
        for r in rows.iter() {
            let fits = |c: &CpuCache| c.width == kvd && c.n_ctx >= r.n_ctx;
            if !fits(r.k) || !fits(r.v) || r.pos >= r.n_ctx {
                return Err(shape(format!(
                    "a row at position {} of {} over caches of {}x{} (width {kvd})",
                    r.pos, r.n_ctx, r.k.n_ctx, r.k.width
                )));
            }
            sets.push(match r.heads {
                Rows::All => IndexSet::full(nq),
                sel => {
                    let hs = rows_of(sel, nq)?.into_iter().map(|h| h as u32).collect();
                    IndexSet::from_unsorted(nq, hs).map_err(|e| shape(e.to_string()))?
                }
            });
        }
        let factors = rope.as_ref().map(|r| rope_factors(r, hd)).transpose()?;
        for (i, r) in rows.iter_mut().enumerate() {
            let (qr, kr) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
            if let Some(rot) = &rope {
                let f = factors.flatten();
                ops::rope(qr, nq, hd, r.pos, rot.theta, rot.style, f);
                ops::rope(kr, nkv, hd, r.pos, rot.theta, rot.style, f);
            }
            r.k.put(r.pos, 0, kr);
            r.v.put(r.pos, 0, &v[i * kvd..(i + 1) * kvd]);
        }
        let seqs: Vec<attention::SeqAttn> = (rows.iter().zip(&sets))
            .map(|(r, heads)| attention::SeqAttn {
                k: r.k.slice((r.pos + 1) * kvd),
                v: r.v.slice((r.pos + 1) * kvd),
                pos: r.pos,
                heads,
            })
            .collect();
        let shape = AttnShape {
            n_heads: nq,
            n_kv_heads: nkv,
            head_dim: hd,
            pos0: 0,
            n_tokens: n,
            scoring: g.scoring,
        };
        let (kern, pool) = (&self.cpu.kernels, &self.cpu.pool);
        attention::attention_seqs(kern, pool, &q[..n * qd], &seqs, shape, &mut out[..n * qd]);
        Ok(())
    }
}
