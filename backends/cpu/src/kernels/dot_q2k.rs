//! Q2_K row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference: element l (< 32) of group k = 4n + s (activation block k) is bits `2s..2s+2` of
//! `qs[32n + l]`, in sub-block `2k + l / 16`, whose byte `scales[2k + l / 16]` holds a 4-bit
//! scale (low) and min (high): `x = d * sc * q - dmin * m`, so per 16 values
//! `dot = d * sc * d_a * sum(q * qa) - dmin * m * d_a * sum(qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ2K, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q2K;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ2K]> {
    super::as_blocks(row)
}

/// The 32 values (0..4) of group k.
fn unpack(b: &BlockQ2K, k: usize) -> [i8; QK] {
    let q = &b.qs[32 * (k / 4)..][..32];
    std::array::from_fn(|l| ((q[l] >> (2 * (k % 4))) & 3) as i8)
}

fn generic(row: &[u8], act: &[BlockQ8A], dot16: impl Fn(&[i8], &[i8]) -> i32) -> f32 {
    let mut acc = 0f32;
    let ones = [1i8; 16];
    for (b, a8) in blocks(row).iter().zip(act.chunks_exact(8)) {
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        for (k, a) in a8.iter().enumerate() {
            let q = unpack(b, k);
            for h in 0..2 {
                let sc = b.scales[2 * k + h];
                let qa = &a.qs[16 * h..16 * h + 16];
                let (s, sa) = (dot16(&q[16 * h..16 * h + 16], qa), dot16(&ones, qa));
                acc +=
                    a.d * (d * (sc & 0xF) as f32 * s as f32 - dmin * (sc >> 4) as f32 * sa as f32);
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

x86_q8a_tiers!(BlockQ2K, x86_body);

/// Per group: `maddubs` of the 2-bit values (and of ones: the activation sums) with the
/// activation quants, `madd` with the per-16 scales (and mins); one float scaling per super-block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockQ2K], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let (mut acc, mut acc_min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (m3, m4, ones) = (_mm256_set1_epi8(3), _mm_set1_epi8(0xF), _mm256_set1_epi8(1));
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        let sb = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
        let scales = _mm256_cvtepu8_epi16(_mm_and_si128(sb, m4));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), m4));
        let (mut p, mut pm) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
        for n in 0..2 {
            let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * n) as *const __m256i);
            for s in 0..4 {
                let k = 4 * n + s;
                let shift = _mm_cvtsi32_si128(2 * s as i32);
                let q = _mm256_and_si256(_mm256_srl_epi16(raw, shift), m3);
                let qa = load_i8x32(&a8[k].qs);
                p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, qa), scale_pair(scales, k));
                pm[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, qa), scale_pair(mins, k));
            }
        }
        let (ad, _) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(ad, _mm256_set1_ps(f16(b.d)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, acc);
        let fac_min = _mm256_mul_ps(ad, _mm256_set1_ps(f16(b.dmin)));
        acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&pm)), fac_min, acc_min);
    }
    hsum_ps(_mm256_sub_ps(acc, acc_min))
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q2K);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q2K);
    }
}
