//! The typed, validated model configuration, parsed once: from GGUF metadata here, from a Hugging
//! Face `config.json` in the architecture family's file ([`crate::model::arch`]).
//!
//! Architecture quirks are fields (positions, norm kind and placement, MLP activation, biases,
//! tied output, embedding projection), so the executor reads the config, never the
//! architecture's name.
use crate::model::arch::gemma::{self, Gemma};
use crate::model::names::{ArchKey, GlobalTensor, LayerTensor, ARCHITECTURE, TOK_TOKENS};
use crate::{Error, Result};
use dejavu_backend_api::{Activation, RopeStyle, Scoring};
use dejavu_formats::gguf::GgufHeader;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma2,
    Gemma3,
    Opt,
}

impl Architecture {
    /// The GGUF architecture name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "phi3" => Ok(Architecture::Phi3),
            "gemma2" => Ok(Architecture::Gemma2),
            "gemma3" => Ok(Architecture::Gemma3),
            "opt" => Ok(Architecture::Opt),
            other => Err(Error::UnknownArchitecture(other.into())),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3",
            Architecture::Opt => "opt",
        }
    }
}

/// Which normalisation the blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x / rms(x) * w` (llama, qwen2).
    Rms,
    /// `(x - mean) / std * w + b` (OPT).
    Layer,
}

/// The MLP: gated (`down(act(gate x) * up x)`) or plain (`down(act(up x + b)) + b`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// SiLU-gated (llama, qwen2).
    SwiGlu,
    /// ReLU-gated (llama with `hidden_act: relu`: ReluLLaMA, ProSparse).
    GatedRelu,
    /// Gated by GELU's tanh approximation (Gemma).
    GeGlu,
    /// fc1, ReLU, fc2 (OPT).
    Relu,
}

impl MlpKind {
    pub fn gated(self) -> bool {
        !matches!(self, MlpKind::Relu)
    }
    pub fn activation(self) -> Activation {
        match self {
            MlpKind::SwiGlu => Activation::Silu,
            MlpKind::GatedRelu | MlpKind::Relu => Activation::Relu,
            MlpKind::GeGlu => Activation::GeluTanh,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            MlpKind::SwiGlu => "silu",
            MlpKind::GatedRelu | MlpKind::Relu => "relu",
            MlpKind::GeGlu => "gelu_tanh",
        }
    }
}

/// How positions enter the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Positions {
    /// Rotary embeddings on Q and K.
    Rope { theta: f32, style: RopeStyle },
    /// A learned table added to the embeddings; position `p` reads row `p + offset` (OPT: 2).
    Learned { offset: usize },
}

/// Llama 3's RoPE scaling (`rope_type: llama3`): the pairs whose wavelength exceeds
/// `original_context / low_freq_factor` turn `factor` times slower, those under
/// `original_context / high_freq_factor` keep their speed, and those between are interpolated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: usize,
}

/// RoPE scaling: every pair `factor` times slower (`linear`: Gemma 3's global layers), or Llama
/// 3's per-pair divisors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    Linear { factor: f32 },
    Llama3(Llama3Scaling),
}

impl RopeScaling {
    /// Each pair's frequency divisor.
    pub fn factors(&self, theta: f32, head_dim: usize) -> Vec<f32> {
        match self {
            RopeScaling::Linear { factor } => vec![*factor; head_dim / 2],
            RopeScaling::Llama3(s) => s.factors(theta, head_dim),
        }
    }
}

impl Llama3Scaling {
    /// Each pair's frequency divisor (llama.cpp's `rope_freqs`), as transformers'
    /// `_compute_llama3_parameters` scales the inverse frequencies, in f64.
    pub fn factors(&self, theta: f32, head_dim: usize) -> Vec<f32> {
        let (factor, low, high) = (
            self.factor as f64,
            self.low_freq_factor as f64,
            self.high_freq_factor as f64,
        );
        let old = self.original_context as f64;
        (0..head_dim / 2)
            .map(|i| {
                let inv = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                let f = if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32
            })
            .collect()
    }
}

/// How attention scores its keys, per layer: the scale, Gemma 2's soft cap, and sliding windows
/// (each query sees `window` positions, itself included, on the layers `local` marks: every
/// layer of Mistral and Phi-3, Gemma's local layers between its global ones).
#[derive(Debug, Clone, PartialEq)]
pub struct AttnConfig {
    /// The scores' scale; `None`: `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
    /// One flag a layer when `window` is set; empty otherwise.
    pub local: Vec<bool>,
}

impl AttnConfig {
    /// Every layer attends to every earlier position with the usual scale.
    pub fn plain() -> Self {
        AttnConfig {
            scale: None,
            softcap: None,
            window: None,
            local: Vec::new(),
        }
    }

    /// Sliding windows of `window` on the layers `local` marks (`None`: full attention).
    pub fn windowed(window: Option<usize>, local: Vec<bool>) -> Self {
        AttnConfig {
            window,
            local: if window.is_some() { local } else { Vec::new() },
            ..Self::plain()
        }
    }

    /// Layer `l`'s scoring, for heads `head_dim` wide.
    pub fn scoring(&self, l: usize, head_dim: usize) -> Scoring {
        let plain = Scoring::plain(head_dim);
        Scoring {
            scale: self.scale.unwrap_or(plain.scale),
            softcap: self.softcap,
            window: self.window.filter(|_| self.local.get(l) == Some(&true)),
        }
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
    pub positions: Positions,
    /// RoPE scaling of the (global) layers: linear, or Llama 3's, from a checkpoint's config
    /// (a Llama 3 GGUF ships the divisors as the tensor `rope_freqs.weight` instead).
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE's base on the sliding-window layers, unscaled (Gemma 3's local layers: 10^4);
    /// `None`: every layer's is the model's.
    pub local_rope_theta: Option<f32>,
    pub norm: NormKind,
    pub norm_eps: f32,
    /// Norms carry learned gains (and, for LayerNorm, biases); false for OPT's
    /// `layer_norm_elementwise_affine: false` (gain 1, bias 0).
    pub norm_affine: bool,
    /// Norm at the start of each block (pre-LN) or after each residual add (post-LN, opt-350m).
    pub pre_norm: bool,
    /// A norm before the output head.
    pub final_norm: bool,
    pub mlp: MlpKind,
    /// Q, K and V projections carry biases (qwen2, OPT).
    pub qkv_bias: bool,
    /// The attention output projection carries a bias (OPT).
    pub out_bias: bool,
    /// The MLP's projections carry biases (OPT's fc1, fc2).
    pub mlp_bias: bool,
    /// Each query and key head is RMS-normed (its own `head_dim` gains) before RoPE (qwen3).
    pub qk_norm: bool,
    /// Attention's scale, soft cap and sliding windows.
    pub attn: AttnConfig,
    /// Each block's output is normed before its residual add (Gemma 2 and 3: norms after
    /// attention and after the MLP as well as before).
    pub post_norms: bool,
    /// The token embeddings are multiplied by this (Gemma: `sqrt(d_model)`).
    pub embed_scale: Option<f32>,
    /// The logits are soft-capped: `c * tanh(logits / c)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// The checkpoint stores RMSNorm gains as `w - 1` (Gemma's norms multiply by `1 + w`; the
    /// loader adds the 1, as llama.cpp's converter does for a GGUF).
    pub norm_plus_one: bool,
    /// The output head is the token embedding (no `output.weight`).
    pub tied_output: bool,
    /// Width of the token embedding; when it differs from `d_model` (OPT's
    /// `word_embed_proj_dim`), `proj_in` and `proj_out` map between the two.
    pub d_embed: usize,
}

impl ModelConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    pub fn rope(&self) -> Option<(f32, RopeStyle)> {
        match self.positions {
            Positions::Rope { theta, style } => Some((theta, style)),
            Positions::Learned { .. } => None,
        }
    }

    /// Check the shape relations every executor relies on.
    pub fn validate(self) -> Result<Self> {
        let bad = |reason: String| Error::BadKey {
            key: format!("{} config", self.arch.name()),
            reason,
        };
        let dims = [
            self.n_layers,
            self.d_model,
            self.n_ff,
            self.n_heads,
            self.n_kv_heads,
            self.vocab_size,
            self.context_length,
            self.d_embed,
        ];
        if dims.iter().any(|&d| d == 0 || d > 1 << 24) {
            return Err(bad(format!(
                "dimensions {dims:?} must be positive and plausible"
            )));
        }
        if !(1..=1024).contains(&self.head_dim) {
            return Err(bad(format!(
                "head_dim {} is not in 1..=1024",
                self.head_dim
            )));
        }
        if self.n_kv_heads > self.n_heads || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(format!(
                "{} kv heads cannot serve {} query heads",
                self.n_kv_heads, self.n_heads
            )));
        }
        if self.rope().is_some() && !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {} is odd", self.head_dim)));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(bad(format!(
                "norm epsilon {} is not positive",
                self.norm_eps
            )));
        }
        let a = &self.attn;
        if a.window.is_some() && a.local.len() != self.n_layers {
            return Err(bad(format!(
                "{} sliding-window flags for {} layers",
                a.local.len(),
                self.n_layers
            )));
        }
        (0..self.n_layers)
            .try_for_each(|l| a.scoring(l, self.head_dim).check())
            .map_err(bad)?;
        if let Positions::Rope { theta, .. } = self.positions {
            if !(theta.is_finite() && theta > 0.0) {
                return Err(bad(format!("rope theta {theta} is not positive")));
            }
        }
        Ok(self)
    }

    pub fn from_gguf(h: &GgufHeader) -> Result<Self> {
        let arch_name = h
            .get(ARCHITECTURE)
            .ok_or_else(|| Error::MissingKey(ARCHITECTURE.into()))?
            .as_str()
            .ok_or_else(|| bad(ARCHITECTURE, "not a string"))?;
        let arch = Architecture::from_name(arch_name)?;
        let m = GgufMeta {
            h,
            arch: arch.name(),
        };
        let n_heads = m.int(ArchKey::HeadCount)?;
        let d_model = m.int(ArchKey::EmbeddingLength)?;
        let n_kv_heads = match m.has(ArchKey::HeadCountKv) {
            true => m.int(ArchKey::HeadCountKv)?,
            false => n_heads,
        };
        let rope_scaling = match h.get(&ArchKey::RopeScalingType.key(arch.name())) {
            None => None,
            Some(t) => match t.as_str() {
                Some("none") | Some("") => None,
                Some("linear") => Some(RopeScaling::Linear {
                    factor: m.float(ArchKey::RopeScalingFactor, None)?,
                }),
                _ => {
                    return Err(bad(
                        &ArchKey::RopeScalingType.key(arch.name()),
                        &format!("RoPE scaling {} is not supported (linear)", t.summary(20)),
                    ))
                }
            },
        };
        // qwen3 states its head width (128 on every size, whatever d_model / n_heads is).
        let head_dim = match m.has(ArchKey::KeyLength) {
            true => m.int(ArchKey::KeyLength)?,
            false if d_model.is_multiple_of(n_heads) => d_model / n_heads,
            false => {
                return Err(bad(
                    &ArchKey::HeadCount.key(arch.name()),
                    &format!("{n_heads} heads do not divide the hidden size {d_model}"),
                ))
            }
        };
        if m.has(ArchKey::ValueLength) && m.int(ArchKey::ValueLength)? != head_dim {
            return Err(bad(
                &ArchKey::ValueLength.key(arch.name()),
                "value heads wider or narrower than key heads are not supported",
            ));
        }
        if m.has(ArchKey::RopeDimensionCount) && m.int(ArchKey::RopeDimensionCount)? != head_dim {
            return Err(bad(
                &ArchKey::RopeDimensionCount.key(arch.name()),
                "partial rotary embeddings are not supported",
            ));
        }
        // The vocabulary size: explicit key, else the tokenizer's token list, else the embedding rows.
        let vocab_size = match m.has(ArchKey::VocabSize) {
            true => m.int(ArchKey::VocabSize)?,
            false => match h.get(TOK_TOKENS).and_then(|v| v.as_array()) {
                Some(t) => t.len(),
                None => {
                    let e = GlobalTensor::TokenEmbd.name();
                    h.tensor(&e).ok_or(Error::MissingTensor(e))?.n_rows()
                }
            },
        };
        let has = |t: GlobalTensor| h.tensor(&t.name()).is_some();
        let rope = |style| -> Result<Positions> {
            Ok(Positions::Rope {
                theta: m.float(ArchKey::RopeFreqBase, Some(10_000.0))?,
                style,
            })
        };
        let opt = arch == Architecture::Opt;
        let gemma = match arch {
            Architecture::Gemma2 => Some(Gemma::Two),
            Architecture::Gemma3 => Some(Gemma::Three),
            _ => None,
        };
        let mlp = match (opt, m.string(ArchKey::FeedForwardActivation)) {
            _ if gemma.is_some() => MlpKind::GeGlu,
            (true, None | Some("relu")) => MlpKind::Relu,
            (false, None | Some("silu")) => MlpKind::SwiGlu,
            (false, Some("relu")) => MlpKind::GatedRelu,
            (_, Some(other)) => {
                return Err(bad(
                    &ArchKey::FeedForwardActivation.key(arch.name()),
                    &format!("activation `{other}` is not supported (silu, relu)"),
                ))
            }
        };
        let has_layer = |t: LayerTensor| h.tensor(&t.name(0)).is_some();
        let n_layers = m.int(ArchKey::BlockCount)?;
        // llama.cpp's key; its mistral files (arch llama) leave it out and run full attention.
        // Gemma 2 files from before the key ran 4096 (llama.cpp's default for them).
        let window = match m.has(ArchKey::SlidingWindow) {
            true => Some(m.int(ArchKey::SlidingWindow)?),
            false if arch == Architecture::Gemma2 => Some(4096),
            false => None,
        };
        let attn = match gemma {
            None => AttnConfig::windowed(window, vec![true; n_layers]),
            Some(g) => {
                let key = ArchKey::SlidingWindowPattern.key(arch.name());
                let v = h.get(&key);
                let flags: Option<Vec<bool>> = match v.and_then(|v| v.as_array()) {
                    None => None,
                    Some(a) => Some(
                        (a.iter().map(|b| b.as_bool()).collect::<Option<Vec<bool>>>())
                            .filter(|f| f.len() == n_layers)
                            .ok_or_else(|| bad(&key, "expected one true or false a layer"))?,
                    ),
                };
                let period = v.and_then(|v| v.as_u64()).map(|p| p as usize);
                let period = period.or((g == Gemma::Two).then_some(2));
                let local = gemma::gguf_local_layers(g, n_layers, flags.as_deref(), period);
                let scale = match m.has(ArchKey::AttentionScale) {
                    true => m.float(ArchKey::AttentionScale, None)?,
                    false => gemma::gguf_attn_scale(g, n_layers, d_model, n_heads, head_dim),
                };
                let cap = m.optional_float(ArchKey::AttnLogitSoftcap)?;
                gemma::gguf_attn(window, local, scale, cap)
            }
        };
        let config = Self {
            arch,
            n_layers,
            d_model,
            n_ff: m.int(ArchKey::FeedForwardLength)?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length: m.int(ArchKey::ContextLength)?,
            rope_scaling,
            local_rope_theta: match gemma {
                Some(Gemma::Three) => Some(m.float(ArchKey::RopeFreqBaseSwa, Some(10_000.0))?),
                _ => None,
            },
            positions: match arch {
                Architecture::Llama => rope(RopeStyle::Interleaved)?,
                Architecture::Qwen2
                | Architecture::Qwen3
                | Architecture::Phi3
                | Architecture::Gemma2
                | Architecture::Gemma3 => rope(RopeStyle::Neox)?,
                Architecture::Opt => Positions::Learned { offset: 2 },
            },
            norm: if opt { NormKind::Layer } else { NormKind::Rms },
            norm_eps: match opt {
                true => m.float(ArchKey::LayerNormEps, Some(1e-5))?,
                false => m.float(ArchKey::RmsEps, None)?,
            },
            norm_affine: h.tensor(&LayerTensor::AttnNorm.name(0)).is_some(),
            pre_norm: !opt || m.flag(ArchKey::LayerNormBefore, true),
            final_norm: !opt || has(GlobalTensor::OutputNorm),
            mlp,
            // Biases are what the file holds (qwen2 always has Q/K/V biases).
            qkv_bias: arch == Architecture::Qwen2 || has_layer(LayerTensor::AttnQBias),
            out_bias: has_layer(LayerTensor::AttnOutputBias),
            mlp_bias: has_layer(LayerTensor::FfnUpBias),
            qk_norm: has_layer(LayerTensor::AttnQNorm),
            attn,
            post_norms: gemma.is_some(),
            embed_scale: gemma.map(|_| (d_model as f32).sqrt()),
            final_softcap: m.optional_float(ArchKey::FinalLogitSoftcap)?,
            norm_plus_one: false,
            tied_output: !has(GlobalTensor::Output),
            d_embed: match opt && m.has(ArchKey::EmbeddingProjection) {
                true => m.int(ArchKey::EmbeddingProjection)?,
                false => d_model,
            },
        };
        config.validate()
    }
}

/// Typed reads of `{arch}.*` keys.
struct GgufMeta<'a> {
    h: &'a GgufHeader,
    arch: &'static str,
}

impl GgufMeta<'_> {
    fn has(&self, k: ArchKey) -> bool {
        self.h.get(&k.key(self.arch)).is_some()
    }
    fn int(&self, k: ArchKey) -> Result<usize> {
        let key = k.key(self.arch);
        let v = self
            .h
            .get(&key)
            .ok_or_else(|| Error::MissingKey(key.clone()))?;
        match v.as_u64() {
            Some(x) if x > 0 && x <= 1 << 24 => Ok(x as usize),
            _ => Err(bad(
                &key,
                &format!("expected a positive integer, got {}", v.summary(40)),
            )),
        }
    }
    fn float(&self, k: ArchKey, default: Option<f64>) -> Result<f32> {
        let key = k.key(self.arch);
        match (self.h.get(&key), default) {
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
    }
    /// A positive number if the key is there (0, llama.cpp's "none", reads as absent).
    fn optional_float(&self, k: ArchKey) -> Result<Option<f32>> {
        match self.h.get(&k.key(self.arch)).and_then(|v| v.as_f64()) {
            None | Some(0.0) => Ok(None),
            Some(_) => self.float(k, None).map(Some),
        }
    }
    fn flag(&self, k: ArchKey, default: bool) -> bool {
        self.h
            .get(&k.key(self.arch))
            .and_then(|v| v.as_bool())
            .unwrap_or(default)
    }
    fn string(&self, k: ArchKey) -> Option<&str> {
        self.h.get(&k.key(self.arch)).and_then(|v| v.as_str())
    }
}

pub(crate) fn bad(key: &str, reason: &str) -> Error {
    Error::BadKey {
        key: key.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::Llama3Scaling;
    use super::{Architecture, Error};

    /// Issue 52: the error for an unknown architecture names every one that loads: each GGUF
    /// name `from_name` takes, and each Hugging Face class `arch::from_hf` takes (read off its
    /// source, so a new family cannot be left out of the message).
    #[test]
    fn the_unknown_architecture_error_lists_every_family() {
        let msg = Error::UnknownArchitecture("x".into()).to_string();
        for name in ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "opt"] {
            assert_eq!(Architecture::from_name(name).unwrap().name(), name);
            let listed = msg.contains(&format!(" {name},")) || msg.contains(&format!(" {name};"));
            assert!(listed, "{name}: {msg}");
        }
        let src = include_str!("arch/mod.rs");
        let classes: Vec<&str> = (src.split('"'))
            .filter(|w| w.ends_with("ForCausalLM") && !w.contains(' '))
            .collect();
        assert!(classes.len() >= 8, "{classes:?}");
        for c in classes {
            assert!(msg.contains(c), "{c}: {msg}");
        }
    }

    /// Llama 3's divisors for heads of 16 (theta 10^4, factor 8, low/high 1/4, original context
    /// 64), worked by hand from the formula: pair 0 (wavelength 6.28 < 64/4) keeps its speed;
    /// pairs 1 and 2 (19.87 and 62.83) are interpolated, smooth = (64/wavelength - 1) / 3 =
    /// 0.74037 and 0.0061972, divisor 1 / ((1 - smooth)/8 + smooth) = 1.29396 and 7.6674; pairs
    /// 3.. (198.7 and up > 64) turn 8 times slower.
    #[test]
    fn llama3_divisors_follow_the_wavelength_regimes() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 64,
        };
        let f = s.factors(10_000.0, 16);
        let want = [1.0, 1.29396, 7.6674, 8.0, 8.0, 8.0, 8.0, 8.0];
        assert_eq!(f.len(), 8);
        for (i, (got, want)) in f.iter().zip(want).enumerate() {
            assert!((got - want).abs() < 2e-4, "pair {i}: {got} against {want}");
        }
    }
}
