//! The learned predictors of a decode step, run inline or ahead on a spare thread (Deja Vu's
//! asynchronous *lookahead*).
//!
//! Job `l` reads layer `l`'s normed attention input `h` as soon as the layer starts and chooses
//! the MLP neurons of layer `l` ([`MlpPredictor`] `l`) and the query heads of layer `l + 1`
//! ([`HeadPredictor`] `l + 1`; job 0 also chooses layer 0's heads from its own input). So the
//! MLP prediction has the whole attention block, and the head prediction the whole previous
//! MLP block, to finish before it is needed.
//!
//! With a spare backend (one thread, its own core when the engine's pool leaves one), jobs run
//! on a scoped worker thread while the main thread computes the layer; without one they run
//! inline at submission. Both compute the same sets from the same inputs, so the output does not
//! depend on the mode. Timing contract: `busy` is the predictors' own time, `wait` the time the
//! main thread spent on them (inline: all of it; lookahead: time blocked waiting for a result),
//! so `1 - wait / busy` is the fraction of predictor time hidden.
//!
//! [`MlpPredictor`]: crate::sparsity::predictor::MlpPredictor
//! [`HeadPredictor`]: crate::sparsity::predictor::HeadPredictor
use crate::sparsity::policy::Policy;
use crate::sparsity::{top_k, HeadRule, MlpRule};
use crate::{Error, Result};
use dejavu_backend_api::{Backend, IndexSet};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::Scope;
use std::time::{Duration, Instant};

/// What job `l` chose.
#[derive(Default)]
pub struct Prediction {
    /// MLP neurons of layer `l`.
    mlp: Option<IndexSet>,
    /// Query heads, with the layer they are for (`l + 1`, and 0 when `l == 0`).
    heads: Vec<(usize, IndexSet)>,
    /// Predictor weight bytes read.
    bytes: usize,
    busy: Duration,
}

/// Scratch of the predictors (kept per thread).
#[derive(Default)]
struct Scratch {
    z: Vec<f32>,
    scores: Vec<f32>,
    idx: Vec<u32>,
}

/// Layers whose head sets job `l` chooses.
fn head_layers(l: usize, n_layers: usize) -> impl Iterator<Item = usize> {
    let first = if l == 0 { 0 } else { l + 1 };
    (first..=l + 1).filter(move |&t| t < n_layers)
}

/// Whether job `l` has anything to compute under `p`.
fn wanted(p: &Policy, l: usize) -> bool {
    matches!(p.mlp[l], MlpRule::LowRank { .. })
        || head_layers(l, p.heads.len()).any(|t| matches!(p.heads[t], HeadRule::LowRank { .. }))
}

/// Run job `l` on `h` (one token's normed attention input of layer `l`).
fn predict(b: &dyn Backend, p: &Policy, l: usize, h: &[f32], s: &mut Scratch) -> Prediction {
    let t0 = Instant::now();
    let mut out = Prediction::default();
    let mut run =
        |pred: &crate::sparsity::predictor::LowRankPredictor, k: usize, s: &mut Scratch| {
            s.z.resize(pred.rank, 0.0);
            s.scores.resize(pred.n_out, 0.0);
            pred.scores(b, h, &mut s.z, &mut s.scores);
            out.bytes += pred.bytes();
            top_k(&s.scores, k, &mut s.idx)
        };
    if let (MlpRule::LowRank { .. }, Some(pred)) = (p.mlp[l], p.mlp_predictors.get(l)) {
        let set = run(pred, p.mlp[l].kept(pred.n_out), s);
        out.mlp = Some(set);
    }
    for t in head_layers(l, p.heads.len()) {
        if let (HeadRule::LowRank { .. }, Some(pred)) = (p.heads[t], p.head_predictors.get(t)) {
            let set = run(pred, p.heads[t].kept(pred.n_out), s);
            out.heads.push((t, set));
        }
    }
    out.busy = t0.elapsed();
    out
}

enum Mode<'a> {
    Off,
    Inline {
        b: &'a dyn Backend,
        p: &'a Policy,
        scratch: Scratch,
    },
    Spare {
        p: &'a Policy,
        jobs: Sender<(usize, Vec<f32>)>,
        results: Receiver<(usize, Prediction)>,
    },
}

/// The predictions of one decode step, by job.
pub struct Predictions<'a> {
    mode: Mode<'a>,
    results: Vec<Option<Prediction>>,
    submitted: Vec<bool>,
    pub busy: Duration,
    pub wait: Duration,
    pub bytes: usize,
}

impl<'a> Predictions<'a> {
    /// For policy `p` (`None`: no predictors to run). With `p.lookahead` and a `spare` backend,
    /// jobs run on a worker thread of scope `s`.
    pub fn new<'scope>(
        s: &'scope Scope<'scope, 'a>,
        p: Option<&'a Policy>,
        main: &'a dyn Backend,
        spare: Option<&'a dyn Backend>,
        n_layers: usize,
    ) -> Self {
        let mode = match (p.filter(|p| p.uses_predictors()), spare) {
            (None, _) => Mode::Off,
            (Some(p), Some(spare)) if p.lookahead => {
                let (jobs, job_rx) = channel::<(usize, Vec<f32>)>();
                let (res_tx, results) = channel();
                s.spawn(move || {
                    let mut scratch = Scratch::default();
                    for (l, h) in job_rx {
                        let r = predict(spare, p, l, &h, &mut scratch);
                        if res_tx.send((l, r)).is_err() {
                            break;
                        }
                    }
                });
                Mode::Spare { p, jobs, results }
            }
            (Some(p), _) => Mode::Inline {
                b: main,
                p,
                scratch: Scratch::default(),
            },
        };
        // Nothing to track (and nothing allocated on the dense path) without predictors.
        let n = if matches!(mode, Mode::Off) {
            0
        } else {
            n_layers
        };
        Self {
            mode,
            results: (0..n).map(|_| None).collect(),
            submitted: vec![false; n],
            busy: Duration::ZERO,
            wait: Duration::ZERO,
            bytes: 0,
        }
    }

    /// Start job `l` on layer `l`'s normed attention input (no-op when it has nothing to do).
    pub fn submit(&mut self, l: usize, h: &[f32]) {
        match &mut self.mode {
            Mode::Off => {}
            Mode::Inline { b, p, scratch } => {
                if wanted(p, l) {
                    let r = predict(*b, p, l, h, scratch);
                    self.wait += r.busy;
                    self.record(l, r);
                }
            }
            Mode::Spare { p, jobs, .. } => {
                if wanted(p, l) {
                    // A send fails only if the worker is gone; `take` then reports it.
                    self.submitted[l] = true;
                    let _ = jobs.send((l, h.to_vec()));
                }
            }
        }
    }

    fn record(&mut self, l: usize, r: Prediction) {
        self.busy += r.busy;
        self.bytes += r.bytes;
        self.results[l] = Some(r);
    }

    /// Job `l`'s result, waiting for the worker if needed (`None`: the job was not run).
    fn take(&mut self, l: usize) -> Result<Option<&mut Prediction>> {
        if matches!(self.mode, Mode::Off) {
            return Ok(None);
        }
        if self.submitted[l] && self.results[l].is_none() {
            let t0 = Instant::now();
            while let Mode::Spare { results, .. } = &self.mode {
                let (j, r) = results
                    .recv()
                    .map_err(|_| Error::Invalid("the lookahead thread stopped".into()))?;
                self.record(j, r);
                if j == l {
                    break;
                }
            }
            self.wait += t0.elapsed();
        }
        Ok(self.results[l].as_mut())
    }

    /// The predicted MLP set of layer `l`, if its rule is learned.
    pub fn mlp(&mut self, l: usize) -> Result<Option<IndexSet>> {
        Ok(self.take(l)?.and_then(|r| r.mlp.take()))
    }

    /// The predicted head set of layer `l`, if its rule is learned.
    pub fn heads(&mut self, l: usize) -> Result<Option<IndexSet>> {
        let job = l.saturating_sub(1);
        Ok(self.take(job)?.and_then(|r| {
            let i = r.heads.iter().position(|(t, _)| *t == l)?;
            Some(r.heads.swap_remove(i).1)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::head_layers;

    #[test]
    fn every_layer_gets_its_heads_from_one_job() {
        let n = 5;
        let mut seen: Vec<usize> = (0..n).flat_map(|l| head_layers(l, n)).collect();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);
        assert_eq!(head_layers(0, n).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(head_layers(4, n).count(), 0);
    }
}
