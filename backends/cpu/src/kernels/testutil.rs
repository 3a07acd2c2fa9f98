//! Random inputs for kernel tests: f32 vectors and valid quantized rows (finite, well-scaled block
//! scales; every other byte random), and the tier-vs-reference check every dot kernel uses.
use super::table::{Kernels, RowDot};
use crate::isa::Isa;
use dejavu_backend_api::quant::{BlockQ8A, QuantType, QK};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

/// `(width, rows, stride padding)` cases for the kernels over strided f32 rows (`dot_rows`,
/// `axpy_rows`): empty and one-element rows, widths around the 8- and 16-lane steps (88: 64,
/// then 16, then 8), and row counts and strides that are not multiples of anything.
pub const ROW_CASES: [(usize, usize, usize); 9] = [
    (0, 3, 0),
    (1, 1, 0),
    (7, 5, 3),
    (8, 2, 0),
    (16, 2, 0),
    (33, 9, 5),
    (64, 40, 128),
    (100, 3, 1),
    (88, 6, 2),
];

pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.gen_range(-2.0f32..2.0)).collect()
}

/// A random row of `n` elements of `qtype` with sane scales.
pub fn random_row(qtype: QuantType, n: usize, seed: u64) -> Vec<u8> {
    let mut r = rng(seed ^ 0x5eed);
    let mut bytes: Vec<u8> = (0..qtype.row_bytes(n)).map(|_| r.gen()).collect();
    let scale =
        |r: &mut rand_chacha::ChaCha8Rng| f16::from_f32(r.gen_range(-0.05f32..0.05)).to_le_bytes();
    let bb = qtype.block_bytes();
    match qtype {
        QuantType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                c.copy_from_slice(&r.gen_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        QuantType::F16 => bytes.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&f16::from_f32(r.gen_range(-1.0f32..1.0)).to_le_bytes())
        }),
        QuantType::BF16 => bytes.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&bf16::from_f32(r.gen_range(-1.0f32..1.0)).to_le_bytes())
        }),
        _ => bytes.chunks_exact_mut(bb).for_each(|b| {
            for &o in qtype.scale_offsets() {
                b[o..o + 2].copy_from_slice(&scale(&mut r));
            }
        }),
    }
    bytes
}

/// Every supported tier's dot for `qtype` equals the scalar tier's on random rows of ragged
/// lengths (in blocks: 1, 7, 31, 33, and more for the 32-wide types). Integer block sums are exact
/// in every tier; only the order of f32 scale products differs, so we allow 1e-5 relative to
/// `sum |block contribution|` plus 1e-6.
pub fn check_dot_tiers(qtype: QuantType) {
    let reference = Kernels::for_isa(Isa::Scalar).unwrap();
    eprintln!(
        "{qtype:?}: checking tiers {:?} against scalar",
        Isa::supported()
    );
    let bl = qtype.block_len();
    // Lengths in elements: ragged for float rows (SIMD body plus tails), whole blocks otherwise.
    let lens: Vec<usize> = match bl {
        1 => vec![1, 7, 31, 33, 257, 4097],
        QK => [1, 7, 31, 33, 257].map(|nb| nb * QK).to_vec(),
        _ => [1, 7, 31, 33].map(|nb| nb * bl).to_vec(),
    };
    for (isa, sparse) in Isa::supported()
        .into_iter()
        .flat_map(|i| [(i, false), (i, true)])
    {
        let k = Kernels::for_isa(isa).unwrap();
        for &n in &lens {
            let row = random_row(qtype, n, n as u64);
            let x = random_f32(n, 7 + n as u64);
            let (r, f) = (reference.dot(qtype, false), k.dot(qtype, sparse));
            let (want, got, mag) = match (r.q8a(), f.q8a(), r, f) {
                (Some(r), Some(f), ..) => {
                    let mut act = vec![
                        BlockQ8A {
                            d: 0.0,
                            s: 0.0,
                            qs: [0; QK]
                        };
                        n / QK
                    ];
                    (reference.quantize)(&x, &mut act);
                    let mut deq = vec![0f32; n];
                    crate::dequant::dequantize_row(qtype, &row, &mut deq);
                    let mag: f32 = deq.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                    (r(&row, &act), f(&row, &act), mag)
                }
                (_, _, RowDot::F32(r), RowDot::F32(f)) => (
                    r(&row, &x),
                    f(&row, &x),
                    x.iter().map(|v| v.abs()).sum::<f32>(),
                ),
                _ => panic!("{isa}: {qtype:?} changed activation format between tiers"),
            };
            assert!(
                (got - want).abs() <= 1e-5 * mag + 1e-6,
                "{isa} (sparse variant: {sparse}) {qtype:?} n={n}: {got} vs scalar {want}"
            );
        }
    }
}

/// The scalar quantized-activation dot stays close to the exact f32 dot: the activation rounding
/// error is at most d/2 = max|x|/254 per element, so |error| <= sum_i |w_i| * max|x_block| / 254.
pub fn check_q8a_against_f32(qtype: QuantType) {
    let k = Kernels::for_isa(Isa::Scalar).unwrap();
    let Some(f) = k.dot(qtype, false).q8a() else {
        panic!("{qtype:?} is not a Q8A type")
    };
    for nb in [1usize, 8, 32] {
        let n = nb * qtype.block_len().max(QK);
        let row = random_row(qtype, n, 3 * n as u64);
        let x = random_f32(n, n as u64);
        let mut act = vec![
            BlockQ8A {
                d: 0.0,
                s: 0.0,
                qs: [0; QK]
            };
            n / QK
        ];
        (k.quantize)(&x, &mut act);
        let mut deq = vec![0f32; n];
        crate::dequant::dequantize_row(qtype, &row, &mut deq);
        let exact: f64 = deq.iter().zip(&x).map(|(w, x)| *w as f64 * *x as f64).sum();
        let bound: f64 = deq
            .chunks(QK)
            .zip(x.chunks(QK))
            .map(|(w, xs)| {
                w.iter().map(|v| v.abs() as f64).sum::<f64>()
                    * xs.iter().fold(0f64, |m, v| m.max(v.abs() as f64))
                    / 254.0
            })
            .sum();
        let got = f(&row, &act) as f64;
        assert!(
            (got - exact).abs() <= bound * 1.001 + 1e-4,
            "{qtype:?} n={n}: {got} vs exact {exact} (bound {bound})"
        );
    }
}

/// Every tier's multi-token dot for `qtype` (where it has one; prefetching or not) gives each
/// of 1..=`MAX_Q8A_TOKENS` tokens what the same tier's one-token dot gives it, bit for bit, on
/// rows of 1, 3 and 9 blocks.
pub fn check_dot_tokens(qtype: QuantType) {
    let bl = qtype.block_len().max(QK);
    for isa in Isa::supported() {
        let k = Kernels::for_isa(isa).unwrap();
        for sparse in [false, true] {
            let RowDot::Q8AN(one, tokens) = k.dot(qtype, sparse) else {
                continue;
            };
            for nb in [1, 3, 9] {
                let n = nb * bl;
                let row = random_row(qtype, n, 11 + n as u64);
                let acts: Vec<Vec<BlockQ8A>> = (0..crate::kernels::MAX_Q8A_TOKENS as u64)
                    .map(|t| {
                        let x = random_f32(n, 100 * t + n as u64);
                        let mut act = vec![
                            BlockQ8A {
                                d: 0.0,
                                s: 0.0,
                                qs: [0; QK]
                            };
                            n / QK
                        ];
                        (k.quantize)(&x, &mut act);
                        act
                    })
                    .collect();
                for nt in 1..=acts.len() {
                    let refs: Vec<&[BlockQ8A]> = acts[..nt].iter().map(|a| &a[..]).collect();
                    let mut out = vec![f32::NAN; nt];
                    tokens(&row, &refs, &mut out);
                    for (t, (o, a)) in out.iter().zip(&refs).enumerate() {
                        let want = one(&row, a);
                        assert_eq!(
                            o.to_bits(),
                            want.to_bits(),
                            "{isa} {qtype:?} ({nb} blocks, sparse {sparse}) token {t} of {nt}: \
                             {o} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
