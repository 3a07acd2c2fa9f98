//! The typed, validated model configuration, parsed once from GGUF metadata.
//!
//! Architecture quirks are fields (`rope_style`, `qkv_bias`, `tied_output`), set from the
//! architecture table below and from which tensors the file actually has.
use crate::engine::names::{ArchKey, GlobalTensor, ARCHITECTURE, TOK_TOKENS};
use crate::{Error, Result};
use dejavu_backend_api::RopeStyle;
use dejavu_formats::gguf::GgufHeader;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            other => Err(Error::UnknownArchitecture(other.into())),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
        }
    }
    /// How this architecture's GGUF files expect RoPE (ggml: llama "normal", qwen2 "neox").
    fn rope_style(self) -> RopeStyle {
        match self {
            Architecture::Llama => RopeStyle::Interleaved,
            Architecture::Qwen2 => RopeStyle::Neox,
        }
    }
    fn qkv_bias(self) -> bool {
        matches!(self, Architecture::Qwen2)
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Context length the model was trained for (the engine's default window).
    pub context_length: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    /// Q, K and V projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// The output head is the token embedding (no `output.weight`).
    pub tied_output: bool,
}

impl ModelConfig {
    pub fn from_gguf(h: &GgufHeader) -> Result<Self> {
        let arch_name = h
            .get(ARCHITECTURE)
            .ok_or_else(|| Error::MissingKey(ARCHITECTURE.into()))?
            .as_str()
            .ok_or_else(|| bad(ARCHITECTURE, "not a string"))?;
        let arch = Architecture::from_name(arch_name)?;
        let a = arch.name();
        let int = |k: ArchKey| -> Result<usize> {
            let key = k.key(a);
            let v = h.get(&key).ok_or_else(|| Error::MissingKey(key.clone()))?;
            match v.as_u64() {
                Some(x) if x > 0 && x <= 1 << 24 => Ok(x as usize),
                _ => Err(bad(
                    &key,
                    &format!("expected a positive integer, got {}", v.summary(40)),
                )),
            }
        };
        let float = |k: ArchKey, default: Option<f64>| -> Result<f32> {
            let key = k.key(a);
            match (h.get(&key), default) {
                (Some(v), _) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                    _ => Err(bad(
                        &key,
                        &format!("expected a positive number, got {}", v.summary(40)),
                    )),
                },
                (None, Some(d)) => Ok(d as f32),
                (None, None) => Err(Error::MissingKey(key)),
            }
        };
        let n_layers = int(ArchKey::BlockCount)?;
        let d_model = int(ArchKey::EmbeddingLength)?;
        let n_ff = int(ArchKey::FeedForwardLength)?;
        let n_heads = int(ArchKey::HeadCount)?;
        let n_kv_heads = int(ArchKey::HeadCountKv)?;
        let context_length = int(ArchKey::ContextLength)?;
        if d_model % n_heads != 0 {
            return Err(bad(
                &ArchKey::HeadCount.key(a),
                &format!("{n_heads} does not divide d_model {d_model}"),
            ));
        }
        if n_kv_heads > n_heads || n_heads % n_kv_heads != 0 {
            return Err(bad(
                &ArchKey::HeadCountKv.key(a),
                &format!("{n_kv_heads} kv heads cannot serve {n_heads} query heads"),
            ));
        }
        let head_dim = d_model / n_heads;
        if head_dim % 2 != 0 {
            return Err(bad(
                &ArchKey::HeadCount.key(a),
                &format!("head_dim {head_dim} is odd"),
            ));
        }
        if h.get(&ArchKey::RopeDimensionCount.key(a)).is_some()
            && int(ArchKey::RopeDimensionCount)? != head_dim
        {
            return Err(bad(
                &ArchKey::RopeDimensionCount.key(a),
                "partial rotary embeddings are not supported",
            ));
        }
        // The vocabulary size: explicit key, else the tokenizer's token list, else the embedding rows.
        let vocab_size = match h.get(&ArchKey::VocabSize.key(a)) {
            Some(_) => int(ArchKey::VocabSize)?,
            None => match h.get(TOK_TOKENS).and_then(|v| v.as_array()) {
                Some(t) => t.len(),
                None => {
                    let e = GlobalTensor::TokenEmbd.name();
                    h.tensor(&e).ok_or(Error::MissingTensor(e))?.n_rows()
                }
            },
        };
        Ok(Self {
            arch,
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length,
            rope_theta: float(ArchKey::RopeFreqBase, Some(10_000.0))?,
            rope_style: arch.rope_style(),
            rms_eps: float(ArchKey::RmsEps, None)?,
            qkv_bias: arch.qkv_bias(),
            tied_output: h.tensor(&GlobalTensor::Output.name()).is_none(),
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

fn bad(key: &str, reason: &str) -> Error {
    Error::BadKey {
        key: key.into(),
        reason: reason.into(),
    }
}
