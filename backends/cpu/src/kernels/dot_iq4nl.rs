//! IQ4_NL row . Q8A activations.
//!
//! Reference, per block b: `x = d_w * KVALUES_IQ4NL[q]` (q a nibble; low nibbles are elements
//! 0..16, high nibbles 16..32), so `dot_b = d_w * d_a * sum(level * qa)`, levels in -127..=113.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockIQ4NL, BlockQ8A, KVALUES_IQ4NL, QK};

select_q8a_kernel!();
const QTYPE: dejavu_backend_api::quant::QuantType = dejavu_backend_api::quant::QuantType::IQ4NL;

fn blocks(row: &[u8]) -> std::borrow::Cow<'_, [BlockIQ4NL]> {
    super::as_blocks(row)
}

/// The 32 signed levels of 16 bytes of nibble indices (IQ4_NL's block, IQ4_XS's sub-block).
pub(crate) fn levels(qs: &[u8]) -> [i8; QK] {
    std::array::from_fn(|i| {
        let q = if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 };
        KVALUES_IQ4NL[q as usize]
    })
}

fn generic(row: &[u8], act: &[BlockQ8A], dot32: impl Fn(&[i8; QK], &[i8; QK]) -> i32) -> f32 {
    let mut acc = 0f32;
    for (b, a) in blocks(row).iter().zip(act) {
        acc += b.d.to_f32() * a.d * dot32(&levels(&b.qs), &a.qs) as f32;
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

x86_q8a_tiers!(BlockIQ4NL, pairs);

/// For `x86::pair_loop`: levels looked up by `pshufb`, a signed dot, no offset term.
#[cfg(target_arch = "x86_64")]
impl super::x86::Step32 for BlockIQ4NL {
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
        dot_i8i8_v::<VNNI>(iq4nl_levels(unpack_nibbles(self.qs.as_ptr())), qa)
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        check_dot_tiers(QuantType::IQ4NL);
    }
    #[test]
    fn reference_is_close_to_f32() {
        check_q8a_against_f32(QuantType::IQ4NL);
    }
}
