//! `out[j] = x . r_j` where `r_j = rows[j * stride..][..x.len()]`: one vector against many f32 rows
//! (attention's query against the cached keys).
//!
//! Reference: a plain f32 sum per row, in order. The SIMD tiers sum in 8-lane blocks with fused
//! multiply-add, so they differ by rounding only.
use crate::isa::Isa;

/// `(x, rows, stride, out)`; `rows` holds `out.len()` rows at `stride`.
pub type DotRowsFn = fn(&[f32], &[f32], usize, &mut [f32]);

pub fn select(isa: Isa) -> DotRowsFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable => portable,
        _ => scalar,
    }
}

fn check(x: &[f32], rows: &[f32], stride: usize, out: &[f32]) {
    check_rows("dot_rows", out.len(), x.len(), rows.len(), stride);
}

/// Panic unless `n_rows` rows of `width` at `stride` fit in `len` elements (the SIMD tiers read
/// through raw pointers). Shared by the row kernels of any element type.
pub(crate) fn check_rows(op: &str, n_rows: usize, width: usize, len: usize, stride: usize) {
    assert!(
        n_rows == 0 || (stride >= width && len >= (n_rows - 1) * stride + width),
        "{op}: {n_rows} rows of {width} at stride {stride} need more than {len} elements"
    );
}

pub fn scalar(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    for (j, o) in out.iter_mut().enumerate() {
        *o = x.iter().zip(&rows[j * stride..]).map(|(a, b)| a * b).sum();
    }
}

pub fn portable(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    use wide::f32x8;
    check(x, rows, stride, out);
    let n8 = x.len() / 8 * 8;
    for (j, o) in out.iter_mut().enumerate() {
        let r = &rows[j * stride..j * stride + x.len()];
        let mut acc = f32x8::ZERO;
        for c in (0..n8).step_by(8) {
            acc = f32x8::from(&r[c..c + 8]).mul_add(f32x8::from(&x[c..c + 8]), acc);
        }
        *o = acc.reduce_add()
            + x[n8..]
                .iter()
                .zip(&r[n8..])
                .map(|(a, b)| a * b)
                .sum::<f32>();
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    // SAFETY: handed out by `select` only for tiers whose features this CPU has; bounds checked.
    unsafe { avx2_impl(x, rows, stride, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    use super::x86::hsum_ps;
    use std::arch::x86_64::*;
    let n = x.len();
    let n16 = n / 16 * 16;
    for (j, o) in out.iter_mut().enumerate() {
        let r = rows.as_ptr().add(j * stride);
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut c = 0;
        while c < n16 {
            a0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(r.add(c)),
                _mm256_loadu_ps(x.as_ptr().add(c)),
                a0,
            );
            a1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(r.add(c + 8)),
                _mm256_loadu_ps(x.as_ptr().add(c + 8)),
                a1,
            );
            c += 16;
        }
        let mut s = hsum_ps(_mm256_add_ps(a0, a1));
        for (i, &xi) in x.iter().enumerate().skip(n16) {
            s += xi * *r.add(i);
        }
        *o = s;
    }
}

#[cfg(test)]
mod tests {
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};

    /// Every tier within 1e-5 of the scalar reference relative to `sum |x_i r_i|`, on ragged
    /// widths, row counts and strides.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = super::select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let r = random_f32(rows * stride, n as u64);
                let x = random_f32(n, 9 + n as u64);
                let (mut want, mut got) = (vec![0f32; rows], vec![f32::NAN; rows]);
                super::scalar(&x, &r, stride, &mut want);
                f(&x, &r, stride, &mut got);
                for j in 0..rows {
                    let mag: f32 = (0..n).map(|i| (x[i] * r[j * stride + i]).abs()).sum();
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} row {j}"
                    );
                }
            }
        }
    }
}
