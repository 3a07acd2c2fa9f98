//! A K-quant matrix's input-sparse product in its two input-block forms, call by call: the
//! K-quant's own (6-bit scales and mins under per-256 scales) and Q4_1's or Q5_1's (each
//! sub-block's scale and min as f16, what K-quants took before). The same random weights, the
//! same kept inputs; copies fill 240 MB (or `MB`: 1 keeps them in cache), in huge pages as a
//! model's layout is, so that each call reads from memory; 4000 calls of each form, alternating, after 100 to warm up. Synthetic weights:
//! this measures kernels, not a model.
//!
//! `cargo bench --bench input_forms -- INPUTS OUTPUTS TYPE DENSITY [THREADS] [MB]` (TYPE: q4_k,
//! q5_k; OUTPUTS a multiple of 256; `DEJAVU_ISA` picks the tier).
use dejavu_backend_api::{quantize, QuantType, RowLayout, Weight};
use dejavu_backend_cpu::axpy_matmul::axpy_blocks;
use dejavu_backend_cpu::kernels::table::Kernels;
use dejavu_backend_cpu::pool::SpinPool;
use std::time::Instant;

#[path = "common/shape.rs"]
mod shape;

fn main() {
    let Some(shape::Shape {
        n_in,
        n_out,
        q,
        density,
        threads,
        isa,
        mb,
    }) = shape::parse("input_forms")
    else {
        return;
    };
    let old = match q {
        QuantType::Q4K => QuantType::Q4_1,
        QuantType::Q5K => QuantType::Q5_1,
        _ => panic!("q4_k or q5_k"),
    };
    assert!(
        n_out.is_multiple_of(256) && n_in.is_multiple_of(256),
        "whole super-blocks"
    );
    let (k, pool) = (Kernels::for_isa(isa).unwrap(), SpinPool::new(threads));
    let mut src = Vec::new();
    for o in 0..n_out {
        let row: Vec<f32> = (0..n_in)
            .map(|i| ((i * 7919 + o * 104729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        quantize::quantize_row(q, &row, &mut src).unwrap();
    }
    let w = Weight::new(q, n_out, n_in, &src).unwrap();
    let form = |t: QuantType| {
        let mut out = vec![0u8; n_in * t.row_bytes(n_out)];
        dejavu::sparsity::blocks::convert(&w, t, &mut out);
        out
    };
    let copies = (mb.unwrap_or(240) << 20) / (n_in * old.row_bytes(n_out)) + 1;
    // Each form's copies in huge pages, as a model holds its input-major layout.
    let (a, b) = (form(old), form(q));
    let olds = shape::huge_pages(&a.repeat(copies));
    let owns = shape::huge_pages(&b.repeat(copies));
    let (olds, owns): (Vec<&[u8]>, Vec<&[u8]>) = (
        olds.chunks_exact(a.len()).collect(),
        owns.chunks_exact(b.len()).collect(),
    );
    let x: Vec<f32> = (0..n_in).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = shape::drop_inputs(&x, density);
    let kept = x.iter().filter(|v| **v != 0.0).count() as f64 / n_in as f64;
    let mut y = vec![0f32; n_out];
    let (reps, warm) = (4100, 100);
    let mut time = |t: QuantType, bytes: &[u8]| {
        let w = Weight::new(t, n_in, n_out, bytes).unwrap();
        let t0 = Instant::now();
        axpy_blocks(
            &k,
            &pool,
            &w.with_layout(RowLayout::InputBlocks),
            &x,
            &mut y,
        );
        t0.elapsed().as_secs_f64()
    };
    let (mut t_old, mut t_own) = (0f64, 0f64);
    for i in 0..reps {
        let (a, b) = (time(old, olds[i % copies]), time(q, owns[i % copies]));
        if i >= warm {
            (t_old, t_own) = (t_old + a, t_own + b);
        }
    }
    let us = |t: f64| t / (reps - warm) as f64 * 1e6;
    println!(
        "{n_in}x{n_out} {} {isa} {threads} threads, {kept:.2} of the inputs kept: {} form {:.1} us, \
         {} form {:.1} us: the own form {:.2}x as fast",
        q.name(),
        old.name(),
        us(t_old),
        q.name(),
        us(t_own),
        t_old / t_own
    );
}
