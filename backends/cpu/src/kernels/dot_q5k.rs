//! Q5_K row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference, per sub-block j (32 elements, activation block j): Q4_K's nibble (low nibbles of
//! `qs[32(j/2)..]` for even j, high for odd) plus bit j of `qh[l]` as the fifth bit, q in 0..32;
//! `x = d * sc_j * q - dmin * m_j`, so `dot_j = d * sc_j * d_a * sum(q * qa) - dmin * m_j * s_a`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{q4k_scale_min, BlockQ5K, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q5K;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ5K]> {
    super::as_blocks(row)
}

/// The 32 values of sub-block j.
fn unpack(b: &BlockQ5K, j: usize) -> [i8; QK] {
    let q = &b.qs[32 * (j / 2)..][..32];
    std::array::from_fn(|l| {
        let low = if j.is_multiple_of(2) {
            q[l] & 0xF
        } else {
            q[l] >> 4
        };
        (low | (((b.qh[l] >> j) & 1) << 4)) as i8
    })
}

fn generic(row: &[u8], act: &[BlockQ8A], dot32: impl Fn(&[i8; QK], &[i8; QK]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a8) in blocks(row).iter().zip(act.chunks_exact(8)) {
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        for (j, a) in a8.iter().enumerate() {
            let (sc, m) = q4k_scale_min(j, &b.scales);
            let s = dot32(&unpack(b, j), &a.qs);
            acc += d * sc as f32 * a.d * s as f32 - dmin * m as f32 * a.s;
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
    generic(row, act, super::dot_q8_0::dot32_wide)
}

x86_q8a_tiers!(BlockQ5K, x86_body);

/// Q4_K's x86 kernel with the fifth bits or-ed in (`fifth_bit` of the 32 `qh` bytes).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockQ5K], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let (mut acc, mut acc_min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mask = _mm256_set1_epi8(0x0F);
    let bytes_f32 = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        let qh = _mm256_loadu_si256(b.qh.as_ptr() as *const __m256i);
        let mut p = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * g) as *const __m256i);
            let lo = _mm256_or_si256(_mm256_and_si256(raw, mask), fifth_bit(qh, 2 * g));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                fifth_bit(qh, 2 * g + 1),
            );
            p[2 * g] = dot_u8i8_v::<VNNI>(lo, load_i8x32(&a8[2 * g].qs));
            p[2 * g + 1] = dot_u8i8_v::<VNNI>(hi, load_i8x32(&a8[2 * g + 1].qs));
        }
        let (sc, mn) = super::dot_q4k::scales_mins(&b.scales);
        let (ad, asum) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(_mm256_mul_ps(bytes_f32(sc), _mm256_set1_ps(f16(b.d))), ad);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, acc);
        let mins = _mm256_mul_ps(bytes_f32(mn), _mm256_set1_ps(f16(b.dmin)));
        acc_min = _mm256_fmadd_ps(mins, asum, acc_min);
    }
    hsum_ps(_mm256_sub_ps(acc, acc_min))
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q5K);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q5K);
    }
}
