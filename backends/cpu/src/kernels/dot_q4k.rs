//! Q4_K row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference, per sub-block j (32 elements, activation block j): `x = d * sc_j * q - dmin * m_j`,
//! so `dot_j = d * sc_j * d_a * sum(q * qa) - dmin * m_j * s_a` with `s_a = d_a * sum(qa)`. Group g of 64 elements
//! reads bytes `qs[32g..32g+32]`: low nibbles are sub-block 2g, high nibbles sub-block 2g+1.
use crate::isa::Isa;
use dejavu_backend_api::quant::{q4k_scale_min, BlockQ4K, BlockQ8A, QK};

select_q8a_kernel!(neon);
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q4K;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ4K]> {
    super::as_blocks(row)
}

/// The 32 values of sub-block j.
fn unpack(b: &BlockQ4K, j: usize) -> [i8; QK] {
    let q = &b.qs[32 * (j / 2)..32 * (j / 2) + 32];
    std::array::from_fn(|l| {
        if j.is_multiple_of(2) {
            (q[l] & 0xF) as i8
        } else {
            (q[l] >> 4) as i8
        }
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

x86_q8a_tiers!(BlockQ4K, x86_body);
arm_q8a_tiers!(BlockQ4K, arm_body);

/// The 8 scales and 8 mins of a super-block, unpacked from 12 bytes, as the bytes of two u64
/// (byte j = sub-block j; same values as [`q4k_scale_min`]).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8; 12]) -> (u64, u64) {
    let u = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (u0, u1, u2) = (u(0), u(4), u(8));
    const LOW6: u32 = 0x3f3f3f3f;
    const LOW4: u32 = 0x0f0f0f0f;
    const TOP2: u32 = 0x03030303;
    // j < 4: low 6 bits of bytes 0..4 (scales) and 4..8 (mins); j >= 4: a nibble of bytes 8..12
    // plus the top 2 bits of bytes 0..4 (scales) or 4..8 (mins).
    let sc = (u0 & LOW6) as u64 | (((u2 & LOW4) | (((u0 >> 6) & TOP2) << 4)) as u64) << 32;
    let mn = (u1 & LOW6) as u64 | ((((u2 >> 4) & LOW4) | (((u1 >> 6) & TOP2) << 4)) as u64) << 32;
    (sc, mn)
}

/// The x86 kernel, compiled into each tier's feature set; `VNNI` picks the byte-dot instruction.
/// Per super-block: 8 integer sub-block dots reduced together, then one vector of float factors
/// `d * sc_j * d_a(j)` and one of min terms `dmin * m_j * s_a(j)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockQ4K], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let (mut acc, mut acc_min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mask = _mm256_set1_epi8(0x0F);
    let bytes_f32 = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        let mut p = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * g) as *const __m256i);
            let lo = _mm256_and_si256(raw, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            p[2 * g] = dot_u8i8_v::<VNNI>(lo, load_i8x32(&a8[2 * g].qs));
            p[2 * g + 1] = dot_u8i8_v::<VNNI>(hi, load_i8x32(&a8[2 * g + 1].qs));
        }
        let (sc, mn) = scales_mins(&b.scales);
        let (ad, asum) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(_mm256_mul_ps(bytes_f32(sc), _mm256_set1_ps(f16(b.d))), ad);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, acc);
        let mins = _mm256_mul_ps(bytes_f32(mn), _mm256_set1_ps(f16(b.dmin)));
        acc_min = _mm256_fmadd_ps(mins, asum, acc_min);
    }
    hsum_ps(_mm256_sub_ps(acc, acc_min))
}

x86_q8a_tokens!(BlockQ4K, x86_tokens);

/// [`x86_body`] for several tokens: each super-block's nibbles unpacked and its scales and
/// mins decoded once, then each token's integer dots and float sums in [`x86_body`]'s
/// operations and order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_tokens<const VNNI: bool, const PF: bool>(
    w: &[BlockQ4K],
    acts: &[&[BlockQ8A]],
    out: &mut [f32],
) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let n = acts.len();
    let mut acc = [_mm256_setzero_ps(); super::MAX_Q8A_TOKENS];
    let mut acc_min = acc;
    let mask = _mm256_set1_epi8(0x0F);
    let bytes_f32 = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    for (i, b) in w.iter().enumerate() {
        if PF {
            prefetch_block_ahead(b);
        }
        let mut q = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * g) as *const __m256i);
            q[2 * g] = _mm256_and_si256(raw, mask);
            q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
        let (sc, mn) = scales_mins(&b.scales);
        let scd = _mm256_mul_ps(bytes_f32(sc), _mm256_set1_ps(f16(b.d)));
        let mins = _mm256_mul_ps(bytes_f32(mn), _mm256_set1_ps(f16(b.dmin)));
        for ((acc, acc_min), act) in acc.iter_mut().zip(&mut acc_min).zip(acts).take(n) {
            let a8 = &act[8 * i..8 * i + 8];
            let p: [__m256i; 8] =
                std::array::from_fn(|j| dot_u8i8_v::<VNNI>(q[j], load_i8x32(&a8[j].qs)));
            let (ad, asum) = act_d_s_x8(a8);
            let fac = _mm256_mul_ps(scd, ad);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, *acc);
            *acc_min = _mm256_fmadd_ps(mins, asum, *acc_min);
        }
    }
    for ((o, acc), acc_min) in out.iter_mut().zip(acc).zip(acc_min) {
        *o = hsum_ps(_mm256_sub_ps(acc, acc_min));
    }
}

/// The NEON kernel: per super-block, 8 sub-block dots as 4-lane partial sums, reduced to one
/// vector per 4 sub-blocks, then scaled by `d * sc_j * d_a(j)` in float lanes; the min terms
/// `dmin * m_j * s_a(j)` accumulate beside them.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
unsafe fn arm_body<const DOT: bool>(w: &[BlockQ4K], act: &[BlockQ8A]) -> f32 {
    use super::arm::*;
    use std::arch::aarch64::*;
    let (mut acc, mut acc_min) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        let mut p = [vdupq_n_s32(0); 8];
        for g in 0..4 {
            let [lo0, hi0] = nibbles(b.qs.as_ptr().add(32 * g));
            let [lo1, hi1] = nibbles(b.qs.as_ptr().add(32 * g + 16));
            p[2 * g] = dot32::<DOT>([lo0, lo1], load32(a8[2 * g].qs.as_ptr()));
            p[2 * g + 1] = dot32::<DOT>([hi0, hi1], load32(a8[2 * g + 1].qs.as_ptr()));
        }
        let sums = [
            hsum4([p[0], p[1], p[2], p[3]]),
            hsum4([p[4], p[5], p[6], p[7]]),
        ];
        let (sc, mn) = scales_mins(&b.scales);
        let (sc, mn) = (bytes_f32(sc), bytes_f32(mn));
        let (d, dmin) = (f16(b.d.to_bits()), f16(b.dmin.to_bits()));
        for h in 0..2 {
            let ad: [f32; 4] = std::array::from_fn(|j| a8[4 * h + j].d);
            let asum: [f32; 4] = std::array::from_fn(|j| a8[4 * h + j].s);
            let fac = vmulq_f32(vmulq_n_f32(sc[h], d), vld1q_f32(ad.as_ptr()));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(sums[h]), fac);
            acc_min = vfmaq_f32(acc_min, vmulq_n_f32(mn[h], dmin), vld1q_f32(asum.as_ptr()));
        }
    }
    vaddvq_f32(vsubq_f32(acc, acc_min))
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q4K);
    }
    #[test]
    fn tokens_equal_one_token_dots() {
        check_dot_tokens(QuantType::Q4K);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q4K);
    }
}

#[cfg(test)]
mod scale_tests {
    use super::*;

    #[test]
    fn scales_mins_match_the_reference_unpacking() {
        let mut r = crate::kernels::testutil::rng(3);
        for _ in 0..1000 {
            let s: [u8; 12] = rand::Rng::gen(&mut r);
            let (sc, mn) = scales_mins(&s);
            for j in 0..8 {
                let (want_sc, want_m) = q4k_scale_min(j, &s);
                assert_eq!(
                    ((sc >> (8 * j)) as u8, (mn >> (8 * j)) as u8),
                    (want_sc, want_m)
                );
            }
        }
    }
}
