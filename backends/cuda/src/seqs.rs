//! `Device::attend_rows`: the attention block of a step of several sequences in four launches
//! (RoPE, the K/V store, a clear of the output, attention), each row reading its sequence's
//! caches, position and heads from a table written to the device before them (`seq_tab`:
//! `SEQ_TAB` values a row, as attention.cu's `attention_rows_f16` reads them).
use crate::{launch, need, shape, Buf, Cache, CudaDevice, Idx};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{AttnGeom, BackendError, Device, Rotary, Rows, SeqRow, SeqRows, MAX_ROWS};

/// Values per row of the table (`SEQ_TAB` in common.cuh): the key cache, the value cache, the
/// heads' index list (0: every head), the position, the context, the head count.
pub(crate) const SEQ_TAB: usize = 6;
/// Layers whose rows `Device::set_seq_rows` can write: `seq_tab` holds `MAX_ROWS` rows for
/// a call's own rows (slot 0, `SEQ_SLOT` values), then room for this many layers' tables of
/// up to `MAX_ROWS` rows, each layer's `n` rows after the last's (layer `l` at `SEQ_SLOT + l n
/// SEQ_TAB`: a recorded step names the tables of its own row count).
pub(crate) const SEQ_LAYERS: usize = 256;
/// Values of slot 0 of `seq_tab`.
pub(crate) const SEQ_SLOT: usize = SEQ_TAB * MAX_ROWS;

/// The rows `Device::set_seq_rows` wrote: how many, every layer's table (as on the device,
/// after slot 0), each layer's largest head count, and the rows' largest context.
pub(crate) struct SeqSet {
    n: usize,
    tab: Vec<u64>,
    most_heads: Vec<usize>,
    most_ctx: usize,
}

impl CudaDevice {
    /// A row's table entry: caches `k`, `v` at position `pos` of `n_ctx`, over `heads` of
    /// `nq` (a selection of group 1, or every head).
    fn seq_entry(
        &self,
        (k, v): (&Cache, &Cache),
        heads: Rows<'_, Idx>,
        (pos, n_ctx): (usize, usize),
        nq: usize,
    ) -> Result<[u64; SEQ_TAB], BackendError> {
        let fits = |c: &Cache| c.n_ctx >= n_ctx && c.width == k.width;
        if !fits(k) || !fits(v) || pos >= n_ctx || n_ctx > i32::MAX as usize {
            return Err(shape(format!(
                "a row at position {pos} of {n_ctx} over caches of {}x{} and {}x{}",
                k.n_ctx, k.width, v.n_ctx, v.width
            )));
        }
        let (ip, _, _, count) = self.sel(heads, nq)?;
        if matches!(heads, Rows::Sel { group, .. } if group != 1) {
            return Err(shape("a row's heads are a selection of group 1".into()));
        }
        let (kp, vp) = (self.ptr(&k.data), self.ptr(&v.data));
        Ok([kp, vp, ip, pos as u64, n_ctx as u64, count as u64])
    }

    /// `Device::set_seq_rows`: every layer's table after slot 0 of `seq_tab` in one copy, kept
    /// on the host too for the layers' calls to check their rows against.
    pub(crate) fn write_seq_rows(
        &self,
        nq: usize,
        rows: &[SeqRows<'_, Self>],
    ) -> Result<bool, BackendError> {
        *self.seq_set.lock().expect("seq_set lock") = None;
        let (n, layers) = (rows.len(), rows.first().map_or(0, |r| r.k.len()));
        let on = self.seq_graphs && self.attend_rows;
        if !on || n == 0 || n > MAX_ROWS || layers == 0 || layers > SEQ_LAYERS {
            return Ok(false);
        }
        let mut tab = Vec::with_capacity(layers * n * SEQ_TAB);
        let (mut most_heads, mut most_ctx) = (vec![0; layers], 0);
        for (l, most) in most_heads.iter_mut().enumerate() {
            for r in rows {
                if r.k.len() != layers || r.v.len() != layers || r.heads.len() != layers {
                    return Err(shape(format!(
                        "rows of {layers} layers, one of {}, {} and {} (keys, values, heads)",
                        r.k.len(),
                        r.v.len(),
                        r.heads.len()
                    )));
                }
                let e = self.seq_entry((&r.k[l], &r.v[l]), r.heads[l], (r.pos, r.n_ctx), nq)?;
                tab.extend(e);
                *most = (*most).max(e[5] as usize);
                most_ctx = most_ctx.max(r.n_ctx);
            }
        }
        launch::htod_at(&self.stream, &self.seq_tab, SEQ_SLOT, &tab)?;
        let set = SeqSet {
            n,
            tab,
            most_heads,
            most_ctx,
        };
        *self.seq_set.lock().expect("seq_set lock") = Some(set);
        Ok(true)
    }

    /// Forget the rows `write_seq_rows` wrote (a new step was set).
    pub(crate) fn forget_seq_rows(&self) {
        *self.seq_set.lock().expect("seq_set lock") = None;
    }
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_attend_rows(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        rope: Option<Rotary<'_, Buf>>,
        g: AttnGeom,
        layer: usize,
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
            if r.k.width != kvd {
                return Err(shape(format!(
                    "a row's caches of width {} (not {kvd})",
                    r.k.width
                )));
            }
            let e = self.seq_entry((r.k, r.v), r.heads, (r.pos, r.n_ctx), nq)?;
            tab.extend(e);
            most_heads = most_heads.max(e[5] as usize);
            most_ctx = most_ctx.max(r.n_ctx);
        }
        // The rows `set_seq_rows` wrote for this layer (a recorded step's), or this call's own.
        let (tp, set) = match &*self.seq_set.lock().expect("seq_set lock") {
            Some(s) if layer < s.most_heads.len() => {
                let (at, len) = (layer * n * SEQ_TAB, n * SEQ_TAB);
                if s.n != n || s.tab[at..at + len] != tab[..] {
                    return Err(shape(format!(
                        "layer {layer}'s rows differ from those set for the step"
                    )));
                }
                (most_heads, most_ctx) = (s.most_heads[layer], s.most_ctx);
                let bytes = ((SEQ_SLOT + at) * std::mem::size_of::<u64>()) as u64;
                (self.ptr(&self.seq_tab) + bytes, true)
            }
            _ => {
                launch::htod(self.lane(), &self.seq_tab, &tab)?;
                (self.ptr(&self.seq_tab), false)
            }
        };
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
        // The longest run of positions a row's heads read (the rows set for the step: any
        // position a replay may come to, up to the largest context).
        let longest = match set {
            true if window > 0 => window,
            true => most_ctx,
            false => longest_run(rows, window),
        };
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

/// The longest run of positions a row's heads read at its position (`window` 0: none).
fn longest_run(rows: &[SeqRow<'_, CudaDevice>], window: usize) -> usize {
    (rows.iter())
        .map(|r| {
            let end = (r.pos + 1).min(r.n_ctx);
            end - if window > 0 {
                end.saturating_sub(window)
            } else {
                0
            }
        })
        .max()
        .unwrap_or(1)
}
