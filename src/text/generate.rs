//! Autoregressive generation: prefill the prompt as one batch, then decode token by token,
//! streaming text as it becomes valid UTF-8.
use crate::exec::Decoder;
use crate::exec::Engine;
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
    /// A stop string appeared in the text.
    StopString,
    /// The caller's cancel flag was raised (Ctrl-C in `dejavu chat`).
    Cancelled,
}

/// What ends generation besides `max_tokens` and the context window.
#[derive(Debug, Clone, Default)]
pub struct StopRules {
    /// Text that ends the reply (itself not printed).
    pub stop: Vec<String>,
    /// Generate past end-of-generation tokens (they are never sampled).
    pub ignore_eos: bool,
    /// Raised by another thread (a signal handler) to stop after the current token; lowered
    /// again when seen.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
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

/// How many leading tokens of `ids` a cache holding `cached` can keep: their shared prefix, but
/// never all of `ids` (its last token is decoded again, for its logits). A chat that continues
/// feeds only `ids[reusable(..)..]` after `Decoder::truncate`.
pub fn reusable(cached: &[u32], ids: &[u32]) -> usize {
    let shared = cached.iter().zip(ids).take_while(|(a, b)| a == b).count();
    shared.min(ids.len().saturating_sub(1))
}

/// Refuse logits that are not finite (NaN or infinite weights or activations would otherwise
/// sample token 0 forever), and keep sampling inside the tokenizer's vocabulary (a checkpoint's
/// embedding may have padding rows past it, which have no text).
pub fn check_logits(engine: &Engine, logits: &mut [f32]) -> Result<()> {
    if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
        return Err(Error::Invalid(format!(
            "the model computed a non-finite logit (token {i}): its weights or activations are \
             NaN or overflow"
        )));
    }
    let n = engine.tokenizer.vocab_size().min(logits.len());
    logits[n..].fill(f32::NEG_INFINITY);
    Ok(())
}

/// Feed `new_tokens` (appended after what `dec` holds) and generate up to `max_tokens`,
/// calling `on_text` with each new piece of text. Stops at an end-of-generation token, at
/// `max_tokens`, or when the context is full. Returns the generated ids (the end token
/// excluded). `engine` gives the tokenizer.
pub fn generate_on(
    engine: &Engine,
    dec: &mut dyn Decoder,
    new_tokens: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats)> {
    let rules = StopRules::default();
    generate_with(
        engine, dec, new_tokens, max_tokens, sampler, &rules, on_text,
    )
}

/// [`generate_on`] under `rules` (stop strings, `ignore_eos`).
pub fn generate_with(
    engine: &Engine,
    dec: &mut dyn Decoder,
    new_tokens: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    rules: &StopRules,
    mut on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats)> {
    if new_tokens.is_empty() {
        return Err(Error::Invalid(
            "the prompt is empty: nothing to condition on".into(),
        ));
    }
    let total = dec.len() + new_tokens.len();
    if total >= dec.n_ctx() {
        return Err(Error::ContextOverflow {
            n_tokens: total,
            n_ctx: dec.n_ctx(),
        });
    }
    let eog = &engine.tokenizer.end_of_generation;
    let mut stats = GenerateStats {
        prompt_tokens: new_tokens.len(),
        ..Default::default()
    };
    let mut history: Vec<u32> = new_tokens.to_vec();
    let t0 = Instant::now();
    let mut logits = dec.decode(new_tokens)?;
    stats.prompt_secs = t0.elapsed().as_secs_f64();

    let mut out = Vec::new();
    let mut stream = TextStream::default();
    let mut stops = super::stop::StopFilter::new(&rules.stop);
    let t1 = Instant::now();
    stats.stop = Stop::MaxTokens;
    while out.len() < max_tokens {
        let cancelled = rules.cancel.as_ref();
        if cancelled.is_some_and(|c| c.swap(false, std::sync::atomic::Ordering::Relaxed)) {
            stats.stop = Stop::Cancelled;
            break;
        }
        check_logits(engine, logits)?;
        if rules.ignore_eos {
            for &e in eog {
                if let Some(l) = logits.get_mut(e as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let next = sampler.sample(logits, &history);
        if eog.contains(&next) {
            stats.stop = Stop::EndOfGeneration;
            break;
        }
        out.push(next);
        history.push(next);
        if let Some(piece) = stream.push(engine, next)? {
            let (text, stopped) = stops.push(&piece);
            if !text.is_empty() {
                on_text(&text);
            }
            if stopped {
                stats.stop = Stop::StopString;
                break;
            }
        }
        if out.len() == max_tokens {
            break;
        }
        if dec.len() + 1 >= dec.n_ctx() {
            stats.stop = Stop::ContextFull;
            break;
        }
        logits = dec.decode(&[next])?;
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.generated_tokens = out.len();
    if stats.stop != Stop::StopString {
        let rest = stream.finish(engine)?.unwrap_or_default();
        let (mut text, stopped) = stops.push(&rest);
        if stopped {
            stats.stop = Stop::StopString;
        } else {
            text.push_str(&stops.flush());
        }
        if !text.is_empty() {
            on_text(&text);
        }
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
