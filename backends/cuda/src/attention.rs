//! The launches of attention.cu (one block per selected query head and batch row over the f16
//! caches, or per span of its positions, merged after) and of rope.cu.
use crate::{launch, need, shape, Buf, Cache, CudaDevice, Idx};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{AttnGeom, BackendError, Device, RopeStyle, Rotary, Rows};

/// Floats of the spans' scratch (`CudaDevice::att_part`) per SM: the spans split only while
/// the blocks fill the SMs under 8 deep, so a launch has under 16 blocks a SM, each writing
/// `head_dim + 2` floats (at most 258).
pub(crate) const ATT_PART: usize = 16 * 258;

impl CudaDevice {
    /// How many spans to split `positions` positions into, for `blocks` blocks (heads times
    /// rows) of head size `hd`: 1 (no split) under `ATT_SPAN=0`, else as many as fill the SMs
    /// 8 deep, each of at least `att_span` positions, at most 64; 1 also where their sums
    /// would not fit `att_part`, and under `--deterministic` (the spans would depend on the
    /// batch).
    pub(crate) fn att_spans(&self, blocks: usize, positions: usize, hd: usize) -> usize {
        // Deterministic: one block a row's head over all its positions, as a step alone has.
        if self.att_span == 0 || blocks == 0 || self.deterministic {
            return 1;
        }
        let fill = (8 * self.n_sm).div_ceil(blocks);
        let spans = positions.div_ceil(self.att_span).min(fill).clamp(1, 64);
        match blocks * spans * (hd + 2) <= self.att_part.len() {
            true => spans,
            false => 1,
        }
    }

    /// rope.cu over `nx` heads at `x` and `ny` at `y`, each of `rows` rows (lengths checked by
    /// the caller); each row at its sequence's position in the table at `tab` (a step of
    /// several sequences), or (`tab` 0) at the step's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_rope(
        &self,
        x: u64,
        nx: usize,
        y: u64,
        ny: usize,
        hd: usize,
        rope: Rotary<'_, Buf>,
        rows: usize,
        tab: u64,
    ) -> Result<(), BackendError> {
        self.batch_rows("rope", rows)?;
        if let Some(f) = rope.factors {
            need("RoPE factors", f.0.len(), hd / 2)?;
        }
        let neox = (rope.style == RopeStyle::Neox) as i32;
        let (nxi, nyi, hdi, sp) = (nx as i32, ny as i32, hd as i32, self.ptr(&self.step));
        let fp = rope.factors.map_or(0, |f| self.ptr(&f.0));
        let mut b = self.lane().launch_builder(self.func("rope"));
        b.arg(&x).arg(&nxi).arg(&y).arg(&nyi).arg(&hdi).arg(&sp);
        b.arg(&rope.theta).arg(&fp).arg(&neox).arg(&tab);
        launch::run(b, launch::rows(launch::grid((nx + ny) * hd / 2, 128), rows))
    }

    /// `Device::attention`.
    pub(crate) fn launch_attention(
        &self,
        q: &Buf,
        k: &Cache,
        v: &Cache,
        heads: Rows<'_, Idx>,
        g: AttnGeom,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        let width = g.n_kv_heads * g.head_dim;
        g.scoring.check().map_err(shape)?;
        if g.n_kv_heads == 0 || !g.n_heads.is_multiple_of(g.n_kv_heads) {
            return Err(shape(format!(
                "{} query heads over {} KV heads",
                g.n_heads, g.n_kv_heads
            )));
        }
        for c in [k, v] {
            if c.width != width || c.n_ctx < g.n_ctx {
                return Err(shape(format!(
                    "cache of {}x{} for attention over {}x{width}",
                    c.n_ctx, c.width, g.n_ctx
                )));
            }
        }
        self.batch_rows("attention", g.rows)?;
        let (ip, _, _, n_sel) = self.sel(heads, g.n_heads)?;
        if n_sel == 0 {
            return Ok(()); // no head selected: nothing to write
        }
        // One block per selected head (`n_sel` heads: the selection's group is 1).
        need("attention queries", q.0.len(), g.rows * n_sel * g.head_dim)?;
        need("attention output", out.0.len(), g.rows * n_sel * g.head_dim)?;
        if !g.head_dim.is_multiple_of(8) || g.head_dim > 256 {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("head size {} (a multiple of 8, at most 256)", g.head_dim),
            });
        }
        let (qp, kp, vp, op, sp) = (
            self.ptr(&q.0),
            self.ptr(&k.data),
            self.ptr(&v.data),
            self.ptr(&out.0),
            self.ptr(&self.step),
        );
        let (nh, nkv, hd, nc) = (
            g.n_heads as i32,
            g.n_kv_heads as i32,
            g.head_dim as i32,
            g.n_ctx as i32,
        );
        // 0: no cap, no window (Scoring::check keeps both positive otherwise).
        let sc = g.scoring;
        let (scale, cap) = (sc.scale, sc.softcap.unwrap_or(0.0));
        let window = sc.window.map_or(0, |w| w.min(g.n_ctx));
        // Spans by the context, not the position: a recorded step replays at every position.
        let reach = if window > 0 { window } else { g.n_ctx };
        let spans = self.att_spans(n_sel * g.rows, reach, g.head_dim);
        let (span, window) = (reach.div_ceil(spans), window as i32);
        let split = spans > 1;
        let name = if split {
            "attention_split_f16"
        } else {
            "attention_f16"
        };
        let smem = (g.head_dim + if split { span } else { g.n_ctx }) * 4;
        self.allow_smem(name, smem)?;
        let pp = self.ptr(&self.att_part);
        let mut b = self.lane().launch_builder(self.func(name));
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&ip)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&nc);
        b.arg(&scale).arg(&cap).arg(&window).arg(&sp);
        let (span_i, spans_i) = (span as i32, spans as i32);
        match split {
            true => b.arg(&span_i).arg(&pp),
            false => b.arg(&op),
        };
        let cfg = LaunchConfig {
            grid_dim: (n_sel.max(1) as u32, g.rows as u32, spans as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        launch::run(b, cfg)?;
        if split {
            let mut b = self.lane().launch_builder(self.func("attention_merge"));
            b.arg(&ip).arg(&nh).arg(&hd).arg(&spans_i).arg(&pp).arg(&op);
            let one = launch::grid(n_sel * 256, 256);
            launch::run(b, launch::rows(one, g.rows))?;
        }
        Ok(())
    }
}
