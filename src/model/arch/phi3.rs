//! Phi-3 (`Phi3ForCausalLM`: Phi-3-mini, -small's dense siblings and -medium): the llama
//! block ([`super::llama`] parses its config) with Q, K and V in one matrix (`qkv_proj`: the
//! query rows, then the key rows, then the value rows) and gate and up in another
//! (`gate_up_proj`: gate rows first), RoPE in NeoX order, a sliding window on every layer.
//! LongRoPE (the 128k models, Phi-3.5) is refused by name.
//!
//! The fused matrices keep llama.cpp's names (`attn_qkv`, and `ffn_up` holding both gate and
//! up); the loader splits them into views of their row ranges ([`unfused`]), so the executor
//! sees the usual separate matrices and sparsity selects their rows as for llama.
use super::layer_name;

/// Checkpoint name (with or without the `model.` prefix) to canonical name.
pub fn canonical_name(name: &str) -> Option<String> {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    let fused = layer_name(rest, |r| {
        let c = match r {
            "self_attn.qkv_proj.weight" => "attn_qkv.weight",
            "mlp.gate_up_proj.weight" => "ffn_up.weight",
            _ => return None,
        };
        Some(c.to_string())
    });
    fused.or_else(|| super::llama::canonical_name(name))
}

/// The row ranges of a fused tensor `blk.{l}.{name}` of `rows` rows: `(canonical part, first
/// row, row count)`, for Phi-3's `attn_qkv` (`q_rows` query rows, then keys and values of
/// `kv_rows` each) and `ffn_up` (`2 * n_ff` rows: gate, then up). `None`: not fused.
pub fn unfused(
    name: &str,
    rows: usize,
    (q_rows, kv_rows, n_ff): (usize, usize, usize),
) -> Option<Vec<(String, usize, usize)>> {
    let (blk, rest) = name
        .rsplit_once('.')
        .map(|(a, _)| a)
        .and_then(|a| a.rsplit_once('.'))?;
    let part = |p: &str, from, n| (format!("{blk}.{p}.weight"), from, n);
    match rest {
        "attn_qkv" if rows == q_rows + 2 * kv_rows => Some(vec![
            part("attn_q", 0, q_rows),
            part("attn_k", q_rows, kv_rows),
            part("attn_v", q_rows + kv_rows, kv_rows),
        ]),
        "ffn_up" if rows == 2 * n_ff => {
            Some(vec![part("ffn_gate", 0, n_ff), part("ffn_up", n_ff, n_ff)])
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_names_and_rows_split_as_llama_cpp_lays_them_out() {
        assert_eq!(
            canonical_name("model.layers.3.self_attn.qkv_proj.weight").as_deref(),
            Some("blk.3.attn_qkv.weight")
        );
        assert_eq!(
            canonical_name("model.layers.0.mlp.gate_up_proj.weight").as_deref(),
            Some("blk.0.ffn_up.weight")
        );
        assert_eq!(
            canonical_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        let s = |v: &[(&str, usize, usize)]| {
            v.iter()
                .map(|(a, b, c)| (a.to_string(), *b, *c))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            unfused("blk.1.attn_qkv.weight", 96, (64, 16, 100)),
            Some(s(&[
                ("blk.1.attn_q.weight", 0, 64),
                ("blk.1.attn_k.weight", 64, 16),
                ("blk.1.attn_v.weight", 80, 16)
            ]))
        );
        assert_eq!(
            unfused("blk.12.ffn_up.weight", 200, (64, 16, 100)),
            Some(s(&[
                ("blk.12.ffn_gate.weight", 0, 100),
                ("blk.12.ffn_up.weight", 100, 100)
            ]))
        );
        // Already split, or of another width: left alone (the shape check reports it).
        assert_eq!(unfused("blk.1.ffn_up.weight", 100, (64, 16, 100)), None);
        assert_eq!(unfused("blk.1.attn_qkv.weight", 95, (64, 16, 100)), None);
        assert_eq!(unfused("output.weight", 200, (64, 16, 100)), None);
    }
}
