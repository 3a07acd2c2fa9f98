//! Quantization of f32 rows into the block formats of [`crate::quant`] (the inverse of
//! dequantization), for weights the engine re-lays out itself (the neuron-major down projection)
//! and for predictor tables.
//!
//! Scales are chosen to minimise the squared error of each block, not just to cover its range:
//! a few candidate scales are refined by least squares on the rounded levels and the best kept
//! (the approach of ggml's `make_qx_quants` / `make_qkx2_quants`). This roughly halves the error
//! of plain min/max scaling at 4-5 bits.
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QuantType, QK};
use crate::quantize_k as k;
use half::{bf16, f16};

/// Types [`quantize_row`] can write: all of them.
pub const WRITABLE: [QuantType; 15] = QuantType::ALL;

/// How [`quantize_row_weighted`] rounds the 32-wide types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) when it
/// has no importances (other types, and these with importances, always round as ggml does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// ggml's one-pass max scaling: the bytes `llama-quantize` writes.
    Ggml,
    /// The scale of least squared error among candidates (lower error than ggml's).
    Search,
}

/// Quantize `x` into `qtype.row_bytes(x.len())` bytes appended to `out`, with the lowest-error
/// rounding ([`Rounding::Search`]). `x.len()` must be a multiple of the block length (else
/// `None`).
pub fn quantize_row(qtype: QuantType, x: &[f32], out: &mut Vec<u8>) -> Option<()> {
    quantize_row_weighted(qtype, x, None, Rounding::Search, out)
}

/// [`quantize_row`] with an importance per element (`qw`, `x.len()` values: an importance
/// matrix's column weights, repeated for every row), which the scale searches weight their
/// squared errors by, as `llama-quantize --imatrix` does (ggml's `quantize_*_impl`); without
/// one, the 32-wide types round as `rounding` says. Q8_0 and the float types ignore importances.
pub fn quantize_row_weighted(
    qtype: QuantType,
    x: &[f32],
    qw: Option<&[f32]>,
    rounding: Rounding,
    out: &mut Vec<u8>,
) -> Option<()> {
    let bl = qtype.block_len();
    if !x.len().is_multiple_of(bl) || qw.is_some_and(|w| w.len() != x.len()) {
        return None;
    }
    let s2 = qw.map(|_| k::row_sigma2(x));
    let ggml = rounding == Rounding::Ggml;
    // Block `i`'s elements and importances.
    let blocks = x
        .chunks_exact(bl)
        .enumerate()
        .map(|(i, b)| (b, qw.map(|w| &w[i * bl..(i + 1) * bl])));
    let mut put = |b: &[u8]| out.extend_from_slice(b);
    use bytemuck::bytes_of;
    for (b, w) in blocks {
        match (qtype, w, s2) {
            (QuantType::F32, ..) => b.iter().for_each(|v| put(&v.to_le_bytes())),
            (QuantType::F16, ..) => b.iter().for_each(|v| put(&f16::from_f32(*v).to_le_bytes())),
            (QuantType::BF16, ..) => b
                .iter()
                .for_each(|v| put(&bf16::from_f32(*v).to_le_bytes())),
            (QuantType::Q8_0, ..) if ggml => put(bytes_of(&q8_0(k::q8_0_ref(b)))),
            (QuantType::Q8_0, ..) => put(bytes_of(&q8_0(symmetric(b, -127, 127)))),
            (QuantType::Q4_0, Some(w), Some(s2)) => put(bytes_of(&q4_0(levels_signed(
                k::symmetric_weighted(b, w, 8, s2),
                8,
            )))),
            (QuantType::Q4_0, ..) if ggml => put(bytes_of(&q4_0(k::symmetric_ref(b, 8)))),
            (QuantType::Q4_0, ..) => put(bytes_of(&q4_0(symmetric(b, -8, 7)))),
            (QuantType::Q5_0, Some(w), Some(s2)) => put(bytes_of(&q5_0(levels_signed(
                k::symmetric_weighted(b, w, 16, s2),
                16,
            )))),
            (QuantType::Q5_0, ..) if ggml => put(bytes_of(&q5_0(k::symmetric_ref(b, 16)))),
            (QuantType::Q5_0, ..) => put(bytes_of(&q5_0(symmetric(b, -16, 15)))),
            (QuantType::Q4_1, Some(w), Some(s2)) => {
                put(bytes_of(&q4_1(k::asymmetric_weighted(b, w, 15, s2))))
            }
            (QuantType::Q4_1, ..) if ggml => put(bytes_of(&q4_1(k::min_max_ref(b, 15)))),
            (QuantType::Q4_1, ..) => put(bytes_of(&q4_1(asymmetric(b, 15)))),
            (QuantType::Q5_1, Some(w), Some(s2)) => {
                put(bytes_of(&q5_1(k::asymmetric_weighted(b, w, 31, s2))))
            }
            (QuantType::Q5_1, ..) if ggml => put(bytes_of(&q5_1(k::min_max_ref(b, 31)))),
            (QuantType::Q5_1, ..) => put(bytes_of(&q5_1(asymmetric(b, 31)))),
            (QuantType::IQ4NL, ..) => put(bytes_of(&k::iq4_nl(b, w))),
            (QuantType::Q2K, ..) => put(bytes_of(&k::q2_k(b, w))),
            (QuantType::Q3K, ..) => put(bytes_of(&k::q3_k(b, w))),
            (QuantType::Q4K, ..) => put(bytes_of(&k::q4_k(b, w))),
            (QuantType::Q5K, ..) => put(bytes_of(&k::q5_k(b, w))),
            (QuantType::Q6K, ..) => put(bytes_of(&k::q6_k(b, w))),
            (QuantType::IQ4XS, ..) => put(bytes_of(&k::iq4_xs(b, w))),
        }
    }
    Some(())
}

/// Levels `0..2 nmax` with their scale as signed levels `L - nmax`.
fn levels_signed((d, l): (f32, [u8; QK]), nmax: i32) -> (f32, [i32; QK]) {
    (d, l.map(|v| v as i32 - nmax))
}

/// Symmetric levels `q in lo..=hi` with `x ~= d * q`: the scale of least squared error among
/// candidates around `max|x| / lo` and `max|x| / hi` (9 each; 3 for 8 bits, where they differ
/// little), each refined by least squares on its rounded levels.
fn symmetric(x: &[f32], lo: i32, hi: i32) -> (f32, [i32; QK]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut best = (0f32, [0i32; QK], f32::INFINITY);
    if amax == 0.0 {
        return (0.0, best.1);
    }
    // The signed value of largest magnitude maps near either end of the range: the low end has
    // one level more (ggml maps it there, with a negative scale if it is positive).
    let vmax = *x.iter().find(|v| v.abs() == amax).unwrap_or(&amax);
    let sxx: f32 = x.iter().map(|v| v * v).sum();
    let steps = if hi > 16 { 1 } else { 4 };
    for (end, step) in [lo as f32, hi as f32]
        .into_iter()
        .flat_map(|e| (-steps..=steps).map(move |s| (e, s)))
    {
        let d0 = vmax / (end + 0.1 * step as f32 * end.signum());
        if d0 == 0.0 || !d0.is_finite() {
            continue;
        }
        let mut d = d0;
        for _ in 0..2 {
            let q = levels(x, 1.0 / d, lo as f32, hi as f32);
            // Eight partial sums (a shape the compiler vectorizes).
            let (mut sxq, mut sqq) = ([0f32; 8], [0f32; 8]);
            for (xc, qc) in x.chunks_exact(8).zip(q.chunks_exact(8)) {
                for j in 0..8 {
                    sxq[j] += xc[j] * qc[j];
                    sqq[j] += qc[j] * qc[j];
                }
            }
            let (sxq, sqq) = (sxq.iter().sum::<f32>(), sqq.iter().sum::<f32>());
            if sqq > 0.0 {
                d = sxq / sqq;
            }
            // The squared error of the stored (f16) scale with these levels.
            let d16 = f16::from_f32(d).to_f32();
            let err = sxx - 2.0 * d16 * sxq + d16 * d16 * sqq;
            if err < best.2 {
                best = (d, q.map(|v| v as i32), err);
            }
        }
    }
    (best.0, best.1)
}

/// `x * id` rounded to the nearest level (ties to even) in `lo..=hi`, as floats: clamped first
/// (the same for integer bounds), then rounded by adding and subtracting 1.5 * 2^23.
#[inline]
fn levels(x: &[f32], id: f32, lo: f32, hi: f32) -> [f32; QK] {
    const MAGIC: f32 = 12582912.0;
    let mut q = [0f32; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((v * id).clamp(lo, hi) + MAGIC) - MAGIC;
    }
    q
}

/// ggml's reference rounding: the scale maps the signed value of largest magnitude to the end of
/// the range with more room, with no search (one pass; for bulk data such as synthetic weights).
fn absmax(x: &[f32], lo: i32, hi: i32) -> (f32, [i32; QK]) {
    let vmax = crate::quantize_search::max_by_magnitude(x);
    let d = vmax / if vmax < 0.0 { lo as f32 } else { hi as f32 };
    // f16 scale, as stored; a zero block stays zero.
    let d = f16::from_f32(d).to_f32();
    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
    (
        d,
        std::array::from_fn(|i| ((x[i] * inv).round() as i32).clamp(lo, hi)),
    )
}

fn q8_0((d, q): (f32, [i32; QK])) -> BlockQ8_0 {
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs: q.map(|v| v as i8),
    }
}

fn q4_0((d, q): (f32, [i32; QK])) -> BlockQ4_0 {
    let u = q.map(|v| (v + 8) as u8);
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs: std::array::from_fn(|j| u[j] | (u[j + QK / 2] << 4)),
    }
}

fn q5_0((d, q): (f32, [i32; QK])) -> BlockQ5_0 {
    let u = q.map(|v| (v + 16) as u32);
    let mut qh = 0u32;
    let mut qs = [0u8; QK / 2];
    for j in 0..QK / 2 {
        qs[j] = ((u[j] & 0xF) | ((u[j + QK / 2] & 0xF) << 4)) as u8;
        qh |= ((u[j] >> 4) & 1) << j;
        qh |= ((u[j + QK / 2] >> 4) & 1) << (j + QK / 2);
    }
    BlockQ5_0 {
        d: f16::from_f32(d),
        qh: qh.to_le_bytes(),
        qs,
    }
}

/// Like [`quantize_row`] but with ggml's one-pass absmax scales (no error search, ~30x faster,
/// up to ~2x the squared error at 4-5 bits): for bulk data where rounding quality does not
/// matter, such as the random weights of synthetic models. Q4_K, Q5_K and Q6_K round in one pass
/// too ([`k::one_pass`]); the other types are as [`quantize_row`].
pub fn quantize_row_absmax(qtype: QuantType, x: &[f32], out: &mut Vec<u8>) -> Option<()> {
    if !x.len().is_multiple_of(qtype.block_len()) {
        return None;
    }
    let blocks = x.chunks_exact(QK);
    match qtype {
        QuantType::Q8_0 => {
            blocks.for_each(|b| out.extend(bytemuck::bytes_of(&q8_0(absmax(b, -127, 127)))))
        }
        QuantType::Q4_0 => {
            blocks.for_each(|b| out.extend(bytemuck::bytes_of(&q4_0(absmax(b, -8, 7)))))
        }
        QuantType::Q5_0 => {
            blocks.for_each(|b| out.extend(bytemuck::bytes_of(&q5_0(absmax(b, -16, 15)))))
        }
        QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => return k::one_pass(qtype, x, out),
        _ => return quantize_row(qtype, x, out),
    }
    Some(())
}

/// Asymmetric levels `x ~= d * q + m`, `q in 0..=nmax`: candidates around the min/max scale,
/// each refined by a least-squares fit of `(d, m)` to its rounded levels. Returns (d, m, q).
fn asymmetric(x: &[f32], nmax: u8) -> (f32, f32, [u8; QK]) {
    let (min, max) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let top = nmax as f32;
    let mut best = (0f32, min, [0u8; QK], f32::INFINITY);
    if max > min {
        for step in -6..=6 {
            let (mut d, mut m) = ((max - min) / (top + 0.1 * step as f32), min);
            for _ in 0..3 {
                let id = 1.0 / d;
                let q: [u8; QK] = std::array::from_fn(|i| {
                    crate::quantize_search::nearest_int((x[i] - m) * id).clamp(0, nmax as i32) as u8
                });
                let n = QK as f32;
                let (sq, sx, sqq, sxq) = (0..QK).fold((0f32, 0f32, 0f32, 0f32), |a, i| {
                    let qi = q[i] as f32;
                    (a.0 + qi, a.1 + x[i], a.2 + qi * qi, a.3 + x[i] * qi)
                });
                let det = n * sqq - sq * sq;
                if det > 0.0 {
                    d = (n * sxq - sq * sx) / det;
                    m = (sx - d * sq) / n;
                }
                let (d16, m16) = (f16::from_f32(d).to_f32(), f16::from_f32(m).to_f32());
                let err: f32 = (0..QK)
                    .map(|i| (x[i] - d16 * q[i] as f32 - m16).powi(2))
                    .sum();
                if err < best.3 {
                    best = (d, m, q, err);
                }
                if d <= 0.0 {
                    break;
                }
            }
        }
    }
    (best.0, best.1, best.2)
}

fn q4_1((d, m, q): (f32, f32, [u8; QK])) -> BlockQ4_1 {
    BlockQ4_1 {
        d: f16::from_f32(d),
        m: f16::from_f32(m),
        qs: std::array::from_fn(|j| q[j] | (q[j + QK / 2] << 4)),
    }
}

fn q5_1((d, m, q): (f32, f32, [u8; QK])) -> BlockQ5_1 {
    let qh = (0..QK).fold(0u32, |h, j| h | (((q[j] >> 4) as u32 & 1) << j));
    BlockQ5_1 {
        d: f16::from_f32(d),
        m: f16::from_f32(m),
        qh: qh.to_le_bytes(),
        qs: std::array::from_fn(|j| (q[j] & 0xF) | ((q[j + QK / 2] & 0xF) << 4)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dequant(qtype: QuantType, b: &[u8]) -> Vec<f32> {
        use bytemuck::pod_read_unaligned as rd;
        match qtype {
            QuantType::Q8_0 => {
                let b: BlockQ8_0 = rd(b);
                b.qs.iter().map(|&q| b.d.to_f32() * q as f32).collect()
            }
            QuantType::Q4_0 => {
                let b: BlockQ4_0 = rd(b);
                let q = |j: usize| ((b.qs[j % 16] >> (4 * (j / 16))) & 15) as i32 - 8;
                (0..QK).map(|j| b.d.to_f32() * q(j) as f32).collect()
            }
            QuantType::Q4_1 => {
                let b: BlockQ4_1 = rd(b);
                let q = |j: usize| (b.qs[j % 16] >> (4 * (j / 16))) & 15;
                (0..QK)
                    .map(|j| b.d.to_f32() * q(j) as f32 + b.m.to_f32())
                    .collect()
            }
            QuantType::Q5_0 => {
                let b: BlockQ5_0 = rd(b);
                let qh = u32::from_le_bytes(b.qh);
                (0..QK)
                    .map(|j| {
                        let lo = (b.qs[j % 16] >> (4 * (j / 16))) & 15;
                        let q = lo as i32 | (((qh >> j) & 1) << 4) as i32;
                        b.d.to_f32() * (q - 16) as f32
                    })
                    .collect()
            }
            _ => unreachable!(),
        }
    }

    /// Root-mean-square error of each type on smooth and heavy-tailed blocks stays below a bound
    /// derived from its step size: a uniform quantizer of step s has RMS error s / sqrt(12); the
    /// search must do at least as well as plain max scaling (checked against that bound + 10%).
    #[test]
    fn error_within_step_bound() {
        let mut state = 12345u64;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        for (qtype, levels) in [
            (QuantType::Q8_0, 254.0),
            (QuantType::Q5_0, 31.0),
            (QuantType::Q4_0, 15.0),
            (QuantType::Q4_1, 15.0),
        ] {
            for trial in 0..200 {
                let x: Vec<f32> = (0..QK)
                    .map(|_| {
                        let v = rnd();
                        if trial % 2 == 0 {
                            v
                        } else {
                            v * v * v * 3.0
                        }
                    })
                    .collect();
                let mut out = Vec::new();
                quantize_row(qtype, &x, &mut out).unwrap();
                assert_eq!(out.len(), qtype.row_bytes(QK));
                let y = dequant(qtype, &out);
                let (lo, hi) = x
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let span = if qtype == QuantType::Q4_1 {
                    hi - lo
                } else {
                    2.0 * lo.abs().max(hi.abs())
                };
                let bound = span / levels / 12f32.sqrt() * 1.1 + 1e-3 * span;
                let rms = (x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / QK as f32)
                    .sqrt();
                assert!(rms <= bound, "{qtype:?} trial {trial}: rms {rms} > {bound}");
            }
        }
    }

    /// The one-pass rounding is within half a step of every element (the step is the block's
    /// stored scale), on random blocks of both signs; at 4-5 bits, where the range has one level
    /// more below zero than above, within a step (an opposite-sign value of full magnitude).
    #[test]
    fn absmax_within_half_step() {
        let mut state = 99u64;
        let mut rnd = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        for qtype in [QuantType::Q8_0, QuantType::Q5_0, QuantType::Q4_0] {
            for trial in 0..200 {
                let x: Vec<f32> = (0..3 * QK).map(|_| rnd() * (trial % 7) as f32).collect();
                let mut out = Vec::new();
                quantize_row_absmax(qtype, &x, &mut out).unwrap();
                assert_eq!(out.len(), qtype.row_bytes(x.len()));
                let bb = qtype.row_bytes(QK);
                let steps = if qtype == QuantType::Q8_0 {
                    0.501
                } else {
                    1.001
                };
                for (xb, ob) in x.chunks(QK).zip(out.chunks(bb)) {
                    let d = f16::from_le_bytes([ob[0], ob[1]]).to_f32().abs();
                    for (a, c) in xb.iter().zip(dequant(qtype, ob)) {
                        assert!(
                            (a - c).abs() <= d * steps + 1e-6,
                            "{qtype:?}: {a} -> {c}, step {d}"
                        );
                    }
                }
            }
        }
        let mut out = Vec::new();
        assert!(quantize_row_absmax(QuantType::Q8_0, &[1.0; 5], &mut out).is_none());
    }

    #[test]
    fn zeros_and_bad_lengths() {
        for q in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
        ] {
            let mut out = Vec::new();
            quantize_row(q, &[0.0; 64], &mut out).unwrap();
            assert_eq!(dequant(q, &out[..q.block_bytes()]), vec![0.0; QK]);
            assert!(quantize_row(q, &[0.0; 33], &mut out).is_none());
        }
        assert!(quantize_row(QuantType::Q4K, &[0.0; 255], &mut Vec::new()).is_none());
    }
}
