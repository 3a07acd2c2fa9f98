//! The launches of attention.cu (one block per selected query head and batch row over the f16
//! caches) and of rope.cu.
use crate::{launch, need, shape, Buf, Cache, CudaDevice, Idx};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{AttnGeom, BackendError, Device, RopeStyle, Rotary, Rows};

impl CudaDevice {
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
        let smem = (g.head_dim + g.n_ctx) * 4;
        self.allow_smem("attention_f16", smem)?;
        let f = self.func("attention_f16");
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
        let window = sc.window.map_or(0, |w| w.min(g.n_ctx)) as i32;
        let mut b = self.lane().launch_builder(f);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&ip)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&nc);
        b.arg(&scale).arg(&cap).arg(&window).arg(&sp).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (n_sel.max(1) as u32, g.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        launch::run(b, cfg)
    }
}
