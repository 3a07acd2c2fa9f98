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

/// Most tokens one [`DotR8TokensFn`] call takes.
pub const MAX_TOKENS: usize = 4;

/// `(row, acts, groups, out)`: one repacked row dotted with `out.len()` tokens (1..=
/// [`MAX_TOKENS`]), token `t` given by its blocks `acts[t]` and their groups `groups[t]`.
/// `out[t]` equals the same tier's [`DotR8Fn`] on token `t` bit for bit: a batch of decode rows
/// gets its steps' logits. The x86 tiers unpack each group's quants once for all the tokens
/// (the integer work a one-token dot repeats per token); the others call the one-token dot.
pub type DotR8TokensFn = fn(&[u8], &[&[BlockQ8A]], &[&[ActGroup]], &mut [f32]);

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

/// The function of `isa` (and `prefetch`) for the repacked type `$t`: `x86::$avx512` or
/// `x86::$avx2` (`::<$t, PREFETCH>`), `arm::$neon` (`::<$t, DOTPROD>`), else `$other`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! tier_fn {
    ($t:ty, $isa:expr, $pf:expr, $avx512:ident, $avx2:ident, $neon:ident, $other:expr) => {
        match ($isa, $pf) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, true) => x86::$avx512::<$t, true>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, false) => x86::$avx512::<$t, false>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, true) => x86::$avx2::<$t, true>,
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, false) => x86::$avx2::<$t, false>,
            #[cfg(target_arch = "aarch64")]
            (Isa::Dotprod, _) => arm::$neon::<$t, true>,
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, _) => arm::$neon::<$t, false>,
            _ => $other,
        }
    };
}

/// [`tier_fn`] for the repacked type of `q`; `$other` for the tiers without one, the other
/// types and other architectures.
macro_rules! by_type {
    ($q:expr, $isa:expr, $pf:expr, $avx512:ident, $avx2:ident, $neon:ident, $other:expr) => {{
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        let f = match $q {
            QuantType::Q8_0 => tier_fn!(R8_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q4_0 => tier_fn!(R4_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q4_1 => tier_fn!(R4_1, $isa, $pf, $avx512, $avx2, $neon, $other),
            QuantType::Q5_0 => tier_fn!(R5_0, $isa, $pf, $avx512, $avx2, $neon, $other),
            _ => $other,
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let f = {
            let _ = ($isa, $pf);
            $other
        };
        f
    }};
}

/// The dot of repacked rows of `q` (one of [`repack::supports`]) for `isa`, prefetching ahead
/// if `prefetch` (dense products; the NEON tiers never prefetch).
pub fn select(q: QuantType, isa: Isa, prefetch: bool) -> DotR8Fn {
    by_type!(q, isa, prefetch, avx512, avx2, neon, scalar_of(q))
}

/// The multi-token dot of repacked rows of `q` for `isa` (see [`DotR8TokensFn`]), prefetching
/// ahead if `prefetch` (the NEON tiers never prefetch).
pub fn select_tokens(q: QuantType, isa: Isa, prefetch: bool) -> DotR8TokensFn {
    by_type!(
        q,
        isa,
        prefetch,
        avx512_tokens,
        avx2_tokens,
        neon_tokens,
        scalar_tokens_of(q)
    )
}

/// The scalar reference token by token.
fn scalar_tokens_of(q: QuantType) -> DotR8TokensFn {
    macro_rules! each {
        ($($q:ident)*) => {
            match q {
                $(QuantType::$q => |r, a, g, o| {
                    check_tokens(QuantType::$q, r, a, g, o);
                    for ((a, g), o) in a.iter().zip(g).zip(o.iter_mut()) {
                        *o = scalar_of(QuantType::$q)(r, a, g);
                    }
                },)*
                _ => panic!("{q:?} rows are never repacked"),
            }
        };
    }
    each!(Q8_0 Q4_0 Q4_1 Q5_0)
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

/// [`check`] for every token of a [`DotR8TokensFn`] call, and 1..=[`MAX_TOKENS`] tokens with one
/// output each.
fn check_tokens(
    q: QuantType,
    row: &[u8],
    acts: &[&[BlockQ8A]],
    groups: &[&[ActGroup]],
    out: &[f32],
) {
    assert!(
        (1..=MAX_TOKENS).contains(&out.len()) && acts.len() == out.len() && groups.len() == out.len(),
        "repacked row dot: {} tokens' blocks and {} tokens' groups for {} outputs (1..={MAX_TOKENS})",
        acts.len(),
        groups.len(),
        out.len()
    );
    for (a, g) in acts.iter().zip(groups) {
        check(q, row, a, g);
    }
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
    use super::{check, check_tokens, Repacked, R4_0, R4_1, R5_0, R8_0};
    use dejavu_backend_api::quant::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ8A, BlockQ8_0};
    use std::arch::x86_64::*;

    /// One repacked type: its group's quants, their 8 block sums with an activation group, and
    /// its offset factors. The quants are unpacked once per group and dotted with every token of
    /// a [`row_dots`] call.
    pub trait Group: Repacked {
        /// The ggml block, for the tail (its `Step32` does the per-block work).
        type Block: Step32 + bytemuck::Pod;
        /// The group's quants as [`Self::qsums`] takes them: 8 unpacked steps of 32 (step `s`
        /// holds element `s` of each block's 32-wide lanes), or where unpacking is a plain load,
        /// the group itself.
        type Quants: Copy;
        unsafe fn quants(g: *const u8) -> Self::Quants;
        /// The 8 blocks' integer dots of `q` with the activation group `a`, lane `j` = block `j`.
        unsafe fn qsums<const VNNI: bool>(q: &Self::Quants, a: &ActGroup) -> __m256i;
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

    /// The 8 steps of a 4-bit group's nibbles (`high`: OR the Q5_0 fifth bits in).
    #[inline(always)]
    unsafe fn four_bit_quants(qs: *const u8, high: Option<__m256i>) -> [__m256i; GROUP] {
        let m = _mm256_set1_epi8(0x0F);
        let mut q = [_mm256_setzero_si256(); GROUP];
        for c in 0..4 {
            let v = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            q[c] = _mm256_and_si256(v, m);
            q[c + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
        }
        if let Some(h) = high {
            for (s, qs) in q.iter_mut().enumerate() {
                *qs = _mm256_or_si256(*qs, fifth_bit(h, s));
            }
        }
        q
    }

    impl Group for R8_0 {
        type Block = BlockQ8_0;
        /// The quants' address: 8-bit quants need no unpacking, and loading them per token
        /// (from L1 after the first) measured faster than holding 8 registers.
        type Quants = *const u8;
        #[inline(always)]
        unsafe fn quants(g: *const u8) -> *const u8 {
            g.add(layout(Self::Q).qs)
        }
        /// Signed x signed by the sign trick; each maddubs lane reaches 2 * 128 * 127, so
        /// AVX2 widens every step.
        #[inline(always)]
        unsafe fn qsums<const VNNI: bool>(qs: &*const u8, a: &ActGroup) -> __m256i {
            let w = |s: usize| _mm256_loadu_si256(qs.add(32 * s) as *const __m256i);
            let (mut x, mut y) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for s in (0..GROUP).step_by(2) {
                x = _mm256_add_epi32(x, dot_i8i8_v::<VNNI>(w(s), step(a, s)));
                y = _mm256_add_epi32(y, dot_i8i8_v::<VNNI>(w(s + 1), step(a, s + 1)));
            }
            _mm256_add_epi32(x, y)
        }
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    /// 4-bit quants: 2 * 15 * 127 per maddubs lane, so 8 steps fit an i16 sum.
    macro_rules! four_bit_qsums {
        () => {
            type Quants = [__m256i; GROUP];
            #[inline(always)]
            unsafe fn qsums<const VNNI: bool>(q: &[__m256i; GROUP], a: &ActGroup) -> __m256i {
                sum_u8i8::<VNNI, 8>(q, a, [0, 1, 2, 3, 4, 5, 6, 7])
            }
        };
    }

    impl Group for R4_0 {
        type Block = BlockQ4_0;
        #[inline(always)]
        unsafe fn quants(g: *const u8) -> [__m256i; GROUP] {
            four_bit_quants(g.add(layout(Self::Q).qs), None)
        }
        four_bit_qsums!();
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    impl Group for R4_1 {
        type Block = BlockQ4_1;
        #[inline(always)]
        unsafe fn quants(g: *const u8) -> [__m256i; GROUP] {
            four_bit_quants(g.add(layout(Self::Q).qs), None)
        }
        four_bit_qsums!();
        #[inline(always)]
        unsafe fn off_w(g: *const u8, _: __m256) -> __m256 {
            let m = layout(Self::Q).mins.unwrap_or(16);
            _mm256_cvtph_ps(_mm_loadu_si128(g.add(m) as *const __m128i))
        }
    }

    impl Group for R5_0 {
        type Block = BlockQ5_0;
        type Quants = [__m256i; GROUP];
        #[inline(always)]
        unsafe fn quants(g: *const u8) -> [__m256i; GROUP] {
            let lay = layout(Self::Q);
            let h = _mm256_loadu_si256(g.add(lay.high.unwrap_or(16)) as *const __m256i);
            four_bit_quants(g.add(lay.qs), Some(h))
        }
        /// 5-bit quants: 2 * 31 * 127 per maddubs lane, so at most 4 steps per i16 sum.
        #[inline(always)]
        unsafe fn qsums<const VNNI: bool>(q: &[__m256i; GROUP], a: &ActGroup) -> __m256i {
            let lo = sum_u8i8::<VNNI, 4>(&[q[0], q[1], q[2], q[3]], a, [0, 1, 2, 3]);
            let hi = sum_u8i8::<VNNI, 4>(&[q[4], q[5], q[6], q[7]], a, [4, 5, 6, 7]);
            _mm256_add_epi32(lo, hi)
        }
        #[inline(always)]
        unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
            dw
        }
    }

    /// One row dotted with `T` tokens: whole groups (each group's quants unpacked once, then
    /// dotted with every token), then the ggml tail blocks through the type's per-block step.
    /// Each token's float operations are those of a one-token call in the same order, so its
    /// result is bit for bit the same at any `T` (the integer sums are exact).
    /// Caller: every `acts[t]` holds the row's blocks and `groups[t]` its whole groups.
    #[inline(always)]
    unsafe fn row_dots<G: Group, const VNNI: bool, const PF: bool, const T: usize>(
        row: &[u8],
        acts: [&[BlockQ8A]; T],
        groups: [&[ActGroup]; T],
    ) -> [f32; T] {
        let (bb, gb) = (G::Q.block_bytes(), layout(G::Q).bytes);
        let blocks = acts.iter().fold(row.len() / bb, |b, a| b.min(a.len()));
        let n = groups.iter().fold(blocks / GROUP, |n, g| n.min(g.len()));
        let (mut acc, mut off) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
        for i in 0..n {
            let g = row.as_ptr().add(i * gb);
            if PF {
                let mut o = 0;
                while o < gb {
                    prefetch_ahead(g.add(o));
                    o += 64;
                }
            }
            let q = G::quants(g);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let ow = G::off_w(g, dw);
            for t in 0..T {
                // i < n <= groups[t].len().
                let a = groups[t].get_unchecked(i);
                let isum = G::qsums::<VNNI>(&q, a);
                let da = _mm256_load_ps(a.d.as_ptr());
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum), acc[t]);
                if G::OFF_SCALE != 0.0 {
                    let sa = _mm256_load_ps(a.s.as_ptr());
                    off[t] = _mm256_fmadd_ps(ow, sa, off[t]);
                }
            }
        }
        let tail: &[G::Block] =
            bytemuck::cast_slice(&row[n * gb..n * gb + (blocks - n * GROUP) * bb]);
        // A loop, not a closure: a closure would not inherit the caller's target features,
        // and the SIMD helpers would not inline into it.
        let mut out = [0f32; T];
        for t in 0..T {
            out[t] =
                hsum_ps(acc[t]) + pair_loop::<G::Block, VNNI, false>(tail, &acts[t][n * GROUP..]);
            if G::OFF_SCALE != 0.0 {
                out[t] += G::OFF_SCALE * hsum_ps(off[t]);
            }
        }
        out
    }

    /// [`row_dots`] over `out.len()` tokens (1..=[`super::MAX_TOKENS`]), `T` a constant.
    #[inline(always)]
    unsafe fn row_dots_any<G: Group, const VNNI: bool, const PF: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        macro_rules! with {
            ($t:literal) => {
                out.copy_from_slice(&row_dots::<G, VNNI, PF, $t>(
                    row,
                    std::array::from_fn(|t| acts[t]),
                    std::array::from_fn(|t| groups[t]),
                ))
            };
        }
        match out.len() {
            1 => with!(1),
            2 => with!(2),
            3 => with!(3),
            4 => with!(4),
            n => unreachable!("{n} tokens: the caller checks 1..=MAX_TOKENS"),
        }
    }

    pub fn avx2<G: Group, const PF: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        check(G::Q, row, act, g);
        // SAFETY: handed out by `select` only for tiers whose features this CPU has; every
        // read lies inside `row`, `act` and `g` (whole groups and blocks of each, counted).
        unsafe { avx2_one::<G, PF>(row, act, g) }
    }

    /// One token: no dispatch on the count (short rows make per-call work count).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_one<G: Group, const PF: bool>(
        row: &[u8],
        act: &[BlockQ8A],
        g: &[ActGroup],
    ) -> f32 {
        row_dots::<G, false, PF, 1>(row, [act], [g])[0]
    }

    pub fn avx2_tokens<G: Group, const PF: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        check_tokens(G::Q, row, acts, groups, out);
        // SAFETY: as `avx2`, for every token (`check_tokens`).
        unsafe { avx2_impl::<G, PF>(row, acts, groups, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_impl<G: Group, const PF: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        row_dots_any::<G, false, PF>(row, acts, groups, out)
    }

    pub fn avx512<G: Group, const PF: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
        check(G::Q, row, act, g);
        // SAFETY: as `avx2`.
        unsafe { avx512_one::<G, PF>(row, act, g) }
    }

    /// One token: no dispatch on the count (short rows make per-call work count).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn avx512_one<G: Group, const PF: bool>(
        row: &[u8],
        act: &[BlockQ8A],
        g: &[ActGroup],
    ) -> f32 {
        row_dots::<G, true, PF, 1>(row, [act], [g])[0]
    }

    pub fn avx512_tokens<G: Group, const PF: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        check_tokens(G::Q, row, acts, groups, out);
        // SAFETY: as `avx2`, for every token (`check_tokens`).
        unsafe { avx512_impl::<G, PF>(row, acts, groups, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn avx512_impl<G: Group, const PF: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        row_dots_any::<G, true, PF>(row, acts, groups, out)
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
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

    /// Token by token through [`neon`] (the NEON tiers do not share unpacked quants yet).
    pub fn neon_tokens<G: Group, const DOT: bool>(
        row: &[u8],
        acts: &[&[BlockQ8A]],
        groups: &[&[ActGroup]],
        out: &mut [f32],
    ) {
        check_tokens(G::Q, row, acts, groups, out);
        for ((a, g), o) in acts.iter().zip(groups).zip(out.iter_mut()) {
            *o = neon::<G, DOT>(row, a, g);
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

    /// Every tier's multi-token dot gives each token its one-token dot bit for bit (1 to
    /// `MAX_TOKENS` tokens, whole groups, ragged tails and tail-only rows, prefetching or not),
    /// and refuses mismatched token counts.
    #[test]
    fn tokens_equal_one_token_dots() {
        for q in TYPES {
            for blocks in [1usize, 8, 9, 28, 67] {
                let n = blocks * QK;
                let row = random_row(q, n, 3 * blocks as u64);
                let mut packed = vec![0u8; row.len()];
                repack_row(q, &row, &mut packed);
                let acts: Vec<Vec<BlockQ8A>> = (0..MAX_TOKENS as u64)
                    .map(|t| act_of(&random_f32(n, 17 + t)))
                    .collect();
                let groups: Vec<Vec<ActGroup>> = acts.iter().map(|a| groups_of(a)).collect();
                for isa in Isa::supported() {
                    for pf in [false, true] {
                        let (one, many) = (select(q, isa, pf), select_tokens(q, isa, pf));
                        for k in 1..=MAX_TOKENS {
                            let a: Vec<&[BlockQ8A]> = acts[..k].iter().map(|a| &a[..]).collect();
                            let g: Vec<&[ActGroup]> = groups[..k].iter().map(|g| &g[..]).collect();
                            let mut out = vec![f32::NAN; k];
                            many(&packed, &a, &g, &mut out);
                            for t in 0..k {
                                let want = one(&packed, &acts[t], &groups[t]);
                                assert_eq!(
                                    out[t].to_bits(),
                                    want.to_bits(),
                                    "{isa} {q:?} {blocks} blocks, {k} tokens, token {t}"
                                );
                            }
                        }
                        let a = [&acts[0][..]];
                        let refused = std::panic::catch_unwind(|| {
                            many(&packed, &a, &[&groups[0][..]], &mut [0.0; 2])
                        });
                        assert!(refused.is_err(), "{isa} {q:?}: 1 token, 2 outputs");
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
