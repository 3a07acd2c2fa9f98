//! Dot product of one quantized row with an f32 vector: `sum_i dequant(row)[i] * x[i]`.
//!
//! Scalar reference: dequantize block by block into a stack buffer, multiply-accumulate in f32 with
//! 8 independent lanes (so the compiler can vectorise it on every target). The SIMD integer-dot
//! tiers of the next milestone are tested against this function.
use crate::dequant::dequantize_block;
use dejavu_backend_api::quant::{QuantType, QK_K};

pub fn dot_row(qtype: QuantType, row: &[u8], x: &[f32]) -> f32 {
    assert!(
        x.len().is_multiple_of(qtype.block_len()) && row.len() == qtype.row_bytes(x.len()),
        "{} row dot: a row of {} bytes against {} activations",
        qtype.name(),
        row.len(),
        x.len()
    );
    if qtype == QuantType::F32 {
        let w: &[f32] = bytemuck::try_cast_slice(row).unwrap_or(&[]);
        if w.len() == x.len() {
            return dot_f32(w, x);
        }
    }
    let (bb, bl) = (qtype.block_bytes(), qtype.block_len());
    // Group scalar types into chunks of 256 to amortise the per-block dispatch.
    let per = if bl == 1 { QK_K } else { bl };
    let mut buf = [0f32; QK_K];
    let mut acc = 0f32;
    for (bytes, xs) in row.chunks(per / bl * bb).zip(x.chunks(per)) {
        let y = &mut buf[..xs.len()];
        for (b, yy) in bytes.chunks_exact(bb).zip(y.chunks_exact_mut(bl)) {
            dequantize_block(qtype, b, yy);
        }
        acc += dot_f32(y, xs);
    }
    acc
}

/// f32 dot product with 8 accumulators.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: slices of unequal length");
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
