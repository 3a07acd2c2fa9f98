//! Input sparsity's product against the dense matvec of the same matrix, in turn, from memory:
//! the kept-byte efficiency of one shape, as `bench`'s per-block table reports it for a model.
//! `cargo bench --bench input_ratio -- INPUTS OUTPUTS TYPE DENSITY [THREADS] [MB]` (TYPE: any
//! with an input-block form at that shape: q8_0, q4_0, q4_1, q5_0, q5_1, the K-quants in their
//! own form or Q4_1's/Q5_1's, q6_k and the others requantized as a model's layout takes them;
//! kept bytes are counted in the file's type; `DEJAVU_ISA` picks the tier). Copies of the matrix fill `MB` (120
//! by default) and each call reads the next, as a decode step reads its layers. Both forms are
//! held as a loaded model holds them: the dense rows repacked, every copy in huge pages (before
//! 2026-12-07 the dense side read the file's rows in 4 KiB pages, slower: 9.6 against 42.5 GB/s
//! in cache for SmolLM2's 576 x 1536 Q4_1, so ratios measured then flatter the sparse side).
//! Five rounds of
//! 200 calls of each, alternating, after one to warm up. Synthetic bytes: these measure
//! kernels, not a model.
use dejavu_backend_api::{quantize, IndexSet, QuantType, RowLayout, Weight};
use dejavu_backend_cpu::axpy_matmul::axpy_blocks;
use dejavu_backend_cpu::kernels::repack;
use dejavu_backend_cpu::kernels::table::Kernels;
use dejavu_backend_cpu::matmul::matmul;
use dejavu_backend_cpu::pool::SpinPool;
use half::f16;
use std::time::Instant;

#[path = "common/shape.rs"]
mod shape;

/// Bytes of a valid `rows x cols` matrix, different for each `seed`, every scale a small f16.
fn synthetic(q: QuantType, rows: usize, cols: usize, seed: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..q.row_bytes(cols) * rows)
        .map(|i| (i * 7 + 3 + seed) as u8)
        .collect();
    let scale = f16::from_f32(0.01).to_le_bytes();
    for blk in bytes.chunks_exact_mut(q.block_bytes()) {
        for &o in q.scale_offsets() {
            blk[o..o + 2].copy_from_slice(&scale);
        }
    }
    bytes
}

fn main() {
    let Some(shape::Shape {
        n_in,
        n_out,
        q,
        density,
        threads,
        isa,
        mb,
    }) = shape::parse("input_ratio")
    else {
        return;
    };
    let k = Kernels::for_isa(isa).unwrap();
    let pool = SpinPool::new(threads);
    let size = q.row_bytes(n_in) * n_out;
    let copies = (mb.unwrap_or(120) << 20) / size + 1;
    // The input-block form a model's layout gives this type (its own, or requantized).
    let Some(bt) = (n_in.is_multiple_of(q.block_len()))
        .then(|| dejavu::sparsity::blocks::target(q, n_out, n_in))
        .flatten()
    else {
        eprintln!(
            "input_ratio: {} has no input-block form at {n_in} x {n_out}",
            q.name()
        );
        std::process::exit(2);
    };
    let bsize = bt.row_bytes(n_out) * n_in;
    // The file's rows of every copy, and each copy's input blocks. The 32-wide types take
    // bytes different in every copy; the others (whose blocks hold sub-scales) a quantized
    // matrix, repeated.
    let (data, blocks_bytes) = match bt == q && q.block_len() == 32 {
        true => {
            let data: Vec<Vec<u8>> = (0..copies).map(|c| synthetic(q, n_out, n_in, c)).collect();
            let b = (0..copies).flat_map(|c| synthetic(q, n_in, n_out, c + copies));
            (data, b.collect())
        }
        false => {
            let mut src = Vec::with_capacity(size);
            for o in 0..n_out {
                let row: Vec<f32> = (0..n_in)
                    .map(|i| ((i * 7919 + o * 104729) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                quantize::quantize_row(q, &row, &mut src).unwrap();
            }
            let mut b = vec![0u8; bsize];
            dejavu::sparsity::blocks::convert(
                &Weight::new(q, n_out, n_in, &src).unwrap(),
                bt,
                &mut b,
            );
            (vec![src; copies], b.repeat(copies))
        }
    };
    // Dense reads the rows as a model's load leaves them: repacked where the type has that form.
    // Both forms' copies in huge pages, as a model holds them.
    let mut packed = data.concat();
    if repack::supports(q) {
        for (d, p) in data.iter().zip(packed.chunks_exact_mut(size)) {
            repack::repack_matrix(q, n_in, d, p);
        }
    }
    let (packed, data) = (shape::huge_pages(&packed), shape::huge_pages(&blocks_bytes));
    let dense: Vec<Weight> = (packed.chunks_exact(size))
        .map(|d| {
            let w = Weight::new(q, n_out, n_in, d).unwrap();
            match repack::supports(q) {
                true => w.with_layout(RowLayout::Repacked),
                false => w,
            }
        })
        .collect();
    let blocks: Vec<Weight> = (data.chunks_exact(bsize))
        .map(|d| {
            let w = Weight::new(bt, n_in, n_out, d).unwrap();
            w.with_layout(RowLayout::InputBlocks)
        })
        .collect();
    let x: Vec<f32> = (0..n_in).map(|i| (i as f32 * 0.37).sin()).collect();
    let xs = shape::drop_inputs(&x, density);
    let kept = xs.iter().filter(|v| **v != 0.0).count() as f64 / n_in as f64;
    let (mut y, all) = (vec![0f32; n_out], IndexSet::full(n_out));
    let (reps, mut td, mut ts) = (200, 0f64, 0f64);
    for round in 0..6 {
        let t0 = Instant::now();
        for i in 0..reps {
            matmul(&k, &pool, &dense[i % copies], &all, &x, &mut y);
        }
        let d = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        for i in 0..reps {
            axpy_blocks(&k, &pool, &blocks[i % copies], &xs, &mut y);
        }
        if round > 0 {
            (td, ts) = (td + d, ts + t0.elapsed().as_secs_f64());
        }
    }
    let gb = (q.row_bytes(n_in) * n_out * 5 * reps) as f64 / 1e9;
    println!(
        "{n_in}x{n_out} {} {isa} {threads} threads, {kept:.2} of the inputs kept: dense {:.1} GB/s, \
         sparse {:.1} GB/s of kept rows, {:.2}x dense's speed, kept-byte efficiency {:.2}",
        q.name(),
        gb / td,
        gb * kept / ts,
        td / ts,
        td / ts * kept
    );
}
