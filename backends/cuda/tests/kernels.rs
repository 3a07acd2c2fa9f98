//! Every CUDA verb but the products (tests/products.rs) against the CPU scalar reference
//! ([`CpuDevice::reference`]) on random inputs of ragged sizes, every weight type. Skipped, with the reason printed, where no GPU is usable (CI).
//!
//! Tolerance: both sides dequantize the same blocks to f32 and compute in f32; only the order
//! of summation differs (a warp's tree against a sequential sum), `~sqrt(n) 2^-24` of the sum of
//! magnitudes, and the GPU's `expf`/`rsqrtf` (a few ulp). We assert `|gpu - ref| <= 1e-4 (1 +
//! sum |terms|)` for products and 1e-4 relative elsewhere; attention compares against an f16
//! cache on both sides.
use dejavu_backend_api::{
    Activation, AttnGeom, Device, LazyKv, Product, QuantType, RopeStyle, Rotary, Rows, Scoring,
    TopK, Weight,
};
use dejavu_backend_cpu::device::CpuDevice;

mod common;
use common::{close, down, gpu, random_matrix, randv, rng};

/// The kernels compile wherever NVRTC is (a GPU is not needed); skipped without it.
#[test]
fn kernels_compile() {
    if !dejavu_backend_cuda::nvrtc_present() {
        eprintln!("skipped: NVRTC (libnvrtc.so) not found");
        return;
    }
    // Hopper, and Turing, where the tensor-core kernels compile to nothing.
    for arch in ["compute_90", "compute_75"] {
        if let Err(e) = dejavu_backend_cuda::compile(arch) {
            panic!("{arch}: {e}");
        }
    }
}

/// Norms and RoPE (both styles) over a batch of rows of one random vector (2 rows where its
/// heads split evenly), then GLU, activations, scatter, add and copy, gather, abs and head norms.
fn elementwise_on<D: Device>(d: &D, x: &[f32], w: &[f32], b: &[f32], hd: usize) -> Vec<f32> {
    let n = x.len();
    let rows = if (n / hd).is_multiple_of(2) { 2 } else { 1 };
    let (xb, wb, bb) = (
        d.upload(x).unwrap(),
        d.upload(w).unwrap(),
        d.upload(b).unwrap(),
    );
    let mut out = Vec::new();
    let mut y = d.zeros(n).unwrap();
    d.set_step(&vec![0; rows], 1234).unwrap();
    let (wr, br) = (
        d.upload(&w[..n / rows]).unwrap(),
        d.upload(&b[..n / rows]).unwrap(),
    );
    d.rmsnorm(&xb, &wr, 1e-5, &mut y, rows).unwrap();
    out.extend(down(d, &y, n));
    d.layernorm(&xb, &wr, Some(&br), 1e-5, &mut y, rows)
        .unwrap();
    out.extend(down(d, &y, n));
    let heads = n / hd / rows;
    // Llama 3's frequency divisors: 1 for the fast pairs, up to 8 for the slow ones.
    let f: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 + 7.0 * i as f32 / (hd / 2) as f32)
        .collect();
    let factors = d.upload(&f).unwrap();
    for (style, factors) in [
        (RopeStyle::Interleaved, None),
        (RopeStyle::Neox, None),
        (RopeStyle::Neox, Some(&factors)),
    ] {
        let r = |theta| Rotary {
            theta,
            style,
            factors,
        };
        let mut z = d.upload(x).unwrap();
        d.rope(&mut z, heads, hd, r(10000.0), rows).unwrap();
        out.extend(down(d, &z, n));
        // Queries and keys in one launch: some heads of x, and all of w.
        let (mut q, mut k) = (d.upload(x).unwrap(), d.upload(w).unwrap());
        d.rope_qk(&mut q, heads - 1, &mut k, heads, hd, r(500.0), rows)
            .unwrap();
        out.extend(down(d, &q, n));
        out.extend(down(d, &k, n));
    }
    // Scatter into a copy of b: distinct indices in any order, one past the end (writes
    // nothing).
    let idx: Vec<u32> = (0..n as u32 / 3)
        .rev()
        .map(|i| 3 * i + 1)
        .chain([n as u32])
        .collect();
    let mut dst = d.upload(b).unwrap();
    let src = d.upload(&x[..idx.len()]).unwrap();
    d.scatter(&src, &d.upload_idx(&idx).unwrap(), idx.len(), 1, &mut dst)
        .unwrap();
    out.extend(down(d, &dst, n));
    // Groups of 3 in descending order (a row's heads put back at their places).
    let groups: Vec<u32> = (0..n as u32 / 3).rev().step_by(2).collect();
    let mut dst = d.upload(b).unwrap();
    let src = d.upload(&x[..3 * groups.len()]).unwrap();
    d.scatter(
        &src,
        &d.upload_idx(&groups).unwrap(),
        groups.len(),
        3,
        &mut dst,
    )
    .unwrap();
    out.extend(down(d, &dst, n));
    // Gemma's embedding scale, and its soft cap of scaled values (some past the cap).
    for (scale, cap) in [(8.0, None), (3.0, Some(1.5))] {
        let mut g = d.upload(x).unwrap();
        d.scale_cap(&mut g, n - 1, scale, cap).unwrap();
        out.extend(down(d, &g, n));
    }
    for act in [Activation::Silu, Activation::Relu, Activation::GeluTanh] {
        let mut g = d.upload(x).unwrap();
        d.glu(act, &mut g, &wb, n - 3).unwrap();
        out.extend(down(d, &g, n));
        let mut g = d.upload(x).unwrap();
        d.activate(act, &mut g, n - 1).unwrap();
        out.extend(down(d, &g, n));
    }
    let mut g = d.upload(x).unwrap();
    d.add(&mut g, &wb, n - 2).unwrap();
    d.copy(&bb, &mut g, 3).unwrap();
    out.extend(down(d, &g, n));
    d.take_rows(&xb, 2, 1, n / 4, &mut g).unwrap();
    out.extend(down(d, &g, n));
    d.take_rows(&xb, 1, 2, n / 4, &mut g).unwrap();
    out.extend(down(d, &g, n));
    // Rows written back at an offset (the rest of the output kept).
    let mut g = d.upload(x).unwrap();
    d.put_rows(&bb, 2, 1, n / 4, &mut g).unwrap();
    out.extend(down(d, &g, n));
    // A selection's compact values (single units and whole heads), magnitudes, head norms.
    let sel: Vec<u32> = (0..(n / hd) as u32).rev().step_by(2).collect();
    let sel_idx = d.upload_idx(&sel).unwrap();
    let mut dst = d.zeros(n).unwrap();
    d.gather(&xb, &sel_idx, sel.len(), hd, &mut dst).unwrap();
    out.extend(down(d, &dst, sel.len() * hd));
    d.gather(&xb, &sel_idx, sel.len(), 1, &mut dst).unwrap();
    out.extend(down(d, &dst, sel.len()));
    let mut g = d.upload(x).unwrap();
    d.abs(&mut g, n - 5).unwrap();
    out.extend(down(d, &g, n));
    d.group_norms(&xb, n / hd, hd, &mut g).unwrap();
    out.extend(down(d, &g, n / hd));
    // Nonzero counts of a ReLU'd vector (about half zero), over more values than one block;
    // and of its groups of 32 (the last one short) and of 2 with a nonzero, on a sparser one.
    let relu: Vec<f32> = (0..3000)
        .map(|i| x[i % n].max(0.0) * (i % 7) as f32)
        .collect();
    let (rb, mut counts) = (d.upload(&relu).unwrap(), d.zeros(5).unwrap());
    d.count_nonzero(&rb, 2999, 1, &mut counts, 1).unwrap();
    d.count_nonzero(&rb, 5, 1, &mut counts, 2).unwrap();
    let sparse: Vec<f32> = (0..3000)
        .map(|i| relu[i] * (i % 97 < 3) as u8 as f32)
        .collect();
    let sb = d.upload(&sparse).unwrap();
    d.count_nonzero(&sb, 2999, 32, &mut counts, 3).unwrap();
    d.count_nonzero(&sb, 2999, 2, &mut counts, 4).unwrap();
    out.extend(down(d, &counts, 5));
    out
}

#[test]
fn elementwise_ops_match_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(2);
    // 12288 and 20480: past the 8192 elements a norm keeps in registers.
    for (n, hd) in [
        (64 * 3, 64),
        (896, 64),
        (5120, 128),
        (12288, 128),
        (20480, 128),
    ] {
        let (x, w, b) = (randv(&mut r, n), randv(&mut r, n), randv(&mut r, n));
        let want = elementwise_on(&host, &x, &w, &b, hd);
        let got = elementwise_on(&gpu, &x, &w, &b, hd);
        close(&format!("elementwise n={n}"), &got, &want, |i| {
            1e-4 * (1.0 + want[i].abs())
        });
    }
}

/// Store `n_pos` positions of keys and values (the first as one batch, the last alone), then
/// attend with a head selection and with every head over a batch of the last `g.rows`
/// positions (row `r`'s queries: `q` times `1 + r`).
fn attention_on<D: Device>(
    d: &D,
    g: AttnGeom,
    kv: &[Vec<f32>],
    q: &[f32],
    heads: &[u32],
) -> Vec<f32> {
    let width = g.n_kv_heads * g.head_dim;
    let (mut kc, mut vc) = (
        d.cache(g.n_ctx, width).unwrap(),
        d.cache(g.n_ctx, width).unwrap(),
    );
    let (n_pos, rows) = (kv.len(), g.rows);
    for (p0, chunk) in [(0, &kv[..n_pos - 1]), (n_pos - 1, &kv[n_pos - 1..])] {
        if chunk.is_empty() {
            continue;
        }
        d.set_step(&vec![0; chunk.len()], p0).unwrap();
        let (k, v): (Vec<f32>, Vec<f32>) = (
            chunk.iter().flat_map(|r| r[..width].to_vec()).collect(),
            chunk.iter().flat_map(|r| r[width..].to_vec()).collect(),
        );
        let (k, v) = (d.upload(&k).unwrap(), d.upload(&v).unwrap());
        d.store(&k, &v, &mut kc, &mut vc, chunk.len()).unwrap();
    }
    let scaled = |q: &[f32]| -> Vec<f32> {
        (0..rows)
            .flat_map(|r| q.iter().map(move |v| v * (1.0 + r as f32)))
            .collect()
    };
    d.set_step(&vec![0; rows], n_pos - rows).unwrap();
    let idx = d.upload_idx(heads).unwrap();
    let qb = d.upload(&scaled(q)).unwrap();
    let mut out = d.zeros(rows * q.len()).unwrap();
    let sel = Rows::Sel {
        idx: &idx,
        count: heads.len(),
        group: 1,
    };
    d.attention(&qb, &kc, &vc, sel, g, &mut out).unwrap();
    let full = g.n_heads * g.head_dim;
    let mut all = d.zeros(rows * full).unwrap();
    let qa = d.upload(&scaled(&[q, q].concat()[..full])).unwrap();
    d.attention(&qa, &kc, &vc, Rows::All, g, &mut all).unwrap();
    let mut res = down(d, &out, rows * q.len());
    res.extend(down(d, &all, rows * full));
    res
}

#[test]
fn attention_matches_the_scalar_reference() {
    let Some(mut gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(3);
    // Multi-head and grouped-query; contexts short, ragged and beyond 48 KiB of scores;
    // batches of one row and of several. Each in one block a head (`set_att_span(0)`), and in
    // spans of the context (flash-decoding; merged after) of 512 positions (the default: the
    // 20000-position context's spans past the position are empty) and of 16.
    // Then Gemma-like scoring: a scale of its own, a soft cap, and sliding windows shorter
    // than the context, of one position, and wider than the cache.
    let gemma = |hd: usize, softcap, window| Scoring {
        scale: 1.0 / (hd as f32 * 1.5).sqrt(),
        softcap,
        window,
    };
    for (nh, nkv, hd, n_pos, n_ctx, rows, scoring) in [
        (4, 4, 64, 1, 8, 1, Scoring::plain(64)),
        (14, 2, 64, 37, 64, 5, Scoring::plain(64)),
        (8, 8, 128, 300, 20000, 3, Scoring::plain(128)),
        (14, 2, 64, 37, 64, 5, gemma(64, Some(0.7), Some(11))),
        (4, 2, 16, 40, 48, 4, gemma(16, None, Some(1))),
        (4, 2, 16, 300, 512, 3, gemma(16, Some(3.0), Some(4096))),
        (8, 8, 128, 300, 20000, 3, gemma(128, None, Some(257))),
    ] {
        let g = AttnGeom {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            n_ctx,
            rows,
            scoring,
        };
        let kv: Vec<Vec<f32>> = (0..n_pos).map(|_| randv(&mut r, 2 * nkv * hd)).collect();
        let heads: Vec<u32> = (0..nh as u32).rev().filter(|h| h % 3 != 0).collect();
        let q = randv(&mut r, heads.len() * hd);
        let want = attention_on(&host, g, &kv, &q, &heads);
        for span in [0, 512, 16] {
            gpu.set_att_span(span);
            let got = attention_on(&gpu, g, &kv, &q, &heads);
            close(
                &format!("attention {nh}/{nkv}x{hd} at {n_pos}, spans of {span}"),
                &got,
                &want,
                |_| 2e-4,
            );
        }
    }
}

#[test]
fn top_k_matches_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(4);
    for (n, k) in [
        (7, 3),
        (56, 28),
        (1500, 700),
        (16384, 1638),
        (28672, 2867),
        (24000, 3000),
        (40000, 4000),
        (50000, 5000),
        (100, 100),
    ] {
        let mut s = randv(&mut r, n);
        s[n / 2] = -0.0; // signed zeros and negatives order correctly
        if n != 100 {
            // A NaN ranks as -inf (never among these top k), infinities at their ends; in the
            // one-block, bucket and multi-block paths alike.
            (s[1], s[n - 2], s[n - 1]) = (f32::NAN, f32::NEG_INFINITY, f32::INFINITY);
        }
        if n == 16384 {
            // 4000 scores tied across the k-th largest: the bucket path's fallback. Ties are
            // broken by index on the host and by any rule on the GPU, so the chosen scores are
            // compared (as a sorted list), not the indices.
            (s.iter_mut().step_by(4)).for_each(|v| *v = 0.9);
        }
        if n == 24000 || n == 50000 {
            // Three quarters of the scores tied: more candidates than the GPU's multi-block path
            // keeps, so its last block selects over every score (up to 200 KB of keys).
            (s.iter_mut().enumerate())
                .filter(|(i, _)| i % 4 != 0)
                .for_each(|(_, v)| *v = 0.5);
        }
        let top = |d: &dyn Fn(&mut Vec<u32>)| {
            let mut v = vec![0u32; k];
            d(&mut v);
            v.sort_unstable();
            v
        };
        let want = top(&|v| {
            let mut o = host.upload_idx(&vec![0; k]).unwrap();
            host.top_k(&host.upload(&s).unwrap(), n, k, &mut o).unwrap();
            host.download_idx(&o, v).unwrap();
        });
        let got = top(&|v| {
            let mut o = gpu.upload_idx(&vec![0; k]).unwrap();
            gpu.top_k(&gpu.upload(&s).unwrap(), n, k, &mut o).unwrap();
            gpu.download_idx(&o, v).unwrap();
        });
        let mut distinct = got.clone();
        distinct.dedup();
        assert!(
            distinct.len() == k && got.iter().all(|&i| (i as usize) < n),
            "top {k} of {n}: indices"
        );
        let values = |v: &[u32]| {
            let mut x: Vec<f32> = v.iter().map(|&i| s[i as usize]).collect();
            x.sort_by(f32::total_cmp);
            x
        };
        assert_eq!(values(&got), values(&want), "top {k} of {n}");
    }
}

/// Lazy K/V: the kept inputs of `n_pos` positions, then at the last one a fill of the selected
/// heads' missed positions (heads missing none, one, several and all of them), read back
/// through attention over every head, and the validity list after.
fn kv_fill_on<D: Device>(
    d: &D,
    w: [&Weight; 2],
    inputs: &[Vec<f32>],
    valid0: &[u32],
    heads: &[u32],
    rope: Option<(f32, RopeStyle, Option<&[f32]>)>,
    q: &[f32],
) -> (Vec<f32>, Vec<u32>) {
    let (nh, hd) = (valid0.len(), w[0].rows / valid0.len());
    let factors = rope.and_then(|r| r.2).map(|f| d.upload(f).unwrap());
    let rope = rope.map(|(theta, style, _)| Rotary {
        theta,
        style,
        factors: factors.as_ref(),
    });
    let (dm, n_ctx) = (w[0].cols, inputs.len() + 2);
    let (wk, wv) = (d.upload_mat(w[0]).unwrap(), d.upload_mat(w[1]).unwrap());
    let bias = d
        .upload(&(0..nh * hd).map(|i| i as f32 * 0.01).collect::<Vec<_>>())
        .unwrap();
    // The inputs as one batch; the fill at a batch of the last 3 positions.
    let mut kept = d.cache(n_ctx, dm).unwrap();
    d.set_step(&vec![0; inputs.len()], 0).unwrap();
    d.store_row(
        &d.upload(&inputs.concat()).unwrap(),
        &mut kept,
        inputs.len(),
    )
    .unwrap();
    d.set_step(&[0; 3], inputs.len() - 3).unwrap();
    let (mut kc, mut vc) = (
        d.cache(n_ctx, nh * hd).unwrap(),
        d.cache(n_ctx, nh * hd).unwrap(),
    );
    let mut valid = d.upload_idx(valid0).unwrap();
    let idx = d.upload_idx(heads).unwrap();
    let job = LazyKv {
        wk: &wk,
        wv: &wv,
        bk: Some(&bias),
        bv: None,
        inputs: &kept,
        heads: Rows::Sel {
            idx: &idx,
            count: heads.len(),
            group: 1,
        },
        head_dim: hd,
        rope,
        rows: 3,
    };
    d.kv_fill(job, &mut valid, &mut kc, &mut vc).unwrap();
    d.set_step(&[0], inputs.len() - 1).unwrap();
    let g = AttnGeom {
        n_heads: nh,
        n_kv_heads: nh,
        head_dim: hd,
        n_ctx,
        rows: 1,
        scoring: Scoring::plain(hd),
    };
    let rows = Rows::Sel {
        idx: &idx,
        count: heads.len(),
        group: 1,
    };
    let (qb, mut out) = (d.upload(q).unwrap(), d.zeros(q.len()).unwrap());
    d.attention(&qb, &kc, &vc, rows, g, &mut out).unwrap();
    let mut v = vec![0; nh];
    d.download_idx(&valid, &mut v).unwrap();
    (down(d, &out, q.len()), v)
}

#[test]
fn lazy_kv_fill_matches_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(6);
    let (nh, hd, dm, n_pos) = (6, 16, 288, 10);
    let inputs: Vec<Vec<f32>> = (0..n_pos).map(|_| randv(&mut r, dm)).collect();
    // Head 0 missed every position, 1 several, 2 and 5 one, 4 none (not selected: 3).
    let valid0 = [0, 3, 9, 2, 10, 9];
    let heads = [5, 0, 2, 1];
    // Small queries: a smooth softmax, so that an f16 rounding of a key moves the output little.
    let q: Vec<f32> = randv(&mut r, heads.len() * hd)
        .iter()
        .map(|v| 0.05 * v)
        .collect();
    for qt in [QuantType::F16, QuantType::Q8_0] {
        let (bk, bv) = (
            random_matrix(&mut r, qt, nh * hd, dm),
            random_matrix(&mut r, qt, nh * hd, dm),
        );
        let wk = Weight::new(qt, nh * hd, dm, &bk).unwrap();
        let wv = Weight::new(qt, nh * hd, dm, &bv).unwrap();
        let f: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 + 7.0 * i as f32 / (hd / 2) as f32)
            .collect();
        for rope in [
            None,
            Some((10000.0, RopeStyle::Interleaved, None)),
            Some((500.0, RopeStyle::Neox, None)),
            Some((500.0, RopeStyle::Neox, Some(&f[..]))),
        ] {
            let want = kv_fill_on(&host, [&wk, &wv], &inputs, &valid0, &heads, rope, &q);
            let got = kv_fill_on(&gpu, [&wk, &wv], &inputs, &valid0, &heads, rope, &q);
            close(&format!("lazy K/V {qt:?} {rope:?}"), &got.0, &want.0, |i| {
                2e-3 * (1.0 + want.0[i].abs())
            });
            assert_eq!(got.1, want.1, "validity after the fill");
            assert_eq!(
                got.1,
                [10, 10, 10, 2, 10, 10],
                "selected heads valid through pos"
            );
        }
    }
}

/// Selections of rows of one buffer of scores (a step of several sequences' predictors, one
/// row each) in one launch, short rows (one block) and long ones (the histogram pass): each
/// the `k` largest of its own row, on the GPU and on the host (distinct random scores, so the
/// set is unique); a row past the buffer is an error.
#[test]
fn top_k_of_a_row_of_scores_is_that_rows() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(6);
    for (n, k) in [(40, 20), (3000, 300)] {
        let s = randv(&mut r, 3 * n);
        let want: Vec<Vec<u32>> = (0..3)
            .map(|row| {
                let mut i: Vec<u32> = (0..n as u32).collect();
                i.sort_by(|a, b| s[row * n + *b as usize].total_cmp(&s[row * n + *a as usize]));
                let mut top = i[..k].to_vec();
                top.sort_unstable();
                top
            })
            .collect();
        fn on<D: Device>(d: &D, s: &[f32], n: usize, k: usize) -> Vec<Vec<u32>> {
            let sb = d.upload(s).unwrap();
            let mut outs: Vec<D::Idx> =
                (0..3).map(|_| d.upload_idx(&vec![0; k]).unwrap()).collect();
            let mut jobs: Vec<TopK<D>> = (outs.iter_mut().enumerate())
                .map(|(i, out)| TopK {
                    scores: &sb,
                    row: 2 - i,
                    n,
                    k,
                    out,
                })
                .collect();
            d.top_ks(&mut jobs).unwrap();
            let mut past = d.upload_idx(&vec![0; k]).unwrap();
            let bad = TopK {
                scores: &sb,
                row: 3,
                n,
                k,
                out: &mut past,
            };
            assert!(d.top_ks(&mut [bad]).is_err(), "a row past the scores");
            (outs.iter().rev())
                .map(|o| {
                    let mut v = vec![0; k];
                    d.download_idx(o, &mut v).unwrap();
                    v.sort_unstable();
                    v
                })
                .collect()
        }
        assert_eq!(on(&host, &s, n, k), want, "host, rows of {n}");
        assert_eq!(on(&gpu, &s, n, k), want, "GPU, rows of {n}");
    }
}

/// A layer's predictors in two product launches and one top-k launch: the second layers each
/// read their own input, and the three selections run as one launch's three blocks.
#[test]
fn predictor_launches_match_the_scalar_reference() {
    let Some(gpu) = gpu() else { return };
    let host = CpuDevice::reference();
    let mut r = rng(5);
    let (d, rank) = (992, 96);
    let outs = [(28672, 2867), (56, 28), (1500, 700)];
    let x = randv(&mut r, d);
    let q = QuantType::Q8_0;
    let b1: Vec<Vec<u8>> = (0..3).map(|_| random_matrix(&mut r, q, rank, d)).collect();
    let b2: Vec<Vec<u8>> = (outs.iter())
        .map(|&(n, _)| random_matrix(&mut r, q, n, rank))
        .collect();
    let w1: Vec<Weight> = (b1.iter())
        .map(|b| Weight::new(q, rank, d, b).unwrap())
        .collect();
    let w2: Vec<Weight> = (b2.iter().zip(outs))
        .map(|(b, (n, _))| Weight::new(q, n, rank, b).unwrap())
        .collect();
    /// Each predictor's scores, and its selected set (sorted).
    type Picks = (Vec<Vec<f32>>, Vec<Vec<u32>>);
    fn on<D: Device>(
        d: &D,
        x: &[f32],
        w1: &[Weight],
        w2: &[Weight],
        outs: &[(usize, usize)],
    ) -> Picks {
        let (mut scores, mut sets) = (Vec::new(), Vec::new());
        let xb = d.upload(x).unwrap();
        let m1: Vec<D::Mat> = w1.iter().map(|w| d.upload_mat(w).unwrap()).collect();
        let m2: Vec<D::Mat> = w2.iter().map(|w| d.upload_mat(w).unwrap()).collect();
        let mut z: Vec<D::Buf> = (0..3).map(|_| d.zeros(w1[0].rows).unwrap()).collect();
        let mut s: Vec<D::Buf> = outs.iter().map(|o| d.zeros(o.0).unwrap()).collect();
        let mut idx: Vec<D::Idx> = outs
            .iter()
            .map(|o| d.upload_idx(&vec![0; o.1]).unwrap())
            .collect();
        let mut p1: Vec<Product<D>> = (m1.iter().zip(z.iter_mut()))
            .map(|(m, z)| Product::new(m, Rows::All, z))
            .collect();
        d.matvecs(&xb, &mut p1).unwrap();
        let mut p2: Vec<Product<D>> = (m2.iter().zip(&z).zip(s.iter_mut()))
            .map(|((m, z), s)| Product::new(m, Rows::All, s).input(z))
            .collect();
        d.matvecs(&xb, &mut p2).unwrap();
        let mut t: Vec<TopK<D>> = (s.iter().zip(idx.iter_mut()).zip(outs))
            .map(|((scores, out), &(n, k))| TopK {
                scores,
                row: 0,
                n,
                k,
                out,
            })
            .collect();
        d.top_ks(&mut t).unwrap();
        for ((sb, ib), &(n, k)) in s.iter().zip(&idx).zip(outs) {
            scores.push(down(d, sb, n));
            let mut v = vec![0; k];
            d.download_idx(ib, &mut v).unwrap();
            v.sort_unstable();
            sets.push(v);
        }
        (scores, sets)
    }
    let (want_s, want_i) = on(&host, &x, &w1, &w2, &outs);
    let (got_s, got_i) = on(&gpu, &x, &w1, &w2, &outs);
    for j in 0..3 {
        let scale = 1e-4 * (1.0 + want_s[j].iter().fold(0f32, |m, v| m.max(v.abs())));
        close(
            &format!("predictor {j} scores"),
            &got_s[j],
            &want_s[j],
            |_| scale,
        );
        // Sets from the GPU's own scores: its k-th largest against the host's differ only at
        // near-ties; compare each set's smallest chosen score with the k-th largest.
        let mut sorted = got_s[j].clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[outs[j].1 - 1];
        assert!(
            got_i[j].iter().all(|&i| got_s[j][i as usize] >= kth),
            "predictor {j}: a chosen score below the k-th largest"
        );
        let mut distinct = got_i[j].clone();
        distinct.dedup();
        assert_eq!(distinct.len(), outs[j].1, "predictor {j}: distinct indices");
        let agree = got_i[j]
            .iter()
            .filter(|i| want_i[j].binary_search(i).is_ok())
            .count();
        assert!(
            agree as f64 >= 0.99 * outs[j].1 as f64,
            "predictor {j}: {agree} of {} agree with the host",
            outs[j].1
        );
    }
}

#[test]
fn bad_sizes_are_errors_not_faults() {
    let Some(gpu) = gpu() else { return };
    let x = gpu.upload(&[1.0; 8]).unwrap();
    let w_bytes = vec![0u8; 4 * 16 * 4];
    let m = gpu
        .upload_mat(&Weight::new(QuantType::F32, 4, 16, &w_bytes).unwrap())
        .unwrap();
    let mut y = gpu.zeros(4).unwrap();
    assert!(
        gpu.matvec(&m, Rows::All, &x, None, &mut y, false).is_err(),
        "short input"
    );
    let idx = gpu.upload_idx(&[0, 1]).unwrap();
    let rows = Rows::Sel {
        idx: &idx,
        count: 3,
        group: 1,
    };
    let x16 = gpu.upload(&[1.0; 16]).unwrap();
    assert!(
        gpu.matvec(&m, rows, &x16, None, &mut y, false).is_err(),
        "short list"
    );
    let mut o = gpu.upload_idx(&[0; 2]).unwrap();
    assert!(gpu.top_k(&x, 8, 3, &mut o).is_err(), "short top-k output");
    assert!(
        gpu.write_idx(&mut o, &[1, 2, 3]).is_err(),
        "write past a list"
    );
}
