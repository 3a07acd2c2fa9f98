//! GGUFs written by llama.cpp's own converter (convert_hf_to_gguf.py) from the Hugging Face
//! fixtures: the engine loads each one, tokenizes the reference prompts to the same ids, and
//! gives the logits of its load of the fixture's directory.
//!
//! The files come from `tools/llama_convert.py` (it needs torch, so it runs on the device
//! machine), into `$DEJAVU_LLAMA_CONVERTED` or `~/.cache/dejavu/llama-converted`. Without them
//! this test says so and checks nothing: CI has no torch, and the files (20 MB) are not
//! committed.
//!
//! Tolerance: both loads hold the same 16-bit weights (the converter's `--outtype auto` keeps the
//! checkpoint's type; its norms are f32, Gemma's with the 1 added in f32 as the engine does) and
//! compute in f32; llama.cpp's converter permutes Q and K rows for its RoPE layout, which changes
//! only summation order. So |gguf - hf| <= 0.01 + 0.001 |hf| on every logit (hf_reference.rs's
//! tolerance), and the same top-1 wherever the directory's margin exceeds 0.05.
//!
//! Some settings llama.cpp's converter does not write, and llama.cpp then runs its own default:
//! the `llama` architecture has no activation key (llama-relu's `hidden_act: relu` is dropped:
//! SwiGLU), Mistral is written as `llama` without its sliding window (full attention), and
//! Gemma 2's `query_pre_attn_scalar` is dropped (llama.cpp scales by 1/sqrt(head_dim)), and so
//! is Gemma 3's `layer_types` (llama.cpp makes every 6th layer global; the gemma3 fixture's
//! layer 2 of 4 is global). The
//! engine reads such a file as llama.cpp does; the test checks that it reads exactly these
//! defaults, then runs the directory with them, so every other setting and every weight is
//! still compared on every position. (Use `dejavu quantize` for such models: it writes them.)
mod common;
use common::*;
use dejavu::exec::Logits;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::config::MlpKind;
use dejavu::sparsity::SparsePlan;
use dejavu::text::sampling::argmax;
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::CpuBackend;
use std::path::PathBuf;

fn converted_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("DEJAVU_LLAMA_CONVERTED") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/dejavu/llama-converted"),
    };
    dir.is_dir().then_some(dir)
}

/// Prompt ids and teacher-forced logits of every case (prompt plus greedy tokens).
fn logits(eng: &Engine, cases: &[RefCase]) -> Vec<(Vec<u32>, Vec<f32>)> {
    let cpu = OnCpu::new(eng, CpuBackend::with_isa(Isa::detect(), 2).unwrap(), false);
    let plan = SparsePlan::dense(&eng.model.config);
    (cases.iter())
        .map(|case| {
            let ids = eng.tokenizer.encode_prompt(&case.prompt).unwrap();
            let mut seq = ids.clone();
            seq.extend(&case.greedy_ids);
            let mut s = cpu.fixed(&plan, eng.n_ctx);
            let l = s.run(&seq, Logits::Range(0, seq.len())).unwrap().to_vec();
            (ids, l)
        })
        .collect()
}

/// Checks that `gguf` differs from the directory's `hf` only by the settings the converter drops
/// (see the header), each read as llama.cpp's default, and sets those on `hf`; returns their
/// Hugging Face names.
fn llama_cpp_defaults(name: &str, gguf: &Engine, hf: &mut Engine) -> Vec<&'static str> {
    let (g, h) = (&gguf.model.config, &mut hf.model.config);
    let mut dropped = Vec::new();
    if g.mlp != h.mlp {
        assert_eq!(
            (h.mlp, g.mlp),
            (MlpKind::GatedRelu, MlpKind::SwiGlu),
            "{name}: MLP"
        );
        h.mlp = g.mlp;
        dropped.push("hidden_act");
    }
    if g.attn.window != h.attn.window {
        assert!(
            g.attn.window.is_none() && g.attn.local.is_empty(),
            "{name}: window"
        );
        (h.attn.window, h.attn.local) = (None, Vec::new());
        dropped.push("sliding_window");
    }
    if g.attn.window == h.attn.window && g.attn.local != h.attn.local {
        // llama.cpp's Gemma 3 pattern: every 6th layer global.
        let every_6th: Vec<bool> = (0..g.n_layers).map(|l| (l + 1) % 6 != 0).collect();
        assert_eq!(g.attn.local, every_6th, "{name}: local layers");
        h.attn.local = g.attn.local.clone();
        dropped.push("layer_types");
    }
    if g.attn.scale != h.attn.scale {
        let llama_cpp = 1.0 / (g.head_dim as f32).sqrt();
        assert_eq!(
            g.attn.scale.unwrap_or(llama_cpp),
            llama_cpp,
            "{name}: attention scale"
        );
        h.attn.scale = g.attn.scale;
        dropped.push("query_pre_attn_scalar");
    }
    dropped
}

#[test]
fn llama_cpp_conversions_match_the_directories() {
    let Some(conv) = converted_dir() else {
        eprintln!(
            "SKIPPED: no llama.cpp conversions (run tools/llama_convert.py where torch is \
             installed, then set DEJAVU_LLAMA_CONVERTED)"
        );
        return;
    };
    let mut checked = 0;
    for name in HF_FIXTURES {
        let file = conv.join(format!("{name}.gguf"));
        if !file.is_file() {
            eprintln!("{name}: no {}", file.display());
            continue;
        }
        let hf_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf")
            .join(name);
        let text = std::fs::read_to_string(hf_dir.join("reference.json")).unwrap();
        let cases = serde_json::from_str::<Reference>(&text)
            .unwrap()
            .greedy
            .cases;
        let opts = EngineOptions::default();
        let gguf = Engine::load(&file, &opts).unwrap_or_else(|e| panic!("{name} (llama.cpp): {e}"));
        let mut hf = Engine::load(&hf_dir, &opts).unwrap();
        let dropped = llama_cpp_defaults(name, &gguf, &mut hf);
        if !dropped.is_empty() {
            eprintln!("{name}: llama.cpp's file drops {dropped:?}; the directory is run with llama.cpp's defaults");
        }
        let vocab = hf.model.config.vocab_size;
        let (mut worst, mut steps) = (0f32, 0);
        for ((ids_g, lg), (ids_h, lh)) in logits(&gguf, &cases).iter().zip(logits(&hf, &cases)) {
            assert_eq!(ids_g, &ids_h, "{name}: prompt ids");
            for (rg, rh) in lg.chunks_exact(vocab).zip(lh.chunks_exact(vocab)) {
                for (g, h) in rg.iter().zip(rh) {
                    let err = (g - h).abs();
                    worst = worst.max(err);
                    assert!(err <= 0.01 + 0.001 * h.abs(), "{name}: logit {g} vs {h}");
                }
                let mut sorted = rh.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > 0.05 {
                    assert_eq!(argmax(rg), argmax(rh), "{name}: top-1");
                }
                steps += 1;
            }
        }
        eprintln!("{name}: llama.cpp's GGUF = directory over {steps} positions, worst logit error {worst:.2e}");
        checked += 1;
    }
    eprintln!(
        "{checked} llama.cpp conversions checked in {}",
        conv.display()
    );
}
