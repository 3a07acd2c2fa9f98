//! The NEON tiers of the repacked row dot (with and without `dotprod`): 128-bit halves of each
//! group, one token per call.
use super::super::arm::*;
use super::repack::{layout, ActGroup, GROUP};
use super::{check, check_tokens, Repacked, R4_0, R4_1, R5_0, R8_0};
use dejavu_backend_api::quant::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8A, BlockQ8_0};
use std::arch::aarch64::*;

/// One repacked type for the NEON tiers: its 8 block sums per group (blocks 0..4 and
/// 4..8, lane `j` = block `j`), and its offset factors.
pub trait Group: Repacked {
    /// The ggml block, for the tail.
    type Block: Block32 + bytemuck::Pod;
    unsafe fn isums<const DOT: bool>(g: *const u8, a: &ActGroup) -> [int32x4_t; 2];
    /// The offset factors of the 8 blocks (`d_w`, or the Q4_1 mins), given `d_w`.
    unsafe fn off_w(g: *const u8, dw: [float32x4_t; 2]) -> [float32x4_t; 2];
}

/// `acc` plus step `s` of the 8 blocks' quants `w` dotted with the activations' step `s`.
#[inline(always)]
unsafe fn step_dot<const DOT: bool>(
    acc: [int32x4_t; 2],
    w: [int8x16_t; 2],
    a: &ActGroup,
    s: usize,
) -> [int32x4_t; 2] {
    let x = load32(a.qs[s].as_ptr());
    [
        sdot::<DOT>(acc[0], w[0], x[0]),
        sdot::<DOT>(acc[1], w[1], x[1]),
    ]
}

/// The 8 steps of a 4-bit group (`high`: the Q5_0 fifth bits, bit `s` for step `s`).
#[inline(always)]
unsafe fn four_bit_sums<const DOT: bool>(
    qs: *const u8,
    high: Option<[uint8x16_t; 2]>,
    a: &ActGroup,
) -> [int32x4_t; 2] {
    // Bit `s` of each byte moved to bit 4 (a negative shift shifts right).
    let fifth = |h: uint8x16_t, s: usize| {
        let bit = vandq_u8(vshlq_u8(h, vdupq_n_s8(4 - s as i8)), vdupq_n_u8(0x10));
        vreinterpretq_s8_u8(bit)
    };
    let mut acc = [vdupq_n_s32(0); 2];
    for c in 0..4 {
        let ([l0, h0], [l1, h1]) = (nibbles(qs.add(32 * c)), nibbles(qs.add(32 * c + 16)));
        let (mut lo, mut hi) = ([l0, l1], [h0, h1]);
        if let Some(h) = high {
            for k in 0..2 {
                lo[k] = vorrq_s8(lo[k], fifth(h[k], c));
                hi[k] = vorrq_s8(hi[k], fifth(h[k], c + 4));
            }
        }
        acc = step_dot::<DOT>(acc, lo, a, c);
        acc = step_dot::<DOT>(acc, hi, a, c + 4);
    }
    acc
}

impl Group for R8_0 {
    type Block = BlockQ8_0;
    #[inline(always)]
    unsafe fn isums<const DOT: bool>(g: *const u8, a: &ActGroup) -> [int32x4_t; 2] {
        let qs = g.add(layout(Self::Q).qs) as *const i8;
        let mut acc = [vdupq_n_s32(0); 2];
        for s in 0..GROUP {
            acc = step_dot::<DOT>(acc, load32(qs.add(32 * s)), a, s);
        }
        acc
    }
    #[inline(always)]
    unsafe fn off_w(_: *const u8, dw: [float32x4_t; 2]) -> [float32x4_t; 2] {
        dw
    }
}

impl Group for R4_0 {
    type Block = BlockQ4_0;
    #[inline(always)]
    unsafe fn isums<const DOT: bool>(g: *const u8, a: &ActGroup) -> [int32x4_t; 2] {
        four_bit_sums::<DOT>(g.add(layout(Self::Q).qs), None, a)
    }
    #[inline(always)]
    unsafe fn off_w(_: *const u8, dw: [float32x4_t; 2]) -> [float32x4_t; 2] {
        dw
    }
}

impl Group for R4_1 {
    type Block = BlockQ4_1;
    #[inline(always)]
    unsafe fn isums<const DOT: bool>(g: *const u8, a: &ActGroup) -> [int32x4_t; 2] {
        four_bit_sums::<DOT>(g.add(layout(Self::Q).qs), None, a)
    }
    #[inline(always)]
    unsafe fn off_w(g: *const u8, _: [float32x4_t; 2]) -> [float32x4_t; 2] {
        let m = g.add(layout(Self::Q).mins.unwrap_or(16));
        [f16x4(m), f16x4(m.add(8))]
    }
}

impl Group for R5_0 {
    type Block = BlockQ5_0;
    #[inline(always)]
    unsafe fn isums<const DOT: bool>(g: *const u8, a: &ActGroup) -> [int32x4_t; 2] {
        let lay = layout(Self::Q);
        let h = g.add(lay.high.unwrap_or(16));
        four_bit_sums::<DOT>(g.add(lay.qs), Some([vld1q_u8(h), vld1q_u8(h.add(16))]), a)
    }
    #[inline(always)]
    unsafe fn off_w(_: *const u8, dw: [float32x4_t; 2]) -> [float32x4_t; 2] {
        dw
    }
}

/// Whole groups, then the ggml tail blocks through [`block_loop`].
#[inline(always)]
unsafe fn row_dot<G: Group, const DOT: bool>(
    row: &[u8],
    act: &[BlockQ8A],
    groups: &[ActGroup],
) -> f32 {
    let (bb, gb) = (G::Q.block_bytes(), layout(G::Q).bytes);
    let blocks = (row.len() / bb).min(act.len());
    let n = (blocks / GROUP).min(groups.len());
    let z = vdupq_n_f32(0.0);
    let (mut acc, mut off) = ([z; 2], [z; 2]);
    for (i, a) in groups[..n].iter().enumerate() {
        let g = row.as_ptr().add(i * gb);
        let isum = G::isums::<DOT>(g, a);
        let dw = [f16x4(g), f16x4(g.add(8))];
        let ow = G::off_w(g, dw);
        for h in 0..2 {
            let da = vld1q_f32(a.d.as_ptr().add(4 * h));
            acc[h] = vfmaq_f32(acc[h], vmulq_f32(dw[h], da), vcvtq_f32_s32(isum[h]));
            if G::OFF_SCALE != 0.0 {
                off[h] = vfmaq_f32(off[h], ow[h], vld1q_f32(a.s.as_ptr().add(4 * h)));
            }
        }
    }
    let tail =
        super::super::as_blocks::<G::Block>(&row[n * gb..n * gb + (blocks - n * GROUP) * bb]);
    let mut total = vaddvq_f32(vaddq_f32(acc[0], acc[1]))
        + block_loop::<G::Block, DOT>(&tail, &act[n * GROUP..]);
    if G::OFF_SCALE != 0.0 {
        total += G::OFF_SCALE * vaddvq_f32(vaddq_f32(off[0], off[1]));
    }
    total
}

pub fn neon<G: Group, const DOT: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
    check(G::Q, row, act, g);
    // SAFETY: handed out by `select` only for tiers whose features this CPU has; every
    // read lies inside `row`, `act` and `g` (whole groups and blocks of each, counted).
    unsafe {
        if DOT {
            dotprod_impl::<G>(row, act, g)
        } else {
            neon_impl::<G>(row, act, g)
        }
    }
}

/// Row by row and token by token through [`neon`] (the NEON tiers do not share unpacked quants
/// yet).
pub fn neon_tokens<G: Group, const DOT: bool>(
    rows: &[u8],
    acts: &[&[BlockQ8A]],
    groups: &[&[ActGroup]],
    out: &mut [f32],
) {
    let rb = check_tokens(G::Q, rows, acts, groups, out);
    for (row, out) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(acts.len())) {
        for ((a, g), o) in acts.iter().zip(groups).zip(out.iter_mut()) {
            *o = neon::<G, DOT>(row, a, g);
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn neon_impl<G: Group>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
    row_dot::<G, false>(row, act, g)
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn dotprod_impl<G: Group>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
    row_dot::<G, true>(row, act, g)
}
