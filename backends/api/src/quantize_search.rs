//! ggml's scale searches (`ggml-quants.c`'s helpers), shared by the per-type quantizers of
//! [`crate::quantize_k`]: symmetric levels (`make_qx_quants`, `make_q3_quants`), levels with a
//! min (`make_qkx2/3_quants`), the non-negative sub-block scales (`make_qp_quants`), and ggml's
//! rounding (`nearest_int`). Ported in ggml's arithmetic order; see quantize_k for the contract.
// The ports index as ggml's C does, so that each line can be read against it.
#![allow(clippy::needless_range_loop)]
use crate::quant::QK;

pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// The value of largest magnitude in `x`, with its sign (the first of equals; 0 for an empty or
/// all-NaN slice): the anchor of ggml's symmetric scales.
#[inline]
pub(crate) fn max_by_magnitude(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Round to nearest, ties to even (ggml's `nearest_int`: the 1.5 * 2^23 trick). ggml requires
/// |f| < 2^22; larger values (and NaN, as 0) are clamped to that range first, so a caller that
/// clamps the result to a few levels gets the nearest one.
#[inline]
pub(crate) fn nearest_int(f: f32) -> i32 {
    let f = if f.is_nan() {
        0.0
    } else {
        f.clamp(-4194303.0, 4194303.0)
    };
    let v = f + 12582912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Symmetric levels `L - nmax` in `-nmax..nmax` and their scale (ggml's `make_qx_quants`):
/// weighted least squares over 19 candidate scales around `-nmax / max`.
pub(crate) fn make_qx_quants(
    nmax: i32,
    x: &[f32],
    l_out: &mut [i8],
    rmse_type: i32,
    qw: Option<&[f32]>,
) -> f32 {
    let n = x.len();
    let max = max_by_magnitude(x);
    if max.abs() < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let weight = |i: usize| match qw {
        Some(w) => w[i],
        None => match rmse_type {
            1 => x[i] * x[i],
            2 => 1.0,
            3 => x[i].abs(),
            _ => x[i].abs().sqrt(),
        },
    };
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = weight(i);
        sumlx += w * x[i] * l as f32;
        suml2 += w * (l * l) as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let w = weight(i);
            sumlx += w * x[i] * l as f32;
            suml2 += w * (l * l) as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                l_out[i] = (nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q3_K's symmetric levels with coordinate-descent refinement (ggml's `make_q3_quants`, rmse on).
pub(crate) fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let max = max_by_magnitude(x);
    if max.abs() < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    let mut l = [0i32; 16];
    for i in 0..x.len() {
        l[i] = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        let w = x[i] * x[i];
        sumlx += w * x[i] * l[i] as f32;
        suml2 += w * (l[i] * l[i]) as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..x.len() {
            let w = x[i] * x[i];
            let mut slx = sumlx - w * x[i] * l[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * (l[i] * l[i]) as f32;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * (new_l * new_l) as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for i in 0..x.len() {
        l_out[i] = (l[i] + nmax) as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Levels `0..=nmax` with a scale and a min, `x ~= scale * L - min` (ggml's `make_qkx2_quants`
/// when `qw` is given, `make_qkx3_quants` otherwise: weights `x^2`): a search over `nstep + 1`
/// scales from `(rmin + nmax) / (max - min)` in steps of `rdelta`, each with its least-squares
/// (scale, min). Returns (scale, min).
#[allow(clippy::too_many_arguments)]
pub(crate) fn make_qkx_quants(
    nmax: i32,
    x: &[f32],
    weights: Option<&[f32]>,
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let w = |i: usize| weights.map_or(x[i] * x[i], |w| w[i]);
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w(0);
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w(i);
        sum_x += w(i) * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        l_out.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        l_out[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        best += w(i) * err(scale * l_out[i] as f32 + min - x[i]);
    }
    let mut laux = [0u8; QK];
    let laux = &mut laux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let lf = l as f32;
            sum_l += w(i) * lf;
            sum_l2 += w(i) * lf * lf;
            sum_xl += w(i) * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur: f32 = (0..n)
                .map(|i| w(i) * err(this_scale * laux[i] as f32 + this_min - x[i]))
                .sum();
            if cur < best {
                l_out.copy_from_slice(laux);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Non-negative levels `0..=nmax` of the sub-block scales (ggml's `make_qp_quants`).
pub(crate) fn make_qp_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    let max = x.iter().fold(0f32, |m, &v| m.max(v));
    if max < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]);
        let d = x[i] - scale * l as f32;
        best_mse += qw[i] * d * d;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mse: f32 = (0..n)
            .map(|i| {
                let l = nearest_int(iscale_is * x[i]).min(nmax);
                let d = x[i] - scale_is * l as f32;
                qw[i] * d * d
            })
            .sum();
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    let mut l = [0i32; 16];
    for i in 0..n {
        l[i] = nearest_int(iscale * x[i]).min(nmax);
        sumlx += qw[i] * x[i] * l[i] as f32;
        suml2 += qw[i] * (l[i] * l[i]) as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..n {
            let w = qw[i];
            let mut slx = sumlx - w * x[i] * l[i] as f32;
            let mut sl2 = suml2 - w * (l[i] * l[i]) as f32;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != l[i] {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * (new_l * new_l) as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for i in 0..n {
        l_out[i] = l[i] as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// The sum of squares of `x` over its length times `k` (ggml's `sigma2`).
pub(crate) fn sigma2(x: &[f32], k: f32) -> f32 {
    k * x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32
}
