//! `y[t][r] = dot(W[r], x[t])` over a subset of rows (see `Backend::matmul`).
//!
//! Two paths with one meaning:
//! - few tokens (decode) or a row subset: one `dot_row` per (token, row), rayon over rows;
//! - many tokens with every row (prefill): dequantize tiles of rows to f32 and multiply them with
//!   the `gemm` crate. Both compute in f32 on the dequantized weights, so they agree to rounding.
use crate::dequant::dequantize_row;
use crate::vec_dot::dot_row;
use dejavu_backend_api::{IndexSet, Weight};
use rayon::prelude::*;

/// From this many tokens on, a dense matmul goes through dequantized tiles and `gemm`.
pub const GEMM_MIN_TOKENS: usize = 4;
/// Rows per dequantized tile (tile size = TILE_ROWS * cols * 4 bytes).
const TILE_ROWS: usize = 512;
/// Rows per rayon task on the dot path.
const ROWS_PER_TASK: usize = 16;

pub fn matmul(w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
    let n_tok = x.len() / w.cols;
    debug_assert_eq!(x.len(), n_tok * w.cols);
    debug_assert_eq!(y.len(), n_tok * w.rows);
    debug_assert_eq!(rows.universe(), w.rows);
    if rows.is_full() && n_tok >= GEMM_MIN_TOKENS {
        return matmul_gemm(w, x, y, n_tok);
    }
    for (xt, yt) in x.chunks_exact(w.cols).zip(y.chunks_exact_mut(w.rows)) {
        if rows.is_full() {
            yt.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(c, ys)| {
                    for (j, yv) in ys.iter_mut().enumerate() {
                        *yv = dot_row(w.qtype, w.row(c * ROWS_PER_TASK + j), xt);
                    }
                });
        } else {
            let vals: Vec<f32> = (0..rows.len())
                .into_par_iter()
                .with_min_len(ROWS_PER_TASK)
                .map(|i| dot_row(w.qtype, w.row(rows.get(i)), xt))
                .collect();
            yt.fill(0.0);
            for (i, v) in vals.into_iter().enumerate() {
                yt[rows.get(i)] = v;
            }
        }
    }
}

fn matmul_gemm(w: &Weight, x: &[f32], y: &mut [f32], n_tok: usize) {
    let k = w.cols;
    let mut tile = vec![0f32; TILE_ROWS.min(w.rows) * k];
    for r0 in (0..w.rows).step_by(TILE_ROWS) {
        let nr = TILE_ROWS.min(w.rows - r0);
        let tile = &mut tile[..nr * k];
        tile.par_chunks_mut(k)
            .enumerate()
            .for_each(|(j, out)| dequantize_row(w.qtype, w.row(r0 + j), out));
        // SAFETY: all pointers come from live slices with the stated extents:
        // dst is y viewed as n_tok x w.rows (row stride w.rows), starting at column r0, nr columns;
        // lhs is x (n_tok x k, row stride k); rhs(kk, j) = tile[j * k + kk] (k x nr).
        unsafe {
            gemm::gemm(
                n_tok,
                nr,
                k,
                y.as_mut_ptr().add(r0),
                1,
                w.rows as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                tile.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            );
        }
    }
}
