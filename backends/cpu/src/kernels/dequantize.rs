//! Dequantize a row to f32 (prefill multiplies dequantized tiles with gemm).
//!
//! Reference: `crate::dequant::dequantize_row` (the block formulas of `dejavu_backend_api::quant`).
//! The AVX2/AVX-512 tier vectorises the 32-wide formats SmolLM2 and Qwen2.5 use most (Q4_0, Q4_1,
//! Q5_0, Q8_0); other types and the portable tier use the reference.
use crate::isa::Isa;
use dejavu_backend_api::quant::QuantType;

pub type DequantFn = fn(QuantType, &[u8], &mut [f32]);

pub fn select(isa: Isa) -> DequantFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        _ => crate::dequant::dequantize_row,
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(qtype: QuantType, row: &[u8], out: &mut [f32]) {
    crate::dequant::check(qtype, row, out);
    match qtype {
        // SAFETY: handed out by `select` only for tiers with AVX2/FMA/F16C; the row holds
        // exactly `out.len()` elements of `qtype` (checked above).
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q8_0 => unsafe {
            avx2_impl(qtype, row, out)
        },
        _ => crate::dequant::dequantize_row(qtype, row, out),
    }
}

/// One block of a 32-element type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; `b` its bytes) as
/// `dequant::unpack_block` gives it: 32 signed values in a register, the scale `d` and the
/// offset (`m` for Q4_1 and Q5_1, else 0). Shared by this file and the integer prefill's panels.
/// Callers guarantee AVX2/F16C and a whole block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block32_avx2(
    qtype: QuantType,
    b: &[u8],
) -> (std::arch::x86_64::__m256i, f32, f32) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let p = b.as_ptr();
    let f16_at = |o: usize| f16(half::f16::from_le_bytes([b[o], b[o + 1]]));
    let fifth = |o: usize| {
        let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10))
    };
    let d = f16_at(0);
    match qtype {
        QuantType::Q8_0 => (_mm256_loadu_si256(p.add(2) as *const __m256i), d, 0.0),
        QuantType::Q4_0 => (
            _mm256_sub_epi8(unpack_nibbles(p.add(2)), _mm256_set1_epi8(8)),
            d,
            0.0,
        ),
        QuantType::IQ4NL => (iq4nl_levels(unpack_nibbles(p.add(2))), d, 0.0),
        QuantType::Q4_1 => (unpack_nibbles(p.add(4)), d, f16_at(2)),
        QuantType::Q5_0 => (
            _mm256_sub_epi8(
                _mm256_or_si256(unpack_nibbles(p.add(6)), fifth(2)),
                _mm256_set1_epi8(16),
            ),
            d,
            0.0,
        ),
        QuantType::Q5_1 => (
            _mm256_or_si256(unpack_nibbles(p.add(8)), fifth(4)),
            d,
            f16_at(2),
        ),
        _ => unreachable!("{} is not a 32-element integer type", qtype.name()),
    }
}

/// `y = d * q` (`y = fma(d, q, m)` for Q4_1) from [`block32_avx2`], 8 values at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl(qtype: QuantType, row: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let bb = qtype.block_bytes();
    for (b, y) in row.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
        let (q, d, m) = block32_avx2(qtype, b);
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        let yp = y.as_mut_ptr();
        for k in 0..4 {
            let lane = match k {
                0 => _mm256_castsi256_si128(q),
                1 => _mm_srli_si128(_mm256_castsi256_si128(q), 8),
                2 => _mm256_extracti128_si256(q, 1),
                _ => _mm_srli_si128(_mm256_extracti128_si256(q, 1), 8),
            };
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lane));
            let v = if qtype == QuantType::Q4_1 {
                _mm256_fmadd_ps(d, v, m)
            } else {
                _mm256_mul_ps(d, v)
            };
            _mm256_storeu_ps(yp.add(8 * k), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_row;

    /// Every tier equals the reference up to one rounding (`fmadd` vs `mul` + `add`).
    #[test]
    fn tiers_match_reference() {
        for isa in Isa::supported() {
            for qtype in QuantType::ALL {
                for nb in [1usize, 7, 33] {
                    let n = nb * qtype.block_len().max(32);
                    let row = random_row(qtype, n, n as u64);
                    let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                    crate::dequant::dequantize_row(qtype, &row, &mut want);
                    select(isa)(qtype, &row, &mut got);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                            "{isa} {qtype:?} elem {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
