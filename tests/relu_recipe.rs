//! The Deja Vu recipe on the tiny trained ReLU OPT (tests/fixtures/hf/opt-relu): the oracle's
//! nonzero set (exact, counting only selected rows), calibration with the paper's labels (the
//! nonzero neurons), per-layer budgets from the measured densities, and the rules' errors.
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::predictors_file::Predictors;
use dejavu::sparsity::{MlpRule, SparsePlan};
use dejavu::tune::calibrate::{train_predictors, CalibrateOptions};
use std::collections::HashMap;
use std::path::PathBuf;

fn load(name: &str) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name);
    Engine::load(dir, &EngineOptions::default()).unwrap()
}

fn eval_tokens(e: &Engine, n: usize) -> Vec<u32> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/eval.txt");
    let text = std::fs::read_to_string(p).unwrap();
    let mut t = e.tokenizer.encode_document(&text).unwrap();
    t.truncate(n);
    t
}

/// `oracle` (no KEEP) selects exactly the nonzero neurons: the dense logits, with fewer bytes
/// counted than `relu-exact` (which reads fc1 in full).
#[test]
fn oracle_is_exact_and_counts_only_its_rows() {
    let e = load("opt-relu");
    let (oracle, exact) = (
        e.policy("oracle", None).unwrap(),
        e.policy("relu-exact", None).unwrap(),
    );
    assert!(oracle.mlp.iter().all(|r| *r == MlpRule::OracleNonzero));
    let dense = SparsePlan::dense(&e.model.config);
    let mut cd = e.session(e.fixed_plan(&dense).unwrap()).unwrap();
    let (mut co, mut ce) = (e.decoder(&oracle).unwrap(), e.decoder(&exact).unwrap());
    for &t in &eval_tokens(&e, 24) {
        let want = cd.run(&[t], Logits::Last).unwrap().to_vec();
        let got = co.run(&[t], Logits::Last).unwrap().to_vec();
        ce.run(&[t], Logits::Last).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 1e-3, "logits differ by {worst}");
        let (so, se) = (co.last_step().unwrap(), ce.last_step().unwrap());
        assert_eq!(so.mlp_kept, se.mlp_kept);
        assert!(so.weight_bytes < se.weight_bytes, "{so:?} vs {se:?}");
    }
    // Only ReLU models, and only as the one MLP rule.
    let silu = load("llama-silu");
    let err = silu.policy("oracle", None).err().unwrap().to_string();
    assert!(err.contains("needs a ReLU MLP"), "{err}");
}

/// Calibration on a ReLU OPT labels the nonzero neurons: it measures each layer's density (layer
/// 0 much denser, as trained: ~30% against 3-7%), trains predictors whose held-out recall of the
/// nonzero set is far above chance (chance = the density), and `dejavu:auto` turns the densities
/// into per-layer budgets.
#[test]
fn calibration_uses_relu_labels_and_per_layer_budgets() {
    let e = load("opt-relu");
    let tokens = eval_tokens(&e, 2048);
    let opts = CalibrateOptions::default();
    let t = train_predictors(&e, &e, &tokens, 256, &opts.mlp, &opts.heads).unwrap();
    let c = &e.model.config;
    assert_eq!(t.mlp_density.len(), c.n_layers);
    assert!(t.mlp_density[0] > 0.15, "{:?}", t.mlp_density);
    for l in 1..c.n_layers {
        assert!(t.mlp_density[l] < 0.15, "{:?}", t.mlp_density);
        assert!(
            t.mlp_recall[l] > 4.0 * t.mlp_density[l],
            "layer {l}: recall {}",
            t.mlp_recall[l]
        );
    }
    let density: Vec<String> = t.mlp_density.iter().map(|d| d.to_string()).collect();
    let preds = Predictors {
        path: None,
        metadata: HashMap::from([("mlp_density".to_string(), density.join(","))]),
        output: None,
        mlp: t.mlp.into(),
        heads: t.heads.into(),
        inputs: None,
    };
    let pol = e.policy("dejavu:auto:2", Some(&preds)).unwrap();
    for (l, r) in pol.mlp.iter().enumerate() {
        let keep = (2.0 * t.mlp_density[l]).min(1.0) as f32;
        assert_eq!(*r, MlpRule::LowRank { keep }, "layer {l}");
    }
    let mut session = e.decoder(&pol).unwrap();
    for &tok in &tokens[..8] {
        let out = session.run(&[tok], Logits::Last).unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
    }
    let st = session.last_step().unwrap();
    let want: usize = (0..c.n_layers)
        .map(|l| {
            MlpRule::LowRank {
                keep: (2.0 * t.mlp_density[l]).min(1.0) as f32,
            }
            .kept(c.n_ff)
        })
        .sum();
    assert_eq!(st.mlp_kept, want);
    // Without stored densities `auto` is an error, not a guess.
    let bare = Predictors {
        metadata: HashMap::new(),
        ..preds
    };
    let err = e
        .policy("dejavu:auto", Some(&bare))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("per-layer densities"), "{err}");
}

/// `perplexity --json` writes the comparison the report and the closing notes quote.
#[test]
fn perplexity_json_has_the_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["perplexity", "-m"])
        .arg(fixtures.join("opt-relu"))
        .arg("-f")
        .arg(fixtures.join("eval.txt"))
        .args([
            "--ctx",
            "64",
            "--chunks",
            "2",
            "--sparsity",
            "relu-exact",
            "--json",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for key in [
        "ppl",
        "dense_ppl",
        "kl",
        "top1_agreement",
        "mlp_density",
        "head_density",
        "weight_bytes_per_token",
    ] {
        assert!(v[key].is_number(), "{key} missing: {v}");
    }
    // relu-exact is exact: the same perplexity, all of the top-1, a fraction of the neurons.
    assert!((v["ppl"].as_f64().unwrap() / v["dense_ppl"].as_f64().unwrap() - 1.0).abs() < 1e-4);
    assert_eq!(v["top1_agreement"].as_f64().unwrap(), 1.0);
    assert!(v["mlp_density"].as_f64().unwrap() < 0.3);
}
