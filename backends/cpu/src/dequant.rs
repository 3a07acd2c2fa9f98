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
/// Integer types go through [`unpack_block`]: `y[i] = scale[i / G] * q[i] + off[i / G]`.
#[inline]
pub fn dequantize_block(qtype: QuantType, b: &[u8], y: &mut [f32]) {
    match qtype {
        QuantType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        QuantType::F16 => y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        QuantType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => {
            const MAX_GROUPS: usize = QK_K / 16;
            let (mut q, mut scale, mut off) = ([0i8; QK_K], [0f32; MAX_GROUPS], [0f32; MAX_GROUPS]);
            let (bl, g) = (qtype.block_len(), group_len(qtype));
            unpack_block(
                qtype,
                b,
                &mut q[..bl],
                &mut scale[..bl / g],
                &mut off[..bl / g],
            );
            for ((y, q), i) in y.iter_mut().zip(&q[..bl]).zip(0..) {
                *y = scale[i / g] * *q as f32 + off[i / g];
            }
        }
    }
}

/// Elements that share one scale and one offset in [`unpack_block`]'s output: 16 for the types
/// with 16-element sub-blocks (Q2_K, Q3_K, Q6_K), 32 for the other integer types.
pub fn group_len(qtype: QuantType) -> usize {
    match qtype {
        QuantType::Q2K | QuantType::Q3K | QuantType::Q6K => 16,
        _ => 32,
    }
}

/// Whether [`unpack_block`]'s offsets can be nonzero (the types with a min term).
pub fn has_offset(qtype: QuantType) -> bool {
    matches!(
        qtype,
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q2K | QuantType::Q4K | QuantType::Q5K
    )
}

/// One block of an integer type as 8-bit integers with a float scale and offset per group of
/// [`group_len`] elements: value `i` is `scale[i / G] * q[i] + off[i / G]` exactly as ggml's
/// formula computes it (the block formulas of `dejavu_backend_api::quant`). `q` holds
/// `qtype.block_len()` values, `scale` and `off` one per group; float types panic.
pub fn unpack_block(qtype: QuantType, b: &[u8], q: &mut [i8], scale: &mut [f32], off: &mut [f32]) {
    off.fill(0.0);
    match qtype {
        QuantType::Q8_0 => {
            let b: BlockQ8_0 = pod_read_unaligned(b);
            scale[0] = b.d.to_f32();
            q.copy_from_slice(&b.qs);
        }
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::IQ4NL => {
            let (d, qs, map): (f32, [u8; QK / 2], fn(u8) -> i8) = match qtype {
                QuantType::Q4_0 => {
                    let b: BlockQ4_0 = pod_read_unaligned(b);
                    (b.d.to_f32(), b.qs, |n| n as i8 - 8)
                }
                QuantType::Q4_1 => {
                    let b: BlockQ4_1 = pod_read_unaligned(b);
                    off[0] = b.m.to_f32();
                    (b.d.to_f32(), b.qs, |n| n as i8)
                }
                _ => {
                    let b: BlockIQ4NL = pod_read_unaligned(b);
                    (b.d.to_f32(), b.qs, |n| KVALUES_IQ4NL[n as usize])
                }
            };
            scale[0] = d;
            for (j, &n) in qs.iter().enumerate() {
                q[j] = map(n & 0xF);
                q[j + QK / 2] = map(n >> 4);
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (d, qh, qs, zero) = match qtype {
                QuantType::Q5_0 => {
                    let b: BlockQ5_0 = pod_read_unaligned(b);
                    (b.d.to_f32(), b.qh, b.qs, 16)
                }
                _ => {
                    let b: BlockQ5_1 = pod_read_unaligned(b);
                    off[0] = b.m.to_f32();
                    (b.d.to_f32(), b.qh, b.qs, 0)
                }
            };
            scale[0] = d;
            let qh = u32::from_le_bytes(qh);
            for (j, &n) in qs.iter().enumerate() {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                q[j] = ((n as u32 & 0xF) | h0) as i8 - zero;
                q[j + QK / 2] = ((n as u32 >> 4) | h1) as i8 - zero;
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            // Sub-block j: 32 values, low nibbles of bytes 32(j/2).. for even j, high for odd;
            // Q5_K adds bit j of each qh byte as the fifth bit.
            let (d, dmin, scales, qs, qh) = match qtype {
                QuantType::Q4K => {
                    let b: BlockQ4K = pod_read_unaligned(b);
                    (b.d.to_f32(), b.dmin.to_f32(), b.scales, b.qs, None)
                }
                _ => {
                    let b: BlockQ5K = pod_read_unaligned(b);
                    (b.d.to_f32(), b.dmin.to_f32(), b.scales, b.qs, Some(b.qh))
                }
            };
            for (j, q) in q.chunks_exact_mut(32).enumerate() {
                let (sc, m) = q4k_scale_min(j, &scales);
                scale[j] = d * sc as f32;
                off[j] = -(dmin * m as f32);
                for (l, (q, &n)) in q.iter_mut().zip(&qs[32 * (j / 2)..][..32]).enumerate() {
                    let low = if j % 2 == 0 { n & 0xF } else { n >> 4 };
                    let high = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
                    *q = (low | high) as i8;
                }
            }
        }
        QuantType::Q6K => {
            let b: BlockQ6K = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (s, sc) in scale.iter_mut().zip(&b.scales) {
                *s = d * *sc as f32;
            }
            // 2 halves of 128; each reads 64 bytes of ql, 32 of qh.
            for n in 0..2 {
                let (ql, qh) = (&b.ql[64 * n..][..64], &b.qh[32 * n..][..32]);
                let q = &mut q[128 * n..][..128];
                for l in 0..32 {
                    q[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    q[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
        QuantType::Q2K | QuantType::Q3K => {
            // Halves of 128: 4 shifts of the same 32 bytes, each two sub-blocks of 16; Q3_K
            // subtracts 4 where the value's bit of `hmask` is clear.
            let (qs, hmask) = if qtype == QuantType::Q2K {
                let b: BlockQ2K = pod_read_unaligned(b);
                let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
                for (i, &sc) in b.scales.iter().enumerate() {
                    scale[i] = d * (sc & 0xF) as f32;
                    off[i] = -(dmin * (sc >> 4) as f32);
                }
                (b.qs, None)
            } else {
                let b: BlockQ3K = pod_read_unaligned(b);
                for (s, sc) in scale.iter_mut().zip(q3k_scales(&b.scales)) {
                    *s = b.d.to_f32() * sc as f32;
                }
                (b.qs, Some(b.hmask))
            };
            for (k, q) in q.chunks_exact_mut(32).enumerate() {
                let (n, shift) = (k / 4, 2 * (k % 4));
                for (l, q) in q.iter_mut().enumerate() {
                    let low = ((qs[32 * n + l] >> shift) & 3) as i8;
                    *q = match hmask {
                        Some(h) if h[l] >> k & 1 == 0 => low - 4,
                        _ => low,
                    };
                }
            }
        }
        QuantType::IQ4XS => {
            let b: BlockIQ4XS = pod_read_unaligned(b);
            let d = b.d.to_f32();
            for (j, q) in q.chunks_exact_mut(32).enumerate() {
                scale[j] = d * iq4xs_scale(&b, j) as f32;
                for (l, &n) in b.qs[16 * j..16 * j + 16].iter().enumerate() {
                    q[l] = KVALUES_IQ4NL[(n & 0xF) as usize];
                    q[l + 16] = KVALUES_IQ4NL[(n >> 4) as usize];
                }
            }
        }
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {
            panic!("{} rows are not integers", qtype.name())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::dequantize_row;
    use dejavu_backend_api::quantize::{quantize_row, quantize_row_absmax};
    use dejavu_backend_api::QuantType;

    fn rms_error(q: QuantType, x: &[f32], one_pass: bool) -> f32 {
        let mut bytes = Vec::new();
        if one_pass {
            quantize_row_absmax(q, x, &mut bytes).unwrap();
        } else {
            quantize_row(q, x, &mut bytes).unwrap();
        }
        assert_eq!(bytes.len(), q.row_bytes(x.len()));
        let mut y = vec![0f32; x.len()];
        dequantize_row(q, &bytes, &mut y);
        let se: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
        (se / x.len() as f32).sqrt()
    }

    /// The one-pass K-quant rounding (synthetic models' weights) is a real rounding of its input:
    /// on rows of normal-like values its error is within 1.2x of ggml's searched rounding and
    /// below a uniform quantizer's over the sub-block's range.
    #[test]
    fn one_pass_k_quants_round_their_input() {
        let mut state = 7u64;
        let mut uniform = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let x: Vec<f32> = (0..16 * 256)
            .map(|_| (0..4).map(|_| uniform()).sum::<f32>() - 2.0)
            .collect();
        for (q, levels) in [
            (QuantType::Q4K, 15.0),
            (QuantType::Q5K, 31.0),
            (QuantType::Q6K, 63.0),
        ] {
            let (fast, search) = (rms_error(q, &x, true), rms_error(q, &x, false));
            // Values within +-2: a sub-block's range is at most 4.
            let uniform_bound = 4.0 / levels / 12f32.sqrt();
            eprintln!("{q:?}: one pass {fast:.5}, search {search:.5}, bound {uniform_bound:.5}");
            assert!(fast <= 1.2 * search && fast < uniform_bound, "{q:?}");
        }
    }
}
