//! `y[t] = sum over r in rows of a[t][r] * W[r]` for a neuron-major weight (see
//! `Backend::axpy_rows`): the sparse MLP's down projection reads only the rows of the neurons it
//! kept, each a contiguous run of bytes.
//!
//! The pool's threads split the columns, in whole units of [`col_unit`]: each owns its columns
//! of every token's output and adds every selected row's share of them, prefetching the rows it
//! will read next. So every output is one thread's sum in the rows' order, with no partial sums
//! to add after, and the result is bit for bit the same for any thread count. Each token adds
//! its own nonzero rows, [`CHUNK`] at a time, with the tier's `axpy_q` (dequantization fused
//! into the multiply-add), exactly as a call of that token alone would: a step of several
//! sequences gives each row what its own decode step gives it (batch invariance), while each
//! row's bytes are read once for all of them. [`reference()`] is the scalar definition the test
//! compares against.
use crate::dequant::dequantize_row;
use crate::isa::Isa;
use crate::kernels::axpy_blocks;
use crate::kernels::axpy_blocks_i8::{quantize, Q8Inputs};
use crate::kernels::table::Kernels;
use crate::matmul::SyncPtr;
use crate::pool::SpinPool;
use crate::prefetch;
use dejavu_backend_api::{IndexSet, QuantType, Weight};
use std::cell::RefCell;

/// Rows summed per kernel call.
const CHUNK: usize = crate::kernels::axpy_q::MAX_ROWS;
/// Outputs per segment of a thread's columns (544 bytes of a Q8_0 row).
const SEGMENT_COLS: usize = 512;
/// Bytes of selected rows per thread, at least, for the down projection (a thread's dispatch
/// costs more than it saves on small matrices).
const MIN_ROW_BYTES_PER_THREAD: usize = 32 << 10;

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

/// The columns a thread's share holds a whole number of: a whole block of the type, and a
/// multiple of 64 (the kernels' f32 lanes and the f16 paths' 32 columns), so that every column
/// is computed by the same instructions whatever share it falls in. A row not of whole units
/// is one share.
fn col_unit(q: QuantType, cols: usize) -> usize {
    let bl = q.block_len().max(1);
    let unit = bl * 64 / gcd(bl, 64);
    match cols.is_multiple_of(unit) {
        true => unit,
        false => cols,
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// One token's rows waiting for a kernel call: their bytes (whole rows) and coefficients.
struct Pending<'w> {
    rows: [&'w [u8]; CHUNK],
    coefs: [f32; CHUNK],
    n: usize,
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
    // Tasks write `y` through raw pointers: check every extent for real.
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
    y.fill(0.0);
    let q = w.qtype;
    let unit = col_unit(q, cols);
    let units = cols.div_ceil(unit.max(1));
    let bytes = rows.len() * q.row_bytes(cols);
    let threads = (pool.threads())
        .min(units)
        .min(bytes.div_ceil(MIN_ROW_BYTES_PER_THREAD))
        .max(1);
    let yp = SyncPtr::new(y.as_mut_ptr());
    pool.run(threads, &|task| {
        let (u0, u1) = (task * units / threads, (task + 1) * units / threads);
        let (c0, c1) = (u0 * unit, (u1 * unit).min(cols));
        if c0 >= c1 {
            return;
        }
        // This share's bytes of a row, and its segments (whole units each).
        let (b0, b1) = (q.row_bytes(c0), q.row_bytes(c1));
        let seg = SEGMENT_COLS.div_ceil(unit) * unit;
        let flush = |p: &mut Pending, t: usize| {
            for s0 in (c0..c1).step_by(seg) {
                let s1 = (s0 + seg).min(c1);
                let (sb0, sb1) = (q.row_bytes(s0), q.row_bytes(s1));
                let mut segs: [&[u8]; CHUNK] = [&[]; CHUNK];
                for (sg, r) in segs.iter_mut().zip(&p.rows[..p.n]) {
                    *sg = &r[sb0..sb1];
                }
                // SAFETY: task `task` alone writes columns c0..c1 of each token's output (the
                // shares are disjoint), inside `y` (n_tok * cols floats, which outlives
                // `pool.run`).
                let ys =
                    unsafe { std::slice::from_raw_parts_mut(yp.get().add(t * cols + s0), s1 - s0) };
                (k.axpy_q)(q, &segs[..p.n], &p.coefs[..p.n], ys);
            }
            p.n = 0;
        };
        let mut pending: Vec<Pending> = (0..n_tok)
            .map(|_| Pending {
                rows: [&[]; CHUNK],
                coefs: [0.0; CHUNK],
                n: 0,
            })
            .collect();
        let ahead = prefetch::rows_ahead(b1 - b0);
        for i in 0..ahead.min(rows.len()) {
            prefetch::prefetch(&w.row(rows.get(i))[b0..b1]);
        }
        for i in 0..rows.len() {
            if i + ahead < rows.len() {
                prefetch::prefetch(&w.row(rows.get(i + ahead))[b0..b1]);
            }
            let r = rows.get(i);
            for (t, p) in pending.iter_mut().enumerate() {
                let c = a[t * w.rows + r];
                if c == 0.0 {
                    continue; // a zero's row adds nothing: a call of this token alone skips it
                }
                (p.rows[p.n], p.coefs[p.n]) = (w.row(r), c);
                p.n += 1;
                if p.n == CHUNK {
                    flush(p, t);
                }
            }
        }
        for (t, p) in pending.iter_mut().enumerate() {
            if p.n > 0 {
                flush(p, t);
            }
        }
    });
}

/// Bytes of kept rows per thread, at least (fewer go to fewer threads: a second thread's
/// dispatch costs more than it saves on small matrices such as K and V).
const MIN_BYTES_PER_THREAD: usize = 64 << 10;
/// Outputs a work unit of an input-block product holds a whole number of: the 8-bit kernel's
/// tile (every output's sum is its own lane's in every tier, so a unit's bounds change no bit).
/// A multiple of 64, as the 5-bit types' words of fifth bits need.
const BLOCK_COL_UNIT: usize = 64;
/// A matrix's kept blocks are cut into chunks (up to this many), summed apart and added in
/// order: the threads then share its work by blocks, each reading whole rows, not a slice of
/// every row. The chunks are fixed by `x` (its kept blocks), never by the thread count, so the
/// sums are the same bits at any thread count. (Once only matrices of fewer than 4096 outputs
/// were chunked, the others' outputs split between the threads; on 2 threads of an AMD EPYC
/// (Zen 4) chunking every matrix raised the kept-byte efficiency of `cargo bench --bench
/// input_ratio -- 14336 4096 q4_0 0.5` from 0.75-0.80 to 0.85-0.87 and of `4096 14336` from
/// 0.82-0.94 to 0.94-0.97: two cores streaming halves of the same rows read them slower than
/// each its own rows whole.)
const MAX_CHUNKS: usize = 4;
/// Kept blocks a chunk holds at least.
const MIN_CHUNK_BLOCKS: usize = 4;

/// `y += sum over r with x[r] != 0 of x[r] * W[r]` for `w` in the input-block layout
/// (`RowLayout::InputBlocks`, see `kernels::axpy_blocks`): [`axpy_blocks_many`] of one matrix.
pub fn axpy_blocks(k: &Kernels, pool: &SpinPool, w: &Weight, x: &[f32], y: &mut [f32]) {
    axpy_blocks_many(k, pool, &[*w], x, &mut [y]);
}

/// The speed of an input-block product's kept bytes over the dense product's (of the repacked
/// rows), by the matrix's outputs: `(cols, efficiency)`, read between in log2 of `cols`, held
/// past either end; with [`CALL_BYTES`], the time model of [`break_even`]. Measured on 2 threads
/// of an AMD EPYC (Zen 4, AVX-512): `cargo bench --bench input_ratio -- IN OUT TYPE DENSITY`
/// at densities 0.8, 0.65, 0.5 and 0.35, Q4_1 and Q8_0, at SmolLM2's, Qwen2.5-0.5B's,
/// gemma-3-270m's and Llama-3-8B's shapes, a line through each shape's four time ratios. A
/// narrow matrix's rows are short runs of bytes (each block's scale table and tile sums cost
/// as much as its kept rows): 576 outputs kept 0.3 of dense's rate, 14336 0.85. Fewer inputs
/// lower it too (896 x 4864 Q4_1 0.54-0.64, 4096 x 4096 0.71): the table leans to the small
/// models' shapes, where a wrong guess costs most.
const EFFICIENCY: [(usize, f64); 6] = [
    (128, 0.15),
    (576, 0.3),
    (1024, 0.4),
    (1536, 0.5),
    (4096, 0.65),
    (14336, 0.85),
];

/// [`EFFICIENCY`]'s factor for the 5-bit types, whose fifth bits are a second run of bytes per
/// kept row: Qwen2.5-0.5B's 896 x 4864 at 0.5 and 0.7 kept moved its kept bytes at 0.38-0.55
/// of dense's rate in Q5_0, 0.54-0.64 in Q4_1, 0.70-0.76 in Q8_0 (same bench, two runs).
const FIVE_BIT: f64 = 0.75;

/// A product's fixed cost (its dispatch, the kept blocks' scan, the first reads of every
/// thread's blocks), in bytes the dense product reads meanwhile: about 8 us a call at 25 GB/s
/// on the machine of [`EFFICIENCY`]. SmolLM2's 576x576 Q4_1 product ran at 0.41-0.62x dense's
/// speed from 0.8 to 0.35 of its inputs kept, and at dense's only at 0.05 (0.93-1.10x).
const CALL_BYTES: f64 = 200.0 * 1024.0;

/// [`EFFICIENCY`]'s factor for the tiers other than AVX-512. The AVX2 tier on the same machine
/// moved its kept bytes at 0.7-1.0 of the AVX-512 tier's efficiency (576 x 1536 Q4_1 0.33-0.36
/// against 0.45-0.59, 4096 x 4096 0.62-0.67 against 0.71, 4096 x 14336 0.79-0.84 against
/// 0.8); the NEON and portable tiers are not measured, and take it too.
const OTHER_TIERS: f64 = 0.85;

/// [`EFFICIENCY`] at `cols` outputs of type `q` on tier `isa`.
fn efficiency(q: QuantType, cols: usize, isa: Isa) -> f64 {
    let tier = match isa {
        Isa::Avx512 => 1.0,
        _ => OTHER_TIERS,
    };
    match q {
        QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q5K => tier * FIVE_BIT * by_width(cols),
        _ => tier * by_width(cols),
    }
}

/// [`EFFICIENCY`] at `cols` outputs.
fn by_width(cols: usize) -> f64 {
    let at = |i: usize| ((EFFICIENCY[i].0 as f64).log2(), EFFICIENCY[i].1);
    let x = (cols.max(1) as f64).log2();
    let last = EFFICIENCY.len() - 1;
    if x <= at(0).0 {
        return at(0).1;
    }
    for i in 1..=last {
        let ((x0, y0), (x1, y1)) = (at(i - 1), at(i));
        if x <= x1 {
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
        }
    }
    at(last).1
}

/// A matrix's type, rows and columns (an input-major matrix: its inputs and outputs).
pub type Shape = (QuantType, usize, usize);

/// The kept fraction of their inputs below which the input-sparse products of `ws` (one
/// input's, one call) take less time than their dense products, which read `dense_bytes` (the
/// file's rows: fewer than `ws`'s where those are requantized to a wider type, as Q6_K's input
/// blocks are Q8_0's). In bytes of dense reading, the sparse call costs [`CALL_BYTES`] plus
/// each matrix's kept bytes over its [`efficiency`], so the fraction `k` where
/// `CALL_BYTES + k * sum(bytes / efficiency) = dense_bytes` (0 where the call's cost alone is
/// more), on tier `isa`. 1 for no matrix.
pub fn break_even(ws: &[Shape], dense_bytes: usize, isa: Isa) -> f64 {
    let bytes = |&(q, rows, cols): &Shape| (q.row_bytes(cols) * rows) as f64;
    let total = dense_bytes as f64;
    let time: f64 = ws
        .iter()
        .map(|w| bytes(w) / efficiency(w.0, w.2, isa))
        .sum();
    match time > 0.0 {
        true => ((total - CALL_BYTES) / time).max(0.0),
        false => 1.0,
    }
}

/// One block of 32 inputs with a kept (nonzero) one: its index, kept rows (the first `n`) and,
/// on a tier with an 8-bit kernel, its kept inputs in 8 bits.
struct KeptBlock {
    b: usize,
    rows: [u8; 32],
    n: usize,
    q8: Option<Q8Inputs>,
}

/// The blocks of `x` with a kept input, into `out`: scanned, and quantized for the 8-bit
/// kernel, once for every matrix and thread that reads them.
fn kept_blocks(k: &Kernels, x: &[f32], out: &mut Vec<KeptBlock>) {
    out.clear();
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let xb: &[f32; 32] = xb.try_into().expect("32 inputs");
        let (mut rows, mut n) = ([0u8; 32], 0);
        for (i, v) in xb.iter().enumerate() {
            rows[n] = i as u8;
            n += usize::from(*v != 0.0);
        }
        if n > 0 {
            let q8 = k.axpy_blocks_q8.and_then(|_| quantize(xb, &rows[..n]));
            out.push(KeptBlock { b, rows, n, q8 });
        }
    }
}

/// What an input-block product of the calling thread works in, kept across calls (no
/// allocation a call once grown to the widest product).
#[derive(Default)]
struct Scratch {
    kept: Vec<KeptBlock>,
    units: Vec<Unit>,
    starts: Vec<usize>,
    partial: Vec<f32>,
    outputs: Vec<SyncPtr>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// One work unit of an input-block product: outputs `c0..c1` of matrix `j` over kept blocks
/// `k0..k1` (chunk `c`), run by thread `owner`.
#[derive(Clone, Copy)]
struct Unit {
    j: usize,
    c: usize,
    c0: usize,
    c1: usize,
    k0: usize,
    k1: usize,
    owner: usize,
}

/// The chunks of every matrix of a product of `kept` kept blocks: [`MAX_CHUNKS`], fewer where
/// they would hold fewer than [`MIN_CHUNK_BLOCKS`] kept blocks each; never the threads'.
fn chunk_count(kept: usize) -> usize {
    MAX_CHUNKS.min(kept / MIN_CHUNK_BLOCKS).max(1)
}

/// The units of a product on `threads` threads (into `out`, in owner order): every matrix's
/// chunks one after the other, each a run of tiles of [`BLOCK_COL_UNIT`] outputs weighted by
/// the chunk's kept rows, split into `threads` contiguous runs of about equal bytes. (A unit's
/// bounds change no bit: every output's sum is one unit's.)
fn units(ws: &[Weight], kept: &[KeptBlock], chunks: usize, threads: usize, out: &mut Vec<Unit>) {
    out.clear();
    let chunk_rows = |c: usize| {
        let (k0, k1) = (c * kept.len() / chunks, (c + 1) * kept.len() / chunks);
        (k0, k1, kept[k0..k1].iter().map(|kb| kb.n).sum::<usize>())
    };
    let tile_cost =
        |j: usize, rows: usize| rows * axpy_blocks::input_bytes(ws[j].qtype, BLOCK_COL_UNIT);
    let mut total = 0;
    for (j, w) in ws.iter().enumerate() {
        for c in 0..chunks {
            total += tile_cost(j, chunk_rows(c).2) * w.cols.div_ceil(BLOCK_COL_UNIT);
        }
    }
    let mut at = 0;
    for (j, w) in ws.iter().enumerate() {
        for c in 0..chunks {
            let (k0, k1, rows) = chunk_rows(c);
            let cost = tile_cost(j, rows);
            let tiles = w.cols.div_ceil(BLOCK_COL_UNIT);
            // Tile i goes to the thread whose share of the total holds its middle.
            let owner = |i: usize| (2 * (at + i * cost) + cost) * threads / (2 * total).max(1);
            let mut i0 = 0;
            while i0 < tiles {
                let t = owner(i0).min(threads - 1);
                let mut i1 = i0 + 1;
                while i1 < tiles && owner(i1).min(threads - 1) == t {
                    i1 += 1;
                }
                let (c0, c1) = (i0 * BLOCK_COL_UNIT, (i1 * BLOCK_COL_UNIT).min(w.cols));
                out.push(Unit {
                    j,
                    c,
                    c0,
                    c1,
                    k0,
                    k1,
                    owner: t,
                });
                i0 = i1;
            }
            at += cost * tiles;
        }
    }
}

/// `ys[j] += sum over r with x[r] != 0 of x[r] * ws[j][r]` for matrices in the input-block
/// layout of one input (Q, K and V; gate and up): each block of 32 inputs with a nonzero one
/// goes through the tier's `axpy_blocks` with its kept rows, in one pool dispatch over the
/// work [`units`]. A unit reads its outputs of its chunk's kept blocks in memory order; chunk
/// 0 adds into `ys`, chunk `c > 0` into a sum of its own, added to `ys` after, in chunk order.
/// So every output's bits depend on its matrix's shape and `x` only: the same at any thread
/// count, and the same as a call of that matrix alone.
pub fn axpy_blocks_many(
    k: &Kernels,
    pool: &SpinPool,
    ws: &[Weight],
    x: &[f32],
    ys: &mut [&mut [f32]],
) {
    assert_eq!(ws.len(), ys.len(), "axpy_blocks: one output per matrix");
    for (w, y) in ws.iter().zip(ys.iter()) {
        w.check();
        assert_eq!(
            w.layout,
            dejavu_backend_api::RowLayout::InputBlocks,
            "axpy_blocks reads input-block matrices"
        );
        let (rows, cols) = (w.rows, w.cols);
        let inputs = axpy_blocks::whole_inputs(w.qtype);
        assert!(
            rows.is_multiple_of(inputs) && cols.is_multiple_of(32),
            "axpy_blocks: a {rows}x{cols} matrix is not in whole blocks of {inputs}"
        );
        assert!(x.len() == rows && y.len() == cols, "axpy_blocks: lengths");
    }
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => blocks_product(k, pool, ws, x, ys, &mut s),
        // A product inside a product's task (none today) works in scratch of its own.
        Err(_) => blocks_product(k, pool, ws, x, ys, &mut Scratch::default()),
    })
}

/// [`axpy_blocks_many`] after its checks.
fn blocks_product(
    k: &Kernels,
    pool: &SpinPool,
    ws: &[Weight],
    x: &[f32],
    ys: &mut [&mut [f32]],
    s: &mut Scratch,
) {
    kept_blocks(k, x, &mut s.kept);
    if s.kept.is_empty() || ws.is_empty() {
        return;
    }
    let Scratch {
        kept,
        units: us,
        starts,
        partial,
        outputs,
    } = s;
    let chunks = chunk_count(kept.len());
    // Chunk c > 0 of matrix j sums into `partial[starts[j] + (c - 1) * cols ..]`, zeroed by the
    // units that write it.
    starts.clear();
    let mut n = 0;
    for w in ws {
        starts.push(n);
        n += (chunks - 1) * w.cols;
    }
    if partial.len() < n {
        partial.resize(n, 0.0);
    }
    let rows: usize = kept.iter().map(|kb| kb.n).sum();
    let bytes: usize = (ws.iter())
        .map(|w| rows * axpy_blocks::input_bytes(w.qtype, w.cols))
        .sum();
    let tiles: usize = (ws.iter())
        .map(|w| chunks * w.cols.div_ceil(BLOCK_COL_UNIT))
        .sum();
    let threads = (pool.threads())
        .min(tiles)
        .min(bytes.div_ceil(MIN_BYTES_PER_THREAD))
        .max(1);
    units(ws, kept, chunks, threads, us);
    outputs.clear();
    outputs.extend(ys.iter_mut().map(|y| SyncPtr::new(y.as_mut_ptr())));
    let pp = SyncPtr::new(partial.as_mut_ptr());
    let (us, starts, kept, yps) = (&*us, &*starts, &*kept, &*outputs);
    pool.run(threads, &|t| {
        for u in us.iter().filter(|u| u.owner == t) {
            let base = match u.c {
                0 => yps[u.j].get(),
                // SAFETY: inside `partial` (it holds chunks - 1 rows of each matrix).
                c => unsafe { pp.get().add(starts[u.j] + (c - 1) * ws[u.j].cols) },
            };
            // SAFETY: each unit writes its own outputs c0..c1 of its own chunk's sums (units
            // are disjoint and each has one owner), inside `ys[j]` (w.cols floats, checked
            // above) or `partial`, both of which outlive `pool.run`.
            let part = unsafe { std::slice::from_raw_parts_mut(base.add(u.c0), u.c1 - u.c0) };
            if u.c > 0 {
                part.fill(0.0);
            }
            blocks_share(k, &ws[u.j], &kept[u.k0..u.k1], x, u.c0, part);
        }
    });
    for (j, y) in ys.iter_mut().enumerate() {
        let cols = ws[j].cols;
        for c in 1..chunks {
            let p = &partial[starts[j] + (c - 1) * cols..][..cols];
            y.iter_mut().zip(p).for_each(|(y, p)| *y += p);
        }
    }
}

/// Outputs `c0..` (`part`) of `w`: every kept block's rows added in memory order, the next
/// block's first rows prefetched while one is read.
fn blocks_share(
    k: &Kernels,
    w: &Weight,
    kept: &[KeptBlock],
    x: &[f32],
    c0: usize,
    part: &mut [f32],
) {
    let (cols, q) = (w.cols, w.qtype);
    let block = |b: usize| axpy_blocks::block(q, w.data, cols, b);
    if let Some(kb) = kept.first() {
        axpy_blocks::prefetch_first(q, block(kb.b), cols, &kb.rows[..kb.n], c0);
    }
    for (i, kb) in kept.iter().enumerate() {
        if let Some(nb) = kept.get(i + 1) {
            axpy_blocks::prefetch_first(q, block(nb.b), cols, &nb.rows[..nb.n], c0);
        }
        let rows = &kb.rows[..kb.n];
        match (k.axpy_blocks_q8, &kb.q8) {
            (Some(f), Some(xi)) => f(q, block(kb.b), cols, rows, xi, c0, part),
            _ => {
                let xb: &[f32; 32] = x[32 * kb.b..32 * kb.b + 32].try_into().expect("32 inputs");
                (k.axpy_blocks)(q, block(kb.b), cols, rows, xb, c0, part)
            }
        }
    }
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
    /// Bit for bit the same at any thread count, and each token of a call what a call of that
    /// token alone gives (batch invariance), for every tier and type, ragged shapes and
    /// subsets; the input-block product the same at any thread count.
    #[test]
    fn threads_and_batches_change_no_bit() {
        const NT: usize = 3;
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for isa in Isa::supported() {
            let k = Kernels::for_isa(isa).unwrap();
            let pools = [1, 2, 3].map(SpinPool::new);
            for (q, cols) in QuantType::ALL.into_iter().flat_map(|q| {
                let bl = q.block_len().max(32);
                [(q, 9 * bl.max(64)), (q, 2 * SEGMENT_COLS + 3 * bl), (q, bl)]
            }) {
                let n = 203;
                let data: Vec<u8> = (0..n)
                    .flat_map(|r| random_row(q, cols, r as u64 * 17 + 3))
                    .collect();
                let w = Weight::new(q, n, cols, &data).unwrap();
                let mut a = random_f32(NT * n, 9);
                // Each token keeps its own rows (zeros elsewhere), as a batched sparse step.
                for (i, v) in a.iter_mut().enumerate() {
                    if (i * 7 + i / n) % 5 < 2 {
                        *v = 0.0;
                    }
                }
                let rows = IndexSet::new(n, (0..n as u32).filter(|i| i % 4 != 1).collect());
                let rows = rows.unwrap();
                let mut one = vec![0f32; NT * cols];
                for t in 0..NT {
                    let at = &a[t * n..(t + 1) * n];
                    let yt = &mut one[t * cols..(t + 1) * cols];
                    axpy_matmul(&k, &pools[0], &w, &rows, at, yt);
                }
                for pool in &pools {
                    let mut got = vec![1f32; NT * cols];
                    axpy_matmul(&k, pool, &w, &rows, &a, &mut got);
                    let th = pool.threads();
                    assert_eq!(bits(&got), bits(&one), "{isa} {q:?} {cols} threads {th}");
                }
            }
            // The input-block layout: Q8_0 inputs in blocks of 32, outputs over several tiles;
            // 3 blocks (one chunk) and 24 (chunks of kept blocks summed apart, then in order).
            for rows in [96, 768] {
                blocks_invariance(&k, &pools, rows);
            }
        }
    }

    /// [`axpy_blocks`] over `rows` inputs: the same bits at 1-3 threads, and each matrix of an
    /// [`axpy_blocks_many`] call what its own call gives, with the 8-bit and the f32 kernels.
    fn blocks_invariance(k: &Kernels, pools: &[SpinPool], rows: usize) {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let cols = 3 * BLOCK_COL_UNIT + 64;
        let data = blocks_matrix(rows, cols, 3);
        let w = blocks_weight(rows, cols, &data);
        let mut x = random_f32(rows, 4);
        x.iter_mut().step_by(3).for_each(|v| *v = 0.0);
        // The tier's f32 kernel too (the 8-bit one off), whose tile is wider than a share.
        let mut kf = *k;
        kf.axpy_blocks_q8 = None;
        let (d2, d3) = (
            blocks_matrix(rows, cols + 128, 5),
            blocks_matrix(rows, 64, 6),
        );
        let ws = [
            w,
            blocks_weight(rows, cols + 128, &d2),
            blocks_weight(rows, 64, &d3),
        ];
        let isa = k.isa;
        // The value: the f32 kernel's chunked sums (the AVX-512 tier's `axpy_blocks` rounds x
        // to 8 bits itself) against each row added in input order, in f64, within 1e-5 of the
        // sum of |terms|.
        let (mut exact, mut mag) = (vec![0f64; cols], vec![0f64; cols]);
        let mut row = vec![0f32; cols];
        let bb = 32 * QuantType::Q8_0.row_bytes(cols);
        for (r, &xr) in x.iter().enumerate() {
            let block = &data[(r / 32) * bb..(r / 32 + 1) * bb];
            axpy_blocks::input_row(QuantType::Q8_0, block, cols, r % 32, &mut row);
            for o in 0..cols {
                exact[o] += xr as f64 * row[o] as f64;
                mag[o] += (xr as f64 * row[o] as f64).abs();
            }
        }
        let mut f32_only = kf;
        f32_only.axpy_blocks = axpy_blocks::select(isa);
        let mut got = vec![0f32; cols];
        axpy_blocks(&f32_only, &pools[1], &w, &x, &mut got);
        for o in 0..cols {
            let e = (got[o] as f64 - exact[o]).abs();
            assert!(
                e <= 1e-5 * mag[o] + 1e-6,
                "{isa} {rows} rows, output {o}: {e}"
            );
        }
        for k in [k, &kf] {
            let mut want = vec![0f32; cols];
            axpy_blocks(k, &pools[0], &w, &x, &mut want);
            for pool in &pools[1..] {
                let mut got = vec![0f32; cols];
                axpy_blocks(k, pool, &w, &x, &mut got);
                let th = pool.threads();
                assert_eq!(bits(&got), bits(&want), "{isa} blocks, {th} threads");
            }
            // Several matrices of one input in one call: each what its own call gives.
            for pool in pools {
                let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.5; w.cols]).collect();
                let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                axpy_blocks_many(k, pool, &ws, &x, &mut outs);
                for (wj, yj) in ws.iter().zip(&ys) {
                    let mut one = vec![0.5f32; wj.cols];
                    axpy_blocks(k, &pools[0], wj, &x, &mut one);
                    assert_eq!(bits(yj), bits(&one), "{isa} many, {}", pool.threads());
                }
            }
        }
    }

    /// A Q8_0 matrix of `rows` inputs and `cols` outputs in the input-block layout.
    fn blocks_matrix(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let q = QuantType::Q8_0;
        let d: Vec<f32> = random_f32(cols, seed)
            .iter()
            .map(|v| v.abs() + 0.01)
            .collect();
        let quants: Vec<u8> = (0..rows * cols)
            .map(|i| ((i as u64 * 31 + seed) % 255) as u8)
            .collect();
        (0..rows / 32)
            .flat_map(|b| {
                let qs = &quants[b * 32 * cols..(b + 1) * 32 * cols];
                axpy_blocks::pack_block(q, cols, &d, &[], qs)
            })
            .collect()
    }

    fn blocks_weight(rows: usize, cols: usize, data: &[u8]) -> Weight<'_> {
        Weight::new(QuantType::Q8_0, rows, cols, data)
            .unwrap()
            .with_layout(dejavu_backend_api::RowLayout::InputBlocks)
    }

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

    /// The efficiency table read between its points: each point itself, rising with the width,
    /// held past the ends; a group's break-even is where its call's cost and its matrices'
    /// kept bytes, each over its efficiency, add up to their dense bytes.
    #[test]
    fn break_even_follows_the_table() {
        for &(cols, f) in &EFFICIENCY {
            let e = |q: QuantType, isa: Isa| efficiency(q, cols, isa);
            assert!(
                (e(QuantType::Q4_0, Isa::Avx512) - f).abs() < 1e-12,
                "{cols}"
            );
            assert!((e(QuantType::Q5_0, Isa::Avx512) - FIVE_BIT * f).abs() < 1e-12);
            assert!((e(QuantType::Q4_0, Isa::Avx2) - OTHER_TIERS * f).abs() < 1e-12);
        }
        let widths = [1, 64, 256, 300, 576, 700, 1024, 4096, 6144, 14336, 1 << 20];
        for w in widths.windows(2) {
            assert!(by_width(w[0]) <= by_width(w[1]), "{w:?}");
        }
        assert_eq!(by_width(1), EFFICIENCY[0].1);
        assert_eq!(by_width(1 << 20), EFFICIENCY[5].1);
        let bytes = vec![0u8; 4096 * 6144 * 18 / 32];
        let w = |rows: usize, cols: usize| {
            let n = rows * QuantType::Q4_0.row_bytes(cols);
            Weight::new(QuantType::Q4_0, rows, cols, &bytes[..n]).unwrap()
        };
        let (q, k, v) = (w(4096, 4096), w(4096, 1024), w(4096, 1024));
        let b = |cols: usize| (4096 * QuantType::Q4_0.row_bytes(cols)) as f64;
        let own = |ws: &[Weight], isa| {
            let shapes: Vec<Shape> = ws.iter().map(|w| (w.qtype, w.rows, w.cols)).collect();
            break_even(&shapes, ws.iter().map(|w| w.data.len()).sum(), isa)
        };
        let qkv = own(&[q, k, v], Isa::Avx512);
        let want = (b(6144) - CALL_BYTES) / (b(4096) / 0.65 + 2.0 * b(1024) / 0.4);
        assert!((qkv - want).abs() < 1e-12, "{qkv} {want}");
        let one = |w: Weight| own(&[w], Isa::Avx512);
        assert!(one(k) < qkv && qkv < one(q), "{qkv}");
        assert!(own(&[q, k, v], Isa::Avx2) < qkv);
        // Dense products that read fewer bytes than the input blocks (a Q6_K file's rows against
        // their Q8_0 blocks) break even at a smaller kept fraction, in proportion.
        let d = (0.77 * b(4096)) as usize;
        let fewer = break_even(&[(q.qtype, q.rows, q.cols)], d, Isa::Avx512);
        let want = (d as f64 - CALL_BYTES) / (b(4096) / 0.65);
        assert!(
            (fewer - want).abs() < 1e-9 && fewer < one(q),
            "{fewer} {want}"
        );
        // A matrix smaller than a call's cost never pays.
        assert_eq!(one(w(64, 256)), 0.0);
        assert_eq!(own(&[], Isa::Avx512), 1.0);
    }
}
