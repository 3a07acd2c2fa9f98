//! Q5_1 row . Q8A activations.
//!
//! Reference, per block b: `x = d_w * q + m` with q in 0..32 (a nibble plus the fifth bit from
//! `qh`, as Q5_0), so `dot_b = d_w * d_a * sum(q * qa) + m * s_a` with `s_a = d_a * sum(qa)`.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ5_1, BlockQ8A, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::Q5_1;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockQ5_1]> {
    super::as_blocks(row)
}

/// The 5-bit q of every element (low nibbles are elements 0..16, high nibbles 16..32; bit i of
/// `qh` is element i's fifth bit).
fn unpack(b: &BlockQ5_1) -> [i8; QK] {
    let qh = u32::from_le_bytes(b.qh);
    std::array::from_fn(|i| {
        let low = if i < 16 {
            b.qs[i] & 0xF
        } else {
            b.qs[i - 16] >> 4
        };
        (low | (((qh >> i) & 1) << 4) as u8) as i8
    })
}

fn generic(row: &[u8], act: &[BlockQ8A], dot32: impl Fn(&[i8; QK], &[i8; QK]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        let s = dot32(&unpack(b), &a.qs);
        acc += b.d.to_f32() * a.d * s as f32 + b.m.to_f32() * a.s;
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

x86_q8a_tiers!(BlockQ5_1, pairs);

/// For `x86::pair_loop`: unsigned 5-bit q, value `d_w d_a (q . qa) + m s_a`.
#[cfg(target_arch = "x86_64")]
impl super::x86::Step32 for BlockQ5_1 {
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
        check_dot_tiers(QuantType::Q5_1);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::Q5_1);
    }
}
