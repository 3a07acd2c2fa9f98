//! `y[t] = sum over r in rows of a[t][r] * W[r]` for a neuron-major weight (see
//! `Backend::axpy_rows`): the sparse MLP's down projection reads only the rows of the neurons it
//! kept, each a contiguous run of bytes.
//!
//! Each pool thread takes one contiguous range of the selected rows, prefetches the rows it will
//! read next and adds them, a few at a time, into its own partial sums: for one token with the
//! tier's `axpy_q` (dequantization fused into the multiply-add); for several (a step of several
//! sequences) each segment of the rows is dequantized once, then added into every token's sum
//! with the tier's f32 `axpy_rows`. The caller adds the partials. [`reference()`] is the scalar definition the test compares against.
use crate::dequant::dequantize_row;
use crate::kernels::axpy_blocks;
use crate::kernels::table::Kernels;
use crate::matmul::SyncPtr;
use crate::pool::SpinPool;
use crate::prefetch;
use dejavu_backend_api::{IndexSet, Weight};
use std::cell::RefCell;

/// Rows summed per kernel call.
const CHUNK: usize = crate::kernels::axpy_q::MAX_ROWS;
/// Outputs per segment of the row loop (see `axpy_matmul`): 544 bytes of a Q8_0 row.
const SEGMENT_COLS: usize = 512;
/// Fewer selected rows than this per thread are not worth a second thread.
const MIN_ROWS_PER_THREAD: usize = 32;

thread_local! {
    /// Per-thread partial sums of the calling thread's dispatch.
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The definition, in scalar f32: dequantize each selected row and accumulate in order.
pub fn reference(w: &Weight, rows: &IndexSet, a: &[f32], y: &mut [f32]) {
    let mut row = vec![0f32; w.cols];
    for (at, yt) in a.chunks_exact(w.rows).zip(y.chunks_exact_mut(w.cols)) {
        yt.fill(0.0);
        for r in rows.iter() {
            dequantize_row(w.qtype, w.row(r), &mut row);
            yt.iter_mut().zip(&row).for_each(|(y, x)| *y += at[r] * x);
        }
    }
}

pub fn axpy_matmul(
    k: &Kernels,
    pool: &SpinPool,
    w: &Weight,
    rows: &IndexSet,
    a: &[f32],
    y: &mut [f32],
) {
    let cols = w.cols;
    // Tasks write partial sums through raw pointers: check every extent for real.
    w.check();
    assert_eq!(rows.universe(), w.rows, "axpy_rows: row set universe");
    assert_eq!(
        w.layout,
        dejavu_backend_api::RowLayout::Ggml,
        "axpy_rows reads ggml rows (neuron-major layouts are never repacked)"
    );
    let n_tok = a.len() / w.rows.max(1);
    assert!(
        a.len() == n_tok * w.rows && y.len() == n_tok * cols,
        "axpy_rows: lengths"
    );
    let threads = pool
        .threads()
        .min(rows.len().div_ceil(MIN_ROWS_PER_THREAD))
        .max(1);
    let per = rows.len().div_ceil(threads);
    // Each task's partial sums of every token, `n_tok * cols` each; a chunk's segment is read
    // once for all tokens (the rows stay in L1 while each token's coefficients add them).
    let width = n_tok * cols;
    PARTS.with_borrow_mut(|parts| {
        parts.resize(threads * width, 0.0);
        let pp = SyncPtr::new(parts.as_mut_ptr());
        pool.run(threads, &|task| {
            // SAFETY: task `task` alone writes partial `task` (`width` floats inside `parts`,
            // which holds threads * width and outlives `pool.run`).
            let part = unsafe { std::slice::from_raw_parts_mut(pp.get().add(task * width), width) };
            part.fill(0.0);
            let (lo, hi) = (task * per, ((task + 1) * per).min(rows.len()));
            // The next chunk's rows are prefetched in step with the reading: while segment
            // `s` of this chunk's rows is added, segment `s` of the next chunk's (a steady
            // number of lines in flight; a burst per chunk overflows the miss queue).
            let (q, bl) = (w.qtype, w.qtype.block_len());
            let seg = if cols.is_multiple_of(SEGMENT_COLS) && bl <= SEGMENT_COLS {
                SEGMENT_COLS
            } else {
                cols
            };
            let seg_bytes = q.row_bytes(seg);
            for i in lo..(lo + CHUNK).min(hi) {
                prefetch::prefetch(w.row(rows.get(i)));
            }
            let mut coefs = vec![0f32; n_tok * CHUNK];
            // Several tokens: each chunk's segment dequantized once into `tile`, then every
            // token's f32 weighted sum of it (one token: the fused integer kernel, as a decode
            // step reads it).
            let mut tile = vec![0f32; if n_tok > 1 { CHUNK * seg } else { 0 }];
            let mut refs: [&[u8]; CHUNK] = [&[]; CHUNK];
            let mut next: [&[u8]; CHUNK] = [&[]; CHUNK];
            for start in (lo..hi).step_by(CHUNK) {
                let m = CHUNK.min(hi - start);
                let nm = CHUNK.min(hi.saturating_sub(start + m));
                for i in 0..m {
                    let r = rows.get(start + i);
                    refs[i] = w.row(r);
                    for t in 0..n_tok {
                        coefs[t * CHUNK + i] = a[t * w.rows + r];
                    }
                }
                for (i, nx) in next.iter_mut().enumerate().take(nm) {
                    *nx = w.row(rows.get(start + m + i));
                }
                for s in 0..cols.div_ceil(seg) {
                    let bytes = s * seg_bytes..(s + 1) * seg_bytes;
                    for nx in &next[..nm] {
                        prefetch::prefetch(&nx[bytes.clone()]);
                    }
                    let mut segs: [&[u8]; CHUNK] = [&[]; CHUNK];
                    for (sg, r) in segs.iter_mut().zip(&refs[..m]) {
                        *sg = &r[bytes.clone()];
                    }
                    let c0 = s * seg;
                    let c1 = (c0 + seg).min(cols);
                    if n_tok == 1 {
                        (k.axpy_q)(q, &segs[..m], &coefs[..m], &mut part[c0..c1]);
                        continue;
                    }
                    let len = c1 - c0;
                    for (sg, t) in segs[..m].iter().zip(tile.chunks_exact_mut(len)) {
                        (k.dequantize)(q, sg, t);
                    }
                    for t in 0..n_tok {
                        let ys = &mut part[t * cols + c0..t * cols + c1];
                        let c = &coefs[t * CHUNK..t * CHUNK + m];
                        (k.axpy_rows)(c, &tile[..m * len], len, ys);
                    }
                }
            }
        });
        let (first, rest) = parts.split_at(width);
        let y = &mut y[..width];
        y.copy_from_slice(first);
        for p in rest.chunks_exact(width) {
            y.iter_mut().zip(p).for_each(|(y, v)| *y += v);
        }
    });
}

/// Bytes of kept rows per thread, at least (fewer go to fewer threads: a second thread's
/// dispatch and partial sum cost more than it saves on small matrices such as K and V).
const MIN_BYTES_PER_THREAD: usize = 64 << 10;

/// `y += sum over r with x[r] != 0 of x[r] * W[r]` for `w` in the input-block layout
/// (`RowLayout::InputBlocks`, see `kernels::axpy_blocks`): each block of 32 inputs with a
/// nonzero one goes through the tier's `axpy_blocks` with its kept rows. The pool's threads take
/// contiguous runs of those blocks (about equal kept rows each), so each streams its rows in
/// memory order; each adds into its own partial sum, and the caller adds the partials.
pub fn axpy_blocks(k: &Kernels, pool: &SpinPool, w: &Weight, x: &[f32], y: &mut [f32]) {
    w.check();
    assert_eq!(
        w.layout,
        dejavu_backend_api::RowLayout::InputBlocks,
        "axpy_blocks reads input-block matrices"
    );
    let (rows, cols, q) = (w.rows, w.cols, w.qtype);
    assert!(
        rows.is_multiple_of(32) && cols.is_multiple_of(32),
        "axpy_blocks: a {rows}x{cols} matrix is not in whole blocks of 32"
    );
    assert!(x.len() == rows && y.len() == cols, "axpy_blocks: lengths");
    let block_bytes = 32 * q.row_bytes(cols);
    // The blocks with a kept input, and their kept rows.
    let kept: Vec<(usize, [u8; 32], usize)> = (0..rows / 32)
        .filter_map(|b| {
            let mut r = [0u8; 32];
            let mut n = 0;
            for (i, v) in x[32 * b..32 * b + 32].iter().enumerate() {
                if *v != 0.0 {
                    r[n] = i as u8;
                    n += 1;
                }
            }
            (n > 0).then_some((b, r, n))
        })
        .collect();
    let total: usize = kept.iter().map(|k| k.2).sum();
    if total == 0 {
        return;
    }
    let threads = pool
        .threads()
        .min((total * q.row_bytes(cols)).div_ceil(MIN_BYTES_PER_THREAD))
        .max(1);
    // Thread t takes the blocks whose first kept row falls in its share of the kept rows.
    let mut bounds = vec![0usize; threads + 1];
    let (mut seen, mut t) = (0, 1);
    for (i, kb) in kept.iter().enumerate() {
        while t < threads && seen >= t * total / threads {
            bounds[t] = i;
            t += 1;
        }
        seen += kb.2;
    }
    for b in bounds.iter_mut().skip(t) {
        *b = kept.len();
    }
    bounds[threads] = kept.len();
    let block = |b: usize| &w.data[b * block_bytes..(b + 1) * block_bytes];
    let run = |part: &mut [f32], t: usize| {
        let mine = &kept[bounds[t]..bounds[t + 1]];
        if let Some((b, r, n)) = mine.first() {
            axpy_blocks::prefetch_first(q, block(*b), cols, &r[..*n]);
        }
        for (i, (b, r, n)) in mine.iter().enumerate() {
            // The next block's first rows, while this one's are read.
            if let Some((nb, nr, nn)) = mine.get(i + 1) {
                axpy_blocks::prefetch_first(q, block(*nb), cols, &nr[..*nn]);
            }
            let xb: &[f32; 32] = x[32 * b..32 * b + 32].try_into().expect("32 inputs");
            (k.axpy_blocks)(q, block(*b), cols, &r[..*n], xb, 0, part);
        }
    };
    if threads == 1 {
        return run(y, 0);
    }
    PARTS.with_borrow_mut(|parts| {
        parts.clear();
        parts.resize((threads - 1) * cols, 0.0);
        let pp = SyncPtr::new(parts.as_mut_ptr());
        let yp = SyncPtr::new(y.as_mut_ptr());
        pool.run(threads, &|t| {
            // SAFETY: task 0 alone writes `y` (cols floats); task t > 0 alone writes partial
            // t - 1 (cols floats inside `parts`, which holds (threads - 1) * cols); both outlive
            // `pool.run`.
            let part = unsafe {
                match t {
                    0 => std::slice::from_raw_parts_mut(yp.get(), cols),
                    _ => std::slice::from_raw_parts_mut(pp.get().add((t - 1) * cols), cols),
                }
            };
            run(part, t);
        });
        for p in parts.chunks_exact(cols) {
            y.iter_mut().zip(p).for_each(|(y, v)| *y += v);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, random_row};
    use dejavu_backend_api::QuantType;

    /// Every tier and thread count within 1e-5 (relative to the sum of |terms|) of the reference,
    /// plus the integer kernels' rounding bound (`axpy_q::rounding_bound`), for every weight type,
    /// ragged row counts and subsets (empty, one row, random, full), for `NT` tokens at once.
    #[test]
    fn tiers_match_reference() {
        const NT: usize = 3;
        for isa in Isa::supported() {
            let k = Kernels::for_isa(isa).unwrap();
            for threads in [1, 2, 3] {
                let pool = SpinPool::new(threads);
                // Short rows, and rows of several segments (the prefetching row loop).
                for (q, cols) in QuantType::ALL.into_iter().flat_map(|q| {
                    let short = if q.block_len() == 256 { 512 } else { 96 };
                    [(q, short), (q, 2 * SEGMENT_COLS)]
                }) {
                    let n = 203;
                    let data: Vec<u8> = (0..n)
                        .flat_map(|r| random_row(q, cols, r as u64 * 31 + 7))
                        .collect();
                    let w = Weight::new(q, n, cols, &data).unwrap();
                    let a = random_f32(NT * n, 5);
                    let subsets = [
                        IndexSet::new(n, vec![]).unwrap(),
                        IndexSet::new(n, vec![17]).unwrap(),
                        IndexSet::new(n, (0..n as u32).filter(|i| i % 3 != 1).collect()).unwrap(),
                        IndexSet::full(n),
                    ];
                    for rows in &subsets {
                        let mut want = vec![0f32; NT * cols];
                        let mut got = vec![1f32; NT * cols];
                        reference(&w, rows, &a, &mut want);
                        axpy_matmul(&k, &pool, &w, rows, &a, &mut got);
                        let mut row = vec![0f32; cols];
                        let mut mag = vec![0f32; NT * cols];
                        for r in rows.iter() {
                            dequantize_row(q, w.row(r), &mut row);
                            for t in 0..NT {
                                for c in 0..cols {
                                    mag[t * cols + c] += (a[t * n + r] * row[c]).abs();
                                }
                            }
                        }
                        let sel: Vec<&[u8]> = rows.iter().map(|r| w.row(r)).collect();
                        for i in 0..NT * cols {
                            let at: Vec<f32> = rows.iter().map(|r| a[(i / cols) * n + r]).collect();
                            let step =
                                crate::kernels::axpy_q::rounding_bound(isa, q, &sel, &at, i % cols);
                            assert!(
                                (got[i] - want[i]).abs() <= 1e-5 * mag[i] + 1e-6 + step,
                                "{isa} {q:?} threads {threads} rows {} i {i}: {} vs {}",
                                rows.len(),
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
