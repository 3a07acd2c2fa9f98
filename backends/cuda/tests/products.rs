//! The CUDA products (matvec, axpy, the embedding lookup, the batched matmul, several products in one launch, the
//! 16-bit loading-ahead kernels and the input-major axpys) against the CPU scalar reference
//! ([`CpuDevice::reference`]) on random inputs of ragged sizes, every weight type. Skipped,
//! with the reason printed, where no GPU is usable (CI). Tolerance as in tests/kernels.rs:
//! `|gpu - ref| <= 1e-4 (1 + sum |terms|)`, the order of summation being all that differs.
use dejavu_backend_api::{
    sparsify_ref, Activation, Device, InputMask, Product, QuantType, Rows, StepRow, Weight,
};
use dejavu_backend_cpu::device::CpuDevice;
use dejavu_backend_cuda::CudaDevice;

mod common;
use common::{close, down, gpu, magnitude, random_matrix, randv, rng};

/// matvec over all rows and over a grouped selection, with bias and accumulation.
fn matvec_on<D: Device>(d: &D, w: &Weight, x: &[f32], sel: &[u32], group: usize) -> Vec<f32> {
    let m = d.upload_mat(w).unwrap();
    let (xb, bias) = (d.upload(x).unwrap(), d.upload(&vec![0.25; w.rows]).unwrap());
    let idx = d.upload_idx(sel).unwrap();
    let mut all = d.zeros(w.rows).unwrap();
    d.matvec(&m, Rows::All, &xb, None, &mut all, false).unwrap();
    let n = sel.len() * group;
    let mut part = d.upload(&vec![1.0; n]).unwrap();
    let rows = Rows::Sel {
        idx: &idx,
        count: sel.len(),
        group,
    };
    d.matvec(&m, rows, &xb, Some(&bias), &mut part, true)
        .unwrap();
    let mut out = down(d, &all, w.rows);
    out.extend(down(d, &part, n));
    out
}

/// y0 + sum of the selected rows weighted by `a`, + a bias.
fn axpy_on<D: Device>(d: &D, w: &Weight, a: &[f32], sel: &[u32], y0: &[f32]) -> Vec<f32> {
    let m = d.upload_mat(w).unwrap();
    let (ab, idx) = (d.upload(a).unwrap(), d.upload_idx(sel).unwrap());
    let bias = d.upload(&vec![0.5; w.cols]).unwrap();
    let mut y = d.upload(y0).unwrap();
    let rows = Rows::Sel {
        idx: &idx,
        count: sel.len(),
        group: 1,
    };
    d.axpy(&m, rows, &ab, Some(&bias), &mut y).unwrap();
    down(d, &y, w.cols)
}

#[test]
fn products_match_the_scalar_reference_for_every_type() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(1);
    for q in QuantType::ALL {
        let bl = q.block_len().max(8);
        // Ragged: columns not a multiple of 256 (nor of 8 for the float types), odd row counts.
        for (rows, cols) in [(37, 3 * bl), (5, 9 * bl), (130, bl * 11), (9, 4096)] {
            let cols = if q.block_len() == 1 { cols + 3 } else { cols };
            let w_bytes = random_matrix(&mut r, q, rows, cols);
            let w = Weight::new(q, rows, cols, &w_bytes).unwrap();
            let x = randv(&mut r, cols);
            let group = if rows % 5 == 0 { 5 } else { 1 };
            let sel: Vec<u32> = (0..rows / group)
                .rev()
                .step_by(2)
                .map(|i| i as u32)
                .collect();
            let want = matvec_on(&host, &w, &x, &sel, group);
            let got = matvec_on(&gpu, &w, &x, &sel, group);
            let mut deq = vec![0.0; cols];
            let mags: Vec<f32> = (0..rows)
                .map(|row| {
                    dejavu_backend_cpu::dequant::dequantize_row(q, w.row(row), &mut deq);
                    magnitude(&deq, &x)
                })
                .collect();
            let mag = |i: usize| {
                let row = if i < rows {
                    i
                } else {
                    let j = i - rows;
                    sel[j / group] as usize * group + j % group
                };
                mags[row]
            };
            close(&format!("matvec {q:?} {rows}x{cols}"), &got, &want, |i| {
                1e-4 * (2.0 + mag(i))
            });

            // axpy over the same matrix read neuron-major (rows are neurons).
            let y0 = randv(&mut r, cols);
            let sel1: Vec<u32> = (0..rows as u32).filter(|i| i % 3 != 1).collect();
            let mut a1 = randv(&mut r, sel1.len());
            a1.iter_mut().step_by(4).for_each(|a| *a = 0.0); // ReLU zeros: rows left unread
            let want = axpy_on(&host, &w, &a1, &sel1, &y0);
            let got = axpy_on(&gpu, &w, &a1, &sel1, &y0);
            close(&format!("axpy {q:?} {rows}x{cols}"), &got, &want, |_| {
                1e-4 * (1.0 + rows as f32 * 0.1)
            });

            // Embedding lookup of a token and a position row, accumulated.
            let want = embed_on(&host, &w, rows);
            let got = embed_on(&gpu, &w, rows);
            close(&format!("embed {q:?}"), &got, &want, |_| 1e-5);

            // A batch's products: batches of one and of a few (`matvec_rows`, up to 8), then
            // the tiles (9 rows, and past one 64-row tile).
            for nt in [1, 5, 8, 9, 70] {
                let xs = randv(&mut r, nt * cols);
                let what = format!("{q:?} {rows}x{cols} of {nt}");
                matmul_matches(&gpu, &host, &w, &xs, nt, &what);
                // A step of several sequences under a sparse plan: the same rows over the
                // union of their neurons (`sel1`), and the down projection over it.
                let a = relu_zeros(randv(&mut r, nt * sel1.len()), sel1.len());
                let ys = randv(&mut r, nt * cols);
                let want = sel_batch_on(&host, &w, &xs, &a, &sel1, &ys, nt);
                let got = sel_batch_on(&gpu, &w, &xs, &a, &sel1, &ys, nt);
                let n_mm = nt * sel1.len();
                close(
                    &format!("matmul_steps and axpy_steps {q:?} {rows}x{cols} of {nt}"),
                    &got,
                    &want,
                    |i| match i < n_mm {
                        true => 1e-4 * (2.0 + want[i].abs()) + 1e-5 * cols as f32,
                        false => 1e-4 * (1.0 + rows as f32 * 0.1),
                    },
                );
            }
        }
    }
}

/// Products of batches large enough for the 64-row tiles (the other cases above take the
/// 32-row ones): ragged rows, batch rows, and columns not a multiple of a k-step.
#[test]
fn large_batch_products_match_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(8);
    for (q, rows, cols, nt) in [
        (QuantType::Q4_1, 4096, 256, 300),
        (QuantType::F16, 4100, 264, 261),
    ] {
        let bytes = random_matrix(&mut r, q, rows, cols);
        let w = Weight::new(q, rows, cols, &bytes).unwrap();
        let xs = randv(&mut r, nt * cols);
        let want = matmul_on(&host, &w, &xs, nt);
        let got = matmul_on(&gpu, &w, &xs, nt);
        // |w| <= 1 and |x| <= 1 elementwise, so a dot's rounding is below ~1e-6 of cols.
        close(
            &format!("matmul {q:?} {rows}x{cols} of {nt}"),
            &got,
            &want,
            |i| 1e-4 * (2.0 + want[i].abs()) + 1e-5 * cols as f32,
        );
    }
}

/// Batches of a few rows (`matvec_rows_T`) through matrices of 5 to 2200 rows, so that 8, 4, 2
/// and 1 warps share an output (the fewer the rows, the more warps split each row's columns; the
/// H100's and H200's 132 SMs put the switches at 526, 1052 and 2104 rows), over rows of 2100
/// columns (F32: not a multiple of 8) or 2112 (Q8_0; F16 off the tensor cores). Tolerance as
/// above.
#[test]
fn few_row_products_of_any_height_match_the_scalar_reference() {
    let Some(mut gpu) = gpu() else { return };
    gpu.set_mma(false);
    let host = CpuDevice::reference();
    let mut r = rng(10);
    for (q, cols) in [
        (QuantType::F32, 2100),
        (QuantType::Q8_0, 2112),
        (QuantType::F16, 2112),
    ] {
        for rows in [5, 600, 1100, 2200] {
            let bytes = random_matrix(&mut r, q, rows, cols);
            let w = Weight::new(q, rows, cols, &bytes).unwrap();
            for nt in [3, 8] {
                let xs = randv(&mut r, nt * cols);
                let what = format!("{q:?} {rows}x{cols} of {nt}");
                matmul_matches(&gpu, &host, &w, &xs, nt, &what);
            }
        }
    }
}

/// Batches of 2 to 32 rows of 16-bit weights whose rows are a multiple of 32 elements: the
/// tensor cores' products (matvec_mma.cu: the inputs split into 16-bit parts, or tf32 with each
/// input split in registers), dense and over a selection, in one launch and in chunks of 32
/// rows (33, 70); ragged outputs (not a multiple of the kernel's 16) and batch rows (not a
/// multiple of its tiles of 8); rows of 4128 and 8256 columns, whose few tiles split each row
/// between 4 and 8 blocks on split inputs; the inputs split by a block a row and by blocks of
/// 1024 columns (`set_split_cols`). Inputs up to 300 in magnitude. Tolerance as above.
#[test]
fn tensor_core_products_match_the_scalar_reference() {
    let Some(mut gpu) = gpu() else { return };
    gpu.set_mma(true);
    let host = CpuDevice::reference();
    let mut r = rng(9);
    // The 16-bit split by a block a row and by blocks of 1024 columns; tf32.
    let splits = [(true, 0), (true, 1024), (false, 0)];
    for (q, (h, sc)) in [QuantType::F16, QuantType::BF16]
        .map(|q| splits.map(|s| (q, s)))
        .concat()
    {
        gpu.set_mma_h(h);
        gpu.set_split_cols(sc);
        for (rows, cols, scale) in [
            (37, 96, 1.0),
            (130, 4128, 1.0),
            (16, 32, 300.0),
            (20, 8256, 1.0),
        ] {
            let bytes = random_matrix(&mut r, q, rows, cols);
            let w = Weight::new(q, rows, cols, &bytes).unwrap();
            let sel: Vec<u32> = (0..rows as u32).filter(|i| i % 3 != 1).collect();
            for nt in [2, 5, 8, 9, 16, 17, 32, 33, 70] {
                let xs: Vec<f32> = (randv(&mut r, nt * cols).into_iter())
                    .map(|v| v * scale)
                    .collect();
                let what =
                    format!("{q:?} {rows}x{cols} of {nt}, inputs to {scale}, parts {h} {sc}");
                let mags = matmul_matches(&gpu, &host, &w, &xs, nt, &what);
                let a = relu_zeros(randv(&mut r, nt * sel.len()), sel.len());
                let ys = randv(&mut r, nt * cols);
                let want = sel_batch_on(&host, &w, &xs, &a, &sel, &ys, nt);
                let got = sel_batch_on(&gpu, &w, &xs, &a, &sel, &ys, nt);
                let n_mm = nt * sel.len();
                close(&format!("matmul_steps {what}"), &got, &want, |i| {
                    match i < n_mm {
                        true => {
                            let (t, k) = (i / sel.len(), sel[i % sel.len()] as usize);
                            1e-4 * (2.0 + mags[t * rows + k])
                        }
                        false => 1e-4 * (1.0 + rows as f32 * 0.1),
                    }
                });
            }
        }
    }
}

/// The tensor cores keep f32's precision at any scale of input, with either split: 8 rows of
/// 1e-6 (f16's subnormals), 1e5 (past f16's largest), 1, 1e-30 and 1 + 3 2^-13 (which f16
/// rounds to 1: a part-less input would be off by 3.7e-4 in every term), through positive
/// weights (so that rounding errors add up rather than cancel), within `3e-5 (sum |terms|)`
/// and the output's own rounding.
#[test]
fn tensor_core_inputs_keep_their_precision_at_any_scale() {
    let Some(mut gpu) = gpu() else { return };
    gpu.set_mma(true);
    let host = CpuDevice::reference();
    let mut r = rng(12);
    let (rows, cols, nt) = (40, 256, 8);
    let scales = [1e-6, 1e5, 1.0, 1e-30, 1e-6, 1e5, 1.0, 1e-30];
    let mut xs = randv(&mut r, nt * cols);
    for (t, row) in xs.chunks_mut(cols).enumerate() {
        for v in row.iter_mut() {
            *v *= scales[t];
        }
    }
    let third = 1.0 + 3.0 * 2f32.powi(-13);
    xs[2 * cols..3 * cols].fill(third);
    for q in [QuantType::F16, QuantType::BF16] {
        let vals: Vec<f32> = (randv(&mut r, rows * cols).into_iter())
            .map(|v| 0.5 + 0.25 * v.abs())
            .collect();
        let bytes: Vec<u8> = match q {
            QuantType::F16 => vals
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => vals
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        };
        let w = Weight::new(q, rows, cols, &bytes).unwrap();
        let mags = batch_magnitudes(&w, &xs, nt);
        let want = matmul_on(&host, &w, &xs, nt);
        for (h, sc) in [(true, 0), (true, 256), (false, 0)] {
            gpu.set_mma_h(h);
            gpu.set_split_cols(sc);
            let got = matmul_on(&gpu, &w, &xs, nt);
            // Plus the last rounding of the output itself (y += s: ones and a bias).
            close(&format!("{q:?}, parts {h} {sc}"), &got, &want, |i| {
                3e-5 * mags[i % (nt * rows)] + 2.4e-7 * want[i].abs()
            });
        }
    }
}

/// A batch `xs` of `nt` rows through `w` ([`matmul_on`]) on the GPU against the host, each dot
/// within `1e-4 (2 + sum |terms|)`; returns the magnitudes ([`batch_magnitudes`]).
fn matmul_matches(
    gpu: &CudaDevice,
    host: &CpuDevice,
    w: &Weight,
    xs: &[f32],
    nt: usize,
    what: &str,
) -> Vec<f32> {
    let mags = batch_magnitudes(w, xs, nt);
    let want = matmul_on(host, w, xs, nt);
    let got = matmul_on(gpu, w, xs, nt);
    close(&format!("matmul {what}"), &got, &want, |i| {
        1e-4 * (2.0 + mags[i % (nt * w.rows)])
    });
    mags
}

/// A batch's activations `[nt][k]` with ReLU's zeros: output `j` zero in every row when
/// `j % 4 == 0` (its weight row goes unread), and in row `t` alone when `(j + t) % 3 == 0`.
fn relu_zeros(mut a: Vec<f32>, k: usize) -> Vec<f32> {
    for (i, v) in a.iter_mut().enumerate() {
        let (t, j) = (i / k, i % k);
        if j % 4 == 0 || (j + t) % 3 == 0 {
            *v = 0.0;
        }
    }
    a
}

/// `sum |terms|` of every (batch row, weight row) dot of a batch `xs` of `nt` rows through `w`,
/// `[nt][rows]`: the products' tolerance scale.
fn batch_magnitudes(w: &Weight, xs: &[f32], nt: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    let mut deq = vec![0f32; cols];
    let mut mags = vec![0f32; nt * rows];
    for row in 0..rows {
        dejavu_backend_cpu::dequant::dequantize_row(w.qtype, w.row(row), &mut deq);
        for t in 0..nt {
            mags[t * rows + row] = magnitude(&deq, &xs[t * cols..(t + 1) * cols]);
        }
    }
    mags
}

/// A batch of `nt` rows through two products in one launch: plain with ReLU, and accumulated
/// onto ones with a bias. Both outputs, `[nt][rows]` each.
fn matmul_on<D: Device>(d: &D, w: &Weight, xs: &[f32], nt: usize) -> Vec<f32> {
    let m = d.upload_mat(w).unwrap();
    d.set_step(&vec![0; nt], 0).unwrap();
    let xb = d.upload(xs).unwrap();
    let bias = d.upload(&vec![0.25; w.rows]).unwrap();
    let (mut y0, mut y1) = (
        d.zeros(nt * w.rows).unwrap(),
        d.upload(&vec![1.0; nt * w.rows]).unwrap(),
    );
    let p0 = Product::new(&m, Rows::All, &mut y0).act(Activation::Relu);
    let p1 = Product::new(&m, Rows::All, &mut y1).bias(Some(&bias));
    d.matmul(&xb, nt, &mut [p0, p1.accumulate()]).unwrap();
    let mut out = down(d, &y0, nt * w.rows);
    out.extend(down(d, &y1, nt * w.rows));
    out
}

/// A batch of `nt` rows over the selection `sel` (a step of several sequences under a sparse
/// plan): `Device::matmul_steps` with a bias and ReLU (compact, `[nt][sel]`), then
/// `Device::axpy_steps` of the activations `a` (`[nt][sel]`) onto the rows `y0` with a bias
/// (`[nt][cols]`, the matrix read neuron-major).
fn sel_batch_on<D: Device>(
    d: &D,
    w: &Weight,
    xs: &[f32],
    a: &[f32],
    sel: &[u32],
    y0: &[f32],
    nt: usize,
) -> Vec<f32> {
    let m = d.upload_mat(w).unwrap();
    d.set_step(&vec![0; nt], 0).unwrap();
    let (xb, ab, idx) = (
        d.upload(xs).unwrap(),
        d.upload(a).unwrap(),
        d.upload_idx(sel).unwrap(),
    );
    let (bias, bias_t) = (
        d.upload(&vec![0.25; w.rows]).unwrap(),
        d.upload(&vec![0.5; w.cols]).unwrap(),
    );
    let rows = Rows::Sel {
        idx: &idx,
        count: sel.len(),
        group: 1,
    };
    let mut y = d.zeros(nt * sel.len()).unwrap();
    let p = Product::new(&m, rows, &mut y).bias(Some(&bias));
    d.matmul_steps(&xb, nt, &mut [p.act(Activation::Relu)])
        .unwrap();
    let mut yt = d.upload(y0).unwrap();
    d.axpy_steps(&m, rows, &ab, nt, Some(&bias_t), &mut yt)
        .unwrap();
    let mut out = down(d, &y, nt * sel.len());
    out.extend(down(d, &yt, nt * w.cols));
    out
}

/// Three products of mixed types in one launch: a selection with a bias and ReLU, a SiLU, an
/// accumulation.
fn products_on<D: Device>(d: &D, ws: &[Weight], x: &[f32], sel: &[u32], y0: &[f32]) -> Vec<f32> {
    let m: Vec<D::Mat> = ws.iter().map(|w| d.upload_mat(w).unwrap()).collect();
    let (xb, idx) = (d.upload(x).unwrap(), d.upload_idx(sel).unwrap());
    let bias = d.upload(&vec![-0.1; ws[0].rows]).unwrap();
    let mut ys: Vec<D::Buf> = ws
        .iter()
        .map(|w| d.upload(&y0[..w.rows]).unwrap())
        .collect();
    let [y0b, y1b, y2b] = &mut ys[..] else {
        unreachable!()
    };
    let rows = Rows::Sel {
        idx: &idx,
        count: sel.len(),
        group: 1,
    };
    let p0 = Product::new(&m[0], rows, y0b)
        .bias(Some(&bias))
        .act(Activation::Relu);
    let p1 = Product::new(&m[1], Rows::All, y1b).act(Activation::Silu);
    let p2 = Product::new(&m[2], Rows::All, y2b).accumulate();
    d.matvecs(&xb, &mut [p0, p1, p2]).unwrap();
    let mut out = down(d, &ys[0], sel.len());
    out.extend(down(d, &ys[1], ws[1].rows));
    out.extend(down(d, &ys[2], ws[2].rows));
    out
}

#[test]
fn several_products_of_mixed_types_in_one_launch() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(5);
    let cols = 1024;
    let types = [QuantType::Q4K, QuantType::F16, QuantType::Q8_0];
    let rows = [300, 17, 64];
    let bytes: Vec<Vec<u8>> = (types.iter().zip(rows))
        .map(|(&q, n)| random_matrix(&mut r, q, n, cols))
        .collect();
    let ws: Vec<Weight> = (0..3)
        .map(|i| Weight::new(types[i], rows[i], cols, &bytes[i]).unwrap())
        .collect();
    let x = randv(&mut r, cols);
    let y0 = randv(&mut r, 300);
    let sel: Vec<u32> = (0..300).filter(|i| i % 7 == 3).collect();
    let want = products_on(&host, &ws, &x, &sel, &y0);
    let got = products_on(&gpu, &ws, &x, &sel, &y0);
    close("three products", &got, &want, |i| {
        1e-3 * (1.0 + want[i].abs())
    });
}

/// The 16-bit products of every row that fill the GPU without split-K (the dense step's, which
/// take the kernel that loads chunks ahead): rows 8-aligned, a ragged tail past the unrolled
/// loop, three jobs in one launch.
#[test]
fn dense_16_bit_products_match_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(11);
    for q in [QuantType::F16, QuantType::BF16] {
        for cols in [1032, 4096] {
            let rows = [3000, 700, 700];
            let bytes: Vec<Vec<u8>> = rows
                .iter()
                .map(|&n| random_matrix(&mut r, q, n, cols))
                .collect();
            let ws: Vec<Weight> = (0..3)
                .map(|i| Weight::new(q, rows[i], cols, &bytes[i]).unwrap())
                .collect();
            let x = randv(&mut r, cols);
            let want = dense_products_on(&host, &ws, &x);
            let got = dense_products_on(&gpu, &ws, &x);
            let mut deq = vec![0.0; cols];
            let mags: Vec<f32> = (ws.iter())
                .flat_map(|w| (0..w.rows).map(|row| (w, row)).collect::<Vec<_>>())
                .map(|(w, row)| {
                    dejavu_backend_cpu::dequant::dequantize_row(q, w.row(row), &mut deq);
                    magnitude(&deq, &x)
                })
                .collect();
            close(&format!("dense {q:?} x{cols}"), &got, &want, |i| {
                1e-4 * (2.0 + mags[i])
            });
        }
    }
}

fn dense_products_on<D: Device>(d: &D, ws: &[Weight], x: &[f32]) -> Vec<f32> {
    let m: Vec<D::Mat> = ws.iter().map(|w| d.upload_mat(w).unwrap()).collect();
    let xb = d.upload(x).unwrap();
    let mut ys: Vec<D::Buf> = ws.iter().map(|w| d.zeros(w.rows).unwrap()).collect();
    let [a, b, c] = &mut ys[..] else {
        unreachable!()
    };
    let mut jobs = [
        Product::new(&m[0], Rows::All, a),
        Product::new(&m[1], Rows::All, b),
        Product::new(&m[2], Rows::All, c),
    ];
    d.matvecs(&xb, &mut jobs).unwrap();
    (ys.iter().zip(ws))
        .flat_map(|(y, w)| down(d, y, w.rows))
        .collect()
}

/// Three axpys of one input (`Device::axpys`, as Q, K and V under input sparsity): the second
/// output cleared first (`Device::clear`), the others added to; each with a bias; with `mask`
/// (a threshold and the scales, if any), input sparsity's threshold inside the products.
fn axpys_on<D: Device>(
    d: &D,
    ws: &[Weight],
    a: &[f32],
    mask: Option<(f32, Option<&[f32]>)>,
    y0: &[f32],
) -> Vec<f32> {
    let m: Vec<D::Mat> = ws.iter().map(|w| d.upload_mat(w).unwrap()).collect();
    let ab = d.upload(a).unwrap();
    let scale = mask.and_then(|(_, s)| s.map(|s| d.upload(s).unwrap()));
    let mask = mask.map(|(threshold, _)| InputMask {
        threshold,
        scale: scale.as_ref(),
    });
    let bias: Vec<D::Buf> = (ws.iter())
        .map(|w| d.upload(&vec![0.5; w.cols]).unwrap())
        .collect();
    let mut ys: Vec<D::Buf> = (ws.iter())
        .map(|w| d.upload(&y0[..w.cols]).unwrap())
        .collect();
    let [y0b, y1b, y2b] = &mut ys[..] else {
        unreachable!()
    };
    d.clear(&mut [(&mut *y1b, ws[1].cols)]).unwrap();
    let p = |i: usize, y| Product::new(&m[i], Rows::All, y).bias(Some(&bias[i]));
    d.axpys(&ab, mask, &mut [p(0, y0b), p(1, y1b), p(2, y2b)])
        .unwrap();
    (ys.iter().zip(ws))
        .flat_map(|(y, w)| down(d, y, w.cols))
        .collect()
}

/// Input-major matrices of 3000 inputs, about half of them zero: one type in one launch (the
/// widest walked in several 256-input segments per row of blocks), then mixed types.
#[test]
fn axpys_of_one_input_match_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(9);
    let rows = 3000;
    let mut a = randv(&mut r, rows);
    a.iter_mut().step_by(2).for_each(|v| *v = 0.0);
    a[7] = 0.0;
    let y0 = randv(&mut r, 40000);
    for types in [
        [QuantType::BF16; 3],
        [QuantType::F16, QuantType::Q8_0, QuantType::BF16],
    ] {
        // Q8_0 rows hold whole blocks of 32.
        let cols = [33000, 1024, 1003];
        let bytes: Vec<Vec<u8>> = (0..3)
            .map(|i| random_matrix(&mut r, types[i], rows, cols[i]))
            .collect();
        let ws: Vec<Weight> = (0..3)
            .map(|i| Weight::new(types[i], rows, cols[i], &bytes[i]).unwrap())
            .collect();
        // |a| |w| summed per output column: the rounding error's scale.
        let mut mags = Vec::new();
        for w in &ws {
            let mut col = vec![0.0f32; w.cols];
            let mut deq = vec![0.0; w.cols];
            for (j, &aj) in a.iter().enumerate() {
                dejavu_backend_cpu::dequant::dequantize_row(w.qtype, w.row(j), &mut deq);
                col.iter_mut()
                    .zip(&deq)
                    .for_each(|(c, d)| *c += (aj * d).abs());
            }
            mags.extend(col);
        }
        let want = axpys_on(&host, &ws, &a, None, &y0);
        let got = axpys_on(&gpu, &ws, &a, None, &y0);
        close(&format!("axpys {types:?}"), &got, &want, |i| {
            1e-4 * (2.0 + mags[i])
        });
        // The threshold inside the products (TEAL's, then WINA's scaled scores) against the
        // reference over the inputs `sparsify` keeps.
        let scales: Vec<f32> = (0..rows).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        for (t, sc) in [(0.4, None), (0.3, Some(&scales[..]))] {
            let mut kept = vec![0.0; rows];
            sparsify_ref(&a, t, sc, &mut kept);
            let nonzero = |v: &[f32]| v.iter().filter(|x| **x != 0.0).count();
            assert!(
                nonzero(&kept) < nonzero(&a) * 9 / 10,
                "the mask drops inputs"
            );
            let want = axpys_on(&host, &ws, &kept, None, &y0);
            let got = axpys_on(&gpu, &ws, &a, Some((t, sc)), &y0);
            close(&format!("masked axpys {types:?} {t}"), &got, &want, |i| {
                1e-4 * (2.0 + mags[i])
            });
        }
    }
}

/// A batch of 3 rows: token rows, then position rows (offset 1) added; then the same tokens
/// looked up as in a vocabulary shard from row `rows / 2` on (token 0 falls outside: zeros),
/// over a buffer of ones.
fn embed_on<D: Device>(d: &D, w: &Weight, rows: usize) -> Vec<f32> {
    let m = d.upload_mat(w).unwrap();
    let mut x = d.zeros(3 * w.cols).unwrap();
    let tokens = [(rows - 1) as u32, 0, (rows / 2) as u32];
    d.set_step(&tokens, rows / 2 - 2).unwrap();
    d.embed(&m, StepRow::Token { first: 0 }, false, &mut x, 3)
        .unwrap();
    d.embed(&m, StepRow::Position { offset: 1 }, true, &mut x, 3)
        .unwrap();
    let mut shard = d.upload(&vec![1.0; 3 * w.cols]).unwrap();
    let first = rows / 2;
    d.embed(&m, StepRow::Token { first }, false, &mut shard, 3)
        .unwrap();
    let mut out = down(d, &x, 3 * w.cols);
    out.extend(down(d, &shard, 3 * w.cols));
    out
}
