//! Q4_1 row . Q8A activations.
//!
//! Reference, per block b: `x = d_w * q + m` with q in 0..16, so
//! `dot_b = d_w * d_a * sum(q * qa) + m * s_a` with `s_a = d_a * sum(qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ4_1, BlockQ8A, QK};

select_q8a_kernel!(neon);
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q4_1;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ4_1]> {
    super::as_blocks(row)
}

/// Nibble q of element i (low nibbles are elements 0..16, high nibbles 16..32).
fn unpack(b: &BlockQ4_1) -> [i8; QK] {
    std::array::from_fn(|i| {
        if i < 16 {
            (b.qs[i] & 0xF) as i8
        } else {
            (b.qs[i - 16] >> 4) as i8
        }
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
        acc += b.d.to_f32() * a.d * s as f32 + b.m.to_f32() * a.s;
    }
    acc
}

pub fn portable(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        let s = super::dot_q8_0::dot32_wide(&unpack(b), &a.qs);
        acc += b.d.to_f32() * a.d * s as f32 + b.m.to_f32() * a.s;
    }
    acc
}

x86_q8a_tiers!(BlockQ4_1, pairs);
arm_q8a_tiers!(BlockQ4_1, blocks);

/// For `arm::block_loop`: unsigned nibbles, offset factor the min `m`.
#[cfg(target_arch = "aarch64")]
impl super::arm::Block32 for BlockQ4_1 {
    #[inline(always)]
    unsafe fn d(&self) -> f32 {
        super::arm::f16(self.d.to_bits())
    }
    #[inline(always)]
    unsafe fn off_w(&self, _: f32) -> f32 {
        super::arm::f16(self.m.to_bits())
    }
    #[inline(always)]
    unsafe fn quants(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        super::arm::nibbles(self.qs.as_ptr())
    }
}

/// For `x86::pair_loop`: unsigned nibbles q, value `d_w d_a (q . qa) + m s_a`.
#[cfg(target_arch = "x86_64")]
impl super::x86::Step32 for BlockQ4_1 {
    const OFF_SCALE: f32 = 1.0;
    /// `[d, m]`, adjacent in the block.
    #[inline(always)]
    unsafe fn scales(&self) -> std::arch::x86_64::__m128 {
        super::x86::f16x2_at(self as *const Self as *const u8)
    }
    #[inline(always)]
    unsafe fn idot<const VNNI: bool>(
        &self,
        qa: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use super::x86::*;
        dot_u8i8_v::<VNNI>(unpack_nibbles(self.qs.as_ptr()), qa)
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q4_1);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q4_1);
    }
}
