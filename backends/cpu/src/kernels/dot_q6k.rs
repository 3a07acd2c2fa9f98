//! Q6_K row . Q8A activations (8 activation blocks per 256-element super-block).
//!
//! Reference: half n (128 elements, activation blocks 4n..4n+4) reads `ql[64n..]`, `qh[32n..]`.
//! Element l of activation block k (l < 32) has 6-bit q from the low (k = 0, 1) or high (k = 2, 3)
//! nibble of `ql[l + 32 * (k % 2)]` and bits `2k..2k+2` of `qh[l]`; its scale is
//! `scales[8n + 2k + l / 16]`. `x = d * scale * (q - 32)`, so per 16 values
//! `dot = d * scale * d_a * (sum(q * qa) - 32 * sum(qa))`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ6K, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q6K;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ6K]> {
    super::as_blocks(row)
}

/// The 32 values (q - 32) of activation block k of half n.
fn unpack(b: &BlockQ6K, n: usize, k: usize) -> [i8; QK] {
    let ql = &b.ql[64 * n + 32 * (k % 2)..][..32];
    let qh = &b.qh[32 * n..][..32];
    std::array::from_fn(|l| {
        let low = if k < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
        (low | (((qh[l] >> (2 * k)) & 3) << 4)) as i8 - 32
    })
}

fn generic(row: &[u8], act: &[BlockQ8A], dot16: impl Fn(&[i8], &[i8]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a8) in blocks(row).iter().zip(act.chunks_exact(8)) {
        let d = b.d.to_f32();
        for n in 0..2 {
            for k in 0..4 {
                let a = &a8[4 * n + k];
                let q = unpack(b, n, k);
                for h in 0..2 {
                    let s = dot16(&q[16 * h..16 * h + 16], &a.qs[16 * h..16 * h + 16]);
                    acc += d * b.scales[8 * n + 2 * k + h] as f32 * a.d * s as f32;
                }
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

/// A 16-element i8 dot with `wide` (the portable tier of the types with 16-element scales).
pub(crate) fn dot16_wide(w: &[i8], x: &[i8]) -> i32 {
    use wide::{i16x16, i8x16};
    let wide16 =
        |x: &[i8]| i16x16::from_i8x16(i8x16::from(<[i8; 16]>::try_from(x).unwrap_or([0; 16])));
    wide16(w).dot(wide16(x)).reduce_add()
}

pub fn portable(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    generic(row, act, dot16_wide)
}

x86_q8a_tiers!(BlockQ6K, x86_body);

/// The x86 kernel, compiled into each tier's feature set. Per super-block: the 8 activation
/// blocks' integer dots (each already weighted by its two 16-element scales) reduced together,
/// then one multiply by `d * d_a(k)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_body<const VNNI: bool, const PF: bool>(w: &[BlockQ6K], act: &[BlockQ8A]) -> f32 {
    use super::x86::*;
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(3);
    let c32 = _mm256_set1_epi8(32);
    // Picks i16 lane 0 of each 128-bit half's pair into the low half and lane 1 into the high one.
    for (b, a8) in w.iter().zip(act.chunks_exact(8)) {
        if PF {
            prefetch_block_ahead(b);
        }
        // All 16 scales as i16; pair k (scales 2k, 2k+1) is i32 lane k.
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.scales.as_ptr() as *const __m128i));
        let mut p = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * n) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * n + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * n) as *const __m256i);
            let lows = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            ];
            let highs = [
                _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30)),
            ];
            for k in 0..4 {
                let kk = 4 * n + k;
                let q = _mm256_or_si256(lows[k], highs[k]);
                let qa = load_i8x32(&a8[kk].qs);
                // i16 pair sums of (q - 32) * qa, then weighted by the two scales and summed to i32.
                let d16 =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(q, qa), _mm256_maddubs_epi16(c32, qa));
                p[kk] = _mm256_madd_epi16(d16, scale_pair(scales, kk));
            }
        }
        let (ad, _) = act_d_s_x8(a8);
        let fac = _mm256_mul_ps(ad, _mm256_set1_ps(f16(b.d)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, acc);
    }
    hsum_ps(acc)
}

x86_q8a_tokens!(BlockQ6K, x86_tokens);

/// [`x86_body`] for several tokens: each super-block's quants unpacked once, then each token's
/// integer dots and float sums in [`x86_body`]'s operations and order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn x86_tokens<const VNNI: bool, const PF: bool>(
    w: &[BlockQ6K],
    acts: &[&[BlockQ8A]],
    out: &mut [f32],
) {
    use super::x86::*;
    use std::arch::x86_64::*;
    let n = acts.len();
    let mut acc = [_mm256_setzero_ps(); super::MAX_Q8A_TOKENS];
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(3);
    let c32 = _mm256_set1_epi8(32);
    for (i, b) in w.iter().enumerate() {
        if PF {
            prefetch_block_ahead(b);
        }
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.scales.as_ptr() as *const __m128i));
        let mut q = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h) as *const __m256i);
            let lows = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            ];
            let highs = [
                _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30)),
            ];
            for k in 0..4 {
                q[4 * h + k] = _mm256_or_si256(lows[k], highs[k]);
            }
        }
        let d = _mm256_set1_ps(f16(b.d));
        for (acc, act) in acc.iter_mut().zip(acts).take(n) {
            let a8 = &act[8 * i..8 * i + 8];
            let p: [__m256i; 8] = std::array::from_fn(|kk| {
                let qa = load_i8x32(&a8[kk].qs);
                let d16 = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(q[kk], qa),
                    _mm256_maddubs_epi16(c32, qa),
                );
                _mm256_madd_epi16(d16, scale_pair(scales, kk))
            });
            let (ad, _) = act_d_s_x8(a8);
            let fac = _mm256_mul_ps(ad, d);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8_epi32(&p)), fac, *acc);
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        *o = hsum_ps(acc);
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q6K);
    }
    #[test]
    fn tokens_equal_one_token_dots() {
        check_dot_tokens(QuantType::Q6K);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q6K);
    }
}
