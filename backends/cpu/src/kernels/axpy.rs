//! `y += sum_j a[j] * x_j` where `x_j = x[j * stride..][..y.len()]`: a weighted sum of rows of
//! f32 or f16 (attention's sum of value rows, of an f32 or f16 KV cache; the sparse path's rows
//! of a neuron-major down projection).
//!
//! Reference: for each j in order, `y[i] += a[j] * x_j[i]` (f16 widened to f32 exactly). The
//! SIMD tiers keep blocks of `y` in registers across all rows (no store-to-load chain through
//! `y`) and use fused multiply-add, so they differ from the reference by rounding only.
use super::RowElem;
use crate::isa::Isa;
use half::f16;

/// `(a, x, stride, y)`; `x` holds `a.len()` rows at `stride` (the last may end at `y.len()`).
pub type AxpyRowsFn<T = f32> = fn(&[f32], &[T], usize, &mut [f32]);

pub fn select(isa: Isa) -> AxpyRowsFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// The same over f16 rows.
pub fn select_f16(isa: Isa) -> AxpyRowsFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

fn check<T>(a: &[f32], x: &[T], stride: usize, y: &[f32]) {
    assert!(
        a.is_empty() || (stride >= y.len() && x.len() >= (a.len() - 1) * stride + y.len()),
        "axpy_rows: {} rows of {} at stride {stride} need more than {} elements",
        a.len(),
        y.len(),
        x.len()
    );
}

pub fn scalar<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    let n = y.len();
    for (j, &aj) in a.iter().enumerate() {
        for (yi, &xi) in y.iter_mut().zip(&x[j * stride..j * stride + n]) {
            *yi += aj * xi.widen();
        }
    }
}

pub fn portable<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32]) {
    use wide::f32x8;
    check(a, x, stride, y);
    let n8 = y.len() / 8 * 8;
    for c in (0..n8).step_by(8) {
        let mut acc = f32x8::from(&y[c..c + 8]);
        for (j, &aj) in a.iter().enumerate() {
            acc = T::load8(&x[j * stride + c..]).mul_add(f32x8::splat(aj), acc);
        }
        y[c..c + 8].copy_from_slice(&acc.to_array());
    }
    tail(a, x, stride, y, n8);
}

/// Columns `from..` of `y`, in scalar.
fn tail<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32], from: usize) {
    for (j, &aj) in a.iter().enumerate() {
        for i in from..y.len() {
            y[i] += aj * x[j * stride + i].widen();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(a: &[f32], x: &[f32], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA) this CPU has; the
    // bounds were checked above.
    unsafe { avx2_impl(a, x, stride, y) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(a: &[f32], x: &[f32], stride: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n32 = y.len() / 32 * 32;
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    // 32 columns at a time in 4 registers, every row accumulated before the store.
    for c in (0..n32).step_by(32) {
        let mut acc: [__m256; 4] = std::array::from_fn(|u| _mm256_loadu_ps(yp.add(c + 8 * u)));
        for (j, &aj) in a.iter().enumerate() {
            let av = _mm256_set1_ps(aj);
            let r = xp.add(j * stride + c);
            for (u, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(r.add(8 * u)), av, *acc);
            }
        }
        for (u, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(yp.add(c + 8 * u), *acc);
        }
    }
    let n8 = y.len() / 8 * 8;
    for c in (n32..n8).step_by(8) {
        let mut acc = _mm256_loadu_ps(yp.add(c));
        for (j, &aj) in a.iter().enumerate() {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(xp.add(j * stride + c)),
                _mm256_set1_ps(aj),
                acc,
            );
        }
        _mm256_storeu_ps(yp.add(c), acc);
    }
    tail(a, x, stride, y, n8);
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    // SAFETY: handed out by `select_f16` only for tiers whose features (AVX2, FMA, F16C) this
    // CPU has; every row read lies inside `x` (checked above).
    unsafe { avx2_f16_impl(a, x, stride, y) };
    tail(a, x, stride, y, y.len() / 8 * 8);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_f16_impl(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = y.len() / 8 * 8;
    let xp = x.as_ptr();
    for c in (0..n8).step_by(8) {
        let mut acc = _mm256_loadu_ps(y.as_ptr().add(c));
        for (j, &aj) in a.iter().enumerate() {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(xp.add(j * stride + c) as *const __m128i));
            acc = _mm256_fmadd_ps(v, _mm256_set1_ps(aj), acc);
        }
        _mm256_storeu_ps(y.as_mut_ptr().add(c), acc);
    }
}

#[cfg(test)]
mod tests {
    use super::{AxpyRowsFn, RowElem};
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};

    /// Every tier within 1e-5 of the scalar reference relative to `sum_j |a_j x_j[i]| + |y[i]|`,
    /// on ragged widths, row counts and strides, for rows of `T` made from random f32 by `from`.
    fn tiers_match<T: RowElem>(select: fn(Isa) -> AxpyRowsFn<T>, from: fn(f32) -> T) {
        for isa in Isa::supported() {
            let f = select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let x: Vec<T> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(from)
                    .collect();
                let a = random_f32(rows, 7 + rows as u64);
                let y0 = random_f32(n, 100 + n as u64);
                let (mut want, mut got) = (y0.clone(), y0.clone());
                super::scalar(&a, &x, stride, &mut want);
                f(&a, &x, stride, &mut got);
                for i in 0..n {
                    let mag: f32 = y0[i].abs()
                        + (0..rows)
                            .map(|j| (a[j] * x[j * stride + i].widen()).abs())
                            .sum::<f32>();
                    assert!(
                        (got[i] - want[i]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} rows {rows} i {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiers_match_reference() {
        tiers_match(super::select, |v| v);
    }

    #[test]
    fn f16_tiers_match_reference() {
        tiers_match(super::select_f16, half::f16::from_f32);
    }
}
