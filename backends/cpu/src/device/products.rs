//! The CPU device's products: a step's matrix-vector products over compact selections, a
//! batch's products over every row, and the sparse down projection (`Device::matvecs`,
//! `Device::matmul`, `Device::axpy`), on the backend's kernels and pool.
use super::{need, rows_of, shape, CpuDevice, CpuMat};
use crate::{axpy_matmul, matmul};
use dejavu_backend_api::{
    Activation, BackendError, IndexSet, InputMask, MatmulJob, Product, RowLayout, Rows,
};

impl CpuDevice {
    /// `Device::matvecs`: one row, every product over every row or a selection (compact).
    pub(super) fn products(
        &self,
        x: &Vec<f32>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        let what = ["matvec input", "matvec output", "matvec bias"];
        self.products_of(what, x, 1, jobs, false)
    }

    /// `Device::matmul` (every row of each matrix) and `Device::matmul_steps` (`steps`: each
    /// row as a one-row step computes it, over every row or a selection).
    pub(super) fn batch_products(
        &self,
        x: &Vec<f32>,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
        steps: bool,
    ) -> Result<(), BackendError> {
        if !steps && jobs.iter().any(|p| !matches!(p.rows, Rows::All)) {
            return Err(shape("a batch's products read every row".into()));
        }
        let what = ["matmul input", "matmul output", "matmul bias"];
        self.products_of(what, x, rows, jobs, steps)
    }

    /// `jobs` over `rows` rows of their inputs, each product's outputs compact over its
    /// selection (row `r` at `r * count`); `what` names the input, output and bias in errors.
    fn products_of(
        &self,
        what: [&str; 3],
        x: &Vec<f32>,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
        steps: bool,
    ) -> Result<(), BackendError> {
        // Checked first: the kernels assert their lengths.
        let mut sels = Vec::with_capacity(jobs.len());
        for p in jobs.iter() {
            let (w, xp) = (p.w, p.x.unwrap_or(x));
            if w.layout == RowLayout::InputBlocks {
                return Err(shape("an input-block matrix is read by axpy only".into()));
            }
            let (set, rs) = selection(p.rows, w.rows)?;
            self.batch(what[0], xp.len(), w.cols, rows)?;
            self.batch(what[1], p.y.len(), count(&rs, w.rows), rows)?;
            if let Some(b) = p.bias {
                need(what[2], b.len(), w.rows)?;
            }
            sels.push((set, rs));
        }
        let weights = jobs
            .iter()
            .map(|p| p.w.weight())
            .collect::<Result<Vec<_>, _>>()?;
        // Every row, overwritten: the kernels write `y` itself; otherwise (an accumulating
        // product, a selection) a row-indexed scratch, finished into `y` afterwards.
        let direct: Vec<bool> = (jobs.iter().zip(&sels))
            .map(|(p, s)| s.1.is_none() && !p.accumulate)
            .collect();
        let mut sums: Vec<Vec<f32>> = (jobs.iter().zip(&direct))
            .map(|(p, &d)| match d {
                true => Vec::new(),
                false => vec![0f32; rows * p.w.rows],
            })
            .collect();
        {
            let all = jobs.iter_mut().zip(sums.iter_mut()).zip(&weights);
            let runs = (all.enumerate())
                .map(|(i, ((p, sum), w))| {
                    let y: &mut [f32] = match direct[i] {
                        true => &mut p.y[..rows * w.rows],
                        false => sum,
                    };
                    let job = MatmulJob {
                        w: *w,
                        rows: &sels[i].0,
                        y,
                    };
                    (p.x.map(|v| &v[..]), job)
                })
                .collect();
            self.dispatch(x, rows, runs, steps);
        }
        for (i, (p, sum)) in jobs.iter_mut().zip(&sums).enumerate() {
            let (w, rs) = (p.w.rows, sels[i].1.as_deref());
            let n = count(&sels[i].1, w);
            if n == 0 || direct[i] && p.bias.is_none() && p.act.is_none() {
                continue; // the kernels' output is the product's
            }
            for (r, yr) in p.y[..rows * n].chunks_exact_mut(n).enumerate() {
                let fr = (!direct[i]).then(|| &sum[r * w..(r + 1) * w]);
                finish(fr, rs, p.bias, p.act, p.accumulate, yr);
            }
        }
        Ok(())
    }

    /// `jobs` over `rows` rows of their inputs (`None`: the call's `x`): the products of the
    /// call's input share one quantization of it and one pool dispatch (their widths agree: Q,
    /// K and V; gate and up); products of their own inputs run one by one.
    /// `steps`: through the decode path at any row count (see `matmul::matmul_shared_steps`).
    fn dispatch<'a>(
        &self,
        x: &[f32],
        rows: usize,
        jobs: Vec<(Option<&'a [f32]>, MatmulJob<'a>)>,
        steps: bool,
    ) {
        let first = (jobs.iter())
            .find(|(input, _)| input.is_none())
            .map(|(_, j)| j.w.cols);
        let (mut shared, mut own) = (Vec::new(), Vec::new());
        for (input, job) in jobs {
            match input {
                None if Some(job.w.cols) == first => shared.push(job),
                input => own.push((input.unwrap_or(x), job)),
            }
        }
        let (k, pool) = (&self.cpu.kernels, &self.cpu.pool);
        let run = match steps {
            true => matmul::matmul_shared_steps,
            false => matmul::matmul_shared,
        };
        if let Some(cols) = first {
            run(k, pool, &x[..rows * cols], &mut shared);
        }
        for (xp, job) in own {
            let cols = job.w.cols;
            run(k, pool, &xp[..rows * cols], &mut [job]);
        }
    }

    /// `Device::axpy_steps`: `n` rows of compact activations `a`, each row's sum added to its
    /// row of `y` (with the bias); each selected weight row read once for all of them.
    pub(super) fn axpy_rows(
        &self,
        w: &CpuMat,
        rows: Rows<'_, Vec<u32>>,
        a: &[f32],
        n: usize,
        bias: Option<&Vec<f32>>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        if w.layout == RowLayout::Repacked {
            return Err(shape(
                "axpy reads neuron-major rows in the file's or the input-block layout".into(),
            ));
        }
        if n == 0 {
            return Err(shape("an axpy of no rows".into()));
        }
        let rs = match rows {
            Rows::All => None,
            sel => Some(rows_of(sel, w.rows)?),
        };
        let per = count(&rs, w.rows);
        self.batch("axpy activations", a.len(), per, n)?;
        self.batch("axpy output", y.len(), w.cols, n)?;
        if let Some(b) = bias {
            need("axpy bias", b.len(), w.cols)?;
        }
        if w.layout == RowLayout::InputBlocks && rs.is_none() {
            // Every row's activations are already at their rows: the kernel reads `a` itself.
            let (wt, k) = (w.weight()?, &self.cpu.kernels);
            let y = &mut y[..n * w.cols];
            for (ar, yr) in a.chunks_exact(w.rows).zip(y.chunks_exact_mut(w.cols)) {
                axpy_matmul::axpy_blocks(k, &self.cpu.pool, &wt, ar, yr);
            }
            add_bias(bias, y, w.cols);
            return Ok(());
        }
        // The compact activations back at their rows, for the kernel's row-indexed input; the
        // rows of zero activations (in every row) go unread (the contract allows it: ReLU's
        // zeros).
        let mut full = vec![0f32; n * w.rows];
        let a_rows = a
            .chunks_exact(per.max(1))
            .take(if per == 0 { 0 } else { n });
        for (fr, ar) in full.chunks_exact_mut(w.rows).zip(a_rows) {
            match &rs {
                None => fr.copy_from_slice(ar),
                Some(rs) => (rs.iter().zip(ar)).for_each(|(&r, &v)| fr[r] += v),
            }
        }
        let wt = w.weight()?;
        let y = &mut y[..n * w.cols];
        if w.layout == RowLayout::InputBlocks {
            let k = &self.cpu.kernels;
            for (fr, yr) in full.chunks_exact(w.rows).zip(y.chunks_exact_mut(w.cols)) {
                axpy_matmul::axpy_blocks(k, &self.cpu.pool, &wt, fr, yr);
            }
        } else {
            // The rows with a nonzero activation in any batch row: one pass over each row's
            // activations (a scan per weight row, through an iterator each, cost 15 us a call
            // on SmolLM2's down projection).
            let mut kept = vec![false; w.rows];
            for fr in full.chunks_exact(w.rows) {
                (kept.iter_mut().zip(fr)).for_each(|(k, &v)| *k |= v != 0.0);
            }
            let nonzero = (0..w.rows as u32).filter(|&r| kept[r as usize]).collect();
            let set = IndexSet::new(w.rows, nonzero).map_err(|e| shape(e.to_string()))?;
            let mut sum = vec![0f32; n * w.cols];
            let k = &self.cpu.kernels;
            axpy_matmul::axpy_matmul(k, &self.cpu.pool, &wt, &set, &full, &mut sum);
            y.iter_mut().zip(&sum).for_each(|(y, s)| *y += s);
        }
        add_bias(bias, y, w.cols);
        Ok(())
    }

    /// `Device::axpys`: the products of one input's coefficients `a`; matrices in the
    /// input-block layout over every row (input sparsity's Q, K and V; gate and up) share one
    /// scan of `a` and one pool dispatch (`axpy_matmul::axpy_blocks_many`), others go one by one.
    /// A mask is applied to a copy of `a` (what `Device::sparsify` writes).
    pub(super) fn axpys_rows(
        &self,
        a: &[f32],
        mask: Option<InputMask<'_, Vec<f32>>>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        let masked;
        let a = match mask {
            None => a,
            Some(m) => {
                // The coefficients the jobs read.
                let n = (jobs.iter())
                    .map(|p| match p.rows {
                        Rows::All => p.w.rows,
                        Rows::Sel { count, group, .. } => count * group,
                    })
                    .max()
                    .unwrap_or(0);
                let mut out = vec![0.0; n];
                super::select::sparsify(a, n, m, &mut out)?;
                masked = out;
                &masked[..]
            }
        };
        let fused = |p: &Product<'_, Self>| {
            p.w.layout == RowLayout::InputBlocks && matches!(p.rows, Rows::All)
        };
        if jobs.is_empty() || jobs.len() > 3 {
            return Err(shape(format!(
                "{} axpys in one launch (1 to 3)",
                jobs.len()
            )));
        }
        if jobs.len() < 2 || !jobs.iter().all(|p| fused(p) && p.w.rows == jobs[0].w.rows) {
            for p in jobs.iter_mut() {
                self.axpy_rows(p.w, p.rows, a, 1, p.bias, p.y)?;
            }
            return Ok(());
        }
        let rows = jobs[0].w.rows;
        need("axpy activations", a.len(), rows)?;
        for p in jobs.iter() {
            need("axpy output", p.y.len(), p.w.cols)?;
            if let Some(b) = p.bias {
                need("axpy bias", b.len(), p.w.cols)?;
            }
        }
        let ws = (jobs.iter().map(|p| p.w.weight())).collect::<Result<Vec<_>, _>>()?;
        let mut ys: Vec<&mut [f32]> = (jobs.iter_mut()).map(|p| &mut p.y[..p.w.cols]).collect();
        let (k, pool) = (&self.cpu.kernels, &self.cpu.pool);
        axpy_matmul::axpy_blocks_many(k, pool, &ws, &a[..rows], &mut ys);
        for p in jobs.iter_mut() {
            add_bias(p.bias, &mut p.y[..p.w.cols], p.w.cols);
        }
        Ok(())
    }
}

/// `y += bias` on each row of `cols` outputs.
fn add_bias(bias: Option<&Vec<f32>>, y: &mut [f32], cols: usize) {
    if let Some(b) = bias {
        for yr in y.chunks_exact_mut(cols) {
            yr.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
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
    // Every row, added (W_o and the down projection into the residual): a plain loop.
    if let (Some(f), None, true) = (full, rs, accumulate) {
        for (j, y) in y.iter_mut().enumerate() {
            *y += f[j] + bias.map_or(0.0, |b| b[j]);
        }
        return;
    }
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
