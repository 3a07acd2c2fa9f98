//! Gemma 2 and 3 (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`, and GGUF `gemma2` / `gemma3`):
//! the llama block with
//! - a GeGLU MLP (GELU's tanh approximation gates the up projection);
//! - token embeddings scaled by `sqrt(d_model)`, and the output head tied to them;
//! - RMSNorm gains stored as `w - 1` in checkpoints (the norm multiplies by `1 + w`; a GGUF
//!   stores `w` itself, as llama.cpp's converter adds the 1);
//! - norms of each block's output as well as its input ("sandwich" norms);
//! - attention scaled by `query_pre_attn_scalar^-1/2`, local sliding-window layers between
//!   global ones (Gemma 2: every other layer; Gemma 3: five of every six), each kind with its
//!   own RoPE base in Gemma 3 (local 10^4 unscaled; global 10^6, linearly scaled on 4B+);
//! - Gemma 2's soft caps of the attention scores and of the final logits; Gemma 3's RMSNorm of
//!   each query and key head.
use super::llama::Rope;
use super::{layer_name, sliding_window, HfJson};
use crate::model::config::{bad, Architecture, AttnConfig, MlpKind, ModelConfig};
use crate::Result;

/// Which Gemma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gemma {
    Two,
    Three,
}

impl Gemma {
    /// Layer `l` is a local (sliding-window) one unless `layer_types` says otherwise: every
    /// other layer from the first (Gemma 2), or five of every `pattern` (Gemma 3, 6).
    fn local(self, l: usize, pattern: usize) -> bool {
        match self {
            Gemma::Two => l.is_multiple_of(2),
            Gemma::Three => l % pattern < pattern - 1,
        }
    }
}

pub fn hf_config(j: &HfJson, g: Gemma) -> Result<ModelConfig> {
    let d_model = j.int("hidden_size")?;
    let n_layers = j.int("num_hidden_layers")?;
    let head_dim = j.int_or("head_dim", 256)?;
    let act = match j.get("hidden_activation") {
        Some(_) => j.str_or("hidden_activation", "")?,
        None => j.str_or("hidden_act", "gelu_pytorch_tanh")?,
    };
    if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh") {
        return Err(bad(
            "hidden_activation",
            &format!("`{act}` is not supported (gelu_pytorch_tanh)"),
        ));
    }
    if j.bool_or("use_bidirectional_attention", false)? {
        return Err(bad(
            "use_bidirectional_attention",
            "bidirectional attention (an embedding model) is not supported",
        ));
    }
    let pattern = j.int_or("sliding_window_pattern", 6)?;
    let mut attn = sliding_window(j, n_layers, |l| g.local(l, pattern))?;
    attn.scale = Some(1.0 / j.float_or("query_pre_attn_scalar", head_dim as f64)?.sqrt());
    attn.softcap = softcap(j, "attn_logit_softcapping")?;
    let (rope, local_rope_theta) = match g {
        Gemma::Two => (super::llama::rope_theta(j)?, None),
        Gemma::Three => gemma3_rope(j)?,
    };
    let arch = match g {
        Gemma::Two => Architecture::Gemma2,
        Gemma::Three => Architecture::Gemma3,
    };
    Ok(ModelConfig {
        local_rope_theta,
        mlp: MlpKind::GeGlu,
        qkv_bias: j.bool_or("attention_bias", false)?,
        out_bias: j.bool_or("attention_bias", false)?,
        qk_norm: g == Gemma::Three,
        attn,
        post_norms: true,
        embed_scale: Some((d_model as f32).sqrt()),
        final_softcap: softcap(j, "final_logit_softcapping")?,
        norm_plus_one: true,
        tied_output: j.bool_or("tie_word_embeddings", true)?,
        ..super::llama::base(j, arch, head_dim, rope)?
    })
}

/// A soft cap (null or absent: none).
fn softcap(j: &HfJson, key: &str) -> Result<Option<f32>> {
    Ok(match j.get(key) {
        Some(_) => Some(j.float_or(key, 1.0)?),
        None => None,
    })
}

/// Gemma 3's RoPE: the global layers' base and scaling, and the local layers' base. In
/// transformers 5's `rope_parameters` per layer type (`full_attention`, `sliding_attention`);
/// before, `rope_theta` and `rope_scaling` (global) and `rope_local_base_freq`.
fn gemma3_rope(j: &HfJson) -> Result<(Rope, Option<f32>)> {
    let per_type = j
        .get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some());
    let Some(p) = per_type else {
        let global = super::llama::rope_theta(j)?;
        return Ok((global, Some(j.float_or("rope_local_base_freq", 1e4)?)));
    };
    let global = serde_json::json!({ "rope_parameters": p["full_attention"] });
    let global = super::llama::rope_theta(&HfJson(&global))?;
    let local = match p.get("sliding_attention") {
        Some(l) => {
            let local = serde_json::json!({ "rope_parameters": l });
            match super::llama::rope_theta(&HfJson(&local))? {
                (theta, None) => theta,
                (_, Some(_)) => {
                    return Err(bad(
                        "rope_parameters.sliding_attention",
                        "scaled RoPE on the local layers is not supported",
                    ))
                }
            }
        }
        None => 1e4,
    };
    Ok((global, Some(local)))
}

/// The local layers of a Gemma GGUF: `{arch}.attention.sliding_window_pattern` as one flag a
/// layer, or as a period, else the family's.
pub fn gguf_local_layers(
    g: Gemma,
    n_layers: usize,
    pattern: Option<&[bool]>,
    period: Option<usize>,
) -> Vec<bool> {
    match pattern {
        Some(p) if p.len() == n_layers => p.to_vec(),
        _ => {
            let period = period.unwrap_or(6).max(1);
            (0..n_layers).map(|l| g.local(l, period)).collect()
        }
    }
}

/// Gemma's attention scale in a GGUF, as llama.cpp derives it: `1/sqrt(d_model / n_heads)` for
/// the 27B models (Gemma 2: 46 layers, Gemma 3: 62), `1/sqrt(head_dim)` otherwise.
pub fn gguf_attn_scale(
    g: Gemma,
    n_layers: usize,
    d_model: usize,
    n_heads: usize,
    head_dim: usize,
) -> f32 {
    let big = match g {
        Gemma::Two => n_layers == 46,
        Gemma::Three => n_layers == 62,
    };
    let width = if big { d_model / n_heads } else { head_dim };
    1.0 / (width as f32).sqrt()
}

/// The plain attention config of a Gemma GGUF, its window and scale filled in by the caller.
pub fn gguf_attn(
    window: Option<usize>,
    local: Vec<bool>,
    scale: f32,
    softcap: Option<f32>,
) -> AttnConfig {
    AttnConfig {
        scale: Some(scale),
        softcap,
        ..AttnConfig::windowed(window, local)
    }
}

/// Checkpoint name (with or without the `model.` prefix) to canonical (llama.cpp's) name:
/// Gemma's four norms of a block; everything else as llama names it.
pub fn canonical_name(name: &str) -> Option<String> {
    let norm = layer_name(name.strip_prefix("model.").unwrap_or(name), |rest| {
        let canonical = match rest {
            "post_attention_layernorm.weight" => "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
            "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
            _ => return None,
        };
        Some(canonical.to_string())
    });
    norm.or_else(|| super::llama::canonical_name(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_layers_follow_each_family() {
        let g2 = gguf_local_layers(Gemma::Two, 4, None, None);
        assert_eq!(g2, [true, false, true, false]);
        let g3 = gguf_local_layers(Gemma::Three, 8, None, None);
        assert_eq!(g3, [true, true, true, true, true, false, true, true]);
        let listed = [false, true, true];
        assert_eq!(
            gguf_local_layers(Gemma::Three, 3, Some(&listed), None),
            listed
        );
        assert_eq!(gguf_attn_scale(Gemma::Two, 46, 4608, 32, 128), 1.0 / 12.0);
        assert_eq!(gguf_attn_scale(Gemma::Three, 26, 1152, 4, 256), 1.0 / 16.0);
        assert_eq!(
            canonical_name("model.layers.2.post_attention_layernorm.weight").as_deref(),
            Some("blk.2.post_attention_norm.weight")
        );
    }
}
