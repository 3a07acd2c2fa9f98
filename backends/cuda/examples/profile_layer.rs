//! Time one dense gated (Llama-shape) decoder layer's verbs, as the decode step launches them,
//! each 20 times in one recorded graph, then the whole layer 20 times in one graph: microseconds
//! and the weight GB/s reached. Default Llama-3-8B (d 4096, 32 heads over 8 KV heads, n_ff
//! 14336, bf16) at position 128. A diagnostic for the dense step's distance from its bytes
//! (`DEJAVU_CUDA_DEFINES` overrides the tuning constants), not a benchmark of the engine
//! (`dejavu bench` is). Then the products of input sparsity at half the inputs (`teal:0.5`'s
//! shape: axpys over input-major matrices), GB/s of the rows read.
//!
//! `cargo run --release -p dejavu-backend-cuda --example profile_layer [d] [heads] [kv_heads]
//! [n_ff] [f16|bf16] [pos]`
use dejavu_backend_api::{
    Activation, AttnGeom, Device, InputMask, Product, QuantType, RopeStyle, Rotary, Rows, Scoring,
};
use dejavu_backend_cuda::{Buf, CudaDevice};

#[path = "common/graph_time.rs"]
mod graph_time;
#[path = "common/mat.rs"]
mod mat;
use graph_time::graph_us as time;
use mat::mat;

fn line(what: &str, us: f64, bytes: usize) {
    let gbs = if bytes > 0 {
        format!("{:7.0} GB/s", bytes as f64 / us / 1e3)
    } else {
        String::new()
    };
    println!("{what:<40} {us:9.2} us  {gbs}");
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| a.get(i).map_or(d, |v| v.parse().unwrap());
    let (d, nh, nkv, ff) = (num(0, 4096), num(1, 32), num(2, 8), num(3, 14336));
    let q = match a.get(4).map_or("bf16", |s| s.as_str()) {
        "f16" => QuantType::F16,
        _ => QuantType::BF16,
    };
    let pos = num(5, 128);
    let (hd, n_ctx) = (d / nh, (pos + 1).next_power_of_two().max(1024));
    let kvw = nkv * hd;
    let dev = CudaDevice::new(0).unwrap();
    println!(
        "{} d={d} heads={nh}/{nkv} n_ff={ff} {q:?} pos={pos}",
        dev.name()
    );
    let (wq, wk, wv, wo) = (
        mat(&dev, q, d, d),
        mat(&dev, q, kvw, d),
        mat(&dev, q, kvw, d),
        mat(&dev, q, d, d),
    );
    let (wg, wu, wd) = (
        mat(&dev, q, ff, d),
        mat(&dev, q, ff, d),
        mat(&dev, q, d, ff),
    );
    let rb = |r: usize, c: usize| r * q.row_bytes(c);
    let b_qkv = rb(d, d) + 2 * rb(kvw, d);
    let (b_o, b_gu, b_down) = (rb(d, d), 2 * rb(ff, d), rb(d, ff));
    let mut x: Buf = dev.upload(&vec![0.01; d]).unwrap();
    let nw: Buf = dev.upload(&vec![1.0; d]).unwrap();
    let mut h: Buf = dev.zeros(d).unwrap();
    let (mut qb, mut kb, mut vb, mut att): (Buf, Buf, Buf, Buf) = (
        dev.zeros(d).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.zeros(d).unwrap(),
    );
    let (mut gate, mut up): (Buf, Buf) = (dev.zeros(ff).unwrap(), dev.zeros(ff).unwrap());
    let (mut kc, mut vc) = (
        dev.cache(n_ctx, kvw).unwrap(),
        dev.cache(n_ctx, kvw).unwrap(),
    );
    dev.set_step(&[0], pos).unwrap();
    let rope = Rotary::<Buf> {
        theta: 500000.0,
        style: RopeStyle::Interleaved,
        factors: None,
    };
    let geom = AttnGeom {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        n_ctx,
        rows: 1,
        scoring: Scoring::plain(hd),
    };
    let kv_bytes = 2 * (pos + 1) * kvw * 2;
    let mut total = 0.0;
    let mut rows = Vec::new();
    let mut add = |what: &str, us: f64, bytes: usize| {
        total += us;
        rows.push((what.to_string(), us, bytes));
    };
    add(
        "rmsnorm",
        time(&dev, || dev.rmsnorm(&x, &nw, 1e-5, &mut h, 1)),
        0,
    );
    add(
        "Q, K, V (one launch)",
        time(&dev, || {
            dev.matvecs(
                &h,
                &mut [
                    Product::new(&wq, Rows::All, &mut qb),
                    Product::new(&wk, Rows::All, &mut kb),
                    Product::new(&wv, Rows::All, &mut vb),
                ],
            )
        }),
        b_qkv,
    );
    add(
        "rope_qk",
        time(&dev, || dev.rope_qk(&mut qb, nh, &mut kb, nkv, hd, rope, 1)),
        0,
    );
    add(
        "store K, V",
        time(&dev, || dev.store(&kb, &vb, &mut kc, &mut vc, 1)),
        0,
    );
    add(
        "attention",
        time(&dev, || {
            dev.attention(&qb, &kc, &vc, Rows::All, geom, &mut att)
        }),
        kv_bytes,
    );
    add(
        "W_o (accumulate)",
        time(&dev, || {
            dev.matvec(&wo, Rows::All, &att, None, &mut x, true)
        }),
        b_o,
    );
    add(
        "rmsnorm",
        time(&dev, || dev.rmsnorm(&x, &nw, 1e-5, &mut h, 1)),
        0,
    );
    add(
        "gate, up (one launch)",
        time(&dev, || {
            dev.matvecs(
                &h,
                &mut [
                    Product::new(&wg, Rows::All, &mut gate),
                    Product::new(&wu, Rows::All, &mut up),
                ],
            )
        }),
        b_gu,
    );
    add(
        "glu",
        time(&dev, || dev.glu(Activation::Silu, &mut gate, &up, ff)),
        0,
    );
    add(
        "W_down (accumulate)",
        time(&dev, || {
            dev.matvec(&wd, Rows::All, &gate, None, &mut x, true)
        }),
        b_down,
    );
    let bytes = b_qkv + b_o + b_gu + b_down + kv_bytes;
    for (what, us, b) in &rows {
        line(what, *us, *b);
    }
    line("sum of the verbs", total, bytes);
    // The layer as the step runs it: every verb in order, 20 layers in one graph.
    let layer = time(&dev, || {
        dev.rmsnorm(&x, &nw, 1e-5, &mut h, 1)?;
        dev.matvecs(
            &h,
            &mut [
                Product::new(&wq, Rows::All, &mut qb),
                Product::new(&wk, Rows::All, &mut kb),
                Product::new(&wv, Rows::All, &mut vb),
            ],
        )?;
        dev.rope_qk(&mut qb, nh, &mut kb, nkv, hd, rope, 1)?;
        dev.store(&kb, &vb, &mut kc, &mut vc, 1)?;
        dev.attention(&qb, &kc, &vc, Rows::All, geom, &mut att)?;
        dev.matvec(&wo, Rows::All, &att, None, &mut x, true)?;
        dev.rmsnorm(&x, &nw, 1e-5, &mut h, 1)?;
        dev.matvecs(
            &h,
            &mut [
                Product::new(&wg, Rows::All, &mut gate),
                Product::new(&wu, Rows::All, &mut up),
            ],
        )?;
        dev.glu(Activation::Silu, &mut gate, &up, ff)?;
        dev.matvec(&wd, Rows::All, &gate, None, &mut x, true)
    });
    line("the layer, in one graph", layer, bytes);
    input_sparsity(&dev, q, d, kvw, ff);
}

/// The products of one layer under input sparsity with half of every input kept: Q, K and V
/// (one launch), W_o, gate and up (one launch), down, over input-major matrices.
fn input_sparsity(dev: &CudaDevice, q: QuantType, d: usize, kvw: usize, ff: usize) {
    let half = |n: usize| -> Buf {
        let v: Vec<f32> = (0..n)
            .map(|i| {
                if i % 2 == 0 {
                    0.01 * (i % 7) as f32 + 0.01
                } else {
                    0.0
                }
            })
            .collect();
        dev.upload(&v).unwrap()
    };
    let (hd_in, ff_in) = (half(d), half(ff));
    let (wq, wk, wv, wo) = (
        mat(dev, q, d, d),
        mat(dev, q, d, kvw),
        mat(dev, q, d, kvw),
        mat(dev, q, d, d),
    );
    let (wg, wu, wd) = (mat(dev, q, d, ff), mat(dev, q, d, ff), mat(dev, q, ff, d));
    let (mut qb, mut kb, mut vb, mut x): (Buf, Buf, Buf, Buf) = (
        dev.zeros(d).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.zeros(d).unwrap(),
    );
    let (mut gate, mut up, mut sp): (Buf, Buf, Buf) = (
        dev.zeros(ff).unwrap(),
        dev.zeros(ff).unwrap(),
        dev.zeros(ff).unwrap(),
    );
    let rb = |r: usize, c: usize| r / 2 * q.row_bytes(c);
    println!("input sparsity, half of every input kept (GB/s of the rows read):");
    let mask = InputMask::<Buf> {
        threshold: 0.0,
        scale: None,
    };
    line(
        "sparsify",
        time(dev, || dev.sparsify(&ff_in, ff, mask, &mut sp)),
        0,
    );
    line(
        "clear Q, K, V (one launch)",
        time(dev, || {
            dev.clear(&mut [(&mut qb, d), (&mut kb, kvw), (&mut vb, kvw)])
        }),
        0,
    );
    line(
        "Q, K, V axpys (one launch)",
        time(dev, || {
            dev.axpys(
                &hd_in,
                &mut [
                    Product::new(&wq, Rows::All, &mut qb),
                    Product::new(&wk, Rows::All, &mut kb),
                    Product::new(&wv, Rows::All, &mut vb),
                ],
            )
        }),
        rb(d, d) + 2 * rb(d, kvw),
    );
    line(
        "W_o axpy",
        time(dev, || dev.axpy(&wo, Rows::All, &hd_in, None, &mut x)),
        rb(d, d),
    );
    line(
        "gate, up axpys (one launch)",
        time(dev, || {
            dev.axpys(
                &hd_in,
                &mut [
                    Product::new(&wg, Rows::All, &mut gate),
                    Product::new(&wu, Rows::All, &mut up),
                ],
            )
        }),
        2 * rb(d, ff),
    );
    line(
        "down axpy",
        time(dev, || dev.axpy(&wd, Rows::All, &ff_in, None, &mut x)),
        rb(ff, d),
    );
}
