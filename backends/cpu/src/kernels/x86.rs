//! AVX2 helpers shared by the x86 kernels (after ggml's `ggml-cpu/arch/x86` helpers).
#![allow(clippy::missing_safety_doc)]
use std::arch::x86_64::*;

/// Horizontal sum of 8 floats.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sums of `T <= 8` vectors, `out[t]` bit for bit `hsum_ps(v[t])`: the same adds
/// of the same lanes in the same order ((lane `k` + lane `k + 4`), then (0 + 2), (1 + 3),
/// then their sum), done for 8 vectors at once by a transpose (22 instructions for 8 sums,
/// where 8 `hsum_ps` take 40). Lanes of absent vectors (`t >= T`) are zeros, never stored.
#[inline(always)]
pub unsafe fn hsums<const T: usize>(v: &[__m256; T], out: &mut [f32; T]) {
    let z = _mm256_setzero_ps();
    let at = |t: usize| if t < T { v[t] } else { z };
    // p[i] = [lo + hi of vector 2i | lo + hi of vector 2i + 1]
    let p: [__m256; 4] = std::array::from_fn(|i| {
        let (a, b) = (at(2 * i), at(2 * i + 1));
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    });
    // q[i] = [(0 + 2), (1 + 3) of vectors 4i, 4i + 2 | of 4i + 1, 4i + 3]
    let q: [__m256; 2] = std::array::from_fn(|i| {
        let (a, b) = (p[2 * i], p[2 * i + 1]);
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    // r = sums of vectors [0, 2, 4, 6 | 1, 3, 5, 7]
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(q[0], q[1]),
        _mm256_shuffle_ps::<0b11_01_11_01>(q[0], q[1]),
    );
    let r = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut all = [0f32; 8];
    _mm256_storeu_ps(all.as_mut_ptr(), r);
    out.copy_from_slice(&all[..T]);
}

/// Sum of adjacent products of unsigned bytes `u` and signed bytes `s`, as 8 i32 lanes
/// (lane k covers bytes 4k..4k+4). Caller keeps `2 * u * s` within i16 per pair.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn dot_u8i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// 16 packed nibble bytes -> 32 bytes: low nibbles first (elements 0..16), then high nibbles.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Expand 32 bits into 32 bytes: 0xFF where the bit is set.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn bytes_from_bits_32(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
}

/// `v` shifted left by `k` bits per 16-bit lane (right for negative `k`), `k` in -4..=4.
#[inline(always)]
unsafe fn shift16(v: __m256i, k: isize) -> __m256i {
    match k {
        -4 => _mm256_srli_epi16::<4>(v),
        -3 => _mm256_srli_epi16::<3>(v),
        -2 => _mm256_srli_epi16::<2>(v),
        -1 => _mm256_srli_epi16::<1>(v),
        0 => v,
        1 => _mm256_slli_epi16::<1>(v),
        2 => _mm256_slli_epi16::<2>(v),
        3 => _mm256_slli_epi16::<3>(v),
        _ => _mm256_slli_epi16::<4>(v),
    }
}

/// Bit `s` (0..8) of every byte of `h` moved to bit 4, the rest cleared (the repacked Q5_0
/// fifth-bit plane). 16-bit shifts suffice: bit 4 of each byte receives a bit of the same byte.
#[inline(always)]
pub unsafe fn fifth_bit(h: __m256i, s: usize) -> __m256i {
    _mm256_and_si256(shift16(h, 4 - s as isize), _mm256_set1_epi8(0x10))
}

/// The inverse of [`fifth_bit`]: bit 4 of every byte of `v` moved to bit `s`, the rest cleared.
#[inline(always)]
pub unsafe fn from_fifth_bit(v: __m256i, s: usize) -> __m256i {
    shift16(_mm256_and_si256(v, _mm256_set1_epi8(0x10)), s as isize - 4)
}

#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn load_i8x32(p: &[i8; 32]) -> __m256i {
    _mm256_loadu_si256(p.as_ptr() as *const __m256i)
}

/// f16 -> f32 with the F16C instruction (the `half` crate's conversion checks the CPU per call).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16(h: half::f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

/// `dot_u8i8` on the tier's instruction: AVX-512 VNNI `vpdpbusd` (one instruction, no i16
/// saturation) or AVX2 `maddubs` + `madd`. Both give the same sums for the value ranges used here
/// (|u * s| pairs below 2^15). Inlined into a caller compiled for the matching features.
#[inline(always)]
pub unsafe fn dot_u8i8_v<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    } else {
        dot_u8i8(u, s)
    }
}

/// Signed x signed bytes on the tier's instruction (sign trick, as `dot_i8i8`).
#[inline(always)]
pub unsafe fn dot_i8i8_v<const VNNI: bool>(a: __m256i, b: __m256i) -> __m256i {
    dot_u8i8_v::<VNNI>(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
}

/// Per-16 scales as multipliers of a 32-byte product: `scales` holds 16 i16 scales (one per
/// 16 elements of a super-block); the result holds scale `2k` in every i16 of the low 128-bit
/// lane and scale `2k + 1` in the high lane (the lanes of elements 0..16 and 16..32 of 32-element
/// group `k`), for `madd` with that group's `maddubs` products.
#[inline(always)]
pub unsafe fn scale_pair(scales: __m256i, k: usize) -> __m256i {
    let pick = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        2, 3,
    );
    _mm256_shuffle_epi8(
        _mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(k as i32)),
        pick,
    )
}

/// The IQ4_NL levels of 32 nibble indices (bytes 0..16), as signed bytes.
#[inline(always)]
pub unsafe fn iq4nl_levels(idx: __m256i) -> __m256i {
    let t = _mm_loadu_si128(dejavu_backend_api::quant::KVALUES_IQ4NL.as_ptr() as *const __m128i);
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx)
}

/// Lane j of the result is the sum of the 8 i32 lanes of `p[j]`: one reduction for the 8
/// sub-block dots of a 256-element super-block, so the float scaling happens once per super-block.
#[inline(always)]
pub unsafe fn hsum8_epi32(p: &[__m256i; 8]) -> __m256i {
    // hadd works per 128-bit lane: after two rounds, `ab` holds [p0..p3 low-lane sums | p0..p3
    // high-lane sums] and `cd` the same for p4..p7.
    let ab = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let cd = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256(ab, cd, 0x20),
        _mm256_permute2x128_si256(ab, cd, 0x31),
    )
}

/// `[a[0].d, ..., a[7].d]` and `[a[0].s, ..., a[7].s]` of 8 consecutive activation blocks
/// (eight 8-byte loads and shuffles: cheaper than two gathers on the CPUs measured).
#[inline(always)]
pub unsafe fn act_d_s_x8(a: &[dejavu_backend_api::quant::BlockQ8A]) -> (__m256, __m256) {
    let a = &a[..8];
    let pair = |j: usize| _mm_movelh_ps(act_scales(&a[j]), act_scales(&a[j + 1]));
    // lo = [d0 s0 d1 s1 | d4 s4 d5 s5], hi = [d2 s2 d3 s3 | d6 s6 d7 s7]
    let lo = _mm256_set_m128(pair(4), pair(0));
    let hi = _mm256_set_m128(pair(6), pair(2));
    (
        _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi),
        _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi),
    )
}

/// How far ahead of the block being read the x86 kernels prefetch weight bytes. Decode streams
/// each matrix once, and the hardware prefetcher alone leaves the loop waiting on DRAM.
pub const PREFETCH_BYTES: usize = 4096;

/// Prefetch the cache line `PREFETCH_BYTES` past `p` (a hint: never faults, even past the end).
#[inline(always)]
pub unsafe fn prefetch_ahead<T>(p: *const T) {
    _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(PREFETCH_BYTES));
}

/// Prefetch every cache line of a `T` (a block wider than a line, such as a K-quant
/// super-block) `PREFETCH_BYTES` ahead: one hint per block would leave most lines to the
/// hardware prefetcher.
#[inline(always)]
pub unsafe fn prefetch_block_ahead<T>(p: *const T) {
    let mut off = 0;
    while off < size_of::<T>() {
        prefetch_ahead((p as *const u8).wrapping_add(off));
        off += 64;
    }
}

/// `[d_a, s_a, 0, 0]` of an activation block, in one 8-byte load (`d` and `s` are adjacent).
#[inline(always)]
pub unsafe fn act_scales(a: &dejavu_backend_api::quant::BlockQ8A) -> __m128 {
    _mm_castpd_ps(_mm_load_sd(&a.d as *const f32 as *const f64))
}

/// Four f16 values starting at `p` (unaligned) as f32 lanes; reads 8 bytes.
#[inline(always)]
pub unsafe fn f16x2_at(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
}

/// Lane 1 of a 4-lane vector.
#[inline(always)]
pub unsafe fn lane1(v: __m128) -> f32 {
    _mm_cvtss_f32(_mm_movehdup_ps(v))
}

/// An f16 scale at `p` (the first field of a block) as `[d, d, _, _]`: one 4-byte load, one
/// conversion, one duplicate (reads 2 bytes past the scale, inside the block).
#[inline(always)]
pub unsafe fn f16_dup_at(p: *const u8) -> __m128 {
    _mm_moveldup_ps(f16x2_at(p))
}

/// A 32-element weight block as each 32-wide kernel file defines it: its scales and the integer
/// part of its dot with an activation block; [`pair_loop`] does the float work shared by all.
/// The block's value is `d_w * (integer dot) * d_a + OFF_SCALE * o_w * s_a`.
pub trait Step32 {
    /// Multiplies the offset term (0: no offset term).
    const OFF_SCALE: f32;
    /// `[d_w, o_w, _, _]`: the block scale, and the factor of the offset term (the min for Q4_1,
    /// `d_w` for the symmetric formats).
    unsafe fn scales(&self) -> __m128;
    /// The block's quants dotted with the activation quants `qa`, as 8 i32 lanes.
    unsafe fn idot<const VNNI: bool>(&self, qa: __m256i) -> __m256i;
}

/// One block: `acc += d_w d_a (q . qa)` lane-wise; lane 1 of `off` += `o_w s_a`.
#[inline(always)]
pub(crate) unsafe fn step<B: Step32, const VNNI: bool>(
    b: &B,
    a: &dejavu_backend_api::quant::BlockQ8A,
    acc: &mut __m256,
    off: &mut __m128,
) {
    let sc = _mm_mul_ps(b.scales(), act_scales(a));
    let p = _mm256_cvtepi32_ps(b.idot::<VNNI>(load_i8x32(&a.qs)));
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(sc), p, *acc);
    if B::OFF_SCALE != 0.0 {
        *off = _mm_add_ps(*off, sc);
    }
}

/// The loop shared by the 32-wide kernels: blocks in pairs onto two accumulator sets (even and
/// odd blocks, kept in registers, so consecutive blocks do not wait on each other's
/// multiply-add), with a weight prefetch per pair if `PF`. Inlined into each tier's `#[target_feature]`
/// function, so the intrinsics of each block's methods compile for that tier.
#[inline(always)]
pub unsafe fn pair_loop<B: Step32, const VNNI: bool, const PF: bool>(
    w: &[B],
    act: &[dejavu_backend_api::quant::BlockQ8A],
) -> f32 {
    let (z, z4) = (_mm256_setzero_ps(), _mm_setzero_ps());
    let (mut acc0, mut acc1, mut off0, mut off1) = (z, z, z4, z4);
    let n = w.len().min(act.len());
    let mut i = 0;
    while i + 1 < n {
        if PF {
            prefetch_ahead(&w[i]);
        }
        step::<B, VNNI>(&w[i], &act[i], &mut acc0, &mut off0);
        step::<B, VNNI>(&w[i + 1], &act[i + 1], &mut acc1, &mut off1);
        i += 2;
    }
    if i < n {
        step::<B, VNNI>(&w[i], &act[i], &mut acc0, &mut off0);
    }
    let total = hsum_ps(_mm256_add_ps(acc0, acc1));
    if B::OFF_SCALE == 0.0 {
        total
    } else {
        total + B::OFF_SCALE * lane1(_mm_add_ps(off0, off1))
    }
}

/// `e^x` in 8 lanes, Cephes' `expf` (as `wide`'s `exp`): `x = n ln 2 + r` with `|r| <= ln 2 / 2`
/// (ln 2 in two parts, so `r` is exact), a degree-5 polynomial in `r`, times `2^n` built in the
/// exponent bits. Within 2 ulp of `e^x` over [-87.3, 88]; 0 below -87.3 (`-inf` too, where the
/// true value is under f32's normal range), `e^88` above 88; NaN stays NaN.
#[inline(always)]
pub unsafe fn exp_ps(x: __m256) -> __m256 {
    let lo = _mm256_set1_ps(-87.336_54);
    // max/min return their second operand when either is NaN: NaN goes through.
    let xc = _mm256_min_ps(_mm256_set1_ps(88.0), _mm256_max_ps(lo, x));
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        xc,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvttps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, lo), v)
}

/// Least span of strided rows (first row to last, in bytes) that the attention kernels
/// prefetch: below it a KV group's rows stay in L2 between the heads that read them, and the
/// hints cost more than they bring (measured on SmolLM2, one row: at 512 positions, 196 KiB a
/// group, 4.12-4.28 ms a step without against 4.40-4.73 with).
pub const PREFETCH_SPAN: usize = 256 << 10;

/// An f32 vector of the x86 tiers (256 or 512 bits), for kernels written once for both widths.
pub trait Floats: Copy {
    const LANES: usize;
    unsafe fn loadu(p: *const f32) -> Self;
    unsafe fn storeu(p: *mut f32, v: Self);
    unsafe fn splat(v: f32) -> Self;
    /// `a * b + c`, fused.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
}

impl Floats for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn loadu(p: *const f32) -> Self {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn storeu(p: *mut f32, v: Self) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
}

/// AVX-512F.
impl Floats for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn loadu(p: *const f32) -> Self {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn storeu(p: *mut f32, v: Self) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
}

/// A cached key or value element as the x86 attention kernels load it: f32, or f16 widened
/// by F16C. Inlined into the tier's `#[target_feature]` bodies.
pub trait Lanes: super::RowElem + bytemuck::Pod {
    /// The 8 values at `p` as f32 lanes (AVX2, F16C).
    unsafe fn x8(p: *const Self) -> __m256;
    /// The 16 values at `p` (AVX-512F).
    unsafe fn x16(p: *const Self) -> __m512;
    /// The 8 values at `p0` in the low half and the 8 at `p1` in the high half (AVX-512F).
    unsafe fn x8_pair(p0: *const Self, p1: *const Self) -> __m512;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn x8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn x16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn x8_pair(p0: *const f32, p1: *const f32) -> __m512 {
        let (lo, hi) = (
            _mm256_castps_pd(Self::x8(p0)),
            _mm256_castps_pd(Self::x8(p1)),
        );
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi))
    }
}

impl Lanes for half::f16 {
    #[inline(always)]
    unsafe fn x8(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn x16(p: *const half::f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn x8_pair(p0: *const half::f16, p1: *const half::f16) -> __m512 {
        let (lo, hi) = (
            _mm_loadu_si128(p0 as *const __m128i),
            _mm_loadu_si128(p1 as *const __m128i),
        );
        _mm512_cvtph_ps(_mm256_set_m128i(hi, lo))
    }
}

/// Do `rows` rows of `T`, `stride` elements apart, span [`PREFETCH_SPAN`] or more?
pub fn spans_far<T>(rows: usize, stride: usize) -> bool {
    rows * stride * size_of::<T>() >= PREFETCH_SPAN
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`hsums`] of 1 to 8 vectors equals [`hsum_ps`] of each bit for bit, on values whose
    /// sums round differently in other orders.
    #[test]
    fn hsums_equal_hsum_ps() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let vals = crate::kernels::testutil::random_f32(64, 9);
        let v: Vec<f32> = vals
            .iter()
            .enumerate()
            .map(|(i, x)| x * 10f32.powi((i % 7) as i32 - 3))
            .collect();
        // SAFETY: AVX2 is present (checked above).
        unsafe { check_all(&v) }

        #[target_feature(enable = "avx2")]
        unsafe fn check_all(v: &[f32]) {
            // Every load reads 8 of `v`'s 64 values.
            let vec = |t: usize| _mm256_loadu_ps(v[8 * t..].as_ptr());
            macro_rules! check {
                ($($t:literal)*) => {$(
                    let vs: [__m256; $t] = std::array::from_fn(vec);
                    let mut out = [0f32; $t];
                    hsums(&vs, &mut out);
                    for (t, o) in out.iter().enumerate() {
                        assert_eq!(o.to_bits(), hsum_ps(vs[t]).to_bits(), "{} of {}", t, $t);
                    }
                )*};
            }
            check!(1 2 3 4 5 6 7 8);
        }
    }
}
