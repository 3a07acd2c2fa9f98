//! The contextual output head's bound (`dejavu::sparsity::head_bound`) scans a vocabulary's
//! logits once per step: each `x_i` raised by `delta` in place, then their maximum, whether one
//! is NaN, and `z = sum e^(x_i - top)` over the `x_i > floor`, with the count of the others.
//!
//! Reference (`scalar`): that in order, each term by the C library's `exp` in f64. The SIMD tier
//! (`portable`, every tier but the x86 ones) runs 8 lanes of `wide`'s polynomial `exp`, the x86
//! tiers (`avx2`) the same polynomial in AVX2 ([`super::x86::exp_ps`]); both sum in f32 over
//! 512 values, then in f64: within [`REL_ERR`] of the reference, relatively (tested), which the
//! bound allows for. A libm `expf` per value took 0.5 ms of a SmolLM2 step (49152 logits).
use crate::isa::Isa;
use wide::{f32x8, CmpGt, CmpLe};

/// What a scan found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tail {
    /// `sum e^(x - top)` over the values above `floor`.
    pub z: f64,
    /// The largest value (after `delta`); `-inf` for none; unspecified when one is NaN.
    pub max: f32,
    /// How many values are at most `floor` (NaNs are neither above nor counted).
    pub below: usize,
    pub nan: bool,
}

/// Relative error of a SIMD tier's `z` against the reference's: a few ulp of f32 per term and
/// the f32 sums of 512 terms.
pub const REL_ERR: f64 = 2e-5;

/// `(x, delta, top, floor)`.
pub type TailFn = fn(&mut [f32], f32, f32, f32) -> Tail;

pub fn select(isa: Isa) -> TailFn {
    match isa {
        Isa::Scalar => scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        _ => portable,
    }
}

pub fn scalar(x: &mut [f32], delta: f32, top: f32, floor: f32) -> Tail {
    let mut t = Tail {
        z: 0.0,
        max: f32::NEG_INFINITY,
        below: 0,
        nan: false,
    };
    for v in x.iter_mut() {
        *v += delta;
        t.nan |= v.is_nan();
        t.max = t.max.max(*v);
        if *v > floor {
            t.z += ((*v - top) as f64).exp();
        } else if *v <= floor {
            t.below += 1;
        }
    }
    t
}

/// Values per f32 partial sum.
const BLOCK: usize = 512;

pub fn portable(x: &mut [f32], delta: f32, top: f32, floor: f32) -> Tail {
    let (d, tp, fl) = (f32x8::splat(delta), f32x8::splat(top), f32x8::splat(floor));
    let (mut max, mut nan) = (f32x8::splat(f32::NEG_INFINITY), false);
    let (mut z, mut below) = (0f64, 0usize);
    let n8 = x.len() / 8 * 8;
    for block in x[..n8].chunks_mut(BLOCK) {
        let mut zb = f32x8::ZERO;
        for c in block.chunks_exact_mut(8) {
            let v = f32x8::from(&*c) + d;
            c.copy_from_slice(v.as_array_ref());
            nan |= v.is_nan().any();
            max = max.max(v);
            let above = v.cmp_gt(fl);
            zb += above.blend((v - tp).exp(), f32x8::ZERO);
            let le = v.cmp_le(fl);
            below += le.move_mask().count_ones() as usize;
        }
        z += zb.reduce_add() as f64;
    }
    let rest = scalar(&mut x[n8..], delta, top, floor);
    let max = (max.to_array().into_iter()).fold(rest.max, f32::max);
    Tail {
        z: z + rest.z,
        max,
        below: below + rest.below,
        nan: nan || rest.nan,
    }
}

/// The x86 tiers: [`portable`] in AVX2 intrinsics (`wide` compiles its 8 lanes as pairs of SSE
/// operations in a build for baseline x86-64).
#[cfg(target_arch = "x86_64")]
fn avx2(x: &mut [f32], delta: f32, top: f32, floor: f32) -> Tail {
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA) this CPU has.
    unsafe { avx2_impl(x, delta, top, floor) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(x: &mut [f32], delta: f32, top: f32, floor: f32) -> Tail {
    use super::x86::{exp_ps, hsum_ps};
    use std::arch::x86_64::*;
    let (d, tp, fl) = (
        _mm256_set1_ps(delta),
        _mm256_set1_ps(top),
        _mm256_set1_ps(floor),
    );
    let (mut max, mut nan) = (_mm256_set1_ps(f32::NEG_INFINITY), _mm256_setzero_ps());
    let (mut z, mut below) = (0f64, 0usize);
    let n8 = x.len() / 8 * 8;
    let p = x.as_mut_ptr();
    for b0 in (0..n8).step_by(BLOCK) {
        let mut zb = _mm256_setzero_ps();
        for c in (b0..(b0 + BLOCK).min(n8)).step_by(8) {
            // SAFETY: c + 8 <= n8 <= x.len().
            let v = _mm256_add_ps(_mm256_loadu_ps(p.add(c)), d);
            _mm256_storeu_ps(p.add(c), v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            max = _mm256_max_ps(max, v);
            let above = _mm256_cmp_ps::<_CMP_GT_OQ>(v, fl);
            zb = _mm256_add_ps(zb, _mm256_and_ps(above, exp_ps(_mm256_sub_ps(v, tp))));
            let le = _mm256_cmp_ps::<_CMP_LE_OQ>(v, fl);
            below += (_mm256_movemask_ps(le) as u32).count_ones() as usize;
        }
        z += hsum_ps(zb) as f64;
    }
    let rest = scalar(&mut x[n8..], delta, top, floor);
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), max);
    Tail {
        z: z + rest.z,
        max: lanes.into_iter().fold(rest.max, f32::max),
        below: below + rest.below,
        nan: _mm256_movemask_ps(nan) != 0 || rest.nan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_f32;

    /// Every tier against the reference on lengths around the lanes and the block, values
    /// spread over 40 logits around `floor` and `top`: `z` within [`REL_ERR`], the rest exact,
    /// and the values raised alike.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = select(isa);
            for n in [0usize, 1, 7, 8, 9, 63, 512, 513, 1000, 49_153] {
                let x: Vec<f32> = random_f32(n, n as u64 + 1)
                    .iter()
                    .map(|v| v * 20.0)
                    .collect();
                let (mut want, mut got) = (x.clone(), x.clone());
                let r = scalar(&mut want, 0.75, 10.0, -5.0);
                let g = f(&mut got, 0.75, 10.0, -5.0);
                assert!(
                    (g.z - r.z).abs() <= REL_ERR * r.z,
                    "{isa} n {n}: {} vs {}",
                    g.z,
                    r.z
                );
                assert_eq!(
                    (g.max, g.below, g.nan),
                    (r.max, r.below, r.nan),
                    "{isa} n {n}"
                );
                assert_eq!(got, want, "{isa} n {n}");
            }
        }
    }

    /// Each term alone over the range a step sums (0 to 30 below the top), every tier; a NaN in
    /// the lanes or the tail is reported and counted neither above nor below.
    #[test]
    fn terms_and_nans() {
        for isa in Isa::supported() {
            let f = select(isa);
            for i in 0..=3000 {
                let v = -(i as f32) * 1e-2;
                let got = f(&mut [v; 8], 0.0, 0.0, -31.0).z / 8.0;
                let want = (v as f64).exp();
                assert!(
                    (got - want).abs() <= REL_ERR * want,
                    "{isa} {v}: {got} vs {want}"
                );
            }
            for at in [2, 9] {
                let mut y = vec![0.0, -50.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
                y[at] = f32::NAN;
                let t = f(&mut y, 0.0, 8.0, -30.0);
                assert!(t.nan && t.below == 1, "{isa} {at}: {t:?}");
            }
        }
    }
}
