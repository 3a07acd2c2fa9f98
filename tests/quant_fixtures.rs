//! Every weight type's dequantization and dot product against values produced by an independent
//! implementation (the `gguf` Python package; see tools/gen_quant_fixtures.py), read from a GGUF
//! written by gguf's own writer.
//!
//! Tolerances: dequantization is the same f32 arithmetic (`d * q (+ m)`), so it must agree to 1 ulp
//! of the value (we allow 1e-6 relative to the block's largest magnitude). Dot products of 512
//! terms are accumulated in f32 in a different order than the float64 reference: the error bound
//! is ~n * eps * sum|w_i x_i| = 512 * 6e-8 * sum|w x|; we allow 3e-5 * sum|w x|. The decode path
//! quantizes activations to 8 bits (Q8A) for quantized weights: each activation moves by at most
//! max|x_block| / 254, so there we allow sum_blocks(sum|w| * max|x_block|) / 254 on top.
use dejavu_backend_api::quant::QK;
use dejavu_backend_api::{IndexSet, QuantType, Weight};
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::kernels::table::Kernels;
use dejavu_backend_cpu::pool::SpinPool;
use dejavu_backend_cpu::{dequant, matmul, vec_dot};
use dejavu_formats::GgufFile;

fn fixture() -> GgufFile {
    GgufFile::open(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quants.gguf"
    ))
    .unwrap()
}

fn f32s(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f
        .tensor(name)
        .unwrap_or_else(|| panic!("fixture lacks {name}"));
    f.data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn dequantize_and_dot_match_ggml_reference() {
    let f = fixture();
    let pool = SpinPool::new(2);
    let x = f32s(&f, "x");
    let cols = x.len();
    for qtype in QuantType::ALL {
        let name = qtype.name();
        let t = f.tensor(&format!("{name}.q")).unwrap();
        let w = Weight::new(qtype, t.n_rows(), t.row_len(), f.data(t)).unwrap();
        let deq = f32s(&f, &format!("{name}.deq"));
        let dots = f32s(&f, &format!("{name}.dot"));
        assert_eq!(w.cols, cols);
        let mut ours = vec![0f32; cols];
        for r in 0..w.rows {
            dequant::dequantize_row(qtype, w.row(r), &mut ours);
            let expect = &deq[r * cols..(r + 1) * cols];
            let scale = expect.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in ours.iter().zip(expect).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * scale,
                    "{name} row {r} elem {i}: ours {a}, reference {b}"
                );
            }
            let mag: f32 = expect.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
            let ours_dot = vec_dot::dot_row(qtype, w.row(r), &x);
            assert!(
                (ours_dot - dots[r]).abs() <= 3e-5 * mag,
                "{name} row {r}: dot {ours_dot} vs {}",
                dots[r]
            );
        }
        // The matmul paths, under every ISA tier this CPU has: per-row dots for one token
        // (quantized activations for quantized types); for a batch, dequantized tiles + gemm
        // (f32 activations), or the integer prefill kernel (quantized activations) on tiers
        // with one.
        let n = matmul::GEMM_MIN_TOKENS;
        let xs: Vec<f32> = x.iter().cycle().take(n * cols).copied().collect();
        let float = matches!(qtype, QuantType::F32 | QuantType::F16 | QuantType::BF16);
        for isa in Isa::supported() {
            let k = Kernels::for_isa(isa).unwrap();
            let int_batch = k.gemm_q8a.is_some_and(|g| (g.types)(qtype));
            let mut y = vec![0f32; n * w.rows];
            matmul::matmul(&k, &pool, &w, &IndexSet::full(w.rows), &xs, &mut y);
            let mut y1 = vec![0f32; w.rows];
            matmul::matmul(&k, &pool, &w, &IndexSet::full(w.rows), &x, &mut y1);
            for r in 0..w.rows {
                let wr = &deq[r * cols..(r + 1) * cols];
                let mag: f32 = wr.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                let q8: f32 = wr
                    .chunks(QK)
                    .zip(x.chunks(QK))
                    .map(|(w, xb)| {
                        w.iter().map(|v| v.abs()).sum::<f32>()
                            * xb.iter().fold(0f32, |m, v| m.max(v.abs()))
                            / 254.0
                    })
                    .sum();
                let tol = 3e-5 * mag + if float { 0.0 } else { q8 };
                for t in 0..n {
                    assert!(
                        (y[t * w.rows + r] - dots[r]).abs()
                            <= if int_batch { tol } else { 3e-5 * mag },
                        "{name} {isa} gemm row {r}"
                    );
                }
                assert!(
                    (y1[r] - dots[r]).abs() <= tol,
                    "{name} {isa} matvec row {r}: {} vs {}",
                    y1[r],
                    dots[r]
                );
            }
        }
    }
}

#[test]
fn subset_matmul_is_masked_dense() {
    let f = fixture();
    let pool = SpinPool::new(2);
    let x = f32s(&f, "x");
    let t = f.tensor("Q4_K.q").unwrap();
    let w = Weight::new(QuantType::Q4K, t.n_rows(), t.row_len(), f.data(t)).unwrap();
    for isa in Isa::supported() {
        let k = Kernels::for_isa(isa).unwrap();
        let mut dense = vec![0f32; w.rows];
        matmul::matmul(&k, &pool, &w, &IndexSet::full(w.rows), &x, &mut dense);
        let rows = IndexSet::new(w.rows, vec![0, 2]).unwrap();
        let mut sparse = vec![f32::NAN; w.rows];
        matmul::matmul(&k, &pool, &w, &rows, &x, &mut sparse);
        assert_eq!(sparse, vec![dense[0], 0.0, dense[2]], "{isa}");
    }
}
