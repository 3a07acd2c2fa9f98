//! `y += sum_j a[j] * x_j` where `x_j = x[j * stride..][..y.len()]`: a weighted sum of rows of
//! f32 or f16 (attention's sum of value rows, of an f32 or f16 KV cache; the sparse path's rows
//! of a neuron-major down projection).
//!
//! Reference: for each j in order, `y[i] += a[j] * x_j[i]` (f16 widened to f32 exactly). The
//! SIMD tiers keep blocks of `y` in registers across all rows (no store-to-load chain through
//! `y`) and use fused multiply-add, so they differ from the reference by rounding only.
#[cfg(target_arch = "x86_64")]
use super::x86::{Floats, Lanes};
use super::{each_vector, RowElem};
use crate::isa::Isa;
use half::f16;

/// `(a, x, stride, y)`; `x` holds `a.len()` rows at `stride` (the last may end at `y.len()`).
pub type AxpyRowsFn<T = f32> = fn(&[f32], &[T], usize, &mut [f32]);

pub fn select(isa: Isa) -> AxpyRowsFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// The same over f16 rows.
pub fn select_f16(isa: Isa) -> AxpyRowsFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => portable,
        _ => scalar,
    }
}

/// `(as, x, stride, ys)`: several weightings of the same rows (the query heads of one KV group
/// over its values), `ys[h] += sum_j as[h][j] * x_j`, each `ys[h]` bit for bit what
/// [`AxpyRowsFn`] of the same tier gives it alone (every column sums its rows in order). The x86
/// tiers read each row once for up to 2 (AVX2) or 4 (AVX-512) weightings.
pub type AxpyRowsManyFn<T = f32> = fn(&[&[f32]], &[T], usize, &mut [&mut [f32]]);

pub fn select_many(isa: Isa) -> AxpyRowsManyFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_many,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_many,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |a, x, st, y| each_vector("axpy_rows", portable, a, x, st, y)
        }
        _ => |a, x, st, y| each_vector("axpy_rows", scalar, a, x, st, y),
    }
}

/// The same over f16 rows.
pub fn select_many_f16(isa: Isa) -> AxpyRowsManyFn<f16> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_many_f16,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_many_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |a, x, st, y| each_vector("axpy_rows", portable, a, x, st, y)
        }
        _ => |a, x, st, y| each_vector("axpy_rows", scalar, a, x, st, y),
    }
}

fn check<T>(a: &[f32], x: &[T], stride: usize, y: &[f32]) {
    assert!(
        a.is_empty() || (stride >= y.len() && x.len() >= (a.len() - 1) * stride + y.len()),
        "axpy_rows: {} rows of {} at stride {stride} need more than {} elements",
        a.len(),
        y.len(),
        x.len()
    );
}

pub fn scalar<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    let n = y.len();
    for (j, &aj) in a.iter().enumerate() {
        for (yi, &xi) in y.iter_mut().zip(&x[j * stride..j * stride + n]) {
            *yi += aj * xi.widen();
        }
    }
}

pub fn portable<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32]) {
    use wide::f32x8;
    check(a, x, stride, y);
    let n8 = y.len() / 8 * 8;
    for c in (0..n8).step_by(8) {
        let mut acc = f32x8::from(&y[c..c + 8]);
        for (j, &aj) in a.iter().enumerate() {
            acc = T::load8(&x[j * stride + c..]).mul_add(f32x8::splat(aj), acc);
        }
        y[c..c + 8].copy_from_slice(&acc.to_array());
    }
    tail(a, x, stride, y, n8);
}

/// Columns `from..` of `y`, in scalar.
fn tail<T: RowElem>(a: &[f32], x: &[T], stride: usize, y: &mut [f32], from: usize) {
    for (j, &aj) in a.iter().enumerate() {
        for i in from..y.len() {
            y[i] += aj * x[j * stride + i].widen();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2(a: &[f32], x: &[f32], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    // SAFETY: handed out by `select` only for tiers whose features (AVX2, FMA) this CPU has; the
    // bounds were checked above.
    unsafe { avx2_impl(a, x, stride, y) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_impl(a: &[f32], x: &[f32], stride: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let xp = x.as_ptr();
    in_blocks(a, y, |j, c| _mm256_loadu_ps(xp.add(j * stride + c)));
    tail(a, x, stride, y, y.len() / 8 * 8);
}

/// `y`'s whole groups of 8 columns plus every row's `a[j] * x_j` there: 64 columns at a time
/// in 8 registers (8 independent chains of multiply-adds, each row's 64 values read once),
/// then 32 in 4, then 8 in 1; each column sums its rows in order (the reference's order).
/// `load(j, c)`: row `j`'s values `c..c + 8`.
///
/// # Safety
/// The caller's tier has AVX2 and FMA (and what `load` needs); `load` reads inside the rows for
/// every `j < a.len()` and `c + 8 <= y.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn in_blocks(
    a: &[f32],
    y: &mut [f32],
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
) {
    let (n, yp) = (y.len(), y.as_mut_ptr());
    let mut c = 0;
    while c + 64 <= n {
        columns::<8>(a, yp, c, &load);
        c += 64;
    }
    while c + 32 <= n {
        columns::<4>(a, yp, c, &load);
        c += 32;
    }
    while c + 8 <= n {
        columns::<1>(a, yp, c, &load);
        c += 8;
    }
}

/// Columns `c..c + 8 * U` of `y` (`yp`) in `U` registers, every row accumulated before the
/// store (see [`in_blocks`], whose contract this shares).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn columns<const U: usize>(
    a: &[f32],
    yp: *mut f32,
    c: usize,
    load: &impl Fn(usize, usize) -> std::arch::x86_64::__m256,
) {
    use std::arch::x86_64::*;
    let mut acc: [__m256; U] = std::array::from_fn(|u| _mm256_loadu_ps(yp.add(c + 8 * u)));
    for (j, &aj) in a.iter().enumerate() {
        let av = _mm256_set1_ps(aj);
        for (u, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(load(j, c + 8 * u), av, *acc);
        }
    }
    for (u, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(yp.add(c + 8 * u), *acc);
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    check(a, x, stride, y);
    // SAFETY: handed out by `select_f16` only for tiers whose features (AVX2, FMA, F16C) this
    // CPU has; every row read lies inside `x` (checked above).
    unsafe { avx2_f16_impl(a, x, stride, y) };
    tail(a, x, stride, y, y.len() / 8 * 8);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_f16_impl(a: &[f32], x: &[f16], stride: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let xp = x.as_ptr();
    in_blocks(a, y, |j, c| {
        _mm256_cvtph_ps(_mm_loadu_si128(xp.add(j * stride + c) as *const __m128i))
    });
}

/// One tier's entry of [`AxpyRowsManyFn`] for rows of `$t`: checks every extent, then runs
/// `$impl` on at most `$max` weightings at a time, and the scalar tail columns of each.
#[cfg(target_arch = "x86_64")]
macro_rules! many_entry {
    ($name:ident, $t:ty, $impl:ident, $max:expr) => {
        fn $name(a: &[&[f32]], x: &[$t], stride: usize, ys: &mut [&mut [f32]]) {
            super::check_many("axpy_rows", a, ys);
            if let (Some(a), Some(y)) = (a.first(), ys.first()) {
                check(a, x, stride, y);
            }
            for (a, y) in a.chunks($max).zip(ys.chunks_mut($max)) {
                // SAFETY: handed out by `select_many*` only for tiers whose features this CPU
                // has; every weighting and output has the checked lengths.
                unsafe {
                    match a.len() {
                        1 => $impl::<$t, 1>(a, x, stride, y),
                        2 => $impl::<$t, 2>(a, x, stride, y),
                        3 => $impl::<$t, 3>(a, x, stride, y),
                        _ => $impl::<$t, 4>(a, x, stride, y),
                    }
                }
            }
            for (a, y) in a.iter().zip(ys.iter_mut()) {
                tail(a, x, stride, y, y.len() / 8 * 8);
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
many_entry!(avx2_many, f32, avx2_many_impl, 2);
#[cfg(target_arch = "x86_64")]
many_entry!(avx2_many_f16, f16, avx2_many_impl, 2);
#[cfg(target_arch = "x86_64")]
many_entry!(avx512_many, f32, avx512_many_impl, 4);
#[cfg(target_arch = "x86_64")]
many_entry!(avx512_many_f16, f16, avx512_many_impl, 4);

/// The AVX2 tier's many-weighting body over rows of `T` ([`in_blocks_many`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_many_impl<T: Lanes, const Q: usize>(
    a: &[&[f32]],
    x: &[T],
    stride: usize,
    ys: &mut [&mut [f32]],
) {
    let (xp, n) = (x.as_ptr(), ys[0].len());
    let pf = |j: usize| crate::prefetch::prefetch(bytemuck::cast_slice(&x[j * stride..][..n]));
    let load = |j: usize, c: usize| T::x8(xp.add(j * stride + c));
    match super::x86::spans_far::<T>(a[0].len(), stride) {
        true => in_blocks_many::<Q, true>(a, ys, load, pf),
        false => in_blocks_many::<Q, false>(a, ys, load, pf),
    }
}

/// The AVX-512 tier's many-weighting body over rows of `T` ([`in_blocks_wide`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn avx512_many_impl<T: Lanes, const Q: usize>(
    a: &[&[f32]],
    x: &[T],
    stride: usize,
    ys: &mut [&mut [f32]],
) {
    let (xp, n) = (x.as_ptr(), ys[0].len());
    let pf = |j: usize| crate::prefetch::prefetch(bytemuck::cast_slice(&x[j * stride..][..n]));
    let load = |j: usize, c: usize| T::x8(xp.add(j * stride + c));
    let wide = |j: usize, c: usize| T::x16(xp.add(j * stride + c));
    match super::x86::spans_far::<T>(a[0].len(), stride) {
        true => in_blocks_wide::<Q, true>(a, ys, wide, load, pf),
        false => in_blocks_wide::<Q, false>(a, ys, wide, load, pf),
    }
}

/// [`in_blocks_many`] on 512 bits: 64 columns of each output in 4 registers (a head of 64
/// values in one pass over the rows, where 256 bits take two), then 16 in 1 (`wide(j, c)`:
/// row `j`'s values `c..c + 16`), then 8 on 256 bits (`load`). Each column still sums its rows
/// in order, so every output is bit for bit the AVX2 bodies'.
///
/// # Safety
/// As [`in_blocks_many`], and the caller's tier has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn in_blocks_wide<const Q: usize, const PF: bool>(
    a: &[&[f32]],
    ys: &mut [&mut [f32]],
    wide: impl Fn(usize, usize) -> std::arch::x86_64::__m512,
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    prefetch: impl Fn(usize),
) {
    let n = ys[0].len();
    let yp: [*mut f32; Q] = std::array::from_fn(|h| ys[h].as_mut_ptr());
    let c = column_steps::<_, 4, Q, PF>(a, yp, n, 0, &wide, &prefetch);
    let c = column_steps::<_, 1, Q, PF>(a, yp, n, c, &wide, &prefetch);
    column_steps::<_, 1, Q, PF>(a, yp, n, c, &load, &prefetch);
}

/// [`in_blocks`] for the first `Q` weightings `a` and outputs `ys` at once: 32 columns of each
/// in 4 registers, then 8 in 1, each row's values loaded once for all `Q`; each column of each
/// output sums its rows in order, as [`in_blocks`] does.
///
/// # Safety
/// As [`in_blocks`], for each of the `Q` weightings (all of one length) and outputs (all of
/// one length).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn in_blocks_many<const Q: usize, const PF: bool>(
    a: &[&[f32]],
    ys: &mut [&mut [f32]],
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    prefetch: impl Fn(usize),
) {
    let n = ys[0].len();
    let yp: [*mut f32; Q] = std::array::from_fn(|h| ys[h].as_mut_ptr());
    let c = column_steps::<_, 4, Q, PF>(a, yp, n, 0, &load, &prefetch);
    column_steps::<_, 1, Q, PF>(a, yp, n, c, &load, &prefetch);
}

/// Rows ahead that [`in_blocks_many`] prefetches (see dot_rows.rs's `AHEAD`: a head's values
/// are strided slices of the cache).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// [`columns_many`] from column `c` on, `U` vectors of `V` a step while they fit in the `n`
/// columns; the column reached. With `PF`, the first pass over the rows (at column 0)
/// prefetches them whole, [`AHEAD`] rows on.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn column_steps<V: Floats, const U: usize, const Q: usize, const PF: bool>(
    a: &[&[f32]],
    yp: [*mut f32; Q],
    n: usize,
    mut c: usize,
    load: &impl Fn(usize, usize) -> V,
    prefetch: &impl Fn(usize),
) -> usize {
    while c + V::LANES * U <= n {
        match PF && c == 0 {
            true => columns_many::<V, U, Q, true>(a, yp, c, load, prefetch),
            false => columns_many::<V, U, Q, false>(a, yp, c, load, prefetch),
        }
        c += V::LANES * U;
    }
    c
}

/// Columns `c..c + LANES * U` of each of the `Q` outputs in registers of `V` (256 or 512
/// bits; see [`in_blocks_many`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn columns_many<V: Floats, const U: usize, const Q: usize, const PF: bool>(
    a: &[&[f32]],
    yp: [*mut f32; Q],
    c: usize,
    load: &impl Fn(usize, usize) -> V,
    prefetch: &impl Fn(usize),
) {
    let w = V::LANES;
    let mut acc: [[V; U]; Q] =
        std::array::from_fn(|h| std::array::from_fn(|u| V::loadu(yp[h].add(c + w * u))));
    let rows = a[0].len();
    for j in 0..rows {
        if PF && j + AHEAD < rows {
            prefetch(j + AHEAD);
        }
        let r: [V; U] = std::array::from_fn(|u| load(j, c + w * u));
        for (h, acc) in acc.iter_mut().enumerate() {
            // SAFETY: j < rows, the length of every weighting (the caller's contract).
            let av = V::splat(*a[h].get_unchecked(j));
            for (u, acc) in acc.iter_mut().enumerate() {
                *acc = V::fmadd(r[u], av, *acc);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        for (u, acc) in acc.iter().enumerate() {
            V::storeu(yp[h].add(c + w * u), *acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{AxpyRowsFn, RowElem};
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, ROW_CASES};

    /// Every tier within 1e-5 of the scalar reference relative to `sum_j |a_j x_j[i]| + |y[i]|`,
    /// on ragged widths, row counts and strides, for rows of `T` made from random f32 by `from`.
    fn tiers_match<T: RowElem>(select: fn(Isa) -> AxpyRowsFn<T>, from: fn(f32) -> T) {
        for isa in Isa::supported() {
            let f = select(isa);
            for (n, rows, pad) in ROW_CASES {
                let stride = n + pad;
                let x: Vec<T> = random_f32(rows * stride, n as u64)
                    .into_iter()
                    .map(from)
                    .collect();
                let a = random_f32(rows, 7 + rows as u64);
                let y0 = random_f32(n, 100 + n as u64);
                let (mut want, mut got) = (y0.clone(), y0.clone());
                super::scalar(&a, &x, stride, &mut want);
                f(&a, &x, stride, &mut got);
                for i in 0..n {
                    let mag: f32 = y0[i].abs()
                        + (0..rows)
                            .map(|j| (a[j] * x[j * stride + i].widen()).abs())
                            .sum::<f32>();
                    assert!(
                        (got[i] - want[i]).abs() <= 1e-5 * mag + 1e-7,
                        "{isa} n {n} rows {rows} i {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiers_match_reference() {
        tiers_match(super::select, |v| v);
    }

    /// Each tier's many-weighting sum gives every output what its one-weighting sum gives it,
    /// bit for bit: 1 to 5 weightings, ragged widths, row counts and strides; and refuses
    /// weightings of different lengths.
    fn many_match<T: RowElem>(
        one: fn(Isa) -> AxpyRowsFn<T>,
        many: fn(Isa) -> super::AxpyRowsManyFn<T>,
        from: fn(f32) -> T,
    ) {
        for isa in Isa::supported() {
            let (one, many) = (one(isa), many(isa));
            // The last case spans more than `x86::PREFETCH_SPAN`: the rows are prefetched.
            for (n, rows, pad) in ROW_CASES.into_iter().chain([(64, 2100, 8)]) {
                let stride = n + pad;
                let x: Vec<T> = (random_f32(rows * stride, 5 + n as u64).into_iter())
                    .map(from)
                    .collect();
                let a: Vec<Vec<f32>> = (0..5).map(|h| random_f32(rows, 60 + h)).collect();
                let y0: Vec<Vec<f32>> = (0..5).map(|h| random_f32(n, 70 + h)).collect();
                for q in 1..=5 {
                    let w: Vec<&[f32]> = a[..q].iter().map(|a| &a[..]).collect();
                    let mut got: Vec<Vec<f32>> = y0[..q].to_vec();
                    let mut ys: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
                    many(&w, &x, stride, &mut ys);
                    for (h, g) in got.iter().enumerate() {
                        let mut want = y0[h].clone();
                        one(&a[h], &x, stride, &mut want);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(g), bits(&want), "{isa} n {n} rows {rows}: {h} of {q}");
                    }
                }
                if rows > 0 {
                    let short = vec![0f32; rows - 1];
                    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let mut o = [vec![0f32; n], vec![0f32; n]];
                        let [p, q] = &mut o;
                        many(&[&a[0][..rows], &short], &x, stride, &mut [p, q]);
                    }));
                    assert!(
                        refused.is_err(),
                        "{isa}: weightings of {rows} and {}",
                        rows - 1
                    );
                }
            }
        }
    }

    #[test]
    fn many_weightings_equal_one_weighting_sums() {
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
