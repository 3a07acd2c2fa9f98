//! `dejavu quantize`'s rounding against ggml's own (the code `llama-quantize` runs), on the rows
//! of tests/fixtures/quantizers.gguf (made by tools/gen_quantizer_fixtures.py from ggml's
//! `ggml_quantize_chunk`), without and with an importance matrix.
//!
//! Contract: where we port ggml's search (every K-quant, IQ4_NL, IQ4_XS, and the importance-
//! weighted 32-wide types), our blocks are ggml's bytes: at least 97% of the blocks identical
//! (the rest differ by float contraction: ggml is compiled with FMA, our port rounds each product),
//! and the importance-weighted squared error within 0.5% of ggml's. Where we do not port it (the
//! 32-wide types without an importance matrix: ggml writes plain max-scaled blocks, we search for
//! the scale of least error), our squared error is at most ggml's.
use dejavu_backend_api::quantize::{quantize_row_weighted, Rounding};
use dejavu_backend_api::QuantType;
use dejavu_backend_cpu::dequant::dequantize_row;
use dejavu_formats::GgufFile;

fn f32s(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f
        .tensor(name)
        .unwrap_or_else(|| panic!("fixture lacks {name}"));
    f.data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Sum over rows of `sum_i w_i (x_i - deq_i)^2` (w = 1 without an importance matrix).
fn weighted_error(q: QuantType, bytes: &[u8], x: &[f32], w: Option<&[f32]>, cols: usize) -> f64 {
    let rb = q.row_bytes(cols);
    let mut deq = vec![0f32; cols];
    let mut err = 0f64;
    for (row, xr) in bytes.chunks_exact(rb).zip(x.chunks_exact(cols)) {
        dequantize_row(q, row, &mut deq);
        for i in 0..cols {
            let d = (xr[i] - deq[i]) as f64;
            err += w.map_or(1.0, |w| w[i] as f64) * d * d;
        }
    }
    err
}

#[test]
fn quantizers_match_ggml() {
    let f = GgufFile::open(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quantizers.gguf"
    ))
    .unwrap();
    let x = f32s(&f, "x");
    let im = f32s(&f, "imatrix");
    let cols = im.len();
    let weights: Vec<f32> = im.iter().cycle().take(x.len()).copied().collect();
    for q in QuantType::ALL.into_iter().filter(|q| q.block_len() > 1) {
        for (imatrix, rounding) in [
            (false, Rounding::Ggml),
            (true, Rounding::Ggml),
            (false, Rounding::Search),
            (true, Rounding::Search),
        ] {
            let name = format!("{}{}", q.name(), if imatrix { ".imatrix" } else { "" });
            let t = f
                .tensor(&name)
                .unwrap_or_else(|| panic!("fixture lacks {name}"));
            let theirs = f.data(t);
            let mut ours = Vec::new();
            for (r, xr) in x.chunks_exact(cols).enumerate() {
                let w = imatrix.then(|| &weights[r * cols..(r + 1) * cols]);
                quantize_row_weighted(q, xr, w, rounding, &mut ours).unwrap();
            }
            assert_eq!(ours.len(), theirs.len(), "{name}: length");
            let w = imatrix.then_some(im.as_slice());
            let e_ours = weighted_error(q, &ours, &x, w, cols);
            let e_theirs = weighted_error(q, theirs, &x, w, cols);
            let bb = q.block_bytes();
            let same = ours
                .chunks(bb)
                .zip(theirs.chunks(bb))
                .filter(|(a, b)| a == b)
                .count();
            let blocks = ours.len() / bb;
            eprintln!(
                "{name} {rounding:?}: {same}/{blocks} blocks identical, error ours {e_ours:.4e} ggml {e_theirs:.4e}"
            );
            // What Search rounds its own way: the 32-wide linear types without importances
            // (Q8_0 ignores them).
            let searched =
                q.block_len() == 32 && q != QuantType::IQ4NL && (!imatrix || q == QuantType::Q8_0);
            let ported = rounding == Rounding::Ggml || !searched;
            if ported {
                assert!(
                    same * 100 >= blocks * 97,
                    "{name}: {same} of {blocks} blocks are ggml's"
                );
                assert!(
                    e_ours <= e_theirs * 1.005,
                    "{name}: error {e_ours} vs ggml's {e_theirs}"
                );
            } else {
                assert!(
                    e_ours <= e_theirs * 1.0001,
                    "{name}: error {e_ours} vs ggml's {e_theirs}"
                );
            }
        }
    }
}
