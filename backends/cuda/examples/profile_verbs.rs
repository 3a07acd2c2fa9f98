//! Time each CUDA verb at one model's decode shapes (default OPT-13B: d 5120, 40 heads, n_ff
//! 20480, 10% of neurons, f16), each launched 20 times in one recorded graph: microseconds per
//! launch and the weight GB/s it reaches. Also the cost of one empty graph node. A diagnostic
//! for tuning (`DEJAVU_CUDA_DEFINES`), not a benchmark of the engine (`dejavu bench` is).
//!
//! `cargo run --release -p dejavu-backend-cuda --example profile_verbs [d] [n_heads] [keep]`
use dejavu_backend_api::{AttnGeom, Device, LazyKv, Product, QuantType, Rows, TopK};
use dejavu_backend_cuda::{Buf, CudaDevice};
use std::time::Instant;

#[path = "common/graph_time.rs"]
mod graph_time;
#[path = "common/mat.rs"]
mod mat;
use graph_time::{graph_us, REPS};
use mat::mat;

fn time(
    dev: &CudaDevice,
    what: &str,
    bytes: usize,
    f: impl FnMut() -> Result<(), dejavu_backend_api::BackendError>,
) {
    let us = graph_us(dev, f);
    println!(
        "{what:<44} {us:9.2} us  {:7.0} GB/s",
        bytes as f64 / us / 1e3
    );
}

fn main() {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let d = args.first().map_or(5120, |&v| v as usize);
    let nh = args.get(1).map_or(40, |&v| v as usize);
    let keep = args.get(2).copied().unwrap_or(0.1);
    let (ff, hd) = (4 * d, d / nh);
    let k = (ff as f64 * keep) as usize;
    let rank = (d / 16).div_ceil(32).clamp(1, 32) * 32;
    let dev = CudaDevice::new(0).unwrap();
    println!(
        "{} d={d} heads={nh} n_ff={ff} K={k} rank={rank}",
        dev.name()
    );
    let f16 = QuantType::F16;
    let x: Buf = dev.upload(&vec![0.01; ff]).unwrap();
    let mut y: Buf = dev.zeros(ff).unwrap();
    let sq = mat(&dev, f16, d, d);
    let fc1 = mat(&dev, f16, ff, d);
    let fc2 = mat(&dev, f16, d, ff);
    let idx = dev
        .upload_idx(
            &(0..k as u32)
                .map(|i| i * 10 % ff as u32)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let sel = Rows::Sel {
        idx: &idx,
        count: k,
        group: 1,
    };
    let rb = f16.row_bytes(d);
    time(&dev, &format!("matvec f16 {d}x{d}"), d * rb, || {
        dev.matvec(&sq, Rows::All, &x, None, &mut y, false)
    });
    let (mut q, mut k2, mut v2): (Buf, Buf, Buf) = (
        dev.zeros(d).unwrap(),
        dev.zeros(d).unwrap(),
        dev.zeros(d).unwrap(),
    );
    time(
        &dev,
        &format!("Q, K, V f16 {d}x{d} in one launch"),
        3 * d * rb,
        || {
            dev.matvecs(
                &x,
                &mut [
                    Product::new(&sq, Rows::All, &mut q),
                    Product::new(&sq, Rows::All, &mut k2),
                    Product::new(&sq, Rows::All, &mut v2),
                ],
            )
        },
    );
    time(&dev, &format!("matvec f16 {ff}x{d} (fc1)"), ff * rb, || {
        dev.matvec(&fc1, Rows::All, &x, None, &mut y, false)
    });
    time(
        &dev,
        &format!("matvec f16 {d}x{ff} (fc2)"),
        d * f16.row_bytes(ff),
        || dev.matvec(&fc2, Rows::All, &x, None, &mut y, true),
    );
    time(
        &dev,
        &format!("gather matvec {k} of {ff}x{d}"),
        k * rb,
        || dev.matvec(&fc1, sel, &x, None, &mut y, false),
    );
    time(&dev, &format!("axpy {k} of {ff}x{d}"), k * rb, || {
        dev.axpy(&fc1, sel, &x, None, &mut y)
    });
    let hsel_idx = dev
        .upload_idx(&(0..nh as u32 / 2).map(|i| i * 2).collect::<Vec<_>>())
        .unwrap();
    let hsel = Rows::Sel {
        idx: &hsel_idx,
        count: nh / 2,
        group: hd,
    };
    time(
        &dev,
        "gather W_q rows of half the heads",
        d / 2 * rb,
        || dev.matvec(&sq, hsel, &x, None, &mut y, false),
    );
    time(&dev, "axpy W_o rows of half the heads", d / 2 * rb, || {
        dev.axpy(&sq, hsel, &x, None, &mut y)
    });
    for q in [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4K,
        QuantType::Q6K,
    ] {
        let m = mat(&dev, q, d, d);
        time(
            &dev,
            &format!("matvec {q:?} {d}x{d}"),
            d * q.row_bytes(d),
            || dev.matvec(&m, Rows::All, &x, None, &mut y, false),
        );
    }
    let w1 = mat(&dev, QuantType::Q8_0, rank, d);
    let w2 = mat(&dev, QuantType::Q8_0, ff, rank);
    let mut z: Buf = dev.zeros(rank).unwrap();
    time(
        &dev,
        &format!("predictor W1 Q8_0 {rank}x{d}"),
        rank * QuantType::Q8_0.row_bytes(d),
        || dev.matvec(&w1, Rows::All, &x, None, &mut z, false),
    );
    time(
        &dev,
        &format!("predictor W2 Q8_0 {ff}x{rank}"),
        ff * QuantType::Q8_0.row_bytes(rank),
        || dev.matvec(&w2, Rows::All, &z, None, &mut y, false),
    );
    let s: Buf = dev
        .upload(
            &(0..ff)
                .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let mut out = dev.upload_idx(&vec![0; k]).unwrap();
    time(&dev, &format!("top_k {k} of {ff}"), 0, || {
        dev.top_k(&s, ff, k, &mut out)
    });
    let mut hout = dev.upload_idx(&vec![0; nh / 2]).unwrap();
    time(&dev, &format!("top_k {} of {nh}", nh / 2), 0, || {
        dev.top_k(&s, nh, nh / 2, &mut hout)
    });
    // A layer's predictors as the decoder launches them: both first layers, both second
    // layers (each of its own input), both top-k.
    let hw1 = mat(&dev, QuantType::Q8_0, rank, d);
    let hw2 = mat(&dev, QuantType::Q8_0, nh, rank);
    let (mut hz, mut hs): (Buf, Buf) = (dev.zeros(rank).unwrap(), dev.zeros(nh).unwrap());
    let mut ms: Buf = dev.zeros(ff).unwrap();
    time(
        &dev,
        "predictors of a layer: W1 pair, W2 pair, top-k pair",
        0,
        || {
            dev.matvecs(
                &x,
                &mut [
                    Product::new(&w1, Rows::All, &mut z),
                    Product::new(&hw1, Rows::All, &mut hz),
                ],
            )?;
            dev.matvecs(
                &x,
                &mut [
                    Product::new(&w2, Rows::All, &mut ms).input(&z),
                    Product::new(&hw2, Rows::All, &mut hs).input(&hz),
                ],
            )?;
            dev.top_ks(&mut [
                TopK {
                    scores: &ms,
                    row: 0,
                    n: ff,
                    k,
                    out: &mut out,
                },
                TopK {
                    scores: &hs,
                    row: 0,
                    n: nh,
                    k: nh / 2,
                    out: &mut hout,
                },
            ])
        },
    );
    let (kc, vc) = (dev.cache(1024, d).unwrap(), dev.cache(1024, d).unwrap());
    dev.set_step(&[0], 128).unwrap();
    let g = AttnGeom {
        n_heads: nh,
        n_kv_heads: nh,
        head_dim: hd,
        n_ctx: 1024,
        rows: 1,
        scoring: dejavu_backend_api::Scoring::plain(hd),
    };
    time(
        &dev,
        "attention, every head, at position 128",
        2 * 129 * d * 2,
        || dev.attention(&x, &kc, &vc, Rows::All, g, &mut y),
    );
    // Lazy K/V of half the heads at position 128, each missing 2 positions (the steady state of
    // random selections of half the heads), against K and V of every head.
    let (mut kc2, mut vc2) = (dev.cache(1024, d).unwrap(), dev.cache(1024, d).unwrap());
    let kept = dev.cache(1024, d).unwrap();
    let hsel1 = Rows::Sel {
        idx: &hsel_idx,
        count: nh / 2,
        group: 1,
    };
    // Run eagerly (the validity list is reset before each fill), both sides alike.
    let eager = |what: &str, bytes: usize, f: &mut dyn FnMut()| {
        f();
        dev.synchronize().unwrap();
        let t0 = Instant::now();
        for _ in 0..REPS {
            f();
        }
        dev.synchronize().unwrap();
        let us = t0.elapsed().as_secs_f64() * 1e6 / REPS as f64;
        println!(
            "{what:<44} {us:9.2} us  {:7.0} GB/s (eager)",
            bytes as f64 / us / 1e3
        );
    };
    eager(
        "K and V of every head (one launch)",
        2 * d * rb,
        &mut || {
            dev.matvecs(
                &x,
                &mut [
                    Product::new(&sq, Rows::All, &mut k2),
                    Product::new(&sq, Rows::All, &mut v2),
                ],
            )
            .unwrap()
        },
    );
    let mut valid = dev.upload_idx(&vec![127; nh]).unwrap();
    eager(
        "lazy K/V of half the heads, 2 positions each",
        d * rb,
        &mut || {
            dev.write_idx(&mut valid, &vec![127; nh]).unwrap();
            let job = LazyKv {
                wk: &sq,
                wv: &sq,
                bk: None,
                bv: None,
                inputs: &kept,
                heads: hsel1,
                head_dim: hd,
                rope: None,
                rows: 1,
            };
            dev.kv_fill(job, &mut valid, &mut kc2, &mut vc2).unwrap()
        },
    );
    let nw: Buf = dev.upload(&vec![1.0; d]).unwrap();
    time(&dev, &format!("layernorm {d}"), 0, || {
        dev.layernorm(&x, &nw, Some(&nw), 1e-5, &mut y, 1)
    });
    // A prompt's batch of 128 rows through the square matrix (a tiled product).
    let rows = 128;
    dev.set_step(&vec![0; rows], 0).unwrap();
    let (xs, mut ys): (Buf, Buf) = (
        dev.upload(&vec![0.01; rows * d]).unwrap(),
        dev.zeros(rows * d).unwrap(),
    );
    let t0 = Instant::now();
    for _ in 0..REPS {
        dev.matmul(&xs, rows, &mut [Product::new(&sq, Rows::All, &mut ys)])
            .unwrap();
    }
    dev.synchronize().unwrap();
    let us = t0.elapsed().as_secs_f64() * 1e6 / REPS as f64;
    let tflops = 2.0 * (rows * d * d) as f64 / us / 1e6;
    println!(
        "{:<44} {us:9.2} us  {tflops:7.1} TFLOP/s (eager)",
        format!("matmul {d}x{d} of {rows} rows")
    );
    dev.set_step(&[0], 128).unwrap();
    let one: Buf = dev.upload(&[1.0]).unwrap();
    time(&dev, "one graph node (add of 1 element)", 0, || {
        dev.add(&mut y, &one, 1)
    });
}
