//! Time one dense gated (Llama-shape) decoder layer's verbs, as the decode step launches them,
//! each 20 times in one recorded graph, then the whole layer 20 times in one graph: microseconds
//! and the weight GB/s reached. Default Llama-3-8B (d 4096, 32 heads over 8 KV heads, n_ff
//! 14336, bf16) at position 128; dense and sparse parts read the same type. A diagnostic for the dense step's distance from its bytes
//! (`DEJAVU_CUDA_DEFINES` overrides the tuning constants), not a benchmark of the engine
//! (`dejavu bench` is). Then the products of input sparsity at half the inputs (`teal:0.5`'s
//! shape: axpys over input-major matrices), GB/s of the rows read.
//!
//! `cargo run --release -p dejavu-backend-cuda --example profile_layer [d] [heads] [kv_heads]
//! [n_ff] [TYPE] [pos]` (TYPE a weight type's name, any case: `bf16` (default), `f16`, `q8_0`,
//! `q4_k`...)
use dejavu_backend_api::{
    Activation, AttnGeom, BackendError, Device, InputMask, Product, QuantType, RopeStyle, Rotary,
    Rows, Scoring,
};
use dejavu_backend_cuda::{Buf, CudaDevice};
use std::cell::Cell;

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
    let q = a.get(4).map_or(Some(QuantType::BF16), |s| {
        QuantType::from_name(&s.to_uppercase())
    });
    let Some(q) = q else {
        eprintln!("error: unknown weight type {:?}", a[4]);
        std::process::exit(2)
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
    let (rope, geom) = llama_attention(nh, nkv, hd, n_ctx);
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
    input_sparsity(&dev, q, (d, nh, nkv, ff), pos);
}

/// `n` values uniform in [-1, 1) (a fixed sequence per seed): a threshold of 0.5 keeps half,
/// at random places.
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The median magnitude of `x`'s first `n` values (the threshold that keeps half).
fn median_abs(dev: &CudaDevice, x: &Buf, n: usize) -> f32 {
    let mut v = vec![0.0; n];
    dev.download(x, &mut v).unwrap();
    let mut a: Vec<f32> = v.iter().map(|x| x.abs()).collect();
    a.sort_by(f32::total_cmp);
    a[n / 2]
}

/// The products of one layer under input sparsity with half of every input kept (at random):
/// Q, K and V (one launch), W_o, gate and up (one launch), down, over input-major matrices;
/// then the layer as a `teal:0.5` step runs it, 20 layers in one graph.
fn input_sparsity(
    dev: &CudaDevice,
    q: QuantType,
    (d, nh, nkv, ff): (usize, usize, usize, usize),
    pos: usize,
) {
    let (hd, kvw) = (d / nh, nkv * (d / nh));
    let n_ctx = (pos + 1).next_power_of_two().max(1024);
    let mask = |threshold: f32| InputMask::<Buf> {
        threshold,
        scale: None,
    };
    let h: Buf = dev.upload(&random(d, 1)).unwrap();
    let ffr: Buf = dev.upload(&random(ff, 2)).unwrap();
    let (mut hd_in, mut ff_in): (Buf, Buf) = (dev.zeros(d).unwrap(), dev.zeros(ff).unwrap());
    dev.sparsify(&h, d, mask(0.5), &mut hd_in).unwrap();
    dev.sparsify(&ffr, ff, mask(0.5), &mut ff_in).unwrap();
    let (wq, wk, wv, wo) = (
        mat(dev, q, d, d),
        mat(dev, q, d, kvw),
        mat(dev, q, d, kvw),
        mat(dev, q, d, d),
    );
    let (wg, wu, wd) = (mat(dev, q, d, ff), mat(dev, q, d, ff), mat(dev, q, ff, d));
    let (mut qb, mut kb, mut vb, mut x, mut att, mut h2): (Buf, Buf, Buf, Buf, Buf, Buf) = (
        dev.zeros(d).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.zeros(kvw).unwrap(),
        dev.upload(&random(d, 3)).unwrap(),
        dev.zeros(d).unwrap(),
        dev.zeros(d).unwrap(),
    );
    let nw: Buf = dev.upload(&vec![1.0; d]).unwrap();
    let (mut gate, mut up, mut sp): (Buf, Buf, Buf) = (
        dev.zeros(ff).unwrap(),
        dev.zeros(ff).unwrap(),
        dev.zeros(ff).unwrap(),
    );
    let rb = |r: usize, c: usize| r / 2 * q.row_bytes(c);
    println!("input sparsity, half of every input kept at random (GB/s of the rows read):");
    line(
        "sparsify",
        time(dev, || dev.sparsify(&ffr, ff, mask(0.5), &mut sp)),
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
                None,
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
                None,
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
    // The layer of a `teal:0.5` step as a step that does not measure runs it (thresholds
    // inside the products: no `sparsify`): the attention output's and the GLU's thresholds are their medians in a
    // first, eager run.
    let (mut kc, mut vc) = (
        dev.cache(n_ctx, kvw).unwrap(),
        dev.cache(n_ctx, kvw).unwrap(),
    );
    let (rope, geom) = llama_attention(nh, nkv, hd, n_ctx);
    let (t_att, t_glu) = (Cell::new(0.0f32), Cell::new(0.0f32));
    // `calibrate`: eager, setting each threshold to its input's median magnitude.
    let mut layer = |calibrate: bool| -> Result<(), BackendError> {
        dev.rmsnorm(&x, &nw, 1e-5, &mut h2, 1)?;
        dev.clear(&mut [(&mut qb, d), (&mut kb, kvw), (&mut vb, kvw)])?;
        dev.axpys(
            &h,
            Some(mask(0.5)),
            &mut [
                Product::new(&wq, Rows::All, &mut qb),
                Product::new(&wk, Rows::All, &mut kb),
                Product::new(&wv, Rows::All, &mut vb),
            ],
        )?;
        dev.rope_qk(&mut qb, nh, &mut kb, nkv, hd, rope, 1)?;
        dev.store(&kb, &vb, &mut kc, &mut vc, 1)?;
        dev.attention(&qb, &kc, &vc, Rows::All, geom, &mut att)?;
        if calibrate {
            t_att.set(median_abs(dev, &att, d));
        }
        let o = Product::new(&wo, Rows::All, &mut x);
        dev.axpys(&att, Some(mask(t_att.get())), &mut [o])?;
        dev.rmsnorm(&x, &nw, 1e-5, &mut h2, 1)?;
        dev.clear(&mut [(&mut gate, ff), (&mut up, ff)])?;
        dev.axpys(
            &h,
            Some(mask(0.5)),
            &mut [
                Product::new(&wg, Rows::All, &mut gate),
                Product::new(&wu, Rows::All, &mut up),
            ],
        )?;
        dev.glu(Activation::Silu, &mut gate, &up, ff)?;
        if calibrate {
            t_glu.set(median_abs(dev, &gate, ff));
        }
        let down = Product::new(&wd, Rows::All, &mut x);
        dev.axpys(&gate, Some(mask(t_glu.get())), &mut [down])
    };
    dev.set_step(&[0], pos).unwrap();
    layer(true).unwrap();
    let bytes = (b_layer(q, d, kvw, ff) / 2) + 2 * (pos + 1) * kvw * 2;
    line(
        "the teal:0.5 layer, in one graph",
        time(dev, || layer(false)),
        bytes,
    );
}

/// Llama 3's RoPE and one row's attention over `nh` query and `nkv` KV heads of `hd`.
fn llama_attention(
    nh: usize,
    nkv: usize,
    hd: usize,
    n_ctx: usize,
) -> (Rotary<'static, Buf>, AttnGeom) {
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
    (rope, geom)
}

/// Bytes of one layer's weights: Q, K, V, O, gate, up and down.
fn b_layer(q: QuantType, d: usize, kvw: usize, ff: usize) -> usize {
    let rb = |r: usize, c: usize| r * q.row_bytes(c);
    rb(d, d) * 2 + 2 * rb(kvw, d) + 2 * rb(ff, d) + rb(d, ff)
}
