//! The interleaved row layout of the 32-element block types (Q8_0, Q4_0, Q4_1, Q5_0), built once
//! at load so the integer dot kernels ([`super::dot_repacked`]) stream instead of compute.
//!
//! A repacked row has the same bytes per row as the ggml row (so rows stay addressable, and a
//! sparse set of rows reads the same bytes). Inside the row, every run of [`GROUP`] blocks is one
//! group whose SIMD lane `j` (4 bytes of a 256-bit vector) belongs to block `j`, so one integer
//! dot per step accumulates all 8 blocks at once and no horizontal sum is needed:
//! - the 8 block scales `d` (f16) side by side, then, for Q4_1, the 8 mins `m`;
//! - the quants in 8 steps of 32 bytes: step `s`, byte `4j + e` is element `4s + e` of block `j`.
//!   Q8_0 stores the 8 steps; the 4-bit types store 4 chunks, chunk `c` holding step `c` in its
//!   low nibbles and step `c + 4` in its high nibbles;
//! - Q5_0: the fifth bits as 32 bytes after the scales, bit `s` of byte `4j + e` being the fifth
//!   bit of element `4s + e` of block `j` (one shift and one mask place a step's bits).
//!
//! The activations of a group are transposed the same way once per token ([`ActGroup`]).
//!
//! The last `blocks % GROUP` blocks of a row stay ggml blocks, unchanged. Contract: `repack_row`
//! and `unpack_row` are inverse permutations of a row's bytes.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QuantType, QK};

/// Blocks per group.
pub const GROUP: usize = 8;

/// Can rows of `q` be repacked?
pub fn supports(q: QuantType) -> bool {
    matches!(
        q,
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0
    )
}

/// Byte offsets inside one group of a repacked type.
#[derive(Clone, Copy, Debug)]
pub struct GroupLayout {
    /// The Q4_1 mins (8 f16), after the scales.
    pub mins: Option<usize>,
    /// The Q5_0 fifth bits (32 bytes).
    pub high: Option<usize>,
    /// The quants.
    pub qs: usize,
    /// Bytes of a group: `GROUP` blocks' worth.
    pub bytes: usize,
}

/// The group layout of `q` (one of [`supports`]).
pub const fn layout(q: QuantType) -> GroupLayout {
    let bytes = GROUP * q.block_bytes();
    match q {
        QuantType::Q4_1 => GroupLayout {
            mins: Some(16),
            high: None,
            qs: 32,
            bytes,
        },
        QuantType::Q5_0 => GroupLayout {
            mins: None,
            high: Some(16),
            qs: 48,
            bytes,
        },
        _ => GroupLayout {
            mins: None,
            high: None,
            qs: 16,
            bytes,
        },
    }
}

/// One block in plain form: scale, min (Q4_1; 0 otherwise) and the stored quants (Q8_0: signed;
/// 4-bit: 0..16; Q5_0: 0..32; the value is `d * (q - offset) + m`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plain {
    pub d: u16,
    pub m: u16,
    pub q: [i8; QK],
}

/// Block `b` of a ggml row of `q`.
fn from_ggml(q: QuantType, blk: &[u8]) -> Plain {
    let d = u16::from_le_bytes([blk[0], blk[1]]);
    let nib = |qs: &[u8], i: usize| if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 };
    match q {
        QuantType::Q8_0 => Plain {
            d,
            m: 0,
            q: std::array::from_fn(|i| blk[2 + i] as i8),
        },
        QuantType::Q4_0 => Plain {
            d,
            m: 0,
            q: std::array::from_fn(|i| nib(&blk[2..], i) as i8),
        },
        QuantType::Q4_1 => Plain {
            d,
            m: u16::from_le_bytes([blk[2], blk[3]]),
            q: std::array::from_fn(|i| nib(&blk[4..], i) as i8),
        },
        QuantType::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            Plain {
                d,
                m: 0,
                q: std::array::from_fn(|i| {
                    (nib(&blk[6..], i) | (((qh >> i) & 1) as u8) << 4) as i8
                }),
            }
        }
        _ => unreachable!("{q:?} is not repackable"),
    }
}

/// The ggml block of `p` into `blk`.
fn to_ggml(q: QuantType, p: &Plain, blk: &mut [u8]) {
    blk[..2].copy_from_slice(&p.d.to_le_bytes());
    let pack = |qs: &mut [u8]| {
        for (i, b) in qs[..16].iter_mut().enumerate() {
            *b = (p.q[i] as u8 & 0xF) | ((p.q[i + 16] as u8 & 0xF) << 4);
        }
    };
    match q {
        QuantType::Q8_0 => {
            for i in 0..QK {
                blk[2 + i] = p.q[i] as u8;
            }
        }
        QuantType::Q4_0 => pack(&mut blk[2..]),
        QuantType::Q4_1 => {
            blk[2..4].copy_from_slice(&p.m.to_le_bytes());
            pack(&mut blk[4..]);
        }
        QuantType::Q5_0 => {
            let qh = (0..QK).fold(0u32, |h, i| h | (((p.q[i] as u32 >> 4) & 1) << i));
            blk[2..6].copy_from_slice(&qh.to_le_bytes());
            pack(&mut blk[6..]);
        }
        _ => unreachable!("{q:?} is not repackable"),
    }
}

/// Block `j` of a repacked group: the reference decoding of the layout.
pub fn group_block(q: QuantType, g: &[u8], j: usize) -> Plain {
    let lay = layout(q);
    let d = u16::from_le_bytes([g[2 * j], g[2 * j + 1]]);
    let m = lay
        .mins
        .map_or(0, |o| u16::from_le_bytes([g[o + 2 * j], g[o + 2 * j + 1]]));
    let qs = &g[lay.qs..];
    let q = std::array::from_fn(|i| {
        let (step, at) = (i / 4, 4 * j + i % 4);
        match q {
            QuantType::Q8_0 => qs[step * 32 + at] as i8,
            _ => {
                let byte = qs[(step % 4) * 32 + at];
                let nib = if step < 4 { byte & 0xF } else { byte >> 4 };
                let hi = lay.high.map_or(0, |o| ((g[o + at] >> step) & 1) << 4);
                (nib | hi) as i8
            }
        }
    });
    Plain { d, m, q }
}

/// Write `blocks` (8 plain blocks) as one repacked group.
fn write_group(q: QuantType, blocks: &[Plain; GROUP], g: &mut [u8]) {
    let lay = layout(q);
    g[..lay.bytes].fill(0);
    for (j, b) in blocks.iter().enumerate() {
        g[2 * j..2 * j + 2].copy_from_slice(&b.d.to_le_bytes());
        if let Some(o) = lay.mins {
            g[o + 2 * j..o + 2 * j + 2].copy_from_slice(&b.m.to_le_bytes());
        }
        for i in 0..QK {
            let (v, step, at) = (b.q[i] as u8, i / 4, 4 * j + i % 4);
            match q {
                QuantType::Q8_0 => g[lay.qs + step * 32 + at] = v,
                _ => {
                    g[lay.qs + (step % 4) * 32 + at] |= (v & 0xF) << (4 * (step / 4));
                    if let Some(o) = lay.high {
                        g[o + at] |= ((v >> 4) & 1) << step;
                    }
                }
            }
        }
    }
}

/// `dst` = the ggml row `src` of `q` repacked (same length; see the module doc): the reference.
pub fn repack_row(q: QuantType, src: &[u8], dst: &mut [u8]) {
    assert!(supports(q) && src.len() == dst.len() && src.len().is_multiple_of(q.block_bytes()));
    let (bb, gb) = (q.block_bytes(), layout(q).bytes);
    let full = src.len() / gb * gb;
    for (s, d) in src[..full].chunks_exact(gb).zip(dst.chunks_exact_mut(gb)) {
        let blocks = std::array::from_fn(|j| from_ggml(q, &s[j * bb..(j + 1) * bb]));
        write_group(q, &blocks, d);
    }
    dst[full..].copy_from_slice(&src[full..]);
}

/// `dst` = the ggml row of the repacked row `src` (the inverse of [`repack_row`]): the reference.
pub fn unpack_row(q: QuantType, src: &[u8], dst: &mut [u8]) {
    assert!(supports(q) && src.len() == dst.len() && src.len().is_multiple_of(q.block_bytes()));
    let (bb, gb) = (q.block_bytes(), layout(q).bytes);
    let full = src.len() / gb * gb;
    for (s, d) in src[..full].chunks_exact(gb).zip(dst.chunks_exact_mut(gb)) {
        for j in 0..GROUP {
            to_ggml(q, &group_block(q, s, j), &mut d[j * bb..(j + 1) * bb]);
        }
    }
    dst[full..].copy_from_slice(&src[full..]);
}

/// The activation blocks of one group, transposed as the weights (see the module doc): scales,
/// sums (`d * sum(qs)`), the integer sums `sum(qs)`, and quants, step `s` byte `4j + e` =
/// element `4s + e` of block `j`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct ActGroup {
    pub d: [f32; GROUP],
    pub s: [f32; GROUP],
    pub qsum: [i32; GROUP],
    pub qs: [[i8; 32]; GROUP],
}

impl ActGroup {
    pub const ZERO: Self = Self {
        d: [0.0; GROUP],
        s: [0.0; GROUP],
        qsum: [0; GROUP],
        qs: [[0; 32]; GROUP],
    };
}

/// `out` = the whole groups of `act` transposed (`act.len() / GROUP` of them).
pub fn act_groups(act: &[BlockQ8A], out: &mut [ActGroup]) {
    assert_eq!(out.len(), act.len() / GROUP, "act_groups: output length");
    for (a8, g) in act.chunks_exact(GROUP).zip(out) {
        for (j, a) in a8.iter().enumerate() {
            g.d[j] = a.d;
            g.s[j] = a.s;
            g.qsum[j] = a.qs.iter().map(|&v| v as i32).sum();
            // Elements 4s..4s+4 to step s, lane j: 4-byte moves.
            for (st, q4) in g.qs.iter_mut().zip(a.qs.chunks_exact(4)) {
                st[4 * j..4 * j + 4].copy_from_slice(q4);
            }
        }
    }
}

/// Every row of a `rows x cols` matrix of `q` repacked, as [`repack_row`] per row.
pub fn repack_matrix(q: QuantType, cols: usize, src: &[u8], dst: &mut [u8]) {
    let rb = q.row_bytes(cols);
    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(rb)) {
        repack_row(q, s, d);
    }
}

/// `(q, src, dst)`: a row conversion of [`select`].
pub type ConvertFn = fn(QuantType, &[u8], &mut [u8]);
/// `(q, repacked row, out)`: dequantization of a repacked row.
pub type DequantFn = fn(QuantType, &[u8], &mut [f32]);

/// The tier's dequantization of repacked rows (the reference: unpack, then the ggml one).
pub fn select_dequantize(isa: Isa) -> DequantFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::dequantize_row,
        _ => dequantize_row,
    }
}

/// The reference dequantization of a repacked row: unpacked, then as a ggml row.
pub fn dequantize_row(q: QuantType, src: &[u8], out: &mut [f32]) {
    let mut ggml = vec![0u8; src.len()];
    unpack_row(q, src, &mut ggml);
    crate::dequant::dequantize_row(q, &ggml, out)
}

/// The tier's `(repack, unpack)` row conversions: the x86 tiers transpose 8x8 lanes in
/// registers; the others use the references.
pub fn select(isa: Isa) -> (ConvertFn, ConvertFn) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => (x86::repack_row, x86::unpack_row),
        _ => (repack_row, unpack_row),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{layout, supports, GROUP};
    use dejavu_backend_api::quant::{QuantType, QK};
    use std::arch::x86_64::*;

    pub fn repack_row(q: QuantType, src: &[u8], dst: &mut [u8]) {
        convert(q, src, dst, true)
    }

    pub fn unpack_row(q: QuantType, src: &[u8], dst: &mut [u8]) {
        convert(q, src, dst, false)
    }

    pub fn dequantize_row(q: QuantType, src: &[u8], out: &mut [f32]) {
        assert!(supports(q) && src.len() == q.row_bytes(out.len()));
        let gb = layout(q).bytes;
        let groups = src.len() / gb;
        for (g, y) in src.chunks_exact(gb).zip(out.chunks_exact_mut(GROUP * QK)) {
            // SAFETY: AVX2 present (x86 tiers only); `g` is one group, `y` its 256 elements.
            unsafe { dequantize_group(q, g, y) }
        }
        crate::dequant::dequantize_row(q, &src[groups * gb..], &mut out[groups * GROUP * QK..]);
    }

    /// One group -> 256 f32: `d * q + m` with `m` the Q4_1 min or `-offset * d`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequantize_group(q: QuantType, g: &[u8], y: &mut [f32]) {
        let lay = layout(q);
        let blocks = group_quants(q, g);
        let mut d = [0f32; GROUP];
        _mm256_storeu_ps(
            d.as_mut_ptr(),
            _mm256_cvtph_ps(_mm_loadu_si128(g.as_ptr() as *const __m128i)),
        );
        let mut m = [0f32; GROUP];
        match (lay.mins, q) {
            (Some(o), _) => _mm256_storeu_ps(
                m.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(g[o..].as_ptr() as *const __m128i)),
            ),
            (None, QuantType::Q4_0) => m.iter_mut().zip(&d).for_each(|(m, d)| *m = -8.0 * d),
            (None, QuantType::Q5_0) => m.iter_mut().zip(&d).for_each(|(m, d)| *m = -16.0 * d),
            _ => {}
        }
        let signed = q == QuantType::Q8_0;
        for (j, v) in blocks.iter().enumerate() {
            let (dj, mj) = (_mm256_set1_ps(d[j]), _mm256_set1_ps(m[j]));
            let halves = [
                _mm256_castsi256_si128(*v),
                _mm256_extracti128_si256::<1>(*v),
            ];
            for (h, half) in halves.iter().enumerate() {
                for k in 0..2 {
                    let bytes = if k == 0 {
                        *half
                    } else {
                        _mm_srli_si128::<8>(*half)
                    };
                    let ints = if signed {
                        _mm256_cvtepi8_epi32(bytes)
                    } else {
                        _mm256_cvtepu8_epi32(bytes)
                    };
                    let x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), dj, mj);
                    _mm256_storeu_ps(y[j * QK + 16 * h + 8 * k..].as_mut_ptr(), x);
                }
            }
        }
    }

    fn convert(q: QuantType, src: &[u8], dst: &mut [u8], pack: bool) {
        assert!(supports(q) && src.len() == dst.len() && src.len().is_multiple_of(q.block_bytes()));
        let gb = layout(q).bytes;
        let full = src.len() / gb * gb;
        for (s, d) in src[..full].chunks_exact(gb).zip(dst.chunks_exact_mut(gb)) {
            // SAFETY: `select` hands these out only on x86 tiers (AVX2 present); `s` and `d`
            // are one whole group each (`gb` bytes), all that the group functions touch.
            unsafe {
                if pack {
                    pack_group(q, s, d)
                } else {
                    unpack_group(q, s, d)
                }
            }
        }
        dst[full..].copy_from_slice(&src[full..]);
    }

    /// 8x8 transpose of 32-bit lanes: lane `j` of `r[i]` becomes lane `i` of the result `j`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn transpose(r: [__m256i; 8]) -> [__m256i; 8] {
        let t = |a, b, hi: bool| {
            if hi {
                _mm256_unpackhi_epi32(a, b)
            } else {
                _mm256_unpacklo_epi32(a, b)
            }
        };
        let (t0, t1) = (t(r[0], r[1], false), t(r[0], r[1], true));
        let (t2, t3) = (t(r[2], r[3], false), t(r[2], r[3], true));
        let (t4, t5) = (t(r[4], r[5], false), t(r[4], r[5], true));
        let (t6, t7) = (t(r[6], r[7], false), t(r[6], r[7], true));
        let u = [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
            _mm256_unpacklo_epi64(t4, t6),
            _mm256_unpackhi_epi64(t4, t6),
            _mm256_unpacklo_epi64(t5, t7),
            _mm256_unpackhi_epi64(t5, t7),
        ];
        [
            _mm256_permute2x128_si256::<0x20>(u[0], u[4]),
            _mm256_permute2x128_si256::<0x20>(u[1], u[5]),
            _mm256_permute2x128_si256::<0x20>(u[2], u[6]),
            _mm256_permute2x128_si256::<0x20>(u[3], u[7]),
            _mm256_permute2x128_si256::<0x31>(u[0], u[4]),
            _mm256_permute2x128_si256::<0x31>(u[1], u[5]),
            _mm256_permute2x128_si256::<0x31>(u[2], u[6]),
            _mm256_permute2x128_si256::<0x31>(u[3], u[7]),
        ]
    }

    /// Offsets in a ggml block: the min (Q4_1), the fifth bits (Q5_0) and the quants.
    fn ggml_offsets(q: QuantType) -> (usize, usize) {
        match q {
            QuantType::Q4_1 => (2, 4),
            QuantType::Q5_0 => (2, 6),
            _ => (0, 2),
        }
    }

    /// 8 ggml blocks -> one group.
    #[target_feature(enable = "avx2")]
    unsafe fn pack_group(q: QuantType, src: &[u8], g: &mut [u8]) {
        let (bb, lay) = (q.block_bytes(), layout(q));
        let (extra, qs_at) = ggml_offsets(q);
        let low = _mm256_set1_epi8(0x0F);
        let blocks: [__m256i; GROUP] = std::array::from_fn(|j| {
            let b = &src[j * bb..(j + 1) * bb];
            g[2 * j..2 * j + 2].copy_from_slice(&b[..2]);
            if let Some(o) = lay.mins {
                g[o + 2 * j..o + 2 * j + 2].copy_from_slice(&b[extra..extra + 2]);
            }
            let p = b[qs_at..].as_ptr();
            match q {
                QuantType::Q8_0 => _mm256_loadu_si256(p as *const __m256i),
                _ => {
                    let half = _mm_loadu_si128(p as *const __m128i);
                    let nib =
                        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(half), half), low);
                    if lay.high.is_some() {
                        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                        let bits = _mm256_and_si256(
                            super::super::x86::bytes_from_bits_32(qh),
                            _mm256_set1_epi8(0x10),
                        );
                        _mm256_or_si256(nib, bits)
                    } else {
                        nib
                    }
                }
            }
        });
        let steps = transpose(blocks);
        let qs = g[lay.qs..].as_mut_ptr();
        if q == QuantType::Q8_0 {
            for (s, v) in steps.iter().enumerate() {
                _mm256_storeu_si256(qs.add(32 * s) as *mut __m256i, *v);
            }
            return;
        }
        for c in 0..4 {
            let lo = _mm256_and_si256(steps[c], low);
            let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(steps[c + 4], low));
            _mm256_storeu_si256(qs.add(32 * c) as *mut __m256i, _mm256_or_si256(lo, hi));
        }
        if let Some(o) = lay.high {
            let mut h = _mm256_setzero_si256();
            for (s, v) in steps.iter().enumerate() {
                h = _mm256_or_si256(h, super::super::x86::from_fifth_bit(*v, s));
            }
            _mm256_storeu_si256(g[o..].as_mut_ptr() as *mut __m256i, h);
        }
    }

    /// The 8 blocks of a group as 32 quant bytes each, in element order (with Q5_0's fifth
    /// bits; 4-bit values unsigned).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn group_quants(q: QuantType, g: &[u8]) -> [__m256i; GROUP] {
        let lay = layout(q);
        let low = _mm256_set1_epi8(0x0F);
        let qs = g[lay.qs..].as_ptr();
        let steps: [__m256i; GROUP] = match q {
            QuantType::Q8_0 => {
                std::array::from_fn(|s| _mm256_loadu_si256(qs.add(32 * s) as *const __m256i))
            }
            _ => {
                let h = lay
                    .high
                    .map(|o| _mm256_loadu_si256(g[o..].as_ptr() as *const __m256i));
                std::array::from_fn(|s| {
                    let v = _mm256_loadu_si256(qs.add(32 * (s % 4)) as *const __m256i);
                    let v = if s < 4 { v } else { _mm256_srli_epi16::<4>(v) };
                    let nib = _mm256_and_si256(v, low);
                    match h {
                        Some(h) => _mm256_or_si256(nib, super::super::x86::fifth_bit(h, s)),
                        None => nib,
                    }
                })
            }
        };
        transpose(steps)
    }

    /// One group -> 8 ggml blocks.
    #[target_feature(enable = "avx2")]
    unsafe fn unpack_group(q: QuantType, g: &[u8], dst: &mut [u8]) {
        let (bb, lay) = (q.block_bytes(), layout(q));
        let (extra, qs_at) = ggml_offsets(q);
        let low = _mm256_set1_epi8(0x0F);
        let blocks = group_quants(q, g);
        for (j, v) in blocks.iter().enumerate() {
            let b = &mut dst[j * bb..(j + 1) * bb];
            b[..2].copy_from_slice(&g[2 * j..2 * j + 2]);
            if let Some(o) = lay.mins {
                b[extra..extra + 2].copy_from_slice(&g[o + 2 * j..o + 2 * j + 2]);
            }
            if q == QuantType::Q8_0 {
                _mm256_storeu_si256(b[qs_at..].as_mut_ptr() as *mut __m256i, *v);
                continue;
            }
            if lay.high.is_some() {
                let qh = _mm256_movemask_epi8(_mm256_slli_epi16::<3>(*v)) as u32;
                b[2..6].copy_from_slice(&qh.to_le_bytes());
            }
            let nib = _mm256_and_si256(*v, low);
            let packed = _mm_or_si128(
                _mm256_castsi256_si128(nib),
                _mm_slli_epi16::<4>(_mm256_extracti128_si256::<1>(nib)),
            );
            _mm_storeu_si128(b[qs_at..].as_mut_ptr() as *mut __m128i, packed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::random_row;

    /// Repacking keeps each block's values (read through the reference decoder) and unpacking
    /// restores the ggml bytes exactly, for whole groups, a ragged tail and tail-only rows.
    #[test]
    fn repack_then_unpack_is_identity() {
        for q in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
        ] {
            for blocks in [1, 7, 8, 9, 28, 33] {
                let src = random_row(q, blocks * QK, blocks as u64);
                let mut packed = vec![0u8; src.len()];
                repack_row(q, &src, &mut packed);
                let bb = q.block_bytes();
                for b in 0..blocks / GROUP * GROUP {
                    let g = &packed[b / GROUP * layout(q).bytes..];
                    assert_eq!(
                        group_block(q, g, b % GROUP),
                        from_ggml(q, &src[b * bb..(b + 1) * bb]),
                        "{q:?} block {b}"
                    );
                }
                let mut back = vec![0u8; src.len()];
                unpack_row(q, &packed, &mut back);
                assert_eq!(back, src, "{q:?} {blocks} blocks");
                for isa in Isa::supported() {
                    let (pack, unpack) = select(isa);
                    let mut p2 = vec![0u8; src.len()];
                    pack(q, &src, &mut p2);
                    assert_eq!(p2, packed, "{isa} {q:?} {blocks} blocks: repack");
                    unpack(q, &packed, &mut back);
                    assert_eq!(back, src, "{isa} {q:?} {blocks} blocks: unpack");
                    let mut want = vec![0f32; blocks * QK];
                    let mut got = vec![f32::NAN; blocks * QK];
                    crate::dequant::dequantize_row(q, &src, &mut want);
                    select_dequantize(isa)(q, &packed, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        // The SIMD tier fuses d * q + m into one rounding.
                        assert!(
                            (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                            "{isa} {q:?} dequantize {i}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
