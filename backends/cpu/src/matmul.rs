//! `y[t][r] = dot(W[r], x[t])` over a subset of rows (see `Backend::matmul`).
//!
//! Two paths:
//! - few tokens (decode) or a row subset: each token's activations are quantized once to Q8A
//!   (for quantized weights) and every selected row is dotted with the tier's integer kernel,
//!   blocks of rows spread over the [`SpinPool`];
//! - many tokens with every row (prefill): tiles of rows are dequantized to f32 and multiplied
//!   with the `gemm` crate (f32 activations), each thread of the pool taking a range of rows.
use crate::kernels::table::{Kernels, RowDot};
use crate::pool::SpinPool;
use dejavu_backend_api::quant::{BlockQ8A, QK};
use dejavu_backend_api::{IndexSet, Weight};
use std::cell::RefCell;

/// From this many tokens on, a dense matmul goes through dequantized tiles and `gemm`.
pub const GEMM_MIN_TOKENS: usize = 4;
/// Rows per dequantized tile (tile size = TILE_ROWS * cols * 4 bytes).
const TILE_ROWS: usize = 512;
/// Rows per pool task on the dot path.
const ROWS_PER_TASK: usize = 32;

thread_local! {
    /// Quantized activations of the calling thread, reused across calls (no per-call allocation
    /// once grown to the widest input).
    static ACT: RefCell<Vec<BlockQ8A>> = const { RefCell::new(Vec::new()) };
}

pub fn matmul(k: &Kernels, pool: &SpinPool, w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
    let n_tok = x.len() / w.cols;
    debug_assert_eq!(x.len(), n_tok * w.cols);
    debug_assert_eq!(y.len(), n_tok * w.rows);
    debug_assert_eq!(rows.universe(), w.rows);
    if rows.is_full() && n_tok >= GEMM_MIN_TOKENS {
        return matmul_gemm(k, pool, w, x, y, n_tok);
    }
    for (xt, yt) in x.chunks_exact(w.cols).zip(y.chunks_exact_mut(w.rows)) {
        match k.dot(w.qtype) {
            RowDot::F32(dot) => rows_dot(pool, w, rows, yt, |r| dot(r, xt)),
            RowDot::Q8A(dot) => ACT.with_borrow_mut(|act| {
                act.resize(
                    w.cols / QK,
                    BlockQ8A {
                        d: 0.0,
                        s: 0.0,
                        qs: [0; QK],
                    },
                );
                (k.quantize)(xt, act);
                let act = &act[..];
                rows_dot(pool, w, rows, yt, |r| dot(r, act))
            }),
        }
    }
}

/// `y[r] = dot(row r)` for selected rows, 0 elsewhere; blocks of rows spread over the pool.
fn rows_dot(
    pool: &SpinPool,
    w: &Weight,
    rows: &IndexSet,
    y: &mut [f32],
    dot: impl Fn(&[u8]) -> f32 + Sync,
) {
    if !rows.is_full() {
        y.fill(0.0);
    }
    let n = rows.len();
    let yp = SyncPtr(y.as_mut_ptr());
    pool.run(n.div_ceil(ROWS_PER_TASK), &|task| {
        for i in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(n) {
            let r = rows.get(i);
            // SAFETY: IndexSet entries are unique and < w.rows == y.len(), so every call writes a
            // distinct element of `y`, which outlives `pool.run`.
            unsafe { *yp.get().add(r) = dot(w.row(r)) };
        }
    });
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(*mut f32);
// SAFETY: only used for disjoint element writes (see `rows_dot`).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    pub(crate) fn new(p: *mut f32) -> Self {
        Self(p)
    }
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

fn matmul_gemm(
    kern: &Kernels,
    pool: &SpinPool,
    w: &Weight,
    x: &[f32],
    y: &mut [f32],
    n_tok: usize,
) {
    let k = w.cols;
    let mut tile = vec![0f32; TILE_ROWS.min(w.rows) * k];
    let threads = pool.threads();
    let yp = SyncPtr::new(y.as_mut_ptr());
    for r0 in (0..w.rows).step_by(TILE_ROWS) {
        let nr = TILE_ROWS.min(w.rows - r0);
        let tp = SyncPtr::new(tile.as_mut_ptr());
        pool.run(nr, &|j| {
            // SAFETY: task j alone writes row j of the tile (`k` floats inside `tile`).
            let out = unsafe { std::slice::from_raw_parts_mut(tp.get().add(j * k), k) };
            (kern.dequantize)(w.qtype, w.row(r0 + j), out);
        });
        // Each thread multiplies a disjoint range of the tile's rows (= output columns).
        let per = nr.div_ceil(threads);
        pool.run(threads, &|t| {
            let (c0, c1) = (t * per, ((t + 1) * per).min(nr));
            if c0 >= c1 {
                return;
            }
            // SAFETY: all pointers come from live slices with the stated extents: dst is y viewed
            // as n_tok x w.rows (row stride w.rows), columns r0+c0..r0+c1, written by this task
            // alone; lhs is x (n_tok x k, row stride k); rhs(kk, j) = tile[(c0 + j) * k + kk].
            unsafe {
                gemm::gemm(
                    n_tok,
                    c1 - c0,
                    k,
                    yp.get().add(r0 + c0),
                    1,
                    w.rows as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tp.get().add(c0 * k),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    }
}
