//! F32 / F16 / BF16 row . f32 activations (no activation quantization: float weights are dotted
//! in f32, as the reference `sum_i w_i * x_i`).
use crate::isa::Isa;
use half::{bf16, f16};

pub fn select_f32(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f32,
        Isa::Portable => |r, x| portable(r, x, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        _ => |r, x| scalar(r, x, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}

pub fn select_f16(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_f16,
        Isa::Portable => |r, x| portable(r, x, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => |r, x| scalar(r, x, 2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

pub fn select_bf16(isa: Isa) -> super::table::DotF32Fn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2_bf16,
        Isa::Portable => |r, x| portable(r, x, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => |r, x| scalar(r, x, 2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

pub fn scalar(row: &[u8], x: &[f32], width: usize, load: impl Fn(&[u8]) -> f32) -> f32 {
    row.chunks_exact(width)
        .zip(x)
        .map(|(b, &v)| load(b) * v)
        .sum()
}

pub fn portable(row: &[u8], x: &[f32], width: usize, load: impl Fn(&[u8]) -> f32) -> f32 {
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

    /// Shared loop: `load8(i)` yields 8 weights as f32 from element `8i`; tail done by `tail`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(
        n: usize,
        x: &[f32],
        load8: impl Fn(usize) -> __m256,
        tail: impl Fn(usize) -> f32,
    ) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let n8 = n / 8;
        for i in 0..n8 {
            acc[i % 2] =
                _mm256_fmadd_ps(load8(i), _mm256_loadu_ps(x.as_ptr().add(8 * i)), acc[i % 2]);
        }
        let mut s = super::super::x86::hsum_ps(_mm256_add_ps(acc[0], acc[1]));
        for (i, &xi) in x.iter().enumerate().take(n).skip(8 * n8) {
            s += tail(i) * xi;
        }
        s
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f32(row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let p = row.as_ptr();
    // SAFETY: handed out only for tiers with AVX2/FMA/F16C; reads stay within `row` (4 bytes per
    // element, `x.len()` elements, checked by the caller's Weight).
    unsafe {
        x86::dot(
            x.len(),
            x,
            |i| _mm256_loadu_ps(p.add(32 * i) as *const f32),
            |i| f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        )
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16(row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let p = row.as_ptr();
    // SAFETY: as `avx2_f32`, 2 bytes per element.
    unsafe {
        x86::dot(
            x.len(),
            x,
            |i| _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * i) as *const __m128i)),
            |i| half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        )
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_bf16(row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let p = row.as_ptr();
    // SAFETY: as `avx2_f32`, 2 bytes per element. bf16 -> f32 is a 16-bit left shift.
    unsafe {
        x86::dot(
            x.len(),
            x,
            |i| {
                let h = _mm_loadu_si128(p.add(16 * i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            },
            |i| half::bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        )
    }
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
