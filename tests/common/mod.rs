//! Shared helpers of the integration tests: llama.cpp's reference outputs in tests/reference (made
//! by tools/llama_reference.py), the evaluation text (tools/eval_text.py), the real models
//! (fetched into the cache on first use), and a tiny synthetic model for fast tests.
#![allow(dead_code)]
use dejavu::exec::{DeviceModel, DevicePlan, DeviceSession};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::policy::Policy;
use dejavu::sparsity::SparsePlan;
use dejavu_backend_cpu::device::CpuDevice;
use dejavu_backend_cpu::CpuBackend;
use dejavu_formats::gguf::{self, GgmlType, MetaValue};
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::path::PathBuf;

pub mod faults;
pub mod inproc;
pub mod load;
pub mod same_reply;
pub mod server;

/// Run `cmd`; assert it succeeded (its stderr in the message) and return its stdout as text.
pub fn stdout_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Run `dejavu args...`; assert a non-zero exit with an `error:` line containing `needle`.
pub fn fails_with(args: &[&str], needle: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: exit {:?}, stderr: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert!(
        stderr.contains("error:") && stderr.contains(needle),
        "{args:?}: expected `{needle}` in: {stderr}"
    );
}

pub const SMOLLM2: &str = "smollm2-135m-instruct";
pub const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
pub const GEMMA: &str = "gemma-3-270m";

/// The directory of llama.cpp's reference outputs, one JSON per real model.
pub fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("reference")
}

#[derive(Deserialize)]
pub struct Reference {
    pub perplexity: RefPerplexity,
    pub greedy: RefGreedy,
}
#[derive(Deserialize)]
pub struct RefPerplexity {
    pub ctx: usize,
    pub chunks: usize,
    pub reference_f32_weights: f64,
    pub reference_native_quant: f64,
}
#[derive(Deserialize)]
pub struct RefGreedy {
    pub cases: Vec<RefCase>,
}
#[derive(Deserialize)]
pub struct RefCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub steps: Vec<RefStep>,
}
#[derive(Deserialize)]
pub struct RefStep {
    pub top5: Vec<(u32, f32)>,
}

pub fn reference(model: &str) -> Reference {
    let path = reference_dir().join(format!("{model}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The evaluation text the references were measured on, as `tools/eval_text.py` assembles it from
/// files of crates that Cargo.lock pins (the tool checks its SHA-256). Made once per test binary.
pub fn public_eval() -> String {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = std::process::Command::new("python3")
            .arg(root.join("tools").join("eval_text.py"))
            .current_dir(&root)
            .output()
            .expect("python3 is needed for tools/eval_text.py");
        assert!(
            out.status.success(),
            "tools/eval_text.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("the evaluation text is UTF-8")
    })
    .clone()
}

pub fn model_path(name: &str) -> PathBuf {
    dejavu::fetch::fetch(name).unwrap_or_else(|e| panic!("model {name} unavailable: {e}"))
}

pub fn engine(name: &str) -> Engine {
    Engine::load(model_path(name), &EngineOptions::default()).unwrap()
}

/// An engine's model on a CPU device of its own (an ISA tier, the f32 reference), for sessions
/// that the tests compare: f32 KV caches, and the sparse layout when asked for.
pub struct OnCpu {
    pub dev: CpuDevice,
    pub model: DeviceModel<CpuDevice>,
}

impl OnCpu {
    pub fn new(eng: &Engine, backend: CpuBackend, sparse: bool) -> Self {
        Self::with_cache(eng, backend, sparse, true)
    }
    /// With f32 or (`f32_cache` false) f16 caches.
    pub fn with_cache(eng: &Engine, backend: CpuBackend, sparse: bool, f32_cache: bool) -> Self {
        let dev = CpuDevice::from_backend(backend);
        let dev = if f32_cache { dev.with_f32_cache() } else { dev };
        let layout = sparse.then(|| eng.sparse_layout().unwrap());
        let model = DeviceModel::upload(&dev, &eng.model, layout).unwrap();
        Self { dev, model }
    }
    /// A session under a fixed plan, with `n_ctx` positions.
    pub fn fixed(&self, plan: &SparsePlan, n_ctx: usize) -> DeviceSession<'_, CpuDevice> {
        let p = DevicePlan::fixed(&self.dev, &self.model.config, plan, "fixed").unwrap();
        DeviceSession::new(&self.dev, &self.model, p, n_ctx).unwrap()
    }
    /// A session under a policy, with `n_ctx` positions.
    pub fn policy(&self, policy: &Policy, n_ctx: usize) -> DeviceSession<'_, CpuDevice> {
        let p = DevicePlan::policy(&self.dev, &self.model.config, policy).unwrap();
        DeviceSession::new(&self.dev, &self.model, p, n_ctx).unwrap()
    }
}

/// The tiny model with its down and attention output projections stored as F32 (the values of
/// the Q8_0 original), so the sparse layout is an exact transposition.
pub fn tiny_f32_down() -> Vec<u8> {
    tiny_llama_gguf(|_, tensors| f32_down(tensors))
}

/// [`tiny_f32_down`]'s edit: the down projections and W_o as F32.
pub fn f32_down(tensors: &mut [(String, Vec<u64>, GgmlType, Vec<u8>)]) {
    for (name, _, ty, bytes) in tensors.iter_mut() {
        if name.ends_with("ffn_down.weight") || name.ends_with("attn_output.weight") {
            let vals: Vec<u8> = bytes
                .chunks_exact(34)
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    b[2..].iter().map(move |&q| d * q as i8 as f32)
                })
                .flat_map(|v| v.to_le_bytes())
                .collect();
            *bytes = vals;
            *ty = GgmlType::F32;
        }
    }
}

/// Shape of the tiny synthetic llama model.
pub struct Tiny {
    pub d: usize,
    pub ff: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub ctx: usize,
}

pub const TINY: Tiny = Tiny {
    d: 64,
    ff: 96,
    heads: 4,
    kv_heads: 2,
    layers: 2,
    ctx: 64,
};

/// A tiny llama GGUF with random Q8_0/F32 weights and a 256-token byte vocabulary. `edit` may
/// change metadata and tensors before writing (to craft bad files).
pub fn tiny_llama_gguf(
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>),
) -> Vec<u8> {
    let t = TINY;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let vocab = 256;
    // GPT-2 byte-to-unicode alphabet: printable bytes map to themselves, others to U+0100 + n.
    let mut tokens = Vec::new();
    let mut n = 0;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
        tokens.push(MetaValue::String(c.to_string()));
    }
    let mut meta: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::String("llama".into()),
        ),
        ("llama.block_count".into(), MetaValue::U32(t.layers as u32)),
        ("llama.embedding_length".into(), MetaValue::U32(t.d as u32)),
        (
            "llama.feed_forward_length".into(),
            MetaValue::U32(t.ff as u32),
        ),
        (
            "llama.attention.head_count".into(),
            MetaValue::U32(t.heads as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            MetaValue::U32(t.kv_heads as u32),
        ),
        ("llama.context_length".into(), MetaValue::U32(t.ctx as u32)),
        ("llama.rope.freq_base".into(), MetaValue::F32(10000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            MetaValue::F32(1e-5),
        ),
        (
            "tokenizer.ggml.model".into(),
            MetaValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::String("smollm".into()),
        ),
        ("tokenizer.ggml.tokens".into(), MetaValue::Array(tokens)),
        ("tokenizer.ggml.merges".into(), MetaValue::Array(vec![])),
    ];
    let mut tensors = Vec::new();
    let mut q8 = |name: String, rows: usize, cols: usize, rng: &mut rand_chacha::ChaCha8Rng| {
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            bytes.extend(half::f16::from_f32(0.02).to_le_bytes());
            bytes.extend((0..32).map(|_| rng.gen_range(-127i8..=127) as u8));
        }
        tensors.push((name, vec![cols as u64, rows as u64], GgmlType::Q8_0, bytes));
    };
    let hd = t.d / t.heads;
    q8("token_embd.weight".into(), vocab, t.d, &mut rng);
    for l in 0..t.layers {
        q8(format!("blk.{l}.attn_q.weight"), t.d, t.d, &mut rng);
        q8(
            format!("blk.{l}.attn_k.weight"),
            t.kv_heads * hd,
            t.d,
            &mut rng,
        );
        q8(
            format!("blk.{l}.attn_v.weight"),
            t.kv_heads * hd,
            t.d,
            &mut rng,
        );
        q8(format!("blk.{l}.attn_output.weight"), t.d, t.d, &mut rng);
        q8(format!("blk.{l}.ffn_gate.weight"), t.ff, t.d, &mut rng);
        q8(format!("blk.{l}.ffn_up.weight"), t.ff, t.d, &mut rng);
        q8(format!("blk.{l}.ffn_down.weight"), t.d, t.ff, &mut rng);
    }
    let norm = |name: String| {
        (
            name,
            vec![t.d as u64],
            GgmlType::F32,
            [1.0f32; 64][..t.d]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    };
    tensors.push(norm("output_norm.weight".into()));
    for l in 0..t.layers {
        tensors.push(norm(format!("blk.{l}.attn_norm.weight")));
        tensors.push(norm(format!("blk.{l}.ffn_norm.weight")));
    }
    edit(&mut meta, &mut tensors);
    let meta_refs: Vec<(&str, MetaValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let tensor_refs: Vec<(&str, &[u64], GgmlType, &[u8])> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.as_slice(), *t, b.as_slice()))
        .collect();
    gguf::write(&meta_refs, &tensor_refs)
}

/// Write bytes to a fresh temporary file and return it (kept alive by the handle).
pub fn temp_file(bytes: &[u8]) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f.flush().unwrap();
    f
}

/// The tiny Hugging Face fixtures of tests/fixtures/hf (tools/make_hf_fixtures.py).
pub const HF_FIXTURES: [&str; 13] = [
    "opt-relu",
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
];

/// A fixed plan whose sets fall unevenly on tensor-parallel ranks (some rank holds none of a layer's
/// heads, or all of them).
pub fn uneven_plan(eng: &Engine) -> dejavu::sparsity::SparsePlan {
    let c = &eng.model.config;
    let set = |n: usize, v: Vec<u32>| dejavu_backend_api::IndexSet::new(n, v).unwrap();
    let layers = (0..c.n_layers)
        .map(|l| {
            let (ff, h) = (c.n_ff as u32, c.n_heads as u32);
            let neurons = match l % 2 {
                0 => (0..ff).filter(|i| i % 3 == 0).collect(),
                _ => (0..ff / 2).collect(),
            };
            let heads = match l % 2 {
                0 => vec![0, h - 1],
                _ => (0..h / 2).collect(),
            };
            dejavu::sparsity::LayerPlan::new(c, set(c.n_ff, neurons), set(c.n_heads, heads))
                .unwrap()
        })
        .collect();
    dejavu::sparsity::SparsePlan::new(c, layers).unwrap()
}
