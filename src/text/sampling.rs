//! Turning logits into the next token: greedy, or temperature sampling with top-k, top-p (nucleus)
//! and min-p filters, and a repetition penalty; seeded so the same seed gives the same text.
//!
//! Order (as llama.cpp's default chain): logit bias -> repetition penalty -> greedy if
//! `temperature <= 0` -> top-k -> softmax(logits / temperature) -> top-p -> min-p -> draw.
use rand::distributions::{Distribution, WeightedIndex};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely (0 = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens by this (1.0 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token seen in that window (OpenAI's and llama.cpp's
    /// presence penalty; 0 = off).
    pub presence_penalty: f32,
    /// Subtracted once per occurrence in that window (frequency penalty; 0 = off).
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before anything else (OpenAI's `logit_bias`;
    /// `-inf` bans a token). Ids past the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
    pub fn validate(&self) -> Result<(), String> {
        let bad =
            |what: &str, v: f32, want: &str| Err(format!("{what} {v} is out of range: {want}"));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "the temperature",
                self.temperature,
                "it must be 0 (greedy) or more",
            );
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top-p", self.top_p, "it must lie in [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p", self.min_p, "it must lie in [0, 1]");
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad(
                "the repeat penalty",
                self.repeat_penalty,
                "it must be above 0 (1 = off)",
            );
        }
        for (what, v) in [
            ("the presence penalty", self.presence_penalty),
            ("the frequency penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(what, v, "it must lie in [-2, 2]");
            }
        }
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self { cfg, rng }
    }

    /// Pick the next token from `logits` (modified in place by the penalty); `history` are the
    /// tokens seen so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let choice = self.choice(logits, history);
        self.draw(&choice)
    }

    /// What [`Self::sample`] draws from: the penalties applied to `logits` (in place), then
    /// the greedy token, or the candidates that survive the filters with their weights.
    pub fn choice(&self, logits: &mut [f32], history: &[u32]) -> Choice {
        let c = &self.cfg;
        for &(t, b) in &c.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let penalized =
            c.repeat_penalty != 1.0 || c.presence_penalty != 0.0 || c.frequency_penalty != 0.0;
        if penalized {
            let start = history.len().saturating_sub(c.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l = if *l > 0.0 {
                        *l / c.repeat_penalty
                    } else {
                        *l * c.repeat_penalty
                    };
                    *l -= c.presence_penalty + c.frequency_penalty * run.len() as f32;
                }
            }
        }
        if c.temperature <= 0.0 {
            return Choice::Token(argmax(logits));
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        let k = if c.top_k == 0 {
            cand.len()
        } else {
            c.top_k.min(cand.len())
        };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand
            .iter()
            .map(|&(_, l)| ((l - max) / c.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let mut keep = probs.len();
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if c.min_p > 0.0 {
            let floor = probs[0] * c.min_p;
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        let tokens = cand[..keep].iter().map(|&(t, _)| t).collect();
        probs.truncate(keep);
        Choice::Weights(tokens, probs)
    }

    /// A token drawn from `choice` (the greedy token as it is).
    pub fn draw(&mut self, choice: &Choice) -> u32 {
        match choice {
            Choice::Token(t) => *t,
            Choice::Weights(tokens, w) => match WeightedIndex::new(w) {
                Ok(dist) => tokens[dist.sample(&mut self.rng)],
                Err(_) => tokens[0],
            },
        }
    }

    /// A uniform draw in `[0, 1)` from the sampler's stream (speculative acceptance).
    pub fn uniform(&mut self) -> f32 {
        rand::Rng::gen::<f32>(&mut self.rng)
    }
}

/// What a sampler draws the next token from (see [`Sampler::choice`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Greedy: this token.
    Token(u32),
    /// The candidates left by the filters, most likely first, and their weights (not
    /// necessarily summing to 1).
    Weights(Vec<u32>, Vec<f32>),
}

impl Choice {
    /// The probability of `t` (0 outside the candidates).
    pub fn prob(&self, t: u32) -> f32 {
        self.probs().find(|&(x, _)| x == t).map_or(0.0, |(_, p)| p)
    }

    /// Each candidate and its probability (the weights normalized).
    pub fn probs(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        let (tokens, w): (&[u32], &[f32]) = match self {
            Choice::Token(x) => (std::slice::from_ref(x), &[1.0]),
            Choice::Weights(tokens, w) => (tokens, w),
        };
        let sum: f32 = w.iter().sum();
        let norm = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        tokens.iter().zip(w).map(move |(&t, &x)| (t, x * norm))
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let mut l = logits();
        let best = argmax(&l);
        assert_eq!(l[best as usize], 9.9);
        assert_eq!(
            Sampler::new(SamplerConfig::greedy()).sample(&mut l, &[]),
            best
        );
    }

    #[test]
    fn same_seed_same_draws_and_filters_hold() {
        let cfg = SamplerConfig {
            temperature: 1.5,
            top_k: 5,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let draw = |cfg: &SamplerConfig| {
            let mut s = Sampler::new(cfg.clone());
            (0..50)
                .map(|_| s.sample(&mut logits(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&cfg);
        assert_eq!(a, draw(&cfg));
        let l = logits();
        let mut sorted = l.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(
            a.iter().all(|&t| l[t as usize] >= sorted[4]),
            "top-k 5 violated"
        );
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "sampling never varied"
        );
        let other = draw(&SamplerConfig {
            seed: 8,
            ..cfg.clone()
        });
        assert_ne!(a, other);
        // top-p so small that only the best token survives
        let only_best = draw(&SamplerConfig {
            top_p: 0.01,
            top_k: 0,
            ..cfg.clone()
        });
        assert!(only_best.iter().all(|&t| t == argmax(&l)));
        // min-p 1.0 keeps only the best
        let only_best = draw(&SamplerConfig {
            min_p: 1.0,
            top_k: 0,
            ..cfg
        });
        assert!(only_best.iter().all(|&t| t == argmax(&l)));
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut l = vec![2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 1.5,
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&mut l, &[0, 2]), 1);
        assert_eq!(l, vec![2.0 / 1.5, 1.9, -1.5]);
    }
}
