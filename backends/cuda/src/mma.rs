//! The launches of matvec_mma.cu: products of 2 to [`MMA_MAX`] batch rows (a step of several
//! sequences, a chunk of a prompt) over f16 or bf16 weights on the tensor cores. With `MMA_H=1`
//! each distinct input is split first into 16-bit parts (`mma_split_T`, into this lane's
//! scratch) and the product runs `matvec_hmma{n}_T` (m16n8k16 on the weights as loaded, each
//! row's chunks split between blocks where the tiles alone would leave SMs idle);
//! else, or where a split does not fit a slot, `matvec_mma{n}_T` (tf32, the input split in
//! registers).
use crate::products::{first_blocks, rows_launch, MvJobs};
use crate::{dev_err, launch, shape, type_suffix, Buf, CudaDevice};
use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use dejavu_backend_api::{BackendError, Product, QuantType};

/// Tiles of 8 batch rows of the `matvec_mma{n}_T` and `matvec_hmma{n}_T` kernels.
pub(crate) const MMA_TILES: [usize; 3] = [1, 2, 4];

/// Most batch rows of one `matvec_mma4_T` launch.
pub(crate) const MMA_MAX: usize = 32;

/// u16s of one split input's slot: 3 planes (bf16's parts) of `MMA_MAX` rows of 32768 columns,
/// then `MMA_MAX` ints (the f16 split's exponents). A wider input takes `matvec_mma{n}_T`.
pub(crate) const MMA_X_SLOT: usize = 3 * MMA_MAX * 32768 + 2 * MMA_MAX;

/// Slots per lane: the distinct inputs of one launch (at most 3 products).
pub(crate) const MMA_X_SLOTS: usize = 3;

/// f32s of the blocks' sums of a launch split between blocks (`matvec_hmma`'s `gpart`).
pub(crate) const MMA_PART: usize = 1 << 21;

/// Tiles of a launch split between blocks (`matvec_hmma`'s `gcount`).
pub(crate) const MMA_COUNT: usize = 1 << 16;

/// One lane's scratch for the tensor-core products of split inputs: the split inputs
/// ([`MMA_X_SLOTS`] of [`MMA_X_SLOT`] u16s), the blocks' sums ([`MMA_PART`]) and the tiles'
/// counters ([`MMA_COUNT`], zero between launches).
pub(crate) struct MmaScratch {
    x: CudaSlice<u16>,
    part: CudaSlice<f32>,
    count: CudaSlice<u32>,
}

impl MmaScratch {
    pub(crate) fn new(stream: &std::sync::Arc<CudaStream>) -> Result<Self, BackendError> {
        Ok(Self {
            x: (stream.alloc_zeros(MMA_X_SLOTS * MMA_X_SLOT)).map_err(dev_err)?,
            part: stream.alloc_zeros(MMA_PART).map_err(dev_err)?,
            count: stream.alloc_zeros(MMA_COUNT).map_err(dev_err)?,
        })
    }
}

/// One input of `mma_split_T` (`SplitJob` in matvec_mma.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SplitJob {
    x: u64,
    xs: u64,
    cols: i32,
    _pad: i32,
}

/// `SplitJobs` in matvec_mma.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SplitJobs {
    job: [SplitJob; 3],
    nt: i32,
    /// Columns per block of `mma_split_T`.
    chunk: i32,
}

// SAFETY: 8-byte pointers, then 4-byte ints, as the kernel's struct: 24 bytes a job, 80 in
// all, no padding inside.
unsafe impl cudarc::driver::DeviceRepr for SplitJobs {}

/// The 16-bit parts of an input of `qtype` (`Parts` in matvec_mma.cu).
fn parts(qtype: QuantType) -> usize {
    match qtype {
        QuantType::F16 => 2,
        _ => 3,
    }
}

impl CudaDevice {
    /// Can `jobs` go to the tensor cores? The kernels' types, rows a multiple of their
    /// 32-element chunks, and compute capability 8.0 (`self.mma`).
    pub(crate) fn mma_fits(&self, jobs: &[Product<'_, Self>]) -> bool {
        let q = |p: &Product<'_, Self>| matches!(p.w.qtype, QuantType::F16 | QuantType::BF16);
        self.mma && jobs.iter().all(|p| q(p) && p.w.cols % 32 == 0)
    }

    /// Rows `t0..t0 + nt` (1 to [`MMA_MAX`]) of a batch's products on the tensor cores (the
    /// caller checked [`Self::mma_fits`]): a block per 16 outputs of each job (`ks` of them on
    /// split inputs, [`Self::mma_ks`]), the kernel of the fewest tiles of 8 rows that hold `nt`.
    pub(crate) fn launch_mma_at(
        &self,
        x: &Buf,
        t0: usize,
        nt: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        rows_launch("on the tensor cores", nt, MMA_MAX, jobs.len())?;
        if jobs.iter().any(|p| p.w.qtype != jobs[0].w.qtype) {
            return (jobs.iter_mut())
                .try_for_each(|p| self.launch_mma_at(x, t0, nt, std::slice::from_mut(p)));
        }
        if let Some(p) = jobs.iter().find(|p| p.w.cols % 32 != 0) {
            return Err(shape(format!(
                "tensor-core products of rows of {}",
                p.w.cols
            )));
        }
        let (mut mv, outs) = self.rows_jobs(x, t0, nt, jobs)?;
        let tiles = MMA_TILES.into_iter().find(|t| 8 * t >= nt).unwrap_or(4);
        let q = type_suffix(jobs[0].w.qtype);
        let Some(scratch) = self.split_inputs(&mut mv, nt, jobs[0].w.qtype)? else {
            let blocks = first_blocks(&mut mv, &outs, 16, 1);
            let mut b = self
                .lane()
                .launch_builder(self.func(&format!("matvec_mma{tiles}_{q}")));
            b.arg(&mv);
            return launch::run(b, launch::grid(blocks * 256, 256));
        };
        let n_tiles: usize = outs.iter().map(|o| o.div_ceil(16)).sum();
        let min_cols = (jobs.iter().map(|p| p.w.cols).min()).unwrap_or(0);
        // Deterministic: the split-K of the widest tile, whatever the rows (a row's sum in one
        // order).
        let widest = if self.deterministic { 4 } else { tiles };
        let ks = self.mma_ks(n_tiles, min_cols, 16 * 8 * widest);
        let blocks = first_blocks(&mut mv, &outs, 16, ks);
        mv.ks = ks as i32;
        let mut b = self
            .lane()
            .launch_builder(self.func(&format!("matvec_hmma{tiles}_{q}")));
        b.arg(&mv);
        b.arg(&scratch.part);
        b.arg(&scratch.count);
        launch::run(b, launch::grid(blocks * 256, 256))
    }

    /// Blocks a tile of `matvec_hmma` (1, 2, 4 or 8: split-K): doubled while the grid holds
    /// fewer than `hmma_fill` blocks per SM, each block keeps at least 16 chunks of the
    /// narrowest row (`min_cols`), and the blocks' sums (`per_tile` floats each) and the tiles'
    /// counters fit this lane's scratch.
    fn mma_ks(&self, n_tiles: usize, min_cols: usize, per_tile: usize) -> usize {
        let mut ks = 1;
        while ks < 8
            && n_tiles * ks < self.hmma_fill * self.n_sm
            && min_cols / 32 >= 16 * 2 * ks
            && n_tiles * 2 * ks * per_tile <= MMA_PART
            && n_tiles <= MMA_COUNT
        {
            ks *= 2;
        }
        ks
    }

    /// With `MMA_H=1`, and where every split fits a slot: split each distinct input of `mv`
    /// (`nt` rows of its `cols`) into this lane's slots in one launch (`mma_split_T`), and
    /// point each job's `x` at its input's split;
    /// returns the lane's scratch. None (nothing launched, `mv` unchanged) otherwise.
    fn split_inputs(
        &self,
        mv: &mut MvJobs,
        nt: usize,
        qtype: QuantType,
    ) -> Result<Option<&MmaScratch>, BackendError> {
        let Some(scratch) = self.mma_scratch.as_ref().filter(|_| self.mma_h) else {
            return Ok(None);
        };
        let scratch = &scratch[self.lane_index()];
        let jobs = &mut mv.job[..mv.n as usize];
        // Deterministic: whether it fits `MMA_MAX` rows, so that the kernel is the same for
        // any rows.
        let most = if self.deterministic { MMA_MAX } else { nt };
        let fits = |cols: i32| parts(qtype) * most * cols as usize + 2 * most <= MMA_X_SLOT;
        if !jobs.iter().all(|j| fits(j.cols)) {
            return Ok(None);
        }
        let base = self.ptr(&scratch.x);
        let mut split = SplitJobs {
            nt: nt as i32,
            ..Default::default()
        };
        let mut n = 0;
        for j in jobs.iter_mut() {
            let s = match split.job[..n]
                .iter()
                .position(|s| s.x == j.x && s.cols == j.cols)
            {
                Some(s) => s,
                None => {
                    let xs = base + (n * MMA_X_SLOT * 2) as u64;
                    split.job[n] = SplitJob {
                        x: j.x,
                        xs,
                        cols: j.cols,
                        _pad: 0,
                    };
                    n += 1;
                    n - 1
                }
            };
            j.x = split.job[s].xs;
        }
        // Blocks of `chunk` columns (`blockIdx.x`) of each row (`.y`) of each input (`.z`):
        // `SPLIT_COLS`, or the widest input's columns (a block a row).
        let widest = (split.job[..n].iter().map(|s| s.cols as usize).max()).unwrap_or(0);
        let chunk = match self.split_cols {
            0 => widest.max(1),
            c => c,
        };
        split.chunk = chunk as i32;
        let q = type_suffix(qtype);
        let mut b = self
            .lane()
            .launch_builder(self.func(&format!("mma_split_{q}")));
        b.arg(&split);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (widest.div_ceil(chunk) as u32, nt as u32, n as u32),
            ..launch::grid(256, 256)
        };
        launch::run(b, cfg)?;
        Ok(Some(scratch))
    }
}
