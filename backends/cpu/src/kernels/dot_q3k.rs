//! Q3_K row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference: element l (< 32) of group k = 4n + s (activation block k) has the two bits
//! `2s..2s+2` of `qs[32n + l]` and, as a third, bit k of `hmask[l]` (clear: minus 4), so
//! q in -4..4; it is in sub-block `2k + l / 16` with the signed scale `q3k_scales(..)[2k + l / 16]`:
//! `x = d * scale * q`, so per 16 values `dot = d * scale * d_a * sum(q * qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{q3k_scales, BlockQ3K, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q3K;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ3K]> {
    super::as_blocks(row)
}

/// The 32 values (-4..4) of group k.
fn unpack(b: &BlockQ3K, k: usize) -> [i8; QK] {
    let q = &b.qs[32 * (k / 4)..][..32];
    std::array::from_fn(|l| {
        let low = ((q[l] >> (2 * (k % 4))) & 3) as i8;
        low - if (b.hmask[l] >> k) & 1 == 1 { 0 } else { 4 }
    })
}

fn generic(row: &[u8], act: &[BlockQ8A], dot16: impl Fn(&[i8], &[i8]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a8) in blocks(row).iter().zip(act.chunks_exact(8)) {
        let d = b.d.to_f32();
        let sc = q3k_scales(&b.scales);
        for (k, a) in a8.iter().enumerate() {
            let q = unpack(b, k);
            for h in 0..2 {
                let s = dot16(&q[16 * h..16 * h + 16], &a.qs[16 * h..16 * h + 16]);
                acc += d * sc[2 * k + h] as f32 * a.d * s as f32;
            }
        }
    }
    acc
}

pub fn scalar(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    generic(row, act, |w, x| {
        w.iter().zip(x).map(|(&w, &x)| w as i32 * x as i32).sum()
    })
}

pub fn portable(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    generic(row, act, super::dot_q6k::dot16_wide)
}

x86_q8a_tiers!(BlockQ3K, x86_body);

/// Q6_K's scheme: unsigned `q + 4` (two bits, and the hmask bit as bit 2) through `maddubs`,
/// minus `4 * sum(qa)`, then `madd` with the per-16 scales.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockQ3K], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let (m3, c4) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        let sc = q3k_scales(&b.scales);
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
        let hm = _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i);
        let mut p = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * n) as *const __m256i);
            for s in 0..4 {
                let k = 4 * n + s;
                let shift = _mm_cvtsi32_si128(2 * s as i32);
                let low = _mm256_and_si256(_mm256_srl_epi16(raw, shift), m3);
                // Bit k of each hmask byte, moved to bit 4 and then (16-bit shift) to bit 2.
                let q = _mm256_or_si256(low, _mm256_srli_epi16(fifth_bit(hm, k), 2));
                let qa = load_i8x32(&a8[k].qs);
                let d16 =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(q, qa), _mm256_maddubs_epi16(c4, qa));
                p[k] = _mm256_madd_epi16(d16, scale_pair(scales, k));
            }
        }
        let (ad, _) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(ad, _mm256_set1_ps(f16(b.d)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, acc);
    }
    hsum_ps(acc)
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q3K);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q3K);
    }
}
