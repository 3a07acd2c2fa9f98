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

/// Rows dotted together by the x86 tiers: four independent sums in flight (a decode step's
/// keys are short rows, 64 or 128 values, so one sum's chain of multiply-adds and its own
/// horizontal sum would bound the loop), reduced together at the end.
#[cfg(target_arch = "x86_64")]
const BLOCK: usize = 4;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let row = |j: usize| rows.as_ptr().add(j * stride);
    rows_in_blocks(
        x,
        out,
        |c, j| _mm256_loadu_ps(row(j).add(c)),
        |i, j| *row(j).add(i),
    );
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
    use std::arch::x86_64::*;
    let row = |j: usize| rows.as_ptr().add(j * stride);
    let load =
        |c: usize, j: usize| _mm256_cvtph_ps(_mm_loadu_si128(row(j).add(c) as *const __m128i));
    rows_in_blocks(x, out, load, |i, j| (*row(j).add(i)).to_f32());
}

/// `out[j] = x . row j` for every `j`: the rows in blocks of [`BLOCK`], each row's eight-wide
/// sum over `x`'s whole groups of 8 (`load(c, j)`: row `j`'s values `c..c + 8`), the block's
/// sums reduced together, then the tail values (`value(i, j)`) added in order; the rows past
/// the last whole block one by one, the same way.
///
/// # Safety
/// The caller's tier has AVX2 and FMA (and what `load` needs); `load` and `value` read inside
/// the rows for every `j < out.len()`, `c + 8 <= x.len()` and `i < x.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_in_blocks(
    x: &[f32],
    out: &mut [f32],
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    value: impl Fn(usize, usize) -> f32,
) {
    use super::x86::hsum_ps;
    use std::arch::x86_64::*;
    let n8 = x.len() / 8 * 8;
    let tail = |j: usize| -> f32 {
        (x.iter().enumerate().skip(n8)).fold(0.0, |s, (i, &xi)| s + xi * value(i, j))
    };
    let full = out.len() / BLOCK * BLOCK;
    for j in (0..full).step_by(BLOCK) {
        let mut acc = [_mm256_setzero_ps(); BLOCK];
        for c in (0..n8).step_by(8) {
            let xv = _mm256_loadu_ps(x.as_ptr().add(c));
            for (b, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(load(c, j + b), xv, *a);
            }
        }
        // Four horizontal sums at once: pairs, then pairs of pairs, then the two halves.
        let (h01, h23) = (
            _mm256_hadd_ps(acc[0], acc[1]),
            _mm256_hadd_ps(acc[2], acc[3]),
        );
        let h = _mm256_hadd_ps(h01, h23);
        let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let mut s = [0f32; BLOCK];
        _mm_storeu_ps(s.as_mut_ptr(), sums);
        for (b, o) in out[j..j + BLOCK].iter_mut().enumerate() {
            *o = s[b] + tail(j + b);
        }
    }
    for (j, o) in out.iter_mut().enumerate().skip(full) {
        let mut acc = _mm256_setzero_ps();
        for c in (0..n8).step_by(8) {
            acc = _mm256_fmadd_ps(load(c, j), _mm256_loadu_ps(x.as_ptr().add(c)), acc);
        }
        *o = hsum_ps(acc) + tail(j);
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
