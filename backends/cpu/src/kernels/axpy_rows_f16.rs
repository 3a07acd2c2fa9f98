//! `y += sum_j a[j] * x_j` where `x_j = x[j * stride..][..y.len()]` are f16: attention's
//! weighted sum of the values of an f16 KV cache (`--kv-type f16`).
//!
//! Reference: for each j in order, `y[i] += a[j] * f32(x_j[i])` (widening is exact). The SIMD
//! tiers keep 8 columns of `y` in a register across all rows and use fused multiply-add, so they
//! differ from the reference by rounding only.
use crate::isa::Isa;
use half::f16;

/// `(a, x, stride, y)`; `x` holds `a.len()` rows at `stride` (the last may end at `y.len()`).
pub type AxpyRowsF16Fn = fn(&[f32], &[f16], usize, &mut [f32]);

pub fn select(isa: Isa) -> AxpyRowsF16Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable => portable,
        _ => scalar,
    }
}

fn check(a: &[f32], x: &[f16], stride: usize, y: &[f32]) {
    super::dot_rows::check_rows("axpy_rows_f16", a.len(), y.len(), x.len(), stride);
}

pub fn scalar(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    let n = y.len();
    for (j, &aj) in a.iter().enumerate() {
        for (yi, xi) in y.iter_mut().zip(&x[j * stride..j * stride + n]) {
            *yi += aj * xi.to_f32();
        }
    }
}

pub fn portable(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    use wide::f32x8;
    check(a, x, stride, y);
    let n8 = y.len() / 8 * 8;
    for c in (0..n8).step_by(8) {
        let mut acc = f32x8::from(&y[c..c + 8]);
        for (j, &aj) in a.iter().enumerate() {
            let v: [f32; 8] = std::array::from_fn(|i| x[j * stride + c + i].to_f32());
            acc = f32x8::from(v).mul_add(f32x8::splat(aj), acc);
        }
        y[c..c + 8].copy_from_slice(&acc.to_array());
    }
    tail(a, x, stride, y, n8);
}

/// Columns `from..` of `y`, in scalar.
fn tail(a: &[f32], x: &[f16], stride: usize, y: &mut [f32], from: usize) {
    for (j, &aj) in a.iter().enumerate() {
        for i in from..y.len() {
            y[i] += aj * x[j * stride + i].to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA, F16C) this CPU
    // has; every row read lies inside `x` (checked above).
    unsafe { avx2_impl(a, x, stride, y) };
    tail(a, x, stride, y, y.len() / 8 * 8);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = y.len() / 8 * 8;
    let xp = x.as_ptr();
    let mut c = 0;
    while c < n8 {
        let mut acc = _mm256_loadu_ps(y.as_ptr().add(c));
        for (j, &aj) in a.iter().enumerate() {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(xp.add(j * stride + c) as *const __m128i));
            acc = _mm256_fmadd_ps(v, _mm256_set1_ps(aj), acc);
        }
        _mm256_storeu_ps(y.as_mut_ptr().add(c), acc);
        c += 8;
    }
}

#[cfg(test)]
mod tests {
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};
    use half::f16;

    /// Every tier within 1e-5 of the scalar reference relative to `sum |a_j x_ji|`, on ragged
    /// widths, row counts and strides.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = super::select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let x: Vec<f16> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect();
                let a = random_f32(rows, 5 + n as u64);
                let y0 = random_f32(n, 7);
                let (mut want, mut got) = (y0.clone(), y0.clone());
                super::scalar(&a, &x, stride, &mut want);
                f(&a, &x, stride, &mut got);
                for i in 0..n {
                    let mag: f32 = y0[i].abs()
                        + (0..rows)
                            .map(|j| (a[j] * x[j * stride + i].to_f32()).abs())
                            .sum::<f32>();
                    assert!(
                        (got[i] - want[i]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} col {i}"
                    );
                }
            }
        }
    }
}
