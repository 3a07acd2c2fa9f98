//! `out[j] = x . r_j` where `r_j = rows[j * stride..][..x.len()]`: one vector against many rows
//! of f32 or f16 (attention's query against the cached keys of an f32 or f16 KV cache).
//!
//! Reference: each element widened to f32 (exact), then a plain f32 sum per row, in order. The
//! SIMD tiers sum in 8-lane blocks with fused multiply-add (widening f16 with F16C on x86), so
//! they differ by rounding only.
use super::RowElem;
use crate::isa::Isa;
use half::f16;

/// `(x, rows, stride, out)`; `rows` holds `out.len()` rows at `stride`.
pub type DotRowsFn<T = f32> = fn(&[f32], &[T], usize, &mut [f32]);

pub fn select(isa: Isa) -> DotRowsFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// The same over f16 rows.
pub fn select_f16(isa: Isa) -> DotRowsFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

fn check<T>(x: &[f32], rows: &[T], stride: usize, out: &[f32]) {
    assert!(
        out.is_empty() || (stride >= x.len() && rows.len() >= (out.len() - 1) * stride + x.len()),
        "dot_rows: {} rows of {} at stride {stride} need more than {} elements",
        out.len(),
        x.len(),
        rows.len()
    );
}

pub fn scalar<T: RowElem>(x: &[f32], rows: &[T], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    for (j, o) in out.iter_mut().enumerate() {
        *o = x
            .iter()
            .zip(&rows[j * stride..])
            .map(|(a, b)| a * b.widen())
            .sum();
    }
}

pub fn portable<T: RowElem>(x: &[f32], rows: &[T], stride: usize, out: &mut [f32]) {
    use wide::f32x8;
    check(x, rows, stride, out);
    let n8 = x.len() / 8 * 8;
    for (j, o) in out.iter_mut().enumerate() {
        let r = &rows[j * stride..j * stride + x.len()];
        let mut acc = f32x8::ZERO;
        for c in (0..n8).step_by(8) {
            acc = T::load8(&r[c..]).mul_add(f32x8::from(&x[c..c + 8]), acc);
        }
        *o = acc.reduce_add()
            + x[n8..]
                .iter()
                .zip(&r[n8..])
                .map(|(a, b)| a * b.widen())
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

#[cfg(target_arch = "x86_64")]
fn avx2_f16(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    // SAFETY: handed out by `select_f16` only for tiers whose features (AVX2, FMA, F16C) this
    // CPU has; every row read lies inside `rows` (checked above).
    unsafe { avx2_f16_impl(x, rows, stride, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_f16_impl(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    use super::x86::hsum_ps;
    use std::arch::x86_64::*;
    let n = x.len();
    let n8 = n / 8 * 8;
    for (j, o) in out.iter_mut().enumerate() {
        let r = rows.as_ptr().add(j * stride);
        let mut acc = _mm256_setzero_ps();
        let mut c = 0;
        while c < n8 {
            let k = _mm256_cvtph_ps(_mm_loadu_si128(r.add(c) as *const __m128i));
            acc = _mm256_fmadd_ps(k, _mm256_loadu_ps(x.as_ptr().add(c)), acc);
            c += 8;
        }
        let mut s = hsum_ps(acc);
        for (i, &xi) in x.iter().enumerate().skip(n8) {
            s += xi * (*r.add(i)).to_f32();
        }
        *o = s;
    }
}

#[cfg(test)]
mod tests {
    use super::{DotRowsFn, RowElem};
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};

    /// Every tier within 1e-5 of the scalar reference relative to `sum |x_i r_i|`, on ragged
    /// widths, row counts and strides, for rows of `T` made from random f32 by `from`.
    fn tiers_match<T: RowElem>(select: fn(Isa) -> DotRowsFn<T>, from: fn(f32) -> T) {
        for isa in Isa::supported() {
            let f = select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let r: Vec<T> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(from)
                    .collect();
                let x = random_f32(n, 9 + n as u64);
                let (mut want, mut got) = (vec![0f32; rows], vec![f32::NAN; rows]);
                super::scalar(&x, &r, stride, &mut want);
                f(&x, &r, stride, &mut got);
                for j in 0..rows {
                    let mag: f32 = (0..n)
                        .map(|i| (x[i] * r[j * stride + i].widen()).abs())
                        .sum();
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} row {j}"
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
