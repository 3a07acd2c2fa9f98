//! Regression tests for what a review found (issue 10, part 6): panics from input, soundness,
//! silently wrong results, and CLI contracts.
mod common;
use common::*;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::model::weights::Model;
use dejavu_formats::gguf::{GgmlType, MetaValue};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .output()
        .unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), s(&out.stdout), s(&out.stderr))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn tiny_file(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>),
) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, tiny_llama_gguf(edit)).unwrap();
    p
}

#[test]
fn calibrate_ctx_0_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_file(dir.path(), "t.gguf", |_, _| {});
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "some calibration text. ".repeat(200)).unwrap();
    let (ok, _, err) = run(&[
        "calibrate",
        "-m",
        m.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--ctx",
        "0",
    ]);
    assert!(
        !ok && err.contains("--ctx 0") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn predictor_of_rank_0_is_refused() {
    use dejavu::sparsity::predictor::LowRankPredictor;
    assert!(LowRankPredictor::from_parts(0, 64, 96, vec![], vec![]).is_err());
}

#[test]
fn inspect_into_a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_file(dir.path(), "t.gguf", |_, _| {});
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["inspect", m.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // as `| head` does once it has its lines
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("panicked"), "{err}");
    // And a Hugging Face directory inspects too.
    let (ok, out, _) = run(&["inspect", fixture("opt-relu").to_str().unwrap()]);
    assert!(
        ok && out.contains("model.decoder.layers.5.fc2.weight"),
        "{out}"
    );
}

/// 64 query heads of 2 dimensions and 32 MLP neurons: attn-norm scores more heads than neurons.
#[test]
fn attn_norm_with_fewer_neurons_than_heads() {
    let dir = tempfile::tempdir().unwrap();
    let (d, heads, ff) = (128usize, 64usize, 32usize);
    let m = tiny_file(dir.path(), "t.gguf", |meta, tensors| {
        for (k, v) in meta.iter_mut() {
            match k.as_str() {
                "llama.embedding_length" => *v = MetaValue::U32(d as u32),
                "llama.feed_forward_length" => *v = MetaValue::U32(ff as u32),
                "llama.attention.head_count" | "llama.attention.head_count_kv" => {
                    *v = MetaValue::U32(heads as u32)
                }
                _ => {}
            }
        }
        for (name, dims, ty, bytes) in tensors.iter_mut() {
            let shape: Vec<u64> = match dims.as_slice() {
                [_] => vec![d as u64],
                _ if name.contains("ffn_gate") || name.contains("ffn_up") => {
                    vec![d as u64, ff as u64]
                }
                _ if name.contains("ffn_down") => vec![ff as u64, d as u64],
                _ if name.contains("token_embd") => vec![d as u64, 256],
                _ => vec![d as u64, d as u64],
            };
            let n: u64 = shape.iter().product();
            *bytes = match ty {
                GgmlType::F32 => [1f32]
                    .repeat(n as usize)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                _ => (0..n / 32)
                    .flat_map(|i| {
                        let mut b = half::f16::from_f32(0.01).to_le_bytes().to_vec();
                        b.extend((0..32).map(|j| ((i * 7 + j * 13) % 255) as u8));
                        b
                    })
                    .collect(),
            };
            *dims = shape;
        }
    });
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "heads and neurons, ".repeat(60)).unwrap();
    let (ok, _, err) = run(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "32",
        "--chunks",
        "1",
        "--sparsity",
        "attn-norm:0.5",
    ]);
    assert!(ok && !err.contains("panicked"), "{err}");
}

#[test]
fn backend_refuses_short_buffers_instead_of_writing_past_them() {
    use dejavu_backend_api::{Backend, IndexSet, QuantType, Weight};
    let b = dejavu_backend_cpu::CpuBackend::new(2).unwrap();
    let data = vec![0u8; 4 * 32 * 8];
    let w = Weight::new(QuantType::F32, 8, 32, &data).unwrap();
    let x = vec![1f32; 32];
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut y = vec![0f32; 4]; // 8 needed
        b.matmul(&w, &IndexSet::full(8), &x, &mut y);
    }));
    assert!(r.is_err(), "a short output must be refused");
    let mut forged = w;
    forged.rows = 64; // fields are public; the backend re-checks them
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut y = vec![0f32; 64];
        b.matmul(&forged, &IndexSet::full(64), &x, &mut y);
    }));
    assert!(
        r.is_err(),
        "a weight whose fields disagree with its bytes must be refused"
    );
}

#[test]
fn same_size_model_with_other_weights_has_another_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let a = tiny_file(dir.path(), "a.gguf", |_, _| {});
    let b = tiny_file(dir.path(), "b.gguf", |_, t| {
        let last = t.iter_mut().rev().find(|t| t.2 == GgmlType::Q8_0).unwrap();
        let n = last.3.len();
        last.3[n - 1] ^= 0x55;
    });
    assert_eq!(
        std::fs::metadata(&a).unwrap().len(),
        std::fs::metadata(&b).unwrap().len()
    );
    let (ma, mb) = (Model::load(&a).unwrap(), Model::load(&b).unwrap());
    assert_ne!(ma.fingerprint(), mb.fingerprint());
    // A predictors file of `a` is refused for `b`.
    let text = dir.path().join("t.txt");
    std::fs::write(
        &text,
        "contextual sparsity skips the rows it does not need. ".repeat(100),
    )
    .unwrap();
    let (ok, _, err) = run(&[
        "calibrate",
        "-m",
        a.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--no-search",
        "--rank",
        "32",
        "--ctx",
        "32",
        "--sample-tokens",
        "0",
        "--mlp-tokens",
        "64",
    ]);
    assert!(ok, "{err}");
    let preds = dejavu::sparsity::predictors_file::Predictors::default_path(&ma);
    let e = dejavu::sparsity::predictors_file::Predictors::load(&preds, &mb)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("another model"), "{e}");
}

#[test]
fn add_bos_token_is_honoured_and_unknown_rope_scaling_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_file(dir.path(), "bos.gguf", |meta, _| {
        meta.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(7)));
        meta.push(("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)));
    });
    let e = Engine::load(&m, &EngineOptions::default()).unwrap();
    assert_eq!(e.tokenizer.encode_prompt("ab").unwrap()[0], 7);
    assert_ne!(e.tokenizer.encode("ab").unwrap()[0], 7);
    // Linear scaling runs (it needs its factor); YaRN is refused by name.
    let scaled = |name: &str, kind: &str, factor: Option<f32>| {
        tiny_file(dir.path(), name, |meta, _| {
            let t = MetaValue::String(kind.into());
            meta.push(("llama.rope.scaling.type".into(), t));
            if let Some(f) = factor {
                meta.push(("llama.rope.scaling.factor".into(), MetaValue::F32(f)));
            }
        })
    };
    let linear = Engine::load(
        scaled("linear.gguf", "linear", Some(4.0)),
        &EngineOptions::default(),
    );
    assert!(linear.is_ok(), "{:?}", linear.err());
    for (name, kind, factor, needle) in [
        ("yarn.gguf", "yarn", Some(4.0), "RoPE scaling"),
        ("nofactor.gguf", "linear", None, "rope.scaling.factor"),
    ] {
        let err = Engine::load(scaled(name, kind, factor), &EngineOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
    let cfg = std::fs::read_to_string(fixture("llama-silu").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["rope_parameters"] =
        serde_json::json!({"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0});
    let err = dejavu::model::arch::from_hf(&v.to_string())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("RoPE scaling `yarn`"), "{err}");
}

/// A long context holds only what a sequence uses: the caches of a 32768-position window are
/// zeroed allocations whose pages the OS maps as positions are written, so a 4-token sequence
/// leaves resident memory far below the window's size.
#[test]
fn kv_cache_holds_what_is_used() {
    const CTX: usize = 32768;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_file(dir.path(), "t.gguf", |meta, _| {
        for (k, v) in meta.iter_mut() {
            if k == "llama.context_length" {
                *v = MetaValue::U32(CTX as u32);
            }
        }
    });
    let e = Engine::load(
        &m,
        &EngineOptions {
            threads: Some(1),
            n_ctx: Some(CTX),
            ..Default::default()
        },
    )
    .unwrap();
    let rss = || dejavu::memstat::resident(&[]).unwrap().total;
    let full = (2 * TINY.layers * CTX * TINY.kv_heads * (TINY.d / TINY.heads) * 4) as u64;
    let plan = dejavu::sparsity::SparsePlan::dense(&e.model.config);
    let before = rss();
    let mut s = e.session(e.fixed_plan(&plan).unwrap()).unwrap();
    s.run(&[1, 2, 3, 4], dejavu::exec::Logits::Last).unwrap();
    let grew = rss().saturating_sub(before);
    assert!(
        grew * 4 <= full,
        "{grew} of the window's {full} bytes resident"
    );
    assert_eq!(
        e.kv_bytes(s.len()) * CTX,
        full as usize * 4,
        "the bytes in use"
    );
}

#[test]
fn cli_contracts() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_file(dir.path(), "t.gguf", |_, _| {});
    let m = m.to_str().unwrap();
    // --threads above the cores: a warning, and a normal run.
    let (ok, _, err) = run(&[
        "generate",
        "-m",
        m,
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--threads",
        "512",
    ]);
    assert!(ok && err.contains("exceeds"), "{err}");
    // A full context is said.
    let (ok, _, err) = run(&[
        "generate",
        "-m",
        m,
        "--prompt",
        "hello",
        "--max-tokens",
        "500",
        "--ctx",
        "16",
        "--temperature",
        "0",
    ]);
    assert!(
        ok && err.contains("context window of 16 tokens is full"),
        "{err}"
    );
    // perplexity under a policy still ends with `ppl: <value>`.
    let text = dir.path().join("t.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let (ok, out, err) = run(&[
        "perplexity",
        "-m",
        m,
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "32",
        "--chunks",
        "2",
        "--sparsity",
        "oracle:0.5",
    ]);
    let last = out.lines().last().unwrap_or_default();
    assert!(
        ok && last.starts_with("ppl: ") && last[5..].trim().parse::<f64>().is_ok(),
        "{out}{err}"
    );
}

/// `chat --ctx`: a conversation that outgrows the window drops its oldest turns and goes on; a
/// message too long for the window alone is refused and the session continues.
#[test]
fn chat_survives_a_full_context() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args([
            "chat",
            "-m",
            fixture("qwen2").to_str().unwrap(),
            "--ctx",
            "96",
            "-n",
            "8",
            "--temperature",
            "0",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let turn = "import os and sys, then read the configuration file from the path";
    let long = "word ".repeat(300);
    let input = format!("{turn}\n{turn}\n{long}\n{turn}\n{turn}\n\n");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("does not fit") && err.contains("dropped the oldest turn"),
        "{err}"
    );
}

/// Bad Hugging Face directories: clear errors naming the problem, never a panic.
#[test]
fn bad_hugging_face_directories() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in std::fs::read_dir(fixture("llama-silu")).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
        }
        d
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        {
            let d = copy("arch");
            let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
            std::fs::write(
                d.join("config.json"),
                cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
            )
            .unwrap();
            (d, "GPT2LMHeadModel")
        },
        {
            let d = copy("pickle");
            std::fs::remove_file(d.join("model.safetensors")).unwrap();
            std::fs::write(d.join("pytorch_model.bin"), b"PK\x03\x04").unwrap();
            (d, "not a PyTorch zip")
        },
        {
            let d = copy("truncated");
            let st = std::fs::read(d.join("model.safetensors")).unwrap();
            std::fs::write(d.join("model.safetensors"), &st[..st.len() / 2]).unwrap();
            (d, "safetensors")
        },
        {
            let d = copy("shape");
            let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
            std::fs::write(
                d.join("config.json"),
                cfg.replace("\"intermediate_size\": 384", "\"intermediate_size\": 416"),
            )
            .unwrap();
            (d, "shape")
        },
        {
            let d = copy("json");
            std::fs::write(d.join("config.json"), "{ not json").unwrap();
            (d, "config.json")
        },
        {
            let d = copy("dtype");
            let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
            std::fs::write(
                d.join("config.json"),
                cfg.replace("\"bfloat16\"", "\"float8_e4m3fn\""),
            )
            .unwrap();
            (d, "float8")
        },
    ];
    for (d, want) in cases {
        let (ok, _, err) = run(&[
            "generate",
            "-m",
            d.to_str().unwrap(),
            "--prompt",
            "x",
            "--max-tokens",
            "1",
        ]);
        assert!(
            !ok && err.contains(want) && !err.contains("panicked"),
            "{}: {err}",
            d.display()
        );
    }
}

/// An f16 KV cache (`--kv-type f16`) halves the cache and keeps the model: perplexity through the
/// cache (token by token) within 0.5% of the f32 cache's on the trained OPT fixture, and half
/// the bytes.
#[test]
fn f16_kv_cache_keeps_quality_at_half_the_bytes() {
    use dejavu::eval::perplexity::{perplexity, Feed};
    use dejavu::exec::KvType;
    let text = std::fs::read_to_string(fixture("eval.txt")).unwrap();
    let mut ppl = Vec::new();
    for kv_type in [KvType::F32, KvType::F16] {
        let opts = EngineOptions {
            kv_type,
            ..Default::default()
        };
        let e = Engine::load(fixture("opt-relu"), &opts).unwrap();
        let mut tokens = e.tokenizer.encode_document(&text).unwrap();
        tokens.truncate(4 * 512);
        let plan = dejavu::sparsity::SparsePlan::dense(&e.model.config);
        let r = perplexity(
            &e,
            &mut e.session(e.fixed_plan(&plan).unwrap()).unwrap(),
            &tokens,
            512,
            Feed::TokenByToken,
            |_, _, _| {},
        )
        .unwrap();
        ppl.push((r.ppl, e.kv_bytes(100)));
    }
    let ((p32, b32), (p16, b16)) = (ppl[0], ppl[1]);
    eprintln!("kv f32: ppl {p32:.4}, {b32} bytes; kv f16: ppl {p16:.4}, {b16} bytes");
    assert!((p16 / p32 - 1.0).abs() < 0.005, "{p16} vs {p32}");
    assert_eq!(b16 * 2, b32);
}

/// Rules that need a gate projection are refused on a plain (OPT) MLP at parse time.
#[test]
fn gate_rules_refused_on_plain_mlp() {
    let e = Engine::load(fixture("opt-postln-proj"), &EngineOptions::default()).unwrap();
    for spec in ["gate-first:0.5", "up-first:0.5"] {
        let err = e.policy(spec, None).err().unwrap().to_string();
        assert!(err.contains("needs a gated MLP"), "{err}");
    }
    assert!(e.policy("dense", None).is_ok());
    assert!(e.policy("relu-exact", None).is_ok());
    // And relu-exact needs a ReLU.
    let q = Engine::load(fixture("qwen2"), &EngineOptions::default()).unwrap();
    let err = q.policy("relu-exact", None).err().unwrap().to_string();
    assert!(err.contains("needs a ReLU MLP"), "{err}");
}
