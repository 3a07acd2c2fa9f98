//! `dejavu quantize`: a loaded model (GGUF or Hugging Face directory, any supported
//! architecture) written as a GGUF of one of llama.cpp's file types.
//!
//! - Tensors keep the canonical (GGUF) names (`model::names`). Each matrix gets the type
//!   `llama-quantize` would give it for the file type ([`mix`]: the `_S`/`_M`/`_L` mixes and the
//!   fallbacks for rows that are not whole blocks); OPT's learned positions stay F16; norm gains
//!   and biases F32. Each row is dequantized to f32 and quantized again with ggml's rounding
//!   (`dejavu_backend_api::quantize`), weighted by an importance matrix ([`imatrix`]) if given.
//! - A Hugging Face llama's Q and K rows are permuted from NeoX to interleaved RoPE order, as
//!   llama.cpp's converter does, so the GGUF runs with llama's interleaved RoPE.
//! - Metadata: llama.cpp's keys where it has them; for OPT and the MLP activation the keys of
//!   `model::names` (the README lists them). The tokenizer goes in twice: as llama.cpp's
//!   `tokenizer.ggml.*` arrays, and whole as `tokenizer.huggingface.json`, which this engine
//!   reads first (exact, post-processor included). The chat template goes to
//!   `tokenizer.chat_template`. A GGUF source's metadata is copied as is.
//! - The file is written as a stream (one tensor in memory at a time), to a temporary name that
//!   is renamed when complete.
use crate::model::config::{Architecture, MlpKind, ModelConfig, NormKind, Positions, RopeScaling};
use crate::model::names::*;
use crate::model::tokenizer::Tokenizer;
use crate::model::weights::{ggml_type, Model, Source, WeightRef};
use crate::{Error, Result};
use dejavu_backend_api::{quantize, Backend, QuantType};
use dejavu_formats::gguf::{GgmlType, GgufWriter, MetaValue};
use std::path::Path;

pub mod imatrix;
pub mod mix;

pub use imatrix::Imatrix;
pub use mix::FileType;

/// What to write.
pub struct Options {
    pub ftype: FileType,
    /// `--pure`: every matrix in the file type's base type (no mix rules).
    pub pure: bool,
    pub imatrix: Option<Imatrix>,
    /// How the 32-wide types round without an importance matrix: `Ggml` (llama-quantize's
    /// bytes) or `Search` (lower squared error).
    pub rounding: quantize::Rounding,
}

/// Where one output tensor's values come from.
enum Data<'a> {
    /// A matrix (or several of the same width stacked, as Phi-3's fused ones), row by row;
    /// `perm` maps output row to source row.
    Rows(Vec<&'a WeightRef>, Option<Vec<usize>>),
    Vector(Vec<f32>),
}

struct Out<'a> {
    name: String,
    /// ggml order: `[cols, rows]`, or `[n]` for a vector.
    dims: Vec<u64>,
    qtype: QuantType,
    data: Data<'a>,
}

impl Out<'_> {
    fn n_bytes(&self) -> usize {
        let rows = self.dims.get(1).copied().unwrap_or(1) as usize;
        rows * self.qtype.row_bytes(self.dims[0] as usize)
    }
}

/// What was written.
pub struct Summary {
    pub tensors: usize,
    pub bytes: u64,
}

/// Write `model` (with its `tokenizer`) to `out` as a GGUF of the file type `opts.ftype`.
/// The error of a type quantized without the importance matrix it needs.
pub fn needs_imatrix(t: mix::FileType) -> Error {
    Error::Invalid(format!(
        "{} needs an importance matrix (--imatrix TEXT): without one its 2-bit rows lose too \
         much (llama-quantize refuses it too); q2_k is the 2-bit type that needs none",
        t.name()
    ))
}

pub fn quantize(
    model: &Model,
    tokenizer: &Tokenizer,
    backend: &dyn Backend,
    opts: &Options,
    out: &Path,
) -> Result<Summary> {
    crate::fsio::refuse_overwrite("--out", out, &model.path)?;
    crate::fsio::refuse_unwritable("--out", out)?;
    if opts.ftype.needs_imatrix() && opts.imatrix.is_none() {
        return Err(needs_imatrix(opts.ftype));
    }
    let mut meta = metadata(model, tokenizer)?;
    meta.push(("general.file_type".into(), MetaValue::U32(opts.ftype.id())));
    if opts.ftype.base().block_len() > 1 {
        meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    }
    let c = &model.config;
    let mut mix = mix::Mix::new(
        opts.ftype,
        opts.pure,
        opts.imatrix.is_some(),
        c.tied_output,
        c.n_heads / c.n_kv_heads.max(1),
        c.n_layers,
    );
    let tensors = plan(model, &mut mix);
    let infos: Vec<(&str, &[u64], GgmlType, usize)> = (tensors.iter())
        .map(|t| {
            (
                t.name.as_str(),
                t.dims.as_slice(),
                ggml_type(t.qtype),
                t.n_bytes(),
            )
        })
        .collect();
    let meta_refs: Vec<(&str, MetaValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let total: u64 = tensors.iter().map(|t| t.n_bytes() as u64).sum();
    let bar = crate::progress::bytes_bar(total, &format!("quantize to {}", opts.ftype.name()));
    // A unique temporary file beside `out`, renamed over it once whole (crate::fsio).
    crate::fsio::write_with(out, |file| {
        let mut w = GgufWriter::start(file, &meta_refs, &infos)?;
        let mut bytes = Vec::new();
        for t in &tensors {
            bytes.clear();
            let importance = opts.imatrix.as_ref().and_then(|m| m.for_tensor(&t.name));
            encode(model, backend, t, importance, opts.rounding, &mut bytes)?;
            w.push(&bytes)?;
            bar.inc(bytes.len() as u64);
        }
        w.finish()?;
        Ok(())
    })?;
    bar.finish_and_clear();
    Ok(Summary {
        tensors: tensors.len(),
        bytes: std::fs::metadata(out)?.len(),
    })
}

/// One tensor's bytes in its output type; `importance`: its columns' (see [`Imatrix`]).
fn encode(
    model: &Model,
    backend: &dyn Backend,
    t: &Out,
    importance: Option<&[f32]>,
    rounding: quantize::Rounding,
    out: &mut Vec<u8>,
) -> Result<()> {
    let fail = || Error::Invalid(format!("cannot write {} as {}", t.name, t.qtype.name()));
    match &t.data {
        Data::Vector(v) => quantize::quantize_row(t.qtype, v, out).ok_or_else(fail),
        Data::Rows(ws, perm) => {
            // Row ranges on every core, concatenated in order; stacked row r is row r - first
            // of the matrix whose rows start at `first`.
            let srcs: Vec<_> = ws.iter().map(|w| (model.weight(w), w.rows)).collect();
            let (rows, cols) = (srcs.iter().map(|s| s.1).sum::<usize>(), ws[0].cols);
            let source = |r: usize| {
                let mut r = r;
                for (src, n) in &srcs {
                    match r < *n {
                        true => return (src, r),
                        false => r -= n,
                    }
                }
                unreachable!("row {r} past the stacked rows")
            };
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = rows.div_ceil(threads).max(1);
            let w = importance.filter(|w| w.len() == cols);
            let parts: Vec<Option<Vec<u8>>> = std::thread::scope(|s| {
                let jobs: Vec<_> = (0..rows)
                    .step_by(per)
                    .map(|r0| {
                        let source = &source;
                        s.spawn(move || {
                            let mut row = vec![0f32; cols];
                            let mut bytes = Vec::new();
                            for r in r0..(r0 + per).min(rows) {
                                let (src, from) = source(perm.as_ref().map_or(r, |p| p[r]));
                                backend.dequantize_row(src, from, &mut row);
                                quantize::quantize_row_weighted(
                                    t.qtype, &row, w, rounding, &mut bytes,
                                )?;
                            }
                            Some(bytes)
                        })
                    })
                    .collect();
                jobs.into_iter().map(|j| j.join().ok().flatten()).collect()
            });
            for p in parts {
                out.extend(p.ok_or_else(fail)?);
            }
            Ok(())
        }
    }
}

/// One matrix of the output, of type `q` (see [`mix::Mix::tensor_type`]).
fn matrix(name: String, w: &WeightRef, q: QuantType, perm: Option<Vec<usize>>) -> Out<'_> {
    stacked(name, vec![w], q, perm)
}

/// Matrices of one width stacked into one tensor (their rows in order).
fn stacked(name: String, ws: Vec<&WeightRef>, q: QuantType, perm: Option<Vec<usize>>) -> Out<'_> {
    let cols = ws[0].cols;
    Out {
        name,
        dims: vec![cols as u64, ws.iter().map(|w| w.rows as u64).sum()],
        qtype: q,
        data: Data::Rows(ws, perm),
    }
}

/// Every tensor of the output, in file order (the mix's counters follow it).
fn plan<'a>(model: &'a Model, mix: &mut mix::Mix) -> Vec<Out<'a>> {
    let c = &model.config;
    // A matrix (or several stacked) in the type the mix gives it.
    let mut mat = |name: String, ws: Vec<&'a WeightRef>, perm: Option<Vec<usize>>| {
        let q = mix.tensor_type(&name, ws[0].cols);
        stacked(name, ws, q, perm)
    };
    let mut v = Vec::new();
    let vector = |name: String, x: &[f32]| Out {
        name,
        dims: vec![x.len() as u64],
        qtype: QuantType::F32,
        data: Data::Vector(x.to_vec()),
    };
    // HF llama Q/K rows: NeoX order to GGUF's interleaved order.
    let permute = matches!(model.source, Source::Hf(_)) && c.arch == Architecture::Llama;
    let perm = |heads: usize| permute.then(|| neox_to_interleaved(heads, c.head_dim));
    v.push(mat(
        GlobalTensor::TokenEmbd.name(),
        vec![&model.token_embd],
        None,
    ));
    if let Some(p) = &model.pos_embd {
        v.push(matrix(
            GlobalTensor::PositionEmbd.name(),
            p,
            QuantType::F16,
            None,
        ));
    }
    for (t, w) in [
        (GlobalTensor::ProjIn, &model.proj_in),
        (GlobalTensor::ProjOut, &model.proj_out),
    ] {
        if let Some(w) = w {
            v.push(mat(t.name(), vec![w], None));
        }
    }
    if let Some(n) = &model.output_norm {
        if c.norm_affine {
            v.push(vector(GlobalTensor::OutputNorm.name(), &n.weight));
            if let Some(b) = &n.bias {
                v.push(vector(GlobalTensor::OutputNormBias.name(), b));
            }
        }
    }
    // Llama 3's divisors as llama.cpp's tensor; a linear scaling goes in the metadata.
    let linear = matches!(c.rope_scaling, Some(RopeScaling::Linear { .. }));
    if let Some(f) = model.rope_factors.as_ref().filter(|_| !linear) {
        v.push(vector(GlobalTensor::RopeFreqs.name(), f));
    }
    if !c.tied_output {
        v.push(mat(GlobalTensor::Output.name(), vec![&model.output], None));
    }
    let permuted = |b: &[f32], p: &Option<Vec<usize>>| match p {
        Some(p) => p.iter().map(|&i| b[i]).collect::<Vec<f32>>(),
        None => b.to_vec(),
    };
    for (l, lw) in model.layers.iter().enumerate() {
        let n = |t: LayerTensor| t.name(l);
        let norms = [
            (
                &lw.attn_norm,
                LayerTensor::AttnNorm,
                LayerTensor::AttnNormBias,
            ),
            (&lw.ffn_norm, LayerTensor::FfnNorm, LayerTensor::FfnNormBias),
        ];
        for (nw, wt, bt) in norms.iter().filter(|_| c.norm_affine) {
            v.push(vector(n(*wt), &nw.weight));
            if let Some(b) = &nw.bias {
                v.push(vector(n(*bt), b));
            }
        }
        // Gemma's norms of the blocks' outputs (gains with the 1 added, as llama.cpp's).
        let posts = [
            (&lw.post_attn_norm, LayerTensor::AttnPostNorm),
            (&lw.post_ffn_norm, LayerTensor::FfnPostNorm),
        ];
        for (nw, t) in posts {
            if let Some(nw) = nw {
                v.push(vector(n(t), &nw.weight));
            }
        }
        let (pq, pk) = (perm(c.n_heads), perm(c.n_kv_heads));
        let biases = [
            (&lw.bq, LayerTensor::AttnQBias, &pq),
            (&lw.bk, LayerTensor::AttnKBias, &pk),
            (&lw.bv, LayerTensor::AttnVBias, &None),
            (&lw.bo, LayerTensor::AttnOutputBias, &None),
            (&lw.b_up, LayerTensor::FfnUpBias, &None),
            (&lw.b_down, LayerTensor::FfnDownBias, &None),
            (&lw.q_norm, LayerTensor::AttnQNorm, &None),
            (&lw.k_norm, LayerTensor::AttnKNorm, &None),
        ];
        for (b, t, p) in biases {
            if let Some(b) = b {
                v.push(vector(n(t), &permuted(b, p)));
            }
        }
        match (c.arch, &lw.w_gate) {
            // llama.cpp's phi3 layout: Q, K and V in one matrix, gate and up in `ffn_up`.
            (Architecture::Phi3, Some(g)) => {
                let qkv = vec![&lw.wq, &lw.wk, &lw.wv];
                v.push(mat(format!("blk.{l}.attn_qkv.weight"), qkv, None));
                v.push(mat(n(LayerTensor::AttnOutput), vec![&lw.wo], None));
                v.push(mat(n(LayerTensor::FfnUp), vec![g, &lw.w_up], None));
            }
            _ => {
                v.push(mat(n(LayerTensor::AttnQ), vec![&lw.wq], pq));
                v.push(mat(n(LayerTensor::AttnK), vec![&lw.wk], pk));
                v.push(mat(n(LayerTensor::AttnV), vec![&lw.wv], None));
                v.push(mat(n(LayerTensor::AttnOutput), vec![&lw.wo], None));
                if let Some(g) = &lw.w_gate {
                    v.push(mat(n(LayerTensor::FfnGate), vec![g], None));
                }
                v.push(mat(n(LayerTensor::FfnUp), vec![&lw.w_up], None));
            }
        }
        v.push(mat(n(LayerTensor::FfnDown), vec![&lw.w_down], None));
    }
    v
}

/// Output row -> source row that turns NeoX-ordered rows of `heads` heads (dimension `i` pairs
/// with `i + head_dim/2`) into interleaved order (`2i` pairs with `2i + 1`): llama.cpp's
/// `permute` in its converter.
pub fn neox_to_interleaved(heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..heads * head_dim)
        .map(|r| {
            let (h, k) = (r / head_dim, r % head_dim);
            let (i, j) = (k / 2, k % 2);
            h * head_dim + j * half + i
        })
        .collect()
}

/// The output's metadata: a GGUF source's own, else the config's and the tokenizer's.
fn metadata(model: &Model, tok: &Tokenizer) -> Result<Vec<(String, MetaValue)>> {
    if let Some(h) = model.gguf_header() {
        // The type of the whole file changes; everything else carries over.
        let keep = |k: &str| k != "general.file_type" && k != "general.quantization_version";
        return Ok(h
            .metadata
            .iter()
            .filter(|(k, _)| keep(k))
            .cloned()
            .collect());
    }
    let c = &model.config;
    let name = model
        .path
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let mut m = vec![
        (
            ARCHITECTURE.to_string(),
            MetaValue::String(c.arch.name().into()),
        ),
        ("general.name".to_string(), MetaValue::String(name)),
    ];
    m.extend(arch_keys(c)?);
    m.extend(tokenizer_keys(c, tok)?);
    Ok(m)
}

fn arch_keys(c: &ModelConfig) -> Result<Vec<(String, MetaValue)>> {
    let a = c.arch.name();
    let u = |k: ArchKey, v: usize| (k.key(a), MetaValue::U32(v as u32));
    let mut m = vec![
        u(ArchKey::BlockCount, c.n_layers),
        u(ArchKey::EmbeddingLength, c.d_model),
        u(ArchKey::FeedForwardLength, c.n_ff),
        u(ArchKey::HeadCount, c.n_heads),
        u(ArchKey::HeadCountKv, c.n_kv_heads),
        u(ArchKey::ContextLength, c.context_length),
        u(ArchKey::VocabSize, c.vocab_size),
    ];
    let eps = match c.norm {
        NormKind::Rms => ArchKey::RmsEps,
        NormKind::Layer => ArchKey::LayerNormEps,
    };
    m.push((eps.key(a), MetaValue::F32(c.norm_eps)));
    if let Positions::Rope { theta, .. } = c.positions {
        m.push((ArchKey::RopeFreqBase.key(a), MetaValue::F32(theta)));
        m.push(u(ArchKey::RopeDimensionCount, c.head_dim));
        // llama.cpp's keys of the head width (qwen3's differs from d_model / n_heads).
        m.push(u(ArchKey::KeyLength, c.head_dim));
        m.push(u(ArchKey::ValueLength, c.head_dim));
    }
    let gemma = matches!(c.arch, Architecture::Gemma2 | Architecture::Gemma3);
    if let Some(w) = c.attn.window {
        // Every layer's (llama.cpp's own mistral files leave the key out), or Gemma's layers
        // one flag each.
        if c.attn.local.iter().any(|&l| !l) && !gemma {
            return Err(Error::Invalid(
                "quantize: a sliding window on some layers only is written for Gemma only".into(),
            ));
        }
        m.push(u(ArchKey::SlidingWindow, w));
        if gemma {
            let flags = c.attn.local.iter().map(|&l| MetaValue::Bool(l)).collect();
            m.push((
                ArchKey::SlidingWindowPattern.key(a),
                MetaValue::Array(flags),
            ));
        }
    }
    let f = |k: ArchKey, v: f32| (k.key(a), MetaValue::F32(v));
    if gemma {
        // llama.cpp derives the scale from the model's size; ours reads the key first.
        let scale = c.attn.scoring(0, c.head_dim).scale;
        m.push(f(ArchKey::AttentionScale, scale));
    }
    if let Some(cap) = c.attn.softcap {
        m.push(f(ArchKey::AttnLogitSoftcap, cap));
    }
    if let Some(cap) = c.final_softcap {
        m.push(f(ArchKey::FinalLogitSoftcap, cap));
    }
    if let Some(t) = c.local_rope_theta {
        m.push(f(ArchKey::RopeFreqBaseSwa, t));
    }
    if let Some(RopeScaling::Linear { factor }) = c.rope_scaling {
        let linear = MetaValue::String("linear".into());
        m.push((ArchKey::RopeScalingType.key(a), linear));
        m.push(f(ArchKey::RopeScalingFactor, factor));
    }
    if c.mlp != MlpKind::Relu {
        m.push((
            ArchKey::FeedForwardActivation.key(a),
            MetaValue::String(c.mlp.name().into()),
        ));
    }
    if c.arch == Architecture::Opt {
        m.push((ArchKey::LayerNormBefore.key(a), MetaValue::Bool(c.pre_norm)));
        if c.d_embed != c.d_model {
            m.push(u(ArchKey::EmbeddingProjection, c.d_embed));
        }
    }
    Ok(m)
}

/// llama.cpp's tokenizer arrays, plus the whole `tokenizer.json`.
fn tokenizer_keys(c: &ModelConfig, tok: &Tokenizer) -> Result<Vec<(String, MetaValue)>> {
    let json = tok.to_hf_json()?;
    let v: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let merges: Vec<MetaValue> = (v["model"]["merges"].as_array().into_iter().flatten())
        .filter_map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(p) => {
                Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?))
            }
            _ => None,
        })
        .map(MetaValue::String)
        .collect();
    let n = tok.vocab_size();
    let special = tok.special_ids();
    let tokens =
        (0..n as u32).map(|i| MetaValue::String(tok.token_text(i).unwrap_or("").to_string()));
    let types = (0..n as u32).map(|i| MetaValue::I32(if special.contains(&i) { 3 } else { 1 }));
    let s = |k: &str, v: &str| (k.to_string(), MetaValue::String(v.to_string()));
    let pre = if matches!(c.arch, Architecture::Qwen2 | Architecture::Qwen3) {
        "qwen2"
    } else {
        "gpt2"
    };
    let mut m = vec![
        s(TOK_MODEL, "gpt2"),
        s(TOK_PRE, pre),
        (TOK_TOKENS.to_string(), MetaValue::Array(tokens.collect())),
        (TOK_TYPES.to_string(), MetaValue::Array(types.collect())),
        (TOK_MERGES.to_string(), MetaValue::Array(merges)),
        (
            TOK_ADD_BOS.to_string(),
            MetaValue::Bool(tok.bos_prefix().is_some()),
        ),
        s(TOK_HF_JSON, &json),
    ];
    for (key, id) in [(TOK_BOS, tok.bos), (TOK_EOS, tok.eos)] {
        if let Some(id) = id {
            m.push((key.to_string(), MetaValue::U32(id)));
        }
    }
    if let Some(t) = tok.chat_template() {
        m.push(s(CHAT_TEMPLATE, t));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_pairs_neox_halves_into_neighbours() {
        // One head of 8: NeoX pairs (0,4) (1,5) (2,6) (3,7) become rows (0,1) (2,3) (4,5) (6,7).
        assert_eq!(neox_to_interleaved(1, 8), vec![0, 4, 1, 5, 2, 6, 3, 7]);
        let p = neox_to_interleaved(3, 4);
        assert_eq!(&p[4..8], &[4, 6, 5, 7]);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..12).collect::<Vec<_>>());
    }
}
