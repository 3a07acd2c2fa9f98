//! Synthetic models (`synthetic:NAME`): built at the published shape, the sparse layout's
//! transposes are the model's own matrices, every output says synthetic, quality commands refuse,
//! and `--sparsity paper` runs its real selection path on them.
use dejavu::exec::{BlockTimes, Logits};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::synthetic::SyntheticOptions;
use dejavu::quantize::mix::FileType;
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::{HeadRule, MlpRule};
use dejavu_backend_api::QuantType;
use std::process::Command;

/// The largest `|a - b|`, and the largest `|a|` (the scale it is judged against).
fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (diff, a.iter().fold(0f32, |m, v| m.max(v.abs())))
}

fn engine(dtype: FileType) -> Engine {
    let opts = EngineOptions {
        threads: Some(2),
        n_ctx: Some(64),
        synthetic: SyntheticOptions {
            dtype,
            ..Default::default()
        },
        ..Default::default()
    };
    Engine::load("synthetic:opt-125m", &opts).unwrap()
}

#[test]
fn builds_at_the_published_shape_and_says_synthetic() {
    let e = engine(FileType::Q8_0);
    let c = &e.model.config;
    assert_eq!(
        (c.n_layers, c.d_model, c.n_ff, c.n_heads, c.vocab_size),
        (12, 768, 3072, 12, 50272)
    );
    assert!(e.model.label().contains("synthetic"), "{}", e.model.label());
    assert_eq!(e.model.layers[3].w_up.qtype, QuantType::Q8_0);
    let dense = e
        .fixed_plan(&dejavu::sparsity::SparsePlan::dense(c))
        .unwrap();
    let mut s = e.session(dense).unwrap();
    let logits = s.run(&[5, 6, 7], Logits::Last).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
    // Random weights at N(0, 0.02): not all logits equal.
    assert!(logits.iter().any(|&v| v != logits[0]));
}

/// Row j of the generated neuron-major down projection is column j of the model's (each
/// quantized along its own axis, so equal within the two rounding steps); likewise W_o.
#[test]
fn layout_is_the_transpose_of_the_model() {
    for dtype in [FileType::Q8_0, FileType::F16] {
        let e = engine(dtype);
        let (m, b) = (&e.model, e.backend());
        let lay = e.sparse_layout().unwrap();
        let l = 4;
        for (src, t) in [
            (&m.layers[l].w_down, lay.down_t(l)),
            (&m.layers[l].wo, lay.wo_t(l)),
        ] {
            let w = m.weight(src);
            assert_eq!((t.rows, t.cols), (w.cols, w.rows));
            let mut row = vec![0f32; w.cols];
            let mut trow = vec![0f32; t.cols];
            for r in [0, 1, 377, w.rows - 1] {
                b.dequantize_row(&w, r, &mut row);
                for j in [0, 5, w.cols / 2, w.cols - 1] {
                    b.dequantize_row(&t, j, &mut trow);
                    // |w| <= 0.02 * 3.46; Q8_0 steps are at most 0.07 / 127 per side.
                    let tol = if dtype == FileType::F16 { 1e-4 } else { 1.2e-3 };
                    assert!(
                        (trow[r] - row[j]).abs() <= tol,
                        "{dtype:?} {}: [{r}][{j}] {} vs {}",
                        src.name,
                        row[j],
                        trow[r]
                    );
                }
            }
        }
    }
}

/// `--dtype q4_k_m` is llama-quantize's Q4_K_M: the head (OPT's, tied to the token embedding)
/// in Q6_K, `attn_v` and `ffn_down` in Q6_K in the first and last eighth of the layers and every
/// third between, every other matrix in Q4_K; it decodes dense and under `teal:0.5:always`
/// (input blocks of the K-quants), reading fewer bytes.
#[test]
fn k_quant_mixes_are_llama_quantizes() {
    let e = engine(FileType::Q4KM);
    let m = &e.model;
    assert!(m.label().contains("q4_k_m"), "{}", m.label());
    assert_eq!(m.token_embd.qtype, QuantType::Q6K);
    // 12 layers: `more` is layer 0 (below n/8 = 1), 10 and 11 (from 7n/8 = 10), and every
    // third from 1 + 2: 3, 6, 9.
    for (l, layer) in m.layers.iter().enumerate() {
        let more = [0, 3, 6, 9, 10, 11].contains(&l);
        let six = if more { QuantType::Q6K } else { QuantType::Q4K };
        assert_eq!(
            (layer.wv.qtype, layer.w_down.qtype),
            (six, six),
            "layer {l}"
        );
        for w in [&layer.wq, &layer.wk, &layer.wo, &layer.w_up] {
            assert_eq!(w.qtype, QuantType::Q4K, "layer {l} {}", w.name);
        }
    }
    let preds = e.predictors(None).unwrap().unwrap();
    let teal = e.policy("teal:0.5:always", Some(&preds)).unwrap();
    let dense = Policy::dense(&m.config);
    let mut bytes = Vec::new();
    for pol in [&dense, &teal] {
        let mut s = e.decoder(pol).unwrap();
        s.run(&[5, 6, 7], Logits::Last).unwrap();
        let out = s.run(&[8], Logits::Last).unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        assert!(out.iter().any(|&v| v != out[0]));
        bytes.push(s.last_step().unwrap().weight_bytes);
    }
    assert!(bytes[1] < bytes[0], "{bytes:?}");
}

#[test]
fn paper_policy_runs_its_selection_on_synthetic_predictors() {
    let e = engine(FileType::Q8_0);
    let preds = e.predictors(None).unwrap().expect("synthetic predictors");
    let pol = e.policy("paper", Some(&preds)).unwrap();
    assert_eq!(pol.mlp[0], MlpRule::Dense);
    assert_eq!(pol.heads[0], HeadRule::Dense);
    assert!(pol.lookahead);
    assert_eq!(pol.kv, dejavu::sparsity::KvRule::All);
    for l in 1..12 {
        assert_eq!(pol.mlp[l], MlpRule::LowRank { keep: 0.1 });
        assert_eq!(pol.heads[l], HeadRule::LowRank { keep: 0.5 });
    }
    let mut s = e.decoder(&pol).unwrap();
    s.run(&[1, 2], Logits::Last).unwrap();
    let out = s.run(&[3], Logits::Last).unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
    let st = s.last_step().unwrap();
    // Layer 0 dense, 11 layers at 10% of 3072 neurons and 6 of 12 heads.
    assert_eq!(st.mlp_kept, 3072 + 11 * 307);
    assert_eq!(st.heads_kept, 12 + 11 * 6);
    assert!(st.weight_bytes < e.model.dense_bytes_per_token());
    let mut t = BlockTimes::default();
    s.profile(&[4], &mut t).unwrap();
    assert!(t.mlp > 0.0 && t.attention > 0.0 && t.output > 0.0 && t.predict > 0.0);
}

#[test]
fn quality_commands_refuse_and_bad_names_are_errors() {
    let e = engine(FileType::Q4_0);
    let mut dense = e.decoder(&Policy::dense(&e.model.config)).unwrap();
    let err = dejavu::eval::perplexity::perplexity(
        &e,
        &mut dense,
        &[1; 64],
        16,
        dejavu::eval::perplexity::Feed::Batch,
        |_, _, _| {},
    )
    .expect_err("perplexity must refuse");
    assert!(err.to_string().contains("real weights"), "{err}");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = run(&["bench", "-m", "synthetic:opt-7b", "-n", "1", "-p", "0"]);
    assert!(
        !ok && err.contains("unknown synthetic model") && err.contains("opt-6.7b"),
        "{err}"
    );
    let (ok, err) = run(&[
        "bench",
        "-m",
        "synthetic:opt-125m",
        "--dtype",
        "q4_1",
        "-n",
        "1",
    ]);
    assert!(
        !ok && err.contains("expected one of f16, bf16, q8_0, q4_0, q4_k_s, q4_k_m"),
        "{err}"
    );
    let (ok, err) = run(&["perplexity", "-m", "synthetic:opt-125m", "-f", "Cargo.toml"]);
    assert!(!ok && err.contains("real weights"), "{err}");
}

/// Lazy K/V computes keys and values for the selected heads only and recomputes what a head
/// missed when it is selected again: the logits equal those of computing every head's K/V
/// under the same head selection (within the batched kernels' rounding), with fewer bytes; and a
/// batch (every unit) after truncating fills every hole.
#[test]
fn lazy_kv_equals_full_kv_with_fewer_bytes() {
    let e = engine(FileType::F16);
    let preds = e.predictors(None).unwrap().unwrap();
    let full = e.policy("dejavu-attn:0.5", Some(&preds)).unwrap();
    let lazy = e.policy("dejavu-attn:0.5+lazy-kv", Some(&preds)).unwrap();
    let (mut cf, mut cl) = (e.decoder(&full).unwrap(), e.decoder(&lazy).unwrap());
    let tokens: Vec<u32> = (0..24).map(|i| (i * 977 + 13) % 50000).collect();
    cf.run(&tokens[..4], Logits::Last).unwrap();
    cl.run(&tokens[..4], Logits::Last).unwrap();
    for &t in &tokens[4..] {
        let a = cf.run(&[t], Logits::Last).unwrap().to_vec();
        let b = cl.run(&[t], Logits::Last).unwrap().to_vec();
        let (diff, scale) = max_diff(&a, &b);
        assert!(
            diff <= 2e-3 * scale,
            "step at {}: max diff {diff} of {scale}",
            cl.len()
        );
        let (sf, sl) = (cf.last_step().unwrap(), cl.last_step().unwrap());
        assert_eq!(sf.heads_kept, sl.heads_kept);
        assert!(
            sl.weight_bytes < sf.weight_bytes,
            "at {}: {} vs {}",
            cl.len(),
            sl.weight_bytes,
            sf.weight_bytes
        );
    }
    // Truncate into the lazily filled part, then a batch on both (every unit): every hole of the
    // lazy cache is recomputed (the same history, so the same logits as the complete cache).
    cl.truncate(15);
    cf.truncate(15);
    let got = cl.run(&tokens[15..20], Logits::Last).unwrap().to_vec();
    let want = cf.run(&tokens[15..20], Logits::Last).unwrap().to_vec();
    let (diff, scale) = max_diff(&want, &got);
    assert!(
        diff <= 2e-3 * scale,
        "after truncate: max diff {diff} of {scale}"
    );
}

#[test]
fn lazy_kv_needs_multi_head_attention_and_a_head_rule() {
    let e = engine(FileType::Q8_0);
    let preds = e.predictors(None).unwrap().unwrap();
    let err = e.policy("dejavu:0.1+lazy-kv", Some(&preds)).err().unwrap();
    assert!(err.to_string().contains("needs a head rule"), "{err}");
    // `paper+lazy-kv` is the paper's plan with lazy K/V; `paper` takes nothing else.
    let pol = e.policy("paper+lazy-kv", Some(&preds)).unwrap();
    assert_eq!(pol.kv, dejavu::sparsity::KvRule::Lazy);
    assert_eq!(pol.heads[0], HeadRule::Dense);
    assert_eq!(pol.heads[1], HeadRule::LowRank { keep: 0.5 });
    let err = e.policy("paper+dejavu:0.2", Some(&preds)).err().unwrap();
    assert!(err.to_string().contains("only `+lazy-kv`"), "{err}");
}

/// `report --speed` writes a row per density (dense first) with the measured MLP density, and
/// `bench --json` carries per-block figures that tell the blocks apart.
#[test]
fn speed_report_and_per_block_bench() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let out = dir.path().to_str().unwrap();
    let base = ["-m", "synthetic:opt-125m", "--dtype", "q8_0", "-t", "2"];
    let mut a = vec![
        "report",
        "--speed",
        "--densities",
        "0.5",
        "--n-gen",
        "2",
        "--out",
        out,
    ];
    a.extend(base);
    run(&a);
    let speed = dir.path().join("synthetic-opt-125m.speed.json");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&speed).unwrap()).unwrap();
    assert_eq!(report["rule"], "dejavu");
    assert!(report["backend"].as_str().unwrap().starts_with("cpu"));
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["mlp_density"].as_f64().unwrap(), 1.0);
    assert_eq!(rows[1]["density"].as_f64().unwrap(), 0.5);
    assert!((rows[1]["mlp_density"].as_f64().unwrap() - 0.5).abs() < 0.01);
    assert!(rows[1]["mlp_ms"].as_f64().unwrap() > 0.0);
    // The map of that report: a table row with its speedup at 0.5 (and the plot where a font is).
    run(&[
        "report",
        "--speed-map",
        speed.to_str().unwrap(),
        "--out",
        out,
    ]);
    let map = std::fs::read_to_string(dir.path().join("speed-map.md")).unwrap();
    assert!(map.lines().next().unwrap().ends_with("| 0.5 |"), "{map}");
    assert!(map.contains("synthetic:opt-125m"), "{map}");
    let bench = dir.path().join("b.json");
    let mut a = vec![
        "bench",
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "--sparsity",
        "dense,paper",
    ];
    a.extend(base);
    a.extend(["--json", bench.to_str().unwrap()]);
    run(&a);
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(bench).unwrap()).unwrap();
    let mb = |r: &serde_json::Value, k: &str| r["blocks"][k]["mb"].as_f64().unwrap();
    for r in &rows {
        assert!(r["model"].as_str().unwrap().contains("synthetic"));
        assert!(r["blocks"]["attention"]["ms"].as_f64().unwrap() > 0.0);
    }
    let (dense, paper) = (&rows[0], &rows[1]);
    // Dense reads no predictors (only the step's embedding rows land there, a few KB); the
    // paper's plan reads its predictors and fewer MLP and attention bytes.
    assert!(mb(dense, "predictors") < 0.01, "{dense}");
    assert!(mb(paper, "predictors") > 0.1, "{paper}");
    assert!(mb(paper, "mlp") < 0.5 * mb(dense, "mlp"));
    assert!(mb(paper, "attention") < mb(dense, "attention"));
    assert_eq!(mb(paper, "output"), mb(dense, "output"));
}

/// `bench --batch` times steps of several sequences: a row per batch size with its aggregate
/// tok/s and its ratio to batch 1 (1 for batch 1 itself), as a table and as JSON, which
/// `--replot` draws, and `--plot`'s points; a batch of 0 is refused.
#[test]
fn bench_of_several_sequences_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("batch.json");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args([
                "bench",
                "-m",
                "synthetic:opt-125m",
                "--dtype",
                "q8_0",
                "-t",
                "2",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    let j = json.to_str().unwrap();
    let plot = dir.path().join("plot.png");
    let out = run(&[
        "--batch",
        "1,2,4",
        "-p",
        "8",
        "-n",
        "2",
        "-r",
        "1",
        "--json",
        j,
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| cpu")).count(),
        3,
        "{table}"
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let batches: Vec<u64> = rows.iter().map(|r| r["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, [1, 2, 4]);
    assert_eq!(rows[0]["vs_one"].as_f64(), Some(1.0));
    for r in &rows {
        assert!(r["step_ms"].as_f64().unwrap() > 0.0 && r["tok_per_s"].as_f64().unwrap() > 0.0);
    }
    // `--plot` keeps its points beside the PNG, font or not: the title and the same rows.
    let points: (String, Vec<serde_json::Value>) =
        serde_json::from_str(&std::fs::read_to_string(plot.with_extension("json")).unwrap())
            .unwrap();
    assert!(
        points.0.ends_with("steps of several sequences"),
        "{}",
        points.0
    );
    assert_eq!(points.1, rows);
    let out = run(&["--batch", "0,2", "-n", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch"));
    // The --json redraws elsewhere (`--replot`, a machine without fonts having kept it): the
    // table again, and the plot where a font is; a file of anything else is an error.
    let png = dir.path().join("batch.png");
    let replot = |from: &str| {
        let p = png.to_str().unwrap();
        Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(["bench", "--replot", from, "--plot", p])
            .output()
            .unwrap()
    };
    let out = replot(j);
    let (table, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| cpu")).count(),
        3,
        "{table}"
    );
    assert_eq!(out.status.success(), png.exists(), "{err}");
    assert!(out.status.success() || err.contains("font"), "{err}");
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "[1, 2]").unwrap();
    let out = replot(junk.to_str().unwrap());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the points"));
}
