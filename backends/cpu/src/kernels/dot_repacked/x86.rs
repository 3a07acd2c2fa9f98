//! The x86 tiers of the repacked row dot (AVX2, AVX-512 VNNI): one group of 8 blocks per step,
//! its quants unpacked once for every token of a call.
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
    /// the group itself; prepared for the tier's integer dot (`VNNI`: `vpdpbusd`).
    type Quants: Copy;
    unsafe fn quants<const VNNI: bool>(g: *const u8) -> Self::Quants;
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
    /// AVX2: the quants' address (8-bit quants need no unpacking, and loading them per token,
    /// from L1 after the first, measured faster than holding 8 registers of 16). VNNI: also the
    /// 8 steps offset to unsigned (`q + 128`, a sign-bit flip), held for every token.
    type Quants = (*const u8, [__m256i; GROUP]);
    #[inline(always)]
    unsafe fn quants<const VNNI: bool>(g: *const u8) -> Self::Quants {
        let qs = g.add(layout(Self::Q).qs);
        let mut u = [_mm256_setzero_si256(); GROUP];
        if VNNI {
            let flip = _mm256_set1_epi8(i8::MIN);
            for (s, u) in u.iter_mut().enumerate() {
                let w = _mm256_loadu_si256(qs.add(32 * s) as *const __m256i);
                *u = _mm256_xor_si256(w, flip);
            }
        }
        (qs, u)
    }
    /// Signed x signed. VNNI: `vpdpbusd` of `q + 128` with the activations, less `128 sum(qa)`
    /// per block (exact in i32, so the same sums as the sign trick). AVX2: the sign trick; each
    /// maddubs lane reaches 2 * 128 * 127, so it widens every step.
    #[inline(always)]
    unsafe fn qsums<const VNNI: bool>(q: &Self::Quants, a: &ActGroup) -> __m256i {
        if VNNI {
            let u = &q.1;
            let (mut x, mut y) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for s in (0..GROUP).step_by(2) {
                x = _mm256_dpbusd_epi32(x, u[s], step(a, s));
                y = _mm256_dpbusd_epi32(y, u[s + 1], step(a, s + 1));
            }
            let qsum = _mm256_load_si256(a.qsum.as_ptr() as *const __m256i);
            return _mm256_sub_epi32(_mm256_add_epi32(x, y), _mm256_slli_epi32::<7>(qsum));
        }
        let w = |s: usize| _mm256_loadu_si256(q.0.add(32 * s) as *const __m256i);
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
    unsafe fn quants<const VNNI: bool>(g: *const u8) -> [__m256i; GROUP] {
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
    unsafe fn quants<const VNNI: bool>(g: *const u8) -> [__m256i; GROUP] {
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
    unsafe fn quants<const VNNI: bool>(g: *const u8) -> [__m256i; GROUP] {
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
/// dotted with every token), then the ggml tail blocks, each block once for every token.
/// Token `t`'s terms, the offset terms among them, go into one 8-lane accumulator, summed
/// across lanes at the end ([`hsums`], in `hsum_ps`'s order at any `T`): its float operations
/// are those of a one-token call in the same order, so its result is bit for bit the same at
/// any `T` (the integer sums are exact).
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
    let mut acc = [_mm256_setzero_ps(); T];
    for i in 0..n {
        let g = row.as_ptr().add(i * gb);
        if PF {
            let mut o = 0;
            while o < gb {
                prefetch_ahead(g.add(o));
                o += 64;
            }
        }
        let q = G::quants::<VNNI>(g);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
        let ow = if G::OFF_SCALE == 1.0 {
            G::off_w(g, dw)
        } else {
            _mm256_mul_ps(_mm256_set1_ps(G::OFF_SCALE), G::off_w(g, dw))
        };
        for t in 0..T {
            // SAFETY: i < n <= groups[t].len().
            let a = groups[t].get_unchecked(i);
            let isum = G::qsums::<VNNI>(&q, a);
            let da = _mm256_load_ps(a.d.as_ptr());
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum), acc[t]);
            if G::OFF_SCALE != 0.0 {
                acc[t] = _mm256_fmadd_ps(ow, _mm256_load_ps(a.s.as_ptr()), acc[t]);
            }
        }
    }
    let tail: &[G::Block] = bytemuck::cast_slice(&row[n * gb..n * gb + (blocks - n * GROUP) * bb]);
    // Loops, not closures: a closure would not inherit the caller's target features, and the
    // SIMD helpers would not inline into it.
    let mut off = [_mm_setzero_ps(); T];
    for (b, w) in tail.iter().enumerate() {
        for t in 0..T {
            // SAFETY: n * GROUP + b < blocks <= acts[t].len().
            let a = acts[t].get_unchecked(n * GROUP + b);
            super::super::x86::step::<G::Block, VNNI>(w, a, &mut acc[t], &mut off[t]);
        }
    }
    if G::OFF_SCALE != 0.0 && !tail.is_empty() {
        for t in 0..T {
            // Lane 1 of `off` (the tail's offset terms), scaled, into lane 0.
            let o = _mm_mul_ss(_mm_set_ss(G::OFF_SCALE), _mm_movehdup_ps(off[t]));
            let o = _mm_move_ss(_mm_setzero_ps(), o);
            acc[t] = _mm256_add_ps(acc[t], _mm256_set_m128(_mm_setzero_ps(), o));
        }
    }
    let mut out = [0f32; T];
    if T == 1 {
        out[0] = hsum_ps(acc[0]);
    } else {
        hsums(&acc, &mut out);
    }
    out
}

/// [`row_dots`] of each row of `rows` (`rb` bytes each) over `acts.len()` tokens
/// (1..=[`super::MAX_TOKENS`], `T` a constant), row `r`'s into `out[r * T..]`.
#[inline(always)]
unsafe fn rows_dots<G: Group, const VNNI: bool, const PF: bool>(
    rows: &[u8],
    rb: usize,
    acts: &[&[BlockQ8A]],
    groups: &[&[ActGroup]],
    out: &mut [f32],
) {
    macro_rules! with {
        ($t:literal) => {{
            let a: [&[BlockQ8A]; $t] = std::array::from_fn(|t| acts[t]);
            let g: [&[ActGroup]; $t] = std::array::from_fn(|t| groups[t]);
            for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut($t)) {
                o.copy_from_slice(&row_dots::<G, VNNI, PF, $t>(row, a, g));
            }
        }};
    }
    match acts.len() {
        1 => with!(1),
        2 => with!(2),
        3 => with!(3),
        4 => with!(4),
        5 => with!(5),
        6 => with!(6),
        7 => with!(7),
        8 => with!(8),
        n => unreachable!("{n} tokens: the caller checks 1..=MAX_TOKENS"),
    }
}

/// One tier's entry points: `$one` (one token, [`super::DotR8Fn`]) and `$tokens`
/// ([`super::DotR8TokensFn`]) check their lengths in release builds, then run [`row_dots`]
/// compiled with `$features` (`$vnni`: the tier's integer dot instruction). The one-token path
/// calls `row_dots` at `T = 1` directly: short rows make a dispatch on the count per call cost.
macro_rules! tier {
    (
        $one:ident,
        $tokens:ident,
        $one_impl:ident,
        $tokens_impl:ident,
        $features:literal,
        $vnni:literal
    ) => {
        pub fn $one<G: Group, const PF: bool>(row: &[u8], act: &[BlockQ8A], g: &[ActGroup]) -> f32 {
            check(G::Q, row, act, g);
            // SAFETY: handed out by `select` only for tiers whose features this CPU has; every
            // read lies inside `row`, `act` and `g` (whole groups and blocks of each, counted).
            unsafe { $one_impl::<G, PF>(row, act, g) }
        }

        #[target_feature(enable = $features)]
        unsafe fn $one_impl<G: Group, const PF: bool>(
            row: &[u8],
            act: &[BlockQ8A],
            g: &[ActGroup],
        ) -> f32 {
            row_dots::<G, $vnni, PF, 1>(row, [act], [g])[0]
        }

        pub fn $tokens<G: Group, const PF: bool>(
            rows: &[u8],
            acts: &[&[BlockQ8A]],
            groups: &[&[ActGroup]],
            out: &mut [f32],
        ) {
            let rb = check_tokens(G::Q, rows, acts, groups, out);
            // SAFETY: as the one-token entry, for every row (of `rb` bytes, as the first) and
            // token (`check_tokens`).
            unsafe { $tokens_impl::<G, PF>(rows, rb, acts, groups, out) }
        }

        #[target_feature(enable = $features)]
        unsafe fn $tokens_impl<G: Group, const PF: bool>(
            rows: &[u8],
            rb: usize,
            acts: &[&[BlockQ8A]],
            groups: &[&[ActGroup]],
            out: &mut [f32],
        ) {
            rows_dots::<G, $vnni, PF>(rows, rb, acts, groups, out)
        }
    };
}

tier!(
    avx2,
    avx2_tokens,
    avx2_one,
    avx2_tokens_impl,
    "avx2,fma,f16c",
    false
);
tier!(
    avx512,
    avx512_tokens,
    avx512_one,
    avx512_tokens_impl,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    true
);
