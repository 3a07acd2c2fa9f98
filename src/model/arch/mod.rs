//! Architecture families, one file each: how a Hugging Face `config.json` becomes a typed
//! [`ModelConfig`], and how the checkpoint's tensor names map to the engine's canonical (GGUF)
//! names. Everything after loading (the executor) reads only the config.
//!
//! - [`llama`]: `LlamaForCausalLM` (SwiGLU, or gated ReLU with `hidden_act: relu`),
//!   `MistralForCausalLM` (sliding-window attention), `Qwen2ForCausalLM` (QKV biases) and
//!   `Qwen3ForCausalLM` (Q/K norms, its own head width):
//!   RMSNorm, RoPE, gated MLP;
//! - [`gemma`]: `Gemma2ForCausalLM` and `Gemma3ForCausalLM`: GeGLU, scaled embeddings, norms
//!   before and after each block, local and global layers, soft caps (2), Q/K norms (3);
//! - [`phi3`]: `Phi3ForCausalLM`: the llama block with fused QKV and gate-up matrices;
//! - [`opt`]: `OPTForCausalLM`: LayerNorm (pre or post), learned positions, ReLU MLP, biases,
//!   optional embedding projections.
pub mod gemma;
pub mod llama;
pub mod opt;
pub mod phi3;

use crate::model::config::{bad, AttnConfig, ModelConfig};
use crate::{Error, Result};

/// A family's mapping from checkpoint tensor names to canonical names (`None`: not a weight the
/// engine reads, e.g. a rotary buffer).
pub type NameMap = fn(&str) -> Option<String>;

/// Parse a Hugging Face `config.json`: the typed config and the family's name mapping.
pub fn from_hf(config_text: &str) -> Result<(ModelConfig, NameMap)> {
    let v: serde_json::Value = serde_json::from_str(config_text)
        .map_err(|e| Error::Invalid(format!("config.json: {e}")))?;
    let j = HfJson(&v);
    let arch = match j.get("architectures").and_then(|a| a.as_array()) {
        Some(a) if a.len() == 1 => a[0].as_str().unwrap_or_default().to_string(),
        Some(a) => {
            return Err(bad(
                "architectures",
                &format!("expected one entry, got {a:?}"),
            ))
        }
        None => return Err(Error::MissingKey("config.json: architectures".into())),
    };
    j.check_dtype()?;
    let parsed = match arch.as_str() {
        "OPTForCausalLM" => (opt::hf_config(&j)?, opt::canonical_name as NameMap),
        "LlamaForCausalLM" => (
            llama::hf_config(&j, llama::Family::Llama)?,
            llama::canonical_name as NameMap,
        ),
        "MistralForCausalLM" => (
            llama::hf_config(&j, llama::Family::Mistral)?,
            llama::canonical_name as NameMap,
        ),
        "Gemma2ForCausalLM" => (
            gemma::hf_config(&j, gemma::Gemma::Two)?,
            gemma::canonical_name as NameMap,
        ),
        "Gemma3ForCausalLM" => (
            gemma::hf_config(&j, gemma::Gemma::Three)?,
            gemma::canonical_name as NameMap,
        ),
        "Phi3ForCausalLM" => (
            llama::hf_config(&j, llama::Family::Phi3)?,
            phi3::canonical_name as NameMap,
        ),
        "Qwen2ForCausalLM" => (
            llama::hf_config(&j, llama::Family::Qwen2)?,
            llama::canonical_name as NameMap,
        ),
        "Qwen3ForCausalLM" => (
            llama::hf_config(&j, llama::Family::Qwen3)?,
            llama::canonical_name as NameMap,
        ),
        other => return Err(Error::UnknownArchitecture(other.into())),
    };
    Ok((parsed.0.validate()?, parsed.1))
}

/// Typed reads of a `config.json` object.
pub struct HfJson<'a>(pub &'a serde_json::Value);

impl HfJson<'_> {
    pub fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    pub fn int(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(Error::MissingKey(format!("config.json: {key}"))),
            Some(v) => match v.as_u64() {
                Some(x) if x > 0 && x <= 1 << 24 => Ok(x as usize),
                _ => Err(bad(key, &format!("expected a positive integer, got {v}"))),
            },
        }
    }
    pub fn int_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.int(key),
        }
    }
    pub fn float_or(&self, key: &str, default: f64) -> Result<f32> {
        match self.get(key) {
            None => Ok(default as f32),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                _ => Err(bad(key, &format!("expected a positive number, got {v}"))),
            },
        }
    }
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(key, &format!("expected true or false, got {v}"))),
        }
    }
    pub fn str_or<'s>(&'s self, key: &str, default: &'s str) -> Result<&'s str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| bad(key, &format!("expected a string, got {v}"))),
        }
    }

    /// The weights' declared dtype (`dtype`, or `torch_dtype` in older configs), if any, must be
    /// one the engine computes with; each tensor's own dtype is checked again at load.
    fn check_dtype(&self) -> Result<()> {
        for key in ["dtype", "torch_dtype"] {
            if let Some(v) = self.get(key) {
                match v.as_str() {
                    Some("float32" | "float16" | "bfloat16") => {}
                    _ => {
                        return Err(bad(
                            key,
                            &format!("{v} is not float32, float16 or bfloat16"),
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}

/// A config's sliding window (`sliding_window`; null or absent: none) and the layers that use
/// it: those `layer_types` names `sliding_attention` (transformers 5 writes the list), else
/// those `local` picks.
pub(crate) fn sliding_window(
    j: &HfJson,
    n_layers: usize,
    local: impl Fn(usize) -> bool,
) -> Result<AttnConfig> {
    let window = match j.get("sliding_window") {
        Some(_) => Some(j.int("sliding_window")?),
        None => None,
    };
    let flags = match j.get("layer_types") {
        None => (0..n_layers).map(local).collect(),
        Some(v) => {
            let kinds = v.as_array().filter(|a| a.len() == n_layers);
            let kinds = kinds.ok_or_else(|| bad("layer_types", "expected one entry a layer"))?;
            kinds
                .iter()
                .map(|k| match k.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(bad("layer_types", &format!("unknown layer type {k}"))),
                })
                .collect::<Result<Vec<bool>>>()?
        }
    };
    Ok(AttnConfig::windowed(window, flags))
}

/// The llama-style checkpoint names outside the layers (with or without `model.`): the
/// embedding, the final norm and the output head.
pub(crate) fn global_name(name: &str) -> Option<String> {
    let g = match name.strip_prefix("model.").unwrap_or(name) {
        _ if name == "lm_head.weight" => "output.weight",
        "embed_tokens.weight" => "token_embd.weight",
        "norm.weight" => "output_norm.weight",
        _ => return None,
    };
    Some(g.into())
}

/// `layers.{i}.{rest}` into `blk.{i}.{canonical rest}` through `map`.
pub(crate) fn layer_name(name: &str, map: impl Fn(&str) -> Option<String>) -> Option<String> {
    let rest = name.strip_prefix("layers.")?;
    let (i, rest) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    Some(format!("blk.{i}.{}", map(rest)?))
}
