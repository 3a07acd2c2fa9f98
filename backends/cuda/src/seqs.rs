//! `Device::attend_rows`: the attention block of a step of several sequences in four launches
//! (RoPE, the K/V store, a clear of the output, attention), each row reading its sequence's
//! caches, position and heads from a table written to the device before them (`seq_tab`:
//! `SEQ_TAB` values a row, as attention.cu's `attention_rows_f16` reads them).
use crate::{launch, need, shape, Buf, CudaDevice};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{AttnGeom, BackendError, Device, Rotary, Rows, SeqRow, MAX_ROWS};

/// Values per row of the table (`SEQ_TAB` in common.cuh): the key cache, the value cache, the
/// heads' index list (0: every head), the position, the context, the head count.
pub(crate) const SEQ_TAB: usize = 6;

impl CudaDevice {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_attend_rows(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        rope: Option<Rotary<'_, Buf>>,
        g: AttnGeom,
        rows: &mut [SeqRow<'_, Self>],
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        if !self.attend_rows {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: "the attention of several sequences in one call (ATTEND_ROWS=0)".into(),
            });
        }
        let n = rows.len();
        let (nq, nkv, hd) = (g.n_heads, g.n_kv_heads, g.head_dim);
        let (qd, kvd) = (nq * hd, nkv * hd);
        g.scoring.check().map_err(shape)?;
        if n == 0 || n > MAX_ROWS || nkv == 0 || !nq.is_multiple_of(nkv) {
            return Err(shape(format!(
                "attention of {n} sequences, {nq} query heads over {nkv} KV heads"
            )));
        }
        if !hd.is_multiple_of(8) || hd > 256 {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("head size {hd} (a multiple of 8, at most 256)"),
            });
        }
        self.batch_rows("attend_rows", n)?;
        need("attention queries", q.0.len(), n * qd)?;
        need("attention keys", k.0.len(), n * kvd)?;
        need("attention values", v.0.len(), n * kvd)?;
        need("attention output", out.0.len(), n * qd)?;
        let (mut tab, mut most_heads, mut most_ctx) = (Vec::with_capacity(n * SEQ_TAB), 0, 0);
        for r in rows.iter() {
            let same = |c: &crate::Cache| c.width == kvd && c.n_ctx >= r.n_ctx;
            if !same(r.k) || !same(r.v) || r.pos >= r.n_ctx || r.n_ctx > i32::MAX as usize {
                return Err(shape(format!(
                    "a row at position {} of {} over caches of {}x{} (width {kvd})",
                    r.pos, r.n_ctx, r.k.n_ctx, r.k.width
                )));
            }
            let (ip, _, _, count) = self.sel(r.heads, nq)?;
            if matches!(r.heads, Rows::Sel { group, .. } if group != 1) {
                return Err(shape("a row's heads are a selection of group 1".into()));
            }
            tab.extend([
                self.ptr(&r.k.data),
                self.ptr(&r.v.data),
                ip,
                r.pos as u64,
                r.n_ctx as u64,
                count as u64,
            ]);
            most_heads = most_heads.max(count);
            most_ctx = most_ctx.max(r.n_ctx);
        }
        launch::htod(self.lane(), &self.seq_tab, &tab)?;
        let tp = self.ptr(&self.seq_tab);
        if let Some(rot) = rope {
            let (qp, kp) = (self.ptr(&q.0), self.ptr(&k.0));
            self.launch_rope(qp, nq, kp, nkv, hd, rot, n, tp)?;
        }
        let (kp, vp, w) = (self.ptr(&k.0), self.ptr(&v.0), kvd as i32);
        let mut b = self.lane().launch_builder(self.func("store_rows_f16"));
        b.arg(&kp).arg(&vp).arg(&w).arg(&tp);
        launch::run(b, launch::rows(launch::grid(kvd, 256), n))?;
        self.launch_clear(&mut [(out, n * qd)])?;
        if most_heads == 0 {
            return Ok(());
        }
        let sc = g.scoring;
        let window = sc.window.map_or(0, |w| w.min(most_ctx));
        // The longest run of positions a row's heads read.
        let longest = (rows.iter())
            .map(|r| {
                let end = (r.pos + 1).min(r.n_ctx);
                end - if window > 0 {
                    end.saturating_sub(window)
                } else {
                    0
                }
            })
            .max()
            .unwrap_or(1);
        let spans = self.att_spans(most_heads * n, longest, hd);
        let (scale, cap, window) = (sc.scale, sc.softcap.unwrap_or(0.0), window as i32);
        let (qp, op) = (self.ptr(&q.0), self.ptr(&out.0));
        let (nqi, nkvi, hdi) = (nq as i32, nkv as i32, hd as i32);
        if spans > 1 {
            let span = longest.div_ceil(spans);
            let (pp, smem) = (self.ptr(&self.att_part), (hd + span) * 4);
            self.allow_smem("attention_rows_split_f16", smem)?;
            let mut b = self
                .lane()
                .launch_builder(self.func("attention_rows_split_f16"));
            b.arg(&qp).arg(&tp).arg(&nqi).arg(&nkvi).arg(&hdi);
            let (span_i, spans_i) = (span as i32, spans as i32);
            b.arg(&scale).arg(&cap).arg(&window).arg(&span_i).arg(&pp);
            let cfg = LaunchConfig {
                grid_dim: (most_heads as u32, n as u32, spans as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            launch::run(b, cfg)?;
            let mut b = self
                .lane()
                .launch_builder(self.func("attention_rows_merge"));
            b.arg(&tp)
                .arg(&nqi)
                .arg(&hdi)
                .arg(&spans_i)
                .arg(&pp)
                .arg(&op);
            return launch::run(b, launch::rows(launch::grid(most_heads * 256, 256), n));
        }
        let smem = (hd + most_ctx) * 4;
        self.allow_smem("attention_rows_f16", smem)?;
        let mut b = self.lane().launch_builder(self.func("attention_rows_f16"));
        b.arg(&qp).arg(&tp).arg(&nqi).arg(&nkvi).arg(&hdi);
        b.arg(&scale).arg(&cap).arg(&window).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (most_heads as u32, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        launch::run(b, cfg)
    }
}
