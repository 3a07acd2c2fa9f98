//! Quantize an f32 activation row to [`BlockQ8A`] blocks, once per matvec, so every weight row can
//! be dotted with integer arithmetic.
//!
//! Reference: per block of 32, `d = max|x| / 127`, `qs[i] = round(x[i] / d)` (ties away from 0),
//! `s = d * sum(qs)`; an all-zero block has `d = 0`, `qs = 0`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QK};

pub type QuantizeFn = fn(&[f32], &mut [BlockQ8A]);

pub fn select(isa: Isa) -> QuantizeFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// The length contract, checked by every tier in release builds: `x` fills `out` exactly.
#[inline(always)]
fn check(x: &[f32], out: &[BlockQ8A]) {
    assert!(
        x.len() == out.len() * QK,
        "activation quantization: {} values into {} blocks of {QK}",
        x.len(),
        out.len()
    );
}

pub fn scalar(x: &[f32], out: &mut [BlockQ8A]) {
    check(x, out);
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        b.d = d;
        b.s = d * sum as f32;
    }
}

pub fn portable(x: &[f32], out: &mut [BlockQ8A]) {
    check(x, out);
    use wide::f32x8;
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let v: [f32x8; 4] = std::array::from_fn(|i| f32x8::from(&xs[8 * i..8 * i + 8]));
        let amax = (v[0].abs().max(v[1].abs()))
            .max(v[2].abs().max(v[3].abs()))
            .to_array()
            .into_iter()
            .fold(0f32, f32::max);
        let d = amax / 127.0;
        let id = f32x8::splat(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut sum = 0i32;
        for (i, vi) in v.iter().enumerate() {
            let q = (*vi * id).round_int().to_array();
            for (j, &qq) in q.iter().enumerate() {
                b.qs[8 * i + j] = qq as i8;
                sum += qq;
            }
        }
        b.d = d;
        b.s = d * sum as f32;
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(x: &[f32], out: &mut [BlockQ8A]) {
    check(x, out);
    // SAFETY: `select` hands this out only for tiers whose features the CPU has (see Isa).
    unsafe { avx2_impl(x, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(x: &[f32], out: &mut [BlockQ8A]) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let p = xs.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let a = v.map(|vi| _mm256_andnot_ps(sign, vi));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // Round half away from zero, as the reference: trunc(x + copysign(0.5, x)).
        let r = v.map(|vi| {
            let s = _mm256_mul_ps(vi, id);
            let half = _mm256_or_ps(_mm256_and_ps(s, sign), _mm256_set1_ps(0.5));
            _mm256_cvttps_epi32(_mm256_add_ps(s, half))
        });
        // Pack 32 i32 -> 32 i8 in order.
        let p01 = _mm256_packs_epi32(r[0], r[1]);
        let p23 = _mm256_packs_epi32(r[2], r[3]);
        let p = _mm256_packs_epi16(p01, p23);
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, p);
        let s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
        let s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(s32),
            _mm256_extracti128_si256(s32, 1),
        );
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        b.d = d;
        b.s = d * _mm_cvtsi128_si32(s4) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_f32;

    #[test]
    fn every_tier_matches_the_reference() {
        for isa in Isa::supported() {
            for n_blocks in [1, 7, 31, 33, 129] {
                let mut x = random_f32(n_blocks * QK, n_blocks as u64);
                x[..QK].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
                if n_blocks > 1 {
                    x[QK] = 127.5 * x[QK + 1].abs().max(1e-3); // ties and a dominant value
                }
                let mut want = vec![
                    BlockQ8A {
                        d: 0.0,
                        s: 0.0,
                        qs: [0; QK]
                    };
                    n_blocks
                ];
                let mut got = want.clone();
                scalar(&x, &mut want);
                select(isa)(&x, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a.d, b.d, "{isa} block {i}");
                    let diff =
                        a.qs.iter()
                            .zip(&b.qs)
                            .map(|(p, q)| (*p as i32 - *q as i32).abs())
                            .max()
                            .unwrap();
                    // Reciprocal-multiply may land a hair on the other side of a .5 tie.
                    assert!(diff <= 1, "{isa} block {i}: qs differ by {diff}");
                    let want_s = a.d * a.qs.iter().map(|&q| q as i32).sum::<i32>() as f32;
                    assert_eq!(a.s, want_s, "{isa} block {i}: s = d * sum(qs)");
                }
            }
        }
    }
}
