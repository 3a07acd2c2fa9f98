//! Q5_0 row . Q8A activations.
//!
//! Reference, per block: 5-bit q = nibble | (bit j of qh) << 4, `x = d_w * (q - 16)`, so
//! `dot_b = d_w * (d_a * sum(q * qa) - 16 * s_a)` with `s_a = d_a * sum(qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ5_0, BlockQ8A, QK};

select_q8a_kernel!();
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
