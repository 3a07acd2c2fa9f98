//! The scale tables of the input-block layout (`super::axpy_blocks`): where a block and its
//! table lie, and each output's scale `d` and offset `off` read from it — plainly
//! ([`scale_off`], the definition) and 16, 8 or 32 outputs at a time for the AVX-512 and AVX2
//! loops ([`scales16`], [`scales8`], [`k_scales32`]), bit for bit the definition.
//!
//! Q8_0, Q4_0 and Q5_0: an f16 scale per output (`off` = 0, `-8 d`, `-16 d`); Q4_1 and Q5_1:
//! then an f16 offset per output. Q4_K and Q5_K keep the file's two levels of scales: a
//! super-block of 256 inputs is 8 blocks, each its own table and quants (Q5_K's with Q5_1's
//! plane of fifth bits), then the f16 `d` of every output and the f16 `dmin` of every output.
//! A block's table: a byte per output of its 6-bit scale's and min's low 4 bits (`sc & 15 |
//! (m & 15) << 4`), then per 32 outputs 16 bytes of their high 2 bits (`sc >> 4 | (m >> 4) <<
//! 2`; output `k` in byte `k`'s low nibble, `k + 16` in its high one, as the quants' nibbles):
//! 1.5 bytes an output, against Q4_1's 4. A K-quant block is handed to the kernels as the bytes
//! from its own start to its super-block's end ([`block`]), so its table is at its start as
//! every type's is and the shared scales are its last `4 cols` bytes; its `d[o] = d * sc` and
//! `off[o] = dmin * -m`, both exact in f32 (an 11-bit mantissa times 6 bits), so the sum is
//! ggml's K-quant value `d sc q - dmin m`.
use dejavu_backend_api::quant::QuantType;
use half::f16;

/// Whether `q` is a K-quant of two levels of scales (Q4_K, Q5_K).
pub(super) fn two_level(q: QuantType) -> bool {
    matches!(q, QuantType::Q4K | QuantType::Q5K)
}

/// Bytes of a K-quant block's own table and quants (per output: 1.5 + 16, and Q5_K's 4 of
/// fifth bits).
fn k_own(q: QuantType, cols: usize) -> usize {
    match q {
        QuantType::Q5K => 43 * cols / 2,
        _ => 35 * cols / 2,
    }
}

/// Bytes of the table at a block's start (the offset of its quants).
pub(super) fn table_bytes(q: QuantType, cols: usize) -> usize {
    match two_level(q) {
        true => 3 * cols / 2,
        false => dejavu_backend_api::input_block_table_bytes(q, cols),
    }
}

/// Inputs a matrix in `q` has in multiples of: 256 for the two-level types (whole
/// super-blocks), else 32.
pub fn whole_inputs(q: QuantType) -> usize {
    if two_level(q) {
        256
    } else {
        32
    }
}

/// Bytes a block of `cols` outputs in `q` holds per input (its row of quants and a 32nd of the
/// table, the K-quants' shared scales included): for any `cols` a multiple of 32.
pub fn input_bytes(q: QuantType, cols: usize) -> usize {
    match q {
        QuantType::Q4K => 9 * cols / 16,
        QuantType::Q5K => 11 * cols / 16,
        _ => q.row_bytes(cols),
    }
}

/// Whether `len` bytes are a block of `cols` outputs in `q` as [`block`] hands them out.
pub(super) fn block_len_ok(q: QuantType, len: usize, cols: usize) -> bool {
    match q {
        QuantType::Q4K | QuantType::Q5K => {
            let own = k_own(q, cols);
            len >= own + 4 * cols
                && (len - 4 * cols).is_multiple_of(own)
                && len <= 8 * own + 4 * cols
        }
        _ => len == 32 * q.row_bytes(cols),
    }
}

/// Block `b` (inputs `32 b ..`) of an input-block matrix of `cols` outputs in `q` (`data`: the
/// matrix's bytes, whole blocks; Q4_K and Q5_K: whole super-blocks).
pub fn block(q: QuantType, data: &[u8], cols: usize, b: usize) -> &[u8] {
    &data[block_range(q, cols, b)]
}

/// Where [`block`] `b` lies in its matrix's bytes: its own bytes, then (the two-level types)
/// the rest of its super-block, whose last `4 cols` bytes are the shared `d` and `dmin`.
pub fn block_range(q: QuantType, cols: usize, b: usize) -> std::ops::Range<usize> {
    match two_level(q) {
        true => {
            let sup = 8 * k_own(q, cols) + 4 * cols;
            let (s, j) = (b / 8, b % 8);
            s * sup + j * k_own(q, cols)..(s + 1) * sup
        }
        false => {
            let bb = 32 * q.row_bytes(cols);
            b * bb..(b + 1) * bb
        }
    }
}

/// Q4_K, Q5_K: output `o`'s 6-bit scale and min in a block.
fn k4_scale_min(block: &[u8], cols: usize, o: usize) -> (u8, u8) {
    let low = block[o];
    let high = block[cols + o / 32 * 16 + o % 16] >> (4 * (o % 32 / 16)) & 0xF;
    (low & 0xF | (high & 3) << 4, low >> 4 | (high >> 2) << 4)
}

/// Write outputs' 6-bit scales and mins (`sc[k]`, `m[k]` of output `o0 + k`, `o0` a multiple
/// of 32, 32 outputs) into a Q4_K or Q5_K block's table (`table`: its `table_bytes` of `cols`
/// outputs).
pub fn put_k4_scale_min(table: &mut [u8], cols: usize, o0: usize, sc: &[u8; 32], m: &[u8; 32]) {
    assert!(o0.is_multiple_of(32) && o0 + 32 <= cols && table.len() == 3 * cols / 2);
    assert!(sc.iter().chain(m).all(|&v| v < 64), "6-bit scales and mins");
    for k in 0..32 {
        table[o0 + k] = sc[k] & 0xF | (m[k] & 0xF) << 4;
    }
    let high = |k: usize| sc[k] >> 4 | (m[k] >> 4) << 2;
    for k in 0..16 {
        table[cols + o0 / 2 + k] = high(k) | high(k + 16) << 4;
    }
}

/// The per-output scale `d[o]` and offset `off[o]` of a block (the definition).
pub(super) fn scale_off(q: QuantType, block: &[u8], cols: usize, o: usize) -> (f32, f32) {
    let h = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
    let d = || h(2 * o);
    match q {
        QuantType::Q4_1 | QuantType::Q5_1 => (d(), h(2 * (cols + o))),
        QuantType::Q4_0 => (d(), -8.0 * d()),
        QuantType::Q5_0 => (d(), -16.0 * d()),
        QuantType::Q4K | QuantType::Q5K => {
            let (sc, m) = k4_scale_min(block, cols, o);
            let head = block.len() - 4 * cols;
            let (d, dmin) = (h(head + 2 * o), h(head + 2 * (cols + o)));
            // `-m` as an integer (0, not -0.0), as the SIMD loaders negate it.
            (d * sc as f32, dmin * -(m as i32) as f32)
        }
        _ => (d(), 0.0),
    }
}

/// Prefetch the table entries of outputs `lo..hi` of a block.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch(q: QuantType, block: &[u8], cols: usize, lo: usize, hi: usize) {
    use crate::prefetch::prefetch;
    match q {
        QuantType::Q4K | QuantType::Q5K => {
            let head = block.len() - 4 * cols;
            prefetch(&block[lo..hi]);
            prefetch(&block[cols + lo / 2..cols + hi.div_ceil(32) * 16]);
            prefetch(&block[head + 2 * lo..head + 2 * hi]);
            prefetch(&block[head + 2 * (cols + lo)..head + 2 * (cols + hi)]);
        }
        _ => {
            prefetch(&block[2 * lo..2 * hi]);
            if matches!(q, QuantType::Q4_1 | QuantType::Q5_1) {
                prefetch(&block[2 * (cols + lo)..2 * (cols + hi)]);
            }
        }
    }
}

/// [`scale_off`] of the 16 outputs from `o` (a multiple of 16, `o + 16 <= cols`) of a block
/// that [`block_len_ok`].
///
/// # Safety
/// The CPU has AVX-512 (F, BW, VL) and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn scales16(
    q: QuantType,
    block: &[u8],
    cols: usize,
    o: usize,
) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
    use std::arch::x86_64::*;
    debug_assert!(o.is_multiple_of(16) && o + 16 <= cols);
    let base = block.as_ptr();
    let half = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(base.add(at) as *const __m256i));
    match q {
        QuantType::Q4K | QuantType::Q5K => {
            let head = block.len() - 4 * cols;
            let low = _mm512_cvtepu8_epi32(_mm_loadu_si128(base.add(o) as *const __m128i));
            let high = _mm_loadu_si128(base.add(cols + o / 32 * 16) as *const __m128i);
            let high = match o % 32 {
                0 => high,
                _ => _mm_srli_epi16(high, 4),
            };
            let high = _mm512_and_si512(_mm512_cvtepu8_epi32(high), _mm512_set1_epi32(0xF));
            let (f, three) = (_mm512_set1_epi32(0xF), _mm512_set1_epi32(3));
            let sc = _mm512_or_si512(
                _mm512_and_si512(low, f),
                _mm512_slli_epi32(_mm512_and_si512(high, three), 4),
            );
            let m = _mm512_or_si512(
                _mm512_srli_epi32(low, 4),
                _mm512_slli_epi32(_mm512_srli_epi32(high, 2), 4),
            );
            let neg_m = _mm512_sub_epi32(_mm512_setzero_si512(), m);
            (
                _mm512_mul_ps(half(head + 2 * o), _mm512_cvtepi32_ps(sc)),
                _mm512_mul_ps(half(head + 2 * (cols + o)), _mm512_cvtepi32_ps(neg_m)),
            )
        }
        QuantType::Q4_1 | QuantType::Q5_1 => (half(2 * o), half(2 * (cols + o))),
        QuantType::Q4_0 => (
            half(2 * o),
            _mm512_mul_ps(half(2 * o), _mm512_set1_ps(-8.0)),
        ),
        QuantType::Q5_0 => (
            half(2 * o),
            _mm512_mul_ps(half(2 * o), _mm512_set1_ps(-16.0)),
        ),
        _ => (half(2 * o), _mm512_setzero_ps()),
    }
}

/// [`scales16`] of 8 outputs from `o` (a multiple of 8), in AVX2.
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn scales8(
    q: QuantType,
    block: &[u8],
    cols: usize,
    o: usize,
) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    debug_assert!(o.is_multiple_of(8) && o + 8 <= cols);
    let base = block.as_ptr();
    let half = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(at) as *const __m128i));
    match q {
        QuantType::Q4K | QuantType::Q5K => {
            let head = block.len() - 4 * cols;
            let low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(base.add(o) as *const __m128i));
            let at = cols + o / 32 * 16 + o % 16;
            let high = _mm_loadl_epi64(base.add(at) as *const __m128i);
            let high = match o % 32 < 16 {
                true => high,
                false => _mm_srli_epi16(high, 4),
            };
            let high = _mm256_and_si256(_mm256_cvtepu8_epi32(high), _mm256_set1_epi32(0xF));
            let (f, three) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(3));
            let sc = _mm256_or_si256(
                _mm256_and_si256(low, f),
                _mm256_slli_epi32(_mm256_and_si256(high, three), 4),
            );
            let m = _mm256_or_si256(
                _mm256_srli_epi32(low, 4),
                _mm256_slli_epi32(_mm256_srli_epi32(high, 2), 4),
            );
            let neg_m = _mm256_sub_epi32(_mm256_setzero_si256(), m);
            (
                _mm256_mul_ps(half(head + 2 * o), _mm256_cvtepi32_ps(sc)),
                _mm256_mul_ps(half(head + 2 * (cols + o)), _mm256_cvtepi32_ps(neg_m)),
            )
        }
        QuantType::Q4_1 | QuantType::Q5_1 => (half(2 * o), half(2 * (cols + o))),
        QuantType::Q4_0 => (
            half(2 * o),
            _mm256_mul_ps(half(2 * o), _mm256_set1_ps(-8.0)),
        ),
        QuantType::Q5_0 => (
            half(2 * o),
            _mm256_mul_ps(half(2 * o), _mm256_set1_ps(-16.0)),
        ),
        _ => (half(2 * o), _mm256_setzero_ps()),
    }
}

/// [`scale_off`] of the 32 outputs from `g` (a multiple of 32, `g + 32 <= cols`) of a block of
/// a two-level type (Q4_K, Q5_K), 8 at a time: the table's bytes decoded once for the 32, as
/// the AVX2 loop's tiles need them (4 calls of [`scales8`] decode each byte plane 4 times).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn k_scales32(
    block: &[u8],
    cols: usize,
    g: usize,
) -> [(std::arch::x86_64::__m256, std::arch::x86_64::__m256); 4] {
    use std::arch::x86_64::*;
    debug_assert!(g.is_multiple_of(32) && g + 32 <= cols);
    let (base, head) = (block.as_ptr(), block.len() - 4 * cols);
    let (f, three) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
    let low = _mm256_loadu_si256(base.add(g) as *const __m256i);
    // The 32 outputs' high bits, one byte each in output order (bytes 0-15 from the low
    // nibbles, 16-31 from the high ones).
    let h = _mm_loadu_si128(base.add(cols + g / 2) as *const __m128i);
    let h = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(h, 4), h), f);
    // Per byte; the 16-bit shifts move no bit across a byte (masked before or after).
    let sc = _mm256_or_si256(
        _mm256_and_si256(low, f),
        _mm256_slli_epi16(_mm256_and_si256(h, three), 4),
    );
    let m = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(low, 4), f),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4),
    );
    let half = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(at) as *const __m128i));
    let bytes8 = |v: __m256i, k: usize| -> __m128i {
        let x = match k / 2 {
            0 => _mm256_castsi256_si128(v),
            _ => _mm256_extracti128_si256::<1>(v),
        };
        match k % 2 {
            0 => x,
            _ => _mm_srli_si128::<8>(x),
        }
    };
    std::array::from_fn(|k| {
        let o = g + 8 * k;
        let sck = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(sc, k)));
        let mk = _mm256_cvtepu8_epi32(bytes8(m, k));
        let neg_m = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), mk));
        (
            _mm256_mul_ps(half(head + 2 * o), sck),
            _mm256_mul_ps(half(head + 2 * (cols + o)), neg_m),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The x86 loaders give the definition's bits for every type and every group of 16 and 8
    /// outputs of random tables (Q4_K: every 6-bit scale and min, the block handed out first,
    /// middle and last of its super-block).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_loaders_are_the_definition() {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let cols = 256;
        for q in super::super::axpy_blocks::TYPES {
            let sup = match two_level(q) {
                true => 8 * k_own(q, cols) + 4 * cols,
                false => 32 * q.row_bytes(cols),
            };
            let mut data: Vec<u8> = (0..sup).map(|_| r.gen()).collect();
            // f16 tables of finite values (random bytes may be NaN, whose bits need not match).
            let finite = |b: &mut [u8], r: &mut rand_chacha::ChaCha8Rng| {
                for c in b.chunks_exact_mut(2) {
                    let v = f16::from_f32(r.gen_range(-2f32..2.0));
                    c.copy_from_slice(&v.to_le_bytes());
                }
            };
            match two_level(q) {
                true => finite(&mut data[sup - 4 * cols..], &mut r),
                false => finite(&mut data[..table_bytes(q, cols)], &mut r),
            }
            let blocks = if two_level(q) { vec![0, 3, 7] } else { vec![0] };
            for b in blocks {
                let block = block(q, &data, cols, b);
                assert!(block_len_ok(q, block.len(), cols));
                let want: Vec<(u32, u32)> = (0..cols)
                    .map(|o| scale_off(q, block, cols, o))
                    .map(|(d, off)| (d.to_bits(), off.to_bits()))
                    .collect();
                let isas = crate::isa::Isa::supported();
                for o in (0..cols).step_by(8) {
                    if isas.contains(&crate::isa::Isa::Avx2) {
                        let (mut d, mut off) = ([0f32; 8], [0f32; 8]);
                        // SAFETY: AVX2 is present (a supported tier); o + 8 <= cols; 8 floats
                        // stored into each array.
                        unsafe {
                            use std::arch::x86_64::_mm256_storeu_ps;
                            let (dv, ov) = scales8(q, block, cols, o);
                            _mm256_storeu_ps(d.as_mut_ptr(), dv);
                            _mm256_storeu_ps(off.as_mut_ptr(), ov);
                        }
                        for k in 0..8 {
                            let got = (d[k].to_bits(), off[k].to_bits());
                            assert_eq!(got, want[o + k], "avx2 {q:?} block {b} output {}", o + k);
                        }
                    }
                    if o % 32 == 0 && two_level(q) && isas.contains(&crate::isa::Isa::Avx2) {
                        let mut got = [[0f32; 8]; 8];
                        // SAFETY: AVX2 is present (a supported tier); o + 32 <= cols; 8
                        // floats stored into each array.
                        unsafe {
                            use std::arch::x86_64::_mm256_storeu_ps;
                            for (k, (d, off)) in k_scales32(block, cols, o).into_iter().enumerate()
                            {
                                _mm256_storeu_ps(got[2 * k].as_mut_ptr(), d);
                                _mm256_storeu_ps(got[2 * k + 1].as_mut_ptr(), off);
                            }
                        }
                        for i in 0..32 {
                            let (k, j) = (i / 8, i % 8);
                            let bits = (got[2 * k][j].to_bits(), got[2 * k + 1][j].to_bits());
                            assert_eq!(
                                bits,
                                want[o + i],
                                "avx2 32 {q:?} block {b} output {}",
                                o + i
                            );
                        }
                    }
                    if o % 16 == 0 && isas.contains(&crate::isa::Isa::Avx512) {
                        let (mut d, mut off) = ([0f32; 16], [0f32; 16]);
                        // SAFETY: AVX-512 is present (a supported tier); o + 16 <= cols; 16
                        // floats stored into each array.
                        unsafe {
                            use std::arch::x86_64::_mm512_storeu_ps;
                            let (dv, ov) = scales16(q, block, cols, o);
                            _mm512_storeu_ps(d.as_mut_ptr(), dv);
                            _mm512_storeu_ps(off.as_mut_ptr(), ov);
                        }
                        for k in 0..16 {
                            let got = (d[k].to_bits(), off[k].to_bits());
                            assert_eq!(got, want[o + k], "avx512 {q:?} block {b} output {}", o + k);
                        }
                    }
                }
            }
        }
    }

    /// The Q4_K table round-trips every scale and min.
    #[test]
    fn k4_tables_hold_six_bits() {
        let cols = 64;
        let mut table = vec![0u8; table_bytes(QuantType::Q4K, cols)];
        for o0 in [0, 32] {
            let sc: [u8; 32] = std::array::from_fn(|k| ((k * 7 + o0) % 64) as u8);
            let m: [u8; 32] = std::array::from_fn(|k| ((k * 13 + 5 + o0) % 64) as u8);
            put_k4_scale_min(&mut table, cols, o0, &sc, &m);
            for k in 0..32 {
                assert_eq!(k4_scale_min(&table, cols, o0 + k), (sc[k], m[k]));
            }
        }
    }
}
