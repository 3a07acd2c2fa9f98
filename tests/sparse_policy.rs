//! Sparsity policies, the sparse layout and the output preview on the tiny crafted model:
//! a dense policy is the dense model bit for bit; sparse MLP and head sets through the sparse
//! layout equal the masked dense model; the output preview at full rank reproduces the dense
//! logits; predictors survive a save and load; lookahead changes timing, not output; bad specs
//! are rejected.
mod common;
use common::*;
use dejavu::exec::{DevicePlan, Logits};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::predictors_file::Predictors;
use dejavu::sparsity::{LayerPlan, SparsePlan};
use dejavu::tune::calibrate::{calibrate, CalibrateOptions};
use dejavu_backend_api::IndexSet;
use dejavu_backend_cpu::device::CpuDevice;
use rand::{seq::index::sample, SeedableRng};

const TOKENS: [u32; 8] = [72, 101, 108, 108, 111, 33, 10, 84];

/// A model file in its own temporary directory (the layout cache is written beside it).
fn tiny(bytes: &[u8]) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, bytes).unwrap();
    let e = Engine::load(
        &path,
        &EngineOptions {
            threads: Some(2),
            n_ctx: None,
            ..Default::default()
        },
    )
    .unwrap();
    (dir, e)
}

/// The logits of every token of [`TOKENS`], fed one at a time, on `e`'s CPU device.
fn decode(e: &Engine, plan: DevicePlan<CpuDevice>) -> Vec<f32> {
    let mut s = e.session(plan).unwrap();
    (TOKENS.iter())
        .flat_map(|&t| s.run(&[t], Logits::Last).unwrap().to_vec())
        .collect()
}

fn fixed(e: &Engine, plan: &SparsePlan) -> DevicePlan<CpuDevice> {
    e.fixed_plan(plan).unwrap()
}

#[test]
fn dense_policy_is_the_dense_plan_bitwise() {
    let (_d, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let c = &e.model.config;
    let pol = e.policy("dense", None).unwrap();
    assert!(pol.is_dense());
    for spec in ["gate-first:1.0", "oracle:1", "up-first:1.0"] {
        assert!(e.policy(spec, None).unwrap().is_dense(), "{spec}");
    }
    assert_eq!(
        decode(&e, e.plan(&pol).unwrap()),
        decode(&e, fixed(&e, &SparsePlan::dense(c)))
    );
}

/// The sparse layout is converted once into dejavu's cache directory (never the model's own)
/// and found there by the next engine; a random plan runs through it. (That a plan through the
/// layout equals the masked dense model is tests/sparse_plan.rs.)
#[test]
fn the_sparse_layout_is_cached_once_in_dejavus_directory() {
    let (dir, e) = tiny(&tiny_f32_down());
    let c = e.model.config.clone();
    let layout = e.sparse_layout().unwrap();
    let cached = layout.path.clone().expect("layout cached");
    // In dejavu's cache directory, never in the model's own (issue 23).
    let home = dejavu::fetch::home_dir().join("layouts");
    assert!(cached.starts_with(&home) && cached.exists(), "{cached:?}");
    assert!(!cached.starts_with(dir.path()));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut subset = |n: usize, keep: usize| {
        let idx = sample(&mut rng, n, keep)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        IndexSet::from_unsorted(n, idx).unwrap()
    };
    let layers = (0..c.n_layers)
        .map(|_| LayerPlan::new(&c, subset(c.n_ff, 1), subset(c.n_heads, 1)).unwrap())
        .collect();
    let plan = SparsePlan::new(&c, layers).unwrap();
    assert!(decode(&e, fixed(&e, &plan)).iter().all(|v| v.is_finite()));
    // A second engine finds the cached layout instead of converting again.
    let (_d2, e2) = (
        dir,
        Engine::load(e.model.path.clone(), &EngineOptions::default()).unwrap(),
    );
    assert_eq!(e2.sparse_layout().unwrap().path.as_ref(), Some(&cached));
}

#[test]
fn mlp_rules_keep_what_they_say() {
    let (_d, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let c = &e.model.config;
    let dense = decode(&e, fixed(&e, &SparsePlan::dense(c)));
    for spec in [
        "gate-first:0.5",
        "up-first:0.5",
        "oracle:0.5",
        "gate-first:0.5:1",
        "gate-first:0.5+attn-norm:0.5",
    ] {
        let pol = e.policy(spec, None).unwrap();
        let mut session = e.decoder(&pol).unwrap();
        session.run(&TOKENS[..3], Logits::Last).unwrap();
        let batch = session.batch_step();
        assert_eq!(batch.mlp_kept, batch.mlp_total, "{spec}: batches run dense");
        let logits = session.run(&[TOKENS[3]], Logits::Last).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()));
        let s = session.last_step().unwrap();
        let sparse_layers = if spec.ends_with(":1") {
            c.n_layers - 2
        } else {
            c.n_layers
        };
        assert_eq!(
            s.mlp_kept,
            sparse_layers * c.n_ff / 2 + (c.n_layers - sparse_layers) * c.n_ff,
            "{spec}"
        );
        let heads = if spec.contains("attn-norm:0.5") {
            c.n_heads / 2
        } else {
            c.n_heads
        };
        assert_eq!(s.heads_kept, c.n_layers * heads, "{spec}");
        assert!(
            s.weight_bytes < batch.weight_bytes || spec.ends_with(":1"),
            "{spec}"
        );
        // The tiny model has 2 layers: EDGE 1 keeps both dense.
        let same = decode(&e, e.plan(&pol).unwrap()) == dense;
        assert_eq!(same, sparse_layers == 0, "{spec}");
    }
}

fn calibrated(e: &Engine) -> Predictors {
    let text =
        "The quick brown fox jumps over the lazy dog. fn main() { println!(\"hi\"); } ".repeat(6);
    let tokens = e.tokenizer.encode(&text).unwrap();
    let opts = CalibrateOptions {
        ctx: 32,
        rank: 64,
        no_search: true,
        ..Default::default()
    };
    calibrate(e, e, &tokens, "test text", &[], &opts, |_| {})
        .unwrap()
        .0
}

#[test]
fn full_rank_output_preview_reproduces_dense_logits() {
    let (dir, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let c = &e.model.config;
    let preds = calibrated(&e);
    let out = dir.path().join("p.safetensors");
    preds.save(&out, &e.model).unwrap();
    let loaded = e.predictors(Some(&out)).unwrap().unwrap();
    assert_eq!(loaded.output.as_ref().unwrap().rank, 64);
    let dense = decode(&e, fixed(&e, &SparsePlan::dense(c)));
    // Rank 64 = d_model: the preview is E itself up to its 8-bit table, so every logit is close
    // and the exact candidates are exact.
    let pol = e.policy("head:64:16", Some(&loaded)).unwrap();
    let got = decode(&e, e.plan(&pol).unwrap());
    let scale = dense.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (a, b) in got.iter().zip(&dense) {
        assert!((a - b).abs() <= 0.03 * scale, "{a} vs {b}");
    }
    for (g, d) in got.chunks(c.vocab_size).zip(dense.chunks(c.vocab_size)) {
        let am = |x: &[f32]| dejavu::eval::perplexity::argmax(x);
        assert_eq!(am(g), am(d));
        assert_eq!(
            g[am(d)],
            d[am(d)],
            "the top token's logit is computed exactly"
        );
    }
    // A lower rank is a prefix of the stored one; ranks not in it are refused.
    assert!(e.policy("head:32:16", Some(&loaded)).is_ok());
    assert!(e.policy("head:96:16", Some(&loaded)).is_err());
    assert!(e.policy("head:40:16", Some(&loaded)).is_err());
}

#[test]
fn predictors_are_tied_to_their_model() {
    let (dir, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let out = dir.path().join("p.safetensors");
    calibrated(&e).save(&out, &e.model).unwrap();
    // Another model file (different size) rejects them.
    let (_d2, other) = tiny(&tiny_f32_down());
    let err = other
        .predictors(Some(&out))
        .err()
        .expect("rejected")
        .to_string();
    assert!(err.contains("another model"), "{err}");
    // A file that is not a predictors file.
    std::fs::write(dir.path().join("junk.safetensors"), b"not safetensors").unwrap();
    assert!(e
        .predictors(Some(&dir.path().join("junk.safetensors")))
        .is_err());
}

#[test]
fn bad_specs_are_rejected() {
    let (_d, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let c = &e.model.config;
    for spec in [
        "sparse",
        "gate-first",
        "gate-first:0",
        "gate-first:1.5",
        "gate-first:x",
        "gate-first:0.5:2",
        "gate-first:0.5+up-first:0.5",
        "attn-norm:0.5+attn-norm:0.7",
        "attn-norm:2",
        "dejavu-attn:0.5",
        "lookahead",
        "lookahead:1+dejavu:0.5",
        "head:64:16",
        "recommended",
    ] {
        let err = Policy::parse(spec, c, None).err();
        assert!(err.is_some(), "{spec} accepted");
        assert!(err.unwrap().to_string().contains("--sparsity"), "{spec}");
    }
}

fn run_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .output()
        .unwrap()
}

/// Run `dejavu args...`, assert it succeeded, return its stdout.
fn cli_ok(args: &[&str]) -> String {
    let out = run_cli(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `calibrate` writes predictors next to the model with a recommended setting, which
/// `generate`, `perplexity` and `bench` then use; bad specs exit 1 with a message.
#[test]
fn cli_calibrate_then_use() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    std::fs::write(&model, tiny_llama_gguf(|_, _| {})).unwrap();
    let m = model.to_str().unwrap();
    let data = dir.path().join("text.txt");
    let text =
        "Sparse models skip work. The cat sat on the mat. let x = vec![1, 2, 3];\n".repeat(40);
    std::fs::write(&data, &text).unwrap();
    let stdout = cli_ok(&[
        "calibrate",
        "-m",
        m,
        "--data",
        data.to_str().unwrap(),
        "--sample-tokens",
        "0",
        "--rank",
        "32",
        "--ctx",
        "32",
        "--validation-tokens",
        "64",
    ]);
    let preds = Predictors::default_path(&dejavu::model::weights::Model::load(&model).unwrap());
    assert!(
        preds.exists() && stdout.contains("recommended:"),
        "{stdout}"
    );

    cli_ok(&[
        "generate",
        "-m",
        m,
        "--prompt",
        "The cat",
        "-n",
        "4",
        "--temperature",
        "0",
        "--sparsity",
        "recommended",
    ]);
    let stdout = cli_ok(&[
        "perplexity",
        "-m",
        m,
        "--file",
        data.to_str().unwrap(),
        "--ctx",
        "32",
        "--chunks",
        "2",
        "--sparsity",
        "gate-first:0.5+head:32:8",
    ]);
    for key in [
        "ppl dense",
        "ppl sparse",
        "kl(dense || sparse)",
        "top-1 agreement",
        "MLP density 0.500",
    ] {
        assert!(stdout.contains(key), "{key} missing: {stdout}");
    }
    let stdout = cli_ok(&[
        "bench",
        "-m",
        m,
        "-t",
        "1",
        "-p",
        "0",
        "-n",
        "4",
        "-r",
        "1",
        "--sparsity",
        "dense,gate-first:0.5,head:32:8",
    ]);
    assert!(
        stdout.contains("| gate-first:0.5 |") && stdout.contains("| head:32:8 |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| 1.00x |"),
        "dense speedup column: {stdout}"
    );

    let docs = dir.path().join("docs");
    let stdout = cli_ok(&[
        "report",
        "-m",
        m,
        "--file",
        data.to_str().unwrap(),
        "--ctx",
        "32",
        "--chunks",
        "2",
        "--out",
        docs.to_str().unwrap(),
    ]);
    assert!(
        stdout.contains("| oracle:0.5 |") && stdout.contains("| recommended ("),
        "{stdout}"
    );
    for ext in ["md", "json"] {
        assert!(docs.join(format!("tiny.frontier.{ext}")).exists(), "{ext}");
    }

    for (spec, needle) in [("gate-first:2", "KEEP"), ("nonsense", "unknown part")] {
        let out = run_cli(&[
            "generate",
            "-m",
            m,
            "--prompt",
            "x",
            "-n",
            "1",
            "--sparsity",
            spec,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{spec}: {err}");
        assert!(
            err.contains("error:") && err.contains(needle) && !err.contains("panicked"),
            "{err}"
        );
    }
    std::fs::remove_file(&preds).unwrap();
    let out = run_cli(&[
        "generate",
        "-m",
        m,
        "--prompt",
        "x",
        "-n",
        "1",
        "--sparsity",
        "recommended",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("dejavu calibrate"), "{err}");
}

/// Calibration trains one MLP and one head predictor per layer; they survive a save and load and
/// drive the `dejavu` and `dejavu-attn` rules, which keep exactly their budgets; lookahead (on
/// the spare thread, or inline without one) gives the same logits and sets as without it.
#[test]
fn dejavu_predictors_round_trip() {
    let (dir, e) = tiny(&tiny_llama_gguf(|_, _| {}));
    let c = &e.model.config;
    let preds = calibrated(&e);
    assert_eq!(preds.mlp.len(), c.n_layers);
    assert_eq!(preds.heads.len(), c.n_layers);
    assert!(preds.metadata.contains_key("mlp_recall"));
    assert!(preds.metadata.contains_key("head_recall"));
    let out = dir.path().join("p.safetensors");
    preds.save(&out, &e.model).unwrap();
    let loaded = e.predictors(Some(&out)).unwrap().unwrap();
    assert_eq!(loaded.mlp.len(), c.n_layers);
    for (a, b) in preds.mlp.iter().zip(loaded.mlp.iter()) {
        assert_eq!((a.w1().data, a.w2().data), (b.w1().data, b.w2().data));
    }
    for (a, b) in preds.heads.iter().zip(loaded.heads.iter()) {
        assert_eq!((a.w1().data, a.w2().data), (b.w1().data, b.w2().data));
    }
    let spec = "dejavu:0.5+dejavu-attn:0.5";
    let pol = e.policy(spec, Some(&loaded)).unwrap();
    let ahead = e
        .policy(&format!("{spec}+lookahead"), Some(&loaded))
        .unwrap();
    assert!(pol.uses_predictors() && ahead.lookahead);
    // Prompt, then single-token steps; logits and kept counts of every step.
    let steps = |pol: &Policy| {
        let mut session = e.decoder(pol).unwrap();
        let mut out = Vec::new();
        session.run(&TOKENS[..2], Logits::Last).unwrap();
        for &t in &TOKENS[2..] {
            out.push(session.run(&[t], Logits::Last).unwrap().to_vec());
            let s = session.last_step().unwrap();
            assert_eq!(s.mlp_kept, c.n_layers * c.n_ff / 2);
            assert_eq!(s.heads_kept, c.n_layers * c.n_heads / 2);
            assert!(s.bytes.predictors > 0);
            out.push(vec![s.weight_bytes as f32]);
        }
        out
    };
    assert_eq!(steps(&ahead), steps(&pol), "lookahead");
    // Without the predictors the rules are refused; lookahead needs a learned rule.
    let mut none = loaded;
    none.mlp = Vec::new().into();
    none.heads = Vec::new().into();
    assert!(e.policy("dejavu:0.5", Some(&none)).is_err());
    assert!(e.policy("dejavu-attn:0.5", Some(&none)).is_err());
    assert!(e.policy("gate-first:0.5+lookahead", Some(&none)).is_err());
}
