//! aarch64 helpers of the NEON tiers (`Isa::Neon`, `Isa::Dotprod`), shared by the kernel files.
//!
//! Contracts: every function here is `unsafe` only because it reads through raw pointers or
//! uses NEON intrinsics; callers run them in functions compiled with `neon` (and `dotprod` when
//! `DOT`), handed out only on CPUs that have those features. The `DOT` parameter picks the byte
//! dot instruction: `sdot` (ARMv8.2 dot product, through `asm!`: its intrinsic is not stable
//! Rust yet) or widening multiplies with pairwise adds. Both give the same exact i32 sums.
//!
//! No tier here prefetches: the `PF` parameter of the dense kernels is accepted and ignored
//! (aarch64 cores' hardware prefetchers follow the sequential row walk).
use dejavu_backend_api::quant::{BlockQ8A, QK};
use std::arch::aarch64::*;
use std::arch::asm;

/// `acc` plus the dots of each 4-byte group: lane `i` += `sum(a[4i+e] * b[4i+e], e < 4)`.
#[inline(always)]
pub unsafe fn sdot<const DOT: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    if DOT {
        let mut acc = acc;
        // SAFETY: `sdot` reads and writes registers only; `DOT` is set only in functions
        // compiled for (and run on) CPUs with the dot product extension.
        asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    } else {
        // i8 x i8 products fit i16 (|p| <= 2^14); pairwise adds widen to i32.
        let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
        let hi = vpaddlq_s16(vmull_high_s8(a, b));
        vaddq_s32(acc, vpaddq_s32(lo, hi))
    }
}

/// The i32 dot of 32 bytes `w` with 32 bytes `a`, as 4 lanes to be summed.
#[inline(always)]
pub unsafe fn dot32<const DOT: bool>(w: [int8x16_t; 2], a: [int8x16_t; 2]) -> int32x4_t {
    sdot::<DOT>(sdot::<DOT>(vdupq_n_s32(0), w[0], a[0]), w[1], a[1])
}

/// 32 bytes at `p` as two i8 vectors.
#[inline(always)]
pub unsafe fn load32(p: *const i8) -> [int8x16_t; 2] {
    [vld1q_s8(p), vld1q_s8(p.add(16))]
}

/// The four lanes' sums of each of `v[0..4]`: lane `i` = `sum(v[i])`.
#[inline(always)]
pub unsafe fn hsum4(v: [int32x4_t; 4]) -> int32x4_t {
    vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]))
}

/// Four f16 values (IEEE binary16 bits) at `p`, widened to f32 exactly (`fcvtl`, base ARMv8).
#[inline(always)]
pub unsafe fn f16x4(p: *const u8) -> float32x4_t {
    let h = vld1_u16(p as *const u16);
    let out: float32x4_t;
    // SAFETY: a register-to-register conversion of the base instruction set.
    asm!(
        "fcvtl {out:v}.4s, {h:v}.4h",
        out = lateout(vreg) out,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    out
}

/// One f16 value (its bits) widened to f32 exactly.
#[inline(always)]
pub unsafe fn f16(bits: u16) -> f32 {
    let v = [bits, 0, 0, 0];
    vgetq_lane_f32::<0>(f16x4(v.as_ptr() as *const u8))
}

/// The 8 bytes of `v` (byte `j` = lane `j`) as two f32 vectors (lanes 0..4 and 4..8).
#[inline(always)]
pub unsafe fn bytes_f32(v: u64) -> [float32x4_t; 2] {
    let w = vmovl_u8(vcreate_u8(v));
    [
        vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))),
        vcvtq_f32_u32(vmovl_high_u16(w)),
    ]
}

/// A 32-element ggml block type read as (scale, offset factor, quants): its value is
/// `d * q + off_w` per element summed as `d d_a (q . qa) + off_w s_a`.
pub trait Block32 {
    /// `d_w`.
    unsafe fn d(&self) -> f32;
    /// The offset factor multiplying `s_a` (`-8 d_w` for Q4_0, `m` for Q4_1, 0 for Q8_0).
    unsafe fn off_w(&self, d: f32) -> f32;
    /// The 32 stored quants as i8 (Q8_0 signed; the 4- and 5-bit types unsigned).
    unsafe fn quants(&self) -> [int8x16_t; 2];
}

/// The low and high nibbles of 16 bytes at `p`, as unsigned values in i8 lanes (for a ggml
/// 4-bit block: elements 0..16 and 16..32).
#[inline(always)]
pub unsafe fn nibbles(p: *const u8) -> [int8x16_t; 2] {
    let v = vld1q_u8(p);
    [
        vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
        vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
    ]
}

/// `sum_b d_w d_a (q . qa) + off_w s_a` over the blocks of a row: the integer dots of two blocks
/// in flight, each scaled in float lanes; the offset terms summed in one scalar.
#[inline(always)]
pub unsafe fn block_loop<B: Block32, const DOT: bool>(w: &[B], act: &[BlockQ8A]) -> f32 {
    let (mut acc, mut off) = ([vdupq_n_f32(0.0); 2], 0f32);
    for (i, (b, a)) in w.iter().zip(act).enumerate() {
        let d = b.d();
        let s = dot32::<DOT>(b.quants(), load32(a.qs.as_ptr()));
        acc[i & 1] = vfmaq_n_f32(acc[i & 1], vcvtq_f32_s32(s), d * a.d);
        off += b.off_w(d) * a.s;
    }
    vaddvq_f32(vaddq_f32(acc[0], acc[1])) + off
}

const _: () = assert!(QK == 32);
