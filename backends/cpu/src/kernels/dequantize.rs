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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl(qtype: QuantType, row: &[u8], out: &mut [f32]) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let bb = qtype.block_bytes();
    for (b, y) in row.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
        let p = b.as_ptr();
        let sc = f16x2_at(p); // [d, second f16 (m for Q4_1), ..]
        let d = _mm256_broadcastss_ps(sc);
        // 32 values as bytes (unsigned for the nibble formats, signed for Q8_0) and an offset.
        let (q, off, signed) = match qtype {
            QuantType::Q4_0 => (unpack_nibbles(p.add(2)), _mm256_set1_ps(-8.0), false),
            QuantType::Q4_1 => (unpack_nibbles(p.add(4)), _mm256_setzero_ps(), false),
            QuantType::Q5_0 => {
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                (
                    _mm256_or_si256(unpack_nibbles(p.add(6)), hi),
                    _mm256_set1_ps(-16.0),
                    false,
                )
            }
            _ => (
                _mm256_loadu_si256(p.add(2) as *const __m256i),
                _mm256_setzero_ps(),
                true,
            ),
        };
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(sc));
        let yp = y.as_mut_ptr();
        for k in 0..4 {
            let lane = match k {
                0 => _mm256_castsi256_si128(q),
                1 => _mm_srli_si128(_mm256_castsi256_si128(q), 8),
                2 => _mm256_extracti128_si256(q, 1),
                _ => _mm_srli_si128(_mm256_extracti128_si256(q, 1), 8),
            };
            let ints = if signed {
                _mm256_cvtepi8_epi32(lane)
            } else {
                _mm256_cvtepu8_epi32(lane)
            };
            let v = _mm256_add_ps(_mm256_cvtepi32_ps(ints), off);
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
