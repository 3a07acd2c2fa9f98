//! The llama family from Hugging Face checkpoints: `LlamaForCausalLM` (SwiGLU, or gated ReLU when
//! `hidden_act` is `relu`, as ReluLLaMA and ProSparse ship), `MistralForCausalLM` (a sliding
//! window on every layer), `Qwen2ForCausalLM` (biases on Q, K and V) and `Qwen3ForCausalLM` (each query and key head RMS-normed before RoPE, a `head_dim` of
//! its own). RMSNorm before each block, RoPE, a gated MLP.
//!
//! Hugging Face stores Q and K rows in the order of NeoX-style RoPE (dimension `i` pairs with
//! `i + head_dim/2`); GGUF llama files permute them for interleaved RoPE. So a checkpoint runs
//! with [`RopeStyle::Neox`], and `dejavu quantize` permutes them back when it writes a llama GGUF.
use super::{layer_name, HfJson};
use crate::model::config::{
    bad, Architecture, AttnConfig, Llama3Scaling, MlpKind, ModelConfig, NormKind, Positions,
    RopeScaling,
};
use crate::Result;
use dejavu_backend_api::RopeStyle;

/// Which checkpoint class of the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    /// Llama with sliding-window attention on every layer (`sliding_window`, unless null).
    Mistral,
    /// Phi-3 (Phi-3-mini and -medium): fused QKV and gate-up matrices ([`super::phi3`]), a
    /// sliding window on every layer.
    Phi3,
    /// Biases on Q, K and V.
    Qwen2,
    /// Per-head RMSNorm on Q and K before RoPE, its own `head_dim`, no biases.
    Qwen3,
}

pub fn hf_config(j: &HfJson, family: Family) -> Result<ModelConfig> {
    let d_model = j.int("hidden_size")?;
    let n_heads = j.int("num_attention_heads")?;
    let head_dim = match j.get("head_dim") {
        Some(_) => j.int("head_dim")?,
        None if d_model.is_multiple_of(n_heads) => d_model / n_heads,
        None => return Err(bad("num_attention_heads", "does not divide hidden_size")),
    };
    let mlp = match j.str_or("hidden_act", "silu")? {
        "silu" => MlpKind::SwiGlu,
        "relu" => MlpKind::GatedRelu,
        other => {
            return Err(bad(
                "hidden_act",
                &format!("`{other}` is not supported (silu, relu)"),
            ))
        }
    };
    if j.bool_or("mlp_bias", false)? {
        return Err(bad("mlp_bias", "MLP biases are not supported for llama"));
    }
    let n_layers = j.int("num_hidden_layers")?;
    let attn = match family {
        Family::Mistral | Family::Phi3 => super::sliding_window(j, n_layers, |_| true)?,
        // Qwen's configs name a window they do not use unless `use_sliding_window` is set
        // (and then only from `max_window_layers` on).
        _ if j.bool_or("use_sliding_window", false)? => {
            return Err(bad(
                "use_sliding_window",
                "Qwen's sliding-window layers are not supported",
            ))
        }
        _ => AttnConfig::plain(),
    };
    // transformers 5 moves the factor into `rope_parameters`.
    let partial = [
        j.get("partial_rotary_factor"),
        j.get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor")),
    ];
    if partial
        .into_iter()
        .flatten()
        .any(|v| v.as_f64() != Some(1.0))
    {
        return Err(bad(
            "partial_rotary_factor",
            "partial rotary embeddings are not supported",
        ));
    }
    let attention_bias = j.bool_or("attention_bias", false)?;
    let qwen2 = family == Family::Qwen2;
    let arch = match family {
        Family::Llama | Family::Mistral => Architecture::Llama,
        Family::Phi3 => Architecture::Phi3,
        Family::Qwen2 => Architecture::Qwen2,
        Family::Qwen3 => Architecture::Qwen3,
    };
    Ok(ModelConfig {
        mlp,
        qkv_bias: qwen2 || attention_bias,
        out_bias: !qwen2 && attention_bias,
        qk_norm: family == Family::Qwen3,
        attn,
        tied_output: j.bool_or("tie_word_embeddings", false)?,
        ..base(j, arch, head_dim, rope_theta(j)?)?
    })
}

/// What every llama-style checkpoint reads alike: the shapes from the usual keys (`head_dim`
/// given), RMSNorm before each block and at the end, RoPE in NeoX order with `rope`'s base and
/// scaling; and llama's choices for the rest (SwiGLU, no biases, no head norms, plain
/// attention, an untied head, none of Gemma's extras), for a family to override.
pub(crate) fn base(
    j: &HfJson,
    arch: Architecture,
    head_dim: usize,
    (theta, rope_scaling): Rope,
) -> Result<ModelConfig> {
    let d_model = j.int("hidden_size")?;
    let n_heads = j.int("num_attention_heads")?;
    Ok(ModelConfig {
        arch,
        n_layers: j.int("num_hidden_layers")?,
        d_model,
        n_ff: j.int("intermediate_size")?,
        n_heads,
        n_kv_heads: j.int_or("num_key_value_heads", n_heads)?,
        head_dim,
        vocab_size: j.int("vocab_size")?,
        context_length: j.int("max_position_embeddings")?,
        positions: Positions::Rope {
            theta,
            style: RopeStyle::Neox,
        },
        rope_scaling,
        local_rope_theta: None,
        post_norms: false,
        embed_scale: None,
        final_softcap: None,
        norm_plus_one: false,
        norm: NormKind::Rms,
        norm_eps: j.float_or("rms_norm_eps", 1e-6)?,
        norm_affine: true,
        pre_norm: true,
        final_norm: true,
        mlp: MlpKind::SwiGlu,
        qkv_bias: false,
        out_bias: false,
        mlp_bias: false,
        qk_norm: false,
        attn: AttnConfig::plain(),
        tied_output: false,
        d_embed: d_model,
    })
}

/// RoPE's base and scaling, as a config reads them.
pub(crate) type Rope = (f32, Option<RopeScaling>);

/// RoPE's base (`rope_theta`, or `rope_parameters.rope_theta` in transformers 5) and its
/// scaling: none (`default`), `linear` (`factor`) or Llama 3's (`llama3`, with `factor`,
/// `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`). Other
/// scalings (dynamic, YaRN, LongRoPE) are refused by name rather than run wrong.
pub(crate) fn rope_theta(j: &HfJson) -> Result<Rope> {
    // Both keys are read (null is absent; anything else must be an object): a scaling named
    // under either is run or refused, never dropped because the other key is there too.
    let kind_of = |v: &serde_json::Value| v.get("rope_type").or_else(|| v.get("type")).cloned();
    let mut given = Vec::new();
    for key in ["rope_parameters", "rope_scaling"] {
        match j.get(key) {
            None | Some(serde_json::Value::Null) => {}
            Some(v) if v.is_object() => given.push((key, v)),
            Some(v) => {
                return Err(bad(
                    key,
                    &format!("{v} is not an object of RoPE parameters"),
                ))
            }
        }
    }
    let typed = |(_, v): &&(&str, &serde_json::Value)| kind_of(v).is_some_and(|t| t != "default");
    if let [a, b] = &given[..] {
        if typed(&a) && typed(&b) && kind_of(a.1) != kind_of(b.1) {
            return Err(bad(
                "rope_scaling",
                "rope_parameters and rope_scaling name different RoPE scalings",
            ));
        }
    }
    let Some(&(key, p)) = given.iter().find(typed).or(given.first()) else {
        return Ok((j.float_or("rope_theta", 10_000.0)?, None));
    };
    let p = HfJson(p);
    let kind = p.get("rope_type").or_else(|| p.get("type"));
    let theta = match given.iter().find(|(_, v)| v.get("rope_theta").is_some()) {
        Some((_, v)) => HfJson(v).float_or("rope_theta", 1e4)?,
        None => j.float_or("rope_theta", 10_000.0)?,
    };
    let scaling = match kind.and_then(|t| t.as_str()) {
        None | Some("default") => None,
        Some("linear") => Some(RopeScaling::Linear {
            factor: p.float_or("factor", 1.0)?,
        }),
        Some("llama3") => Some(RopeScaling::Llama3(Llama3Scaling {
            factor: p.float_or("factor", 8.0)?,
            low_freq_factor: p.float_or("low_freq_factor", 1.0)?,
            high_freq_factor: p.float_or("high_freq_factor", 4.0)?,
            original_context: p.int("original_max_position_embeddings")?,
        })),
        Some(other) => {
            return Err(bad(
                key,
                &format!("RoPE scaling `{other}` is not supported (default, linear, llama3)"),
            ))
        }
    };
    if let Some(RopeScaling::Llama3(s)) = scaling {
        if s.high_freq_factor <= s.low_freq_factor {
            return Err(bad(key, "high_freq_factor must exceed low_freq_factor"));
        }
    }
    Ok((theta, scaling))
}

/// Checkpoint name (with or without the `model.` prefix) to canonical name.
pub fn canonical_name(name: &str) -> Option<String> {
    if let Some(g) = super::global_name(name) {
        return Some(g);
    }
    layer_name(name.strip_prefix("model.").unwrap_or(name), |rest| {
        let canonical = match rest {
            "input_layernorm.weight" => "attn_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.q_proj.bias" => "attn_q.bias",
            "self_attn.k_proj.bias" => "attn_k.bias",
            "self_attn.v_proj.bias" => "attn_v.bias",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "self_attn.o_proj.bias" => "attn_output.bias",
            "self_attn.q_norm.weight" => "attn_q_norm.weight",
            "self_attn.k_norm.weight" => "attn_k_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            _ => return None,
        };
        Some(canonical.to_string())
    })
}
