//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it (see shared/reference):
//! split the tokenized text into `floor(n / ctx)` chunks of `ctx` tokens, evaluate each from an
//! empty cache, and score the second half: logits at positions `ctx/2 .. ctx-1` predict the tokens
//! at `ctx/2 + 1 .. ctx`. `ppl = exp(mean NLL)`.
use crate::engine::Engine;
use crate::executor::Logits;
use crate::sparsity::SparsePlan;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct PerplexityResult {
    pub ppl: f64,
    pub n_chunks: usize,
    pub n_scored: usize,
    pub mean_nll: f64,
}

/// `on_chunk(i, n_chunks, running_ppl)` is called after each chunk.
/// How each chunk is evaluated. Both score the same positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    /// The whole chunk as one batch (the prefill kernels), as llama-perplexity does.
    Batch,
    /// The unscored first half as one batch, then every scored position one token at a time
    /// through the KV cache: the decode kernels, i.e. the quality of generated text.
    TokenByToken,
}

pub fn perplexity(
    engine: &Engine,
    tokens: &[u32],
    ctx: usize,
    plan: &SparsePlan,
    feed: Feed,
    mut on_chunk: impl FnMut(usize, usize, f64),
) -> Result<PerplexityResult> {
    if ctx < 4 {
        return Err(Error::Invalid(format!(
            "--ctx {ctx} is too small (at least 4)"
        )));
    }
    if ctx > engine.n_ctx {
        return Err(Error::ContextOverflow {
            n_tokens: ctx,
            n_ctx: engine.n_ctx,
        });
    }
    let n_chunks = tokens.len() / ctx;
    if n_chunks == 0 {
        return Err(Error::Invalid(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}",
            tokens.len()
        )));
    }
    let exec = engine.executor();
    let vocab = engine.model.config.vocab_size;
    let first = ctx / 2;
    let mut cache = engine.new_cache();
    let mut rows = Vec::new();
    let (mut nll_sum, mut n_scored) = (0f64, 0usize);
    for i in 0..n_chunks {
        let chunk = &tokens[i * ctx..(i + 1) * ctx];
        cache.clear();
        let logits: &[f32] = match feed {
            Feed::Batch => exec.forward(chunk, &mut cache, plan, Logits::Range(first, ctx - 1))?,
            Feed::TokenByToken => {
                exec.forward(&chunk[..first], &mut cache, plan, Logits::Last)?;
                rows.clear();
                for &t in &chunk[first..ctx - 1] {
                    rows.extend_from_slice(exec.forward(&[t], &mut cache, plan, Logits::Last)?);
                }
                &rows
            }
        };
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let target = chunk[first + j + 1] as usize;
            nll_sum += nll(row, target);
            n_scored += 1;
        }
        on_chunk(i + 1, n_chunks, (nll_sum / n_scored as f64).exp());
    }
    let mean_nll = nll_sum / n_scored as f64;
    Ok(PerplexityResult {
        ppl: mean_nll.exp(),
        n_chunks,
        n_scored,
        mean_nll,
    })
}

/// `-log softmax(logits)[target]`, in f64.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    lse - logits[target] as f64
}
