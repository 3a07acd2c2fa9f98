//! Prefill product on 8-bit integers: a panel of [`PR`] weight rows against [`NT`] tokens.
//!
//! Weights are unpacked per group of `G` elements (16 or 32, `dequant::group_len`) into
//! integers `q` with a float `scale` and `off` (`dequant::unpack_block`: value
//! `scale * q + off`, exact); activations are [`BlockQ8A`]s (`x ~= d * qa`). Reference, for row
//! `r` and token `t`, over the groups `g` in order, in f32 with fused multiply-adds:
//!
//! ```text
//! acc = fma(float(sum_i q[r][g][i] * qa[t][g][i]), scale[r][g] * d[t][g], acc)
//! acc = fma(off[r][g], s[t][g], acc)          (types with offsets; s = d * sum(qa))
//! ```
//!
//! The integer sum is exact; it is computed as `sum (qa + 128) * q - 128 * sum(q)`, the form of
//! AVX-512 VNNI's `vpdpbusd` and AVX2's `vpmaddubsw` (unsigned by signed bytes), whose row-only
//! correction is the panel's `init`. Layout: the panel holds, per group, the rows' bytes interleaved by 4
//! (`[G / 4][PR][4]`), so one 64-byte load is 4 bytes of each of 16 rows and a broadcast
//! token's 4 bytes meet all 16 rows in one instruction (rows in lanes, as ggml's repacked
//! GEMMs). Every tier equals the scalar reference bit for bit (same operations, same order), so
//! a product does not depend on the tier that computed it nor on the thread count.
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QuantType, QK};

/// Rows of a panel: the 16 f32 lanes of an AVX-512 register.
pub const PR: usize = 16;
/// Tokens of one kernel call.
pub const NT: usize = 12;

/// `PR` weight rows unpacked for [`GemmFn`]: [`Panel::reset`], [`Panel::set_row`] for the
/// rows present, then [`Panel::finish`] (rows never set are zero).
pub struct Panel {
    pub qtype: QuantType,
    /// Elements per group (16 or 32) and whether `off` is used.
    pub g: usize,
    pub has_off: bool,
    pub groups: usize,
    /// `[PR][cols]`, `[PR][groups]`, `[PR][groups]`: the rows as unpacked, before `finish`.
    rows: Vec<i8>,
    row_scale: Vec<f32>,
    row_off: Vec<f32>,
    /// Rows set since `reset`.
    n: usize,
    /// `[cols / 4][PR][4]`: group `gi` is `q[gi * g * PR..][..g * PR]`.
    pub q: Vec<i8>,
    /// `[groups][PR]`: `-128 * sum(q)` over the row's group.
    pub init: Vec<i32>,
    /// `[groups][PR]` each.
    pub scale: Vec<f32>,
    pub off: Vec<f32>,
}

impl Default for Panel {
    fn default() -> Self {
        Self {
            qtype: QuantType::Q8_0,
            g: QK,
            has_off: false,
            groups: 0,
            rows: Vec::new(),
            row_scale: Vec::new(),
            row_off: Vec::new(),
            n: 0,
            q: Vec::new(),
            init: Vec::new(),
            scale: Vec::new(),
            off: Vec::new(),
        }
    }
}

impl Panel {
    /// An empty panel for rows of `cols` columns of the integer type `qtype`.
    pub fn reset(&mut self, qtype: QuantType, cols: usize) {
        assert!(
            qtype.block_len() > 1 && cols.is_multiple_of(qtype.block_len().max(QK)),
            "a panel of {cols} columns of {}",
            qtype.name()
        );
        self.qtype = qtype;
        self.g = crate::dequant::group_len(qtype);
        self.has_off = crate::dequant::has_offset(qtype);
        self.groups = cols / self.g;
        self.n = 0;
        let n = self.groups * PR;
        self.rows.resize(cols * PR, 0);
        self.q.resize(cols * PR, 0);
        for v in [
            &mut self.row_scale,
            &mut self.row_off,
            &mut self.scale,
            &mut self.off,
        ] {
            v.resize(n, 0.0);
        }
        self.init.resize(n, 0);
    }

    /// The next row of the panel from its ggml bytes, decoded by the tier's `unpack`.
    pub fn set_row(&mut self, bytes: &[u8], unpack: UnpackFn) {
        let (r, cols, groups) = (self.n, self.groups * self.g, self.groups);
        assert!(r < PR, "a panel holds {PR} rows");
        unpack(
            self.qtype,
            bytes,
            &mut self.rows[r * cols..][..cols],
            &mut self.row_scale[r * groups..][..groups],
            &mut self.row_off[r * groups..][..groups],
        );
        self.n += 1;
    }

    /// Rows in the kernel's layout (zero past the rows set), by the tier's `finish`.
    pub fn finish(&mut self, finish: FinishFn) {
        let (cols, groups) = (self.groups * self.g, self.groups);
        self.rows[self.n * cols..].fill(0);
        self.row_scale[self.n * groups..].fill(0.0);
        self.row_off[self.n * groups..].fill(0.0);
        finish(self);
        for r in 0..PR {
            for gi in 0..groups {
                self.scale[gi * PR + r] = self.row_scale[r * groups + gi];
                self.off[gi * PR + r] = self.row_off[r * groups + gi];
            }
        }
    }
}

/// The byte half of [`Panel::finish`]: `q` from `rows` (4-byte interleave) and `init`.
pub type FinishFn = fn(&mut Panel);

fn check_finish(p: &Panel) {
    let cols = p.groups * p.g;
    assert!(
        p.g.is_multiple_of(4)
            && p.rows.len() == cols * PR
            && p.q.len() == cols * PR
            && p.init.len() == p.groups * PR,
        "panel of {} groups of {}",
        p.groups,
        p.g
    );
}

/// The reference [`FinishFn`].
pub fn finish_scalar(p: &mut Panel) {
    check_finish(p);
    let (cols, g) = (p.groups * p.g, p.g);
    for (r, row) in p.rows.chunks_exact(cols).enumerate() {
        for (c, four) in row.chunks_exact(4).enumerate() {
            p.q[(c * PR + r) * 4..][..4].copy_from_slice(four);
        }
        for (gi, qg) in row.chunks_exact(g).enumerate() {
            p.init[gi * PR + r] = -128 * qg.iter().map(|&v| v as i32).sum::<i32>();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn finish_avx2(p: &mut Panel) {
    check_finish(p);
    // SAFETY: handed out by `select` only for the AVX2 tier; extents checked above.
    unsafe { finish_avx2_impl(p) }
}

/// One gather per 4-byte column and half panel (4 bytes of each of 8 rows), and the group sums
/// from the gathered registers: `vpmaddubsw` with 128 in every unsigned byte (a pair,
/// `128 (q0 + q1)`, lies in `-2^15..=2^15 - 256`: no saturation), then `vpmaddwd` by ones.
/// The AVX-512 tier uses it too (a 16-lane gather measured no faster).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_avx2_impl(p: &mut Panel) {
    use std::arch::x86_64::*;
    let (cols, g) = (p.groups * p.g, p.g);
    let rows = _mm256_mullo_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(cols as i32),
    );
    let (k128, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    let (src, dst) = (p.rows.as_ptr(), p.q.as_mut_ptr());
    for gi in 0..p.groups {
        for h in 0..2 {
            let mut sum = _mm256_setzero_si256();
            let base = src.add(h * 8 * cols);
            for s in 0..g / 4 {
                let c = gi * g / 4 + s;
                let v = _mm256_i32gather_epi32::<1>(base.add(4 * c) as *const i32, rows);
                _mm256_storeu_si256(dst.add(c * 4 * PR + 32 * h) as *mut __m256i, v);
                let pairs = _mm256_maddubs_epi16(k128, v);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
            }
            let init = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
            _mm256_storeu_si256(
                p.init.as_mut_ptr().add(gi * PR + 8 * h) as *mut __m256i,
                init,
            );
        }
    }
}

/// A row of an integer type decoded as [`crate::dequant::unpack_block`] does, block by block:
/// `(qtype, ggml bytes, q[cols], scale[cols / G], off[cols / G])`.
pub type UnpackFn = fn(QuantType, &[u8], &mut [i8], &mut [f32], &mut [f32]);

/// The length contract of an [`UnpackFn`], checked by every tier in release builds.
fn check_unpack(qtype: QuantType, bytes: &[u8], q: &[i8], scale: &[f32], off: &[f32]) {
    let g = crate::dequant::group_len(qtype);
    assert!(
        qtype.block_len() > 1
            && q.len().is_multiple_of(qtype.block_len())
            && bytes.len() == qtype.row_bytes(q.len())
            && scale.len() * g == q.len()
            && off.len() == scale.len(),
        "unpacking {} bytes of {} into {} values",
        bytes.len(),
        qtype.name(),
        q.len()
    );
}

/// The reference [`UnpackFn`].
pub fn unpack_scalar(
    qtype: QuantType,
    bytes: &[u8],
    q: &mut [i8],
    scale: &mut [f32],
    off: &mut [f32],
) {
    check_unpack(qtype, bytes, q, scale, off);
    let (bl, bb) = (qtype.block_len(), qtype.block_bytes());
    let gb = bl / crate::dequant::group_len(qtype);
    for (((b, q), s), o) in bytes
        .chunks_exact(bb)
        .zip(q.chunks_exact_mut(bl))
        .zip(scale.chunks_exact_mut(gb))
        .zip(off.chunks_exact_mut(gb))
    {
        crate::dequant::unpack_block(qtype, b, q, s, o);
    }
}

#[cfg(target_arch = "x86_64")]
fn unpack_avx2(qtype: QuantType, bytes: &[u8], q: &mut [i8], scale: &mut [f32], off: &mut [f32]) {
    check_unpack(qtype, bytes, q, scale, off);
    match qtype {
        // SAFETY: handed out by `select` only for tiers with AVX2/F16C; the extents were checked.
        QuantType::Q8_0
        | QuantType::Q4_0
        | QuantType::Q4_1
        | QuantType::Q5_0
        | QuantType::Q5_1
        | QuantType::IQ4NL => unsafe { unpack32_avx2(qtype, bytes, q, scale, off) },
        // SAFETY: as above.
        QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => unsafe {
            unpack256_avx2(qtype, bytes, q, scale, off)
        },
        _ => unpack_scalar(qtype, bytes, q, scale, off),
    }
}

/// The 32-element block types: one block per register (`dequantize::block32_avx2`), the loop
/// instantiated per type so the decoder's type dispatch folds away.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack32_avx2(
    qtype: QuantType,
    bytes: &[u8],
    q: &mut [i8],
    scale: &mut [f32],
    off: &mut [f32],
) {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn each(t: QuantType, bytes: &[u8], q: &mut [i8], scale: &mut [f32], off: &mut [f32]) {
        use std::arch::x86_64::*;
        for (i, b) in bytes.chunks_exact(t.block_bytes()).enumerate() {
            let (v, d, m) = super::dequantize::block32_avx2(t, b);
            (scale[i], off[i]) = (d, m);
            _mm256_storeu_si256(q.as_mut_ptr().add(32 * i) as *mut __m256i, v);
        }
    }
    match qtype {
        QuantType::Q8_0 => each(QuantType::Q8_0, bytes, q, scale, off),
        QuantType::Q4_0 => each(QuantType::Q4_0, bytes, q, scale, off),
        QuantType::Q4_1 => each(QuantType::Q4_1, bytes, q, scale, off),
        QuantType::Q5_0 => each(QuantType::Q5_0, bytes, q, scale, off),
        QuantType::Q5_1 => each(QuantType::Q5_1, bytes, q, scale, off),
        _ => each(QuantType::IQ4NL, bytes, q, scale, off),
    }
}

/// Q4_K, Q5_K and Q6_K: the quants 32 at a time (the formulas of `dequant::unpack_block`), the
/// scales and mins in scalar.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack256_avx2(
    qtype: QuantType,
    bytes: &[u8],
    q: &mut [i8],
    scale: &mut [f32],
    off: &mut [f32],
) {
    use super::x86::*;
    use dejavu_backend_api::quant::{q4k_scale_min, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
    use std::arch::x86_64::*;
    let bb = qtype.block_bytes();
    let load = |p: &[u8]| _mm256_loadu_si256(p.as_ptr() as *const __m256i);
    let low4 = _mm256_set1_epi8(0x0F);
    let hi2 = _mm256_set1_epi8(0x30);
    for (i, b) in bytes.chunks_exact(bb).enumerate() {
        let out = q.as_mut_ptr().add(QK_K * i) as *mut __m256i;
        match qtype {
            QuantType::Q6K => {
                let b: BlockQ6K = bytemuck::pod_read_unaligned(b);
                let d = f16(b.d);
                for (s, &sc) in scale[16 * i..][..16].iter_mut().zip(&b.scales) {
                    *s = d * sc as f32;
                }
                off[16 * i..][..16].fill(0.0);
                for n in 0..2 {
                    let (a, c) = (load(&b.ql[64 * n..]), load(&b.ql[64 * n + 32..]));
                    let h = load(&b.qh[32 * n..]);
                    let parts = [
                        (a, _mm256_slli_epi16::<4>(h)),
                        (c, _mm256_slli_epi16::<2>(h)),
                        (_mm256_srli_epi16::<4>(a), h),
                        (_mm256_srli_epi16::<4>(c), _mm256_srli_epi16::<2>(h)),
                    ];
                    for (k, (lo, hi)) in parts.into_iter().enumerate() {
                        let v =
                            _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_and_si256(hi, hi2));
                        let v = _mm256_sub_epi8(v, _mm256_set1_epi8(32));
                        _mm256_storeu_si256(out.add(4 * n + k), v);
                    }
                }
            }
            _ => {
                let (d, dmin, scales, qs, qh) = if qtype == QuantType::Q4K {
                    let b: BlockQ4K = bytemuck::pod_read_unaligned(b);
                    (b.d, b.dmin, b.scales, b.qs, None)
                } else {
                    let b: BlockQ5K = bytemuck::pod_read_unaligned(b);
                    (b.d, b.dmin, b.scales, b.qs, Some(load(&b.qh)))
                };
                let (d, dmin) = (f16(d), f16(dmin));
                for j in 0..8 {
                    let (sc, m) = q4k_scale_min(j, &scales);
                    scale[8 * i + j] = d * sc as f32;
                    off[8 * i + j] = -(dmin * m as f32);
                    let v = load(&qs[32 * (j / 2)..]);
                    let v = if j % 2 == 0 {
                        v
                    } else {
                        _mm256_srli_epi16::<4>(v)
                    };
                    let v = _mm256_and_si256(v, low4);
                    let v = match qh {
                        Some(h) => _mm256_or_si256(v, fifth_bit(h, j)),
                        None => v,
                    };
                    _mm256_storeu_si256(out.add(j), v);
                }
            }
        }
    }
}

/// Tokens prepared for [`GemmFn`], per group of `g` elements: the activation bytes plus 128
/// (`u8`), and each group's `d` and `s` (`d * sum(qa)` over the group).
#[derive(Default)]
pub struct Acts {
    pub g: usize,
    pub cols: usize,
    /// Tokens, padded to a multiple of [`NT`] with zero activations.
    pub n_tok: usize,
    pub u: Vec<u8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl Acts {
    /// `blocks` holds `n` tokens of `cols / 32` blocks each.
    pub fn build(&mut self, g: usize, cols: usize, blocks: &[BlockQ8A]) {
        assert!(g == 16 || g == QK, "group of {g}");
        assert!(cols.is_multiple_of(QK) && blocks.len().is_multiple_of(cols / QK));
        let n = blocks.len() / (cols / QK).max(1);
        let (padded, groups) = (n.div_ceil(NT) * NT, cols / g);
        self.g = g;
        self.cols = cols;
        self.n_tok = padded;
        self.u.clear();
        self.u.resize(padded * cols, 128);
        for v in [&mut self.d, &mut self.s] {
            v.clear();
            v.resize(padded * groups, 0.0);
        }
        for (i, b) in blocks.iter().enumerate() {
            for (u, &q) in self.u[i * QK..][..QK].iter_mut().zip(&b.qs) {
                *u = (q as i16 + 128) as u8;
            }
            for (h, qh) in b.qs.chunks_exact(g).enumerate() {
                let gi = i * (QK / g) + h;
                self.d[gi] = b.d;
                self.s[gi] = b.d * qh.iter().map(|&v| v as i32).sum::<i32>() as f32;
            }
        }
    }
}

/// `out[t][r] = row r of the panel . token t0 + t` for the [`NT`] tokens from `t0`.
pub type GemmFn = fn(&Panel, &Acts, usize, &mut [[f32; PR]; NT]);

/// A tier's integer prefill: its row decoder and its kernel.
#[derive(Clone, Copy)]
pub struct Gemm {
    /// The weight types the kernel multiplies exactly (others take the f32 path).
    pub types: fn(QuantType) -> bool,
    pub unpack: UnpackFn,
    pub finish: FinishFn,
    pub kernel: GemmFn,
}

/// Every integer type (`vpdpbusd` sums in i32).
#[cfg(target_arch = "x86_64")]
fn all_integer_types(q: QuantType) -> bool {
    q.block_len() > 1
}

/// The types whose values stay within +-64, so AVX2's `vpmaddubsw` (pairs of (qa + 128) * q
/// summed in i16, saturating) never saturates: 2 * 255 * 64 < 2^15. Q8_0 and the IQ4 types
/// (values up to +-127) are left out.
#[cfg(target_arch = "x86_64")]
fn small_integer_types(q: QuantType) -> bool {
    all_integer_types(q) && !matches!(q, QuantType::Q8_0 | QuantType::IQ4NL | QuantType::IQ4XS)
}

/// The tier's kernels; `None` where the f32 `gemm` path is faster (tiers without `vpdpbusd`).
pub fn select(isa: Isa) -> Option<Gemm> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(Gemm {
            types: all_integer_types,
            unpack: unpack_avx2,
            finish: finish_avx2,
            kernel: avx512,
        }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(Gemm {
            types: small_integer_types,
            unpack: unpack_avx2,
            finish: finish_avx2,
            kernel: avx2,
        }),
        _ => None,
    }
}

/// The shape contract, checked by every tier in release builds (the SIMD tier reads through raw
/// pointers): panel and tokens of one group size and width, and `t0 + NT` tokens present.
fn check(p: &Panel, a: &Acts, t0: usize) {
    let n = p.groups * PR;
    assert!(
        (p.g == 16 || p.g == QK)
            && p.g == a.g
            && p.groups * p.g == a.cols
            && p.q.len() == a.cols * PR
            && p.init.len() == n
            && p.scale.len() == n
            && p.off.len() == n
            && t0 + NT <= a.n_tok
            && a.u.len() == a.n_tok * a.cols
            && a.d.len() == a.n_tok * p.groups
            && a.s.len() == a.d.len(),
        "gemm_q8a: a panel of {} x {} against {} tokens of {} x {} from token {t0}",
        p.groups,
        p.g,
        a.n_tok,
        a.cols / a.g.max(1),
        a.g
    );
}

pub fn scalar(p: &Panel, a: &Acts, t0: usize, out: &mut [[f32; PR]; NT]) {
    check(p, a, t0);
    let (g, cols) = (p.g, a.cols);
    for (t, out) in out.iter_mut().enumerate() {
        let tok = t0 + t;
        for (r, out) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for gi in 0..p.groups {
                let u = &a.u[tok * cols + gi * g..][..g];
                let q = &p.q[gi * g * PR..][..g * PR];
                let mut dot = p.init[gi * PR + r];
                for (i, &u) in u.iter().enumerate() {
                    dot += u as i32 * q[(i / 4 * PR + r) * 4 + i % 4] as i32;
                }
                let (d, s) = (a.d[tok * p.groups + gi], a.s[tok * p.groups + gi]);
                acc = (dot as f32).mul_add(p.scale[gi * PR + r] * d, acc);
                if p.has_off {
                    acc = p.off[gi * PR + r].mul_add(s, acc);
                }
            }
            *out = acc;
        }
    }
}

/// `$impl::<G, OFF>(args)` for the panel's group size and offsets.
#[cfg(target_arch = "x86_64")]
macro_rules! by_group {
    ($impl:ident, $p:expr, $($arg:expr),*) => {
        match ($p.g, $p.has_off) {
            (16, false) => $impl::<16, false>($p, $($arg),*),
            (16, true) => $impl::<16, true>($p, $($arg),*),
            (_, false) => $impl::<32, false>($p, $($arg),*),
            (_, true) => $impl::<32, true>($p, $($arg),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
fn avx512(p: &Panel, a: &Acts, t0: usize, out: &mut [[f32; PR]; NT]) {
    check(p, a, t0);
    // SAFETY: handed out by `select` only for the AVX-512 tier, whose features this CPU has; the
    // extents were checked above.
    unsafe { by_group!(avx512_impl, p, a, t0, out) }
}

/// Callers guarantee the AVX-512 VNNI features and the extents of [`check`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn avx512_impl<const G: usize, const OFF: bool>(
    p: &Panel,
    a: &Acts,
    t0: usize,
    out: &mut [[f32; PR]; NT],
) {
    use std::arch::x86_64::*;
    let (groups, cols) = (p.groups, a.cols);
    let mut acc = [_mm512_setzero_ps(); NT];
    for gi in 0..groups {
        let init = _mm512_loadu_si512(p.init.as_ptr().add(gi * PR) as *const _);
        let mut dots = [init; NT];
        let q = p.q.as_ptr().add(gi * G * PR);
        let u = a.u.as_ptr().add(t0 * cols + gi * G);
        for s in 0..G / 4 {
            let w = _mm512_loadu_si512(q.add(s * 4 * PR) as *const _);
            for (t, dot) in dots.iter_mut().enumerate() {
                let x = (u.add(t * cols + 4 * s) as *const i32).read_unaligned();
                *dot = _mm512_dpbusd_epi32(*dot, _mm512_set1_epi32(x), w);
            }
        }
        let scale = _mm512_loadu_ps(p.scale.as_ptr().add(gi * PR));
        let off = _mm512_loadu_ps(p.off.as_ptr().add(gi * PR));
        for (t, (acc, dot)) in acc.iter_mut().zip(dots).enumerate() {
            let i = (t0 + t) * groups + gi;
            let ds = _mm512_mul_ps(scale, _mm512_set1_ps(*a.d.get_unchecked(i)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, *acc);
            if OFF {
                *acc = _mm512_fmadd_ps(off, _mm512_set1_ps(*a.s.get_unchecked(i)), *acc);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        _mm512_storeu_ps(o.as_mut_ptr(), acc);
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(p: &Panel, a: &Acts, t0: usize, out: &mut [[f32; PR]; NT]) {
    check(p, a, t0);
    assert!(
        small_integer_types(p.qtype),
        "gemm_q8a: {} values saturate AVX2's byte products",
        p.qtype.name()
    );
    // SAFETY: handed out by `select` only for the AVX2 tier, whose features this CPU has; the
    // extents were checked above, and the type's values keep `vpmaddubsw` from saturating.
    unsafe { by_group!(avx2_impl, p, a, t0, out) }
}

/// Tokens of one register block on AVX2 (16 registers: 2 per token's integer sums, the two
/// weight halves, a broadcast, the ones).
#[cfg(target_arch = "x86_64")]
const TB2: usize = 6;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(NT.is_multiple_of(TB2));

/// The AVX-512 kernel's operations on 8-row halves: `vpmaddubsw` + `vpmaddwd` for
/// `vpdpbusd`, the float sums kept in `out` (L1) between groups.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl<const G: usize, const OFF: bool>(
    p: &Panel,
    a: &Acts,
    t0: usize,
    out: &mut [[f32; PR]; NT],
) {
    use std::arch::x86_64::*;
    let (groups, cols) = (p.groups, a.cols);
    let ones = _mm256_set1_epi16(1);
    *out = [[0.0; PR]; NT];
    for tb in (0..NT).step_by(TB2) {
        for gi in 0..groups {
            let init = p.init.as_ptr().add(gi * PR) as *const __m256i;
            let (i0, i1) = (_mm256_loadu_si256(init), _mm256_loadu_si256(init.add(1)));
            let mut dots = [[i0, i1]; TB2];
            let q = p.q.as_ptr().add(gi * G * PR);
            let u = a.u.as_ptr().add((t0 + tb) * cols + gi * G);
            for s in 0..G / 4 {
                let w = q.add(s * 4 * PR) as *const __m256i;
                let (w0, w1) = (_mm256_loadu_si256(w), _mm256_loadu_si256(w.add(1)));
                for (t, dot) in dots.iter_mut().enumerate() {
                    let x = (u.add(t * cols + 4 * s) as *const i32).read_unaligned();
                    let x = _mm256_set1_epi32(x);
                    let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(x, w0), ones);
                    let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(x, w1), ones);
                    dot[0] = _mm256_add_epi32(dot[0], p0);
                    dot[1] = _mm256_add_epi32(dot[1], p1);
                }
            }
            for (t, dot) in dots.iter().enumerate() {
                let i = (t0 + tb + t) * groups + gi;
                let (d, sa) = (*a.d.get_unchecked(i), *a.s.get_unchecked(i));
                let o = out[tb + t].as_mut_ptr();
                for (h, &dot) in dot.iter().enumerate() {
                    let scale = _mm256_loadu_ps(p.scale.as_ptr().add(gi * PR + 8 * h));
                    let ds = _mm256_mul_ps(scale, _mm256_set1_ps(d));
                    let acc = _mm256_loadu_ps(o.add(8 * h));
                    let mut acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc);
                    if OFF {
                        let off = _mm256_loadu_ps(p.off.as_ptr().add(gi * PR + 8 * h));
                        acc = _mm256_fmadd_ps(off, _mm256_set1_ps(sa), acc);
                    }
                    _mm256_storeu_ps(o.add(8 * h), acc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{random_f32, random_row};

    /// Every tier's kernel equals the scalar reference bit for bit, and the reference equals the
    /// dequantized rows dotted with the dequantized activations within float rounding
    /// (1e-5 of the sum of |products|): every integer type, ragged row counts (a panel partly
    /// empty), widths of one and several super-blocks, a token count that is not a multiple of
    /// `NT` (padding).
    #[test]
    fn tiers_match_scalar_and_dequantized() {
        let tiers: Vec<_> = Isa::supported()
            .into_iter()
            .filter_map(|i| select(i).map(|f| (i, f)))
            .collect();
        eprintln!(
            "gemm_q8a: checking tiers {:?} against scalar",
            tiers.iter().map(|t| t.0).collect::<Vec<_>>()
        );
        let quantize = crate::kernels::quantize_act::scalar;
        for q in QuantType::ALL.into_iter().filter(|q| q.block_len() > 1) {
            for (cols, rows, n_tok) in [(256, 16, 8), (512, 5, 11), (768, 13, 3)] {
                let data: Vec<Vec<u8>> = (0..rows)
                    .map(|r| random_row(q, cols, 31 * r as u64 + cols as u64))
                    .collect();
                let mut panel = Panel::default();
                panel.reset(q, cols);
                for row in &data {
                    panel.set_row(row, unpack_scalar);
                }
                panel.finish(finish_scalar);
                let x = random_f32(n_tok * cols, 7 + rows as u64);
                let mut blocks = vec![bytemuck::Zeroable::zeroed(); n_tok * cols / QK];
                for (xt, bt) in x.chunks_exact(cols).zip(blocks.chunks_exact_mut(cols / QK)) {
                    quantize(xt, bt);
                }
                let mut acts = Acts::default();
                acts.build(panel.g, cols, &blocks);
                let mut wrow = vec![0f32; cols];
                for t0 in (0..acts.n_tok).step_by(NT) {
                    let mut want = [[0f32; PR]; NT];
                    scalar(&panel, &acts, t0, &mut want);
                    for (isa, f) in tiers.iter().filter(|(_, f)| (f.types)(q)) {
                        let mut got = [[1f32; PR]; NT];
                        (f.kernel)(&panel, &acts, t0, &mut got);
                        assert_eq!(got, want, "{isa} {q:?} cols {cols} from token {t0}");
                    }
                    for (t, want) in want.iter().enumerate().filter(|(t, _)| t0 + t < n_tok) {
                        let xa: Vec<f32> = blocks[(t0 + t) * cols / QK..][..cols / QK]
                            .iter()
                            .flat_map(|b| b.qs.map(|v| b.d * v as f32))
                            .collect();
                        for (r, &w) in want.iter().enumerate() {
                            if r >= rows {
                                assert_eq!(w, 0.0, "{q:?} empty row {r}");
                                continue;
                            }
                            crate::dequant::dequantize_row(q, &data[r], &mut wrow);
                            let exact: f64 =
                                wrow.iter().zip(&xa).map(|(a, b)| (a * b) as f64).sum();
                            let mag: f32 = wrow.iter().zip(&xa).map(|(a, b)| (a * b).abs()).sum();
                            assert!(
                                (w as f64 - exact).abs() <= 1e-5 * mag as f64 + 1e-6,
                                "{q:?} cols {cols} token {} row {r}: {w} vs {exact}",
                                t0 + t
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every tier's row decoder equals the reference, for every integer type, one block and
    /// several.
    #[test]
    fn unpack_tiers_match_scalar() {
        for isa in Isa::supported() {
            let Some(f) = select(isa) else { continue };
            for q in QuantType::ALL.into_iter().filter(|q| q.block_len() > 1) {
                let g = crate::dequant::group_len(q);
                for nb in [1, 3] {
                    let n = nb * q.block_len().max(QK);
                    let row = random_row(q, n, nb as u64);
                    let mut want = (vec![0i8; n], vec![0f32; n / g], vec![0f32; n / g]);
                    let mut got = (vec![1i8; n], vec![1f32; n / g], vec![1f32; n / g]);
                    unpack_scalar(q, &row, &mut want.0, &mut want.1, &mut want.2);
                    (f.unpack)(q, &row, &mut got.0, &mut got.1, &mut got.2);
                    assert_eq!(got, want, "{isa} {q:?} {nb} blocks");
                }
            }
        }
    }

    /// Every tier's panel layout equals the reference's, for both group sizes and a partly
    /// empty panel.
    #[test]
    fn finish_tiers_match_scalar() {
        for isa in Isa::supported() {
            let Some(f) = select(isa) else { continue };
            for (q, rows) in [
                (QuantType::Q8_0, 16),
                (QuantType::Q6K, 9),
                (QuantType::Q4_1, 1),
            ] {
                let cols = 512;
                let mut want = Panel::default();
                let mut got = Panel::default();
                for (p, fin) in [(&mut want, finish_scalar as FinishFn), (&mut got, f.finish)] {
                    p.reset(q, cols);
                    for r in 0..rows {
                        p.set_row(&random_row(q, cols, r), unpack_scalar);
                    }
                    p.finish(fin);
                }
                assert_eq!((&got.q, &got.init), (&want.q, &want.init), "{isa} {q:?}");
                assert_eq!(
                    (&got.scale, &got.off),
                    (&want.scale, &want.off),
                    "{isa} {q:?}"
                );
            }
        }
    }
}
