//! Launch shapes of the products (matvec.cu, axpy.cu), `Device::clear` (elementwise.cu) and of the top-k selection (topk.cu):
//! the checks of every buffer against the sizes the kernels will touch, then one launch.
use crate::{launch, need, shape, type_suffix, Buf, CudaDevice, Idx, Mat};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dejavu_backend_api::{Activation, BackendError, InputMask, Product, QuantType, Rows, TopK};

/// One product of `matvec_jobs` (`MvJob` in matvec.cu: same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MvJob {
    w: u64,
    idx: u64,
    bias: u64,
    y: u64,
    pub(crate) x: u64,
    rows: i32,
    pub(crate) cols: i32,
    n_out: i32,
    group: i32,
    accumulate: i32,
    act: i32,
    first_block: i32,
    _pad: i32,
}

/// Most batch rows of one `matvec_rows_T` launch (`MVR_MAX` in matvec.cu).
pub(crate) const MVR_MAX: usize = 8;

/// `MvJobs` in matvec.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MvJobs {
    pub(crate) job: [MvJob; 3],
    pub(crate) n: i32,
    split: i32,
    /// Warps per output of `matvec_rows_T`, or blocks per tile of `matvec_hmma{n}_T` (1, 2, 4
    /// or 8).
    pub(crate) ks: i32,
    _pad: i32,
}

// SAFETY: plain `repr(C)` data of integers, laid out as the kernel's struct (8-byte pointers
// first, then 4-byte ints: no padding inside; 232 bytes in all).
unsafe impl cudarc::driver::DeviceRepr for MvJobs {}

/// One product of the `axpy` kernels (`AxJob` in axpy.cu: same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AxJob {
    w: u64,
    idx: u64,
    bias: u64,
    y: u64,
    rows: i32,
    cols: i32,
    n_out: i32,
    group: i32,
    first_tile: i32,
    _pad: i32,
}

/// `AxJobs` in axpy.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AxJobs {
    job: [AxJob; 3],
    input: AxIn,
    n: i32,
    _pad: i32,
}

/// `AxIn` in axpy.cu: the coefficients, and input sparsity's mask over them (`masked` 0: none).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AxIn {
    a: u64,
    scale: u64,
    t: f32,
    masked: i32,
}

/// The job of `axpy_rows_T` (`AxbJob` in axpy.cu: same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AxbJob {
    w: u64,
    idx: u64,
    bias: u64,
    a: u64,
    y: u64,
    rows: i32,
    cols: i32,
    n_out: i32,
    group: i32,
    nb: i32,
    passes: i32,
}

// SAFETY: 8-byte pointers, then 4-byte ints, as the kernel's struct: 64 bytes, no padding.
unsafe impl cudarc::driver::DeviceRepr for AxbJob {}

// SAFETY: as for `MvJobs`: 8-byte pointers, then 4-byte ints, each struct a multiple of 8
// bytes (56 a job, 184 in all), no padding inside.
unsafe impl cudarc::driver::DeviceRepr for AxJobs {}

/// One selection of `top_k_jobs` (`TkJob` in topk.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TkJob {
    s: u64,
    out: u64,
    n: i32,
    k: i32,
}

/// `TkJobs` in topk.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TkJobs {
    job: [TkJob; 3],
    n: i32,
    _pad: i32,
}

// SAFETY: as for `MvJobs`: pointers, then ints, no padding inside (80 bytes).
unsafe impl cudarc::driver::DeviceRepr for TkJobs {}

impl CudaDevice {
    /// `Device::matvecs`: one launch per weight type, each job reading its own input.
    pub(crate) fn launch_matvecs(
        &self,
        x: &Buf,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        if jobs.is_empty() || jobs.len() > 3 {
            return Err(shape(format!(
                "{} products in one launch (1 to 3)",
                jobs.len()
            )));
        }
        // One launch per weight type (a file may mix them: Q4_K with Q6_K rows).
        if jobs.iter().any(|p| p.w.qtype != jobs[0].w.qtype) {
            return jobs
                .iter_mut()
                .try_for_each(|p| self.launch_matvecs(x, std::slice::from_mut(p)));
        }
        let mut mv = MvJobs {
            n: jobs.len() as i32,
            ..Default::default()
        };
        let mut outs = Vec::new();
        for (i, p) in jobs.iter().enumerate() {
            let (w, px) = (p.w, p.x.unwrap_or(x));
            let (ip, n_out, group, o) = self.sel(p.rows, w.rows)?;
            need("matvec input", px.0.len(), w.cols)?;
            need("matvec output", p.y.0.len(), o)?;
            if let Some(b) = p.bias {
                need("matvec bias", b.0.len(), w.rows)?;
            }
            outs.push(o);
            mv.job[i] = MvJob {
                w: self.ptr(&w.data),
                idx: ip,
                bias: p.bias.map_or(0, |b| self.ptr(&b.0)),
                y: self.ptr(&p.y.0),
                x: self.ptr(&px.0),
                rows: w.rows as i32,
                cols: w.cols as i32,
                n_out,
                group,
                accumulate: p.accumulate as i32,
                act: p.act.map_or(-1, act_code),
                first_block: 0,
                _pad: 0,
            };
        }
        // Warps per output: 1 when the outputs fill the GPU `mv_fill` times over (`mv_fill_sel`
        // for gathers: their rows are scattered, so they need more in flight), else up to 8
        // (split-K).
        let (total, min_cols) = (
            outs.iter().sum::<usize>(),
            jobs.iter().map(|p| p.w.cols).min(),
        );
        let gather = jobs.iter().any(|p| matches!(p.rows, Rows::Sel { .. }));
        let fill = if gather {
            self.mv_fill_sel
        } else {
            self.mv_fill
        };
        let split = self.split_k(total, self.mv_rows, fill, min_cols.unwrap_or(0));
        // Outputs per block: 8 warps of `mv_rows` rows, or 8 / split under split-K.
        let per_block = if split == 1 {
            8 * self.mv_rows
        } else {
            8 / split
        };
        let blocks = first_blocks(&mut mv, &outs, per_block, 1);
        mv.split = split as i32;
        // Products of every row of a bf16 matrix, unsplit: the kernel that loads ahead (f16 has
        // one too, not the default: OPT-13B f16 dense ran 1-2% slower with it).
        let q = jobs[0].w.qtype;
        let ahead = split == 1
            && !gather
            && (q == QuantType::BF16 || self.mv_ahead_f16 && q == QuantType::F16);
        let f = match ahead {
            true => self.func(&format!("matvec_{}_ahead", type_suffix(q))),
            false => self.func(&format!("matvec_{}", type_suffix(q))),
        };
        let mut b = self.lane().launch_builder(f);
        b.arg(&mv);
        launch::run(b, launch::grid(blocks * 256, 256))
    }

    /// `Device::matmul` of a batch of 1 to [`MVR_MAX`] rows (`matvec_rows_T`): each weight row
    /// read once for every batch row (the prompt's tile kernel computes whole tiles of 32 or
    /// 64 batch rows). One weight type per launch; a product over every row or a selection
    /// (`Device::matmul_steps`: each row's outputs compact).
    pub(crate) fn launch_matvec_rows(
        &self,
        x: &Buf,
        nt: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.launch_matvec_rows_at(x, 0, nt, jobs)
    }

    /// [`Self::launch_matvec_rows`] of rows `t0..t0 + nt` of the inputs and outputs (a batch
    /// of more than [`MVR_MAX`] rows over a selection, in chunks).
    pub(crate) fn launch_matvec_rows_at(
        &self,
        x: &Buf,
        t0: usize,
        nt: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        rows_launch("in one launch", nt, MVR_MAX, jobs.len())?;
        if jobs.iter().any(|p| p.w.qtype != jobs[0].w.qtype) {
            return (jobs.iter_mut())
                .try_for_each(|p| self.launch_matvec_rows_at(x, t0, nt, std::slice::from_mut(p)));
        }
        // 8 warps a block, `ks` an output (split-K as the one-row matvec's, at `mvr_fill`).
        let (mut mv, outs) = self.rows_jobs(x, t0, nt, jobs)?;
        let min_cols = (jobs.iter().map(|p| p.w.cols).min()).unwrap_or(0);
        let ks = self.split_k(outs.iter().sum(), 1, self.mvr_fill, min_cols);
        let blocks = first_blocks(&mut mv, &outs, 8 / ks, 1);
        mv.ks = ks as i32;
        let f = self.func(&format!("matvec_rows_{}", type_suffix(jobs[0].w.qtype)));
        let mut b = self.lane().launch_builder(f);
        b.arg(&mv);
        launch::run(b, launch::grid(blocks * 256, 256))
    }

    /// Warps per output of the matvec kernels (1, 2, 4 or 8: split-K) for `total` outputs,
    /// `per_warp` a warp unsplit, 8 warps a block: doubled while the grid holds fewer than
    /// `fill` blocks per SM and the narrowest row (`min_cols`) gives each warp at least 256
    /// columns.
    fn split_k(&self, total: usize, per_warp: usize, fill: usize, min_cols: usize) -> usize {
        let mut split = 1;
        while split < 8
            && total.div_ceil(8 * per_warp / split) < fill * self.n_sm
            && min_cols >= 512 * split
        {
            split *= 2;
        }
        split
    }

    /// The `MvJobs` of rows `t0..t0 + nt` of a batch's products (one weight type), each job's
    /// extents checked, `split` holding `nt`, and each job's outputs (the caller assigns the
    /// blocks: [`first_blocks`]).
    pub(crate) fn rows_jobs(
        &self,
        x: &Buf,
        t0: usize,
        nt: usize,
        jobs: &[Product<'_, Self>],
    ) -> Result<(MvJobs, Vec<usize>), BackendError> {
        let mut mv = MvJobs {
            n: jobs.len() as i32,
            split: nt as i32,
            ..Default::default()
        };
        let (mut outs, end) = (Vec::with_capacity(jobs.len()), t0 + nt);
        for (i, p) in jobs.iter().enumerate() {
            let (w, px) = (p.w, p.x.unwrap_or(x));
            let (ip, n_out, group, o) = self.sel(p.rows, w.rows)?;
            need("matmul input", px.0.len(), end * w.cols)?;
            need("matmul output", p.y.0.len(), end * o)?;
            if let Some(b) = p.bias {
                need("matmul bias", b.0.len(), w.rows)?;
            }
            let f32s = std::mem::size_of::<f32>() as u64;
            mv.job[i] = MvJob {
                w: self.ptr(&w.data),
                idx: ip,
                bias: p.bias.map_or(0, |b| self.ptr(&b.0)),
                y: self.ptr(&p.y.0) + (t0 * o) as u64 * f32s,
                x: self.ptr(&px.0) + (t0 * w.cols) as u64 * f32s,
                rows: w.rows as i32,
                cols: w.cols as i32,
                n_out,
                group,
                accumulate: p.accumulate as i32,
                act: p.act.map_or(-1, act_code),
                first_block: 0,
                _pad: 0,
            };
            outs.push(o);
        }
        Ok((mv, outs))
    }

    /// `Device::axpy_steps`: one row through [`Self::launch_axpys`]'s kernel; more through
    /// `axpy_rows_T`, which reads each selected weight row once for `axb_rows` batch rows (in
    /// passes of that many rows, side by side), its outputs split into ranges so that the
    /// grid holds about `axb_fill` blocks per SM.
    pub(crate) fn launch_axpy_steps(
        &self,
        w: &Mat,
        rows: Rows<'_, Idx>,
        a: &Buf,
        n: usize,
        bias: Option<&Buf>,
        y: &mut Buf,
    ) -> Result<(), BackendError> {
        let (_, _, _, per) = self.sel(rows, w.rows)?;
        if n == 0 {
            return Err(shape("an axpy of no rows".into()));
        }
        need("axpy activations", a.0.len(), n * per)?;
        need("axpy output", y.0.len(), n * w.cols)?;
        if n == 1 {
            return self.axpy_at(
                w,
                rows,
                (self.ptr(&a.0), per),
                bias,
                (self.ptr(&y.0), w.cols),
            );
        }
        let (job, outs) = self.ax_job(w, rows, per, bias, (self.ptr(&y.0), w.cols), 0)?;
        let passes = n.div_ceil(self.axb_rows);
        let tiles = w.cols.div_ceil(256) * passes;
        let splits = (self.axb_fill * self.n_sm / tiles).clamp(1, outs.div_ceil(8).max(1));
        if n > i32::MAX as usize || tiles > i32::MAX as usize {
            return Err(shape(format!("an axpy of {n} rows of {}", w.cols)));
        }
        let axb = AxbJob {
            w: job.w,
            idx: job.idx,
            bias: job.bias,
            a: self.ptr(&a.0),
            y: job.y,
            rows: job.rows,
            cols: job.cols,
            n_out: job.n_out,
            group: job.group,
            nb: n as i32,
            passes: passes as i32,
        };
        self.launch_tiles(
            &format!("axpy_rows_{}", type_suffix(w.qtype)),
            &axb,
            (tiles, splits),
        )
    }

    /// Kernel `name` of one argument over a grid of `(tiles, splits)` blocks of 256 threads
    /// (the axpy kernels: tiles of columns, ranges of outputs).
    fn launch_tiles<A: cudarc::driver::DeviceRepr>(
        &self,
        name: &str,
        arg: &A,
        (tiles, splits): (usize, usize),
    ) -> Result<(), BackendError> {
        let mut b = self.lane().launch_builder(self.func(name));
        b.arg(arg);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch::run(b, cfg)
    }

    /// `Device::axpys`: each job in tiles of `256 * ax_vec` columns, one launch; the outputs
    /// (input rows) split into contiguous ranges so that the grid holds about `ax_fill` blocks
    /// per SM.
    pub(crate) fn launch_axpys(
        &self,
        a: &Buf,
        mask: Option<InputMask<'_, Buf>>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        if jobs.is_empty() || jobs.len() > 3 {
            return Err(shape(format!(
                "{} axpys in one launch (1 to 3)",
                jobs.len()
            )));
        }
        if jobs.iter().any(|p| p.w.qtype != jobs[0].w.qtype) {
            return jobs
                .iter_mut()
                .try_for_each(|p| self.launch_axpys(a, mask, std::slice::from_mut(p)));
        }
        let mut ax = AxJobs {
            input: AxIn {
                a: self.ptr(&a.0),
                ..Default::default()
            },
            n: jobs.len() as i32,
            ..Default::default()
        };
        let (mut tiles, mut most, mut read) = (0, 1, 0);
        for (i, p) in jobs.iter().enumerate() {
            let y = (self.ptr(&p.y.0), p.y.0.len());
            let outs;
            (ax.job[i], outs) = self.ax_job(p.w, p.rows, a.0.len(), p.bias, y, tiles)?;
            tiles += p.w.cols.div_ceil(256 * self.ax_vec);
            most = most.max(outs.div_ceil(8));
            read = read.max(outs);
        }
        if let Some(m) = mask {
            ax.input.masked = 1;
            ax.input.t = m.threshold;
            if let Some(sc) = m.scale {
                // A scale for each coefficient read.
                need("axpys mask scales", sc.0.len(), read)?;
                ax.input.scale = self.ptr(&sc.0);
            }
        }
        self.run_axpys(ax, tiles, most, jobs[0].w.qtype)
    }

    /// One axpy of `Device::axpy`'s, its activations and outputs given by address and length
    /// (a row of a batch's).
    fn axpy_at(
        &self,
        w: &Mat,
        rows: Rows<'_, Idx>,
        (a, a_len): (u64, usize),
        bias: Option<&Buf>,
        y: (u64, usize),
    ) -> Result<(), BackendError> {
        let (job, outs) = self.ax_job(w, rows, a_len, bias, y, 0)?;
        let mut ax = AxJobs {
            input: AxIn {
                a,
                ..Default::default()
            },
            n: 1,
            ..Default::default()
        };
        ax.job[0] = job;
        let tiles = w.cols.div_ceil(256 * self.ax_vec);
        self.run_axpys(ax, tiles, outs.div_ceil(8).max(1), w.qtype)
    }

    /// An axpy's job, checked (activations of `a_len` values, outputs at `y`, `y.1` values),
    /// its tiles from `first_tile` on; and its selection's outputs.
    fn ax_job(
        &self,
        w: &Mat,
        rows: Rows<'_, Idx>,
        a_len: usize,
        bias: Option<&Buf>,
        (y, y_len): (u64, usize),
        first_tile: usize,
    ) -> Result<(AxJob, usize), BackendError> {
        let (ip, n_out, group, outs) = self.sel(rows, w.rows)?;
        need("axpy activations", a_len, outs)?;
        need("axpy output", y_len, w.cols)?;
        if let Some(bb) = bias {
            need("axpy bias", bb.0.len(), w.cols)?;
        }
        let job = AxJob {
            w: self.ptr(&w.data),
            idx: ip,
            bias: bias.map_or(0, |bb| self.ptr(&bb.0)),
            y,
            rows: w.rows as i32,
            cols: w.cols as i32,
            n_out,
            group,
            first_tile: first_tile as i32,
            _pad: 0,
        };
        Ok((job, outs))
    }

    /// The axpy kernel over `tiles` tiles of columns, split so that the grid holds about
    /// `ax_fill` blocks per SM (at most `most` ranges of outputs).
    fn run_axpys(
        &self,
        ax: AxJobs,
        tiles: usize,
        most: usize,
        q: QuantType,
    ) -> Result<(), BackendError> {
        let splits = (self.ax_fill * self.n_sm / tiles.max(1)).clamp(1, most);
        self.launch_tiles(&format!("axpy_{}", type_suffix(q)), &ax, (tiles, splits))
    }

    /// `Device::clear`: up to 3 buffers in one launch.
    pub(crate) fn launch_clear(&self, bufs: &mut [(&mut Buf, usize)]) -> Result<(), BackendError> {
        if bufs.len() > 3 {
            return Err(shape(format!(
                "{} buffers cleared in one call (at most 3)",
                bufs.len()
            )));
        }
        let mut args = [(0u64, 0i32); 3];
        for (i, (x, n)) in bufs.iter().enumerate() {
            need("clear", x.0.len(), *n)?;
            if *n > i32::MAX as usize {
                return Err(shape(format!("clear of {n} values")));
            }
            args[i] = (self.ptr(&x.0), *n as i32);
        }
        let most = args.iter().map(|a| a.1 as usize).max().unwrap_or(0);
        let mut b = self.lane().launch_builder(self.func("clear_f32"));
        for (p, n) in &args {
            b.arg(p).arg(n);
        }
        launch::run(b, launch::grid(most, 256))
    }

    /// `Device::top_ks`: `top_k_hist` then `top_k_select` (topk.cu), blocks of 1024 threads, a
    /// row of blocks per selection (3 a launch), with `tk_scratch` as their global state; a
    /// selection of row `r` of its scores reads them from `r * n` on.
    pub(crate) fn launch_top_ks(&self, jobs: &mut [TopK<'_, Self>]) -> Result<(), BackendError> {
        if jobs.len() > 3 {
            return jobs.chunks_mut(3).try_for_each(|j| self.launch_top_ks(j));
        }
        if jobs.is_empty() {
            return Err(shape(format!(
                "{} top-k selections in one launch (1 to 3)",
                jobs.len()
            )));
        }
        let mut tk = TkJobs {
            n: jobs.len() as i32,
            ..Default::default()
        };
        for (i, j) in jobs.iter().enumerate() {
            let (n, k) = (j.n, j.k);
            let end = (j.row.checked_add(1).and_then(|r| r.checked_mul(n)))
                .ok_or_else(|| shape(format!("row {} of scores of {n}", j.row)))?;
            need("top_k scores", j.scores.0.len(), end)?;
            if k == 0 || k > n || j.out.0.len() < k || n > i32::MAX as usize {
                return Err(shape(format!(
                    "top {k} of {n} into a list of {}",
                    j.out.0.len()
                )));
            }
            tk.job[i] = TkJob {
                s: self.ptr(&j.scores.0) + (j.row * n * std::mem::size_of::<f32>()) as u64,
                out: self.ptr(&j.out.0),
                n: n as i32,
                k: k as i32,
            };
        }
        let n_max = jobs.iter().map(|j| j.n).max().unwrap_or(0);
        let grid = (n_max.div_ceil(1024) as u32, jobs.len() as u32, 1);
        let scratch = self.ptr(&self.tk_scratch);
        if n_max > 1024 {
            let mut b = self.lane().launch_builder(self.func("top_k_hist"));
            b.arg(&tk).arg(&scratch);
            let cfg = LaunchConfig {
                grid_dim: grid,
                ..launch::one_block(1024)
            };
            launch::run(b, cfg)?;
        }
        // The last block of a selection may need every score's key in shared memory.
        let smem = 4 * n_max;
        self.allow_smem("top_k_select", smem)?;
        let mut b = self.lane().launch_builder(self.func("top_k_select"));
        b.arg(&tk).arg(&scratch);
        let cfg = LaunchConfig {
            grid_dim: grid,
            shared_mem_bytes: smem as u32,
            ..launch::one_block(1024)
        };
        launch::run(b, cfg)
    }
}

/// A launch of `nt` batch rows (1 to `max`) of `n_jobs` products (1 to 3), `what` in the error.
pub(crate) fn rows_launch(
    what: &str,
    nt: usize,
    max: usize,
    n_jobs: usize,
) -> Result<(), BackendError> {
    match nt == 0 || nt > max || n_jobs == 0 || n_jobs > 3 {
        true => Err(shape(format!(
            "{n_jobs} products of {nt} rows {what} (1 to 3, 1 to {max} rows)"
        ))),
        false => Ok(()),
    }
}

/// Each job's first block, `per_block` outputs a block and `ks` blocks sharing them (split-K
/// between blocks; job `i` has `outs[i]`); returns the blocks of all.
pub(crate) fn first_blocks(mv: &mut MvJobs, outs: &[usize], per_block: usize, ks: usize) -> usize {
    let mut blocks = 0;
    for (job, o) in mv.job.iter_mut().zip(outs) {
        job.first_block = blocks as i32;
        blocks += o.div_ceil(per_block) * ks;
    }
    blocks
}

/// u32s of one selection's global state (`TkScratch` in topk.cu: a 4096-bin histogram, 4
/// counters, 8192 candidates).
pub(crate) const TK_SCRATCH: usize = 4096 + 4 + 8192;

/// `Activation` as the kernels' `act` (elementwise.cu).
pub(crate) fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::Relu => 1,
        Activation::GeluTanh => 2,
    }
}
