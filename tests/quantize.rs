//! `dejavu quantize` on the Hugging Face fixtures: the GGUF it writes loads (memory-mapped),
//! tokenizes as the checkpoint does, runs on every kernel tier, and keeps the quality the issue
//! asks for (Q8_0 within 0.5% and Q4_0 within 5% of the f16 checkpoint's perplexity).
mod common;
use common::OnCpu;
use common::Reference;
use dejavu::eval::perplexity::{perplexity, Feed};
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::tokenizer::Tokenizer;
use dejavu::model::weights::Model;
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::SparsePlan;
use dejavu::text::sampling::argmax;
use dejavu_backend_api::QuantType;
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::CpuBackend;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn quantize(src: &Path, qtype: QuantType, out: &Path) {
    let m = Model::load(src).unwrap();
    let t = Tokenizer::from_model(&m).unwrap();
    let b = CpuBackend::new(2).unwrap();
    dejavu::quantize::quantize(&m, &t, &b, qtype, out).unwrap();
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
        (QuantType::F16, 1e-6),
        (QuantType::Q8_0, 0.005),
        (QuantType::Q4_0, 0.05),
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
        quantize(&fixture(name), QuantType::F16, &out);
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
    for qtype in [QuantType::Q8_0, QuantType::Q4_0] {
        let out = dir.path().join(format!("opt-{}.gguf", qtype.name()));
        quantize(&fixture("opt-relu"), qtype, &out);
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
