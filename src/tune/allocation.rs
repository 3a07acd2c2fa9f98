//! TEAL's greedy allocation of input sparsity across a layer's inputs (Liu et al., ICLR 2025,
//! "block-wise greedy optimization"), as `dejavu calibrate` runs it: from every input dense,
//! each round raises one input group's sparsity by [`STEP`], the group whose raise costs the
//! least quality per byte it saves, until the model-wide sparsity (the groups' sparsities
//! weighted by the weights that read them, [`weights`]) reaches [`MAX`]. Every round is a row of
//! the allocation (`InputStats::alloc`), and `teal:S` reads its groups' sparsities there.
//!
//! Three choices differ from TEAL's script, which scores a candidate by the L2 error of one
//! block's output on its dense input and keeps an allocation per block:
//! - the cost is the mean KL divergence of the model's next-token distribution from the dense
//!   model's, over calibration tokens run as masked batches (`Decoder::mask_batches`): what the
//!   quality gate of `recommended` measures, at the price of one pass of the whole model per
//!   candidate;
//! - one allocation serves every layer (four candidates a round, not four per layer), and a
//!   candidate's cost is divided by the bytes it saves, so a step of a small group (W_o) is not
//!   preferred only for being small;
//! - the search is lazy: a group's cost measured in an earlier round stands until the group is
//!   the cheapest, and is then measured again (about two passes a round instead of four).
use crate::eval::perplexity::kl_div;
use crate::exec::{Logits, Sessions};
use crate::model::config::ModelConfig;
use crate::sparsity::input::{InputStats, Score};
use crate::sparsity::policy::{InputRule, Policy};
use crate::Result;

/// How much one round raises a group's sparsity.
pub const STEP: f64 = 0.05;

/// The model-wide sparsity the search stops at (past it, `teal:S` is uniform).
pub const MAX: f64 = 0.6;

/// Calibration tokens each candidate runs (the first of the training split).
pub const TOKENS: usize = 256;

/// The highest sparsity a group is raised to.
const GROUP_MAX: f64 = 0.9;

/// The weights of a layer that read each input group (`Group::ALL` order): Q, K and V; W_o;
/// gate and up (or fc1); the down projection.
pub fn weights(c: &ModelConfig) -> [f64; 4] {
    let (d, qd, ff) = (
        c.d_model as f64,
        (c.n_heads * c.head_dim) as f64,
        c.n_ff as f64,
    );
    let first = if c.mlp.gated() { 2.0 } else { 1.0 };
    [
        d * (qd + 2.0 * c.kv_dim() as f64),
        qd * d,
        first * d * ff,
        ff * d,
    ]
}

/// The model-wide sparsity of groups at sparsities `s` weighted by `w`.
pub fn model_wide(w: &[f64; 4], s: &[f64; 4]) -> f64 {
    let total: f64 = w.iter().sum();
    w.iter().zip(s).map(|(w, s)| w * s).sum::<f64>() / total.max(f64::MIN_POSITIVE)
}

/// The allocation rows (see `InputStats::alloc`) that the greedy search finds on `tokens`
/// (up to [`TOKENS`]), in passes of `ctx` tokens on `on`, with `stats`' TEAL thresholds.
pub fn greedy(
    on: &dyn Sessions,
    stats: &InputStats,
    tokens: &[u32],
    ctx: usize,
) -> Result<Vec<[f32; 5]>> {
    let c = on.config();
    let w = weights(c);
    let tokens = &tokens[..tokens.len().min(TOKENS)];
    let chunks: Vec<&[u32]> = (tokens.chunks(ctx.max(2)))
        .filter(|ch| ch.len() >= 2)
        .collect();
    let dense = logits(on, &Policy::dense(c), &chunks)?;
    let cost = |s: [f64; 4]| -> Result<f64> {
        let mut pol = Policy::dense(c);
        pol.name = format!("teal allocation {s:?}");
        // TEAL's rule itself in every group (the allocation is about quality; a device's
        // choice to keep a slow group dense comes at run time).
        let mut rule = InputRule::groups(Score::Teal, model_wide(&w, &s), s, stats);
        rule.always = true;
        pol.inputs = Some(rule);
        mean_kl(on, &pol, &chunks, &dense)
    };
    let bar = crate::progress::bar((MAX * 100.0).round() as u64, "teal allocation (% sparsity)");
    let (mut s, mut at, mut rows) = ([0f64; 4], 0.0, Vec::new());
    // Lazy greedy: each group's last measured cost per byte (and its KL), and whether it was
    // measured at the current allocation. The cheapest by its last cost is measured afresh;
    // once the cheapest is fresh, it is taken.
    let mut last: [Option<(f64, f64, bool)>; 4] = [None; 4];
    while model_wide(&w, &s) < MAX - 1e-9 {
        let open = |g: usize| s[g] + STEP <= GROUP_MAX + 1e-9 && w[g] > 0.0;
        let pick = |last: &[Option<(f64, f64, bool)>; 4]| {
            (0..4).filter(|&g| open(g)).min_by(|&a, &b| {
                let key = |g: usize| last[g].map_or(f64::NEG_INFINITY, |(c, ..)| c);
                key(a).total_cmp(&key(b))
            })
        };
        let g = loop {
            let Some(g) = pick(&last) else { break None };
            if let Some((.., true)) = last[g] {
                break Some(g);
            }
            let mut t = s;
            t[g] += STEP;
            let kl = cost(t)?;
            let per_byte = (kl - at) / (model_wide(&w, &t) - model_wide(&w, &s));
            last[g] = Some((per_byte, kl, true));
        };
        let Some(g) = g else { break };
        let kl = last[g].map_or(at, |(_, kl, _)| kl);
        (s[g], at) = (s[g] + STEP, kl);
        last.iter_mut().flatten().for_each(|e| e.2 = false);
        let wide = model_wide(&w, &s);
        rows.push([
            wide as f32,
            s[0] as f32,
            s[1] as f32,
            s[2] as f32,
            s[3] as f32,
        ]);
        bar.set_position((wide * 100.0).round() as u64);
    }
    bar.finish_and_clear();
    Ok(rows)
}

/// Each chunk's rows of next-token logits under `pol`, the chunks one after another
/// (`[tokens][vocab]`), run as masked batches where `pol` has input thresholds.
fn logits(on: &dyn Sessions, pol: &Policy, chunks: &[&[u32]]) -> Result<Vec<f32>> {
    let mut session = on.open(pol)?;
    if pol.inputs.is_some() {
        session.mask_batches(true)?;
    }
    let mut out = Vec::new();
    for chunk in chunks {
        session.truncate(0);
        out.extend_from_slice(session.run(chunk, Logits::Range(0, chunk.len()))?);
    }
    Ok(out)
}

/// The mean over tokens of KL(dense || `pol`), `dense` from [`logits`] of the same chunks.
fn mean_kl(on: &dyn Sessions, pol: &Policy, chunks: &[&[u32]], dense: &[f32]) -> Result<f64> {
    let vocab = on.config().vocab_size;
    let got = logits(on, pol, chunks)?;
    let rows = got.len() / vocab.max(1);
    let kl: f64 = (dense.chunks_exact(vocab).zip(got.chunks_exact(vocab)))
        .map(|(p, q)| kl_div(p, q))
        .sum();
    Ok(kl / rows.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_wide_sparsity_weights_the_groups_by_their_weights() {
        let w = [3.0, 1.0, 4.0, 2.0];
        assert!((model_wide(&w, &[0.5; 4]) - 0.5).abs() < 1e-12);
        assert!((model_wide(&w, &[0.0, 1.0, 0.0, 0.0]) - 0.1).abs() < 1e-12);
        assert!((model_wide(&w, &[0.0, 0.0, 0.5, 0.5]) - 0.3).abs() < 1e-12);
    }
}
