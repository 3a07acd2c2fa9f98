//! ggml's quantizers for the super-block types (Q2_K .. Q6_K, IQ4_XS), for IQ4_NL, and the
//! 32-wide types' importance-weighted and one-pass rounding, ported from `ggml-quants.c` so that
//! a file `dejavu quantize` writes rounds as `llama-quantize`'s does (the shared searches are in
//! [`crate::quantize_search`]; the 32-wide blocks are packed by [`crate::quantize`]).
//!
//! Contract: every function takes whole blocks of `x` (a multiple of the type's block length) and
//! returns the blocks. `qw`, where given, is the importance of each element (an importance
//! matrix's per-column mean of squared activations, `x.len()` values); without it each type uses
//! llama.cpp's own choice (the `_ref` rounding for the K-quants, element magnitudes for IQ4). The
//! ports keep ggml's arithmetic order and its round-half-even `nearest_int`, so results agree
//! with ggml's bit for bit up to the compiler's float contraction.
// The ports index as ggml's C does, so that each line can be read against it.
#![allow(clippy::needless_range_loop)]
use crate::quant::*;
use crate::quantize_search::*;
use bytemuck::Zeroable;
use half::f16;

fn h(v: f32) -> f16 {
    f16::from_f32(v)
}

/// `x` (a super-block) as 2-bit planes: `qs[32n + l]` holds the levels of elements `128n + l`,
/// `+32`, `+64`, `+96` in bits 0-1, 2-3, 4-5, 6-7 (Q2_K and Q3_K).
fn pack_2bit(l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    std::array::from_fn(|i| {
        let (n, j) = (i / 32, i % 32);
        let b = 128 * n + j;
        l[b] | (l[b + 32] << 2) | (l[b + 64] << 4) | (l[b + 96] << 6)
    })
}

/// Q2_K (ggml's `quantize_row_q2_K_ref`, or `_impl` with importance weights).
pub fn q2_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let mut y = BlockQ2K::zeroed();
    match qw {
        None => {
            for j in 0..16 {
                let xs = &x[16 * j..16 * j + 16];
                let w: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
                (scales[j], mins[j]) = make_qkx_quants(
                    3,
                    xs,
                    Some(&w),
                    &mut l[16 * j..16 * j + 16],
                    -0.5,
                    0.1,
                    15,
                    true,
                );
            }
            let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
            let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
            if max_scale > 0.0 {
                let iscale = 15.0 / max_scale;
                for j in 0..16 {
                    y.scales[j] = nearest_int(iscale * scales[j]) as u8;
                }
                y.d = h(max_scale / 15.0);
            }
            if max_min > 0.0 {
                let iscale = 15.0 / max_min;
                for j in 0..16 {
                    y.scales[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
                }
                y.dmin = h(max_min / 15.0);
            }
        }
        Some(qw) => {
            let s2 = sigma2(x, 1.0);
            let mut sw = [0f32; 16];
            for j in 0..16 {
                let xs = &x[16 * j..16 * j + 16];
                let w: [f32; 16] =
                    std::array::from_fn(|i| qw[16 * j + i] * (s2 + xs[i] * xs[i]).sqrt());
                sw[j] = w.iter().sum();
                (scales[j], mins[j]) = make_qkx_quants(
                    3,
                    xs,
                    Some(&w),
                    &mut l[16 * j..16 * j + 16],
                    -0.9,
                    0.05,
                    36,
                    false,
                );
            }
            let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
            let dm = make_qp_quants(15, &scales, &mut ls, &sw);
            let mm = make_qp_quants(15, &mins, &mut lm, &sw);
            y.d = h(dm);
            y.dmin = h(mm);
            for j in 0..16 {
                y.scales[j] = ls[j] | (lm[j] << 4);
            }
        }
    }
    let (d, dmin) = (y.d.to_f32(), y.dmin.to_f32());
    for j in 0..16 {
        let dj = d * (y.scales[j] & 0xF) as f32;
        if dj == 0.0 {
            continue;
        }
        let mj = dmin * (y.scales[j] >> 4) as f32;
        for i in 0..16 {
            l[16 * j + i] = nearest_int((x[16 * j + i] + mj) / dj).clamp(0, 3) as u8;
        }
    }
    y.qs = pack_2bit(&l);
    y
}

/// Q3_K (ggml's `quantize_row_q3_K_ref`, or `_impl` with importance weights).
pub fn q3_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut y = BlockQ3K::zeroed();
    // Scale j (0..64, stored + 32): low nibble in byte j (j < 8) or the high nibble of byte
    // j - 8, the top 2 bits in byte 8 + j % 4 at bit 2 (j / 4).
    let put_scale = |y: &mut BlockQ3K, j: usize, v: i32| {
        let v = v as u8;
        if j < 8 {
            y.scales[j] = v & 0xF;
        } else {
            y.scales[j - 8] |= (v & 0xF) << 4;
        }
        y.scales[j % 4 + 8] |= (v >> 4) << (2 * (j / 4));
    };
    match qw {
        None => {
            for j in 0..16 {
                scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            }
            let max_scale = max_by_magnitude(&scales);
            if max_scale != 0.0 {
                let iscale = -32.0 / max_scale;
                for j in 0..16 {
                    let v = (nearest_int(iscale * scales[j]) as i8 as i32).clamp(-32, 31) + 32;
                    put_scale(&mut y, j, v);
                }
                y.d = h(1.0 / iscale);
            }
        }
        Some(qw) => {
            let s2 = sigma2(x, 2.0);
            let mut sw = [0f32; 16];
            for j in 0..16 {
                let xs = &x[16 * j..16 * j + 16];
                let w: [f32; 16] =
                    std::array::from_fn(|i| qw[16 * j + i] * (s2 + xs[i] * xs[i]).sqrt());
                sw[j] = w.iter().sum();
                scales[j] = make_qx_quants(4, xs, &mut l[16 * j..16 * j + 16], 1, Some(&w));
            }
            let mut ls = [0i8; 16];
            let d_block = make_qx_quants(32, &scales, &mut ls, 1, Some(&sw));
            for j in 0..16 {
                put_scale(&mut y, j, ls[j] as i32);
            }
            y.d = h(d_block);
        }
    }
    let sc = q3k_scales(&y.scales);
    let d = y.d.to_f32();
    for j in 0..16 {
        let dj = d * sc[j] as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dj).clamp(-4, 3) + 4) as i8;
        }
    }
    // The high bit of element j goes to bit j / 32 of hmask[j % 32].
    let mut lu = [0u8; QK_K];
    for j in 0..QK_K {
        let mut v = l[j] as u8;
        if v > 3 {
            y.hmask[j % 32] |= 1 << (j / 32);
            v -= 4;
        }
        lu[j] = v;
    }
    y.qs = pack_2bit(&lu);
    y
}

/// Q4_K/Q5_K's 8 scales and mins, 6 bits each, packed into 12 bytes (ggml's layout, read by
/// [`q4k_scale_min`]).
fn pack_k_scales(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        let (a, m) = (ls[j].min(63), lm[j].min(63));
        if j < 4 {
            s[j] = a;
            s[j + 4] = m;
        } else {
            s[j + 4] = (a & 0xF) | ((m & 0xF) << 4);
            s[j - 4] |= (a >> 4) << 6;
            s[j] |= (m >> 4) << 6;
        }
    }
    s
}

/// The shared body of Q4_K and Q5_K: 8 sub-blocks of 32 with levels `0..=nmax`; returns
/// (d, dmin, packed scales, levels). `one_pass` (without importances only): each sub-block's
/// scale and min from its own min and max, with no search ([`one_pass`]).
fn k_scaled(
    x: &[f32],
    qw: Option<&[f32]>,
    nmax: i32,
    one_pass: bool,
) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (ls, lm, d, dmin);
    match qw {
        None => {
            let (rmin, rdelta, nstep) = match (one_pass, nmax) {
                // make_qkx_quants' first guess only: the levels of the sub-block's min and max.
                (true, _) => (0.0, 0.0, -1),
                (false, 15) => (-1.0, 0.1, 20),
                (false, _) => (-0.5, 0.1, 15),
            };
            for j in 0..8 {
                let xs = &x[32 * j..32 * j + 32];
                let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
                let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
                (scales[j], mins[j]) = make_qkx_quants(
                    nmax,
                    xs,
                    Some(&w),
                    &mut l[32 * j..32 * j + 32],
                    rmin,
                    rdelta,
                    nstep,
                    false,
                );
            }
            let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
            let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
            let inv_scale = if max_scale > 0.0 {
                63.0 / max_scale
            } else {
                0.0
            };
            let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
            ls = scales.map(|s| nearest_int(inv_scale * s) as u8);
            lm = mins.map(|m| nearest_int(inv_min * m) as u8);
            d = h(max_scale / 63.0);
            dmin = h(max_min / 63.0);
        }
        Some(qw) => {
            let s2 = sigma2(x, 2.0);
            let mut sw = [0f32; 8];
            for j in 0..8 {
                let xs = &x[32 * j..32 * j + 32];
                let w: [f32; 32] =
                    std::array::from_fn(|i| qw[32 * j + i] * (s2 + xs[i] * xs[i]).sqrt());
                sw[j] = w.iter().sum();
                (scales[j], mins[j]) = make_qkx_quants(
                    nmax,
                    xs,
                    Some(&w),
                    &mut l[32 * j..32 * j + 32],
                    -0.9,
                    0.05,
                    36,
                    false,
                );
            }
            let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
            d = h(make_qp_quants(63, &scales, &mut a, &sw));
            dmin = h(make_qp_quants(63, &mins, &mut b, &sw));
            (ls, lm) = (a, b);
        }
    }
    let packed = pack_k_scales(&ls, &lm);
    for j in 0..8 {
        let (sc, m) = q4k_scale_min(j, &packed);
        let dj = d.to_f32() * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

/// Q4_K (ggml's `quantize_row_q4_K_ref`, or `_impl` with importance weights).
pub fn q4_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ4K {
    q4_k_with(x, qw, false)
}

fn q4_k_with(x: &[f32], qw: Option<&[f32]>, one_pass: bool) -> BlockQ4K {
    let (d, dmin, scales, l) = k_scaled(x, qw, 15, one_pass);
    BlockQ4K {
        d,
        dmin,
        scales,
        qs: std::array::from_fn(|i| {
            let (g, j) = (i / 32, i % 32);
            l[64 * g + j] | (l[64 * g + j + 32] << 4)
        }),
    }
}

/// Q5_K (ggml's `quantize_row_q5_K_ref`, or `_impl` with importance weights).
pub fn q5_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ5K {
    q5_k_with(x, qw, false)
}

fn q5_k_with(x: &[f32], qw: Option<&[f32]>, one_pass: bool) -> BlockQ5K {
    let (d, dmin, scales, l) = k_scaled(x, qw, 31, one_pass);
    let mut y = BlockQ5K {
        d,
        dmin,
        scales,
        qh: [0; 32],
        qs: [0; 128],
    };
    for i in 0..QK_K {
        let (sub, j) = (i / 32, i % 32);
        y.qh[j] |= (l[i] >> 4) << sub;
        y.qs[32 * (sub / 2) + j] |= (l[i] & 0xF) << (4 * (sub % 2));
    }
    y
}

/// Q6_K (ggml's `quantize_row_q6_K_ref`, or `_impl` with importance weights).
pub fn q6_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ6K {
    q6_k_with(x, qw, false)
}

fn q6_k_with(x: &[f32], qw: Option<&[f32]>, one_pass: bool) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        scales[j] = if one_pass {
            // make_qx_quants' first guess: the value of largest magnitude at level -32.
            max_by_magnitude(xs) / -32.0
        } else {
            let w = qw.map(|w| &w[16 * j..16 * j + 16]);
            make_qx_quants(32, xs, &mut l[16 * j..16 * j + 16], 1, w)
        };
    }
    let max_scale = max_by_magnitude(&scales);
    let mut y = BlockQ6K::zeroed();
    if max_scale.abs() < GROUP_MAX_EPS {
        return y;
    }
    let iscale = -128.0 / max_scale;
    y.d = h(1.0 / iscale);
    for j in 0..16 {
        y.scales[j] = nearest_int(iscale * scales[j]).min(127) as i8;
    }
    for j in 0..16 {
        let dj = y.d.to_f32() * y.scales[j] as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    for n in 0..2 {
        for j in 0..32 {
            let q = |k: usize| l[128 * n + j + 32 * k] as u8;
            y.ql[64 * n + j] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            y.ql[64 * n + j + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            y.qh[32 * n + j] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    y
}

/// Q4_K, Q5_K or Q6_K blocks of `x` with one pass of rounding: each sub-block's scale (and
/// min) from its own extremes, where ggml's `_ref` quantizers search a dozen or more candidates;
/// then the sub-block scales rounded to the super-block's as ggml does. About 10x faster, with a
/// larger error (within one level of the sub-block's step): for bulk random data such as
/// synthetic models' weights, as `quantize_row_absmax` rounds the 32-wide types. `None` for
/// another type, or `x` not whole super-blocks.
pub fn one_pass(qtype: QuantType, x: &[f32], out: &mut Vec<u8>) -> Option<()> {
    if !x.len().is_multiple_of(QK_K) {
        return None;
    }
    let blocks = x.chunks_exact(QK_K);
    use bytemuck::bytes_of;
    match qtype {
        QuantType::Q4K => blocks.for_each(|b| out.extend(bytes_of(&q4_k_with(b, None, true)))),
        QuantType::Q5K => blocks.for_each(|b| out.extend(bytes_of(&q5_k_with(b, None, true)))),
        QuantType::Q6K => blocks.for_each(|b| out.extend(bytes_of(&q6_k_with(b, None, true)))),
        _ => return None,
    }
    Some(())
}

/// The index of the IQ4_NL level nearest `v` (ggml's `best_index_int8`).
fn best_index(v: f32) -> u8 {
    let k = &KVALUES_IQ4NL;
    if v <= k[0] as f32 {
        return 0;
    }
    if v >= k[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if v < k[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if v - (k[hi - 1] as f32) < k[hi] as f32 - v {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// IQ4's per-32 search (ggml's `quantize_row_iq4_nl_impl` for one sub-block, `ntry = 7`): the
/// scale and the level indices of `xb` under weights `w`.
fn iq4_block(xb: &[f32], w: &[f32], l: &mut [u8]) -> f32 {
    let k = |i: u8| KVALUES_IQ4NL[i as usize] as f32;
    let max = max_by_magnitude(xb);
    if max.abs() < GROUP_MAX_EPS {
        return 0.0;
    }
    let mut d = -max / k(0);
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for j in 0..xb.len() {
        l[j] = best_index(id * xb[j]);
        let q = k(l[j]);
        sumqx += w[j] * q * xb[j];
        sumq2 += w[j] * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -7..=7 {
        id = (itry as f32 + k(0)) / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for j in 0..xb.len() {
            let q = k(best_index(id * xb[j]));
            sumqx += w[j] * q * xb[j];
            sumq2 += w[j] * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// The weights of IQ4's search: importance times `sqrt(sigma2 + x^2)`, or `x^2`.
fn iq4_weights(xb: &[f32], qw: Option<&[f32]>, s2: f32) -> Vec<f32> {
    match qw {
        Some(qw) => (0..xb.len())
            .map(|j| qw[j] * (s2 + xb[j] * xb[j]).sqrt())
            .collect(),
        None => xb.iter().map(|v| v * v).collect(),
    }
}

fn pack_nibbles(l: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| l[j] | (l[j + 16] << 4))
}

/// IQ4_NL (ggml's `quantize_iq4_nl`).
pub fn iq4_nl(x: &[f32], qw: Option<&[f32]>) -> BlockIQ4NL {
    let w = iq4_weights(x, qw, sigma2(x, 2.0));
    let mut l = [0u8; QK];
    let d = iq4_block(x, &w, &mut l);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for j in 0..QK {
        l[j] = best_index(id * x[j]);
    }
    BlockIQ4NL {
        d: h(d),
        qs: pack_nibbles(&l),
    }
}

/// IQ4_XS (ggml's `quantize_iq4_xs`).
pub fn iq4_xs(x: &[f32], qw: Option<&[f32]>) -> BlockIQ4XS {
    let s2 = sigma2(x, 2.0);
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let w = iq4_weights(xb, qw.map(|q| &q[32 * ib..32 * ib + 32]), s2);
        scales[ib] = iq4_block(xb, &w, &mut l[32 * ib..32 * ib + 32]);
    }
    let max_scale = max_by_magnitude(&scales);
    let mut y = BlockIQ4XS::zeroed();
    let d = -max_scale / 32.0;
    y.d = h(d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    for ib in 0..8 {
        let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for j in 0..32 {
            l[32 * ib + j] = best_index(idl * x[32 * ib + j]);
        }
        let u = (ls + 32) as u8;
        y.scales_l[ib / 2] |= (u & 0xF) << (4 * (ib % 2));
        scales_h |= ((u >> 4) as u16) << (2 * ib);
        y.qs[16 * ib..16 * ib + 16].copy_from_slice(&pack_nibbles(&l[32 * ib..32 * ib + 32]));
    }
    y.scales_h = scales_h.to_le_bytes();
    y
}

/// Symmetric levels of a 32-wide type with importance weights (ggml's `quantize_row_q4_0_impl`,
/// `q5_0_impl`: `nmax` 8 or 16; `s2` is [`row_sigma2`] of the whole row): (d, levels `L` in
/// `0..2 nmax`).
pub fn symmetric_weighted(x: &[f32], qw: &[f32], nmax: i32, s2: f32) -> (f32, [u8; QK]) {
    let w: [f32; QK] = std::array::from_fn(|j| qw[j] * (s2 + x[j] * x[j]).sqrt());
    let mut l = [0i8; QK];
    let d = make_qx_quants(nmax, x, &mut l, 1, Some(&w));
    (d, l.map(|v| v as u8))
}

/// Levels `0..=nmax` with a min of a 32-wide type with importance weights (ggml's
/// `quantize_row_q4_1_impl`, `q5_1_impl`; `s2` as for [`symmetric_weighted`]): (d, m, levels),
/// `x ~= d * L + m`.
pub fn asymmetric_weighted(x: &[f32], qw: &[f32], nmax: i32, s2: f32) -> (f32, f32, [u8; QK]) {
    let w: [f32; QK] = std::array::from_fn(|j| qw[j] * (s2 + x[j] * x[j]).sqrt());
    let mut l = [0u8; QK];
    let (d, min) = make_qkx_quants(nmax, x, Some(&w), &mut l, -0.9, 0.05, 36, false);
    (d, -min, l)
}

/// The row-wide `sigma2` the 32-wide weighted quantizers use (mean square over the whole row).
pub fn row_sigma2(row: &[f32]) -> f32 {
    sigma2(row, 1.0)
}

/// ggml's one-pass reference rounding of the 32-wide types (`quantize_row_q4_0_ref` ..
/// `q8_0_ref`), which `llama-quantize` writes without an importance matrix: the value of largest
/// magnitude maps to the low end, `d = max / -nmax` (-8, -16), and the levels `x / d + nmax + 1/2`
/// are truncated and capped at `2 nmax - 1`; returned as signed levels `L - nmax`.
pub fn symmetric_ref(x: &[f32], nmax: i32) -> (f32, [i32; QK]) {
    let d = max_by_magnitude(x) / -(nmax as f32);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let bias = nmax as f32 + 0.5;
    let l = |v: f32| ((v * id + bias) as i32).min(2 * nmax - 1) - nmax;
    (d, std::array::from_fn(|j| l(x[j])))
}

/// ggml's Q4_1/Q5_1 reference rounding: `d = (max - min) / nmax`, `m = min`, levels
/// `(x - min) / d + 1/2` truncated (at most `nmax`). Returns (d, m, levels).
pub fn min_max_ref(x: &[f32], nmax: i32) -> (f32, f32, [u8; QK]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    let d = (max - min) / nmax as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let l = |v: f32| (((v - min) * id + 0.5) as i32).min(nmax) as u8;
    (d, min, std::array::from_fn(|j| l(x[j])))
}

/// ggml's Q8_0 reference rounding: `d = max|x| / 127`, levels `round(x / d)`.
pub fn q8_0_ref(x: &[f32]) -> (f32, [i32; QK]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, std::array::from_fn(|j| (x[j] * id).round() as i32))
}
