//! Q8_0 row . Q8A activations.
//!
//! Reference, per block: `dot_b = d_w * d_a * sum(qw * qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, BlockQ8_0, QK};

select_q8a_kernel!(neon);
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q8_0;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ8_0]> {
    super::as_blocks(row)
}

pub fn scalar(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        let s: i32 =
            b.qs.iter()
                .zip(&a.qs)
                .map(|(&w, &x)| w as i32 * x as i32)
                .sum();
        acc += b.d.to_f32() * a.d * s as f32;
    }
    acc
}

/// `sum(a[i] * b[i])` over 32 i8 with `wide` (i16 products, pairwise i32 sums).
#[inline]
pub fn dot32_wide(a: &[i8; QK], b: &[i8; QK]) -> i32 {
    use wide::{i16x16, i8x16};
    let half = |x: &[i8; QK], h: usize| {
        i16x16::from_i8x16(i8x16::from(
            <[i8; 16]>::try_from(&x[16 * h..16 * h + 16]).unwrap_or([0; 16]),
        ))
    };
    (half(a, 0).dot(half(b, 0)) + half(a, 1).dot(half(b, 1))).reduce_add()
}

pub fn portable(row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(QTYPE, row, act);
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        acc += b.d.to_f32() * a.d * dot32_wide(&b.qs, &a.qs) as f32;
    }
    acc
}

x86_q8a_tiers!(BlockQ8_0, pairs);
arm_q8a_tiers!(BlockQ8_0, blocks);

/// For `arm::block_loop`: signed quants, no offset term.
#[cfg(target_arch = "aarch64")]
impl super::arm::Block32 for BlockQ8_0 {
    #[inline(always)]
    unsafe fn d(&self) -> f32 {
        super::arm::f16(self.d.to_bits())
    }
    #[inline(always)]
    unsafe fn off_w(&self, _: f32) -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn quants(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        super::arm::load32(self.qs.as_ptr())
    }
}

/// For `x86::pair_loop`: signed quants, value `d_w d_a (qw . qa)` (no offset term).
#[cfg(target_arch = "x86_64")]
impl super::x86::Step32 for BlockQ8_0 {
    const OFF_SCALE: f32 = 0.0;
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
        dot_i8i8_v::<VNNI>(load_i8x32(&self.qs), qa)
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::Q8_0);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q8_0);
    }
}
