//! The input-block layout of a projection (`RowLayout::InputBlocks`, read by the CPU's
//! `kernels::axpy_blocks`): the source's own 8- or 4-bit values, transposed, so input sparsity
//! reads each kept input's quants without a second rounding.
//!
//! Sources and their target type: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 keep their type and every
//! value exactly; so do Q4_K and Q5_K where their outputs are a multiple of 256 (their 6-bit
//! scales and mins under the per-256 scales, 4.5 and 5.5 bits a weight as in the file); other
//! Q4_K matrices become Q4_1 and Q5_K Q5_1 (each sub-block's scale `d * sc` and min `-dmin * m`
//! rounded to f16, a relative change below 2^-11 of a scale; the quants are unchanged; 5 and 6
//! bits a weight). The 5-bit types need outputs in multiples of 64 (their fifth bits are stored
//! in 64-bit words). The types whose scales cover 16 inputs or 256 (Q6_K; Q2_K, Q3_K, IQ4_NL,
//! IQ4_XS) have no such form: each output's 32 inputs are requantized, to the type and with
//! the error-minimising scales of the requantized rows of [`crate::sparsity::layout`] (Q8_0 for
//! Q6_K, Q5_0 for the others; a Q5_0 target needs outputs in multiples of 64 as above) — the
//! same one rounding those rows take, along the other axis.
use dejavu_backend_api::{quantize, QuantType, RowLayout, Weight};
use dejavu_backend_cpu::dequant::{dequantize_row, group_len, unpack_block};
use dejavu_backend_cpu::kernels::{axpy_blocks, repack};

/// The input-block type a source of `src` becomes, if it has one, for a `[outputs][inputs]`
/// source of this shape (both multiples of 32).
pub fn target(src: QuantType, outputs: usize, inputs: usize) -> Option<QuantType> {
    if !outputs.is_multiple_of(32) || !inputs.is_multiple_of(32) {
        return None;
    }
    let words = outputs.is_multiple_of(64);
    match src {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 => Some(src),
        // Q4_K's own form has Q4_K's size only in whole super-blocks of outputs.
        QuantType::Q4K if outputs.is_multiple_of(256) => Some(QuantType::Q4K),
        QuantType::Q4K => Some(QuantType::Q4_1),
        QuantType::Q5_0 | QuantType::Q5_1 if words => Some(src),
        QuantType::Q5K if outputs.is_multiple_of(256) => Some(QuantType::Q5K),
        QuantType::Q5K if words => Some(QuantType::Q5_1),
        q if requantized(q) => {
            let t = crate::sparsity::layout::down_t_type(q);
            (t == QuantType::Q8_0 || (t == QuantType::Q5_0 && words)).then_some(t)
        }
        _ => None,
    }
}

/// Whether a source of type `q` is requantized into its input blocks (see the module's text).
fn requantized(q: QuantType) -> bool {
    matches!(
        q,
        QuantType::Q6K | QuantType::Q2K | QuantType::Q3K | QuantType::IQ4NL | QuantType::IQ4XS
    )
}

/// Write `w` (`[outputs][inputs]`, ggml or repacked rows of a type [`target`] takes) into `out`
/// in the input-block layout of `inputs` rows of `outputs` columns of type `qt` (the target, or
/// Q4_1 and Q5_1 for Q4_K and Q5_K sources of any shape they take).
pub fn convert(w: &Weight, qt: QuantType, out: &mut [u8]) {
    let (n_out, n_in) = (w.rows, w.cols);
    let as_q4_1 = w.qtype == QuantType::Q4K && qt == QuantType::Q4_1;
    let as_q5_1 = w.qtype == QuantType::Q5K && qt == QuantType::Q5_1 && n_out.is_multiple_of(64);
    assert!(
        as_q4_1 || as_q5_1 || target(w.qtype, n_out, n_in) == Some(qt),
        "input blocks of {:?} as {qt:?}",
        w.qtype
    );
    assert_eq!(out.len(), n_in * qt.row_bytes(n_out), "input blocks: size");
    if matches!(qt, QuantType::Q4K | QuantType::Q5K) {
        return convert_k(w, out);
    }
    // The type whose blocks are unpacked: the source's, or the target's for a requantized one.
    let sq = if requantized(w.qtype) { qt } else { w.qtype };
    let (bl, g) = (sq.block_len(), group_len(sq));
    assert_eq!(g, 32, "input blocks take groups of 32");
    let bb = sq.block_bytes();
    let (mut values, mut requant) = (vec![0f32; n_in], Vec::with_capacity(qt.row_bytes(n_in)));
    let block_bytes = 32 * qt.row_bytes(n_out);
    let scales = match qt {
        QuantType::Q4_1 | QuantType::Q5_1 => 4 * n_out,
        _ => 2 * n_out,
    };
    // The 5-bit types' plane of fifth bits, after the nibbles.
    let high = scales + 16 * n_out;
    let mut ggml = vec![0u8; w.qtype.row_bytes(n_in)];
    let (mut q, mut sc, mut off) = (vec![0i8; bl], vec![0f32; bl / g], vec![0f32; bl / g]);
    // 32 outputs at a time: their quants of every input, then each input's 32 (one ggml
    // group of the target's row).
    let mut quants = vec![0u8; 32 * n_in];
    for o0 in (0..n_out).step_by(32) {
        for k in 0..32 {
            let o = o0 + k;
            let row = ggml_row(w, o, &mut ggml);
            let row = match requantized(w.qtype) {
                true => {
                    dequantize_row(w.qtype, row, &mut values);
                    requant.clear();
                    quantize::quantize_row(qt, &values, &mut requant)
                        .expect("a requantized source's target is writable");
                    &requant[..]
                }
                false => row,
            };
            for (blk, src) in row.chunks_exact(bb).enumerate() {
                unpack_block(sq, src, &mut q, &mut sc, &mut off);
                for j in 0..bl / g {
                    let b = (blk * bl + j * g) / 32;
                    let block = &mut out[b * block_bytes..(b + 1) * block_bytes];
                    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
                    block[2 * o..2 * o + 2].copy_from_slice(&h(sc[j]));
                    if matches!(qt, QuantType::Q4_1 | QuantType::Q5_1) {
                        block[2 * (n_out + o)..2 * (n_out + o) + 2].copy_from_slice(&h(off[j]));
                    }
                    for r in 0..32 {
                        // Q4_0's and Q5_0's unpacked values are `n - 8` and `n - 16`: store
                        // the quant `n`.
                        let v = q[j * g + r];
                        quants[k * n_in + b * 32 + r] = match sq {
                            QuantType::Q4_0 => (v + 8) as u8,
                            QuantType::Q5_0 => (v + 16) as u8,
                            _ => v as u8,
                        };
                    }
                }
            }
        }
        for i in 0..n_in {
            let (b, r) = (i / 32, i % 32);
            let block = &mut out[b * block_bytes..(b + 1) * block_bytes];
            let col: [u8; 32] = std::array::from_fn(|k| quants[k * n_in + i]);
            match qt {
                QuantType::Q8_0 => {
                    let at = scales + r * n_out + o0;
                    block[at..at + 32].copy_from_slice(&col);
                }
                _ => {
                    let at = scales + r * n_out / 2 + o0 / 2;
                    for k in 0..16 {
                        block[at + k] = (col[k] & 0xF) | ((col[k + 16] & 0xF) << 4);
                    }
                    if axpy_blocks::five_bit(qt) {
                        // Outputs o0..o0 + 32: 4 bytes of the row's words (o0 a multiple of 32).
                        let bits = (col.iter().enumerate())
                            .fold(0u32, |b, (k, &v)| b | ((v as u32 >> 4) & 1) << k);
                        let at = high + r * n_out / 8 + o0 / 8;
                        block[at..at + 4].copy_from_slice(&bits.to_le_bytes());
                    }
                }
            }
        }
    }
    debug_assert!(axpy_blocks::supports(qt));
}

/// Row `o` of `w` in ggml's layout (unpacked into `ggml` if `w` is repacked).
fn ggml_row<'a>(w: &Weight<'a>, o: usize, ggml: &'a mut [u8]) -> &'a [u8] {
    match w.layout {
        RowLayout::Repacked => {
            repack::unpack_row(w.qtype, w.row(o), ggml);
            ggml
        }
        _ => w.row(o),
    }
}

/// [`convert`] of Q4_K or Q5_K into its own form (`kernels::axpy_blocks`): per 32 outputs,
/// each super-block's `d` and `dmin` into its shared table, each block's 6-bit scales and mins
/// into its own table, and its quants transposed (Q5_K's fifth bits into their plane).
fn convert_k(w: &Weight, out: &mut [u8]) {
    let (n_out, n_in, five) = (w.rows, w.cols, w.qtype == QuantType::Q5K);
    // A ggml block: d, dmin (f16), 12 bytes of 6-bit scales and mins, Q5_K's 32 bytes of fifth
    // bits, 128 of quants.
    let (bb, qs_at) = if five { (176, 48) } else { (144, 16) };
    // Each block's own table (1.5 bytes an output) at its start; a super-block's `d` and `dmin`
    // in the last `4 n_out` bytes of its blocks' ranges.
    let (range, table) = (
        |b| axpy_blocks::block_range(w.qtype, n_out, b),
        3 * n_out / 2,
    );
    let mut ggml = vec![0u8; w.qtype.row_bytes(n_in)];
    // Per block of 32 inputs, the 32 outputs' scales and mins; per output, its quants.
    let blocks = n_in / 32;
    let (mut sc, mut m) = (vec![[0u8; 32]; blocks], vec![[0u8; 32]; blocks]);
    let mut quants = vec![0u8; 32 * n_in];
    for o0 in (0..n_out).step_by(32) {
        for k in 0..32 {
            let o = o0 + k;
            let row = ggml_row(w, o, &mut ggml);
            for (s, src) in row.chunks_exact(bb).enumerate() {
                let head = range(8 * s).end - 4 * n_out;
                out[head + 2 * o..][..2].copy_from_slice(&src[0..2]);
                out[head + 2 * (n_out + o)..][..2].copy_from_slice(&src[2..4]);
                let scales: &[u8; 12] = src[4..16].try_into().expect("12 bytes");
                for j in 0..8 {
                    let b = 8 * s + j;
                    (sc[b][k], m[b][k]) = dejavu_backend_api::quant::q4k_scale_min(j, scales);
                    for (l, &n) in src[qs_at + 32 * (j / 2)..][..32].iter().enumerate() {
                        let low = if j % 2 == 0 { n & 0xF } else { n >> 4 };
                        let high = if five { (src[16 + l] >> j & 1) << 4 } else { 0 };
                        quants[k * n_in + 32 * b + l] = low | high;
                    }
                }
            }
        }
        for b in 0..blocks {
            let at = range(b).start;
            axpy_blocks::put_k4_scale_min(&mut out[at..at + table], n_out, o0, &sc[b], &m[b]);
            for r in 0..32 {
                let col: [u8; 32] = std::array::from_fn(|k| quants[k * n_in + 32 * b + r]);
                let dst = &mut out[at + table + r * n_out / 2 + o0 / 2..][..16];
                for (k, d) in dst.iter_mut().enumerate() {
                    *d = col[k] & 0xF | (col[k + 16] & 0xF) << 4;
                }
                if five {
                    // Outputs o0..o0 + 32: 4 bytes of the row's words of fifth bits.
                    let bits = (col.iter().enumerate())
                        .fold(0u32, |a, (k, &v)| a | ((v as u32 >> 4) & 1) << k);
                    let hb = at + table + 16 * n_out + r * n_out / 8 + o0 / 8;
                    out[hb..hb + 4].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dejavu_backend_api::quantize;

    /// Every input's row of the converted matrix equals the source's column (dequantized), for
    /// each source type: exactly for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; for Q4_K and Q5_K within
    /// the f16 rounding of their scale and min terms (2^-10 of the row's largest magnitude);
    /// for the requantized ones within a step of their target (its largest magnitude over 127
    /// for Q8_0, over 15 for Q5_0, in each output's group of 32 inputs).
    #[test]
    fn converted_rows_are_the_source_columns() {
        // 64 outputs: Q4_K as Q4_1; 512 outputs, Q4_K's own form.
        for (n_out, n_in) in [(64, 256), (512, 512)] {
            converted_rows_of(n_out, n_in);
        }
    }

    fn converted_rows_of(n_out: usize, n_in: usize) {
        let vals: Vec<f32> = (0..n_out * n_in)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        for src in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q4K,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q5K,
            QuantType::Q6K,
            QuantType::Q2K,
            QuantType::Q3K,
            QuantType::IQ4NL,
            QuantType::IQ4XS,
        ] {
            if !quantize::WRITABLE.contains(&src) {
                continue;
            }
            let mut bytes = Vec::new();
            for row in vals.chunks_exact(n_in) {
                quantize::quantize_row(src, row, &mut bytes).unwrap();
            }
            let w = Weight::new(src, n_out, n_in, &bytes).unwrap();
            let qt = target(src, n_out, n_in).unwrap();
            let mut out = vec![0u8; n_in * qt.row_bytes(n_out)];
            convert(&w, qt, &mut out);
            let t = Weight::new(qt, n_in, n_out, &out)
                .unwrap()
                .with_layout(RowLayout::InputBlocks);
            let mut src_row = vec![0f32; n_in];
            let mut col = vec![0f32; n_out];
            let k = dejavu_backend_cpu::kernels::table::Kernels::f32_reference();
            for i in 0..n_in {
                dejavu_backend_cpu::matmul::dequantize_row(&k, &t, i, &mut col);
                for (o, c) in col.iter().enumerate() {
                    dejavu_backend_cpu::dequant::dequantize_row(src, w.row(o), &mut src_row);
                    let want = src_row[i];
                    // Q4_K: f16 rounding of `d * sc` and `dmin * m`, each term up to the row's
                    // largest magnitude.
                    let big = src_row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let group = &src_row[i / 32 * 32..][..32];
                    let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let tol = match (src, qt) {
                        (QuantType::Q4K, QuantType::Q4K) | (QuantType::Q5K, QuantType::Q5K) => 0.0,
                        (QuantType::Q4K | QuantType::Q5K, _) => 2.0 * big / 1024.0,
                        (QuantType::Q6K, _) => {
                            assert_eq!(qt, QuantType::Q8_0);
                            amax / 127.0
                        }
                        (QuantType::Q2K | QuantType::Q3K | QuantType::IQ4NL, _)
                        | (QuantType::IQ4XS, _) => {
                            assert_eq!(qt, QuantType::Q5_0);
                            amax / 15.0
                        }
                        _ => 0.0,
                    };
                    assert!(
                        (c - want).abs() <= tol,
                        "{src:?} input {i} output {o}: {c} vs {want}"
                    );
                }
            }
        }
    }
}
