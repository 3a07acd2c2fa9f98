//! Q5_0 row . Q8A activations.
//!
//! Reference, per block: 5-bit q = nibble | (bit j of qh) << 4, `x = d_w * (q - 16)`, so
//! `dot_b = d_w * (d_a * sum(q * qa) - 16 * s_a)` with `s_a = d_a * sum(qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ5_0, BlockQ8A, QK};

select_q8a_kernel!(neon);
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q5_0;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ5_0]> {
    super::as_blocks(row)
}

fn unpack(b: &BlockQ5_0) -> [i8; QK] {
    let qh = u32::from_le_bytes(b.qh);
    std::array::from_fn(|i| {
        let nib = if i < 16 {
            b.qs[i] & 0xF
        } else {
            b.qs[i - 16] >> 4
        };
        (nib | ((((qh >> i) & 1) as u8) << 4)) as i8
    })
}

pub fn scalar(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        let q = unpack(b);
        let s: i32 = q
            .iter()
            .zip(&a.qs)
            .map(|(&w, &x)| w as i32 * x as i32)
            .sum();
        acc += b.d.to_f32() * (a.d * s as f32 - 16.0 * a.s);
    }
    acc
}

pub fn portable(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        let s = super::dot_q8_0::dot32_wide(&unpack(b), &a.qs);
        acc += b.d.to_f32() * (a.d * s as f32 - 16.0 * a.s);
    }
    acc
}

x86_q8a_tiers!(BlockQ5_0, pairs);
arm_q8a_tiers!(BlockQ5_0, blocks);

/// For `arm::block_loop`: nibbles plus the fifth bits of `qh` (bit `i`: element `i`), offset
/// factor `-16 d_w`.
#[cfg(target_arch = "aarch64")]
impl super::arm::Block32 for BlockQ5_0 {
    #[inline(always)]
    unsafe fn d(&self) -> f32 {
        super::arm::f16(self.d.to_bits())
    }
    #[inline(always)]
    unsafe fn off_w(&self, d: f32) -> f32 {
        -16.0 * d
    }
    #[inline(always)]
    unsafe fn quants(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        use std::arch::aarch64::*;
        let [lo, hi] = super::arm::nibbles(self.qs.as_ptr());
        // Byte i of a half: byte i / 8 of its 16 qh bits, tested against bit i % 8, to 0x10.
        let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
        let fifth = |h: [u8; 2]| {
            let v = vcombine_u8(vdup_n_u8(h[0]), vdup_n_u8(h[1]));
            vreinterpretq_s8_u8(vandq_u8(vtstq_u8(v, bit), vdupq_n_u8(0x10)))
        };
        [
            vorrq_s8(lo, fifth([self.qh[0], self.qh[1]])),
            vorrq_s8(hi, fifth([self.qh[2], self.qh[3]])),
        ]
    }
}

/// For `x86::pair_loop`: unsigned 5-bit q, value `d_w d_a (q . qa) - 16 d_w s_a`.
#[cfg(target_arch = "x86_64")]
impl super::x86::Step32 for BlockQ5_0 {
    const OFF_SCALE: f32 = -16.0;
    /// `[d, d]`: the offset factor is the scale itself (x -16).
    #[inline(always)]
    unsafe fn scales(&self) -> std::arch::x86_64::__m128 {
        super::x86::f16_dup_at(self as *const Self as *const u8)
    }
    #[inline(always)]
    unsafe fn idot<const VNNI: bool>(
        &self,
        qa: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use super::x86::*;
        use std::arch::x86_64::*;
        let hi = _mm256_and_si256(
            bytes_from_bits_32(u32::from_le_bytes(self.qh)),
            _mm256_set1_epi8(0x10),
        );
        dot_u8i8_v::<VNNI>(_mm256_or_si256(unpack_nibbles(self.qs.as_ptr()), hi), qa)
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q5_0);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q5_0);
    }
}
