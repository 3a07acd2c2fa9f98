//! `out[j] = x . r_j` where `r_j = rows[j * stride..][..x.len()]`: one vector against many rows
//! of f32 or f16 (attention's query against the cached keys of an f32 or f16 KV cache).
//!
//! Reference: each element widened to f32 (exact), then a plain f32 sum per row, in order. The
//! SIMD tiers sum in 8-lane blocks with fused multiply-add (widening f16 with F16C on x86), so
//! they differ by rounding only.
#[cfg(target_arch = "x86_64")]
use super::x86::Lanes;
use super::{each_vector, RowElem};
use crate::isa::Isa;
use half::f16;

/// `(x, rows, stride, out)`; `rows` holds `out.len()` rows at `stride`.
pub type DotRowsFn<T = f32> = fn(&[f32], &[T], usize, &mut [f32]);

pub fn select(isa: Isa) -> DotRowsFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// The same over f16 rows.
pub fn select_f16(isa: Isa) -> DotRowsFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// `(xs, rows, stride, outs)`: several vectors against the same rows (the query heads of one
/// KV group against its keys), `outs[h]` as [`DotRowsFn`] of the same tier gives `xs[h]` alone,
/// bit for bit. The x86 tiers read each row once for up to [`MANY_AVX2`] (AVX2) or
/// [`MANY_AVX512`] (AVX-512: 32 registers, a block's rows in pairs on 512 bits) vectors; the
/// others go vector by vector.
pub type DotRowsManyFn<T = f32> = fn(&[&[f32]], &[T], usize, &mut [&mut [f32]]);

/// Vectors per read of the rows on the AVX2 tier (16 registers: 4 rows' sums per vector).
pub const MANY_AVX2: usize = 2;
/// The same on the AVX-512 tier.
pub const MANY_AVX512: usize = 4;

pub fn select_many(isa: Isa) -> DotRowsManyFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_many,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_many,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |xs, r, st, o| each_vector("dot_rows", portable, xs, r, st, o)
        }
        _ => |xs, r, st, o| each_vector("dot_rows", scalar, xs, r, st, o),
    }
}

/// The same over f16 rows.
pub fn select_many_f16(isa: Isa) -> DotRowsManyFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_many_f16,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_many_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |xs, r, st, o| each_vector("dot_rows", portable, xs, r, st, o)
        }
        _ => |xs, r, st, o| each_vector("dot_rows", scalar, xs, r, st, o),
    }
}

fn check<T>(x: &[f32], rows: &[T], stride: usize, out: &[f32]) {
    assert!(
        out.is_empty() || (stride >= x.len() && rows.len() >= (out.len() - 1) * stride + x.len()),
        "dot_rows: {} rows of {} at stride {stride} need more than {} elements",
        out.len(),
        x.len(),
        rows.len()
    );
}

pub fn scalar<T: RowElem>(x: &[f32], rows: &[T], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    for (j, o) in out.iter_mut().enumerate() {
        *o = x
            .iter()
            .zip(&rows[j * stride..])
            .map(|(a, b)| a * b.widen())
            .sum();
    }
}

pub fn portable<T: RowElem>(x: &[f32], rows: &[T], stride: usize, out: &mut [f32]) {
    use wide::f32x8;
    check(x, rows, stride, out);
    let n8 = x.len() / 8 * 8;
    for (j, o) in out.iter_mut().enumerate() {
        let r = &rows[j * stride..j * stride + x.len()];
        let mut acc = f32x8::ZERO;
        for c in (0..n8).step_by(8) {
            acc = T::load8(&r[c..]).mul_add(f32x8::from(&x[c..c + 8]), acc);
        }
        *o = acc.reduce_add()
            + x[n8..]
                .iter()
                .zip(&r[n8..])
                .map(|(a, b)| a * b.widen())
                .sum::<f32>();
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    // SAFETY: handed out by `select` only for tiers whose features this CPU has; bounds checked.
    unsafe { avx2_impl::<f32, 1>(&[x], rows, stride, &mut [out]) }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16(x: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    check(x, rows, stride, out);
    // SAFETY: handed out by `select_f16` only for tiers whose features (AVX2, FMA, F16C) this
    // CPU has; every row read lies inside `rows` (checked above).
    unsafe { avx2_impl::<f16, 1>(&[x], rows, stride, &mut [out]) }
}

/// One tier's entry of [`DotRowsManyFn`] for rows of `$t`: checks every extent, then runs
/// `$impl` on at most `$max` vectors at a time.
#[cfg(target_arch = "x86_64")]
macro_rules! many_entry {
    ($name:ident, $t:ty, $impl:ident, $max:expr) => {
        fn $name(xs: &[&[f32]], rows: &[$t], stride: usize, outs: &mut [&mut [f32]]) {
            super::check_many("dot_rows", xs, outs);
            if let (Some(x), Some(o)) = (xs.first(), outs.first()) {
                check(x, rows, stride, o);
            }
            for (x, o) in xs.chunks($max).zip(outs.chunks_mut($max)) {
                // SAFETY: handed out by `select_many*` only for tiers whose features this CPU
                // has; every vector and output has the checked lengths.
                unsafe {
                    match x.len() {
                        1 => $impl::<$t, 1>(x, rows, stride, o),
                        2 => $impl::<$t, 2>(x, rows, stride, o),
                        3 => $impl::<$t, 3>(x, rows, stride, o),
                        _ => $impl::<$t, 4>(x, rows, stride, o),
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
many_entry!(avx2_many, f32, avx2_impl, MANY_AVX2);
#[cfg(target_arch = "x86_64")]
many_entry!(avx2_many_f16, f16, avx2_impl, MANY_AVX2);
#[cfg(target_arch = "x86_64")]
many_entry!(avx512_many, f32, avx512_impl, MANY_AVX512);
#[cfg(target_arch = "x86_64")]
many_entry!(avx512_many_f16, f16, avx512_impl, MANY_AVX512);

/// The AVX2 tier's body over rows of `T` ([`rows_in_blocks`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_impl<T: Lanes, const Q: usize>(
    xs: &[&[f32]],
    rows: &[T],
    stride: usize,
    outs: &mut [&mut [f32]],
) {
    let row = |j: usize| rows.as_ptr().add(j * stride);
    let far = super::x86::spans_far::<T>(outs[0].len(), stride);
    rows_in_blocks::<Q>(
        xs,
        outs,
        |c, j| T::x8(row(j).add(c)),
        |i, j| (*row(j).add(i)).widen(),
        far.then_some(|j: usize| {
            crate::prefetch::prefetch(bytemuck::cast_slice(&rows[j * stride..][..xs[0].len()]))
        }),
    );
}

/// The AVX-512 tier's body over rows of `T`: [`rows_in_blocks_wide`] (one conversion for two
/// rows' 8 f16 values), bit for bit the AVX2 body's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn avx512_impl<T: Lanes, const Q: usize>(
    xs: &[&[f32]],
    rows: &[T],
    stride: usize,
    outs: &mut [&mut [f32]],
) {
    let row = |j: usize| rows.as_ptr().add(j * stride);
    let far = super::x86::spans_far::<T>(outs[0].len(), stride);
    rows_in_blocks_wide::<Q>(
        xs,
        outs,
        |c, j| T::x8_pair(row(j).add(c), row(j + 1).add(c)),
        |c, j| T::x8(row(j).add(c)),
        |i, j| (*row(j).add(i)).widen(),
        far.then_some(|j: usize| {
            crate::prefetch::prefetch(bytemuck::cast_slice(&rows[j * stride..][..xs[0].len()]))
        }),
    );
}

/// Rows dotted together by the x86 tiers: four independent sums in flight (a decode step's
/// keys are short rows, 64 or 128 values, so one sum's chain of multiply-adds and its own
/// horizontal sum would bound the loop), reduced together at the end.
#[cfg(target_arch = "x86_64")]
const BLOCK: usize = 4;

/// Rows ahead of the block being read that the x86 tiers prefetch: a head's keys are strided
/// slices of the cache (one KV group's part of each position), which the hardware prefetchers
/// follow poorly. Only where the rows span [`super::x86::PREFETCH_SPAN`] or more. Measured with
/// axpy.rs's prefetch of the values, SmolLM2 at a 2048-token context: 8 rows 63.9-64.7 ->
/// 43.7-45.9 ms a step, one row 9.6-10.5 -> 8.4-9.0.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// `outs[h][j] = xs[h] . row j` for every `j` and each of the `Q` vectors (the first `Q` of
/// `xs` and `outs`): the rows in blocks of [`BLOCK`] (`prefetch`, if any, called for the rows
/// [`AHEAD`] rows on, those below `outs[0].len()`), each row's eight-wide sum over the
/// vectors' whole groups of 8 (`load(c, j)`: row `j`'s values `c..c + 8`, loaded once for all
/// `Q`), the block's sums reduced together, then the tail values (`value(i, j)`) added in order;
/// the rows past the last whole block one by one, the same way. Each vector's operations are
/// the same at any `Q`, so its outputs are too.
///
/// # Safety
/// The caller's tier has AVX2 and FMA (and what `load` needs); `xs` and `outs` hold at least
/// `Q` entries, the vectors of one length, the outputs of one length; `load` and `value` read
/// inside the rows for every `j < outs[0].len()`, `c + 8 <= xs[0].len()` and `i < xs[0].len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_in_blocks<const Q: usize>(
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    value: impl Fn(usize, usize) -> f32,
    prefetch: Option<impl Fn(usize)>,
) {
    use std::arch::x86_64::*;
    let n8 = xs[0].len() / 8 * 8;
    let xp: [*const f32; Q] = std::array::from_fn(|h| xs[h].as_ptr());
    let block = |j: usize| {
        let mut acc = [[_mm256_setzero_ps(); BLOCK]; Q];
        for c in (0..n8).step_by(8) {
            let r: [__m256; BLOCK] = std::array::from_fn(|b| load(c, j + b));
            for (h, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp[h].add(c));
                for (b, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(r[b], xv, *a);
                }
            }
        }
        acc
    };
    in_row_blocks::<Q>(xs, outs, block, &load, value, prefetch);
}

/// The loop of [`rows_in_blocks`] and [`rows_in_blocks_wide`]: per block of [`BLOCK`] rows
/// from `j` (prefetching [`AHEAD`] rows on), `block(j)`'s eight-wide sums of each vector with
/// each row, reduced together, the tail values added in order; then the rows past the last
/// block one by one ([`rows_one_by_one`]).
///
/// # Safety
/// As [`rows_in_blocks`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn in_row_blocks<const Q: usize>(
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
    block: impl Fn(usize) -> [[std::arch::x86_64::__m256; BLOCK]; Q],
    load: &impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    value: impl Fn(usize, usize) -> f32,
    prefetch: Option<impl Fn(usize)>,
) {
    let (n, n_out) = (xs[0].len(), outs[0].len());
    let n8 = n / 8 * 8;
    let xp: [*const f32; Q] = std::array::from_fn(|h| xs[h].as_ptr());
    let op: [*mut f32; Q] = std::array::from_fn(|h| outs[h].as_mut_ptr());
    let tail =
        |h: usize, j: usize| -> f32 { (n8..n).fold(0.0, |s, i| s + *xp[h].add(i) * value(i, j)) };
    let full = n_out / BLOCK * BLOCK;
    for j in (0..full).step_by(BLOCK) {
        if let Some(pf) = &prefetch {
            for b in j + AHEAD..(j + AHEAD + BLOCK).min(n_out) {
                pf(b);
            }
        }
        for (h, acc) in block(j).iter().enumerate() {
            for (b, sb) in block_sums(acc).into_iter().enumerate() {
                *op[h].add(j + b) = sb + tail(h, j + b);
            }
        }
    }
    rows_one_by_one::<Q>(xs, outs, full, load, &value);
}

/// Four horizontal sums of a block's rows at once: pairs, then pairs of pairs, then the two
/// halves.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_sums(acc: &[std::arch::x86_64::__m256; BLOCK]) -> [f32; BLOCK] {
    use std::arch::x86_64::*;
    let (h01, h23) = (
        _mm256_hadd_ps(acc[0], acc[1]),
        _mm256_hadd_ps(acc[2], acc[3]),
    );
    let v = _mm256_hadd_ps(h01, h23);
    let sums = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let mut s = [0f32; BLOCK];
    _mm_storeu_ps(s.as_mut_ptr(), sums);
    s
}

/// The rows from `from` on, one by one, as [`rows_in_blocks`] takes those past its last block.
///
/// # Safety
/// As [`rows_in_blocks`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_one_by_one<const Q: usize>(
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
    from: usize,
    load: &impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    value: &impl Fn(usize, usize) -> f32,
) {
    use super::x86::hsum_ps;
    use std::arch::x86_64::*;
    let (n, n_out) = (xs[0].len(), outs[0].len());
    let n8 = n / 8 * 8;
    let xp: [*const f32; Q] = std::array::from_fn(|h| xs[h].as_ptr());
    let op: [*mut f32; Q] = std::array::from_fn(|h| outs[h].as_mut_ptr());
    for j in from..n_out {
        let mut acc = [_mm256_setzero_ps(); Q];
        for c in (0..n8).step_by(8) {
            let r = load(c, j);
            for (h, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(r, _mm256_loadu_ps(xp[h].add(c)), *a);
            }
        }
        for (h, a) in acc.iter().enumerate() {
            let t = (n8..n).fold(0.0, |s, i| s + *xp[h].add(i) * value(i, j));
            *op[h].add(j) = hsum_ps(*a) + t;
        }
    }
}

/// [`rows_in_blocks`] on 512 bits: a block's rows in pairs, row `j` in the low half of a
/// register and `j + 1` in the high half (`pair(c, j)`: both rows' values `c..c + 8`), each
/// vector's 8 values broadcast to both halves. Each half does `rows_in_blocks`' eight-wide sum
/// in its order, so every output is bit for bit its, for half the multiply-adds and
/// conversions.
///
/// # Safety
/// As [`rows_in_blocks`], `pair` reading as `load` does for rows `j` and `j + 1`, and the
/// caller's tier has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_in_blocks_wide<const Q: usize>(
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
    pair: impl Fn(usize, usize) -> std::arch::x86_64::__m512,
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    value: impl Fn(usize, usize) -> f32,
    prefetch: Option<impl Fn(usize)>,
) {
    use std::arch::x86_64::*;
    let n8 = xs[0].len() / 8 * 8;
    let xp: [*const f32; Q] = std::array::from_fn(|h| xs[h].as_ptr());
    let half = |v: __m512, hi: bool| match hi {
        false => _mm512_castps512_ps256(v),
        true => _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    };
    let block = |j: usize| {
        let mut acc = [[_mm512_setzero_ps(); 2]; Q];
        for c in (0..n8).step_by(8) {
            let r = [pair(c, j), pair(c, j + 2)];
            for (h, acc) in acc.iter_mut().enumerate() {
                let x8 = _mm256_castps_pd(_mm256_loadu_ps(xp[h].add(c)));
                let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(x8));
                acc[0] = _mm512_fmadd_ps(r[0], xv, acc[0]);
                acc[1] = _mm512_fmadd_ps(r[1], xv, acc[1]);
            }
        }
        // A loop, not `map`: the closure would not inherit the tier's target features.
        let mut rows = [[_mm256_setzero_ps(); BLOCK]; Q];
        for (r, [a, b]) in rows.iter_mut().zip(acc) {
            *r = [half(a, false), half(a, true), half(b, false), half(b, true)];
        }
        rows
    };
    in_row_blocks::<Q>(xs, outs, block, &load, value, prefetch);
}

#[cfg(test)]
mod tests {
    use super::{DotRowsFn, RowElem};
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};

    /// Every tier within 1e-5 of the scalar reference relative to `sum |x_i r_i|`, on ragged
    /// widths, row counts and strides, for rows of `T` made from random f32 by `from`.
    fn tiers_match<T: RowElem>(select: fn(Isa) -> DotRowsFn<T>, from: fn(f32) -> T) {
        for isa in Isa::supported() {
            let f = select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let r: Vec<T> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(from)
                    .collect();
                let x = random_f32(n, 9 + n as u64);
                let (mut want, mut got) = (vec![0f32; rows], vec![f32::NAN; rows]);
                super::scalar(&x, &r, stride, &mut want);
                f(&x, &r, stride, &mut got);
                for j in 0..rows {
                    let mag: f32 = (0..n)
                        .map(|i| (x[i] * r[j * stride + i].widen()).abs())
                        .sum();
                    assert!(
                        (got[j] - want[j]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} row {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiers_match_reference() {
        tiers_match(super::select, |v| v);
    }

    /// Each tier's many-vector dot gives every vector what its one-vector dot gives it, bit for
    /// bit: 1 to 5 vectors (past one read of the rows on every tier), ragged widths, row counts
    /// and strides; and refuses vectors of different lengths.
    fn many_match<T: RowElem>(
        one: fn(Isa) -> DotRowsFn<T>,
        many: fn(Isa) -> super::DotRowsManyFn<T>,
        from: fn(f32) -> T,
    ) {
        for isa in Isa::supported() {
            let (one, many) = (one(isa), many(isa));
            // The last case spans more than `x86::PREFETCH_SPAN`: the rows are prefetched.
            for (n, rows, pad) in ROW_CASES.into_iter().chain([(64, 2100, 8)]) {
                let stride = n + pad;
                let r: Vec<T> = (random_f32(rows * stride, 3 + n as u64).into_iter())
                    .map(from)
                    .collect();
                let xs: Vec<Vec<f32>> = (0..5).map(|h| random_f32(n, 50 + h)).collect();
                for q in 1..=5 {
                    let x: Vec<&[f32]> = xs[..q].iter().map(|x| &x[..]).collect();
                    let mut got = vec![vec![f32::NAN; rows]; q];
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| &mut o[..]).collect();
                    many(&x, &r, stride, &mut outs);
                    for (h, g) in got.iter().enumerate() {
                        let mut want = vec![f32::NAN; rows];
                        one(&xs[h], &r, stride, &mut want);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(g), bits(&want), "{isa} n {n} rows {rows}: {h} of {q}");
                    }
                }
                if n > 0 {
                    let short = vec![0f32; n - 1];
                    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let mut o = [vec![0f32; rows], vec![0f32; rows]];
                        let [a, b] = &mut o;
                        many(&[&xs[0][..n], &short], &r, stride, &mut [a, b]);
                    }));
                    assert!(refused.is_err(), "{isa}: vectors of {n} and {}", n - 1);
                }
            }
        }
    }

    #[test]
    fn many_vectors_equal_one_vector_dots() {
        many_match(super::select, super::select_many, |v| v);
        many_match(
            super::select_f16,
            super::select_many_f16,
            half::f16::from_f32,
        );
    }

    #[test]
    fn f16_tiers_match_reference() {
        tiers_match(super::select_f16, half::f16::from_f32);
    }
}
