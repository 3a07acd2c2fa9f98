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
    /// Under `--speculate`: the dense passes and the drafts kept.
    pub speculation: Option<super::speculate::SpecStats>,
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
    on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats)> {
    generate_speculative(
        engine, dec, new_tokens, max_tokens, sampler, rules, None, on_text,
    )
}

/// [`generate_with`], with `speculate: Some(k)` the decoder's plan drafting up to `k` tokens a
/// round and the dense model verifying them in one pass (see [`crate::text::speculate`]): the
/// dense model's text (under greedy decoding, its very tokens), faster when drafts are cheap
/// and mostly kept. `None`: plain decoding under the plan.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    engine: &Engine,
    dec: &mut dyn Decoder,
    new_tokens: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    rules: &StopRules,
    speculate: Option<usize>,
    on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats)> {
    if speculate == Some(0) {
        return Err(Error::Invalid(
            "--speculate K: K is the draft length, at least 1".into(),
        ));
    }
    let run = Run::new(engine, dec, new_tokens, max_tokens, rules)?;
    run.go(dec, new_tokens, sampler, speculate, on_text)
}

/// One generation's state: what was emitted, and what ends it.
struct Run<'a> {
    engine: &'a Engine,
    rules: &'a StopRules,
    max_tokens: usize,
    n_ctx: usize,
    history: Vec<u32>,
    out: Vec<u32>,
    stream: TextStream,
    stops: super::stop::StopFilter<'a>,
}

impl<'a> Run<'a> {
    fn new(
        engine: &'a Engine,
        dec: &dyn Decoder,
        new_tokens: &[u32],
        max_tokens: usize,
        rules: &'a StopRules,
    ) -> Result<Self> {
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
        Ok(Self {
            engine,
            rules,
            max_tokens,
            n_ctx: dec.n_ctx(),
            history: new_tokens.to_vec(),
            out: Vec::new(),
            stream: TextStream::default(),
            stops: super::stop::StopFilter::new(&rules.stop),
        })
    }

    /// Logits ready for the sampler: finite, inside the vocabulary, end tokens masked under
    /// `ignore_eos`.
    fn prepare(engine: &Engine, rules: &StopRules, logits: &mut [f32]) -> Result<()> {
        check_logits(engine, logits)?;
        if rules.ignore_eos {
            for &e in &engine.tokenizer.end_of_generation {
                if let Some(l) = logits.get_mut(e as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Emit `t`: `Some(why)` when generation ends with it (an end token, which is not emitted;
    /// a stop string; `max_tokens`).
    fn emit(&mut self, t: u32, on_text: &mut impl FnMut(&str)) -> Result<Option<Stop>> {
        if self.engine.tokenizer.end_of_generation.contains(&t) {
            return Ok(Some(Stop::EndOfGeneration));
        }
        self.out.push(t);
        self.history.push(t);
        if let Some(piece) = self.stream.push(self.engine, t)? {
            let (text, stopped) = self.stops.push(&piece);
            if !text.is_empty() {
                on_text(&text);
            }
            if stopped {
                return Ok(Some(Stop::StopString));
            }
        }
        Ok((self.out.len() == self.max_tokens).then_some(Stop::MaxTokens))
    }

    /// Whether the caller's cancel flag is up (and lower it).
    fn cancelled(&self) -> bool {
        let c = self.rules.cancel.as_ref();
        c.is_some_and(|c| c.swap(false, std::sync::atomic::Ordering::Relaxed))
    }

    fn go(
        mut self,
        dec: &mut dyn Decoder,
        new_tokens: &[u32],
        sampler: &mut Sampler,
        speculate: Option<usize>,
        mut on_text: impl FnMut(&str),
    ) -> Result<(Vec<u32>, GenerateStats)> {
        let (engine, rules) = (self.engine, self.rules);
        let mut stats = GenerateStats {
            prompt_tokens: new_tokens.len(),
            ..Default::default()
        };
        let t0 = Instant::now();
        // Speculation's first token is the dense model's too: the prompt's last row through
        // the dense head (a plan's contextual head would otherwise pick it).
        let n = new_tokens.len();
        let mut logits = match speculate {
            Some(_) => dec.run(new_tokens, crate::exec::Logits::Range(n - 1, n))?,
            None => dec.prompt(new_tokens)?,
        };
        stats.prompt_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        stats.stop = Stop::MaxTokens;
        let mut spec = speculate.map(|_| super::speculate::SpecStats::default());
        while self.out.len() < self.max_tokens {
            if self.cancelled() {
                stats.stop = Stop::Cancelled;
                break;
            }
            Self::prepare(engine, rules, logits)?;
            let next = sampler.sample(logits, &self.history);
            if let Some(stop) = self.emit(next, &mut on_text)? {
                stats.stop = stop;
                break;
            }
            if dec.len() + 1 >= self.n_ctx {
                stats.stop = Stop::ContextFull;
                break;
            }
            if let (Some(k), Some(spec)) = (speculate, spec.as_mut()) {
                stats.stop = self.rounds(dec, sampler, next, k, spec, &mut on_text)?;
                break;
            }
            logits = dec.decode(&[next])?;
        }
        stats.decode_secs = t1.elapsed().as_secs_f64();
        stats.generated_tokens = self.out.len();
        stats.speculation = spec;
        if stats.stop != Stop::StopString {
            let rest = self.stream.finish(engine)?.unwrap_or_default();
            let (mut text, stopped) = self.stops.push(&rest);
            if stopped {
                stats.stop = Stop::StopString;
            } else {
                text.push_str(&self.stops.flush());
            }
            if !text.is_empty() {
                on_text(&text);
            }
        }
        Ok((self.out, stats))
    }

    /// Speculation's rounds after `next` (emitted, not yet in the cache), until one ends
    /// generation (why it ended): each drafts up to `k` tokens, verifies them in one dense pass
    /// and emits the kept ones and the dense model's own; the cache then holds the positions
    /// whose rows were consulted (see [`crate::text::speculate`]).
    fn rounds(
        &mut self,
        dec: &mut dyn Decoder,
        sampler: &mut Sampler,
        mut next: u32,
        k: usize,
        spec: &mut super::speculate::SpecStats,
        on_text: &mut impl FnMut(&str),
    ) -> Result<Stop> {
        let (engine, rules) = (self.engine, self.rules);
        let eog = &engine.tokenizer.end_of_generation;
        loop {
            if self.cancelled() {
                return Ok(Stop::Cancelled);
            }
            let at = dec.len();
            if at + 1 >= self.n_ctx {
                return Ok(Stop::ContextFull);
            }
            // No more drafts than tokens still wanted, nor past the context.
            let want = self.max_tokens - self.out.len();
            let k = k.min(want.saturating_sub(1)).min(self.n_ctx - 2 - at);
            let prep = |l: &mut [f32]| Self::prepare(engine, rules, l);
            let stop_at = if rules.ignore_eos { &[][..] } else { &eog[..] };
            let d =
                super::speculate::draft(dec, sampler, next, k, &mut self.history, prep, stop_at)?;
            dec.truncate(at);
            let mut seq = Vec::with_capacity(d.tokens.len() + 1);
            seq.push(next);
            seq.extend(&d.tokens);
            let vocab = engine.model.config.vocab_size;
            let rows = dec.verify(&seq)?;
            let rows_len = rows.len();
            spec.dense_passes += 1;
            spec.drafted += d.tokens.len();
            let mut end = None;
            for (i, row) in rows.chunks_exact_mut(vocab).enumerate() {
                Self::prepare(engine, rules, row)?;
                let p = sampler.choice(row, &self.history);
                let (t, kept) = match (d.tokens.get(i), d.choices.get(i)) {
                    (Some(&dt), Some(q)) => super::speculate::verdict(sampler, &p, q, dt),
                    _ => (sampler.draw(&p), false),
                };
                spec.accepted += kept as usize;
                let stop = self.emit(t, on_text)?;
                if stop.is_some() || !kept {
                    end = Some((i, t, stop));
                    break;
                }
            }
            let Some((i, t, stop)) = end else {
                return Err(Error::Invalid(format!(
                    "a verification of {} tokens returned {} values, not {} rows of {vocab}",
                    seq.len(),
                    rows_len,
                    seq.len()
                )));
            };
            // Positions `at..=at + i` were consulted: `next` and the kept drafts.
            dec.truncate(at + i + 1);
            if let Some(stop) = stop {
                return Ok(stop);
            }
            next = t;
        }
    }
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
