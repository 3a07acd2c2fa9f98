//! `out[j] = x . r_j` where `r_j = rows[j * stride..][..x.len()]` are f16: attention's query
//! against the keys of an f16 KV cache (`--kv-type f16`).
//!
//! Reference: each key widened to f32 (exactly: every f16 is an f32), then a plain f32 sum in
//! order. The SIMD tiers widen 8 lanes at a time (F16C on x86) and sum with fused multiply-add,
//! so they differ by rounding only.
use crate::isa::Isa;
use half::f16;

/// `(x, rows, stride, out)`; `rows` holds `out.len()` rows at `stride`.
pub type DotRowsF16Fn = fn(&[f32], &[f16], usize, &mut [f32]);

pub fn select(isa: Isa) -> DotRowsF16Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable => portable,
        _ => scalar,
    }
}

fn check(x: &[f32], rows: &[f16], stride: usize, out: &[f32]) {
    super::dot_rows::check_rows("dot_rows_f16", out.len(), x.len(), rows.len(), stride);
}

pub fn scalar(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    for (j, o) in out.iter_mut().enumerate() {
        *o = x
            .iter()
            .zip(&rows[j * stride..])
            .map(|(a, b)| a * b.to_f32())
            .sum();
    }
}

pub fn portable(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    use wide::f32x8;
    check(x, rows, stride, out);
    let n8 = x.len() / 8 * 8;
    for (j, o) in out.iter_mut().enumerate() {
        let r = &rows[j * stride..j * stride + x.len()];
        let mut acc = f32x8::ZERO;
        for c in (0..n8).step_by(8) {
            let k: [f32; 8] = std::array::from_fn(|i| r[c + i].to_f32());
            acc = f32x8::from(k).mul_add(f32x8::from(&x[c..c + 8]), acc);
        }
        *o = acc.reduce_add() + (n8..x.len()).map(|i| x[i] * r[i].to_f32()).sum::<f32>();
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA, F16C) this CPU
    // has; every row read lies inside `rows` (checked above).
    unsafe { avx2_impl(x, rows, stride, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
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
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};
    use half::f16;

    /// Every tier within 1e-5 of the scalar reference relative to `sum |x_i r_i|`, on ragged
    /// widths, row counts and strides.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = super::select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let r: Vec<f16> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect();
                let x = random_f32(n, 9 + n as u64);
                let (mut want, mut got) = (vec![0f32; rows], vec![f32::NAN; rows]);
                super::scalar(&x, &r, stride, &mut want);
                f(&x, &r, stride, &mut got);
                for j in 0..rows {
                    let mag: f32 = (0..n)
                        .map(|i| (x[i] * r[j * stride + i].to_f32()).abs())
                        .sum();
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} row {j}"
                    );
                }
            }
        }
    }
}
