//! `y += sum_j c[j] * dequant(row_j)`: a weighted sum of a few quantized rows, the inner step of
//! the sparse down projection (rows of the neuron-major matrix, one per kept neuron).
//!
//! Reference: dequantize each row ([`crate::dequant`]) and add `c[j] * row_j` in order. The x86
//! tiers fuse the two for the 32-wide formats: per block of 32 outputs the partial sums stay in
//! registers while every row's block is unpacked and added, so no dequantized row is stored and
//! reloaded. Q8_0, Q5_0 and Q4_0 (the sparse layout's types) go through integer multiply-adds
//! with the row weights `c[j] * d` rounded to 8 bits per block (as the dense path rounds
//! activations; the test states the bound); Q4_1, f16 and bf16 use f32 multiply-adds. Other types
//! and the portable tier dequantize into a small buffer and use the tier's f32 `axpy_rows`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{QuantType, QK};

/// `(qtype, rows, c, y)`: `rows[j]` holds `y.len()` elements of `qtype`; `c.len() == rows.len()`.
pub type AxpyQFn = fn(QuantType, &[&[u8]], &[f32], &mut [f32]);

/// Most rows one call takes.
pub const MAX_ROWS: usize = 8;

pub fn select(isa: Isa) -> AxpyQFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

pub fn scalar(qtype: QuantType, rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    via_f32(qtype, rows, c, y, super::axpy::scalar)
}

pub fn portable(qtype: QuantType, rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    via_f32(qtype, rows, c, y, super::axpy::portable)
}

/// Dequantize `QK`-column slices of every row into a stack buffer, then one f32 `axpy` per slice.
fn via_f32(
    qtype: QuantType,
    rows: &[&[u8]],
    c: &[f32],
    y: &mut [f32],
    axpy: super::axpy::AxpyRowsFn,
) {
    assert!(rows.len() <= MAX_ROWS && rows.len() == c.len());
    for r in rows {
        assert_eq!(r.len(), qtype.row_bytes(y.len()), "axpy_q: a row's length");
    }
    let bl = qtype.block_len().max(QK);
    let step_bytes = qtype.row_bytes(bl);
    let mut tile = [0f32; MAX_ROWS * 256];
    for (s, ys) in y.chunks_mut(bl).enumerate() {
        let n = ys.len();
        let (b0, b1) = (s * step_bytes, s * step_bytes + qtype.row_bytes(n));
        for (j, r) in rows.iter().enumerate() {
            crate::dequant::dequantize_row(qtype, &r[b0..b1], &mut tile[j * n..(j + 1) * n]);
        }
        axpy(c, &tile[..rows.len() * n], n, ys);
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(qtype: QuantType, rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    assert!(rows.len() <= MAX_ROWS && rows.len() == c.len());
    for r in rows {
        assert_eq!(r.len(), qtype.row_bytes(y.len()));
    }
    // SAFETY (all arms): handed out by `select` only for tiers with AVX2/FMA/F16C; every row
    // holds y.len() elements of qtype (asserted), so y.len() is a multiple of 32 (the float
    // types: checked by their arms).
    match qtype {
        QuantType::Q8_0 => unsafe { avx2_impl::<Q8_0>(rows, c, y) },
        QuantType::Q4_0 => unsafe { avx2_int::<Q4_0>(rows, c, y) },
        QuantType::Q4_1 => unsafe { avx2_impl::<Q4_1>(rows, c, y) },
        QuantType::Q5_0 => unsafe { avx2_int::<Q5_0>(rows, c, y) },
        QuantType::F16 if y.len().is_multiple_of(QK) => unsafe { avx2_impl::<F16>(rows, c, y) },
        QuantType::BF16 if y.len().is_multiple_of(QK) => unsafe { avx2_impl::<BF16>(rows, c, y) },
        _ => via_f32(qtype, rows, c, y, super::axpy::select(Isa::Avx2)),
    }
}

/// The AVX-512 tier: Q8_0, f16 and bf16 with 16-lane multiply-adds (half the instructions of
/// the AVX2 loop, which bounds these f32-accumulating formats); others as [`avx2`].
#[cfg(target_arch = "x86_64")]
fn avx512(qtype: QuantType, rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    assert!(rows.len() <= MAX_ROWS && rows.len() == c.len());
    for r in rows {
        assert_eq!(r.len(), qtype.row_bytes(y.len()));
    }
    let whole = y.len().is_multiple_of(QK);
    // SAFETY (all arms): handed out by `select` only for the AVX-512 tier (F/BW/VL, with AVX2,
    // FMA, F16C); every row holds y.len() elements (asserted), a multiple of 32 (checked).
    match qtype {
        QuantType::Q8_0 => unsafe { avx512_impl::<Q8_0>(rows, c, y) },
        QuantType::F16 if whole => unsafe { avx512_impl::<F16>(rows, c, y) },
        QuantType::BF16 if whole => unsafe { avx512_impl::<BF16>(rows, c, y) },
        _ => avx2(qtype, rows, c, y),
    }
}

/// [`avx2_impl`]'s loop for Q8_0, f16 and bf16 in 16 lanes: per block of 32 outputs two pairs
/// of accumulators (even and odd rows).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn avx512_impl<const F: u8>(rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let bb = if F == Q8_0 { 34 } else { 64 };
    let yp = y.as_mut_ptr();
    // 16 widened elements at `p` (bytes `p..p + 16` of Q8_0 quants, or 32 of f16 / bf16).
    let wide16 = |p: *const u8| match F {
        Q8_0 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))),
        F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)),
            16,
        )),
    };
    for blk in 0..y.len() / QK {
        let z = _mm512_setzero_ps();
        let mut acc = [[z; 2]; 2];
        for (j, (r, &cj)) in rows.iter().zip(c).enumerate() {
            let p = r.as_ptr().add(blk * bb);
            let (w, step) = match F {
                Q8_0 => (cj * _mm_cvtss_f32(f16x2_at(p)), 16),
                _ => (cj, 32),
            };
            let q = if F == Q8_0 { p.add(2) } else { p };
            let (cv, a) = (_mm512_set1_ps(w), &mut acc[j & 1]);
            a[0] = _mm512_fmadd_ps(wide16(q), cv, a[0]);
            a[1] = _mm512_fmadd_ps(wide16(q.add(step)), cv, a[1]);
        }
        let o = yp.add(QK * blk);
        for (k, (even, odd)) in acc[0].iter().zip(&acc[1]).enumerate() {
            let sum = _mm512_add_ps(*even, *odd);
            _mm512_storeu_ps(
                o.add(16 * k),
                _mm512_add_ps(_mm512_loadu_ps(o.add(16 * k)), sum),
            );
        }
    }
}

/// Format codes of the fused kernel's const parameter.
#[cfg(target_arch = "x86_64")]
const Q8_0: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q4_0: u8 = 1;
#[cfg(target_arch = "x86_64")]
const Q4_1: u8 = 2;
#[cfg(target_arch = "x86_64")]
const Q5_0: u8 = 3;
#[cfg(target_arch = "x86_64")]
const F16: u8 = 4;
#[cfg(target_arch = "x86_64")]
const BF16: u8 = 5;

/// Per block of 32 outputs: four 8-lane partial sums in registers; per row, its block's quants
/// converted to f32 and multiply-added with `c[j] * d`; the offset terms of all rows (`-8 d`,
/// `-16 d`, or Q4_1's min, times `c[j]`) summed as one scalar and added once. f16 and bf16 rows
/// (32 elements, 64 bytes per block) are widened and multiply-added with `c[j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl<const F: u8>(rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let bb = match F {
        Q8_0 => 34,
        Q4_0 => 18,
        Q4_1 => 20,
        F16 | BF16 => 64,
        _ => 22,
    };
    let yp = y.as_mut_ptr();
    // Widen 8 f16 or bf16 values at `p`.
    let wide8 = |p: *const u8| {
        let v = _mm_loadu_si128(p as *const __m128i);
        if F == F16 {
            _mm256_cvtph_ps(v)
        } else {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
        }
    };
    for blk in 0..y.len() / QK {
        let o = yp.add(QK * blk);
        // Two accumulator sets (even and odd rows) halve the multiply-add chains per block.
        let z = _mm256_setzero_ps();
        let mut acc = [[z; 4]; 2];
        let mut bias = 0f32;
        for (j, (r, &cj)) in rows.iter().zip(c).enumerate() {
            let p = r.as_ptr().add(blk * bb);
            if F == F16 || F == BF16 {
                let (cv, a) = (_mm256_set1_ps(cj), &mut acc[j & 1]);
                for (k, ak) in a.iter_mut().enumerate() {
                    *ak = _mm256_fmadd_ps(wide8(p.add(16 * k)), cv, *ak);
                }
                continue;
            }
            let sc = f16x2_at(p); // [d, second f16 (m for Q4_1), ..]
            let cd = cj * _mm_cvtss_f32(sc);
            bias += match F {
                Q4_0 => -8.0 * cd,
                Q4_1 => cj * lane1(sc),
                Q5_0 => -16.0 * cd,
                _ => 0.0,
            };
            if F == Q8_0 {
                // Sign-extend straight from memory, 8 quants at a time.
                let (cdv, a) = (_mm256_set1_ps(cd), &mut acc[j & 1]);
                for (k, ak) in a.iter_mut().enumerate() {
                    let v = _mm_loadl_epi64(p.add(2 + 8 * k) as *const __m128i);
                    *ak = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), cdv, *ak);
                }
                continue;
            }
            let q = match F {
                Q8_0 => _mm256_loadu_si256(p.add(2) as *const __m256i),
                Q4_0 => unpack_nibbles(p.add(2)),
                Q4_1 => unpack_nibbles(p.add(4)),
                _ => {
                    let qh = std::ptr::read_unaligned(p.add(2) as *const u32);
                    let hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                    _mm256_or_si256(unpack_nibbles(p.add(6)), hi)
                }
            };
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            let to_f32 = |v: __m128i| {
                _mm256_cvtepi32_ps(if F == Q8_0 {
                    _mm256_cvtepi8_epi32(v)
                } else {
                    _mm256_cvtepu8_epi32(v)
                })
            };
            let cdv = _mm256_set1_ps(cd);
            let a = &mut acc[j & 1];
            a[0] = _mm256_fmadd_ps(to_f32(lo), cdv, a[0]);
            a[1] = _mm256_fmadd_ps(to_f32(_mm_srli_si128(lo, 8)), cdv, a[1]);
            a[2] = _mm256_fmadd_ps(to_f32(hi), cdv, a[2]);
            a[3] = _mm256_fmadd_ps(to_f32(_mm_srli_si128(hi, 8)), cdv, a[3]);
        }
        let b = _mm256_set1_ps(bias);
        for (k, (even, odd)) in acc[0].iter().zip(&acc[1]).enumerate() {
            let sum = _mm256_add_ps(_mm256_add_ps(*even, *odd), b);
            _mm256_storeu_ps(
                o.add(8 * k),
                _mm256_add_ps(_mm256_loadu_ps(o.add(8 * k)), sum),
            );
        }
    }
}

/// Integer variant for Q8_0 and for the formats with unsigned quants and a constant offset (Q5_0,
/// Q4_0). Per block of 32 outputs, the row weights `w_j = c[j] * d_j` are quantized to i8 with
/// one scale `s = max|w_j| / 127` (as the dense path quantizes activations per block of 32); four
/// rows' quants are interleaved byte by byte so `maddubs` + `madd` give `sum_j e_j q_j[i]` per
/// output in i32, and `y += s * sum + offset * sum_j w_j` (the offset term exact in f32). Q8_0's
/// quants are signed: `maddubs(|q|, sign(e, q))` (at most 2 * 127 * 127, no saturation).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_int<const F: u8>(rows: &[&[u8]], c: &[f32], y: &mut [f32]) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let (bb, off) = match F {
        Q8_0 => (34, 0.0f32),
        Q4_0 => (18, -8.0f32),
        _ => (22, -16.0f32),
    };
    let m = rows.len();
    let yp = y.as_mut_ptr();
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    for blk in 0..y.len() / QK {
        let mut w = [0f32; MAX_ROWS];
        let mut q = [zero; MAX_ROWS];
        for j in 0..m {
            let p = rows[j].as_ptr().add(blk * bb);
            w[j] = c[j] * _mm_cvtss_f32(f16x2_at(p));
            q[j] = if F == Q8_0 {
                _mm256_loadu_si256(p.add(2) as *const __m256i)
            } else if F == Q4_0 {
                unpack_nibbles(p.add(2))
            } else {
                let qh = std::ptr::read_unaligned(p.add(2) as *const u32);
                let hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                _mm256_or_si256(unpack_nibbles(p.add(6)), hi)
            };
        }
        let wv = _mm256_loadu_ps(w.as_ptr());
        let amax = hmax_abs(wv);
        let o = yp.add(QK * blk);
        if amax == 0.0 {
            continue;
        }
        let bias = _mm256_set1_ps(off * hsum_ps(wv));
        let s = amax / 127.0;
        // e_j = round(w_j / s) as i8, packed into the low 8 bytes.
        let e32 = _mm256_cvtps_epi32(_mm256_mul_ps(wv, _mm256_set1_ps(127.0 / amax)));
        let e16 = _mm_packs_epi32(
            _mm256_castsi256_si128(e32),
            _mm256_extracti128_si256(e32, 1),
        );
        let e8 = _mm_cvtsi128_si64(_mm_packs_epi16(e16, e16)) as u64;
        let mut acc = [zero; 4];
        for g in 0..m.div_ceil(4) {
            let (a, b, cq, d) = (q[4 * g], q[4 * g + 1], q[4 * g + 2], q[4 * g + 3]);
            let (ab_lo, ab_hi) = (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b));
            let (cd_lo, cd_hi) = (_mm256_unpacklo_epi8(cq, d), _mm256_unpackhi_epi8(cq, d));
            let e4 = _mm256_set1_epi32((e8 >> (32 * g)) as u32 as i32);
            let inter = [
                _mm256_unpacklo_epi16(ab_lo, cd_lo),
                _mm256_unpackhi_epi16(ab_lo, cd_lo),
                _mm256_unpacklo_epi16(ab_hi, cd_hi),
                _mm256_unpackhi_epi16(ab_hi, cd_hi),
            ];
            for (a, x) in acc.iter_mut().zip(inter) {
                let prod = if F == Q8_0 {
                    _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(e4, x))
                } else {
                    _mm256_maddubs_epi16(x, e4)
                };
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(prod, ones));
            }
        }
        // acc[k]: outputs 4k..4k+4 in the low lane, 16+4k..16+4k+4 in the high lane.
        let sv = _mm256_set1_ps(s);
        let v: [__m256; 4] =
            std::array::from_fn(|k| _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[k]), sv, bias));
        let outs = [
            _mm256_permute2f128_ps(v[0], v[1], 0x20),
            _mm256_permute2f128_ps(v[2], v[3], 0x20),
            _mm256_permute2f128_ps(v[0], v[1], 0x31),
            _mm256_permute2f128_ps(v[2], v[3], 0x31),
        ];
        for (k, out) in outs.iter().enumerate() {
            _mm256_storeu_ps(
                o.add(8 * k),
                _mm256_add_ps(_mm256_loadu_ps(o.add(8 * k)), *out),
            );
        }
    }
}

/// Largest absolute value of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hmax_abs(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// For tests: how far the integer kernels may be from the reference at output `col` (zero for
/// the exact kernels): each row weight is rounded by at most half a step `s = max|w| / 127` of its
/// block (`w_j = c_j d_j`), times `|q|` (at most 31; Q8_0: 128).
#[cfg(test)]
pub(crate) fn rounding_bound(isa: Isa, q: QuantType, rows: &[&[u8]], c: &[f32], col: usize) -> f32 {
    let int = cfg!(target_arch = "x86_64")
        && matches!(isa, Isa::Avx2 | Isa::Avx512)
        && matches!(q, QuantType::Q5_0 | QuantType::Q4_0 | QuantType::Q8_0);
    if !int {
        return 0.0;
    }
    let qmax = if q == QuantType::Q8_0 { 128.0 } else { 31.0 };
    let wmax = rows
        .iter()
        .zip(c)
        .map(|(r, cj)| {
            let b = &r[col / QK * q.block_bytes()..];
            (cj * half::f16::from_le_bytes([b[0], b[1]]).to_f32()).abs()
        })
        .fold(0f32, f32::max);
    rows.len() as f32 * qmax * wmax / 127.0 / 2.0 * 1.001
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{random_f32, random_row};

    /// Every tier within 1e-5 of the reference (relative to the sum of |terms|), for every type,
    /// 1..=MAX_ROWS rows and several widths. The integer x86 kernels (Q5_0, Q4_0) also round each
    /// row weight `w_j = c_j d_j` to a step of `s = max|w| / 127`: at most `s / 2 * |q|` per term,
    /// `|q| <= 31`, so `m * 31 * s / 2` more per output.
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            let f = select(isa);
            for q in QuantType::ALL {
                for blocks in [1usize, 3, 9] {
                    // Float rows also at ragged widths (no block structure).
                    let n = match q.block_len() {
                        1 if blocks == 3 => 3 * QK + 5,
                        bl => blocks * bl.max(QK),
                    };
                    for m in 1..=MAX_ROWS {
                        let rows: Vec<Vec<u8>> = (0..m)
                            .map(|j| random_row(q, n, (j * 7 + n) as u64))
                            .collect();
                        let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                        let c = random_f32(m, m as u64);
                        let y0 = random_f32(n, 3);
                        let (mut want, mut got) = (y0.clone(), y0.clone());
                        scalar(q, &refs, &c, &mut want);
                        f(q, &refs, &c, &mut got);
                        let mut mag: Vec<f32> = y0.iter().map(|v| v.abs()).collect();
                        let mut row = vec![0f32; n];
                        for (r, cj) in refs.iter().zip(&c) {
                            crate::dequant::dequantize_row(q, r, &mut row);
                            mag.iter_mut()
                                .zip(&row)
                                .for_each(|(a, v)| *a += (cj * v).abs());
                        }
                        for i in 0..n {
                            let step = rounding_bound(isa, q, &refs, &c, i);
                            assert!(
                                (got[i] - want[i]).abs() <= 1e-5 * mag[i] + 1e-6 + step,
                                "{isa} {q:?} n {n} rows {m} i {i}: {} vs {}",
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
