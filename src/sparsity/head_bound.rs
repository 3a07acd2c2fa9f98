//! The contextual output head's bound: when its preview may have missed mass, the dense head.
//!
//! The contextual head (`head:RANK:CANDIDATES`) computes exact logits for the `C` candidates the
//! preview ranks highest and leaves every other token its preview logit. A preview logit can lie
//! far *below* the exact one; a token the text then uses gets almost no probability, and one
//! such miss costs more perplexity than every hit saves (SmolLM2 `head:64:2048` was +1.8% on
//! calibration text and +46% on a licence text). So, per step, on the host:
//!
//! - `delta` ([`delta`]): how far this step's preview falls below the exact logits among its
//!   candidates (a high quantile of their errors), the estimate of how far it may fall below a
//!   non-candidate's;
//! - every non-candidate gets `preview + delta`, an estimated upper bound on its exact logit;
//! - with those, the non-candidates' share of the softmax is bounded ([`check`]); when it may
//!   exceed [`EPSILON`], or a non-candidate may outrank the best candidate, the step falls back
//!   to the dense head ([`Check::Dense`]).
//!
//! Where every non-candidate's exact logit is at most `delta` above its preview, a kept step's
//! distribution is dense's up to a factor in `[1 - EPSILON, 1]` on each candidate's
//! probability, and no non-candidate's probability falls below its dense one by more than that
//! factor: the log-likelihood of any next token is at most `-ln(1 - EPSILON)` below dense's,
//! and greedy decoding picks dense's token. Sampling at a temperature T <= 1 moves at most
//! about `EPSILON` of the mass. `delta` is an estimate, not a proof: its quantile is measured
//! ([`QUANTILE`]).

use dejavu_backend_cpu::kernels::table;
use dejavu_backend_cpu::kernels::tail_mass::{self, REL_ERR};

/// The largest share of the softmax (temperature 1) the non-candidates may hold by their upper
/// bounds before the step computes the dense head: a token's log-likelihood is then at most
/// `-ln(1 - 0.02) = 0.0202` below dense's (perplexity +2%, within the default calibration
/// budget of 3%).
pub const EPSILON: f64 = 0.02;

/// How far below the best candidate (in logits) a term may lie and be left out of the sum, for
/// `n` terms: at most `n * e^-cut <= EPSILON / 1000` of the share, and the bound counts it.
fn cutoff(n: usize) -> f32 {
    (1000.0 * n.max(1) as f64 / EPSILON).ln() as f32
}

/// The scan of a step's logits on the process's tier (the CPU kernel table; its reference if
/// `DEJAVU_ISA` is unusable, which loading a model refuses first).
fn scan(x: &mut [f32], delta: f32, top: f32, floor: f32) -> tail_mass::Tail {
    let f = table::kernels().map_or(tail_mass::scalar as tail_mass::TailFn, |k| k.tail_mass);
    f(x, delta, top, floor)
}

/// What a step's contextual head left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Check {
    /// The logits stand (non-candidates raised by `delta`); the non-candidates' bounded share.
    Kept { share: f64 },
    /// The bound does not hold: the caller computes the dense head.
    Dense,
}

/// The contextual head's logits `logits` (the candidates `cand` exact, every other token its
/// preview) checked against the bound: non-candidates raised by `delta` in place and
/// [`Check::Kept`], or [`Check::Dense`] (then `logits` are unspecified: the caller overwrites
/// them with the dense head's). `cand` holds distinct indices below `logits.len()`, at least
/// one. A NaN among the logits gives `Dense`.
pub fn check(logits: &mut [f32], cand: &[u32], delta: f32, saved: &mut Vec<f32>) -> Check {
    if cand.is_empty() || !delta.is_finite() || cand.iter().any(|&i| i as usize >= logits.len()) {
        return Check::Dense;
    }
    // The candidates' maximum and sum, then the candidates hidden while the rest are raised.
    saved.clear();
    saved.extend(cand.iter().map(|&i| logits[i as usize]));
    let top = saved.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if !top.is_finite() || saved.iter().any(|v| v.is_nan()) {
        return Check::Dense;
    }
    // Terms below `floor` each add at most e^-cut: the candidates' are left out of their sum
    // (a bound from below), the others' counted into theirs (from above).
    let cut = cutoff(logits.len());
    let floor = top - cut;
    let z_cand = scan(saved, 0.0, top, floor).z * (1.0 - REL_ERR);
    cand.iter()
        .for_each(|&i| logits[i as usize] = f32::NEG_INFINITY);
    let rest = scan(logits, delta, top, floor);
    cand.iter()
        .zip(saved.iter())
        .for_each(|(&i, &v)| logits[i as usize] = v);
    // The hidden candidates are among `rest.below`.
    let tail = rest.below.saturating_sub(cand.len()) as f64 * (-cut as f64).exp();
    let (z_rest, max_rest, nan) = (rest.z * (1.0 + REL_ERR) + tail, rest.max, rest.nan);
    let share = z_rest / (z_cand + z_rest);
    match nan || max_rest >= top || share > EPSILON {
        true => Check::Dense,
        false => Check::Kept { share },
    }
}

/// A step's `delta`: the [`QUANTILE`] of the candidates' errors `logits[cand[i]] - preview[i]`
/// (the exact logit less the preview's, both after any soft cap): how far the preview falls
/// below the exact logit near the top of this step's distribution, where the non-candidates
/// that could matter lie. Infinite when an error is NaN or there are no candidates.
pub fn delta(logits: &[f32], cand: &[u32], preview: &[f32], scratch: &mut Vec<f32>) -> f32 {
    scratch.clear();
    let pairs = cand.iter().zip(preview);
    scratch.extend(pairs.map(|(&i, &p)| logits.get(i as usize).map_or(f32::NAN, |&e| e - p)));
    if scratch.is_empty() || scratch.iter().any(|e| e.is_nan()) {
        return f32::INFINITY;
    }
    let at = ((scratch.len() - 1) as f64 * QUANTILE) as usize;
    *scratch.select_nth_unstable_by(at, f32::total_cmp).1
}

/// See [`delta`]. Measured on SmolLM2-135M (rank 64 and 128, 2048 to 16384 candidates; 1008
/// tokens each of calibration text and of a licence text): with the 99th percentile no kept
/// step lost any log-likelihood against dense; with the 90th, kept steps lost up to 17 nats.
pub const QUANTILE: f64 = 0.99;

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: the dense softmax against the bounded one.
    fn reference(exact: &[f32], preview: &[f32], cand: &[u32], delta: f32) -> (Vec<f32>, f64) {
        let mut out: Vec<f32> = preview.iter().map(|v| v + delta).collect();
        cand.iter()
            .for_each(|&i| out[i as usize] = exact[i as usize]);
        let top = cand
            .iter()
            .map(|&i| exact[i as usize])
            .fold(f32::MIN, f32::max);
        let (mut zc, mut zr) = (0f64, 0f64);
        for (i, v) in out.iter().enumerate() {
            let e = ((v - top) as f64).exp();
            match cand.contains(&(i as u32)) {
                true => zc += e,
                false => zr += e,
            }
        }
        (out, zr / (zc + zr))
    }

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    #[test]
    fn kept_steps_match_the_definition_and_dense_ones_fall_back() {
        let mut r = rng(3);
        let mut saved = Vec::new();
        let (mut kept, mut dense) = (0, 0);
        for trial in 0..400 {
            let n = 50 + trial % 37;
            let exact: Vec<f32> = (0..n).map(|_| 12.0 * r()).collect();
            let preview: Vec<f32> = exact.iter().map(|v| v - 0.5 * r().abs()).collect();
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.sort_by(|&a, &b| preview[b as usize].total_cmp(&preview[a as usize]));
            // Some steps put a true maximum among the non-candidates (a depressed preview).
            let mut preview = preview;
            if trial % 5 == 0 {
                let j = order[n - 1] as usize;
                preview[j] = exact.iter().fold(f32::MIN, |m, &v| m.max(v)) - 0.1;
            }
            let c = 1 + trial % (n / 2);
            let cand = &order[..c];
            let delta = 0.5;
            let mut got = preview.clone();
            cand.iter()
                .for_each(|&i| got[i as usize] = exact[i as usize]);
            let (want, share) = reference(&exact, &preview, cand, delta);
            let top = cand
                .iter()
                .map(|&i| exact[i as usize])
                .fold(f32::MIN, f32::max);
            let max_rest = (0..n)
                .filter(|i| !cand.contains(&(*i as u32)))
                .map(|i| want[i])
                .fold(f32::MIN, f32::max);
            match check(&mut got, cand, delta, &mut saved) {
                Check::Kept { share: s } => {
                    kept += 1;
                    assert!(share <= EPSILON && max_rest < top);
                    assert!(
                        (s - share).abs() <= EPSILON / 1000.0 + 1e-4 * share,
                        "{s} vs {share}"
                    );
                    assert_eq!(got, want);
                    // The bound: every token's probability at least (1 - EPSILON) of dense's
                    // wherever the preview errs by at most delta (here it does).
                    let lse = |x: &[f32]| {
                        let m = x.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                        m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
                    };
                    let (lg, le) = (lse(&got), lse(&exact));
                    for i in 0..n {
                        let loss = (exact[i] as f64 - le) - (got[i] as f64 - lg);
                        assert!(loss <= -(1.0 - EPSILON).ln() + 1e-6, "token {i}: {loss}");
                    }
                }
                Check::Dense => {
                    dense += 1;
                    assert!(
                        share > EPSILON || max_rest >= top,
                        "{share} {max_rest} {top}"
                    );
                }
            }
        }
        assert!(kept > 50 && dense > 50, "kept {kept}, dense {dense}");
    }

    #[test]
    fn bad_values_fall_back() {
        let mut saved = Vec::new();
        let mut x = vec![10.0, 0.0, f32::NAN, -3.0];
        assert_eq!(check(&mut x, &[0], 0.1, &mut saved), Check::Dense);
        let mut x = vec![10.0, 0.0, 1.0];
        assert_eq!(check(&mut x, &[], 0.1, &mut saved), Check::Dense);
        assert_eq!(check(&mut x, &[7], 0.1, &mut saved), Check::Dense);
        assert_eq!(check(&mut x, &[0], f32::INFINITY, &mut saved), Check::Dense);
        assert!(matches!(
            check(&mut x, &[0], 0.1, &mut saved),
            Check::Kept { .. }
        ));
        assert_eq!(x, vec![10.0, 0.1, 1.1]);
    }

    #[test]
    fn delta_is_the_quantile_of_the_candidates_errors() {
        let mut scratch = Vec::new();
        let logits: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let cand: Vec<u32> = (0..201).rev().collect();
        // Errors 0, 0.01, ..., 2.0 (in any order): the 99th percentile is 1.98.
        let preview: Vec<f32> = cand.iter().map(|&i| i as f32 - i as f32 / 100.0).collect();
        let d = delta(&logits, &cand, &preview, &mut scratch);
        assert!((d - 1.98).abs() < 1e-4, "{d}");
        assert_eq!(delta(&logits, &[], &[], &mut scratch), f32::INFINITY);
        assert_eq!(delta(&logits, &[400], &[0.0], &mut scratch), f32::INFINITY);
        assert_eq!(
            delta(&logits, &[1], &[f32::NAN], &mut scratch),
            f32::INFINITY
        );
    }
}
