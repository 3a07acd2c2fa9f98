//! [`super::axpy_blocks`] with the kept inputs rounded to 8 bits, for `vpdpbusd` (AVX-512) and
//! `vpmaddubsw` (AVX2) and NEON's `smlal` (both aarch64 tiers): the SIMD tiers' kernels of input
//! sparsity (TEAL, WINA) over the input-block layout.
//!
//! Per block of 32 inputs, with `amax` the largest |x| kept: `sx = amax / 127` and, for the j-th
//! kept input, `xq[j] = round_ties_even(x * (127 / amax))` ([`quantize`]). Per output `o`,
//! `t = sum_j xq[j] q[kept[j]][o]` in exact integers, then `y[o] = d[o] * (sx * t) + (off[o] *
//! (sx * sum_j xq[j]) + y[o])` (two fused multiply-adds; `off` as in `axpy_blocks`). The rounding
//! of x is the dense path's (activations in 8 bits per block of 32, as `quantize_act`'s): its
//! error per term is at most `|x| / 254` of the kept block's largest input. A block whose kept
//! inputs are not all finite, or all zero, takes the f32 kernel (a NaN is not dropped).
//!
//! The AVX-512 VNNI loop takes the kept rows 4 at a time: their quants of a tile of 64 outputs
//! are interleaved in registers (two rounds of byte and word unpacks give 4 bytes per output,
//! one from each row), and one `vpdpbusd` per 16 outputs multiplies them with the 4 inputs'
//! bytes. A fifth to eighth row repeats a kept row with a zero input. Q8_0's signed quants enter
//! `vpdpbusd`'s unsigned operand as `q + 128`, the excess `128 * sum xq` taken off once. The 4-bit
//! types' tile holds outputs 0-15 and 32-47 (low nibbles) before 16-31 and 48-63 (high): the
//! sums are put back in output order once per tile. The AVX2 and NEON loops are described at
//! [`avx2_impl`] and `neon_impl`.
use super::axpy_blocks::{self, AxpyBlocksFn};
use crate::isa::Isa;
use dejavu_backend_api::quant::QuantType;

/// `$f::<T>(args)` with `T` the const of `q`'s type: each kernel built once per type, so that
/// no test of the type is left in its loops.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! by_type {
    ($f:ident, $q:expr, $($a:expr),*) => {
        match $q {
            QuantType::Q8_0 => $f::<TYPE_Q8_0>($($a),*),
            QuantType::Q4_0 => $f::<TYPE_Q4_0>($($a),*),
            QuantType::Q4_1 => $f::<TYPE_Q4_1>($($a),*),
            QuantType::Q5_0 => $f::<TYPE_Q5_0>($($a),*),
            QuantType::Q5_1 => $f::<TYPE_Q5_1>($($a),*),
            QuantType::Q4K => $f::<TYPE_Q4K>($($a),*),
            QuantType::Q5K => $f::<TYPE_Q5K>($($a),*),
            _ => unreachable!("axpy_blocks::check admits the input-block types only"),
        }
    };
}

/// The input-block types as the kernel's const parameter.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q8_0: u8 = 0;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q4_0: u8 = 1;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q4_1: u8 = 2;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q5_0: u8 = 3;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q5_1: u8 = 4;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q4K: u8 = 5;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const TYPE_Q5K: u8 = 6;

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const fn type_of(t: u8) -> QuantType {
    match t {
        TYPE_Q8_0 => QuantType::Q8_0,
        TYPE_Q4_0 => QuantType::Q4_0,
        TYPE_Q4_1 => QuantType::Q4_1,
        TYPE_Q5_0 => QuantType::Q5_0,
        TYPE_Q5_1 => QuantType::Q5_1,
        TYPE_Q4K => QuantType::Q4K,
        _ => QuantType::Q5K,
    }
}

/// The x86 and NEON tiers' `axpy_blocks`; other tiers keep their f32 kernels.
pub fn select(isa: Isa) -> Option<AxpyBlocksFn> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(avx2),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::Dotprod => Some(neon),
        _ => None,
    }
}

/// The x86 and NEON tiers' kernels over inputs [`quantize`]d once per product (not once per
/// thread's share of the outputs); `None` on other tiers.
pub fn select_q8(isa: Isa) -> Option<AxpyBlocksQ8Fn> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(avx512_q8),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(avx2_q8),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::Dotprod => Some(neon_q8),
        _ => None,
    }
}

/// `(qtype, block, cols, kept, inputs, lo, y)`: [`scalar`] with the block's kept inputs
/// already in 8 bits (`inputs = quantize(x, kept)`, which was `Some`); the rest as
/// [`AxpyBlocksFn`].
pub type AxpyBlocksQ8Fn = fn(QuantType, &[u8], usize, &[u8], &Q8Inputs, usize, &mut [f32]);

/// A block's kept inputs in 8 bits, in `kept` order: scale `sx`, quants `xq` and their sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Q8Inputs {
    pub sx: f32,
    pub xq: [i8; 32],
    pub sum: i32,
}

/// 1.5 * 2^23: `(v + MAGIC) - MAGIC` rounds `|v| < 2^22` to an integer, ties to even (the
/// default rounding of f32 addition), as `f32::round_ties_even` does, without a call to `rintf`
/// on targets without SSE4.1's `roundps` (the baseline x86-64 this function is built for).
const MAGIC: f32 = 12_582_912.0;

/// The kept inputs of a block in 8 bits, in `kept` order; `None` when they are not all finite
/// or all zero (the caller takes the f32 kernel).
pub fn quantize(x: &[f32; 32], kept: &[u8]) -> Option<Q8Inputs> {
    let amax = kept.iter().fold(0f32, |m, &r| m.max(x[r as usize].abs()));
    let finite = kept.iter().all(|&r| x[r as usize].is_finite());
    if !finite || amax == 0.0 {
        return None;
    }
    let inv = 127.0 / amax;
    let mut xq = [0i8; 32];
    let mut sum = 0;
    for (j, &r) in kept.iter().enumerate() {
        // |x * inv| <= 127 (up to one rounding of the product): well inside MAGIC's range.
        let v = ((x[r as usize] * inv + MAGIC) - MAGIC) as i8;
        xq[j] = v;
        sum += v as i32;
    }
    Some(Q8Inputs {
        sx: amax / 127.0,
        xq,
        sum,
    })
}

/// The definition.
pub fn scalar(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    axpy_blocks::check(q, block, cols, kept, lo, y);
    let Some(Q8Inputs { sx, xq, sum }) = quantize(x, kept) else {
        return axpy_blocks::scalar(q, block, cols, kept, x, lo, y);
    };
    // The quants are small integers, exact in f32.
    let quant = |r: usize, o: usize| axpy_blocks::quant(q, block, cols, r, o) as i32;
    let so = sx * sum as f32;
    for (j, yj) in y.iter_mut().enumerate() {
        let o = lo + j;
        let t: i32 = (kept.iter().zip(xq))
            .map(|(&r, v)| v as i32 * quant(r as usize, o))
            .sum();
        let (d, off) = axpy_blocks::scale_off(q, block, cols, o);
        *yj = d.mul_add(sx * t as f32, off.mul_add(so, *yj));
    }
}

/// A tier's two entries: `$f32_in` over f32 inputs, quantized here (the tier's f32 kernel
/// `$fallback` where they are not all finite or all zero), and `$q8_in` over inputs already
/// quantized; both check the extents and run `$imp` for the block's type.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! entries {
    ($f32_in:ident, $q8_in:ident, $imp:ident, $fallback:expr) => {
        fn $f32_in(
            q: QuantType,
            block: &[u8],
            cols: usize,
            kept: &[u8],
            x: &[f32; 32],
            lo: usize,
            y: &mut [f32],
        ) {
            axpy_blocks::check(q, block, cols, kept, lo, y);
            let Some(xi) = quantize(x, kept) else {
                return ($fallback)(q, block, cols, kept, x, lo, y);
            };
            // SAFETY: handed out by `select` for this tier only (its CPU features present);
            // extents checked above, and `quantize` gave `Some`, so `kept` is not empty.
            unsafe { by_type!($imp, q, block, cols, kept, &xi, lo, y) }
        }

        fn $q8_in(
            q: QuantType,
            block: &[u8],
            cols: usize,
            kept: &[u8],
            xi: &Q8Inputs,
            lo: usize,
            y: &mut [f32],
        ) {
            axpy_blocks::check(q, block, cols, kept, lo, y);
            assert!(
                !kept.is_empty(),
                "axpy_blocks: quantized inputs of no kept row"
            );
            // SAFETY: handed out by `select_q8` for this tier only (its CPU features
            // present); extents checked above, `kept` not empty.
            unsafe { by_type!($imp, q, block, cols, kept, xi, lo, y) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
entries!(avx512, avx512_q8, avx512_impl, axpy_blocks::avx512);
#[cfg(target_arch = "x86_64")]
entries!(avx2, avx2_q8, avx2_impl, axpy_blocks::select(Isa::Avx2));
#[cfg(target_arch = "aarch64")]
entries!(neon, neon_q8, neon_impl, axpy_blocks::generic);

/// The starts of the kept rows' quants and fifth-bit planes (the 5-bit types; the block's
/// start otherwise, never read) in a block, slot `j` for `kept[j]`; the slots past `kept` hold
/// `kept[0]`'s, for the padding of a short last group. `kept` is not empty and its rows are in
/// the block (`axpy_blocks::check`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn row_starts(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
) -> ([*const u8; 32], [*const u8; 32]) {
    let base = block.as_ptr();
    let row = if q == QuantType::Q8_0 { cols } else { cols / 2 };
    let quants = axpy_blocks::scale_bytes(q, cols);
    let five = axpy_blocks::five_bit(q);
    // `wrapping_add`: offsets inside the block, so no pointer leaves it.
    let start = |r: u8| base.wrapping_add(quants + r as usize * row);
    let high = |r: u8| match five {
        true => base.wrapping_add(axpy_blocks::high_bits_at(q, cols) + r as usize * cols / 8),
        false => base,
    };
    let (mut rows, mut highs) = ([start(kept[0]); 32], [high(kept[0]); 32]);
    for (j, &r) in kept.iter().enumerate() {
        (rows[j], highs[j]) = (start(r), high(r));
    }
    (rows, highs)
}

/// The AVX2 loop: tiles of 32 outputs, the kept rows 2 at a time. A pair's quants are
/// interleaved (one byte unpack per 16 outputs) and `vpmaddubsw` multiplies them with the
/// pair's 2 input bytes: one 16-bit sum per output, at most 2 * 128 * 127 in magnitude (Q8_0's
/// signed quants enter as |q| against the input with q's sign, `vpsignb`), widened to 32 bits
/// at once by shifts (even outputs, odd outputs) and added. A short last pair repeats row
/// kept[0] with input 0. The sums are exact integers, so the result is the definition's.
///
/// # Safety
/// The caller checked the extents (`axpy_blocks::check`), `kept` is not empty, and the CPU
/// has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl<const T: u8>(
    block: &[u8],
    cols: usize,
    kept: &[u8],
    &Q8Inputs { sx, ref xq, sum }: &Q8Inputs,
    lo: usize,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let q = const { type_of(T) };
    let q8 = q == QuantType::Q8_0;
    let shift = if q8 { 0 } else { 1 };
    let five = axpy_blocks::five_bit(q);
    // A short last pair repeats row kept[0] with input 0.
    let pairs = kept.len().div_ceil(2);
    let (rows, highs) = row_starts(q, block, cols, kept);
    let mut x2 = [0i16; 16];
    for (j, &v) in xq.iter().enumerate().take(kept.len()) {
        x2[j / 2] |= (((v as u8) as u16) << (8 * (j % 2))) as i16;
    }
    let nib = _mm256_set1_epi8(0x0F);
    // A 32-bit word of fifth bits to bytes: byte i takes bit i % 8 of the word's byte i / 8.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let sixteen = _mm256_set1_epi8(16);
    let end = lo + y.len();
    let (sxv, so) = (_mm256_set1_ps(sx), _mm256_set1_ps(sx * sum as f32));
    // Row j's 32 quants of the tile at `g`, one byte an output in output order.
    let load = |j: usize, g: usize| -> __m256i {
        let p = rows[j].add(g >> shift);
        if q8 {
            return _mm256_loadu_si256(p as *const __m256i);
        }
        let w = _mm_loadu_si128(p as *const __m128i);
        let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(w, 4), w), nib);
        if !five {
            return v;
        }
        let hw = (highs[j].add(g / 8) as *const u32).read_unaligned();
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(hw as i32), spread);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        _mm256_add_epi8(v, _mm256_and_si256(set, sixteen))
    };
    for g in (lo..end).step_by(32) {
        // acc[0]: outputs 0-7 and 16-23 even, acc[1] odd; acc[2], acc[3]: 8-15 and 24-31.
        let mut acc = [_mm256_setzero_si256(); 4];
        if (g - lo).is_multiple_of(64) && g + AHEAD_OUTPUTS < end {
            for &r in rows.iter().take(kept.len()) {
                _mm_prefetch::<_MM_HINT_T0>(r.add((g + AHEAD_OUTPUTS) >> shift) as *const i8);
            }
        }
        for (pi, xp) in x2.iter().enumerate().take(pairs) {
            let xb = _mm256_set1_epi16(*xp);
            let (v0, v1) = (load(2 * pi, g), load(2 * pi + 1, g));
            let halves = [_mm256_unpacklo_epi8(v0, v1), _mm256_unpackhi_epi8(v0, v1)];
            for (h, v) in halves.into_iter().enumerate() {
                let m = match q8 {
                    true => _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xb, v)),
                    false => _mm256_maddubs_epi16(v, xb),
                };
                let even = _mm256_srai_epi32(_mm256_slli_epi32(m, 16), 16);
                acc[2 * h] = _mm256_add_epi32(acc[2 * h], even);
                acc[2 * h + 1] = _mm256_add_epi32(acc[2 * h + 1], _mm256_srai_epi32(m, 16));
            }
        }
        // Back in output order: lanes of (even, odd) pairs, then the 128-bit halves.
        let a = _mm256_unpacklo_epi32(acc[0], acc[1]); // 0-3, 16-19
        let b = _mm256_unpackhi_epi32(acc[0], acc[1]); // 4-7, 20-23
        let c = _mm256_unpacklo_epi32(acc[2], acc[3]); // 8-11, 24-27
        let d = _mm256_unpackhi_epi32(acc[2], acc[3]); // 12-15, 28-31
        let t = [
            _mm256_permute2x128_si256::<0x20>(a, b), // 0-7
            _mm256_permute2x128_si256::<0x20>(c, d), // 8-15
            _mm256_permute2x128_si256::<0x31>(a, b), // 16-23
            _mm256_permute2x128_si256::<0x31>(c, d), // 24-31
        ];
        if super::block_tables::two_level(q) {
            // The two-level tables decoded once for the tile.
            let scales = super::block_tables::k_scales32(block, cols, g);
            for (k, (tk, (d, off))) in t.into_iter().zip(scales).enumerate() {
                let yp = y.as_mut_ptr().add(g + 8 * k - lo);
                let tf = _mm256_mul_ps(_mm256_cvtepi32_ps(tk), sxv);
                let v = _mm256_fmadd_ps(d, tf, _mm256_fmadd_ps(off, so, _mm256_loadu_ps(yp)));
                _mm256_storeu_ps(yp, v);
            }
            continue;
        }
        for (k, tk) in t.into_iter().enumerate() {
            let o = g + 8 * k;
            let tf = _mm256_mul_ps(_mm256_cvtepi32_ps(tk), sxv);
            add_scaled8::<T>(block, cols, o, tf, so, y.as_mut_ptr().add(o - lo));
        }
    }
}

/// `y[..8] = d * t + (off * s + y)` for the 8 outputs from `o` of `block`, as
/// `axpy_blocks::add_scaled16` (the definition's two fused multiply-adds).
///
/// # Safety
/// `o` a multiple of 8, `o + 8 <= cols`, 8 floats at `y`, the block's extent checked; AVX2,
/// FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_scaled8<const T: u8>(
    block: &[u8],
    cols: usize,
    o: usize,
    t: std::arch::x86_64::__m256,
    s: std::arch::x86_64::__m256,
    y: *mut f32,
) {
    use std::arch::x86_64::*;
    let (d, off) = super::block_tables::scales8(const { type_of(T) }, block, cols, o);
    let v = _mm256_fmadd_ps(d, t, _mm256_fmadd_ps(off, s, _mm256_loadu_ps(y)));
    _mm256_storeu_ps(y, v);
}

/// A tile's fifth bits (bit `i`: output `i`) in the order of the 4-bit types' register: bytes
/// 0-15 hold outputs 0-15, 16-31 outputs 32-47, 32-47 outputs 16-31, 48-63 outputs 48-63.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn register_order(w: u64) -> u64 {
    (w & 0xFFFF_0000_0000_FFFF) | ((w >> 16) & 0xFFFF_0000) | ((w << 16) & 0xFFFF_0000_0000)
}

/// Outputs whose fifth bits fill a cache line (64 bytes of a row's bit plane).
#[cfg(target_arch = "x86_64")]
const HIGH_LINE: usize = 512;

/// Outputs of a tile ahead that the loop prefetches for the rows it reads (the first ones of a
/// block were fetched by `prefetch_first`).
#[cfg(target_arch = "x86_64")]
const AHEAD_OUTPUTS: usize = axpy_blocks::FIRST_OUTPUTS;

/// # Safety
/// The caller checked the extents (`axpy_blocks::check`), `kept` is not empty, and the CPU
/// has AVX-512 with VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn avx512_impl<const T: u8>(
    block: &[u8],
    cols: usize,
    kept: &[u8],
    &Q8Inputs { sx, ref xq, sum }: &Q8Inputs,
    lo: usize,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let q = const { type_of(T) };
    let q8 = q == QuantType::Q8_0;
    // Row bytes per output: 1 (Q8_0) or 1/2.
    let shift = if q8 { 0 } else { 1 };
    let five = axpy_blocks::five_bit(q);
    // The kept rows in groups of 4 (a short last group repeats row kept[0] with input 0); each
    // group's 4 input bytes as one 32-bit lane.
    let groups = kept.len().div_ceil(4);
    let (rows, highs) = row_starts(q, block, cols, kept);
    let mut x4 = [0i32; 8];
    for (j, &v) in xq.iter().enumerate().take(kept.len()) {
        x4[j / 4] |= ((v as u8) as i32) << (8 * (j % 4));
    }
    let nib = _mm256_set1_epi8(0x0F);
    let flip = _mm512_set1_epi8(-128);
    let sixteen = _mm512_set1_epi8(16);
    let end = lo + y.len();
    let (sxv, so) = (_mm512_set1_ps(sx), _mm512_set1_ps(sx * sum as f32));
    let excess = _mm512_set1_epi32(128 * sum);
    for g in (lo..end).step_by(64) {
        // 32 or 64 outputs; bytes of this tile in a row: Q8_0 64 (or 32), 4-bit 32 (or 16).
        // The loads past them are masked (they do not fault past the block).
        let n = (end - g).min(64);
        let mask: u64 = if n == 64 { !0 } else { (1u64 << 32) - 1 };
        let mut acc = [_mm512_setzero_si512(); 4];
        let ahead = g + AHEAD_OUTPUTS < end;
        // The fifth bits: a line holds 512 outputs' of a row; fetch the next one (waiting on
        // them took 28% of this kernel's samples on Qwen2.5's Q5_0).
        let high_ahead = five && (g - lo).is_multiple_of(HIGH_LINE) && g + HIGH_LINE < end;
        for (gi, xg) in x4.iter().enumerate().take(groups) {
            let xb = _mm512_set1_epi32(*xg);
            // A loop, not a closure: a closure would not inherit this function's features.
            let mut v = [_mm512_setzero_si512(); 4];
            for (k, vk) in v.iter_mut().enumerate() {
                let p = rows[4 * gi + k].add(g >> shift);
                if ahead {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(AHEAD_OUTPUTS >> shift) as *const i8);
                }
                if high_ahead {
                    let at = highs[4 * gi + k].add((g + HIGH_LINE) / 8);
                    _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
                }
                *vk = if q8 {
                    _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, p as *const i8), flip)
                } else {
                    let w = _mm256_maskz_loadu_epi8(mask as u32 >> (32 - n / 2), p as *const i8);
                    let l = _mm256_and_si256(w, nib);
                    let h = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
                    let v = _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
                    match five {
                        // Register byte j holds output `order(j)`: its fifth bit, as 16 (a
                        // nibble plus 16 is the nibble with bit 4 set).
                        true => {
                            // Inside the block: `check` saw the plane's extent.
                            let hw =
                                (highs[4 * gi + k].add(g / 64 * 8) as *const u64).read_unaligned();
                            _mm512_mask_add_epi8(v, register_order(hw), v, sixteen)
                        }
                        false => v,
                    }
                };
            }
            let a = _mm512_unpacklo_epi8(v[0], v[1]);
            let b = _mm512_unpackhi_epi8(v[0], v[1]);
            let c = _mm512_unpacklo_epi8(v[2], v[3]);
            let d = _mm512_unpackhi_epi8(v[2], v[3]);
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_unpacklo_epi16(a, c), xb);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_unpackhi_epi16(a, c), xb);
            acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_unpacklo_epi16(b, d), xb);
            acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_unpackhi_epi16(b, d), xb);
        }
        // acc[k]'s 128-bit lane l holds tile positions 16 l + 4 k .. + 4: transpose the 4x4
        // lanes so that p[l] holds positions 16 l .. 16 l + 16.
        let t0 = _mm512_shuffle_i32x4::<0x44>(acc[0], acc[1]);
        let t1 = _mm512_shuffle_i32x4::<0xEE>(acc[0], acc[1]);
        let t2 = _mm512_shuffle_i32x4::<0x44>(acc[2], acc[3]);
        let t3 = _mm512_shuffle_i32x4::<0xEE>(acc[2], acc[3]);
        let p = [
            _mm512_shuffle_i32x4::<0x88>(t0, t2),
            _mm512_shuffle_i32x4::<0xDD>(t0, t2),
            _mm512_shuffle_i32x4::<0x88>(t1, t3),
            _mm512_shuffle_i32x4::<0xDD>(t1, t3),
        ];
        // Position block l's first output: Q8_0 in order; 4-bit: low nibbles of both groups,
        // then high nibbles.
        let first = if q8 { [0, 16, 32, 48] } else { [0, 32, 16, 48] };
        for (pl, f) in p.into_iter().zip(first) {
            if f >= n {
                continue;
            }
            let o = g + f;
            let t = if q8 { _mm512_sub_epi32(pl, excess) } else { pl };
            let tf = _mm512_mul_ps(_mm512_cvtepi32_ps(t), sxv);
            axpy_blocks::add_scaled16(q, block, cols, o, tf, so, y.as_mut_ptr().add(o - lo));
        }
    }
}

/// The NEON loop (both aarch64 tiers; base ARMv8 instructions): tiles of 32 outputs; each kept
/// row's quants of the tile (nibbles, plus 16 where the fifth bit is set; Q8_0's bytes) are
/// multiplied by the row's input byte and added into 16-bit lanes (`smlal`), then widened into
/// 32-bit sums every 8 rows (every 2 for Q8_0): |xq * q| is at most 127 * 31 for the 4- and
/// 5-bit types and 128 * 127 for Q8_0, so no 16-bit sum overflows. The sums are exact
/// integers, and the result is the definition's two fused multiply-adds (`fmla`) per output:
/// bit for bit the definition.
///
/// # Safety
/// The caller checked the extents (`axpy_blocks::check`) and `kept` is not empty; NEON is
/// part of every aarch64 CPU.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn neon_impl<const T: u8>(
    block: &[u8],
    cols: usize,
    kept: &[u8],
    &Q8Inputs { sx, ref xq, sum }: &Q8Inputs,
    lo: usize,
    y: &mut [f32],
) {
    use super::arm::f16x4;
    use std::arch::aarch64::*;
    let q = const { type_of(T) };
    let base = block.as_ptr();
    let (q8, five) = (q == QuantType::Q8_0, axpy_blocks::five_bit(q));
    let flush = if q8 { 2 } else { 8 };
    let (rows, highs) = row_starts(q, block, cols, kept);
    let (sxv, so) = (vdupq_n_f32(sx), vdupq_n_f32(sx * sum as f32));
    // Byte i of a half takes bit i % 8 of byte i / 8 of its 16 bits.
    let bit: [u8; 16] = std::array::from_fn(|i| 1 << (i % 8));
    let bit = vld1q_u8(bit.as_ptr());
    let (spread_lo, spread_hi): ([u8; 16], [u8; 16]) = (
        std::array::from_fn(|i| (i / 8) as u8),
        std::array::from_fn(|i| 2 + (i / 8) as u8),
    );
    let (spread_lo, spread_hi) = (vld1q_u8(spread_lo.as_ptr()), vld1q_u8(spread_hi.as_ptr()));
    // Row j's quants of outputs g..g + 16 and g + 16..g + 32, in output order.
    let load = |j: usize, g: usize| -> [int8x16_t; 2] {
        if q8 {
            let p = rows[j].add(g) as *const i8;
            return [vld1q_s8(p), vld1q_s8(p.add(16))];
        }
        let v = vld1q_u8(rows[j].add(g / 2));
        let mut n = [vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v)];
        if five {
            let hw = vreinterpretq_u8_u32(vdupq_n_u32(
                (highs[j].add(g / 8) as *const u32).read_unaligned(),
            ));
            for (h, spread) in [spread_lo, spread_hi].into_iter().enumerate() {
                let set = vtstq_u8(vqtbl1q_u8(hw, spread), bit);
                n[h] = vaddq_u8(n[h], vandq_u8(set, vdupq_n_u8(16)));
            }
        }
        [vreinterpretq_s8_u8(n[0]), vreinterpretq_s8_u8(n[1])]
    };
    let scale = |o: usize| f16x4(base.add(2 * o));
    for g in (lo..lo + y.len()).step_by(32) {
        let mut t = [vdupq_n_s32(0); 8];
        let mut p = [vdupq_n_s16(0); 4];
        for (j, &xj) in xq.iter().enumerate().take(kept.len()) {
            let xb = vdupq_n_s8(xj);
            for (h, v) in load(j, g).into_iter().enumerate() {
                p[2 * h] = vmlal_s8(p[2 * h], vget_low_s8(v), vget_low_s8(xb));
                p[2 * h + 1] = vmlal_high_s8(p[2 * h + 1], v, xb);
            }
            if (j + 1) % flush == 0 || j + 1 == kept.len() {
                for (k, pk) in p.iter_mut().enumerate() {
                    t[2 * k] = vaddw_s16(t[2 * k], vget_low_s16(*pk));
                    t[2 * k + 1] = vaddw_high_s16(t[2 * k + 1], *pk);
                    *pk = vdupq_n_s16(0);
                }
            }
        }
        for (k, tk) in t.into_iter().enumerate() {
            let o = g + 4 * k;
            let (d, off) = match q {
                // Both levels of scales, as the definition combines them.
                QuantType::Q4K | QuantType::Q5K => {
                    let both: [(f32, f32); 4] =
                        std::array::from_fn(|i| axpy_blocks::scale_off(q, block, cols, o + i));
                    let (d, off) = (both.map(|v| v.0), both.map(|v| v.1));
                    (vld1q_f32(d.as_ptr()), vld1q_f32(off.as_ptr()))
                }
                QuantType::Q4_1 | QuantType::Q5_1 => (scale(o), scale(cols + o)),
                QuantType::Q4_0 => (scale(o), vmulq_n_f32(scale(o), -8.0)),
                QuantType::Q5_0 => (scale(o), vmulq_n_f32(scale(o), -16.0)),
                _ => (scale(o), vdupq_n_f32(0.0)),
            };
            let yp = y.as_mut_ptr().add(o - lo);
            let inner = vfmaq_f32(vld1q_f32(yp), off, so);
            let tf = vmulq_f32(vcvtq_f32_s32(tk), sxv);
            vst1q_f32(yp, vfmaq_f32(inner, d, tf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `quantize` rounds as `round_ties_even` does: on exact ties (amax 127, so `x * inv` is x
    /// itself, at every half from -127 to 127), and on random blocks.
    #[test]
    fn quantize_rounds_ties_to_even() {
        let want = |x: &[f32; 32], kept: &[u8]| {
            let amax = kept.iter().fold(0f32, |m, &r| m.max(x[r as usize].abs()));
            let inv = 127.0 / amax;
            let xq: Vec<i8> = (kept.iter())
                .map(|&r| (x[r as usize] * inv).round_ties_even() as i8)
                .collect();
            (amax / 127.0, xq)
        };
        let all: Vec<u8> = (0..32).collect();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for start in (-254..=222).step_by(16) {
            let mut x: [f32; 32] = std::array::from_fn(|i| (start + i as i32) as f32 * 0.5);
            x[0] = 127.0;
            let got = quantize(&x, &all).unwrap();
            let (sx, xq) = want(&x, &all);
            assert_eq!((got.sx, &got.xq[..]), (sx, &xq[..]), "ties from {start}");
            assert_eq!(got.sum, xq.iter().map(|&v| v as i32).sum::<i32>());
        }
        for _ in 0..2000 {
            let x: [f32; 32] = std::array::from_fn(|_| r.gen_range(-3f32..3.0));
            let kept: Vec<u8> = (0..32).filter(|_| r.gen_bool(0.6)).collect();
            if let Some(got) = quantize(&x, &kept) {
                let (sx, xq) = want(&x, &kept);
                assert_eq!((got.sx, &got.xq[..kept.len()]), (sx, &xq[..]));
            }
        }
    }

    /// The definition against the f32 kernel: the rounding of x costs at most half a step
    /// (`amax / 254`) per kept input, times |w|, summed; the AVX-512 and AVX2 tiers equal the
    /// definition bit for bit (the same integer sums, the same two fused multiply-adds), on
    /// ragged output ranges (tails of 32), kept sets of 1 to 32 rows (groups of 4 or pairs
    /// padded), every type; a NaN input and an all-zero block take the f32 path.
    #[test]
    fn the_tier_equals_the_definition_within_the_rounding_of_x() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for q in axpy_blocks::TYPES {
            for cols in [32usize, 64, 96, 352, 2112, 192, 2240] {
                if axpy_blocks::five_bit(q) && !cols.is_multiple_of(64) {
                    continue;
                }
                let (bytes, _) = axpy_blocks::random_block(q, cols, r.gen());
                let mut x: [f32; 32] = std::array::from_fn(|_| r.gen_range(-2f32..2.0));
                let cases = axpy_blocks::test_cases(&mut r, q, cols);
                for (kept, lo, n) in cases.iter().filter(|c| !c.0.is_empty()) {
                    let (kept, lo, n) = (kept, *lo, *n);
                    let y0: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
                    let mut want = y0.clone();
                    scalar(q, &bytes, cols, kept, &x, lo, &mut want);
                    let mut f32_ref = y0.clone();
                    axpy_blocks::scalar(q, &bytes, cols, kept, &x, lo, &mut f32_ref);
                    let amax = kept.iter().map(|&k| x[k as usize].abs()).fold(0., f32::max);
                    let mut deq = vec![0f32; cols];
                    let mut wsum = vec![0f32; n];
                    for &k in kept {
                        axpy_blocks::input_row(q, &bytes, cols, k as usize, &mut deq);
                        (wsum.iter_mut().zip(&deq[lo..])).for_each(|(s, w)| *s += w.abs());
                    }
                    for j in 0..n {
                        let tol = amax / 254.0 * wsum[j] * 1.01 + 1e-4 * (1.0 + want[j].abs());
                        let e = (want[j] - f32_ref[j]).abs();
                        assert!(e <= tol, "{q:?} {cols} {lo}+{j}: {e} > {tol}");
                    }
                    for isa in Isa::supported() {
                        if let Some(f) = select(isa) {
                            let mut got = y0.clone();
                            f(q, &bytes, cols, kept, &x, lo, &mut got);
                            assert_eq!(got, want, "{isa} {q:?} cols {cols} lo {lo} n {n}");
                        }
                    }
                }
                // Not finite, or all zero: the f32 kernel's result.
                for bad in [f32::NAN, 0.0] {
                    let kept: Vec<u8> = vec![2, 5];
                    (x[2], x[5]) = (bad, 0.0);
                    let mut want = vec![0.5f32; cols];
                    axpy_blocks::scalar(q, &bytes, cols, &kept, &x, 0, &mut want);
                    let mut got = vec![0.5f32; cols];
                    scalar(q, &bytes, cols, &kept, &x, 0, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{q:?} {bad}: the f32 kernel's sums"
                    );
                    let nans = |v: &[f32]| v.iter().filter(|f| f.is_nan()).count();
                    for isa in Isa::supported() {
                        if let Some(f) = select(isa) {
                            let mut t = vec![0.5f32; cols];
                            f(q, &bytes, cols, &kept, &x, 0, &mut t);
                            assert_eq!(nans(&t), nans(&want), "{isa} {q:?} {bad}");
                        }
                    }
                }
            }
        }
    }
}
