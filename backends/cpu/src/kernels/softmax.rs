//! Attention's softmax over one head's raw dot products, in place:
//! `x_j = score(s_j)` (the [`Scoring`]: scaled, then soft-capped `c * tanh(x / c)` where the
//! model caps), then `p_j = exp(x_j - max) / sum_k exp(x_k - max)`.
//!
//! Reference (`scalar`): that formula in order, with the C library's `exp` and a division per
//! value. The SIMD tier (`portable`, every other tier) runs 8 lanes of `wide`'s polynomial
//! `exp` (Cephes' degree-5 polynomial after a reduction by ln 2, within a few ulp over the
//! softmax's range `x - max <= 0`; 0 below -87.3, where the true value is under f32's normal
//! range) and multiplies by `1 / sum`: it differs from the reference by rounding only. The x86
//! tiers (`avx2`) run the same passes and polynomial in AVX2 intrinsics. The cap's
//! `tanh` stays scalar on every tier. A NaN score gives NaN everywhere on every tier: nothing
//! hides it.
use crate::isa::Isa;
use dejavu_backend_api::Scoring;
use wide::f32x8;

/// `(scores, scoring)`.
pub type SoftmaxFn = fn(&mut [f32], Scoring);

pub fn select(isa: Isa) -> SoftmaxFn {
    match isa {
        Isa::Scalar => scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        _ => portable,
    }
}

/// The x86 tiers: [`portable`]'s passes in AVX2 intrinsics with [`super::x86::exp_ps`] (`wide`
/// compiles its 8 lanes as pairs of SSE operations in a build for baseline x86-64).
#[cfg(target_arch = "x86_64")]
fn avx2(x: &mut [f32], sc: Scoring) {
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA) this CPU has.
    unsafe { avx2_impl(x, sc) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(x: &mut [f32], sc: Scoring) {
    use super::x86::{exp_ps, hsum_ps};
    use std::arch::x86_64::*;
    let (n8, p) = (x.len() / 8 * 8, x.as_mut_ptr());
    // Scores, their maximum, and whether any is NaN (an unordered self-compare).
    let (mut vmax, mut nan) = (_mm256_set1_ps(f32::NEG_INFINITY), _mm256_setzero_ps());
    match sc.softcap {
        None => {
            let scale = _mm256_set1_ps(sc.scale);
            for c in (0..n8).step_by(8) {
                let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), scale);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                vmax = _mm256_max_ps(vmax, v);
                _mm256_storeu_ps(p.add(c), v);
            }
            x[n8..].iter_mut().for_each(|v| *v = sc.score(*v));
        }
        Some(_) => x.iter_mut().for_each(|v| *v = sc.score(*v)),
    }
    // The values the vector pass did not see (all of them under a cap).
    let rest = &x[if sc.softcap.is_none() { n8 } else { 0 }..];
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
    let max = (lanes.iter().chain(rest)).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if _mm256_movemask_ps(nan) != 0 || rest.iter().any(|v| v.is_nan()) {
        return x.fill(f32::NAN);
    }
    // exp(x - max) in 8 lanes, the tail padded with -inf (whose exp is 0).
    let (m, mut vsum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for c in (0..n8).step_by(8) {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p.add(c)), m));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(p.add(c), e);
    }
    let tail = &mut x[n8..];
    if !tail.is_empty() {
        let mut pad = [f32::NEG_INFINITY; 8];
        pad[..tail.len()].copy_from_slice(tail);
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(pad.as_ptr()), m));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(pad.as_mut_ptr(), e);
        tail.copy_from_slice(&pad[..tail.len()]);
    }
    let inv = 1.0 / hsum_ps(vsum);
    let vinv = _mm256_set1_ps(inv);
    for c in (0..n8).step_by(8) {
        _mm256_storeu_ps(p.add(c), _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), vinv));
    }
    x[n8..].iter_mut().for_each(|v| *v *= inv);
}

pub fn scalar(x: &mut [f32], sc: Scoring) {
    x.iter_mut().for_each(|v| *v = sc.score(*v));
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if x.iter().any(|v| v.is_nan()) {
        return x.fill(f32::NAN);
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

pub fn portable(x: &mut [f32], sc: Scoring) {
    let n8 = x.len() / 8 * 8;
    // Scores, their maximum, and whether any is NaN.
    let (mut vmax, mut nan) = (f32x8::splat(f32::NEG_INFINITY), false);
    match sc.softcap {
        None => {
            let scale = f32x8::splat(sc.scale);
            for c in x[..n8].chunks_exact_mut(8) {
                let v = f32x8::from(&*c) * scale;
                nan |= v.is_nan().any();
                vmax = vmax.max(v);
                c.copy_from_slice(v.as_array_ref());
            }
            x[n8..].iter_mut().for_each(|v| *v = sc.score(*v));
        }
        Some(_) => x.iter_mut().for_each(|v| *v = sc.score(*v)),
    }
    // The values the vector pass did not see (all of them under a cap).
    let rest = &x[if sc.softcap.is_none() { n8 } else { 0 }..];
    let lanes = vmax.to_array();
    let max = (lanes.iter().chain(rest)).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if nan || rest.iter().any(|v| v.is_nan()) {
        return x.fill(f32::NAN);
    }
    // exp(x - max) in 8 lanes, the tail padded with -inf (whose exp is 0).
    let m = f32x8::splat(max);
    let mut vsum = f32x8::ZERO;
    for c in x[..n8].chunks_exact_mut(8) {
        let e = (f32x8::from(&*c) - m).exp();
        vsum += e;
        c.copy_from_slice(e.as_array_ref());
    }
    let tail = &mut x[n8..];
    if !tail.is_empty() {
        let mut pad = [f32::NEG_INFINITY; 8];
        pad[..tail.len()].copy_from_slice(tail);
        let e = (f32x8::from(pad) - m).exp();
        vsum += e;
        tail.copy_from_slice(&e.as_array_ref()[..tail.len()]);
    }
    let inv = f32x8::splat(1.0 / vsum.reduce_add());
    for c in x[..n8].chunks_exact_mut(8) {
        c.copy_from_slice((f32x8::from(&*c) * inv).as_array_ref());
    }
    let inv = inv.as_array_ref()[0];
    x[n8..].iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_f32;

    fn scorings() -> [Scoring; 2] {
        let plain = Scoring::plain(64);
        [
            Scoring {
                scale: 3.0,
                ..plain
            },
            Scoring {
                scale: 3.0,
                softcap: Some(5.0),
                ..plain
            },
        ]
    }

    /// Every tier within 2e-6 of the reference relative to each probability (plus 1e-9), on
    /// lengths around the 8 lanes and long ones, scores spread over +-6 (exp over ~36 units
    /// after the scale), with and without a cap; the probabilities sum to 1.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = select(isa);
            for n in [1usize, 2, 7, 8, 9, 16, 31, 64, 100, 1000] {
                for sc in scorings() {
                    let x: Vec<f32> = random_f32(n, n as u64).iter().map(|v| v * 3.0).collect();
                    let (mut want, mut got) = (x.clone(), x.clone());
                    scalar(&mut want, sc);
                    f(&mut got, sc);
                    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 2e-6 * w + 1e-9,
                            "{isa} n {n} {j}: {g} vs {w}"
                        );
                    }
                    let sum: f32 = got.iter().sum();
                    assert!((sum - 1.0).abs() < 1e-5, "{isa} n {n}: sum {sum}");
                }
            }
        }
    }

    /// A NaN score anywhere (lanes or tail) gives NaN everywhere; scores far below the max
    /// give 0, not garbage; an empty head is left empty.
    #[test]
    fn nan_spreads_and_far_scores_vanish() {
        for isa in Isa::supported() {
            let f = select(isa);
            for at in [0usize, 5, 8, 10] {
                let mut x = random_f32(11, 3);
                x[at] = f32::NAN;
                f(&mut x, Scoring::plain(4));
                assert!(x.iter().all(|v| v.is_nan()), "{isa}: NaN at {at}");
            }
            let mut x = vec![0.0, -1e6, -150.0, 0.0, -1e30, 0.0, 0.0, 0.0, -200.0];
            f(&mut x, Scoring::plain(1));
            assert_eq!((x[1], x[2], x[4], x[8]), (0.0, 0.0, 0.0, 0.0), "{isa}");
            assert!((x[0] - 0.2).abs() < 1e-6, "{isa}: {}", x[0]);
            f(&mut [], Scoring::plain(1));
        }
    }
}
