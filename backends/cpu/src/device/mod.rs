//! [`CpuDevice`]: the [`Device`] verbs on host memory, over the CPU backend's own kernels (the
//! kernel table of one ISA tier and the thread pool): what the forward pass runs on the CPU
//! (`--backend cpu`). [`CpuDevice::reference`] is the f32 reference (f32 activations dotted with
//! dequantized rows, one thread): what the CUDA kernels and the SIMD tiers are checked against.
//! [`CpuDevice::new`] runs the process's tier (`DEJAVU_ISA`) with 8-bit activations. The verbs
//! live by kind: products (`products.rs`), attention and the lazy K/V fill (`attend.rs`),
//! matrices read in place (`mat.rs`), caches (`cache.rs`); the rest here.
//!
//! Products compute the selected rows into a full-length scratch with the backend's `matmul`
//! (unselected outputs untouched) and then gather them into the compact order the trait names;
//! the sparse down projection expands the compact activations the other way for `axpy_matmul`.
//! Matrices keep the layout they are given: the engine's repacked rows, or the file's (the
//! neuron-major matrices of the sparse layout, which `axpy` reads). Steps are not recorded
//! (`begin_capture` is `false`): a CPU step is its verbs.
use crate::isa::Isa;
use crate::kernels::table::Kernels;
use crate::pool::SpinPool;
use crate::world::HostWorld;
use crate::{ops, CpuBackend};
use dejavu_backend_api::{
    Activation, AttnGeom, BackendError, Device, InputMask, LazyKv, Product, QuantType, Rotary,
    Rows, SeqRow, SharedBytes, StepRow, TopK, Weight, MAX_ROWS,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod attend;
mod cache;
mod mat;
mod products;
mod select;

pub use cache::CpuCache;
pub use mat::CpuMat;
use mat::{range_in, MatBytes};

pub struct CpuDevice {
    /// The batch's tokens and each row's position (`Device::set_steps`), and its first
    /// position and row count (read by every verb: atomics, set together with the rows).
    rows: Mutex<(Vec<u32>, Vec<usize>)>,
    pos: AtomicUsize,
    n_rows: AtomicUsize,
    /// The kernel table and the thread pool.
    cpu: CpuBackend,
    /// The f32 reference ([`CpuDevice::reference`]).
    reference: bool,
    /// This device's rank in a tensor-parallel world of host threads, if any.
    world: Option<(usize, Arc<HostWorld>)>,
    /// Caches hold f32 rather than f16 ([`CpuDevice::with_f32_cache`]).
    f32_cache: bool,
    /// `upload_rows` keeps the file's layout ([`CpuDevice::with_file_layout`]).
    file_layout: bool,
    /// Batch-invariant (the default; off by [`CpuDevice::with_prompt_tiles`]): every verb of
    /// several rows gives each row bit for bit what a one-row decode step gives it, whatever
    /// the rows beside it and the pool's thread count (see `Device::batch_invariant`).
    invariant: bool,
}

impl Default for CpuDevice {
    /// [`CpuDevice::reference`].
    fn default() -> Self {
        Self::reference()
    }
}

impl CpuDevice {
    /// The f32 reference: f32 activations dotted with dequantized rows, scalar, one thread.
    pub fn reference() -> Self {
        Self {
            reference: true,
            ..Self::of(Kernels::f32_reference(), 1)
        }
    }
    /// The process's tier (`DEJAVU_ISA` if set, else the best this CPU has) on `threads` threads.
    pub fn new(threads: usize) -> Result<Self, BackendError> {
        let k = crate::kernels::table::kernels().map_err(|e| unsupported(e.to_string()))?;
        Ok(Self::of(*k, threads))
    }
    /// A given tier (tests compare tiers); an error if this CPU lacks it.
    pub fn with_isa(isa: Isa, threads: usize) -> Result<Self, BackendError> {
        let k = Kernels::for_isa(isa).ok_or_else(|| unsupported(format!("ISA tier {isa}")))?;
        Ok(Self::of(k, threads))
    }
    fn of(kernels: Kernels, threads: usize) -> Self {
        Self::from_backend(CpuBackend {
            kernels,
            pool: SpinPool::new(threads.max(1)),
        })
    }
    /// The device on `cpu`'s kernels and thread pool.
    pub fn from_backend(cpu: CpuBackend) -> Self {
        Self {
            rows: Mutex::new((vec![0], vec![0])),
            pos: AtomicUsize::new(0),
            n_rows: AtomicUsize::new(1),
            cpu,
            reference: false,
            world: None,
            f32_cache: false,
            file_layout: false,
            invariant: true,
        }
    }
    /// The kernels and pool as a [`crate::CpuBackend`] (for work outside a decode step: repacking,
    /// layouts, calibration).
    pub fn backend(&self) -> &CpuBackend {
        &self.cpu
    }
    pub fn threads(&self) -> usize {
        self.cpu.pool.threads()
    }
    /// Rank `rank` of `world` (its other ranks are other threads' devices), on the reference.
    pub fn rank(rank: usize, world: Arc<HostWorld>) -> Result<Self, BackendError> {
        if rank >= world.size() {
            return Err(shape(format!("rank {rank} of a world of {}", world.size())));
        }
        Ok(Self {
            world: Some((rank, world)),
            ..Self::reference()
        })
    }
    /// Caches of f32 values from now on (the KV cache at full precision; f16 by default).
    pub fn with_f32_cache(self) -> Self {
        Self {
            f32_cache: true,
            ..self
        }
    }
    /// A prompt's batches through the fastest kernels (`--deterministic false`): a dense batch's
    /// products in integer or f32 tiles and its attention in tiles from 16 tokens on, each
    /// token's values then differing from its decode step's by rounding, so a token's logits
    /// depend on how its prompt was split. Off by default.
    pub fn with_prompt_tiles(self) -> Self {
        Self {
            invariant: false,
            ..self
        }
    }
    /// Matrices uploaded for row products keep the file's row layout too (`--no-repack`: the
    /// model's weights then keep it, and so do the predictors').
    pub fn with_file_layout(self) -> Self {
        Self {
            file_layout: true,
            ..self
        }
    }
    pub fn isa(&self) -> Isa {
        self.cpu.kernels.isa
    }
}

fn unsupported(what: String) -> BackendError {
    BackendError::Unsupported {
        backend: "cpu".into(),
        what,
    }
}

fn shape(what: String) -> BackendError {
    BackendError::Shape(what)
}

fn need(what: &str, have: usize, want: usize) -> Result<(), BackendError> {
    match have >= want {
        true => Ok(()),
        false => Err(shape(format!("{what}: {have} values, needs {want}"))),
    }
}

/// The rows the outputs of `rows` read, checked against a matrix of `n` rows.
fn rows_of(rows: Rows<'_, Vec<u32>>, n: usize) -> Result<Vec<usize>, BackendError> {
    match rows {
        Rows::All => Ok((0..n).collect()),
        Rows::Sel { idx, count, group } => {
            need("selection", idx.len(), count)?;
            let out: Vec<usize> = (0..count * group)
                .map(|j| idx[j / group] as usize * group + j % group)
                .collect();
            match out.iter().find(|&&r| r >= n) {
                Some(r) => Err(shape(format!("row {r} of a {n}-row matrix"))),
                None => Ok(out),
            }
        }
    }
}

impl CpuDevice {
    fn pos(&self) -> usize {
        self.pos.load(Ordering::Relaxed)
    }
    /// The batch set has at least `rows` rows (and `rows` > 0).
    fn rows(&self, what: &str, rows: usize) -> Result<(), BackendError> {
        let have = self.n_rows.load(Ordering::Relaxed);
        match rows > 0 && rows <= have {
            true => Ok(()),
            false => Err(shape(format!("{what} of {rows} rows in a batch of {have}"))),
        }
    }
    /// [`Self::rows`], and a buffer of `x` values holds `rows` rows of `width`.
    fn batch(&self, what: &str, x: usize, width: usize, rows: usize) -> Result<(), BackendError> {
        self.rows(what, rows)?;
        need(what, x, rows * width)
    }
}

impl Device for CpuDevice {
    type Buf = Vec<f32>;
    type Idx = Vec<u32>;
    type Mat = CpuMat;
    type Cache = CpuCache;
    type Graph = ();

    /// Batch-invariant unless made [`CpuDevice::with_prompt_tiles`]: `Device::matmul` is then
    /// `Device::matmul_steps`, `Device::attention` of several rows runs each row through the
    /// decode kernels, the lazy K/V fill's products are the decode path's, and the sparse sums
    /// add in one order whatever the thread count.
    fn batch_invariant(&self) -> bool {
        self.invariant
    }
    fn name(&self) -> String {
        match self.reference {
            true => "cpu (f32 reference)".into(),
            false => format!(
                "cpu ({} threads, {})",
                self.cpu.pool.threads(),
                self.cpu.kernels.isa
            ),
        }
    }
    fn supports(&self, _qtype: QuantType) -> bool {
        true
    }
    fn zeros(&self, n: usize) -> Result<Vec<f32>, BackendError> {
        Ok(vec![0.0; n])
    }
    fn upload(&self, x: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(x.to_vec())
    }
    fn upload_idx(&self, idx: &[u32]) -> Result<Vec<u32>, BackendError> {
        Ok(idx.to_vec())
    }
    /// Either layout: the engine's repacked rows (any tier reads them) or the file's.
    fn upload_mat(&self, w: &Weight) -> Result<CpuMat, BackendError> {
        w.check();
        Ok(CpuMat::of(w, MatBytes::Owned(w.data.to_vec())))
    }
    /// Repacked where this tier repacks `w`'s type (as the model's weights are at load), unless
    /// the device keeps the file's layout ([`CpuDevice::with_file_layout`]).
    fn upload_rows(&self, w: &Weight) -> Result<CpuMat, BackendError> {
        use dejavu_backend_api::{Backend, RowLayout};
        if self.file_layout || w.layout != RowLayout::Ggml || !self.cpu.repacks(w.qtype) {
            return self.upload_mat(w);
        }
        w.check();
        let mut data = vec![0u8; w.data.len()];
        let layout = self.cpu.repack(w, &mut data);
        Ok(CpuMat::of(&w.with_layout(layout), MatBytes::Owned(data)))
    }
    /// In place when `w`'s bytes lie inside `owner`'s; a copy otherwise.
    fn share_mat(&self, w: &Weight, owner: &SharedBytes) -> Result<CpuMat, BackendError> {
        w.check();
        match range_in((**owner).as_ref(), w.data) {
            Some(r) => Ok(CpuMat::of(w, MatBytes::Shared(owner.clone(), r))),
            None => self.upload_mat(w),
        }
    }
    fn cache(&self, n_ctx: usize, width: usize) -> Result<CpuCache, BackendError> {
        CpuCache::new(self.f32_cache, n_ctx, width)
    }
    fn release(&self, cache: &mut CpuCache) -> Result<(), BackendError> {
        cache.release()
    }
    fn copy_cache(&self, src: &CpuCache, dst: &mut CpuCache, n: usize) -> Result<(), BackendError> {
        dst.copy_from(src, n)
    }
    fn download(&self, x: &Vec<f32>, out: &mut [f32]) -> Result<(), BackendError> {
        need("download", x.len(), out.len())?;
        out.copy_from_slice(&x[..out.len()]);
        Ok(())
    }
    fn download_idx(&self, x: &Vec<u32>, out: &mut [u32]) -> Result<(), BackendError> {
        need("download_idx", x.len(), out.len())?;
        out.copy_from_slice(&x[..out.len()]);
        Ok(())
    }
    fn write_idx(&self, x: &mut Vec<u32>, v: &[u32]) -> Result<(), BackendError> {
        need("write_idx", x.len(), v.len())?;
        x[..v.len()].copy_from_slice(v);
        Ok(())
    }
    fn set_step(&self, tokens: &[u32], pos: usize) -> Result<(), BackendError> {
        let positions: Vec<usize> = (pos..pos + tokens.len()).collect();
        self.set_steps(tokens, &positions)
    }
    fn set_steps(&self, tokens: &[u32], positions: &[usize]) -> Result<(), BackendError> {
        if tokens.is_empty() || tokens.len() > MAX_ROWS || positions.len() != tokens.len() {
            return Err(shape(format!(
                "a batch of {} rows at {} positions",
                tokens.len(),
                positions.len()
            )));
        }
        *self.rows.lock().expect("rows lock") = (tokens.to_vec(), positions.to_vec());
        self.pos.store(positions[0], Ordering::Relaxed);
        self.n_rows.store(tokens.len(), Ordering::Relaxed);
        Ok(())
    }

    fn embed(
        &self,
        t: &CpuMat,
        which: StepRow,
        acc: bool,
        x: &mut Vec<f32>,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.batch("embed output", x.len(), t.cols, rows)?;
        let (tokens, positions) = self.rows.lock().expect("rows lock").clone();
        let mut row = vec![0.0; t.cols];
        for (i, xr) in x.chunks_exact_mut(t.cols).take(rows).enumerate() {
            let r = match which {
                StepRow::Token { first } => (tokens[i] as usize).checked_sub(first),
                StepRow::Position { offset } => Some(positions[i] + offset),
            };
            match r {
                Some(r) if r < t.rows => t.row(r, &mut row),
                _ if acc => continue,
                _ => row.fill(0.0),
            }
            for (x, &v) in xr.iter_mut().zip(&row) {
                *x = if acc { *x + v } else { v };
            }
        }
        Ok(())
    }

    fn matvecs(&self, x: &Vec<f32>, jobs: &mut [Product<'_, Self>]) -> Result<(), BackendError> {
        self.products(x, jobs)
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.batch_products(x, rows, jobs, self.invariant)
    }

    fn matmul_steps(
        &self,
        x: &Vec<f32>,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.batch_products(x, rows, jobs, true)
    }

    fn axpy(
        &self,
        w: &CpuMat,
        rows: Rows<'_, Vec<u32>>,
        a: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.axpy_rows(w, rows, a, 1, bias, y)
    }

    fn axpys(
        &self,
        a: &Vec<f32>,
        mask: Option<InputMask<'_, Vec<f32>>>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.axpys_rows(a, mask, jobs)
    }

    fn axpy_steps(
        &self,
        w: &CpuMat,
        rows: Rows<'_, Vec<u32>>,
        a: &Vec<f32>,
        n: usize,
        bias: Option<&Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.axpy_rows(w, rows, a, n, bias, y)
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
        rows: usize,
    ) -> Result<(), BackendError> {
        let n = w.len();
        if rows == 0 {
            return Err(shape("rmsnorm of no rows".into()));
        }
        need("rmsnorm input", x.len(), rows * n)?;
        need("rmsnorm output", out.len(), rows * n)?;
        for r in 0..rows {
            ops::rmsnorm(&x[r * n..(r + 1) * n], w, eps, &mut out[r * n..(r + 1) * n]);
        }
        Ok(())
    }

    fn layernorm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: Option<&Vec<f32>>,
        eps: f32,
        out: &mut Vec<f32>,
        rows: usize,
    ) -> Result<(), BackendError> {
        let n = w.len();
        self.batch("layernorm input", x.len(), n, rows)?;
        self.batch("layernorm output", out.len(), n, rows)?;
        if let Some(b) = b {
            need("layernorm bias", b.len(), n)?;
        }
        let b = b.map(|b| &b[..n]);
        for r in 0..rows {
            let o = &mut out[r * n..(r + 1) * n];
            ops::layernorm(&x[r * n..(r + 1) * n], w, b, eps, o);
        }
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("add output", x.len(), n)?;
        need("add input", y.len(), n)?;
        (x[..n].iter_mut().zip(&y[..n])).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn scatter(
        &self,
        src: &Vec<f32>,
        idx: &Vec<u32>,
        count: usize,
        group: usize,
        dst: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        if group == 0 {
            return Err(shape("a scatter of groups of 0".into()));
        }
        need("scatter input", src.len(), count * group)?;
        need("scatter indices", idx.len(), count)?;
        for (&i, vs) in idx[..count].iter().zip(src.chunks_exact(group)) {
            let at = i as usize * group;
            for (g, &v) in vs.iter().enumerate() {
                if let Some(d) = dst.get_mut(at + g) {
                    *d = v;
                }
            }
        }
        Ok(())
    }

    fn gather(
        &self,
        src: &Vec<f32>,
        idx: &Vec<u32>,
        count: usize,
        group: usize,
        dst: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let sel = Rows::Sel { idx, count, group };
        let rs = rows_of(sel, src.len() / group.max(1) * group)?;
        need("gather output", dst.len(), rs.len())?;
        (dst.iter_mut().zip(&rs)).for_each(|(d, &r)| *d = src[r]);
        Ok(())
    }

    fn reads_input_blocks(&self) -> bool {
        true
    }

    fn input_break_even(&self, mats: &[&CpuMat], dense_bytes: usize) -> f64 {
        let shape = |m: &&CpuMat| m.weight().map(|w| (w.qtype, w.rows, w.cols));
        let ws: Result<Vec<_>, _> = mats.iter().map(shape).collect();
        ws.map_or(1.0, |ws| {
            crate::axpy_matmul::break_even(&ws, dense_bytes, self.isa())
        })
    }

    fn sparsify(
        &self,
        x: &Vec<f32>,
        n: usize,
        mask: InputMask<'_, Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        select::sparsify(x, n, mask, out)
    }

    fn abs(&self, x: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("abs", x.len(), n)?;
        x[..n].iter_mut().for_each(|v| *v = v.abs());
        Ok(())
    }

    fn count_nonzero(
        &self,
        x: &Vec<f32>,
        n: usize,
        group: usize,
        out: &mut Vec<f32>,
        slot: usize,
    ) -> Result<(), BackendError> {
        need("count_nonzero output", out.len(), slot + 1)?;
        out[slot] = select::count_nonzero(x, n, group)? as f32;
        Ok(())
    }

    fn group_norms(
        &self,
        x: &Vec<f32>,
        groups: usize,
        width: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        need("group_norms input", x.len(), groups * width)?;
        need("group_norms output", out.len(), groups)?;
        for (o, g) in out
            .iter_mut()
            .zip(x.chunks_exact(width.max(1)).take(groups))
        {
            *o = g.iter().map(|v| v * v).sum::<f32>().sqrt();
        }
        Ok(())
    }

    fn clear(&self, bufs: &mut [(&mut Vec<f32>, usize)]) -> Result<(), BackendError> {
        if bufs.len() > 3 {
            return Err(shape(format!(
                "{} buffers cleared in one call (at most 3)",
                bufs.len()
            )));
        }
        for (x, n) in bufs.iter_mut() {
            need("clear", x.len(), *n)?;
            x[..*n].fill(0.0);
        }
        Ok(())
    }

    fn copy(&self, x: &Vec<f32>, y: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("copy input", x.len(), n)?;
        need("copy output", y.len(), n)?;
        y[..n].copy_from_slice(&x[..n]);
        Ok(())
    }

    fn take_rows(
        &self,
        x: &Vec<f32>,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        need("take_rows input", x.len(), (r + n) * width)?;
        need("take_rows output", y.len(), n * width)?;
        y[..n * width].copy_from_slice(&x[r * width..(r + n) * width]);
        Ok(())
    }

    fn put_rows(
        &self,
        x: &Vec<f32>,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        need("put_rows input", x.len(), n * width)?;
        need("put_rows output", y.len(), (r + n) * width)?;
        y[r * width..(r + n) * width].copy_from_slice(&x[..n * width]);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        n_heads: usize,
        head_dim: usize,
        rope: Rotary<'_, Vec<f32>>,
        rows: usize,
    ) -> Result<(), BackendError> {
        let w = n_heads * head_dim;
        self.batch("rope", x.len(), w, rows)?;
        let factors = rope_factors(&rope, head_dim)?;
        // One call over the rows: the frequencies are computed once, not once a row.
        let (pos, theta, style) = (self.pos(), rope.theta, rope.style);
        ops::rope(
            &mut x[..rows * w],
            n_heads,
            head_dim,
            pos,
            theta,
            style,
            factors,
        );
        Ok(())
    }

    fn glu(
        &self,
        act: Activation,
        gate: &mut Vec<f32>,
        up: &Vec<f32>,
        n: usize,
    ) -> Result<(), BackendError> {
        need("glu gate", gate.len(), n)?;
        need("glu up", up.len(), n)?;
        let glu = self.cpu.kernels.glu;
        // A prompt's batch: chunks across the pool. Chunks start at multiples of 8, so each
        // value takes the same lane or tail path of the kernel as in one call.
        const CHUNK: usize = 8192;
        if n < 4 * CHUNK || self.cpu.pool.threads() == 1 {
            glu(act, &mut gate[..n], &up[..n]);
            return Ok(());
        }
        let gp = crate::matmul::SyncPtr::new(gate.as_mut_ptr());
        self.cpu.pool.run(n.div_ceil(CHUNK), &|i| {
            let (a, b) = (i * CHUNK, ((i + 1) * CHUNK).min(n));
            // SAFETY: chunk `i` is `gate[a..b]`, inside `gate[..n]` (checked above), written by
            // this task alone; `gate` outlives `pool.run`.
            let g = unsafe { std::slice::from_raw_parts_mut(gp.get().add(a), b - a) };
            glu(act, g, &up[a..b]);
        });
        Ok(())
    }

    fn activate(&self, act: Activation, x: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("activate", x.len(), n)?;
        ops::activate(act, &mut x[..n]);
        Ok(())
    }

    fn scale_cap(
        &self,
        x: &mut Vec<f32>,
        n: usize,
        s: f32,
        cap: Option<f32>,
    ) -> Result<(), BackendError> {
        need("scale_cap", x.len(), n)?;
        dejavu_backend_api::check_scale_cap(s, cap)?;
        ops::scale_cap(&mut x[..n], s, cap);
        Ok(())
    }

    fn store(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        kc: &mut CpuCache,
        vc: &mut CpuCache,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.batch("store", k.len(), kc.width, rows)?;
        self.batch("store", v.len(), vc.width, rows)?;
        self.store_row(k, kc, rows)?;
        self.store_row(v, vc, rows)
    }

    fn store_row(&self, x: &Vec<f32>, c: &mut CpuCache, rows: usize) -> Result<(), BackendError> {
        self.batch("store_row", x.len(), c.width, rows)?;
        let w = c.width;
        for (p, xr) in (self.pos()..c.n_ctx).zip(x.chunks_exact(w.max(1)).take(rows)) {
            c.put(p, 0, xr);
        }
        Ok(())
    }

    fn kv_fill(
        &self,
        job: LazyKv<'_, Self>,
        valid: &mut Vec<u32>,
        kc: &mut CpuCache,
        vc: &mut CpuCache,
    ) -> Result<(), BackendError> {
        self.fill_kv(job, valid, kc, vc)
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &CpuCache,
        v: &CpuCache,
        heads: Rows<'_, Vec<u32>>,
        g: AttnGeom,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.attend(q, k, v, heads, g, out)
    }

    fn attend_rows(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        rope: Option<Rotary<'_, Vec<f32>>>,
        g: AttnGeom,
        _layer: usize,
        rows: &mut [SeqRow<'_, Self>],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        // The reference device keeps to the definition: the caller's row-by-row one-row verbs.
        if self.reference {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: "attend_rows on the reference device (rows run one by one)".into(),
            });
        }
        self.attend_seqs(q, k, v, rope, g, rows, out)
    }

    fn top_k(
        &self,
        s: &Vec<f32>,
        n: usize,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), BackendError> {
        let sel = self.select(s, (0, n, k), out.len())?;
        out[..k].copy_from_slice(&sel);
        Ok(())
    }

    /// The selections side by side on the pool's threads (see `select.rs`).
    fn top_ks(&self, jobs: &mut [TopK<'_, Self>]) -> Result<(), BackendError> {
        self.select_rows(jobs)
    }

    fn sync(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn world(&self) -> (usize, usize) {
        self.world.as_ref().map_or((0, 1), |(r, w)| (*r, w.size()))
    }
    fn all_reduce(&self, x: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("all-reduce buffer", x.len(), n)?;
        match &self.world {
            Some((rank, w)) => w.all_reduce(*rank, &mut x[..n]),
            None => Ok(()),
        }
    }
    fn all_gather(&self, x: &Vec<f32>, n: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        need("all-gather input", x.len(), n)?;
        let size = self.world().1;
        need("all-gather output", out.len(), n * size)?;
        match &self.world {
            Some((rank, w)) => w.all_gather(*rank, &x[..n], &mut out[..n * size]),
            None => self.copy(x, out, n),
        }
    }
    fn begin_capture(&self) -> Result<bool, BackendError> {
        Ok(false)
    }
    fn end_capture(&self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            backend: self.name(),
            what: "recorded steps".into(),
        })
    }
    fn replay(&self, _g: &()) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            backend: self.name(),
            what: "recorded steps".into(),
        })
    }
}

/// A rotation's frequency divisors, `head_dim / 2` of them when given.
pub(crate) fn rope_factors<'a>(
    rope: &Rotary<'a, Vec<f32>>,
    head_dim: usize,
) -> Result<Option<&'a [f32]>, BackendError> {
    match rope.factors {
        Some(f) if f.len() != head_dim / 2 => Err(shape(format!(
            "{} RoPE frequency factors for heads of {head_dim}",
            f.len()
        ))),
        f => Ok(f.map(|f| f.as_slice())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{dot_repacked, testutil};
    use dejavu_backend_api::{Product, QuantType, RowLayout, Rows};

    /// `upload_rows` repacks the rows of a type the tier repacks (Q8_0, the predictors' type:
    /// on the x86 and NEON tiers) and keeps the file's layout elsewhere, and on a device that
    /// keeps the file's layout (`--no-repack`); its products equal
    /// those of the file's layout within rounding (1e-5 of `sum |w x|`), on rows of whole
    /// groups and a tail.
    #[test]
    fn rows_for_products_take_the_tiers_layout() {
        let (rows, cols, q) = (37, 32 * 8 * 2 + 32 * 3, QuantType::Q8_0);
        let data: Vec<u8> = (0..rows)
            .flat_map(|r| testutil::random_row(q, cols, r as u64 + 1))
            .collect();
        let w = Weight::new(q, rows, cols, &data).unwrap();
        let x = testutil::random_f32(cols, 5);
        for isa in Isa::supported() {
            let dev = CpuDevice::with_isa(isa, 2).unwrap();
            let (file, fast) = (dev.upload_mat(&w).unwrap(), dev.upload_rows(&w).unwrap());
            let want = match dot_repacked::repacks(isa, q) {
                true => RowLayout::Repacked,
                false => RowLayout::Ggml,
            };
            assert_eq!((file.layout, fast.layout), (RowLayout::Ggml, want), "{isa}");
            let kept = CpuDevice::with_isa(isa, 1).unwrap().with_file_layout();
            let kept = kept.upload_rows(&w).unwrap();
            assert_eq!(
                kept.layout,
                RowLayout::Ggml,
                "{isa}: --no-repack keeps the file's"
            );
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            let mut jobs = [Product::new(&file, Rows::All, &mut a)];
            dev.matvecs(&x, &mut jobs).unwrap();
            let mut jobs = [Product::new(&fast, Rows::All, &mut b)];
            dev.matvecs(&x, &mut jobs).unwrap();
            let mut deq = vec![0f32; cols];
            for (r, (a, b)) in a.iter().zip(&b).enumerate() {
                file.row(r, &mut deq);
                let mag: f32 = deq.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                assert!(
                    (a - b).abs() <= 1e-5 * mag + 1e-6,
                    "{isa} row {r}: {a} vs {b}"
                );
            }
        }
    }
}
