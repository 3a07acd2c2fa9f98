//! Time the products of a step of several sequences at one model's shapes (default OPT-13B: d
//! 5120, n_ff 20480, f16), 1 to 32 batch rows, each launched 20 times in one recorded graph:
//! microseconds per launch and the weight GB/s it reaches (one row: the decode step's matvec).
//! Then the gather over a union of 31% of fc1's rows (8 sequences under `dejavu:0.1`). A
//! diagnostic for tuning (`DEJAVU_CUDA_DEFINES`), not a benchmark of the engine (`dejavu
//! bench` is).
//!
//! `cargo run --release -p dejavu-backend-cuda --example profile_batch [d] [n_ff] [f16|bf16]`
use dejavu_backend_api::{Activation, Device, Product, QuantType, Rows};
use dejavu_backend_cuda::{Buf, CudaDevice, Mat};

#[path = "common/graph_time.rs"]
mod graph_time;
#[path = "common/mat.rs"]
mod mat;
use graph_time::graph_us;
use mat::mat;

/// A step's products of `rows` rows: one row as the decode step runs it (`matvecs`).
fn step(
    dev: &CudaDevice,
    x: &Buf,
    rows: usize,
    jobs: &mut [Product<'_, CudaDevice>],
) -> Result<(), dejavu_backend_api::BackendError> {
    match rows {
        1 => dev.matvecs(x, jobs),
        _ => dev.matmul_steps(x, rows, jobs),
    }
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| a.get(i).map_or(d, |v| v.parse().unwrap());
    let (d, ff) = (num(0, 5120), num(1, 20480));
    let q = match a.get(2).map_or("f16", |s| s.as_str()) {
        "bf16" => QuantType::BF16,
        _ => QuantType::F16,
    };
    let dev = CudaDevice::new(0).unwrap();
    println!("{} d={d} n_ff={ff} {q:?}", dev.name());
    let (sq, fc1, fc2) = (mat(&dev, q, d, d), mat(&dev, q, ff, d), mat(&dev, q, d, ff));
    let rb = |r: usize, c: usize| r * q.row_bytes(c);
    let x: Buf = dev.upload(&vec![0.01; 32 * ff]).unwrap();
    let (mut y1, mut y2, mut y3): (Buf, Buf, Buf) = (
        dev.zeros(32 * ff).unwrap(),
        dev.zeros(32 * d).unwrap(),
        dev.zeros(32 * d).unwrap(),
    );
    println!(
        "{:<6} {:>22} {:>22} {:>22} {:>22}",
        "rows", "Q, K, V (3 launches)", "out (one)", "fc1 + relu", "fc2 (accumulate)"
    );
    for rows in [1, 2, 4, 8, 16, 32] {
        dev.set_step(&vec![0; rows], 128).unwrap();
        let run = |w: &Mat, y: &mut Buf, act: bool, acc: bool| {
            graph_us(&dev, || {
                let mut p = Product::new(w, Rows::All, y);
                if act {
                    p = p.act(Activation::Relu);
                }
                if acc {
                    p = p.accumulate();
                }
                step(&dev, &x, rows, &mut [p])
            })
        };
        let qkv = graph_us(&dev, || {
            step(
                &dev,
                &x,
                rows,
                &mut [
                    Product::new(&sq, Rows::All, &mut y1),
                    Product::new(&sq, Rows::All, &mut y2),
                    Product::new(&sq, Rows::All, &mut y3),
                ],
            )
        });
        let cells = [
            (qkv, 3 * rb(d, d)),
            (run(&sq, &mut y2, false, false), rb(d, d)),
            (run(&fc1, &mut y1, true, false), rb(ff, d)),
            (run(&fc2, &mut y2, false, true), rb(d, ff)),
        ];
        print!("{rows:<6}");
        for (us, bytes) in cells {
            print!(" {us:9.2} us {:5.0} GB/s", bytes as f64 / us / 1e3);
        }
        println!();
    }
    // The union of 8 sequences' 10% of fc1 (31% of the rows), gathered for each of them.
    let k = ff * 31 / 100;
    let idx = dev
        .upload_idx(&(0..k as u32).map(|i| i * 3 % ff as u32).collect::<Vec<_>>())
        .unwrap();
    let sel = Rows::Sel {
        idx: &idx,
        count: k,
        group: 1,
    };
    dev.set_step(&[0; 8], 128).unwrap();
    let us = graph_us(&dev, || {
        dev.matmul_steps(&x, 8, &mut [Product::new(&fc1, sel, &mut y1)])
    });
    println!(
        "gather of {k} fc1 rows, 8 rows: {us:9.2} us {:5.0} GB/s",
        rb(k, d) as f64 / us / 1e3
    );
}
