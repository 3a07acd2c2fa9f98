//! Autoregressive generation: prefill the prompt as one batch, then decode token by token,
//! streaming text as it becomes valid UTF-8.
use crate::engine::executor::{Logits, Plan};
use crate::engine::kv_cache::KvCache;
use crate::engine::Engine;
use crate::text::sampling::Sampler;
use crate::{Error, Result};
use std::time::Instant;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Stop {
    /// The model produced an end-of-generation token.
    #[default]
    EndOfGeneration,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context window is full.
    ContextFull,
}

#[derive(Debug, Clone, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    pub decode_secs: f64,
    pub stop: Stop,
}

impl GenerateStats {
    pub fn prompt_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs.max(1e-9)
    }
    /// Decode speed over the tokens after the first (the first comes from the prefill's logits).
    pub fn decode_tok_per_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Feed `new_tokens` (appended after what the cache holds) and generate up to `max_tokens`,
/// calling `on_text` with each new piece of text. Stops at an end-of-generation token, at
/// `max_tokens`, or when the context is full. Returns the generated ids (the end token excluded).
pub fn generate(
    engine: &Engine,
    cache: &mut KvCache,
    new_tokens: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    plan: Plan,
    mut on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats)> {
    if new_tokens.is_empty() {
        return Err(Error::Invalid(
            "the prompt is empty: nothing to condition on".into(),
        ));
    }
    let total = cache.len() + new_tokens.len();
    if total >= cache.n_ctx() {
        return Err(Error::ContextOverflow {
            n_tokens: total,
            n_ctx: cache.n_ctx(),
        });
    }
    let exec = engine.executor();
    let eog = &engine.tokenizer.end_of_generation;
    let mut stats = GenerateStats {
        prompt_tokens: new_tokens.len(),
        ..Default::default()
    };
    let mut history: Vec<u32> = new_tokens.to_vec();
    let t0 = Instant::now();
    let mut logits = exec.run(new_tokens, cache, plan, Logits::Last)?;
    stats.prompt_secs = t0.elapsed().as_secs_f64();

    let mut out = Vec::new();
    let mut stream = TextStream::default();
    let t1 = Instant::now();
    stats.stop = Stop::MaxTokens;
    while out.len() < max_tokens {
        let next = sampler.sample(logits, &history);
        if eog.contains(&next) {
            stats.stop = Stop::EndOfGeneration;
            break;
        }
        out.push(next);
        history.push(next);
        if let Some(piece) = stream.push(engine, next)? {
            on_text(&piece);
        }
        if out.len() == max_tokens {
            break;
        }
        if cache.len() + 1 >= cache.n_ctx() {
            stats.stop = Stop::ContextFull;
            break;
        }
        logits = exec.run(&[next], cache, plan, Logits::Last)?;
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.generated_tokens = out.len();
    if let Some(rest) = stream.finish(engine)? {
        on_text(&rest);
    }
    Ok((out, stats))
}

/// Incremental detokenizer: emits text only once it no longer ends in an incomplete UTF-8
/// sequence (decoded as U+FFFD), so multi-token characters print whole.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream {
    pub fn push(&mut self, engine: &Engine, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = engine.tokenizer.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}')
            || text.len() <= self.printed
            || !text.is_char_boundary(self.printed)
        {
            return Ok(None);
        }
        let piece = text[self.printed..].to_string();
        self.printed = text.len();
        Ok(Some(piece))
    }
    pub fn finish(&mut self, engine: &Engine) -> Result<Option<String>> {
        let text = engine.tokenizer.decode(&self.ids)?;
        Ok(
            (text.len() > self.printed && text.is_char_boundary(self.printed))
                .then(|| text[self.printed..].to_string()),
        )
    }
}
