//! The x86 tiers of the repacked row dot (AVX2, AVX-512 VNNI): one group of 8 blocks per step,
//! its quants unpacked once for every token of a call; on AVX-512, two rows at once, one in
//! each half of a 512-bit vector.
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

    /// AVX-512 VNNI, two rows at once ([`pair_dots`]): the quants of the groups at `g0` (lanes
    /// 0..8 of every step) and `g1` (lanes 8..16), prepared for `vpdpbusd` as [`Self::quants`].
    unsafe fn quants2(g0: *const u8, g1: *const u8) -> [__m512i; GROUP];
    /// The 16 blocks' integer dots of `q` with the activation group `a` (broadcast to both
    /// halves), lane `j` = block `j % 8` of row `j / 8`: each lane's sum of [`Self::qsums`].
    #[inline(always)]
    unsafe fn qsums2(q: &[__m512i; GROUP], a: &ActGroup) -> __m512i {
        vnni_sum2(q, a)
    }
    /// [`Self::off_w`] of both groups, given both `d_w`.
    #[inline(always)]
    unsafe fn off_w2(_g0: *const u8, _g1: *const u8, dw: __m512) -> __m512 {
        dw
    }
    /// Two tail blocks (ggml layout) as `vpdpbusd`'s unsigned operand, `b0`'s in the low half:
    /// the 4-bit types' quants (Q5_0's fifth bits in), Q8_0's offset by 128 (see
    /// [`Self::OFFSET_128`]).
    unsafe fn tail_quants2(b0: &Self::Block, b1: &Self::Block) -> __m512i;
    /// [`Self::tail_quants2`] is `q + 128`: a lane's dot is less 128 times its activations' sum.
    const OFFSET_128: bool = false;
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

/// Step `s` of the activation group in both halves of a 512-bit vector (a load, no shuffle).
#[inline(always)]
unsafe fn step2(a: &ActGroup, s: usize) -> __m512i {
    _mm512_broadcast_i64x4(step(a, s))
}

/// `lo` and `hi` as the halves of one vector.
#[inline(always)]
unsafe fn join2(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// 8 floats at `p` (32-byte aligned) in both halves.
#[inline(always)]
unsafe fn floats2(p: *const f32) -> __m512 {
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd(p as *const f64)))
}

/// 32 bytes at `p0` (low half) and at `p1` (high half).
#[inline(always)]
unsafe fn load2(p0: *const u8, p1: *const u8) -> __m512i {
    join2(
        _mm256_loadu_si256(p0 as *const __m256i),
        _mm256_loadu_si256(p1 as *const __m256i),
    )
}

/// 8 f16 values at `p0` (lanes 0..8) and at `p1` (lanes 8..16) as f32.
#[inline(always)]
unsafe fn f16x8_2(p0: *const u8, p1: *const u8) -> __m512 {
    let (lo, hi) = (
        _mm_loadu_si128(p0 as *const __m128i),
        _mm_loadu_si128(p1 as *const __m128i),
    );
    _mm512_cvtph_ps(_mm256_set_m128i(hi, lo))
}

/// `vpdpbusd` of the 8 steps `q` with the activation group's, on two chains (the integer sums
/// are exact, so each lane equals [`sum_u8i8`]'s).
#[inline(always)]
unsafe fn vnni_sum2(q: &[__m512i; GROUP], a: &ActGroup) -> __m512i {
    let (mut x, mut y) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for s in (0..GROUP).step_by(2) {
        x = _mm512_dpbusd_epi32(x, q[s], step2(a, s));
        y = _mm512_dpbusd_epi32(y, q[s + 1], step2(a, s + 1));
    }
    _mm512_add_epi32(x, y)
}

/// [`four_bit_quants`] of two groups, `g0`'s in the low halves (`high`: both fifth-bit planes).
#[inline(always)]
unsafe fn four_bit_quants2(
    q0: *const u8,
    q1: *const u8,
    high: Option<__m512i>,
) -> [__m512i; GROUP] {
    let m = _mm512_set1_epi8(0x0F);
    let mut q = [_mm512_setzero_si512(); GROUP];
    for c in 0..4 {
        let v = load2(q0.add(32 * c), q1.add(32 * c));
        q[c] = _mm512_and_si512(v, m);
        q[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m);
    }
    if let Some(h) = high {
        for (s, qs) in q.iter_mut().enumerate() {
            *qs = _mm512_or_si512(*qs, fifth_bit2(h, s));
        }
    }
    q
}

/// [`fifth_bit`] on 512 bits.
#[inline(always)]
unsafe fn fifth_bit2(h: __m512i, s: usize) -> __m512i {
    let v = match 4 - s as isize {
        -3 => _mm512_srli_epi16::<3>(h),
        -2 => _mm512_srli_epi16::<2>(h),
        -1 => _mm512_srli_epi16::<1>(h),
        0 => h,
        1 => _mm512_slli_epi16::<1>(h),
        2 => _mm512_slli_epi16::<2>(h),
        3 => _mm512_slli_epi16::<3>(h),
        _ => _mm512_slli_epi16::<4>(h),
    };
    _mm512_and_si512(v, _mm512_set1_epi8(0x10))
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
    #[inline(always)]
    unsafe fn quants2(g0: *const u8, g1: *const u8) -> [__m512i; GROUP] {
        let o = layout(Self::Q).qs;
        let flip = _mm512_set1_epi8(i8::MIN);
        std::array::from_fn(|s| {
            _mm512_xor_si512(load2(g0.add(o + 32 * s), g1.add(o + 32 * s)), flip)
        })
    }
    #[inline(always)]
    unsafe fn tail_quants2(b0: &BlockQ8_0, b1: &BlockQ8_0) -> __m512i {
        let q = load2(b0.qs.as_ptr() as *const u8, b1.qs.as_ptr() as *const u8);
        _mm512_xor_si512(q, _mm512_set1_epi8(i8::MIN))
    }
    const OFFSET_128: bool = true;
    /// As the VNNI [`Self::qsums`]: less `128 sum(qa)` per block.
    #[inline(always)]
    unsafe fn qsums2(q: &[__m512i; GROUP], a: &ActGroup) -> __m512i {
        let qsum = _mm512_broadcast_i64x4(_mm256_load_si256(a.qsum.as_ptr() as *const __m256i));
        _mm512_sub_epi32(vnni_sum2(q, a), _mm512_slli_epi32::<7>(qsum))
    }
}

/// The nibble types (Q4_0, Q4_1): their quants as the group's nibbles, on 256 bits, on two
/// rows' 512, and as a tail block's; 2 * 15 * 127 per maddubs lane, so 8 steps fit an i16 sum.
macro_rules! nibbles {
    () => {
        type Quants = [__m256i; GROUP];
        #[inline(always)]
        unsafe fn quants<const VNNI: bool>(g: *const u8) -> [__m256i; GROUP] {
            four_bit_quants(g.add(layout(Self::Q).qs), None)
        }
        #[inline(always)]
        unsafe fn qsums<const VNNI: bool>(q: &[__m256i; GROUP], a: &ActGroup) -> __m256i {
            sum_u8i8::<VNNI, 8>(q, a, [0, 1, 2, 3, 4, 5, 6, 7])
        }
        #[inline(always)]
        unsafe fn quants2(g0: *const u8, g1: *const u8) -> [__m512i; GROUP] {
            let o = layout(Self::Q).qs;
            four_bit_quants2(g0.add(o), g1.add(o), None)
        }
        #[inline(always)]
        unsafe fn tail_quants2(b0: &Self::Block, b1: &Self::Block) -> __m512i {
            join2(
                unpack_nibbles(b0.qs.as_ptr()),
                unpack_nibbles(b1.qs.as_ptr()),
            )
        }
    };
}

impl Group for R4_0 {
    type Block = BlockQ4_0;
    nibbles!();
    #[inline(always)]
    unsafe fn off_w(_: *const u8, dw: __m256) -> __m256 {
        dw
    }
}

impl Group for R4_1 {
    type Block = BlockQ4_1;
    nibbles!();
    #[inline(always)]
    unsafe fn off_w(g: *const u8, _: __m256) -> __m256 {
        let m = layout(Self::Q).mins.unwrap_or(16);
        _mm256_cvtph_ps(_mm_loadu_si128(g.add(m) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn off_w2(g0: *const u8, g1: *const u8, _: __m512) -> __m512 {
        let m = layout(Self::Q).mins.unwrap_or(16);
        f16x8_2(g0.add(m), g1.add(m))
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
    #[inline(always)]
    unsafe fn quants2(g0: *const u8, g1: *const u8) -> [__m512i; GROUP] {
        let lay = layout(Self::Q);
        let h = lay.high.unwrap_or(16);
        four_bit_quants2(
            g0.add(lay.qs),
            g1.add(lay.qs),
            Some(load2(g0.add(h), g1.add(h))),
        )
    }
    #[inline(always)]
    unsafe fn tail_quants2(b0: &BlockQ5_0, b1: &BlockQ5_0) -> __m512i {
        let q = |b: &BlockQ5_0| {
            let hi = bytes_from_bits_32(u32::from_le_bytes(b.qh));
            _mm256_or_si256(
                unpack_nibbles(b.qs.as_ptr()),
                _mm256_and_si256(hi, _mm256_set1_epi8(0x10)),
            )
        };
        join2(q(b0), q(b1))
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
/// dotted with every token), then the ggml tail blocks ([`finish`]).
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
    let (blocks, n) = extent::<G, T>(row.len(), &acts, &groups);
    let gb = layout(G::Q).bytes;
    let mut acc = [_mm256_setzero_ps(); T];
    for i in 0..n {
        let g = row.as_ptr().add(i * gb);
        if PF {
            prefetch_group(g, gb);
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
    finish::<G, VNNI, T>(row, acts, n, blocks, acc)
}

/// AVX-512 VNNI: two rows of one length dotted with `T` tokens, `r0`'s groups in the low
/// halves of 512-bit vectors and `r1`'s in the high halves (each weight vector built once per
/// group for every token; each activation step broadcast to both halves by a load). Every lane
/// does [`row_dots`]' float operations in its order, and each row's 8 lanes then go on as
/// `row_dots`' accumulator ([`finish2`]), so both results are bit for bit `row_dots`' at any
/// `T`. Caller: as `row_dots`, for both rows.
#[inline(always)]
unsafe fn pair_dots<G: Group, const PF: bool, const T: usize>(
    r0: &[u8],
    r1: &[u8],
    acts: [&[BlockQ8A]; T],
    groups: [&[ActGroup]; T],
) -> [[f32; T]; 2] {
    let (blocks, n) = extent::<G, T>(r0.len().min(r1.len()), &acts, &groups);
    let gb = layout(G::Q).bytes;
    let mut acc = [_mm512_setzero_ps(); T];
    for i in 0..n {
        let (g0, g1) = (r0.as_ptr().add(i * gb), r1.as_ptr().add(i * gb));
        if PF {
            prefetch_group(g0, gb);
            prefetch_group(g1, gb);
        }
        let q = G::quants2(g0, g1);
        let dw = f16x8_2(g0, g1);
        let ow = if G::OFF_SCALE == 1.0 {
            G::off_w2(g0, g1, dw)
        } else {
            _mm512_mul_ps(_mm512_set1_ps(G::OFF_SCALE), G::off_w2(g0, g1, dw))
        };
        for t in 0..T {
            // SAFETY: i < n <= groups[t].len().
            let a = groups[t].get_unchecked(i);
            let isum = G::qsums2(&q, a);
            let da = floats2(a.d.as_ptr());
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum), acc[t]);
            if G::OFF_SCALE != 0.0 {
                acc[t] = _mm512_fmadd_ps(ow, floats2(a.s.as_ptr()), acc[t]);
            }
        }
    }
    finish2::<G, T>([r0, r1], acts, n, blocks, acc)
}

/// The ggml blocks of `row` after its `n` whole groups, up to `blocks`.
#[inline(always)]
fn tail_of<G: Group>(row: &[u8], n: usize, blocks: usize) -> &[G::Block] {
    let (bb, gb) = (G::Q.block_bytes(), layout(G::Q).bytes);
    bytemuck::cast_slice(&row[n * gb..n * gb + (blocks - n * GROUP) * bb])
}

/// [`finish`] of both rows of [`pair_dots`] at once: each tail block pair's quants prepared
/// once for every token, and in every lane [`step`]'s float operations in its order (the
/// product `d_w d_a` broadcast, its multiply-add, the offset terms `o_w s_a` summed block by
/// block), so each row's result is bit for bit `finish`'s.
#[inline(always)]
unsafe fn finish2<G: Group, const T: usize>(
    rows: [&[u8]; 2],
    acts: [&[BlockQ8A]; T],
    n: usize,
    blocks: usize,
    mut acc: [__m512; T],
) -> [[f32; T]; 2] {
    let (t0, t1) = (
        tail_of::<G>(rows[0], n, blocks),
        tail_of::<G>(rows[1], n, blocks),
    );
    // Lane r of `off[t]`: row r's offset terms.
    let mut off = [_mm_setzero_ps(); T];
    for (b, (w0, w1)) in t0.iter().zip(t1).enumerate() {
        let u = G::tail_quants2(w0, w1);
        let (s0, s1) = (w0.scales(), w1.scales());
        let dw = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_broadcastss_ps(s0))),
            _mm256_castps_pd(_mm256_broadcastss_ps(s1)),
        ));
        let ow = _mm_movehl_ps(_mm_unpacklo_ps(s0, s1), _mm_unpacklo_ps(s0, s1));
        for t in 0..T {
            // SAFETY: n * GROUP + b < blocks <= acts[t].len().
            let a = acts[t].get_unchecked(n * GROUP + b);
            let qa = _mm512_broadcast_i64x4(load_i8x32(&a.qs));
            let mut p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, qa);
            if G::OFFSET_128 {
                let fix =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(i8::MIN), qa);
                p = _mm512_sub_epi32(p, fix);
            }
            let dd = _mm512_mul_ps(dw, _mm512_set1_ps(a.d));
            acc[t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(p), acc[t]);
            if G::OFF_SCALE != 0.0 {
                off[t] = _mm_add_ps(off[t], _mm_mul_ps(ow, _mm_set1_ps(a.s)));
            }
        }
    }
    let mut out = [[0f32; T]; 2];
    for (r, out) in out.iter_mut().enumerate() {
        let mut half = [_mm256_setzero_ps(); T];
        for t in 0..T {
            half[t] = match r {
                0 => _mm512_castps512_ps256(acc[t]),
                _ => _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[t]))),
            };
            if G::OFF_SCALE != 0.0 && !t0.is_empty() {
                // Lane r of `off` (the row's offset terms), scaled, into lane 0.
                let o = match r {
                    0 => off[t],
                    _ => _mm_movehdup_ps(off[t]),
                };
                let o = _mm_mul_ss(_mm_set_ss(G::OFF_SCALE), o);
                let o = _mm_move_ss(_mm_setzero_ps(), o);
                half[t] = _mm256_add_ps(half[t], _mm256_set_m128(_mm_setzero_ps(), o));
            }
        }
        if T == 1 {
            out[0] = hsum_ps(half[0]);
        } else {
            hsums(&half, out);
        }
    }
    out
}

/// `(blocks, groups)`: the blocks of a `len`-byte row that every token has, and its whole
/// groups that every token has.
#[inline(always)]
fn extent<G: Group, const T: usize>(
    len: usize,
    acts: &[&[BlockQ8A]; T],
    groups: &[&[ActGroup]; T],
) -> (usize, usize) {
    let blocks = acts
        .iter()
        .fold(len / G::Q.block_bytes(), |b, a| b.min(a.len()));
    (
        blocks,
        groups.iter().fold(blocks / GROUP, |n, g| n.min(g.len())),
    )
}

/// Prefetch the `gb` bytes of a group [`PREFETCH_BYTES`] ahead, a line at a time.
#[inline(always)]
unsafe fn prefetch_group(g: *const u8, gb: usize) {
    let mut o = 0;
    while o < gb {
        prefetch_ahead(g.add(o));
        o += 64;
    }
}

/// The end of [`row_dots`] from its accumulators `acc` after the row's `n` whole groups: the
/// ggml tail blocks (up to `blocks`), each block once for every token, then the lane sums.
#[inline(always)]
unsafe fn finish<G: Group, const VNNI: bool, const T: usize>(
    row: &[u8],
    acts: [&[BlockQ8A]; T],
    n: usize,
    blocks: usize,
    mut acc: [__m256; T],
) -> [f32; T] {
    let tail = tail_of::<G>(row, n, blocks);
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
/// (1..=[`super::MAX_TOKENS`], `T` a constant), row `r`'s into `out[r * T..]`. From 2 tokens
/// on the AVX-512 tier takes the rows in pairs ([`pair_dots`]; an odd last row alone): a
/// `vpdpbusd` on 512 bits costs about what one on 256 does on the CPUs measured, and the
/// weights' unpacking is shared by every token. `dejavu bench -m SmolLM2-135M-Instruct.Q4_1.gguf
/// -t 2 --batch 8 -p 8 -n 128 -r 5`, the builds alternating, four runs: 9.59-10.28 ms a step
/// before, 9.19-9.65 after. One token stays on 256 bits: pairs there read two rows' streams at
/// once and decode (`-p 0 -n 128 -r 5`, three runs each) went from 361-397 tok/s to 342-365.
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
            let mut done = 0;
            if VNNI && $t > 1 {
                let pairs = rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2 * $t));
                for (two, o) in pairs {
                    let [o0, o1] = pair_dots::<G, PF, $t>(&two[..rb], &two[rb..], a, g);
                    o[..$t].copy_from_slice(&o0);
                    o[$t..].copy_from_slice(&o1);
                    done += 2;
                }
            }
            let rest = rows[done * rb..]
                .chunks_exact(rb)
                .zip(out[done * $t..].chunks_exact_mut($t));
            for (row, o) in rest {
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
