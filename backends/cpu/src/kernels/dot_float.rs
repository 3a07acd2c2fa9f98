//! F32 / F16 / BF16 row . f32 activations (no activation quantization: float weights are dotted
//! in f32, as the reference `sum_i w_i * x_i`).
use crate::isa::Isa;
use half::{bf16, f16};

pub fn select_f32(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f32,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |r, x| portable(r, x, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        _ => |r, x| scalar(r, x, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}

pub fn select_f16(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |r, x| portable(r, x, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        _ => |r, x| scalar(r, x, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

pub fn select_bf16(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_bf16,
        Isa::Portable | Isa::Neon | Isa::Dotprod => {
            |r, x| portable(r, x, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        _ => |r, x| scalar(r, x, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

/// The length contract, checked by every tier in release builds: `row` holds exactly `x.len()`
/// elements of `width` bytes.
#[inline(always)]
fn check(row: &[u8], x: &[f32], width: usize) {
    assert!(
        row.len() == x.len() * width,
        "float row dot: a row of {} bytes against {} activations of {width}-byte weights",
        row.len(),
        x.len()
    );
}

pub fn scalar(row: &[u8], x: &[f32], width: usize, load: impl Fn(&[u8]) -> f32) -> f32 {
    check(row, x, width);
    row.chunks_exact(width)
        .zip(x)
        .map(|(b, &v)| load(b) * v)
        .sum()
}

pub fn portable(row: &[u8], x: &[f32], width: usize, load: impl Fn(&[u8]) -> f32) -> f32 {
    check(row, x, width);
    use wide::f32x8;
    let mut acc = f32x8::ZERO;
    let (xc, xr) = (x.chunks_exact(8), x.chunks_exact(8).remainder());
    for (wb, xs) in row.chunks_exact(8 * width).zip(xc) {
        let w: [f32; 8] = std::array::from_fn(|i| load(&wb[i * width..]));
        acc = f32x8::from(w).mul_add(f32x8::from(xs), acc);
    }
    let tail = &row[(x.len() - xr.len()) * width..];
    acc.reduce_add() + scalar(tail, xr, width, load)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// How one float type turns bytes into f32 lanes; inlined into each `#[target_feature]`
    /// entry point below, so the loads compile with AVX2/F16C (a closure passed in from a plain
    /// function would not be inlined across the feature boundary).
    pub trait Load8 {
        const WIDTH: usize;
        /// 8 elements starting at `p`.
        unsafe fn load8(p: *const u8) -> __m256;
        /// One element from its bytes.
        fn one(b: &[u8]) -> f32;
    }

    pub struct F32;
    pub struct F16;
    pub struct BF16;

    impl Load8 for F32 {
        const WIDTH: usize = 4;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_loadu_ps(p as *const f32)
        }
        fn one(b: &[u8]) -> f32 {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
    }

    impl Load8 for F16 {
        const WIDTH: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        fn one(b: &[u8]) -> f32 {
            half::f16::from_le_bytes([b[0], b[1]]).to_f32()
        }
    }

    impl Load8 for BF16 {
        const WIDTH: usize = 2;
        /// bf16 -> f32 is a 16-bit left shift.
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
        fn one(b: &[u8]) -> f32 {
            half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
        }
    }

    /// `sum_i row[i] * x[i]`, 8 lanes at a time on 4 accumulators, tail in scalar. Caller: `row`
    /// holds `x.len()` elements of `L` and the CPU has AVX2, FMA and F16C.
    #[inline(always)]
    pub unsafe fn dot<L: Load8>(row: &[u8], x: &[f32]) -> f32 {
        let (n, p) = (x.len(), row.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, a) in acc.iter_mut().enumerate() {
                let e = i + 8 * u;
                let w = L::load8(p.add(e * L::WIDTH));
                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.as_ptr().add(e)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            let w = L::load8(p.add(i * L::WIDTH));
            acc[0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.as_ptr().add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = super::super::x86::hsum_ps(sum);
        for (j, &xj) in x.iter().enumerate().skip(i) {
            s += L::one(&row[j * L::WIDTH..]) * xj;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_impl(row: &[u8], x: &[f32]) -> f32 {
        dot::<F32>(row, x)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_impl(row: &[u8], x: &[f32]) -> f32 {
        dot::<F16>(row, x)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn bf16_impl(row: &[u8], x: &[f32]) -> f32 {
        dot::<BF16>(row, x)
    }
}

// SAFETY (all three): handed out only for tiers with AVX2/FMA/F16C; `row` holds `x.len()`
// elements of the type (checked here, in release builds too).
#[cfg(target_arch = "x86_64")]
fn avx2_f32(row: &[u8], x: &[f32]) -> f32 {
    check(row, x, 4);
    // SAFETY: see above.
    unsafe { x86::f32_impl(row, x) }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16(row: &[u8], x: &[f32]) -> f32 {
    check(row, x, 2);
    // SAFETY: see above.
    unsafe { x86::f16_impl(row, x) }
}

#[cfg(target_arch = "x86_64")]
fn avx2_bf16(row: &[u8], x: &[f32]) -> f32 {
    check(row, x, 2);
    // SAFETY: see above.
    unsafe { x86::bf16_impl(row, x) }
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::*;
    use dejavu_backend_api::QuantType;

    #[test]
    fn tiers_match_reference() {
        for q in [QuantType::F32, QuantType::F16, QuantType::BF16] {
            check_dot_tiers(q);
        }
    }
}
