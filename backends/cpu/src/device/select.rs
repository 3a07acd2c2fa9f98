//! The CPU's top-k selections (`Device::top_k`, `Device::top_ks`): one row of a buffer of
//! scores each, several side by side on the pool; and the count of what a selection kept
//! (`Device::count_nonzero`).
use super::{need, shape, CpuDevice};
use dejavu_backend_api::{sparsify_ref, BackendError, InputMask, TopK};
use std::sync::Mutex;

impl CpuDevice {
    /// `Device::top_k` of row `row` of the scores `s` (`s[row * n..][..n]`) into a list of
    /// `out_len`: the `k` indices.
    pub(super) fn select(
        &self,
        s: &[f32],
        (row, n, k): (usize, usize, usize),
        out_len: usize,
    ) -> Result<Vec<u32>, BackendError> {
        let end = (row.checked_add(1).and_then(|r| r.checked_mul(n)))
            .ok_or_else(|| shape(format!("row {row} of scores of {n}")))?;
        need("top_k scores", s.len(), end)?;
        if k == 0 || k > n || out_len < k {
            return Err(shape(format!("top {k} of {n} into a list of {out_len}")));
        }
        let s = &s[row * n..end];
        let mut sel = Vec::with_capacity(k);
        match self.reference {
            true => sel = crate::top_k::top_k_reference(s, k),
            false => crate::top_k::top_k(s, k, &mut sel, &mut Vec::new()),
        }
        Ok(sel)
    }

    /// `Device::top_ks`: the selections side by side on the pool's threads (a step of several
    /// sequences' rows), each as `top_k`; every one is checked before any list is written.
    pub(super) fn select_rows(&self, jobs: &mut [TopK<'_, Self>]) -> Result<(), BackendError> {
        let picks: Vec<_> = (jobs.iter())
            .map(|_| Mutex::new(None::<Result<Vec<u32>, BackendError>>))
            .collect();
        self.cpu.pool.run(jobs.len(), &|i| {
            let j = &jobs[i];
            let sel = self.select(j.scores, (j.row, j.n, j.k), j.out.len());
            *picks[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(sel);
        });
        let picks: Vec<Vec<u32>> = (picks.into_iter())
            .map(|p| p.into_inner().unwrap_or_else(|e| e.into_inner()))
            .map(|p| p.unwrap_or_else(|| Err(shape("a top-k that did not run".into()))))
            .collect::<Result<_, _>>()?;
        for (j, sel) in jobs.iter_mut().zip(picks) {
            j.out[..sel.len()].copy_from_slice(&sel);
        }
        Ok(())
    }
}

/// `Device::sparsify`: `out[..n]` = the entries of `x[..n]` the mask keeps (`sparsify_ref`).
pub(super) fn sparsify(
    x: &[f32],
    n: usize,
    mask: InputMask<'_, Vec<f32>>,
    out: &mut [f32],
) -> Result<(), BackendError> {
    need("sparsify input", x.len(), n)?;
    need("sparsify output", out.len(), n)?;
    let scale = match mask.scale {
        Some(s) => {
            need("sparsify scales", s.len(), n)?;
            Some(&s[..n])
        }
        None => None,
    };
    sparsify_ref(&x[..n], mask.threshold, scale, &mut out[..n]);
    Ok(())
}

/// `Device::count_nonzero`'s count: the groups of `group` values of `x[..n]` that hold a nonzero.
/// (Run on every measured step: loops without early exits, which vectorise.)
pub(super) fn count_nonzero(x: &[f32], n: usize, group: usize) -> Result<usize, BackendError> {
    need("count_nonzero input", x.len(), n)?;
    if group == 0 {
        return Err(shape("count_nonzero: groups of 0 values".into()));
    }
    let nonzero = |g: &[f32]| g.iter().fold(false, |a, &v| a | (v != 0.0));
    Ok(match group {
        1 => x[..n].iter().filter(|&&v| v != 0.0).count(),
        _ => x[..n].chunks(group).filter(|g| nonzero(g)).count(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dejavu_backend_api::Device;

    /// A selection of row `r` of a buffer of scores reads that row (each row's best indices
    /// differ here), on the reference device and a tier; a row past the buffer is an error.
    #[test]
    fn top_ks_select_from_their_own_row() {
        let n = 6;
        // Row r's largest two are at (2r, 2r + 1) mod 6.
        let scores: Vec<f32> = (0..3 * n)
            .map(|i| {
                let (r, j) = (i / n, i % n);
                if j / 2 == r {
                    10.0 + j as f32
                } else {
                    j as f32 * 0.1
                }
            })
            .collect();
        for dev in [CpuDevice::reference(), CpuDevice::default()] {
            let mut outs = vec![vec![0u32; 2]; 3];
            let mut jobs: Vec<TopK<'_, CpuDevice>> = (outs.iter_mut().enumerate())
                .map(|(row, out)| TopK {
                    scores: &scores,
                    row,
                    n,
                    k: 2,
                    out,
                })
                .collect();
            dev.top_ks(&mut jobs).unwrap();
            for (r, o) in outs.iter_mut().enumerate() {
                o.sort_unstable();
                assert_eq!(*o, vec![2 * r as u32, 2 * r as u32 + 1], "row {r}");
            }
            let mut past = vec![0u32; 2];
            let bad = TopK {
                scores: &scores,
                row: 3,
                n,
                k: 2,
                out: &mut past,
            };
            assert!(dev.top_ks(&mut [bad]).is_err(), "a row past the scores");
        }
    }
}
