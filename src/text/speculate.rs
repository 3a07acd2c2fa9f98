//! Lossless speculation: the sparse plan drafts, the dense model verifies (issue 26, item 4).
//!
//! A round starts from the next token `t0` (sampled, not yet in the cache, at position `L`).
//! The session's plan decodes `t0` and its own guesses for up to `k` steps, drawing each draft
//! `d_i` from its distribution `q_i`; the cache is cut back to `L` and the dense model runs
//! `t0, d_1 .. d_k` once as a batch ([`Decoder::verify`]: every weight read once, each row
//! computed as a dense decode step computes it, and those positions' keys and values written as
//! dense decoding writes them). Row `i` gives the dense distribution `p_i` of the slot `d_(i+1)`
//! fills: the draft is kept with probability `min(1, p(d) / q(d))` (greedy: when it is the
//! dense argmax), else the slot gets a token of the residual `max(0, p - q)` (greedy: the dense
//! argmax) and the round ends; when every draft is kept, the last row gives one more token.
//! The cache keeps the positions whose rows were consulted, so it always holds what dense
//! decoding would hold. The tokens are therefore distributed as the dense model's (Leviathan
//! et al., 2023; Chen et al., 2023), and under greedy decoding they are the dense model's: on
//! the CPU bit for bit, since every logit is.
use super::sampling::{Choice, Sampler};
use crate::exec::Decoder;
use crate::Result;

/// What speculation did over a generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SpecStats {
    /// Verifications: dense passes over a draft (the prompt's pass not counted).
    pub dense_passes: usize,
    /// Draft tokens proposed, and those the dense model kept.
    pub drafted: usize,
    pub accepted: usize,
}

impl SpecStats {
    /// Tokens each dense pass produced: the kept drafts and the dense model's own token.
    pub fn tokens_per_pass(&self) -> f64 {
        (self.accepted + self.dense_passes) as f64 / self.dense_passes.max(1) as f64
    }
    /// The share of drafts kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// The dense model's token for a slot the draft filled with `d`, drawn from `q`, given the
/// dense model's `p` there; and whether it is the draft's (the speculative acceptance rule).
pub fn verdict(sampler: &mut Sampler, p: &Choice, q: &Choice, d: u32) -> (u32, bool) {
    if let Choice::Token(best) = p {
        return (*best, *best == d);
    }
    let (pd, qd) = (p.prob(d), q.prob(d));
    if qd > 0.0 && sampler.uniform() * qd < pd {
        return (d, true);
    }
    // The residual max(0, p - q) over p's candidates (q's others have p = 0).
    let q: std::collections::HashMap<u32, f32> = q.probs().collect();
    let (tokens, w): (Vec<u32>, Vec<f32>) = (p.probs())
        .map(|(t, pt)| (t, (pt - q.get(&t).copied().unwrap_or(0.0)).max(0.0)))
        .unzip();
    let residual = match w.iter().any(|&x| x > 0.0) {
        true => Choice::Weights(tokens, w),
        false => p.clone(),
    };
    (sampler.draw(&residual), false)
}

/// One round's plan: the drafts, each with the distribution it was drawn from.
pub struct Draft {
    pub tokens: Vec<u32>,
    pub choices: Vec<Choice>,
}

/// Draft up to `k` tokens after `t0` under the decoder's plan, `history` the tokens so far
/// (`t0` included); `prepare` readies each step's logits (checks, masks) before the sampler
/// sees them. Drafting ends early at a token of `stop_at` (nothing after it is needed). The
/// cache is left holding the draft's positions; the caller truncates it.
pub fn draft(
    dec: &mut dyn Decoder,
    sampler: &mut Sampler,
    t0: u32,
    k: usize,
    history: &mut Vec<u32>,
    mut prepare: impl FnMut(&mut [f32]) -> Result<()>,
    stop_at: &[u32],
) -> Result<Draft> {
    let mut d = Draft {
        tokens: Vec::with_capacity(k),
        choices: Vec::with_capacity(k),
    };
    let base = history.len();
    let mut t = t0;
    for _ in 0..k {
        let logits = dec.decode(&[t])?;
        prepare(logits)?;
        let choice = sampler.choice(logits, history);
        t = sampler.draw(&choice);
        d.tokens.push(t);
        d.choices.push(choice);
        history.push(t);
        if stop_at.contains(&t) {
            break;
        }
    }
    history.truncate(base);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::sampling::SamplerConfig;

    /// Sampled speculation draws from the dense distribution whatever the draft's: the slot's
    /// token frequencies over many trials match p within sampling error.
    #[test]
    fn acceptance_rule_leaves_the_dense_distribution() {
        let p = Choice::Weights(vec![0, 1, 2, 3], vec![0.5, 0.3, 0.15, 0.05]);
        let q = Choice::Weights(vec![3, 1, 4], vec![0.6, 0.3, 0.1]);
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        });
        let n = 200_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            let d = s.draw(&q);
            let (t, kept) = verdict(&mut s, &p, &q, d);
            assert!(!kept || t == d, "a kept draft is the draft");
            counts[t as usize] += 1;
        }
        for t in 0..5u32 {
            let f = counts[t as usize] as f64 / n as f64;
            let want = p.prob(t) as f64;
            // 5 standard errors of a binomial share.
            let tol = 5.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-9;
            assert!((f - want).abs() <= tol, "token {t}: {f} against {want}");
        }
    }

    #[test]
    fn greedy_keeps_the_draft_only_when_it_is_the_dense_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        let q = Choice::Token(7);
        assert_eq!(verdict(&mut s, &Choice::Token(7), &q, 7), (7, true));
        assert_eq!(verdict(&mut s, &Choice::Token(2), &q, 7), (2, false));
    }
}
