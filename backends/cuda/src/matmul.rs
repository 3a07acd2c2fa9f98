//! The launch of matmul.cu: a prompt's products over a batch of rows, in 64 x 64 tiles, or
//! 32 x 32 where those would leave SMs idle (fewer blocks than SMs). A batch of at most
//! `MVR_MAX` rows (a step of several sequences) goes through `matvec_rows_T` instead, and a
//! batch of up to `MMA_MAX` rows of 16-bit weights through the tensor cores (matvec_mma.cu;
//! `MMA=1`, the default). Measured on the H200: a
//! 128-row batch through a 7168 x 7168 f16 matrix (224 tiles of 64) ran at 17.3 TFLOP/s in 64-row
//! tiles, 10.2 in 32-row ones; SmolLM2's products (18 to 96 tiles of 64) took pp128 from 16.4k
//! to 23.0k tok/s in 32-row tiles.
use crate::products::act_code;
use crate::{launch, need, shape, type_suffix, Buf, CudaDevice};
use cudarc::driver::PushKernelArg;
use dejavu_backend_api::{BackendError, Product, Rows};

/// Weight rows and batch rows per tile: `matmul_T`'s, `matmul_small_T`'s.
const TILES: [usize; 2] = [64, 32];

/// One product of `matmul_T` (`MmJob` in matmul.cu: same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MmJob {
    w: u64,
    bias: u64,
    x: u64,
    y: u64,
    n: i32,
    k: i32,
    accumulate: i32,
    act: i32,
    tiles_n: i32,
    first_block: i32,
    _pad: [i32; 2],
}

/// `MmJobs` in matmul.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MmJobs {
    job: [MmJob; 3],
    n_jobs: i32,
    nt: i32,
}

// SAFETY: plain `repr(C)` data laid out as the kernel's struct: 8-byte pointers, then 4-byte
// ints (an even number per job, so no padding anywhere; 200 bytes in all).
unsafe impl cudarc::driver::DeviceRepr for MmJobs {}

impl CudaDevice {
    /// `Device::matmul`: one launch per weight type, a block per tile of each job.
    pub(crate) fn launch_matmul(
        &self,
        x: &Buf,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.batch_rows("matmul", rows)?;
        if self.deterministic {
            return self.launch_invariant(x, rows, jobs);
        }
        let sel = jobs.iter().any(|p| matches!(p.rows, Rows::Sel { .. }));
        // A few rows (a step of several sequences), a selection, or with `MMA_PROMPT` any
        // batch, of 16-bit weights: the tensor cores, `MMA_MAX` rows a launch.
        let mma = crate::mma::MMA_MAX;
        if rows > 1 && self.mma_fits(jobs) && (rows <= mma || sel || self.mma_prompt) {
            return (0..rows)
                .step_by(mma)
                .try_for_each(|t0| self.launch_mma_at(x, t0, mma.min(rows - t0), jobs));
        }
        let mvr = crate::products::MVR_MAX;
        if rows <= mvr {
            return self.launch_matvec_rows(x, rows, jobs);
        }
        // A selection (`Device::matmul_steps` under a sparse plan): chunks of the row kernel.
        if sel {
            return (0..rows)
                .step_by(mvr)
                .try_for_each(|t0| self.launch_matvec_rows_at(x, t0, mvr.min(rows - t0), jobs));
        }
        if jobs.is_empty() || jobs.len() > 3 {
            return Err(shape(format!(
                "{} products in one launch (1 to 3)",
                jobs.len()
            )));
        }
        if jobs.iter().any(|p| p.w.qtype != jobs[0].w.qtype) {
            return (jobs.iter_mut())
                .try_for_each(|p| self.launch_matmul(x, rows, std::slice::from_mut(p)));
        }
        let mut mm = MmJobs {
            n_jobs: jobs.len() as i32,
            nt: rows as i32,
            ..Default::default()
        };
        let blocks_of = |t: usize| -> usize {
            let per = |p: &Product<'_, Self>| p.w.rows.div_ceil(t) * rows.div_ceil(t);
            jobs.iter().map(per).sum()
        };
        let small = blocks_of(TILES[0]) < self.n_sm;
        let tile = TILES[small as usize];
        let tiles_t = rows.div_ceil(tile);
        let mut blocks = 0;
        for (i, p) in jobs.iter().enumerate() {
            let (w, px) = (p.w, p.x.unwrap_or(x));
            if !matches!(p.rows, Rows::All) {
                return Err(shape("a batch's products read every row".into()));
            }
            need("matmul input", px.0.len(), rows * w.cols)?;
            need("matmul output", p.y.0.len(), rows * w.rows)?;
            if let Some(b) = p.bias {
                need("matmul bias", b.0.len(), w.rows)?;
            }
            let tiles_n = w.rows.div_ceil(tile);
            mm.job[i] = MmJob {
                w: self.ptr(&w.data),
                bias: p.bias.map_or(0, |b| self.ptr(&b.0)),
                x: self.ptr(&px.0),
                y: self.ptr(&p.y.0),
                n: w.rows as i32,
                k: w.cols as i32,
                accumulate: p.accumulate as i32,
                act: p.act.map_or(-1, act_code),
                tiles_n: tiles_n as i32,
                first_block: blocks as i32,
                _pad: [0; 2],
            };
            blocks += tiles_n * tiles_t;
        }
        let kind = if small { "matmul_small" } else { "matmul" };
        let f = self.func(&format!("{kind}_{}", type_suffix(jobs[0].w.qtype)));
        let mut b = self.lane().launch_builder(f);
        b.arg(&mm);
        launch::run(b, launch::grid(blocks * 256, 256))
    }

    /// `--deterministic` ([`CudaDevice::set_deterministic`]): rows `0..rows` of `jobs` through
    /// one kernel per product whatever `rows` is (one row, a step of several sequences, a
    /// prompt): the tensor cores' split-input kernel for 16-bit weights (`MMA_MAX` rows a
    /// launch, with `MMA_H=1`), else `matvec_rows_T` (`MVR_MAX` rows a launch). Each row's sum
    /// runs in one order: both kernels keep each batch row's accumulators apart, and their
    /// split-K (`mma_ks` at its widest tile, `split_k`) depends on the products' shapes only.
    /// A product whose kernel differs from its launch-mates' goes alone, so the kernel is
    /// each product's own.
    pub(crate) fn launch_invariant(
        &self,
        x: &Buf,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        let fits = |p: &Product<'_, Self>| self.mma_h && self.mma_fits(std::slice::from_ref(p));
        let mma = jobs.first().is_some_and(fits);
        let alike = |p: &Product<'_, Self>| p.w.qtype == jobs[0].w.qtype && fits(p) == mma;
        if !jobs.iter().all(alike) {
            return (jobs.iter_mut())
                .try_for_each(|p| self.launch_invariant(x, rows, std::slice::from_mut(p)));
        }
        let step = match mma {
            true => crate::mma::MMA_MAX,
            false => crate::products::MVR_MAX,
        };
        (0..rows).step_by(step).try_for_each(|t0| {
            let nt = step.min(rows - t0);
            match mma {
                true => self.launch_mma_at(x, t0, nt, jobs),
                false => self.launch_matvec_rows_at(x, t0, nt, jobs),
            }
        })
    }
}
