//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it (tests/reference, made by tools/llama_reference.py):
//! split the tokenized text into `floor(n / ctx)` chunks of `ctx` tokens, evaluate each from an
//! empty cache, and score the second half: logits at positions `ctx/2 .. ctx-1` predict the tokens
//! at `ctx/2 + 1 .. ctx`. `ppl = exp(mean NLL)`. For a model that takes a BOS, the text is
//! tokenized with it first and each chunk's first token is replaced by it (as llama-perplexity
//! does; see [`crate::model::tokenizer::Tokenizer::encode_document`]).
use crate::exec::{Decoder, Engine, Logits, Sessions};
use crate::sparsity::policy::Policy;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct PerplexityResult {
    pub ppl: f64,
    /// The standard error of `ppl` from the scored tokens' NLL spread (llama-perplexity's
    /// "+/-"; 0 where not tracked).
    pub ppl_err: f64,
    pub n_chunks: usize,
    pub n_scored: usize,
    pub mean_nll: f64,
}

impl PerplexityResult {
    /// From the summed NLL of `n_scored` tokens over `n_chunks` chunks; a non-finite result
    /// (NaN or infinite logits) is an error, never a figure.
    fn of(nll_sum: f64, n_scored: usize, n_chunks: usize) -> Result<Self> {
        let mean_nll = nll_sum / n_scored as f64;
        if !mean_nll.is_finite() {
            return Err(Error::Invalid(format!(
                "perplexity is not finite (mean NLL {mean_nll} over {n_scored} tokens): the \
                 model computed NaN or infinite logits"
            )));
        }
        Ok(Self {
            ppl: mean_nll.exp(),
            ppl_err: 0.0,
            n_chunks,
            n_scored,
            mean_nll,
        })
    }
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

/// `tokens` scored in chunks of `ctx` on `dec` (a dense sequence, or any policy's), each chunk
/// from an empty cache, fed as `feed` says.
pub fn perplexity(
    engine: &Engine,
    dec: &mut dyn Decoder,
    tokens: &[u32],
    ctx: usize,
    feed: Feed,
    mut on_chunk: impl FnMut(usize, usize, f64),
) -> Result<PerplexityResult> {
    check_ctx(engine, dec.n_ctx(), tokens, ctx)?;
    let n_chunks = tokens.len() / ctx;
    let vocab = engine.model.config.vocab_size;
    let first = ctx / 2;
    let mut rows = Vec::new();
    let (mut nll_sum, mut nll2_sum, mut n_scored) = (0f64, 0f64, 0usize);
    let mut chunk_buf = Vec::new();
    for i in 0..n_chunks {
        let chunk = chunk_of(engine, tokens, i, ctx, &mut chunk_buf);
        dec.truncate(0);
        let logits: &[f32] = match feed {
            Feed::Batch => dec.run(chunk, Logits::Range(first, ctx - 1))?,
            Feed::TokenByToken => {
                dec.run(&chunk[..first], Logits::Last)?;
                rows.clear();
                for &t in &chunk[first..ctx - 1] {
                    rows.extend_from_slice(dec.run(&[t], Logits::Last)?);
                }
                &rows
            }
        };
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let target = chunk[first + j + 1] as usize;
            let l = nll(row, target);
            nll_sum += l;
            nll2_sum += l * l;
            n_scored += 1;
        }
        on_chunk(i + 1, n_chunks, (nll_sum / n_scored as f64).exp());
    }
    let mut r = PerplexityResult::of(nll_sum, n_scored, n_chunks)?;
    // As llama-perplexity: the mean NLL's standard error, carried through exp().
    let n = n_scored as f64;
    let var = (nll2_sum / n - r.mean_nll * r.mean_nll).max(0.0);
    r.ppl_err = r.ppl * (var / (n - 1.0).max(1.0)).sqrt();
    Ok(r)
}

fn check_ctx(engine: &Engine, n_ctx: usize, tokens: &[u32], ctx: usize) -> Result<()> {
    engine.require_real_weights("perplexity")?;
    if ctx < 4 {
        return Err(Error::Invalid(format!(
            "--ctx {ctx} is too small (at least 4)"
        )));
    }
    if ctx > n_ctx {
        return Err(Error::ContextOverflow {
            n_tokens: ctx,
            n_ctx,
        });
    }
    if tokens.len() < ctx {
        return Err(Error::Invalid(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}",
            tokens.len()
        )));
    }
    Ok(())
}

/// Chunk `i` of `tokens`, its first token the BOS when the model takes one.
fn chunk_of<'a>(
    engine: &Engine,
    tokens: &'a [u32],
    i: usize,
    ctx: usize,
    buf: &'a mut Vec<u32>,
) -> &'a [u32] {
    let chunk = &tokens[i * ctx..(i + 1) * ctx];
    match engine.tokenizer.bos_prefix() {
        Some(bos) => {
            buf.clear();
            buf.extend_from_slice(chunk);
            buf[0] = bos;
            buf
        }
        None => chunk,
    }
}

/// `-log softmax(logits)[target]`, in f64.
pub fn nll(logits: &[f32], target: usize) -> f64 {
    -log_softmax(logits).nth(target).unwrap_or(f64::NEG_INFINITY)
}

/// A sparse policy against dense decoding on the same scored positions (both token by token).
#[derive(Debug, Clone)]
pub struct Comparison {
    pub dense: PerplexityResult,
    pub sparse: PerplexityResult,
    /// Mean KL(dense || sparse) of the next-token distributions, in nats.
    pub kl: f64,
    /// Fraction of positions where both put the same token first.
    pub top1_agreement: f64,
    /// What the sparse steps read and kept.
    pub steps: crate::eval::bench::StepTotals,
    /// Wall time of the scored decode steps, dense and sparse (interleaved token by token, so
    /// both see the same machine conditions).
    pub dense_secs: f64,
    pub sparse_secs: f64,
}

impl Comparison {
    /// Decode speedup of the policy over dense, measured on the scored steps.
    pub fn speedup(&self) -> f64 {
        self.dense_secs / self.sparse_secs.max(1e-12)
    }
}

/// Score `tokens` as [`perplexity`] with [`Feed::TokenByToken`], once dense and once under
/// `policy`, side by side. `on_chunk(i, n_chunks, dense_ppl, sparse_ppl)` after each chunk.
pub fn compare(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
    policy: &crate::sparsity::policy::Policy,
    mut on_chunk: impl FnMut(usize, usize, f64, f64),
) -> Result<Comparison> {
    let on_chunk = |i, n, d, s: &[f64]| on_chunk(i, n, d, s[0]);
    let mut r = compare_many(engine, on, tokens, ctx, &[policy], on_chunk, |_, _| {})?;
    Ok(r.remove(0))
}

/// How many tokens [`compare_many`] scores in `n_tokens` tokens cut into chunks of `ctx`: the
/// second half of each whole chunk, less its last token.
pub fn scored_tokens(n_tokens: usize, ctx: usize) -> usize {
    n_tokens / ctx.max(1) * ctx.saturating_sub(1 + ctx / 2)
}

/// [`compare`] for several policies in one pass: every scored token is decoded once dense and
/// once under each policy (each with its own cache), interleaved, so the timings of all policies
/// see the same machine conditions. `on_chunk(i, n_chunks, dense_ppl, sparse_ppls)` after each
/// chunk; `on_token(done, total)` after each scored token (for progress: a chunk of a report with
/// twenty policies takes minutes).
pub fn compare_many(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
    policies: &[&crate::sparsity::policy::Policy],
    mut on_chunk: impl FnMut(usize, usize, f64, &[f64]),
    mut on_token: impl FnMut(usize, usize),
) -> Result<Vec<Comparison>> {
    check_ctx(engine, on.n_ctx(), tokens, ctx)?;
    let n_chunks = tokens.len() / ctx;
    let vocab = engine.model.config.vocab_size;
    let first = ctx / 2;
    let total = scored_tokens(tokens.len(), ctx);
    let np = policies.len();
    let mut cd = on.open(&Policy::dense(&engine.model.config))?;
    let mut caches = (policies.iter())
        .map(|p| on.open(p))
        .collect::<Result<Vec<_>>>()?;
    let (mut nd, mut n, mut dense_secs) = (0f64, 0usize, 0f64);
    let mut acc = vec![(0f64, 0f64, 0usize, 0f64); np]; // nll, kl, agree, secs
    let mut steps = vec![crate::eval::bench::StepTotals::default(); np];
    let mut ld = vec![0f32; vocab];
    let mut chunk_buf = Vec::new();
    for i in 0..n_chunks {
        let chunk = chunk_of(engine, tokens, i, ctx, &mut chunk_buf);
        // The unscored half as a prompt: in batches, every unit (as a policy's prompt runs).
        for c in std::iter::once(&mut cd).chain(caches.iter_mut()) {
            c.truncate(0);
            c.run(&chunk[..first], Logits::Last)?;
        }
        for (j, &t) in chunk[first..ctx - 1].iter().enumerate() {
            let target = chunk[first + j + 1] as usize;
            let t0 = std::time::Instant::now();
            ld.copy_from_slice(cd.run(&[t], Logits::Last)?);
            dense_secs += t0.elapsed().as_secs_f64();
            nd += nll(&ld, target);
            let top = argmax(&ld);
            for k in 0..np {
                let t1 = std::time::Instant::now();
                let ls = caches[k].run(&[t], Logits::Last)?;
                acc[k].3 += t1.elapsed().as_secs_f64();
                acc[k].0 += nll(ls, target);
                acc[k].1 += kl_div(&ld, ls);
                acc[k].2 += (argmax(ls) == top) as usize;
                let Some(step) = caches[k].last_step()? else {
                    return Err(Error::Invalid(
                        "this decoder does not count its steps".into(),
                    ));
                };
                steps[k].add(step);
            }
            n += 1;
            on_token(n, total);
        }
        let ppls: Vec<f64> = acc.iter().map(|a| (a.0 / n as f64).exp()).collect();
        on_chunk(i + 1, n_chunks, (nd / n as f64).exp(), &ppls);
    }
    let result = |sum: f64| PerplexityResult::of(sum, n, n_chunks);
    acc.iter()
        .zip(steps)
        .map(|(a, steps)| {
            Ok(Comparison {
                dense: result(nd)?,
                sparse: result(a.0)?,
                kl: a.1 / n as f64,
                top1_agreement: a.2 as f64 / n as f64,
                steps,
                dense_secs,
                sparse_secs: a.3,
            })
        })
        .collect()
}

/// [`compare_many`] for policy specs (`--sparsity` strings), with a progress bar labelled
/// `what`; returns each parsed policy with its comparison.
pub fn compare_specs(
    engine: &Engine,
    on: &dyn Sessions,
    tokens: &[u32],
    ctx: usize,
    specs: &[String],
    predictors: Option<&crate::sparsity::predictors_file::Predictors>,
    what: &str,
) -> Result<Vec<(crate::sparsity::policy::Policy, Comparison)>> {
    let pols = specs
        .iter()
        .map(|s| engine.policy(s, predictors))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&crate::sparsity::policy::Policy> = pols.iter().collect();
    // Scored tokens, each decoded once dense and once per policy.
    let bar = crate::progress::bar(scored_tokens(tokens.len(), ctx) as u64, what);
    let on_token = |done, _| bar.set_position(done as u64);
    let rs = compare_many(engine, on, tokens, ctx, &refs, |_, _, _, _| {}, on_token)?;
    bar.finish_and_clear();
    Ok(pols.into_iter().zip(rs).collect())
}

/// `ln(sum(exp(logits)))`, computed from the largest logit (no overflow).
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max
}

fn log_softmax(logits: &[f32]) -> impl Iterator<Item = f64> + '_ {
    let lse = log_sum_exp(logits);
    logits.iter().map(move |&l| l as f64 - lse)
}

/// KL(p || q) of the softmax distributions of two logit vectors, in nats.
pub fn kl_div(p: &[f32], q: &[f32]) -> f64 {
    log_softmax(p)
        .zip(log_softmax(q))
        .map(|(lp, lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
        .max(0.0)
}

pub fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}
