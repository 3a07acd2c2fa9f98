//! OPT (`OPTForCausalLM`, the paper's models), every configuration of the family:
//! - learned positional embeddings, position `p` at row `p + 2` (OPT's offset);
//! - LayerNorm with bias before each block (pre-LN), or after each residual add when
//!   `do_layer_norm_before` is false (post-LN, opt-350m); gains and biases absent when
//!   `layer_norm_elementwise_affine` is false; the final LayerNorm only in pre-LN models without
//!   `_remove_final_layer_norm`;
//! - `project_in` / `project_out` when `word_embed_proj_dim` differs from `hidden_size`;
//! - multi-head attention with biases on Q, K, V and the output (`enable_bias`), queries scaled by
//!   `head_dim^-1/2` (the usual attention scale);
//! - fc1, ReLU, fc2 with biases; the output head tied to the token embedding.
use super::{layer_name, HfJson};
use crate::model::config::{
    bad, Architecture, AttnConfig, MlpKind, ModelConfig, NormKind, Positions,
};
use crate::Result;

pub fn hf_config(j: &HfJson) -> Result<ModelConfig> {
    let act = j.str_or("activation_function", "relu")?;
    if act != "relu" {
        return Err(bad(
            "activation_function",
            &format!("`{act}` is not supported (relu)"),
        ));
    }
    let d_model = j.int("hidden_size")?;
    let n_heads = j.int("num_attention_heads")?;
    let pre_norm = j.bool_or("do_layer_norm_before", true)?;
    let bias = j.bool_or("enable_bias", true)?;
    Ok(ModelConfig {
        arch: Architecture::Opt,
        n_layers: j.int("num_hidden_layers")?,
        d_model,
        n_ff: j.int("ffn_dim")?,
        n_heads,
        n_kv_heads: n_heads,
        head_dim: d_model / n_heads,
        vocab_size: j.int("vocab_size")?,
        context_length: j.int("max_position_embeddings")?,
        positions: Positions::Learned { offset: 2 },
        norm: NormKind::Layer,
        norm_eps: 1e-5,
        norm_affine: j.bool_or("layer_norm_elementwise_affine", true)?,
        pre_norm,
        final_norm: pre_norm && !j.bool_or("_remove_final_layer_norm", false)?,
        mlp: MlpKind::Relu,
        qkv_bias: bias,
        out_bias: bias,
        mlp_bias: bias,
        qk_norm: false,
        attn: AttnConfig::plain(),
        rope_scaling: None,
        local_rope_theta: None,
        post_norms: false,
        embed_scale: None,
        final_softcap: None,
        norm_plus_one: false,
        tied_output: j.bool_or("tie_word_embeddings", true)?,
        d_embed: j.int_or("word_embed_proj_dim", d_model)?,
    })
}

/// Checkpoint name (`model.decoder.*`, or `decoder.*` as some facebook/opt files have) to
/// canonical name.
pub fn canonical_name(name: &str) -> Option<String> {
    if name == "lm_head.weight" {
        return Some("output.weight".into());
    }
    let name = name.strip_prefix("model.").unwrap_or(name);
    let name = name.strip_prefix("decoder.")?;
    let global = match name {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "embed_positions.weight" => Some("position_embd.weight"),
        "project_in.weight" => Some("proj_in.weight"),
        "project_out.weight" => Some("proj_out.weight"),
        "final_layer_norm.weight" => Some("output_norm.weight"),
        "final_layer_norm.bias" => Some("output_norm.bias"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.into());
    }
    layer_name(name, |rest| {
        let (module, kind) = rest.rsplit_once('.')?;
        let base = match module {
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.out_proj" => "attn_output",
            "self_attn_layer_norm" => "attn_norm",
            "final_layer_norm" => "ffn_norm",
            "fc1" => "ffn_up",
            "fc2" => "ffn_down",
            _ => return None,
        };
        let kind = match kind {
            "weight" => "weight",
            "bias" => "bias",
            _ => return None,
        };
        Some(format!("{base}.{kind}"))
    })
}
