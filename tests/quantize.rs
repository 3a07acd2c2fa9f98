//! `dejavu quantize` on the Hugging Face fixtures: the GGUF it writes loads (memory-mapped),
//! tokenizes as the checkpoint does, runs on every kernel tier, keeps the quality the issue
//! asks for (Q8_0 within 0.5% and Q4_0 within 5% of the f16 checkpoint's perplexity), and gives
//! each matrix the type llama-quantize's mixes give it.
mod common;
use common::OnCpu;
use common::Reference;
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::tokenizer::Tokenizer;
use dejavu::model::weights::Model;
use dejavu::quantize::{FileType, Imatrix, Options};
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::SparsePlan;
use dejavu::text::sampling::argmax;
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::CpuBackend;
use dejavu_formats::GgufFile;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn quantize(src: &Path, ftype: FileType, out: &Path) {
    quantize_with(src, ftype, false, None, out)
}

fn quantize_with(src: &Path, ftype: FileType, pure: bool, imatrix: Option<Imatrix>, out: &Path) {
    let m = Model::load(src).unwrap();
    let t = Tokenizer::from_model(&m).unwrap();
    let b = CpuBackend::new(2).unwrap();
    let opts = Options {
        ftype,
        pure,
        imatrix,
        rounding: dejavu_backend_api::quantize::Rounding::Ggml,
    };
    dejavu::quantize::quantize(&m, &t, &b, &opts, out).unwrap();
}

fn ppl(path: &Path) -> f64 {
    let eng = Engine::load(path, &EngineOptions::default()).unwrap();
    let text = std::fs::read_to_string(fixture("eval.txt")).unwrap();
    let tokens = eng.tokenizer.encode_document(&text).unwrap();
    let mut dense = eng.decoder(&Policy::dense(&eng.model.config)).unwrap();
    perplexity(&eng, &mut dense, &tokens, 512, Feed::Batch, |_, _, _| {})
        .unwrap()
        .ppl
}

#[test]
fn quantized_opt_keeps_quality() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("opt-relu");
    let base = ppl(&src);
    for (qtype, budget) in [
        (FileType::F16, 1e-6),
        (FileType::Q8_0, 0.005),
        (FileType::Q4_0, 0.05),
    ] {
        let out = dir.path().join(format!("opt-{}.gguf", qtype.name()));
        quantize(&src, qtype, &out);
        let p = ppl(&out);
        let rel = (p / base - 1.0).abs();
        eprintln!(
            "opt-relu {}: ppl {p:.4} vs f16 checkpoint {base:.4} ({:+.3}%)",
            qtype.name(),
            (p / base - 1.0) * 100.0
        );
        assert!(rel <= budget, "{}: ppl {p} vs {base}", qtype.name());
    }
}

/// Every architecture converts: same tokens as the checkpoint, same perplexity in F16 (exact
/// weights: for llama this also checks the Q/K permutation to interleaved RoPE).
#[test]
fn every_fixture_converts_to_gguf() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "opt-postln-proj",
        "opt-noaffine",
        "llama-relu",
        "llama-silu",
        "qwen2",
        "qwen3",
        "llama3-rope",
        "mistral-swa",
        "phi3",
        "gemma2",
        "gemma3",
        "opt-torch",
    ] {
        let out = dir.path().join(format!("{name}.gguf"));
        quantize(&fixture(name), FileType::F16, &out);
        let eng = Engine::load(&out, &EngineOptions::default()).unwrap();
        let r: Reference = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        for case in &r.greedy.cases {
            assert_eq!(
                eng.tokenizer.encode_prompt(&case.prompt).unwrap(),
                case.prompt_ids,
                "{name}"
            );
        }
        let (a, b) = (ppl(&fixture(name)), ppl(&out));
        eprintln!("{name}: checkpoint ppl {a:.4}, F16 GGUF {b:.4}");
        assert!((a / b - 1.0).abs() < 1e-4, "{name}: {a} vs {b}");
    }
}

/// The Q8_0 and Q4_0 files on every kernel tier: token-by-token decoding (integer kernels, 8-bit
/// activations) against the f32 reference backend on the same file, within the decode path's
/// tolerance of model_reference.rs (1.5 on logits relative to top-1), and the same top-1 where
/// the reference's margin exceeds 1.
#[test]
fn quantized_files_run_on_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let r: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("opt-relu").join("reference.json")).unwrap(),
    )
    .unwrap();
    // The pure K-quant files put Q2_K, Q5_K and IQ4_XS rows in the 1536-wide down projections.
    for (qtype, pure) in [
        (FileType::Q8_0, false),
        (FileType::Q4_0, false),
        (FileType::Q4KM, false),
        (FileType::Q3KM, false),
        (FileType::Q2K, true),
        (FileType::Q5KS, true),
        (FileType::IQ4XS, true),
    ] {
        let out = dir.path().join(format!("opt-{}.gguf", qtype.name()));
        quantize_with(&fixture("opt-relu"), qtype, pure, None, &out);
        let eng = Engine::load(&out, &EngineOptions::default()).unwrap();
        let vocab = eng.model.config.vocab_size;
        let plan = SparsePlan::dense(&eng.model.config);
        let case = &r.greedy.cases[0];
        let mut seq = case.prompt_ids.clone();
        seq.extend(&case.greedy_ids[..16]);
        let reference = OnCpu::new(&eng, CpuBackend::f32_reference(2), false);
        let want = (reference.fixed(&plan, eng.n_ctx))
            .run(&seq, Logits::Range(0, seq.len()))
            .unwrap()
            .to_vec();
        for isa in Isa::supported() {
            let tier = OnCpu::new(&eng, CpuBackend::with_isa(isa, 2).unwrap(), false);
            let mut s = tier.fixed(&plan, eng.n_ctx);
            for (i, &t) in seq.iter().enumerate() {
                let got = s.run(&[t], Logits::Last).unwrap();
                let w = &want[i * vocab..(i + 1) * vocab];
                let top = argmax(w) as usize;
                let mut sorted = w.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > 1.0 {
                    assert_eq!(
                        argmax(got) as usize,
                        top,
                        "{} {isa} position {i}",
                        qtype.name()
                    );
                }
                let (g0, w0) = (got[top], w[top]);
                let worst = (got.iter().zip(w))
                    .map(|(g, v)| ((g - g0) - (v - w0)).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1.5, "{} {isa} position {i}: {worst}", qtype.name());
            }
        }
    }
}

/// The types of a file, by tensor name.
fn types_of(path: &Path) -> std::collections::HashMap<String, String> {
    let f = GgufFile::open(path).unwrap();
    (f.header.tensors.iter())
        .map(|t| (t.name.clone(), t.ggml_type.name().to_string()))
        .collect()
}

/// The K-quant mixes on opt-relu (6 layers, width 384, 1536 neurons): llama-quantize's type for
/// each matrix (widths of 384 fall back to 32-wide types), and the perplexity within each type's
/// budget of the f16 checkpoint's (budgets: 2-15x the change measured, which is under 0.6% for
/// every type: this little-trained model's perplexity is insensitive to rounding, so the real
/// check of quality is llama-perplexity on real models, in the README). With an importance
/// matrix from the evaluation text the 2-bit file keeps its budget too.
#[test]
fn k_quant_mixes_follow_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("opt-relu");
    let base = ppl(&src);
    for (ftype, budget) in [
        (FileType::Q6K, 0.005),
        (FileType::Q5KM, 0.01),
        (FileType::Q4KM, 0.015),
        (FileType::IQ4XS, 0.015),
        (FileType::Q3KM, 0.03),
        (FileType::Q2K, 0.05),
    ] {
        let out = dir.path().join(format!("opt-{}.gguf", ftype.name()));
        quantize(&src, ftype, &out);
        let p = ppl(&out);
        eprintln!(
            "opt-relu {}: ppl {p:.4} vs f16 {base:.4} ({:+.2}%)",
            ftype.name(),
            (p / base - 1.0) * 100.0
        );
        assert!(
            (p / base - 1.0).abs() <= budget,
            "{}: ppl {p} vs {base}",
            ftype.name()
        );
        let t = types_of(&out);
        // more(i, 6) layers (2 and 5) get Q6_K down projections under Q4_K_M and Q5_K_M; no
        // layer is in the first eighth or sixteenth of 6.
        let down = |l: usize| t[&format!("blk.{l}.ffn_down.weight")].as_str();
        match ftype {
            FileType::Q4KM => assert_eq!([down(0), down(2), down(5)], ["Q4_K", "Q6_K", "Q6_K"]),
            FileType::Q5KM => assert_eq!([down(0), down(2)], ["Q5_K", "Q6_K"]),
            FileType::Q3KM => assert_eq!(down(0), "Q4_K"),
            FileType::Q2K => assert_eq!(down(0), "Q3_K"),
            FileType::IQ4XS => assert_eq!(down(0), "IQ4_XS"),
            _ => assert_eq!(down(0), "Q6_K"),
        }
        // 384-wide rows fall back as llama-quantize's do; the tied output is Q8_0.
        let fallback = match ftype {
            FileType::Q6K => "Q8_0",
            FileType::Q5KM => "Q5_1",
            FileType::Q4KM => "Q5_0",
            FileType::IQ4XS => "IQ4_NL",
            _ => "Q4_0",
        };
        assert_eq!(t["blk.0.attn_q.weight"], fallback, "{}", ftype.name());
        assert_eq!(t["token_embd.weight"], "Q8_0");
    }
    // Q2_K with an importance matrix.
    let eng = Engine::load(&src, &EngineOptions::default()).unwrap();
    let text = std::fs::read_to_string(fixture("eval.txt")).unwrap();
    let tokens = eng.tokenizer.encode_document(&text).unwrap();
    let im = Imatrix::collect(&eng, &tokens, 512, Some(4)).unwrap();
    assert!(im
        .for_tensor("blk.0.ffn_down.weight")
        .is_some_and(|v| v.len() == 1536));
    assert!(im
        .for_tensor("blk.5.attn_output.weight")
        .is_some_and(|v| v.iter().all(|x| *x >= 0.0)));
    let out = dir.path().join("opt-q2_k-imatrix.gguf");
    quantize_with(&src, FileType::Q2K, false, Some(im.clone()), &out);
    let p = ppl(&out);
    eprintln!(
        "opt-relu q2_k with an importance matrix: ppl {p:.4} ({:+.2}%)",
        (p / base - 1.0) * 100.0
    );
    assert!((p / base - 1.0).abs() <= 0.05);
    // Issue 52: Q2_K_S only with an importance matrix, as llama-quantize: refused without one
    // (the library and the command, before any work, writing nothing), written with one.
    let out = dir.path().join("opt-q2_k_s.gguf");
    let m = Model::load(&src).unwrap();
    let t = Tokenizer::from_model(&m).unwrap();
    let opts = Options {
        ftype: FileType::Q2KS,
        pure: false,
        imatrix: None,
        rounding: dejavu_backend_api::quantize::Rounding::Ggml,
    };
    let b = CpuBackend::new(1).unwrap();
    let err = match dejavu::quantize::quantize(&m, &t, &b, &opts, &out) {
        Ok(_) => panic!("q2_k_s without an importance matrix was written"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("q2_k_s needs an importance matrix"), "{err}");
    assert!(!out.exists());
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["quantize", "--type", "q2_k_s", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&cli.stderr);
    assert!(
        !cli.status.success() && stderr.contains("--imatrix"),
        "{stderr}"
    );
    assert!(!out.exists());
    quantize_with(&src, FileType::Q2KS, false, Some(im), &out);
    let p = ppl(&out);
    assert!(
        (p / base - 1.0).abs() <= 0.08,
        "q2_k_s with an importance matrix: {p} vs {base}"
    );
}
