//! The layer executor: one forward pass of a llama-family decoder over a batch of tokens, under a
//! [`SparsePlan`], on any [`Backend`].
//!
//! Per layer (x is the residual stream, `[n_tokens][d_model]`):
//! ```text
//! h = rmsnorm(x) ; q,k,v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv) ; rope(q), rope(k) ; cache k,v
//! x += attention(q, K, V; selected heads) Wo^T
//! h = rmsnorm(x) ; x += (silu(h Wg^T) * (h Wu^T)) Wd^T      (gate/up: selected neurons only)
//! ```
//! Unselected heads and neurons contribute exactly zero, so a plan with full sets is the dense model.
//!
//! The plan is either given ([`Plan::Fixed`]: explicit sets, for tests and research) or built per
//! decode step by a [`Policy`] from the activations themselves ([`Plan::Policy`]): gate-first
//! computes the gate projection, keeps the top neurons and computes up and down over those; the
//! contextual output head previews the logits at low rank and computes exact logits only for the
//! top candidates (the others keep their preview value). A sparse MLP set reads the neuron-major
//! down projection of the [`SparseLayout`] when the executor has one (without it, the dense down
//! projection over zeroed activations: the same result, no bytes saved). Likewise a sparse head
//! set reads the head-major W_o. Learned predictors run through [`crate::sparsity::lookahead`].
use crate::engine::weights::{Model, WeightRef};
use crate::sparsity::layout::SparseLayout;
use crate::sparsity::lookahead::Predictions;
use crate::sparsity::policy::Policy;
use crate::sparsity::{head_rows, top_k, HeadRule, MlpRule, SparsePlan};
use crate::{Error, Result};
use dejavu_backend_api::{AttnShape, Backend, IndexSet, MatmulJob, Weight};

/// Keys and values of every layer for positions `0..len`, f32, `[n_ctx][n_kv_heads * head_dim]`,
/// plus the activation buffers of the sequence's forward passes (grown to the largest batch seen,
/// then reused: decoding allocates nothing per token).
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    n_ctx: usize,
    scratch: Scratch,
    last: StepStats,
    /// When set, every forward step appends what calibration trains the predictors on.
    pub capture: Option<Capture>,
}

/// Per layer, appended by every forward step of a capturing cache.
#[derive(Default)]
pub struct Capture {
    /// Normed attention inputs, `[n][d_model]`.
    pub attn_in: Vec<Vec<f32>>,
    /// Norms of each query head's attention output, `[n][n_heads]`.
    pub head_norm: Vec<Vec<f32>>,
    /// Normed MLP inputs, `[n][d_model]`.
    pub mlp_in: Vec<Vec<f32>>,
}

/// What the last forward step read and kept.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Bytes of weights read (once per step, whatever the batch size).
    pub weight_bytes: usize,
    /// MLP neurons computed, summed over layers, and the dense count.
    pub mlp_kept: usize,
    pub mlp_total: usize,
    /// Query heads computed, summed over layers, and the dense count.
    pub heads_kept: usize,
    pub heads_total: usize,
    /// Output rows computed exactly (the vocabulary size when dense).
    pub exact_logits: usize,
    /// Time the learned predictors took, and the time the main thread spent on them (all of it
    /// inline; with lookahead, only the time it waited), in nanoseconds.
    pub predict_ns: u64,
    pub predict_wait_ns: u64,
}

/// Activations of one forward pass (see `Executor::forward` for the names).
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    att: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    logits: Vec<f32>,
    /// Selection scores and index scratch of the contextual rules; the output preview.
    score: Vec<f32>,
    idx: Vec<u32>,
    z: Vec<f32>,
    preview: Vec<f32>,
}

/// The first `n` elements of `v`, growing it if needed (contents unspecified: every user
/// overwrites them).
fn buf(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl KvCache {
    pub fn new(model: &Model, n_ctx: usize) -> Self {
        let c = &model.config;
        let size = n_ctx * c.kv_dim();
        Self {
            k: vec![vec![0.0; size]; c.n_layers],
            v: vec![vec![0.0; size]; c.n_layers],
            len: 0,
            n_ctx,
            scratch: Scratch::default(),
            last: StepStats::default(),
            capture: None,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// Bytes of keys and values held for the positions in use.
    pub fn bytes_in_use(&self) -> usize {
        let per_pos: usize = self
            .k
            .iter()
            .chain(&self.v)
            .map(|l| l.len() / self.n_ctx)
            .sum();
        self.len * per_pos * size_of::<f32>()
    }
    /// What the last forward step read and kept.
    pub fn last_step(&self) -> StepStats {
        self.last
    }
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Forget every position from `len` on (keeps a shared prefix for reuse).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Which positions of the batch need logits.
#[derive(Debug, Clone, Copy)]
pub enum Logits {
    /// Only the last token (generation).
    Last,
    /// Tokens `start..end` of the batch (perplexity scores a window).
    Range(usize, usize),
    /// No logits: the final normed hidden states of tokens `start..end` (`[n][d_model]`), the
    /// output head's input (calibration collects them).
    Hidden(usize, usize),
}

/// Where a step's sparse plan comes from.
#[derive(Clone, Copy)]
pub enum Plan<'a> {
    /// Explicit sets for every layer, applied to every token of the batch.
    Fixed(&'a SparsePlan),
    /// Built from the activations of each single-token step (batches run dense).
    Policy(&'a Policy),
}

#[derive(Clone, Copy)]
pub struct Executor<'m> {
    pub model: &'m Model,
    pub backend: &'m dyn Backend,
    /// The neuron-major down projections used by sparse MLP sets (see the module docs).
    pub layout: Option<&'m SparseLayout>,
    /// A one-thread backend for the lookahead thread (`None`: predictors run inline).
    pub spare: Option<&'m dyn Backend>,
}

impl<'m> Executor<'m> {
    pub fn new(model: &'m Model, backend: &'m dyn Backend) -> Result<Self> {
        let mut refs = vec![&model.token_embd, &model.output];
        for l in &model.layers {
            refs.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
        }
        if let Some(w) = refs.iter().find(|w| !backend.supports(w.qtype)) {
            return Err(Error::UnsupportedType {
                tensor: w.name.clone(),
                qtype: format!("{} on {}", w.qtype.name(), backend.name()),
            });
        }
        Ok(Self {
            model,
            backend,
            layout: None,
            spare: None,
        })
    }

    /// `y = x W^T` over `rows`; returns the bytes of weights read.
    fn matmul(&self, w: &WeightRef, rows: &IndexSet, x: &[f32], y: &mut [f32]) -> usize {
        let w = self.model.weight(w);
        self.backend.matmul(&w, rows, x, y);
        read_bytes(&w, rows)
    }

    fn job<'a>(&self, w: &WeightRef, rows: &'a IndexSet, y: &'a mut [f32]) -> MatmulJob<'a>
    where
        'm: 'a,
    {
        MatmulJob {
            w: self.model.weight(w),
            rows,
            y,
        }
    }

    /// [`Self::run`] under a fixed plan.
    pub fn forward<'c>(
        &self,
        tokens: &[u32],
        cache: &'c mut KvCache,
        plan: &SparsePlan,
        want: Logits,
    ) -> Result<&'c mut [f32]> {
        self.run(tokens, cache, Plan::Fixed(plan), want)
    }

    /// Run `tokens` at positions `cache.len()..`, append their keys/values to the cache and return
    /// the logits asked for (`[n][vocab]`, n = 1 for `Last`; hidden states for `Hidden`), valid
    /// until the cache's next use. `cache.last_step()` then tells what the step read.
    pub fn run<'c>(
        &self,
        tokens: &[u32],
        cache: &'c mut KvCache,
        plan: Plan,
        want: Logits,
    ) -> Result<&'c mut [f32]> {
        let m = self.model;
        let c = &m.config;
        let b = self.backend;
        let n = tokens.len();
        let pos0 = cache.len;
        if n == 0 {
            return Err(Error::Invalid("forward called with no tokens".into()));
        }
        if pos0 + n > cache.n_ctx {
            return Err(Error::ContextOverflow {
                n_tokens: pos0 + n,
                n_ctx: cache.n_ctx,
            });
        }
        let n_plans = match plan {
            Plan::Fixed(p) => p.layers.len(),
            Plan::Policy(p) => p.mlp.len(),
        };
        if n_plans != c.n_layers {
            return Err(Error::BadPlan(format!(
                "{n_plans} layer plans for {} layers",
                c.n_layers
            )));
        }
        // Contextual rules act on single-token steps only.
        let policy = match plan {
            Plan::Policy(p) if n == 1 => Some(p),
            _ => None,
        };
        let (d, qd, kvd, ff) = (c.d_model, c.n_heads * c.head_dim, c.kv_dim(), c.n_ff);

        let (first, last) = match want {
            Logits::Last => (n - 1, n),
            Logits::Range(s, e) | Logits::Hidden(s, e) if s < e && e <= n => (s, e),
            Logits::Range(s, e) | Logits::Hidden(s, e) => {
                return Err(Error::Invalid(format!(
                    "logit range {s}..{e} outside batch of {n}"
                )))
            }
        };
        let sc = &mut cache.scratch;
        let x = buf(&mut sc.x, n * d);
        let embd = m.weight(&m.token_embd);
        for (&t, xt) in tokens.iter().zip(x.chunks_exact_mut(d)) {
            if t as usize >= c.vocab_size {
                return Err(Error::Invalid(format!(
                    "token id {t} out of range (vocab {})",
                    c.vocab_size
                )));
            }
            b.dequantize_row(&embd, t as usize, xt);
        }

        let h = buf(&mut sc.h, n * d);
        let (q, att) = (buf(&mut sc.q, n * qd), buf(&mut sc.att, n * qd));
        let (k, v) = (buf(&mut sc.k, n * kvd), buf(&mut sc.v, n * kvd));
        let o = buf(&mut sc.o, n * d);
        let (gate, up) = (buf(&mut sc.gate, n * ff), buf(&mut sc.up, n * ff));
        let score = buf(&mut sc.score, ff);
        let full_kv = IndexSet::full(kvd);
        let full_d = IndexSet::full(d);
        let full_ff = IndexSet::full(ff);
        let dense_layer = crate::sparsity::LayerPlan::dense(c);
        let mut st = StepStats::default();
        let hd = c.head_dim;
        let (k_cache, v_cache, capture) = (&mut cache.k, &mut cache.v, &mut cache.capture);
        let idx = &mut sc.idx;
        if let Some(cap) = capture.as_mut() {
            for v in [&mut cap.attn_in, &mut cap.head_norm, &mut cap.mlp_in] {
                v.resize(c.n_layers, Vec::new());
            }
        }

        std::thread::scope(|s| -> Result<()> {
            let mut pred = Predictions::new(s, policy, b, self.spare, c.n_layers);
            for (l, lw) in m.layers.iter().enumerate() {
                let lp = match plan {
                    Plan::Fixed(p) => &p.layers[l],
                    Plan::Policy(_) => &dense_layer,
                };
                b.rmsnorm(x, m.vector(&lw.attn_norm), c.rms_eps, h);
                if let Some(cap) = capture.as_mut() {
                    cap.attn_in[l].extend_from_slice(h);
                }
                pred.submit(l, h);
                let head_rule = policy.map_or(HeadRule::Dense, |p| p.heads[l]);
                let predicted = match head_rule {
                    HeadRule::LowRank { .. } => pred.heads(l)?,
                    _ => None,
                };
                let q_set = predicted.as_ref().map(|hs| head_rows(hs, hd));
                let heads = predicted.as_ref().unwrap_or(&lp.heads);
                let q_rows = q_set.as_ref().unwrap_or(lp.q_rows());
                let mut jobs = [
                    self.job(&lw.wq, q_rows, q),
                    self.job(&lw.wk, &full_kv, k),
                    self.job(&lw.wv, &full_kv, v),
                ];
                st.weight_bytes += jobs.iter().map(|j| read_bytes(&j.w, j.rows)).sum::<usize>();
                b.matmul_shared_input(h, &mut jobs);
                if let (Some(bq), Some(bk), Some(bv)) = (&lw.bq, &lw.bk, &lw.bv) {
                    add_bias(q, m.vector(bq), Some(q_rows));
                    add_bias(k, m.vector(bk), None);
                    add_bias(v, m.vector(bv), None);
                }
                b.rope(q, c.n_heads, hd, pos0, c.rope_theta, c.rope_style);
                b.rope(k, c.n_kv_heads, hd, pos0, c.rope_theta, c.rope_style);
                k_cache[l][pos0 * kvd..(pos0 + n) * kvd].copy_from_slice(k);
                v_cache[l][pos0 * kvd..(pos0 + n) * kvd].copy_from_slice(v);
                let shape = AttnShape {
                    n_heads: c.n_heads,
                    n_kv_heads: c.n_kv_heads,
                    head_dim: hd,
                    pos0,
                    n_tokens: n,
                };
                let end = (pos0 + n) * kvd;
                b.attention(q, &k_cache[l][..end], &v_cache[l][..end], heads, shape, att);
                if let Some(cap) = capture.as_mut() {
                    cap.head_norm[l].extend(att.chunks_exact(hd).map(norm));
                }
                // attn-norm: every head's attention is known; keep the top heads by output norm.
                let normed = match head_rule {
                    HeadRule::Norm { .. } => {
                        let norms = &mut score[..c.n_heads];
                        norms
                            .iter_mut()
                            .zip(att.chunks_exact(hd))
                            .for_each(|(s, a)| *s = norm(a));
                        let set = top_k(norms, head_rule.kept(c.n_heads), idx);
                        for (hh, a) in att.chunks_exact_mut(hd).enumerate() {
                            if !set.contains(hh) {
                                a.fill(0.0);
                            }
                        }
                        Some(set)
                    }
                    _ => None,
                };
                let heads = normed.as_ref().unwrap_or(heads);
                st.heads_kept += heads.len();
                st.heads_total += c.n_heads;
                match self.layout {
                    Some(lay) if !heads.is_full() => {
                        let (w, rows) = (lay.wo_t(l), head_rows(heads, hd));
                        b.axpy_rows(&w, &rows, att, o);
                        st.weight_bytes += read_bytes(&w, &rows);
                    }
                    _ => st.weight_bytes += self.matmul(&lw.wo, &full_d, att, o),
                }
                add(x, o);

                b.rmsnorm(x, m.vector(&lw.ffn_norm), c.rms_eps, h);
                if let Some(cap) = capture.as_mut() {
                    cap.mlp_in[l].extend_from_slice(h);
                }
                let rule = policy.map_or(MlpRule::Dense, |p| p.mlp[l]);
                let predicted = match rule {
                    MlpRule::LowRank { .. } => pred.mlp(l)?,
                    _ => None,
                };
                let fixed = if policy.is_some() { &full_ff } else { &lp.mlp };
                let (set, act) =
                    self.mlp_select(l, rule, fixed, predicted, h, gate, up, score, idx, &mut st);
                let set = set.as_ref().unwrap_or(fixed);
                st.mlp_kept += set.len();
                st.mlp_total += ff;
                match self.layout {
                    Some(lay) if !set.is_full() => {
                        let w = lay.down_t(l);
                        b.axpy_rows(&w, set, act, o);
                        st.weight_bytes += read_bytes(&w, set);
                    }
                    _ => st.weight_bytes += self.matmul(&lw.w_down, &full_d, act, o),
                }
                add(x, o);
            }
            st.weight_bytes += pred.bytes;
            st.predict_ns = pred.busy.as_nanos() as u64;
            st.predict_wait_ns = pred.wait.as_nanos() as u64;
            Ok(())
        })?;
        cache.len = pos0 + n;

        let nl = last - first;
        let hn = &mut h[..nl * d];
        b.rmsnorm(
            &x[first * d..last * d],
            m.vector(&m.output_norm),
            c.rms_eps,
            hn,
        );
        if let Logits::Hidden(..) = want {
            cache.last = st;
            return Ok(hn);
        }
        let vocab = c.vocab_size;
        let logits = buf(&mut sc.logits, nl * vocab);
        let out_rule = policy.and_then(|p| p.output.as_ref());
        match out_rule {
            Some(rule) if nl == 1 => {
                let pv = &rule.preview;
                let z = buf(&mut sc.z, pv.rank);
                b.matmul(&pv.proj(), &IndexSet::full(pv.rank), hn, z);
                let preview = buf(&mut sc.preview, vocab);
                b.matmul(&pv.table(), &IndexSet::full(vocab), z, preview);
                let cand = top_k(preview, rule.candidates, &mut sc.idx);
                st.weight_bytes += pv.bytes() + self.matmul(&m.output, &cand, hn, logits);
                st.exact_logits = cand.len();
                // Exact logits for the candidates, the preview's for every other token.
                for i in cand.iter() {
                    preview[i] = logits[i];
                }
                logits.copy_from_slice(preview);
            }
            _ => {
                st.weight_bytes += self.matmul(&m.output, &IndexSet::full(vocab), hn, logits);
                st.exact_logits = vocab;
            }
        }
        st.weight_bytes += embd.qtype.row_bytes(d);
        cache.last = st;
        Ok(logits)
    }

    /// Gate and up projections of layer `l` under `rule` (`fixed`: the given set when the rule is
    /// dense; `predicted`: the learned predictor's set for `LowRank`); returns the chosen set (`None`: `fixed`) and the activations `silu(gate) * up`, zero
    /// outside the set, for the down projection.
    #[allow(clippy::too_many_arguments)]
    fn mlp_select<'a>(
        &self,
        l: usize,
        rule: MlpRule,
        fixed: &IndexSet,
        predicted: Option<IndexSet>,
        h: &[f32],
        gate: &'a mut [f32],
        up: &'a mut [f32],
        score: &mut [f32],
        idx: &mut Vec<u32>,
        st: &mut StepStats,
    ) -> (Option<IndexSet>, &'a mut [f32]) {
        let (lw, b, ff) = (&self.model.layers[l], self.backend, self.model.config.n_ff);
        let full = IndexSet::full(ff);
        let k = rule.kept(ff);
        // Gate and up over `set` in one dispatch, then silu(gate) * up.
        let both = |set: &IndexSet, gate: &mut [f32], up: &mut [f32], st: &mut StepStats| {
            let mut jobs = [self.job(&lw.w_gate, set, gate), self.job(&lw.w_up, set, up)];
            st.weight_bytes += jobs.iter().map(|j| read_bytes(&j.w, j.rows)).sum::<usize>();
            b.matmul_shared_input(h, &mut jobs);
            b.silu_mul(gate, up);
        };
        match (rule, predicted) {
            (MlpRule::LowRank { .. }, Some(set)) => {
                both(&set, gate, up, st);
                (Some(set), gate)
            }
            (MlpRule::Dense | MlpRule::LowRank { .. }, _) => {
                both(fixed, gate, up, st);
                (None, gate)
            }
            (MlpRule::GateFirst { .. }, _) => {
                st.weight_bytes += self.matmul(&lw.w_gate, &full, h, gate);
                score
                    .iter_mut()
                    .zip(gate.iter())
                    .for_each(|(s, &g)| *s = silu(g).abs());
                let set = top_k(score, k, idx);
                st.weight_bytes += self.matmul(&lw.w_up, &set, h, up);
                b.silu_mul(gate, up);
                (Some(set), gate)
            }
            (MlpRule::UpFirst { .. }, _) => {
                st.weight_bytes += self.matmul(&lw.w_up, &full, h, up);
                score
                    .iter_mut()
                    .zip(up.iter())
                    .for_each(|(s, &u)| *s = u.abs());
                let set = top_k(score, k, idx);
                st.weight_bytes += self.matmul(&lw.w_gate, &set, h, gate);
                b.silu_mul(gate, up);
                (Some(set), gate)
            }
            (MlpRule::Oracle { .. }, _) => {
                let mut jobs = [
                    self.job(&lw.w_gate, &full, gate),
                    self.job(&lw.w_up, &full, up),
                ];
                st.weight_bytes += jobs.iter().map(|j| read_bytes(&j.w, j.rows)).sum::<usize>();
                b.matmul_shared_input(h, &mut jobs);
                b.silu_mul(gate, up);
                score
                    .iter_mut()
                    .zip(gate.iter())
                    .for_each(|(s, &a)| *s = a.abs());
                let set = top_k(score, k, idx);
                up.fill(0.0);
                set.iter().for_each(|i| up[i] = gate[i]);
                (Some(set), up)
            }
        }
    }
}

/// Bytes of `w` a product over `rows` reads.
fn read_bytes(w: &Weight, rows: &IndexSet) -> usize {
    w.qtype.row_bytes(w.cols) * rows.len()
}

fn norm(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Add a bias to each token row; with `rows`, only to those entries (others stay 0).
fn add_bias(y: &mut [f32], bias: &[f32], rows: Option<&IndexSet>) {
    for yt in y.chunks_exact_mut(bias.len()) {
        match rows {
            Some(r) if !r.is_full() => r.iter().for_each(|i| yt[i] += bias[i]),
            _ => add(yt, bias),
        }
    }
}
