//! Launches of lazy K/V (kvfill.cu): the kept attention inputs, and the keys and values a
//! selected head missed.
use crate::{launch, need, shape, type_suffix, Buf, Cache, CudaDevice, Idx};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{BackendError, LazyKv, RopeStyle};

impl CudaDevice {
    /// `Device::store_row`.
    pub(crate) fn launch_store_row(
        &self,
        x: &Buf,
        c: &mut Cache,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.batch_rows("store_row", rows)?;
        need("store_row", x.0.len(), rows * c.width)?;
        let (xp, cp, sp) = (self.ptr(&x.0), self.ptr(&c.data), self.ptr(&self.step));
        let (w, n) = (c.width as i32, c.n_ctx as i32);
        let mut b = self.lane().launch_builder(self.func("store_row_f16"));
        b.arg(&xp).arg(&cp).arg(&w).arg(&n).arg(&sp);
        launch::run(b, launch::rows(launch::grid(c.width, 256), rows))
    }

    /// `Device::kv_fill`: `kv_fill_T` (a warp per row pair of K or V of a selected head), then
    /// `kv_mark`.
    pub(crate) fn launch_kv_fill(
        &self,
        job: LazyKv<'_, Self>,
        valid: &mut Idx,
        kc: &mut Cache,
        vc: &mut Cache,
    ) -> Result<(), BackendError> {
        let hd = job.head_dim;
        self.batch_rows("kv_fill", job.rows)?;
        let n_heads = job.wk.rows / hd.max(1);
        let d = job.inputs.width;
        let fits = hd > 0
            && hd.is_multiple_of(2)
            && job.wk.rows == n_heads * hd
            && (job.wv.rows, job.wv.qtype) == (job.wk.rows, job.wk.qtype)
            && job.wk.cols == d
            && job.wv.cols == d
            && d.is_multiple_of(8)
            && kc.width == job.wk.rows
            && (vc.width, vc.n_ctx) == (kc.width, kc.n_ctx)
            && job.inputs.n_ctx >= kc.n_ctx;
        if !fits {
            return Err(shape(format!(
                "lazy K/V of {n_heads} heads of {hd} over {d} inputs (even head size, inputs a \
                 multiple of 8, one weight type)"
            )));
        }
        need("kv_fill valid", valid.0.len(), n_heads)?;
        for b in [job.bk, job.bv].into_iter().flatten() {
            need("kv_fill bias", b.0.len(), kc.width)?;
        }
        let (ip, n_sel, group, _) = self.sel(job.heads, n_heads)?;
        if group != 1 {
            return Err(shape("lazy K/V selects heads (group 1)".into()));
        }
        if n_sel == 0 {
            return Ok(());
        }
        let (theta, rope, factors) = match job.rope {
            None => (0.0f32, -1i32, None),
            Some(r) => (r.theta, (r.style == RopeStyle::Neox) as i32, r.factors),
        };
        if let Some(f) = factors {
            need("kv_fill RoPE factors", f.0.len(), hd / 2)?;
        }
        let fp = factors.map_or(0, |f| self.ptr(&f.0));
        let ptrs = [
            self.ptr(&job.wk.data),
            self.ptr(&job.wv.data),
            job.bk.map_or(0, |b| self.ptr(&b.0)),
            job.bv.map_or(0, |b| self.ptr(&b.0)),
            self.ptr(&job.inputs.data),
        ];
        let (vp, sp, kp, vcp) = (
            self.ptr(&valid.0),
            self.ptr(&self.step),
            self.ptr(&kc.data),
            self.ptr(&vc.data),
        );
        let (di, hdi, wi, nc) = (d as i32, hd as i32, kc.width as i32, kc.n_ctx as i32);
        let rows = job.rows as i32;
        let f = self.func(&format!("kv_fill_{}", type_suffix(job.wk.qtype)));
        let mut b = self.lane().launch_builder(f);
        for p in &ptrs {
            b.arg(p);
        }
        b.arg(&di)
            .arg(&ip)
            .arg(&n_sel)
            .arg(&hdi)
            .arg(&vp)
            .arg(&sp)
            .arg(&rows)
            .arg(&nc);
        b.arg(&theta)
            .arg(&fp)
            .arg(&rope)
            .arg(&kp)
            .arg(&vcp)
            .arg(&wi);
        // A warp per row pair of K or V of each selected head (n_sel * hd warps) and chunk of
        // positions: 4 rows of blocks, so that up to 4 chunks of a head that missed many run at
        // once (the rows with none to fill return at once).
        let cfg = LaunchConfig {
            grid_dim: ((n_sel as usize * hd).div_ceil(8) as u32, 4, 1),
            ..launch::grid(1, 256)
        };
        launch::run(b, cfg)?;
        let mut b = self.lane().launch_builder(self.func("kv_mark"));
        let nh = n_heads as i32;
        b.arg(&ip).arg(&n_sel).arg(&nh).arg(&vp).arg(&sp).arg(&rows);
        launch::run(b, launch::grid(n_sel as usize, 256))
    }
}
