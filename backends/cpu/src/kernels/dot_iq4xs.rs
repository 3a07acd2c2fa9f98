//! IQ4_XS row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference: sub-block j (activation block j) is an IQ4_NL block of 32 levels from
//! `qs[16j..16j+16]` with the signed scale `iq4xs_scale(b, j)`: `x = d * scale_j * level`, so
//! `dot_j = d * scale_j * d_a * sum(level * qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{iq4xs_scale, BlockIQ4XS, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::IQ4XS;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockIQ4XS]> {
    super::as_blocks(row)
}

fn generic(row: &[u8], act: &[BlockQ8A], dot32: impl Fn(&[i8; QK], &[i8; QK]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a8) in blocks(row).iter().zip(act.chunks_exact(8)) {
        let d = b.d.to_f32();
        for (j, a) in a8.iter().enumerate() {
            let s = dot32(&super::dot_iq4nl::levels(&b.qs[16 * j..16 * j + 16]), &a.qs);
            acc += d * iq4xs_scale(b, j) as f32 * a.d * s as f32;
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

x86_q8a_tiers!(BlockIQ4XS, x86_body);

/// Per sub-block a signed dot of the looked-up levels; the 8 sums reduced together and scaled
/// by one vector `d * scale_j * d_a(j)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockIQ4XS], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        // Plain loops, not closures: a closure would not inherit the tier's target features.
        let mut p = [_mm256_setzero_si256(); 8];
        let mut sc = [0i32; 8];
        for j in 0..8 {
            let lv = iq4nl_levels(unpack_nibbles(b.qs.as_ptr().add(16 * j)));
            p[j] = dot_i8i8_v::<VNNI>(lv, load_i8x32(&a8[j].qs));
            sc[j] = iq4xs_scale(b, j);
        }
        let scf = _mm256_cvtepi32_ps(_mm256_loadu_si256(sc.as_ptr() as *const __m256i));
        let (ad, _) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(_mm256_mul_ps(scf, _mm256_set1_ps(f16(b.d))), ad);
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
        check_dot_tiers(QuantType::IQ4XS);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::IQ4XS);
    }
}
