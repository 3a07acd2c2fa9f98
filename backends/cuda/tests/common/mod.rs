//! What the kernel tests share: the GPU (or why there is none), seeded random inputs and
//! matrices of every weight type, read-backs and the tolerance check. Each test crate
//! (tests/kernels.rs, tests/products.rs) uses a part of it.
#![allow(dead_code)]
use dejavu_backend_api::{Device, QuantType};
use dejavu_backend_cuda::CudaDevice;
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no usable GPU ({e})");
            None
        }
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn randv(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
}

/// A random `rows x cols` matrix of `q`: random bytes, its f16 scales set to small values.
pub fn random_matrix(r: &mut ChaCha8Rng, q: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * q.row_bytes(cols);
    let mut b: Vec<u8> = (0..n).map(|_| r.gen()).collect();
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
    };
    let scale_at: &[usize] = match q {
        QuantType::F32 => {
            for (i, v) in randv(r, rows * cols).into_iter().enumerate() {
                b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
            }
            &[]
        }
        QuantType::F16 => {
            for (i, v) in randv(r, rows * cols).into_iter().enumerate() {
                put(&mut b, 2 * i, v);
            }
            &[]
        }
        QuantType::BF16 => {
            for (i, v) in randv(r, rows * cols).into_iter().enumerate() {
                let h = half::bf16::from_f32(v).to_le_bytes();
                b[2 * i..2 * i + 2].copy_from_slice(&h);
            }
            &[]
        }
        _ => q.scale_offsets(),
    };
    for blk in b.chunks_exact_mut(q.block_bytes()) {
        for &at in scale_at {
            put(blk, at, r.gen_range(-0.05..0.05));
        }
    }
    b
}

pub fn close(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol(i),
            "{what}[{i}]: gpu {g} against reference {w}"
        );
    }
}

pub fn down<D: Device>(d: &D, b: &D::Buf, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    d.download(b, &mut out).unwrap();
    out
}

/// Sum of |w| |x| over a row (the scale of a dot's rounding).
pub fn magnitude(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum()
}
