//! Input sparsity's calibration (`teal`, `wina`): each layer's four projection inputs over
//! calibration tokens, from dense batched passes, reduced to quantiles of their scores
//! ([`InputStats`]); `teal:S` then sets each threshold at the quantile `S`.
use crate::exec::{Engine, Sessions};
use crate::sparsity::input::InputStats;
use crate::Result;

/// Random tokens a synthetic model's thresholds are measured on.
pub const SYNTHETIC_TOKENS: usize = 64;

/// Calibration tokens the statistics use at most (the quantiles of 2048 tokens' values are
/// steady to a fraction of a percent of sparsity).
pub const MAX_TOKENS: usize = 2048;

/// The quantiles of every layer's inputs on `tokens` (up to [`MAX_TOKENS`]), in passes of
/// `ctx` tokens on `on`'s dense sessions; WINA's scores use the engine's weight-row norms.
pub fn input_stats(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
) -> Result<InputStats> {
    let c = &engine.model.config;
    let (_, norms) = engine.input_layout(crate::sparsity::layout::Form::Blocks)?;
    let tokens = &tokens[..tokens.len().min(MAX_TOKENS)];
    let what = "activations for the input thresholds";
    let (mut session, cap) = crate::tune::calibrate::captured(on, c, tokens, ctx, what)?;
    let mut st = InputStats::new();
    for (l, norms) in norms.layers.iter().enumerate() {
        let act = session.mlp_activations(l, &cap.mlp_in[l])?;
        st.push_layer(
            [&cap.attn_in[l], &cap.attn_out[l], &cap.mlp_in[l], &act],
            norms,
        )?;
    }
    Ok(st)
}
