//! `y += sum over kept inputs r of x[r] * W[r]` over one block of an input-major matrix in the
//! input-block layout ([`dejavu_backend_api::RowLayout::InputBlocks`]): the inner step of input
//! sparsity (TEAL, WINA) on 8- and 4-bit weights, which keeps the file's own quantization (each
//! stored value is the source's, transposed).
//!
//! A block holds 32 inputs' rows of `cols` outputs: a table of the outputs' scales `d` (f16;
//! Q4_1 and Q5_1: then their offsets `m`), then the 32 rows of quants (Q8_0: `cols` signed bytes;
//! the 4- and 5-bit types: `cols / 2` bytes of low nibbles, each 32 outputs in 16 bytes as a
//! ggml block: byte `k` holds output `k` in its low nibble and `k + 16` in its high one); Q5_0
//! and Q5_1 then hold the 32 rows' fifth bits (`cols / 8` bytes a row, `cols` a multiple of 64:
//! little-endian 64-bit words, bit `i` of word `t` the fifth bit of output `64 t + i`). Value
//! `(r, o)` = `d[o] * q + m[o]` (Q4_1, Q5_1), `d[o] * (q - 8)` (Q4_0), `d[o] * (q - 16)` (Q5_0),
//! `d[o] * q` (Q8_0). Q4_K and Q5_K keep their 6-bit scales and mins under per-256 scales:
//! their tables are described in `block_tables`, their quants are Q4_1's and Q5_1's; their
//! `d[o]` and `off[o]` come from both levels.
//!
//! Per output: `t = sum_r x[r] q[r][o]` in f32 over the kept rows, then `y[o] += d[o] * t +
//! off[o] * S` with `S = sum_r x[r]` (`off = m`, `-8 d`, `-16 d`, or 0). [`scalar`] is the definition; the
//! x86 tiers keep `t` of a tile of outputs (128 on AVX-512, 64 on AVX2) in registers while each
//! kept row's quants of the tile are widened and multiply-added, prefetching the rows ahead.
pub(super) use super::block_tables::scale_off;
pub(super) use super::block_tables::table_bytes as scale_bytes;
pub use super::block_tables::{block, block_range, input_bytes, put_k4_scale_min, whole_inputs};
use crate::isa::Isa;
use dejavu_backend_api::quant::QuantType;
use half::f16;

/// `(qtype, block, cols, kept, x, lo, y)`: the block's bytes (`32 * qtype.row_bytes(cols)`),
/// the kept rows (`kept[j] < 32`, any order), the block's 32 inputs (`x[kept[j]]` used), and
/// `y[j]` = output `lo + j` (`lo` and `y.len()` multiples of 32).
pub type AxpyBlocksFn = fn(QuantType, &[u8], usize, &[u8], &[f32; 32], usize, &mut [f32]);

/// The types this layout holds.
pub fn supports(q: QuantType) -> bool {
    matches!(
        q,
        QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q4K
            | QuantType::Q5K
    )
}

/// Whether `q` is a 5-bit type (a plane of fifth bits after the nibbles; `cols` a multiple of
/// 64).
pub fn five_bit(q: QuantType) -> bool {
    matches!(q, QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q5K)
}

/// Offset of the fifth-bit plane in a block (the 5-bit types).
pub(super) fn high_bits_at(q: QuantType, cols: usize) -> usize {
    scale_bytes(q, cols) + 16 * cols
}

/// Row `r`'s fifth bits of outputs `64 t .. 64 t + 64` (a 5-bit type's block).
#[inline(always)]
pub(super) fn high_word(q: QuantType, block: &[u8], cols: usize, r: usize, t: usize) -> u64 {
    let at = high_bits_at(q, cols) + r * cols / 8 + 8 * t;
    u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"))
}

pub fn select(isa: Isa) -> AxpyBlocksFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2,
        Isa::Scalar => scalar,
        _ => generic,
    }
}

/// Check the call's extents (every tier, in release builds: the x86 loops read through raw
/// pointers).
pub(super) fn check(q: QuantType, block: &[u8], cols: usize, kept: &[u8], lo: usize, y: &[f32]) {
    assert!(supports(q), "axpy_blocks: {q:?} has no input-block layout");
    assert!(
        super::block_tables::block_len_ok(q, block.len(), cols),
        "axpy_blocks: block size"
    );
    assert!(
        cols.is_multiple_of(32) && lo.is_multiple_of(32) && y.len().is_multiple_of(32),
        "axpy_blocks: outputs in whole groups of 32"
    );
    assert!(lo + y.len() <= cols, "axpy_blocks: outputs past the row");
    assert!(
        !five_bit(q) || cols.is_multiple_of(64) && lo.is_multiple_of(64),
        "axpy_blocks: a 5-bit block's outputs and range start in whole words of 64"
    );
    assert!(
        kept.iter().all(|&r| r < 32),
        "axpy_blocks: a kept row past 32"
    );
}

/// Quant `q[r][o]` (unsigned for the 4- and 5-bit types, signed byte for Q8_0).
pub(super) fn quant(q: QuantType, block: &[u8], cols: usize, r: usize, o: usize) -> f32 {
    let base = scale_bytes(q, cols);
    match q {
        QuantType::Q8_0 => block[base + r * cols + o] as i8 as f32,
        _ => {
            let b = block[base + r * cols / 2 + (o / 32) * 16 + o % 16];
            let low = if o % 32 < 16 { b & 0xF } else { b >> 4 };
            let high = match five_bit(q) {
                true => (high_word(q, block, cols, r, o / 64) >> (o % 64)) as u8 & 1,
                false => 0,
            };
            (low | high << 4) as f32
        }
    }
}

/// The definition (and the scalar tier's kernel).
pub fn scalar(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    check(q, block, cols, kept, lo, y);
    let s: f32 = kept.iter().map(|&r| x[r as usize]).sum();
    for (j, yj) in y.iter_mut().enumerate() {
        let o = lo + j;
        let t: f32 = (kept.iter())
            .map(|&r| x[r as usize] * quant(q, block, cols, r as usize, o))
            .sum();
        let (d, off) = scale_off(q, block, cols, o);
        *yj += d * t + off * s;
    }
}

/// The tiers without intrinsics of their own here (portable, NEON, NEON with the dot product):
/// [`scalar`]'s arithmetic in its order (each output's `t` summed over the kept rows in `kept`
/// order from -0.0, as `Sum` does; products and sums not fused), 32 outputs at a time in
/// fixed-size arrays that the compiler vectorises (NEON on aarch64, SSE2 on x86-64), each kernel
/// built once per type: bit for bit the definition.
pub fn generic(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    check(q, block, cols, kept, lo, y);
    match q {
        QuantType::Q8_0 => generic_type::<0>(q, block, cols, kept, x, lo, y),
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q4K => {
            generic_type::<4>(q, block, cols, kept, x, lo, y)
        }
        _ => generic_type::<5>(q, block, cols, kept, x, lo, y),
    }
}

/// [`generic`] for a type of `BITS` (0: Q8_0's bytes).
#[inline(always)]
fn generic_type<const BITS: u32>(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    let s: f32 = kept.iter().map(|&r| x[r as usize]).sum();
    let base = scale_bytes(q, cols);
    for (g, yg) in y.chunks_exact_mut(32).enumerate() {
        let o0 = lo + 32 * g;
        let mut t = [-0.0f32; 32];
        for &r in kept {
            let (r, xr) = (r as usize, x[r as usize]);
            let mut v = [0f32; 32];
            if BITS == 0 {
                let row: &[u8; 32] = block[base + r * cols + o0..][..32].try_into().unwrap();
                for i in 0..32 {
                    v[i] = row[i] as i8 as f32;
                }
            } else {
                let at = base + r * cols / 2 + o0 / 2;
                let row: &[u8; 16] = block[at..at + 16].try_into().unwrap();
                let high = match BITS {
                    5 => (high_word(q, block, cols, r, o0 / 64) >> (o0 % 64)) as u32,
                    _ => 0,
                };
                for i in 0..16 {
                    v[i] = ((row[i] & 15) as u32 | (high >> i & 1) << 4) as f32;
                    v[i + 16] = ((row[i] >> 4) as u32 | (high >> (i + 16) & 1) << 4) as f32;
                }
            }
            for i in 0..32 {
                t[i] += xr * v[i];
            }
        }
        for (j, yj) in yg.iter_mut().enumerate() {
            let (d, off) = scale_off(q, block, cols, o0 + j);
            *yj += d * t[j] + off * s;
        }
    }
}

/// Row `r` (< 32) of a block, dequantized: input `r`'s value at every output.
pub fn input_row(q: QuantType, block: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    check(q, block, cols, &[r.min(32) as u8], 0, &out[..cols]);
    for (o, v) in out[..cols].iter_mut().enumerate() {
        let (d, off) = scale_off(q, block, cols, o);
        *v = d * quant(q, block, cols, r, o) + off;
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    check(q, block, cols, kept, lo, y);
    // SAFETY: handed out by `select` for the AVX2 tier only; extents checked above.
    unsafe { avx2_impl(q, block, cols, kept, x, lo, y) }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn avx512(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    check(q, block, cols, kept, lo, y);
    // SAFETY: handed out by `select` for the AVX-512 tier only; extents checked above.
    unsafe { avx512_impl(q, block, cols, kept, x, lo, y) }
}

/// Kept rows the x86 loops prefetch ahead of the one they read, in the order they read them
/// (the hardware prefetcher alone leaves them waiting on memory: see `crate::prefetch`).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 24;

/// Prefetch row `r`'s quants of outputs `o..o + n` (nothing without a row).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_row(q: QuantType, block: &[u8], cols: usize, r: Option<&u8>, o: usize, n: usize) {
    if let Some(&r) = r {
        let (row, at, bytes) = match q {
            QuantType::Q8_0 => (cols, o, n),
            _ => (cols / 2, o / 2, n / 2),
        };
        let start = scale_bytes(q, cols) + r as usize * row + at;
        crate::prefetch::prefetch(&block[start..start + bytes]);
        if five_bit(q) {
            let hb = high_bits_at(q, cols) + r as usize * cols / 8 + o / 8;
            crate::prefetch::prefetch(&block[hb..hb + n.div_ceil(8)]);
        }
    }
}

/// Outputs from `lo` of every kept row that [`prefetch_first`] fetches: as far as the loops'
/// own prefetches run ahead of the tile they read (the 8-bit kernel's distance), so that no
/// row's start is left to wait on memory.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const FIRST_OUTPUTS: usize = 256;

/// The scales of the first tile and the first [`FIRST_OUTPUTS`] outputs from `lo` (a multiple
/// of 32) of every kept row of a block, for the loop that reads the block before it to
/// prefetch. (Only the first tile's scales: the whole table, read by every thread for every
/// block, cost 4% of a SmolLM2 `teal` step; the hardware prefetcher follows the table from
/// there. Every kept row: with the first 24 rows' first 128 outputs only, the 8-bit kernel
/// waited on the loads of the rest, 30% of its samples.)
pub fn prefetch_first(q: QuantType, block: &[u8], cols: usize, kept: &[u8], lo: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let lo = lo.min(cols);
        let hi = (lo + TILE).min(cols);
        super::block_tables::prefetch(q, block, cols, lo, hi);
        for &r in kept {
            prefetch_row(q, block, cols, Some(&r), lo, FIRST_OUTPUTS.min(cols - lo));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (q, block, cols, kept, lo);
}

/// Outputs per register tile of the AVX-512 loop (eight 16-lane sums; the AVX2 loop takes
/// half).
#[cfg(target_arch = "x86_64")]
const TILE: usize = 128;

/// The `(tile, row)` steps of a block's loop in order: step `i` reads kept row `i % rows` of
/// tile `i / rows`; prefetch what step `i + AHEAD` reads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn prefetch_step(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    lo: usize,
    end: usize,
    tile: usize,
    i: usize,
) {
    let n = kept.len();
    let (t, j) = ((i + AHEAD) / n, (i + AHEAD) % n);
    let o = lo + t * tile;
    if o < end {
        prefetch_row(q, block, cols, kept.get(j), o, tile.min(end - o));
    }
}

/// Per tile of 64 outputs: `t` in eight 8-lane registers; each kept row's quants of the tile
/// widened and multiply-added; then `y += d * t + off * S`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let s: f32 = kept.iter().map(|&r| x[r as usize]).sum();
    let base = block.as_ptr();
    let quants = base.add(scale_bytes(q, cols));
    let nib = _mm_set1_epi8(0x0F);
    let five = five_bit(q);
    // Byte j of a 32-bit word's spread: its byte j / 8 (both lanes hold the word); tested
    // against bit j % 8.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let sixteen = _mm256_set1_epi8(16);
    let (end, tile) = (lo + y.len(), TILE / 2);
    let mut step = 0;
    for g in (lo..end).step_by(tile) {
        let groups = ((end - g) / 32).min(tile / 32);
        let mut t = [_mm256_setzero_ps(); 8];
        for &r in kept {
            prefetch_step(q, block, cols, kept, lo, end, tile, step);
            step += 1;
            let xv = _mm256_set1_ps(x[r as usize]);
            for h in 0..groups {
                let o = g + 32 * h;
                let w: [__m128i; 4] = if q == QuantType::Q8_0 {
                    let p = quants.add(r as usize * cols + o);
                    std::array::from_fn(|k| _mm_loadl_epi64(p.add(8 * k) as *const __m128i))
                } else {
                    let p = quants.add(r as usize * cols / 2 + o / 2);
                    let v = _mm_loadu_si128(p as *const __m128i);
                    let (mut l, mut hi) = (
                        _mm_and_si128(v, nib),
                        _mm_and_si128(_mm_srli_epi16(v, 4), nib),
                    );
                    if five {
                        // This row's fifth bits of the group's 32 outputs, one byte each
                        // (byte j: bit j % 8 of the word's byte j / 8), as 16 or 0.
                        let hw = high_word(q, block, cols, r as usize, o / 64) >> (o % 64);
                        let b = _mm256_shuffle_epi8(_mm256_set1_epi32(hw as u32 as i32), spread);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
                        let add = _mm256_and_si256(set, sixteen);
                        l = _mm_or_si128(l, _mm256_castsi256_si128(add));
                        hi = _mm_or_si128(hi, _mm256_extracti128_si256(add, 1));
                    }
                    [l, _mm_srli_si128(l, 8), hi, _mm_srli_si128(hi, 8)]
                };
                for (k, wk) in w.into_iter().enumerate() {
                    let f = match q {
                        QuantType::Q8_0 => _mm256_cvtepi8_epi32(wk),
                        _ => _mm256_cvtepu8_epi32(wk),
                    };
                    t[4 * h + k] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(f), t[4 * h + k]);
                }
            }
        }
        let sv = _mm256_set1_ps(s);
        for (k, tk) in t.iter().enumerate().take(4 * groups) {
            let o = g + 8 * k;
            let (d, off) = super::block_tables::scales8(q, block, cols, o);
            let yp = y.as_mut_ptr().add(o - lo);
            let v = _mm256_fmadd_ps(d, *tk, _mm256_fmadd_ps(off, sv, _mm256_loadu_ps(yp)));
            _mm256_storeu_ps(yp, v);
        }
    }
}

/// [`avx2_impl`] in 16 lanes, tiles of 128 outputs (64 bytes of 4-bit quants, 128 of Q8_0).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn avx512_impl(
    q: QuantType,
    block: &[u8],
    cols: usize,
    kept: &[u8],
    x: &[f32; 32],
    lo: usize,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let s: f32 = kept.iter().map(|&r| x[r as usize]).sum();
    let base = block.as_ptr();
    let quants = base.add(scale_bytes(q, cols));
    let nib = _mm256_set1_epi8(0x0F);
    let nib128 = _mm_set1_epi8(0x0F);
    let (five, sixteen) = (five_bit(q), _mm_set1_epi8(16));
    let end = lo + y.len();
    let mut step = 0;
    for g in (lo..end).step_by(TILE) {
        // Groups of 32 outputs in this tile (1 to 4).
        let n = ((end - g) / 32).min(TILE / 32);
        let mut t = [_mm512_setzero_ps(); 8];
        for &r in kept {
            prefetch_step(q, block, cols, kept, lo, end, TILE, step);
            step += 1;
            let xv = _mm512_set1_ps(x[r as usize]);
            if q == QuantType::Q8_0 {
                let p = quants.add(r as usize * cols + g);
                for (k, tk) in t.iter_mut().enumerate().take(2 * n) {
                    let w = _mm_loadu_si128(p.add(16 * k) as *const __m128i);
                    *tk = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w)), *tk);
                }
                continue;
            }
            let p = quants.add(r as usize * cols / 2 + g / 2);
            // Two groups of 32 outputs per 32 bytes: low nibbles are outputs 0..16 of each
            // group, high nibbles 16..32; a last odd group from 16 bytes.
            for h in 0..n.div_ceil(2) {
                let parts: [__m128i; 4] = if 2 * h + 1 < n {
                    let v = _mm256_loadu_si256(p.add(32 * h) as *const __m256i);
                    let l = _mm256_and_si256(v, nib);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                    [
                        _mm256_castsi256_si128(l),
                        _mm256_castsi256_si128(hi),
                        _mm256_extracti128_si256(l, 1),
                        _mm256_extracti128_si256(hi, 1),
                    ]
                } else {
                    let v = _mm_loadu_si128(p.add(32 * h) as *const __m128i);
                    let l = _mm_and_si128(v, nib128);
                    [l, _mm_and_si128(_mm_srli_epi16(v, 4), nib128), l, l]
                };
                let m = if 2 * h + 1 < n { 4 } else { 2 };
                // The 5-bit types: this row's fifth bits of these 64 outputs (part k: 16).
                let hw = match five {
                    true => high_word(q, block, cols, r as usize, (g + 64 * h) / 64),
                    false => 0,
                };
                for (k, w) in parts.into_iter().enumerate().take(m) {
                    let w = match five {
                        true => _mm_mask_add_epi8(w, (hw >> (16 * k)) as u16, w, sixteen),
                        false => w,
                    };
                    let f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(w));
                    t[4 * h + k] = _mm512_fmadd_ps(xv, f, t[4 * h + k]);
                }
            }
        }
        let sv = _mm512_set1_ps(s);
        for (k, tk) in t.iter().enumerate().take(2 * n) {
            let o = g + 16 * k;
            add_scaled16(q, block, cols, o, *tk, sv, y.as_mut_ptr().add(o - lo));
        }
    }
}

/// `y[..16] = d * t + (off * s + y)` for the 16 outputs from `o` of `block` (`d`, `off` from
/// its table, as [`scale_off`]): the end of a tile of the AVX-512 loops. The caller keeps `o`
/// a multiple of 16, `o + 16 <= cols`, 16 floats at `y`, and the block's extent checked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn add_scaled16(
    q: QuantType,
    block: &[u8],
    cols: usize,
    o: usize,
    t: std::arch::x86_64::__m512,
    s: std::arch::x86_64::__m512,
    y: *mut f32,
) {
    use std::arch::x86_64::*;
    let (d, off) = super::block_tables::scales16(q, block, cols, o);
    _mm512_storeu_ps(
        y,
        _mm512_fmadd_ps(d, t, _mm512_fmadd_ps(off, s, _mm512_loadu_ps(y))),
    );
}

/// A random block (scales, offsets, quants) and its values as the layout defines them, for the
/// tests of this layout's kernels. (Q4_K and Q5_K: a super-block's block 6 as [`block`] hands
/// it out: its own bytes, block 7's, then the shared scales.)
#[cfg(test)]
pub(super) fn random_block(q: QuantType, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    use rand::{Rng, SeedableRng};
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    if super::block_tables::two_level(q) {
        return random_k_block(q, &mut r, cols);
    }
    let d: Vec<f32> = (0..cols).map(|_| r.gen_range(0.001f32..0.1)).collect();
    let m: Vec<f32> = (0..cols).map(|_| r.gen_range(-0.5f32..0.5)).collect();
    let quants: Vec<u8> = (0..32 * cols)
        .map(|_| match q {
            QuantType::Q8_0 => r.gen_range(-127i8..=127) as u8,
            _ if five_bit(q) => r.gen_range(0u8..32),
            _ => r.gen_range(0u8..16),
        })
        .collect();
    let bytes = pack_block(q, cols, &d, &m, &quants);
    let rd = |v: f32| f16::from_f32(v).to_f32();
    let values = (0..32 * cols)
        .map(|i| {
            let (o, qv) = (i % cols, quants[i]);
            match q {
                QuantType::Q8_0 => rd(d[o]) * qv as i8 as f32,
                QuantType::Q4_0 => rd(d[o]) * (qv as f32 - 8.0),
                QuantType::Q5_0 => rd(d[o]) * (qv as f32 - 16.0),
                _ => rd(d[o]) * qv as f32 + rd(m[o]),
            }
        })
        .collect();
    (bytes, values)
}

/// The cases of this layout's kernel tests: kept-row sets (none, one, three, about half at
/// random, all 32 in reverse), each with the output ranges `(lo, n)` over `cols` outputs (all,
/// all but the first group (64 outputs for a 5-bit type), the first group, the last; empty
/// ones left out). `cols` of a 5-bit type: a multiple of 64.
#[cfg(test)]
pub(crate) fn test_cases(
    r: &mut impl rand::Rng,
    q: QuantType,
    cols: usize,
) -> Vec<(Vec<u8>, usize, usize)> {
    let sets: Vec<Vec<u8>> = vec![
        vec![],
        vec![7],
        vec![3, 9, 30],
        (0..32).filter(|_| r.gen_bool(0.5)).collect(),
        (0..32).rev().collect(),
    ];
    let g = if five_bit(q) { 64 } else { 32 };
    let ranges = [
        (0, cols),
        (g, cols - g),
        (0, 32),
        (cols - g, 32),
        (cols - g, g),
    ];
    (sets.iter())
        .flat_map(|k| {
            ranges
                .iter()
                .filter(|r| r.1 > 0)
                .map(|&(lo, n)| (k.clone(), lo, n))
        })
        .collect()
}

/// [`random_block`] of Q4_K and Q5_K.
#[cfg(test)]
fn random_k_block(q: QuantType, r: &mut impl rand::Rng, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let h = |v: f32| f16::from_f32(v);
    let d: Vec<f16> = (0..cols).map(|_| h(r.gen_range(0.0001f32..0.01))).collect();
    let dmin: Vec<f16> = (0..cols).map(|_| h(r.gen_range(0.0f32..0.01))).collect();
    let sc: Vec<u8> = (0..cols).map(|_| r.gen_range(0..64)).collect();
    let m: Vec<u8> = (0..cols).map(|_| r.gen_range(0..64)).collect();
    let top = if five_bit(q) { 32 } else { 16 };
    let quants: Vec<u8> = (0..32 * cols).map(|_| r.gen_range(0..top)).collect();
    let mut table = vec![0u8; scale_bytes(q, cols)];
    for o0 in (0..cols).step_by(32) {
        let (s, mm) = (&sc[o0..o0 + 32], &m[o0..o0 + 32]);
        let put = super::block_tables::put_k4_scale_min;
        put(
            &mut table,
            cols,
            o0,
            s.try_into().unwrap(),
            mm.try_into().unwrap(),
        );
    }
    let mut out = table;
    // The quants as Q4_1's or Q5_1's (the plane of fifth bits after the nibbles).
    let q1 = if five_bit(q) {
        QuantType::Q5_1
    } else {
        QuantType::Q4_1
    };
    let ones = vec![0f32; cols];
    out.extend(&pack_block(q1, cols, &ones, &ones, &quants)[scale_bytes(q1, cols)..]);
    // Block 7 of the super-block: bytes the kernels must not read as this block's.
    let own = out.len();
    out.extend((0..own).map(|_| r.gen::<u8>()));
    out.extend(d.iter().chain(&dmin).flat_map(|v| v.to_le_bytes()));
    let values = (0..32 * cols)
        .map(|i| {
            let (o, qv) = (i % cols, quants[i] as f32);
            d[o].to_f32() * sc[o] as f32 * qv - dmin[o].to_f32() * m[o] as f32
        })
        .collect();
    (out, values)
}

/// The block `b` of a matrix in the input-block layout built from ggml rows: for tests and the
/// layout conversion's reference (`values[r][o]` for its 32 inputs of `cols` outputs, and the
/// per-output scales and offsets of the 32-input group, as `(d, m)` with the quants `q`).
pub fn pack_block(q: QuantType, cols: usize, d: &[f32], m: &[f32], quants: &[u8]) -> Vec<u8> {
    let one_level = !super::block_tables::two_level(q);
    assert!(supports(q) && one_level && d.len() == cols && quants.len() == 32 * cols);
    let mut out = Vec::with_capacity(32 * q.row_bytes(cols));
    assert!(
        !five_bit(q) || cols.is_multiple_of(64),
        "5-bit blocks of whole words"
    );
    out.extend(d.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
    if matches!(q, QuantType::Q4_1 | QuantType::Q5_1) {
        out.extend(m.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
    }
    for row in quants.chunks_exact(cols) {
        match q {
            QuantType::Q8_0 => out.extend_from_slice(row),
            _ => {
                for g in row.chunks_exact(32) {
                    out.extend((0..16).map(|k| (g[k] & 0xF) | ((g[k + 16] & 0xF) << 4)));
                }
            }
        }
    }
    if five_bit(q) {
        for row in quants.chunks_exact(cols) {
            for w in row.chunks_exact(64) {
                let bits =
                    (w.iter().enumerate()).fold(0u64, |b, (i, &v)| b | ((v as u64 >> 4) & 1) << i);
                out.extend(bits.to_le_bytes());
            }
        }
    }
    out
}

/// The types of this layout, for its tests.
#[cfg(test)]
pub(super) const TYPES: [QuantType; 7] = [
    QuantType::Q8_0,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q4K,
    QuantType::Q5K,
];

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The reference equals the sum over kept rows of x times the block's values (within 1e-5
    /// of the sum of |terms|); every tier equals the reference within 1e-5 of the same sum (the
    /// sums are ordered alike: per output, rows in `kept` order), for each type, ragged output
    /// ranges (32 to 2080 outputs at offsets), and the kept sets of [`test_cases`].
    #[test]
    fn tiers_match_reference() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for q in TYPES {
            for cols in [32usize, 96, 256, 352, 2112, 64, 192, 2240] {
                if five_bit(q) && !cols.is_multiple_of(64) {
                    continue;
                }
                let (bytes, values) = random_block(q, cols, cols as u64);
                let x: [f32; 32] = std::array::from_fn(|_| r.gen_range(-2f32..2.0));
                for (kept, lo, n) in &test_cases(&mut r, q, cols) {
                    let (kept, lo, n) = (kept, *lo, *n);
                    let y0: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
                    let mut want = y0.clone();
                    scalar(q, &bytes, cols, kept, &x, lo, &mut want);
                    for j in 0..n {
                        let o = lo + j;
                        let (mut exact, mut mag) = (y0[j] as f64, y0[j].abs() as f64);
                        for &k in kept {
                            let v = (x[k as usize] * values[k as usize * cols + o]) as f64;
                            exact += v;
                            mag += v.abs();
                        }
                        let tol = 1e-5 * mag + 1e-6;
                        assert!(((want[j] as f64) - exact).abs() <= tol, "{q:?} ref {o}");
                    }
                    // The kernel of the tiers without intrinsics: the definition's bits.
                    let mut got = y0.clone();
                    generic(q, &bytes, cols, kept, &x, lo, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "generic {q:?} {cols} {lo} {n}");
                    for isa in Isa::supported() {
                        let mut got = y0.clone();
                        select(isa)(q, &bytes, cols, kept, &x, lo, &mut got);
                        for j in 0..n {
                            let mag: f32 = kept
                                .iter()
                                .map(|&k| {
                                    (x[k as usize] * values[k as usize * cols + lo + j]).abs()
                                })
                                .sum::<f32>()
                                + y0[j].abs();
                            assert!(
                                (got[j] - want[j]).abs() <= 1e-5 * mag + 1e-6,
                                "{isa} {q:?} cols {cols} lo {lo} n {n} kept {}: {} vs {}",
                                kept.len(),
                                got[j],
                                want[j]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "outputs past the row")]
    fn extents_are_checked() {
        let (bytes, _) = random_block(QuantType::Q4_0, 64, 1);
        let mut y = vec![0f32; 64];
        for isa in Isa::supported() {
            select(isa)(QuantType::Q4_0, &bytes, 64, &[1], &[1.0; 32], 32, &mut y);
        }
    }
}
