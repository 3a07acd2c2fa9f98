//! [`CpuDevice`]: the [`Device`] verbs on host memory, over the CPU backend's own kernels (the
//! kernel table of one ISA tier and the thread pool), so the device-resident decoder runs on the
//! CPU as it does on a GPU. [`CpuDevice::reference`] is the f32 reference (f32 activations dotted
//! with dequantized rows, one thread): what the CUDA kernels and the SIMD tiers are checked
//! against. [`CpuDevice::new`] runs the process's tier (`DEJAVU_ISA`) with 8-bit activations.
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
use crate::{attention, axpy_matmul, matmul, ops, CpuBackend};
use dejavu_backend_api::{
    Activation, AttnGeom, AttnShape, BackendError, Device, IndexSet, LazyKv, MatmulJob, Product,
    QuantType, RopeStyle, RowLayout, Rows, SharedBytes, StepRow, Weight, MAX_ROWS,
};
use std::sync::{Arc, Mutex};

mod cache;
mod mat;

pub use cache::CpuCache;
pub use mat::CpuMat;
use mat::{range_in, MatBytes};

pub struct CpuDevice {
    /// The batch's tokens and first position.
    step: Mutex<(Vec<u32>, usize)>,
    /// The kernel table and the thread pool.
    cpu: CpuBackend,
    /// The f32 reference ([`CpuDevice::reference`]).
    reference: bool,
    /// This device's rank in a tensor-parallel world of host threads, if any.
    world: Option<(usize, Arc<HostWorld>)>,
    /// Caches hold f32 rather than f16 ([`CpuDevice::with_f32_cache`]).
    f32_cache: bool,
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
            step: Mutex::new((vec![0], 0)),
            cpu,
            reference: false,
            world: None,
            f32_cache: false,
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
        self.step.lock().expect("step lock").1
    }
    /// The batch set has at least `rows` rows (and `rows` > 0).
    fn rows(&self, what: &str, rows: usize) -> Result<(), BackendError> {
        let have = self.step.lock().expect("step lock").0.len();
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

/// The rows a product reads as a set of the matrix's rows (for the backend's kernels), with the
/// row of each compact output (`None`: every row, output `j` being row `j`).
fn selection(
    rows: Rows<'_, Vec<u32>>,
    n: usize,
) -> Result<(IndexSet, Option<Vec<usize>>), BackendError> {
    match rows {
        Rows::All => Ok((IndexSet::full(n), None)),
        sel => {
            let rs = rows_of(sel, n)?;
            let idx = rs.iter().map(|&r| r as u32).collect();
            let set = IndexSet::from_unsorted(n, idx).map_err(|e| shape(e.to_string()))?;
            Ok((set, Some(rs)))
        }
    }
}

/// The outputs of a selection: its compact rows, or every row of `n`.
fn count(rs: &Option<Vec<usize>>, n: usize) -> usize {
    rs.as_ref().map_or(n, |rs| rs.len())
}

/// Finish one product: `y[j] = act(full[r] + bias[r])`, or with `accumulate`
/// `y[j] += full[r] + bias[r]`, `r` the row of output `j` (`rs[j]`, or `j` for every row).
/// `full = None`: the kernels wrote every row's dot into `y` itself.
fn finish(
    full: Option<&[f32]>,
    rs: Option<&[usize]>,
    bias: Option<&Vec<f32>>,
    act: Option<Activation>,
    accumulate: bool,
    y: &mut [f32],
) {
    for (j, y) in y.iter_mut().enumerate() {
        let r = rs.map_or(j, |rs| rs[j]);
        let s = full.map_or(*y, |f| f[r]) + bias.map_or(0.0, |b| b[r]);
        *y = match (accumulate, act) {
            (true, _) => *y + s,
            (false, Some(a)) => a.apply(s),
            (false, None) => s,
        };
    }
}

impl Device for CpuDevice {
    type Buf = Vec<f32>;
    type Idx = Vec<u32>;
    type Mat = CpuMat;
    type Cache = CpuCache;
    type Graph = ();

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
    /// In place when `w`'s bytes lie inside `owner`'s; a copy otherwise.
    fn share_mat(&self, w: &Weight, owner: &SharedBytes) -> Result<CpuMat, BackendError> {
        w.check();
        match range_in((**owner).as_ref(), w.data) {
            Some(r) => Ok(CpuMat::of(w, MatBytes::Shared(owner.clone(), r))),
            None => self.upload_mat(w),
        }
    }
    fn cache(&self, n_ctx: usize, width: usize) -> Result<CpuCache, BackendError> {
        Ok(CpuCache::new(self.f32_cache, n_ctx, width))
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
        if tokens.is_empty() || tokens.len() > MAX_ROWS {
            return Err(shape(format!("a batch of {} rows", tokens.len())));
        }
        *self.step.lock().expect("step lock") = (tokens.to_vec(), pos);
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
        let (tokens, pos) = self.step.lock().expect("step lock").clone();
        let mut row = vec![0.0; t.cols];
        for (i, xr) in x.chunks_exact_mut(t.cols).take(rows).enumerate() {
            let r = match which {
                StepRow::Token { first } => (tokens[i] as usize).checked_sub(first),
                StepRow::Position { offset } => Some(pos + i + offset),
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
        // Checked first: the kernels assert their lengths.
        let mut sels = Vec::with_capacity(jobs.len());
        for p in jobs.iter() {
            let w = p.w;
            let (set, rs) = selection(p.rows, w.rows)?;
            need("matvec input", p.x.unwrap_or(x).len(), w.cols)?;
            need("matvec output", p.y.len(), count(&rs, w.rows))?;
            if let Some(b) = p.bias {
                need("matvec bias", b.len(), w.rows)?;
            }
            sels.push((set, rs));
        }
        // Every row, overwritten: the kernels write `y` itself; otherwise a row-indexed scratch.
        let direct: Vec<bool> = (jobs.iter().zip(&sels))
            .map(|(p, s)| s.1.is_none() && !p.accumulate)
            .collect();
        let mut scratch: Vec<Vec<f32>> = (jobs.iter().zip(&direct))
            .map(|(p, &d)| if d { Vec::new() } else { vec![0f32; p.w.rows] })
            .collect();
        // Products of the call's input share one quantization of it and one pool dispatch
        // (their widths agree); products of their own inputs run one by one.
        let first = jobs.iter().find(|p| p.x.is_none()).map(|p| p.w.cols);
        let weights = jobs
            .iter()
            .map(|p| p.w.weight())
            .collect::<Result<Vec<_>, _>>()?;
        {
            let (mut shared, mut own) = (Vec::new(), Vec::new());
            let all = jobs.iter_mut().zip(scratch.iter_mut()).zip(&weights);
            for (i, ((p, sc), w)) in all.enumerate() {
                let y: &mut [f32] = match direct[i] {
                    true => &mut p.y[..w.rows],
                    false => sc,
                };
                let job = MatmulJob {
                    w: *w,
                    rows: &sels[i].0,
                    y,
                };
                match p.x {
                    None if Some(w.cols) == first => shared.push(job),
                    input => own.push((input.unwrap_or(x), job)),
                }
            }
            if let Some(cols) = first {
                matmul::matmul_shared(&self.cpu.kernels, &self.cpu.pool, &x[..cols], &mut shared);
            }
            for (xp, job) in own {
                let cols = job.w.cols;
                matmul::matmul_shared(&self.cpu.kernels, &self.cpu.pool, &xp[..cols], &mut [job]);
            }
        }
        for (i, p) in jobs.iter_mut().enumerate() {
            if direct[i] && p.bias.is_none() && p.act.is_none() {
                continue; // the kernels' output is the product's
            }
            let full = (!direct[i]).then_some(&scratch[i][..]);
            let y = &mut p.y[..count(&sels[i].1, p.w.rows)];
            finish(full, sels[i].1.as_deref(), p.bias, p.act, p.accumulate, y);
        }
        Ok(())
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        // Checked first: the kernels assert their lengths.
        for p in jobs.iter() {
            let (w, xp) = (p.w, p.x.unwrap_or(x));
            if !matches!(p.rows, Rows::All) {
                return Err(shape("a batch's products read every row".into()));
            }
            self.batch("matmul input", xp.len(), w.cols, rows)?;
            self.batch("matmul output", p.y.len(), w.rows, rows)?;
            if let Some(b) = p.bias {
                need("matmul bias", b.len(), w.rows)?;
            }
        }
        let alls: Vec<IndexSet> = jobs.iter().map(|p| IndexSet::full(p.w.rows)).collect();
        let weights = jobs
            .iter()
            .map(|p| p.w.weight())
            .collect::<Result<Vec<_>, _>>()?;
        // An accumulating product adds a scratch product to its output afterwards.
        let mut sums: Vec<Vec<f32>> = (jobs.iter())
            .map(|p| match p.accumulate {
                true => vec![0f32; rows * p.w.rows],
                false => Vec::new(),
            })
            .collect();
        {
            // Products of the call's input in one shared dispatch (their widths agree: Q, K and
            // V; gate and up); products of their own inputs one by one.
            let first = jobs.iter().find(|p| p.x.is_none()).map(|p| p.w.cols);
            let (mut shared, mut own) = (Vec::new(), Vec::new());
            let all = jobs
                .iter_mut()
                .zip(sums.iter_mut())
                .zip(&weights)
                .zip(&alls);
            for (((p, sum), w), set) in all {
                let n = rows * w.rows;
                let y: &mut [f32] = match p.accumulate {
                    true => sum,
                    false => &mut p.y[..n],
                };
                let job = MatmulJob {
                    w: *w,
                    rows: set,
                    y,
                };
                match p.x {
                    None if Some(w.cols) == first => shared.push(job),
                    input => own.push((input.unwrap_or(x), job)),
                }
            }
            if let Some(cols) = first {
                let xs = &x[..rows * cols];
                matmul::matmul_shared(&self.cpu.kernels, &self.cpu.pool, xs, &mut shared);
            }
            for (xp, job) in own {
                let xs = &xp[..rows * job.w.cols];
                matmul::matmul_shared(&self.cpu.kernels, &self.cpu.pool, xs, &mut [job]);
            }
        }
        for (p, sum) in jobs.iter_mut().zip(&sums) {
            if !p.accumulate && p.bias.is_none() && p.act.is_none() {
                continue;
            }
            let w = p.w.rows;
            for (r, yr) in p.y[..rows * w].chunks_exact_mut(w).enumerate() {
                let fr = p.accumulate.then(|| &sum[r * w..(r + 1) * w]);
                finish(fr, None, p.bias, p.act, p.accumulate, yr);
            }
        }
        Ok(())
    }

    fn axpy(
        &self,
        w: &CpuMat,
        rows: Rows<'_, Vec<u32>>,
        a: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        if w.layout != RowLayout::Ggml {
            return Err(shape(
                "axpy reads neuron-major rows in the file's layout".into(),
            ));
        }
        let rs = match rows {
            Rows::All => None,
            sel => Some(rows_of(sel, w.rows)?),
        };
        need("axpy activations", a.len(), count(&rs, w.rows))?;
        need("axpy output", y.len(), w.cols)?;
        if let Some(b) = bias {
            need("axpy bias", b.len(), w.cols)?;
        }
        // The compact activations back at their rows, for the kernel's row-indexed input; the
        // rows of zero activations go unread (the contract allows it: ReLU's zeros).
        let full = match &rs {
            None => a[..w.rows].to_vec(),
            Some(rs) => {
                let mut full = vec![0f32; w.rows];
                (rs.iter().zip(a.iter())).for_each(|(&r, &v)| full[r] += v);
                full
            }
        };
        let nonzero = (0..w.rows as u32)
            .filter(|&r| full[r as usize] != 0.0)
            .collect();
        let set = IndexSet::new(w.rows, nonzero).map_err(|e| shape(e.to_string()))?;
        let mut sum = vec![0f32; w.cols];
        let wt = w.weight()?;
        axpy_matmul::axpy_matmul(
            &self.cpu.kernels,
            &self.cpu.pool,
            &wt,
            &set,
            &full,
            &mut sum,
        );
        (y[..w.cols].iter_mut().zip(&sum)).for_each(|(y, s)| *y += s);
        if let Some(b) = bias {
            y[..w.cols].iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
        Ok(())
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
        self.batch("rmsnorm input", x.len(), n, rows)?;
        self.batch("rmsnorm output", out.len(), n, rows)?;
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
        n: usize,
        dst: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        need("scatter input", src.len(), n)?;
        need("scatter indices", idx.len(), n)?;
        for (&i, &v) in idx[..n].iter().zip(src) {
            if let Some(d) = dst.get_mut(i as usize) {
                *d = v;
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

    fn abs(&self, x: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("abs", x.len(), n)?;
        x[..n].iter_mut().for_each(|v| *v = v.abs());
        Ok(())
    }

    fn count_nonzero(
        &self,
        x: &Vec<f32>,
        n: usize,
        out: &mut Vec<f32>,
        slot: usize,
    ) -> Result<(), BackendError> {
        need("count_nonzero input", x.len(), n)?;
        need("count_nonzero output", out.len(), slot + 1)?;
        out[slot] = x[..n].iter().filter(|&&v| v != 0.0).count() as f32;
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

    fn rope(
        &self,
        x: &mut Vec<f32>,
        n_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
        rows: usize,
    ) -> Result<(), BackendError> {
        let w = n_heads * head_dim;
        self.batch("rope", x.len(), w, rows)?;
        let pos = self.pos();
        for (r, xr) in x.chunks_exact_mut(w.max(1)).take(rows).enumerate() {
            ops::rope(xr, n_heads, head_dim, pos + r, theta, style);
        }
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
        ops::glu(act, &mut gate[..n], &up[..n]);
        Ok(())
    }

    fn activate(&self, act: Activation, x: &mut Vec<f32>, n: usize) -> Result<(), BackendError> {
        need("activate", x.len(), n)?;
        ops::activate(act, &mut x[..n]);
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
            matmul::matmul_shared(&self.cpu.kernels, &self.cpu.pool, &x, &mut jobs);
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
                        if let Some((theta, style)) = rope {
                            ops::rope(out, 1, hd, p, theta, style);
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

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &CpuCache,
        v: &CpuCache,
        heads: Rows<'_, Vec<u32>>,
        g: AttnGeom,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let (hd, pos, rows) = (g.head_dim, self.pos(), g.rows);
        let width = g.n_kv_heads * hd;
        self.rows("attention", rows)?;
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
        };
        attention::attention(
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

    fn top_k(
        &self,
        s: &Vec<f32>,
        n: usize,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), BackendError> {
        need("top_k scores", s.len(), n)?;
        if k == 0 || k > n || out.len() < k {
            return Err(shape(format!(
                "top {k} of {n} into a list of {}",
                out.len()
            )));
        }
        let mut sel = Vec::with_capacity(k);
        match self.reference {
            true => sel = crate::top_k::top_k_reference(&s[..n], k),
            false => crate::top_k::top_k(&s[..n], k, &mut sel, &mut Vec::new()),
        }
        out[..k].copy_from_slice(&sel);
        Ok(())
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
