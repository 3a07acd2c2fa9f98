//! Repacked row (see [`super::repack`]) . Q8A activations, for Q8_0, Q4_0, Q4_1 and Q5_0.
//!
//! Reference: each block decoded from the group layout and dotted as its ggml type's reference
//! does (`d_w d_a sum(q qa)`, minus `8 d_w s_a` (Q4_0) or `16 d_w s_a` (Q5_0), plus `m_w s_a`
//! (Q4_1)); the ggml tail blocks by the type's own reference.
//!
//! The x86 tiers take a group (8 blocks) per step: lane `j` of every vector is block `j`, so
//! 8 integer dots (Q8_0 signs, nibble masks and Q5_0 fifth bits first) give the 8 block sums in
//! one register, then one conversion of the 8 scales and one multiply-add serve all 8 blocks.
//! The ggml-layout kernels spend a horizontal reduction, a scale conversion, a broadcast and a
//! multiply-add per block: that made them compute-bound (7-12 GB/s per core).
//!
//! The NEON tiers do the same with 128-bit vectors: a 32-byte step is two registers, blocks
//! 0..4 and 4..8, each lane one block, summed by `sdot` (or its widening emulation).
//!
//! The portable and scalar tiers use the reference: the engine repacks only on the x86 and NEON
//! tiers ([`repacks`]).
use super::repack::{self, ActGroup, GROUP};
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QuantType};

/// `(row, act, groups)`: a repacked row, the token's activation blocks, and the same blocks'
/// whole groups transposed ([`repack::act_groups`]).
pub type DotR8Fn = fn(&[u8], &[BlockQ8A], &[ActGroup]) -> f32;

/// Does this tier read repacked rows faster than ggml rows (so the backend should repack)?
pub fn repacks(isa: Isa, q: QuantType) -> bool {
    repack::supports(q) && matches!(isa, Isa::Avx2 | Isa::Avx512 | Isa::Neon | Isa::Dotprod)
}

/// A repacked type, for the SIMD tiers' `Group` impls: its ggml type, and the factor of its
/// offset term `sum(off_w * s_a)` (0: none; `off_w` is `d_w`, or the Q4_1 mins).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) trait Repacked {
    const Q: QuantType;
    const OFF_SCALE: f32;
}

macro_rules! repacked_types {
    ($($t:ident: $q:ident, $off:expr;)*) => {$(
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        pub(crate) struct $t;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        impl Repacked for $t {
            const Q: QuantType = QuantType::$q;
            const OFF_SCALE: f32 = $off;
        }
    )*};
}

repacked_types! {
    R8_0: Q8_0, 0.0;
    R4_0: Q4_0, -8.0;
    R4_1: Q4_1, 1.0;
    R5_0: Q5_0, -16.0;
}

/// The dot of repacked rows of `q` (one of [`repack::supports`]) for `isa`, prefetching ahead
/// if `prefetch` (dense products; the NEON tiers never prefetch).
pub fn select(q: QuantType, isa: Isa, prefetch: bool) -> DotR8Fn {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    macro_rules! pick {
        ($t:ty) => {
            match (isa, prefetch) {
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, true) => x86::avx512::<$t, true>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, false) => x86::avx512::<$t, false>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, true) => x86::avx2::<$t, true>,
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, false) => x86::avx2::<$t, false>,
                #[cfg(target_arch = "aarch64")]
                (Isa::Dotprod, _) => arm::neon::<$t, true>,
                #[cfg(target_arch = "aarch64")]
                (Isa::Neon, _) => arm::neon::<$t, false>,
                _ => scalar_of(q),
            }
        };
    }
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    return match q {
        QuantType::Q8_0 => pick!(R8_0),
        QuantType::Q4_0 => pick!(R4_0),
        QuantType::Q4_1 => pick!(R4_1),
        QuantType::Q5_0 => pick!(R5_0),
        _ => scalar_of(q),
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (isa, prefetch);
        scalar_of(q)
    }
}

/// The scalar reference for repacked rows of `q`.
pub fn scalar_of(q: QuantType) -> DotR8Fn {
    match q {
        QuantType::Q8_0 => |r, a, g| {
            check(QuantType::Q8_0, r, a, g);
            scalar(QuantType::Q8_0, r, a)
        },
        QuantType::Q4_0 => |r, a, g| {
            check(QuantType::Q4_0, r, a, g);
            scalar(QuantType::Q4_0, r, a)
        },
        QuantType::Q4_1 => |r, a, g| {
            check(QuantType::Q4_1, r, a, g);
            scalar(QuantType::Q4_1, r, a)
        },
        QuantType::Q5_0 => |r, a, g| {
            check(QuantType::Q5_0, r, a, g);
            scalar(QuantType::Q5_0, r, a)
        },
        _ => panic!("{q:?} rows are never repacked"),
    }
}

/// The ggml-layout reference of `q`, for the tail blocks.
fn ggml_scalar(q: QuantType) -> super::table::DotQ8AFn {
    match q {
        QuantType::Q8_0 => super::dot_q8_0::scalar,
        QuantType::Q4_0 => super::dot_q4_0::scalar,
        QuantType::Q4_1 => super::dot_q4_1::scalar,
        _ => super::dot_q5_0::scalar,
    }
}

/// The length contract, checked by every tier in release builds: `row` holds the
/// `act.len() * 32` elements of `q`, and `groups` are `act`'s whole groups (`repack::act_groups`).
#[inline(always)] // per row: inlined, the type's sizes fold to constants
fn check(q: QuantType, row: &[u8], act: &[BlockQ8A], groups: &[ActGroup]) {
    super::check_q8a(q, row, act);
    assert!(
        groups.len() == act.len() / GROUP,
        "repacked row dot: {} activation groups for {} blocks",
        groups.len(),
        act.len()
    );
}

fn scalar(q: QuantType, row: &[u8], act: &[BlockQ8A]) -> f32 {
    super::check_q8a(q, row, act);
    let gb = repack::layout(q).bytes;
    let groups = (row.len() / gb).min(act.len() / GROUP);
    let mut acc = 0f32;
    for (g, a8) in row
        .chunks_exact(gb)
        .take(groups)
        .zip(act.chunks_exact(GROUP))
    {
        for (j, a) in a8.iter().enumerate() {
            let b = repack::group_block(q, g, j);
            let s: i32 =
                b.q.iter()
                    .zip(&a.qs)
                    .map(|(&w, &x)| w as i32 * x as i32)
                    .sum();
            let d = half::f16::from_bits(b.d).to_f32();
            acc += match q {
                QuantType::Q8_0 => d * a.d * s as f32,
                QuantType::Q4_0 => d * (a.d * s as f32 - 8.0 * a.s),
                QuantType::Q4_1 => d * a.d * s as f32 + half::f16::from_bits(b.m).to_f32() * a.s,
                _ => d * (a.d * s as f32 - 16.0 * a.s),
            };
        }
    }
    acc + ggml_scalar(q)(&row[groups * gb..], &act[groups * GROUP..])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::*;
    use super::repack::{layout, ActGroup, GROUP};
    use super::{check, Repacked, R4_0, R4_1, R5_0, R8_0};
    use dejavu_backend_api::quant::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8A, BlockQ8_0};
    use std::arch::x86_64::*;

    /// One repacked type: its 8 block sums per group, and its offset factors.
    pub trait Group: Repacked {
        /// The ggml block, for the tail (its `Step32` does the per-block work).
        type Block: Step32 + bytemuck::Pod;
        /// The 8 blocks' integer dots with the activation group `a`, lane `j` = block `j`.
        unsafe fn isums<const VNNI: bool>(g: *const u8, a: &ActGroup) -> __m256i;
        /// The offset factor of the 8 blocks (`d_w`, or the Q4_1 mins), given `d_w`.
        unsafe fn off_w(g: *const u8, dw: __m256) -> __m256;
    }

    #[inline(always)]
    unsafe fn step(a: &ActGroup, s: usize) -> __m256i {
        load_i8x32(&a.qs[s])
    }

    /// Sums of u8 x i8 products over the steps `q` and the matching activation steps. AVX2:
    /// `maddubs` pairs added in i16 before one widening (the caller keeps `n * 2 * max|u s|`
    /// below 2^15); VNNI: `vpdpbusd` on two chains.
    #[inline(always)]
    unsafe fn sum_u8i8<const VNNI: bool, const N: usize>(
        q: &[__m256i; N],
        a: &ActGroup,
        steps: [usize; N],
    ) -> __m256i {
        if VNNI {
            let (mut x, mut y) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for i in (0..N).step_by(2) {
                x = _mm256_dpbusd_epi32(x, q[i], step(a, steps[i]));
                if i + 1 < N {
                    y = _mm256_dpbusd_epi32(y, q[i + 1], step(a, steps[i + 1]));
                }
            }
            _mm256_add_epi32(x, y)
        } else {
            let mut p = _mm256_setzero_si256();
            for i in 0..N {
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], step(a, steps[i])));
            }
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
    }

    /// The 8 steps of a 4-bit group (`high`: the Q5_0 fifth bits) dotted with `a`.
    #[inline(always)]
    unsafe fn four_bit_sums<const VNNI: bool>(
        qs: *const u8,
        high: Option<__m256i>,
        a: &ActGroup,
    ) -> __m256i {
        let m = _mm256_set1_epi8(0x0F);
        let mut q = [_mm256_setzero_si256(); GROUP];
        for c in 0..4 {
            let v = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            q[c] = _mm256_and_si256(v, m);
            q[c + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
        }
        match high {
            // 5-bit quants: 2 * 31 * 127 per maddubs lane, so at most 4 steps per i16 sum.
            Some(h) => {
                for (s, qs) in q.iter_mut().enumerate() {
                    *qs = _mm256_or_si256(*qs, fifth_bit(h, s));
                }
                let lo = sum_u8i8::<VNNI, 4>(&[q[0], q[1], q[2], q[3]], a, [0, 1, 2, 3]);
                let hi = sum_u8i8::<VNNI, 4>(&[q[4], q[5], q[6], q[7]], a, [4, 5, 6, 7]);
                _mm256_add_epi32(lo, hi)
            }
            // 4-bit quants: 2 * 15 * 127 per lane, 8 steps fit an i16.
            None => sum_u8i8::<VNNI, 8>(&q, a, [0, 1, 2, 3, 4, 5, 6, 7]),
        }
    }

    impl Group for R8_0 {
        type Block = BlockQ8_0;
        /// Signed x signed by the sign trick; each maddubs lane reaches 2 * 128 * 127, so
        /// AVX2 widens every step.
        #[inline(always)]
        unsafe fn isums<const VNNI: bool>(g: *const u8, a: &ActGroup) -> __m256i {
            let qs = g.add(layout(Self::Q).qs);
            let (mut x, mut y) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for s in (0..GROUP).step_by(2) {
                let w0 = _mm256_loadu_si256(qs.add(32 * s) as *const __m256i);
                let w1 = _mm256_loadu_si256(qs.add(32 * s + 32) as *const __m256i);
                x = _mm256_add_epi32(x, dot_i8i8_v::<VNNI>(w0, step(a, s)));
                y = _mm256_add_epi32(y, dot_i8i8_v::<VNNI>(w1, step(a, s + 1)));
            }
            _mm256_add_epi32(x, y)
        }
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    impl Group for R4_0 {
        type Block = BlockQ4_0;
        #[inline(always)]
        unsafe fn isums<const VNNI: bool>(g: *const u8, a: &ActGroup) -> __m256i {
            four_bit_sums::<VNNI>(g.add(layout(Self::Q).qs), None, a)
        }
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    impl Group for R4_1 {
        type Block = BlockQ4_1;
        #[inline(always)]
        unsafe fn isums<const VNNI: bool>(g: *const u8, a: &ActGroup) -> __m256i {
            four_bit_sums::<VNNI>(g.add(layout(Self::Q).qs), None, a)
        }
        #[inline(always)]
        unsafe fn off_w(g: *const u8, _: __m256) -> __m256 {
            let m = layout(Self::Q).mins.unwrap_or(16);
            _mm256_cvtph_ps(_mm_loadu_si128(g.add(m) as *const __m128i))
        }
    }

    impl Group for R5_0 {
        type Block = BlockQ5_0;
        #[inline(always)]
        unsafe fn isums<const VNNI: bool>(g: *const u8, a: &ActGroup) -> __m256i {
            let lay = layout(Self::Q);
            let h = _mm256_loadu_si256(g.add(lay.high.unwrap_or(16)) as *const __m256i);
            four_bit_sums::<VNNI>(g.add(lay.qs), Some(h), a)
        }
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    /// Whole groups, then the ggml tail blocks through the type's per-block step.
    #[inline(always)]
    unsafe fn row_dot<G: Group, const VNNI: bool, const PF: bool>(
        row: &[u8],
        act: &[BlockQ8A],
        groups: &[ActGroup],
    ) -> f32 {
        let (bb, gb) = (G::Q.block_bytes(), layout(G::Q).bytes);
        let blocks = (row.len() / bb).min(act.len());
        let n = (blocks / GROUP).min(groups.len());
        let (mut acc, mut off) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (i, a) in groups[..n].iter().enumerate() {
            let g = row.as_ptr().add(i * gb);
            if PF {
                let mut o = 0;
                while o < gb {
                    prefetch_ahead(g.add(o));
                    o += 64;
                }
            }
            let isum = G::isums::<VNNI>(g, a);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let da = _mm256_load_ps(a.d.as_ptr());
            acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum), acc);
            if G::OFF_SCALE != 0.0 {
                let sa = _mm256_load_ps(a.s.as_ptr());
                off = _mm256_fmadd_ps(G::off_w(g, dw), sa, off);
            }
        }
        let tail: &[G::Block] =
            bytemuck::cast_slice(&row[n * gb..n * gb + (blocks - n * GROUP) * bb]);
        let mut total = hsum_ps(acc) + pair_loop::<G::Block, VNNI, false>(tail, &act[n * GROUP..]);
        if G::OFF_SCALE != 0.0 {
            total += G::OFF_SCALE * hsum_ps(off);
        }
        total
    }

    pub fn avx2<G: Group, const PF: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        check(G::Q, row, act, g);
        // SAFETY: handed out by `select` only for tiers whose features this CPU has; every
        // read lies inside `row`, `act` and `g` (whole groups and blocks of each, counted).
        unsafe { avx2_impl::<G, PF>(row, act, g) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_impl<G: Group, const PF: bool>(
        row: &[u8],
        act: &[BlockQ8A],
        g: &[ActGroup],
    ) -> f32 {
        row_dot::<G, false, PF>(row, act, g)
    }

    pub fn avx512<G: Group, const PF: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        check(G::Q, row, act, g);
        // SAFETY: as `avx2`.
        unsafe { avx512_impl::<G, PF>(row, act, g) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn avx512_impl<G: Group, const PF: bool>(
        row: &[u8],
        act: &[BlockQ8A],
        g: &[ActGroup],
    ) -> f32 {
        row_dot::<G, true, PF>(row, act, g)
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::super::arm::*;
    use super::repack::{layout, ActGroup, GROUP};
    use super::{check, Repacked, R4_0, R4_1, R5_0, R8_0};
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

    #[target_feature(enable = "neon")]
    unsafe fn neon_impl<G: Group>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        row_dot::<G, false>(row, act, g)
    }

    #[target_feature(enable = "neon,dotprod")]
    unsafe fn dotprod_impl<G: Group>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        row_dot::<G, true>(row, act, g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::repack::repack_row;
    use crate::kernels::table::{Kernels, RowDot};
    use crate::kernels::testutil::{random_f32, random_row};
    use dejavu_backend_api::quant::QK;

    const TYPES: [QuantType; 4] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
    ];

    fn groups_of(act: &[BlockQ8A]) -> Vec<ActGroup> {
        let mut g = vec![ActGroup::ZERO; act.len() / GROUP];
        repack::act_groups(act, &mut g);
        g
    }

    fn act_of(x: &[f32]) -> Vec<BlockQ8A> {
        let mut act = vec![
            BlockQ8A {
                d: 0.0,
                s: 0.0,
                qs: [0; QK]
            };
            x.len() / QK
        ];
        (Kernels::for_isa(Isa::Scalar).unwrap().quantize)(x, &mut act);
        act
    }

    /// The repacked reference equals the ggml reference on the same row (same per-block terms
    /// in the same order, so equal up to f32 rounding of the sum), and every tier's repacked dot
    /// (prefetching or not) is within 1e-5 of `sum |w x|` of the reference: whole groups, ragged
    /// tails and tail-only rows.
    #[test]
    fn tiers_match_reference() {
        for q in TYPES {
            for blocks in [1usize, 7, 8, 9, 28, 33, 67] {
                let n = blocks * QK;
                let row = random_row(q, n, 11 * blocks as u64);
                let mut packed = vec![0u8; row.len()];
                repack_row(q, &row, &mut packed);
                let x = random_f32(n, blocks as u64);
                let act = act_of(&x);
                let mut deq = vec![0f32; n];
                crate::dequant::dequantize_row(q, &row, &mut deq);
                let mag: f32 = deq.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                let RowDot::Q8A(ggml) = Kernels::for_isa(Isa::Scalar).unwrap().dot(q, false) else {
                    panic!()
                };
                let want = ggml(&row, &act);
                let groups = groups_of(&act);
                let reference = scalar_of(q)(&packed, &act, &groups);
                assert!(
                    (reference - want).abs() <= 1e-6 * mag + 1e-6,
                    "{q:?} {blocks}"
                );
                for isa in Isa::supported() {
                    for pf in [false, true] {
                        let got = select(q, isa, pf)(&packed, &act, &groups);
                        assert!(
                            (got - reference).abs() <= 1e-5 * mag + 1e-6,
                            "{isa} {q:?} {blocks} blocks (prefetch {pf}): {got} vs {reference}"
                        );
                    }
                }
            }
        }
    }

    /// Q8_0 quants of -128 (the sign trick's edge) and Q5_0 rows of all-ones high bits.
    #[test]
    fn extreme_quants() {
        for (q, fill) in [(QuantType::Q8_0, 0x80u8), (QuantType::Q5_0, 0xFF)] {
            let n = 16 * QK;
            let mut row = random_row(q, n, 5);
            let bb = q.block_bytes();
            for b in row.chunks_exact_mut(bb) {
                b[2..].fill(fill);
            }
            let mut packed = vec![0u8; row.len()];
            repack_row(q, &row, &mut packed);
            let act = act_of(&random_f32(n, 3));
            let groups = groups_of(&act);
            let want = scalar_of(q)(&packed, &act, &groups);
            for isa in Isa::supported() {
                let got = select(q, isa, true)(&packed, &act, &groups);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs() + 1e-4,
                    "{isa} {q:?}"
                );
            }
        }
    }
}
