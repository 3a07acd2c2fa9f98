//! Dequantization of one row, per weight type: the scalar reference every other kernel is checked
//! against. Formulas are those of the block structs in `dejavu_backend_api::quant` (ggml's).
use bytemuck::pod_read_unaligned;
use dejavu_backend_api::quant::*;
use half::{bf16, f16};

/// Dequantize `out.len()` elements from `row` (exactly `qtype.row_bytes(out.len())` bytes).
pub fn dequantize_row(qtype: QuantType, row: &[u8], out: &mut [f32]) {
    check(qtype, row, out);
    let bb = qtype.block_bytes();
    let bl = qtype.block_len();
    for (blk, y) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
        dequantize_block(qtype, blk, y);
    }
}

/// The length contract of a row dequantization, checked in release builds by every tier:
/// `row` holds exactly the `out.len()` elements of `qtype`.
#[inline]
pub fn check(qtype: QuantType, row: &[u8], out: &[f32]) {
    assert!(
        out.len().is_multiple_of(qtype.block_len()) && row.len() == qtype.row_bytes(out.len()),
        "{} dequantization: a row of {} bytes into {} values",
        qtype.name(),
        row.len(),
        out.len()
    );
}

/// Dequantize one block (`qtype.block_bytes()` bytes) into `y` (`qtype.block_len()` elements).
#[inline]
pub fn dequantize_block(qtype: QuantType, b: &[u8], y: &mut [f32]) {
    match qtype {
        QuantType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        QuantType::F16 => y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        QuantType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        QuantType::Q8_0 => {
            let b: BlockQ8_0 = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (y, &q) in y.iter_mut().zip(&b.qs) {
                *y = d * q as f32;
            }
        }
        QuantType::Q4_0 => {
            let b: BlockQ4_0 = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (j, &q) in b.qs.iter().enumerate() {
                y[j] = d * ((q & 0xF) as i32 - 8) as f32;
                y[j + QK / 2] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        QuantType::Q4_1 => {
            let b: BlockQ4_1 = pod_read_unaligned(b);
            let (d, m) = (b.d.to_f32(), b.m.to_f32());
            for (j, &q) in b.qs.iter().enumerate() {
                y[j] = d * (q & 0xF) as f32 + m;
                y[j + QK / 2] = d * (q >> 4) as f32 + m;
            }
        }
        QuantType::Q5_0 => {
            let b: BlockQ5_0 = pod_read_unaligned(b);
            let d = b.d.to_f32();
            let qh = u32::from_le_bytes(b.qh);
            for (j, &q) in b.qs.iter().enumerate() {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = d * (((q as u32 & 0xF) | h0) as i32 - 16) as f32;
                y[j + QK / 2] = d * (((q as u32 >> 4) | h1) as i32 - 16) as f32;
            }
        }
        QuantType::Q4K => {
            let b: BlockQ4K = pod_read_unaligned(b);
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            // 4 groups of 64: low nibbles use sub-block 2g, high nibbles sub-block 2g+1.
            for g in 0..4 {
                let (s0, m0) = q4k_scale_min(2 * g, &b.scales);
                let (s1, m1) = q4k_scale_min(2 * g + 1, &b.scales);
                let (d0, d1) = (d * s0 as f32, d * s1 as f32);
                let (o0, o1) = (dmin * m0 as f32, dmin * m1 as f32);
                let q = &b.qs[32 * g..32 * g + 32];
                let y = &mut y[64 * g..64 * g + 64];
                for l in 0..32 {
                    y[l] = d0 * (q[l] & 0xF) as f32 - o0;
                    y[l + 32] = d1 * (q[l] >> 4) as f32 - o1;
                }
            }
        }
        QuantType::Q6K => {
            let b: BlockQ6K = pod_read_unaligned(b);
            let d = b.d.to_f32();
            // 2 halves of 128; each reads 64 bytes of ql, 32 of qh, 8 scales.
            for n in 0..2 {
                let ql = &b.ql[64 * n..64 * n + 64];
                let qh = &b.qh[32 * n..32 * n + 32];
                let sc = &b.scales[8 * n..8 * n + 8];
                let y = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * sc[is] as f32 * q1 as f32;
                    y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                    y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                    y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
                }
            }
        }
        QuantType::Q5_1 => {
            let b: BlockQ5_1 = pod_read_unaligned(b);
            let (d, m) = (b.d.to_f32(), b.m.to_f32());
            let qh = u32::from_le_bytes(b.qh);
            for (j, &q) in b.qs.iter().enumerate() {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = d * ((q as u32 & 0xF) | h0) as f32 + m;
                y[j + QK / 2] = d * ((q as u32 >> 4) | h1) as f32 + m;
            }
        }
        QuantType::Q2K => {
            let b: BlockQ2K = pod_read_unaligned(b);
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            // Halves of 128: 4 shifts of the same 32 bytes, each two sub-blocks of 16.
            for (k, y) in y.chunks_exact_mut(32).enumerate() {
                let (n, shift) = (k / 4, 2 * (k % 4));
                for (l, y) in y.iter_mut().enumerate() {
                    let sc = b.scales[8 * n + 2 * (k % 4) + l / 16];
                    let q = (b.qs[32 * n + l] >> shift) & 3;
                    *y = d * (sc & 0xF) as f32 * q as f32 - dmin * (sc >> 4) as f32;
                }
            }
        }
        QuantType::Q3K => {
            let b: BlockQ3K = pod_read_unaligned(b);
            let d = b.d.to_f32();
            let sc = q3k_scales(&b.scales);
            for (k, y) in y.chunks_exact_mut(32).enumerate() {
                let (n, shift) = (k / 4, 2 * (k % 4));
                for (l, y) in y.iter_mut().enumerate() {
                    let low = ((b.qs[32 * n + l] >> shift) & 3) as i32;
                    let high = if b.hmask[l] >> k & 1 == 1 { 0 } else { 4 };
                    *y = d * sc[8 * n + 2 * (k % 4) + l / 16] as f32 * (low - high) as f32;
                }
            }
        }
        QuantType::Q5K => {
            let b: BlockQ5K = pod_read_unaligned(b);
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let (sc, m) = q4k_scale_min(j, &b.scales);
                let q = &b.qs[32 * (j / 2)..][..32];
                for (l, y) in y.iter_mut().enumerate() {
                    let low = if j % 2 == 0 { q[l] & 0xF } else { q[l] >> 4 };
                    let q5 = low | (((b.qh[l] >> j) & 1) << 4);
                    *y = d * sc as f32 * q5 as f32 - dmin * m as f32;
                }
            }
        }
        QuantType::IQ4NL => {
            let b: BlockIQ4NL = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (j, &q) in b.qs.iter().enumerate() {
                y[j] = d * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
                y[j + QK / 2] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
            }
        }
        QuantType::IQ4XS => {
            let b: BlockIQ4XS = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let dl = d * iq4xs_scale(&b, j) as f32;
                for (l, &q) in b.qs[16 * j..16 * j + 16].iter().enumerate() {
                    y[l] = dl * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
                    y[l + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
                }
            }
        }
    }
}
