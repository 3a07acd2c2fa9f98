//! Gated activation: `gate[i] = act(gate[i]) * up[i]` (SwiGLU, GeGLU, gated ReLU).
//!
//! Reference: `crate::ops::glu` (`Activation::apply`, libm's `exp` and `tanh` per element).
//! The vector tier writes both smooth activations as `x * sigmoid(k)`: SiLU with `k = x`, the
//! tanh GELU with `k = 2 sqrt(2/pi) (x + 0.044715 x^3)` (since `(1 + tanh z) / 2 =
//! sigmoid(2z)`), with `wide`'s polynomial `exp`; it matches the reference within 1e-5 of the
//! value plus 1e-6 (tested). The x86 tiers run the same formulas in AVX2 intrinsics.
use crate::isa::Isa;
use dejavu_backend_api::Activation;

pub type GluFn = fn(Activation, &mut [f32], &[f32]);

pub fn select(isa: Isa) -> GluFn {
    match isa {
        Isa::Scalar => scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        _ => portable,
    }
}

/// The x86 tiers: [`portable`]'s formulas in AVX2 intrinsics with [`super::x86::exp_ps`]
/// (`wide` compiles its 8 lanes as pairs of SSE operations in a build for baseline x86-64).
#[cfg(target_arch = "x86_64")]
fn avx2(act: Activation, gate: &mut [f32], up: &[f32]) {
    check(gate, up);
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA) this CPU has;
    // `gate` and `up` have one length (checked).
    unsafe { avx2_impl(act, gate, up) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(act: Activation, gate: &mut [f32], up: &[f32]) {
    use super::x86::exp_ps;
    use std::arch::x86_64::*;
    let one = _mm256_set1_ps(1.0);
    // x * sigmoid(k), exp's argument clamped at 87 as in `portable`.
    let sigmoid_times = |x: __m256, k: __m256| {
        let e = exp_ps(_mm256_min_ps(
            _mm256_sub_ps(_mm256_setzero_ps(), k),
            _mm256_set1_ps(87.0),
        ));
        _mm256_div_ps(x, _mm256_add_ps(one, e))
    };
    let n8 = gate.len() / 8 * 8;
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    for c in (0..n8).step_by(8) {
        let x = _mm256_loadu_ps(g.add(c));
        let a = match act {
            Activation::Relu => _mm256_max_ps(x, _mm256_setzero_ps()),
            Activation::Silu => sigmoid_times(x, x),
            Activation::GeluTanh => {
                let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
                let inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715), x3, x);
                sigmoid_times(x, _mm256_mul_ps(_mm256_set1_ps(2.0 * 0.797_884_6), inner))
            }
        };
        _mm256_storeu_ps(g.add(c), _mm256_mul_ps(a, _mm256_loadu_ps(u.add(c))));
    }
    crate::ops::glu(act, &mut gate[n8..], &up[n8..]);
}

/// The length contract: one `up` per `gate`.
fn check(gate: &[f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "glu: {} gates, {} ups",
        gate.len(),
        up.len()
    );
}

pub fn scalar(act: Activation, gate: &mut [f32], up: &[f32]) {
    check(gate, up);
    crate::ops::glu(act, gate, up);
}

pub fn portable(act: Activation, gate: &mut [f32], up: &[f32]) {
    use wide::f32x8;
    check(gate, up);
    // exp(87) is finite; `wide`'s exp returns 0 from 87.3 on, so larger arguments are clamped
    // (the sigmoid of a value below -87 is 0 within f32 either way).
    let sigmoid_times = |x: f32x8, k: f32x8| x / (f32x8::ONE + (-k).min(f32x8::splat(87.0)).exp());
    let n8 = gate.len() / 8 * 8;
    for (g, u) in gate[..n8].chunks_exact_mut(8).zip(up.chunks_exact(8)) {
        let x = f32x8::from(&g[..]);
        let a = match act {
            Activation::Relu => x.max(f32x8::ZERO),
            Activation::Silu => sigmoid_times(x, x),
            Activation::GeluTanh => {
                const C2: f32 = 2.0 * 0.797_884_6; // 2 sqrt(2 / pi)
                let k = f32x8::splat(C2) * (x + f32x8::splat(0.044715) * x * x * x);
                sigmoid_times(x, k)
            }
        };
        g.copy_from_slice(&(a * f32x8::from(u)).to_array());
    }
    crate::ops::glu(act, &mut gate[n8..], &up[n8..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_f32;

    /// Every tier within 1e-5 of the reference's value plus 1e-6, on ragged lengths, values
    /// over the activations' whole working range, and the extremes (large negative inputs go
    /// to 0, not to the input).
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            for act in [Activation::Silu, Activation::GeluTanh, Activation::Relu] {
                for n in [0, 5, 8, 37, 1000] {
                    let mut x: Vec<f32> = random_f32(n, n as u64).iter().map(|v| v * 6.0).collect();
                    if n >= 8 {
                        x[..6].copy_from_slice(&[-200.0, -90.0, -20.0, 0.0, 30.0, 200.0]);
                    }
                    let up = random_f32(n, 99);
                    let (mut want, mut got) = (x.clone(), x.clone());
                    scalar(act, &mut want, &up);
                    select(isa)(act, &mut got, &up);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * b.abs() + 1e-6,
                            "{isa} {act:?} x {} up {}: {a} vs {b}",
                            x[i],
                            up[i]
                        );
                    }
                }
            }
        }
    }
}
