//! The layer executor: one forward pass of a decoder over a batch of tokens, under a
//! [`SparsePlan`], on any [`Backend`]. The architecture enters only through the typed config.
//!
//! ```text
//! x = embed(tokens) (then proj_in) (+ learned positions)
//! per layer:                                       pre-norm            post-norm (opt-350m)
//!   attention:  h = pre ? norm(x) : x ; q,k,v = h Wq^T (+b), h Wk^T (+b), h Wv^T (+b)
//!               rope(q, k) if RoPE ; append k, v to the cache
//!               x += attention(q, K, V; selected heads) Wo^T (+bo) ; post ? x = norm(x)
//!   MLP:        h = pre ? norm(x) : x
//!               a = act(h Wg^T) * (h Wu^T)    (gated: SwiGLU, gated ReLU)
//!               a = act(h Wu^T + bu)          (plain: OPT's fc1, ReLU)   selected neurons only
//!               x += a Wd^T (+bd) ; post ? x = norm(x)
//! logits = (final norm(x)) (proj_out) E^T
//! ```
//! Unselected heads and neurons contribute exactly zero (biases of Wo and Wd are added whole), so
//! a plan with full sets is the dense model.
//!
//! The plan is either given ([`Plan::Fixed`]: explicit sets, for tests and research) or built per
//! decode step by a [`Policy`] from the activations themselves ([`Plan::Policy`]): e.g. gate-first
//! computes the gate projection, keeps the top neurons and computes up and down over those; the
//! contextual output head previews the logits at low rank and computes exact logits only for the
//! top candidates (the others keep their preview value). A sparse MLP set reads the neuron-major
//! down projection of the [`SparseLayout`] when the executor has one (without it, the dense down
//! projection over zeroed activations: the same result, no bytes saved). Likewise a sparse head
//! set reads the head-major W_o. Learned predictors run through [`crate::sparsity::lookahead`].
use crate::engine::config::{ModelConfig, NormKind, Positions};
use crate::engine::kv_cache::{buf, BlockCost, Capture, KvCache, KvStore, Scratch, StepStats};
use crate::engine::weights::{Model, NormWeights, WeightRef};
use crate::sparsity::layout::SparseLayout;
use crate::sparsity::lookahead::Predictions;
use crate::sparsity::policy::Policy;
use crate::sparsity::{head_rows, top_k, HeadRule, KvRule, LayerPlan, MlpRule, SparsePlan};
use crate::{Error, Result};
use dejavu_backend_api::{AttnShape, Backend, IndexSet, MatmulJob, Weight};

/// Which positions of the batch need logits.
#[derive(Debug, Clone, Copy)]
pub enum Logits {
    /// Only the last token (generation).
    Last,
    /// Tokens `start..end` of the batch (perplexity scores a window).
    Range(usize, usize),
    /// No logits: the output head's input for tokens `start..end` (`[n][d_embed]`: the final
    /// hidden states, normed and projected as the head reads them; calibration collects them).
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

/// What every block of one step shares.
struct Step<'a> {
    n: usize,
    pos0: usize,
    plan: Plan<'a>,
    /// The policy, for single-token steps (contextual rules act on those only).
    policy: Option<&'a Policy>,
    dense: LayerPlan,
}

impl Step<'_> {
    fn layer(&self, l: usize) -> &LayerPlan {
        match self.plan {
            Plan::Fixed(p) => &p.layers[l],
            Plan::Policy(_) => &self.dense,
        }
    }
}

impl<'m> Executor<'m> {
    pub fn new(model: &'m Model, backend: &'m dyn Backend) -> Result<Self> {
        if let Some(w) = model
            .matrices()
            .into_iter()
            .find(|w| !backend.supports(w.qtype))
        {
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

    fn config(&self) -> &'m ModelConfig {
        &self.model.config
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

    /// Several products of one input in one dispatch; returns the bytes read.
    fn jobs(&self, x: &[f32], jobs: &mut [MatmulJob<'_>]) -> usize {
        let bytes = jobs.iter().map(|j| read_bytes(&j.w, j.rows)).sum();
        self.backend.matmul_shared_input(x, jobs);
        bytes
    }

    /// The model's norm of each token of `x` into `out`.
    fn norm(&self, w: &NormWeights, x: &[f32], out: &mut [f32]) {
        let c = self.config();
        match c.norm {
            NormKind::Rms => self.backend.rmsnorm(x, &w.weight, c.norm_eps, out),
            NormKind::Layer => {
                (self.backend).layernorm(x, &w.weight, w.bias.as_deref(), c.norm_eps, out)
            }
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
    /// the logits asked for (`[n][vocab]`, n = 1 for `Last`; the head's input for `Hidden`), valid
    /// until the cache's next use. `cache.last_step()` then tells what the step read.
    pub fn run<'c>(
        &self,
        tokens: &[u32],
        cache: &'c mut KvCache,
        plan: Plan,
        want: Logits,
    ) -> Result<&'c mut [f32]> {
        let c = self.config();
        let (n, pos0) = (tokens.len(), cache.len);
        let step = self.check(tokens, cache, plan)?;
        let (first, last) = match want {
            Logits::Last => (n - 1, n),
            Logits::Range(s, e) | Logits::Hidden(s, e) if s < e && e <= n => (s, e),
            Logits::Range(s, e) | Logits::Hidden(s, e) => {
                return Err(Error::Invalid(format!(
                    "logit range {s}..{e} outside batch of {n}"
                )))
            }
        };
        let KvCache {
            kv,
            scratch: sc,
            capture,
            ..
        } = cache;
        if let Some(cap) = capture.as_mut() {
            for v in [&mut cap.attn_in, &mut cap.head_norm, &mut cap.mlp_in] {
                v.resize(c.n_layers, Vec::new());
            }
        }
        let mut st = StepStats {
            weight_bytes: self.embed(tokens, pos0, sc)?,
            ..Default::default()
        };
        std::thread::scope(|s| -> Result<()> {
            let mut pred = Predictions::new(s, step.policy, self.backend, self.spare, c.n_layers);
            for l in 0..c.n_layers {
                let t = Timer::start(&st);
                self.attention_block(l, &step, &mut pred, kv, capture, sc, &mut st)?;
                t.stop(&mut st, |s| &mut s.attention);
                let t = Timer::start(&st);
                self.mlp_block(l, &step, &mut pred, capture, sc, &mut st)?;
                t.stop(&mut st, |s| &mut s.mlp);
            }
            st.weight_bytes += pred.bytes;
            st.predict_ns = pred.busy.as_nanos() as u64;
            st.predict_wait_ns = pred.wait.as_nanos() as u64;
            Ok(())
        })?;
        cache.len = pos0 + n;
        let t = Timer::start(&st);
        let out = self.output_head(&step, first, last, want, &mut cache.scratch, &mut st)?;
        t.stop(&mut st, |s| &mut s.output);
        cache.last = st;
        Ok(out)
    }

    /// The step's shared state, after checking the batch, the context and the plan.
    fn check<'p>(&self, tokens: &[u32], cache: &KvCache, plan: Plan<'p>) -> Result<Step<'p>> {
        let c = self.config();
        let (n, pos0) = (tokens.len(), cache.len);
        if n == 0 {
            return Err(Error::Invalid("forward called with no tokens".into()));
        }
        if pos0 + n > cache.n_ctx {
            return Err(Error::ContextOverflow {
                n_tokens: pos0 + n,
                n_ctx: cache.n_ctx,
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::Invalid(format!(
                "token id {t} out of range (vocab {})",
                c.vocab_size
            )));
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
        Ok(Step {
            n,
            pos0,
            plan,
            policy: match plan {
                Plan::Policy(p) if n == 1 => Some(p),
                _ => None,
            },
            dense: LayerPlan::dense(c),
        })
    }

    /// `x` = token embeddings (through `proj_in` when the embedding is narrower), plus learned
    /// positions. Returns the weight bytes one token reads (as `Model::dense_bytes_per_token`).
    fn embed(&self, tokens: &[u32], pos0: usize, sc: &mut Scratch) -> Result<usize> {
        let (m, b, c) = (self.model, self.backend, self.config());
        let (n, d) = (tokens.len(), c.d_model);
        let x = buf(&mut sc.x, n * d);
        let embd = m.weight(&m.token_embd);
        let mut bytes = embd.qtype.row_bytes(embd.cols);
        match &m.proj_in {
            None => {
                for (&t, xt) in tokens.iter().zip(x.chunks_exact_mut(d)) {
                    b.dequantize_row(&embd, t as usize, xt);
                }
            }
            Some(p) => {
                let e = buf(&mut sc.e, n * c.d_embed);
                for (&t, et) in tokens.iter().zip(e.chunks_exact_mut(c.d_embed)) {
                    b.dequantize_row(&embd, t as usize, et);
                }
                bytes += self.matmul(p, &IndexSet::full(d), e, x);
            }
        }
        if let (Positions::Learned { offset }, Some(pe)) = (c.positions, &m.pos_embd) {
            let pos = m.weight(pe);
            let row = buf(&mut sc.o, d);
            for (t, xt) in x.chunks_exact_mut(d).enumerate() {
                let p = pos0 + t + offset;
                if p >= pos.rows {
                    return Err(Error::ContextOverflow {
                        n_tokens: pos0 + n,
                        n_ctx: pos.rows - offset,
                    });
                }
                b.dequantize_row(&pos, p, row);
                add(xt, row);
            }
            bytes += pos.qtype.row_bytes(pos.cols);
        }
        Ok(bytes)
    }

    /// Layer `l`'s attention: Q over the selected heads' rows, K and V in full (or, under lazy
    /// K/V, for the selected heads), attention over the selected heads, W_o, the residual add.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        l: usize,
        step: &Step,
        pred: &mut Predictions,
        kv: &mut KvStore,
        capture: &mut Option<Capture>,
        sc: &mut Scratch,
        st: &mut StepStats,
    ) -> Result<()> {
        let (m, b, c) = (self.model, self.backend, self.config());
        let lw = &m.layers[l];
        let (n, d, hd) = (step.n, c.d_model, c.head_dim);
        let (qd, kvd) = (c.n_heads * hd, c.kv_dim());
        let x = buf(&mut sc.x, n * d);
        let h = buf(&mut sc.h, n * d);
        self.block_input(&lw.attn_norm, x, h);
        if let Some(cap) = capture.as_mut() {
            cap.attn_in[l].extend_from_slice(h);
        }
        pred.submit(l, h);
        let rule = step.policy.map_or(HeadRule::Dense, |p| p.heads[l]);
        let predicted = match rule {
            HeadRule::LowRank { .. } => pred.heads(l)?,
            _ => None,
        };
        let lp = step.layer(l);
        let q_set = predicted.as_ref().map(|hs| head_rows(hs, hd));
        let heads = predicted.as_ref().unwrap_or(&lp.heads);
        let q_rows = q_set.as_ref().unwrap_or(lp.q_rows());
        let (q, att) = (buf(&mut sc.q, n * qd), buf(&mut sc.att, n * qd));
        // Keys and values: every KV head, or under lazy K/V (single-token steps with every
        // input kept) the selected heads only; heads that missed positions since they were last
        // computed get those too (see `KvStore`), in one product per first missing position.
        kv.clamp(l, step.pos0);
        // Batches (prefill) under a lazy policy keep their inputs too, for the steps after them.
        let lazy = matches!(step.plan, Plan::Policy(p) if p.kv == KvRule::Lazy);
        let kept = lazy && kv.keep_inputs(l, step.pos0, h);
        let kv_heads = match kept && n == 1 && !matches!(rule, HeadRule::Norm { .. }) {
            true => heads.clone(),
            false => IndexSet::full(c.n_kv_heads),
        };
        let (cur_set, stale) = kv.stale_groups(l, step.pos0, &kv_heads);
        let cur_rows = head_rows(&cur_set, hd);
        let (k, v) = (buf(&mut sc.k, n * kvd), buf(&mut sc.v, n * kvd));
        let mut jobs = vec![self.job(&lw.wq, q_rows, q)];
        if !cur_set.is_empty() {
            jobs.push(self.job(&lw.wk, &cur_rows, k));
            jobs.push(self.job(&lw.wv, &cur_rows, v));
        }
        st.weight_bytes += self.jobs(h, &mut jobs);
        drop(jobs);
        add_bias(q, lw.bq.as_deref(), Some(q_rows));
        add_bias(k, lw.bk.as_deref(), Some(&cur_rows));
        add_bias(v, lw.bv.as_deref(), Some(&cur_rows));
        if let Some((theta, style)) = c.rope() {
            b.rope(q, c.n_heads, hd, step.pos0, theta, style);
            b.rope(k, c.n_kv_heads, hd, step.pos0, theta, style);
        }
        match cur_set.is_full() {
            true => drop(kv.append(l, step.pos0, k, v)),
            false => kv.write_heads(l, step.pos0, &cur_set, hd, k, v),
        }
        for (from, set) in stale {
            let gap = [&mut sc.gap_x, &mut sc.gap_k, &mut sc.gap_v];
            st.weight_bytes += self.recompute_kv(l, from, step, &set, h, kv, gap);
        }
        let (k_all, v_all) = kv.view(l, step.pos0 + n);
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            pos0: step.pos0,
            n_tokens: n,
        };
        b.attention(q, k_all, v_all, heads, shape, att);
        if let Some(cap) = capture.as_mut() {
            cap.head_norm[l].extend(att.chunks_exact(hd).map(norm));
        }
        let normed = match rule {
            HeadRule::Norm { .. } => {
                Some(top_heads_by_norm(att, hd, rule, &mut sc.score, &mut sc.idx))
            }
            _ => None,
        };
        let heads = normed.as_ref().unwrap_or(heads);
        st.heads_kept += heads.len();
        st.heads_total += c.n_heads;
        let o = buf(&mut sc.o, n * d);
        match self.layout {
            Some(lay) if !heads.is_full() => {
                let (w, rows) = (lay.wo_t(l), head_rows(heads, hd));
                b.axpy_rows(&w, &rows, att, o);
                st.weight_bytes += read_bytes(&w, &rows);
            }
            _ => st.weight_bytes += self.matmul(&lw.wo, &IndexSet::full(d), att, o),
        }
        add_bias(o, lw.bo.as_deref(), None);
        self.residual(&lw.attn_norm, x, o, h);
        Ok(())
    }

    /// Lazy K/V: keys and values of `heads` of layer `l` for positions `from..pos0 + n` (the
    /// kept inputs of `from..pos0`, then this step's `h`), stored in the cache; returns the bytes
    /// read (each head's rows once, whatever the number of positions).
    #[allow(clippy::too_many_arguments)]
    fn recompute_kv(
        &self,
        l: usize,
        from: usize,
        step: &Step,
        heads: &IndexSet,
        h: &[f32],
        kv: &mut KvStore,
        [gx, gk, gv]: [&mut Vec<f32>; 3],
    ) -> usize {
        let (c, b, lw) = (self.config(), self.backend, &self.model.layers[l]);
        let (d, hd, kvd) = (c.d_model, c.head_dim, c.kv_dim());
        let m = step.pos0 + step.n - from;
        let x = buf(gx, m * d);
        kv.inputs(l, from, step.pos0, &mut x[..(step.pos0 - from) * d]);
        x[(step.pos0 - from) * d..].copy_from_slice(h);
        let rows = head_rows(heads, hd);
        let (k, v) = (buf(gk, m * kvd), buf(gv, m * kvd));
        let bytes = self.jobs(
            x,
            &mut [self.job(&lw.wk, &rows, k), self.job(&lw.wv, &rows, v)],
        );
        add_bias(k, lw.bk.as_deref(), Some(&rows));
        add_bias(v, lw.bv.as_deref(), Some(&rows));
        if let Some((theta, style)) = c.rope() {
            b.rope(k, c.n_kv_heads, hd, from, theta, style);
        }
        kv.write_heads(l, from, heads, hd, k, v);
        bytes
    }

    /// A block's input `h`: `norm(x)` (pre-norm models) or `x` itself (post-norm: the previous
    /// block already normed it).
    fn block_input(&self, w: &NormWeights, x: &[f32], h: &mut [f32]) {
        match self.config().pre_norm {
            true => self.norm(w, x, h),
            false => h.copy_from_slice(x),
        }
    }

    /// `x += o`, then (post-norm models) `x = norm(x)` through `tmp`.
    fn residual(&self, w: &NormWeights, x: &mut [f32], o: &[f32], tmp: &mut [f32]) {
        add(x, o);
        if !self.config().pre_norm {
            self.norm(w, x, tmp);
            x.copy_from_slice(tmp);
        }
    }

    /// Layer `l`'s MLP over the neurons its rule selects, the down projection, the residual add.
    fn mlp_block(
        &self,
        l: usize,
        step: &Step,
        pred: &mut Predictions,
        capture: &mut Option<Capture>,
        sc: &mut Scratch,
        st: &mut StepStats,
    ) -> Result<()> {
        let (m, b, c) = (self.model, self.backend, self.config());
        let lw = &m.layers[l];
        let (n, d, ff) = (step.n, c.d_model, c.n_ff);
        let x = buf(&mut sc.x, n * d);
        let h = buf(&mut sc.h, n * d);
        self.block_input(&lw.ffn_norm, x, h);
        if let Some(cap) = capture.as_mut() {
            cap.mlp_in[l].extend_from_slice(h);
        }
        let rule = step.policy.map_or(MlpRule::Dense, |p| p.mlp[l]);
        let predicted = match rule {
            MlpRule::LowRank { .. } => pred.mlp(l)?,
            _ => None,
        };
        let full_ff = IndexSet::full(ff);
        let fixed = if step.policy.is_some() {
            &full_ff
        } else {
            &step.layer(l).mlp
        };
        let bufs = MlpBufs {
            gate: buf(&mut sc.gate, n * ff),
            up: buf(&mut sc.up, n * ff),
            score: buf(&mut sc.score, ff),
            idx: &mut sc.idx,
        };
        let (set, act) = self.mlp_select(l, rule, fixed, predicted, h, bufs, st)?;
        let set = set.as_ref().unwrap_or(fixed);
        st.mlp_kept += set.len();
        st.mlp_total += ff;
        let o = buf(&mut sc.o, n * d);
        match self.layout {
            Some(lay) if !set.is_full() => {
                let w = lay.down_t(l);
                b.axpy_rows(&w, set, act, o);
                st.weight_bytes += read_bytes(&w, set);
            }
            _ => st.weight_bytes += self.matmul(&lw.w_down, &IndexSet::full(d), act, o),
        }
        add_bias(o, lw.b_down.as_deref(), None);
        self.residual(&lw.ffn_norm, x, o, h);
        Ok(())
    }

    /// The MLP's first projections of layer `l` over `set` in one dispatch, then the activation:
    /// `act(gate) * up` into `gate` (gated), or `act(up + bias)` into `up` (plain). Rows outside
    /// `set` are 0. Returns the activations.
    fn mlp_first<'a>(
        &self,
        l: usize,
        set: &IndexSet,
        h: &[f32],
        gate: &'a mut [f32],
        up: &'a mut [f32],
        st: &mut StepStats,
    ) -> &'a mut [f32] {
        let (lw, b, mlp) = (&self.model.layers[l], self.backend, self.config().mlp);
        match &lw.w_gate {
            Some(wg) => {
                st.weight_bytes += self.jobs(
                    h,
                    &mut [self.job(wg, set, gate), self.job(&lw.w_up, set, up)],
                );
                b.glu(mlp.activation(), gate, up);
                gate
            }
            None => {
                st.weight_bytes += self.matmul(&lw.w_up, set, h, up);
                add_bias(up, lw.b_up.as_deref(), Some(set));
                b.activate(mlp.activation(), up);
                up
            }
        }
    }

    /// Gate and up projections of layer `l` under `rule` (`fixed`: the given set when the rule is
    /// dense; `predicted`: the learned predictor's set for `LowRank`); returns the chosen set
    /// (`None`: `fixed`) and the activations, zero outside the set, for the down projection.
    #[allow(clippy::too_many_arguments)]
    fn mlp_select<'a>(
        &self,
        l: usize,
        rule: MlpRule,
        fixed: &IndexSet,
        predicted: Option<IndexSet>,
        h: &[f32],
        bufs: MlpBufs<'a>,
        st: &mut StepStats,
    ) -> Result<(Option<IndexSet>, &'a mut [f32])> {
        let (lw, b, c) = (&self.model.layers[l], self.backend, self.config());
        let MlpBufs {
            gate,
            up,
            score,
            idx,
        } = bufs;
        let full = IndexSet::full(c.n_ff);
        let k = rule.kept(c.n_ff);
        let act = c.mlp.activation();
        let needs_gate =
            || Error::Invalid(format!("{rule:?} needs a gated MLP ({:?} has none)", c.mlp));
        Ok(match (rule, predicted) {
            (MlpRule::LowRank { .. }, Some(set)) => {
                let a = self.mlp_first(l, &set, h, gate, up, st);
                (Some(set), a)
            }
            (MlpRule::Dense | MlpRule::LowRank { .. }, _) => {
                (None, self.mlp_first(l, fixed, h, gate, up, st))
            }
            (MlpRule::GateFirst { .. }, _) => {
                let wg = lw.w_gate.as_ref().ok_or_else(needs_gate)?;
                st.weight_bytes += self.matmul(wg, &full, h, gate);
                (score.iter_mut().zip(gate.iter())).for_each(|(s, &g)| *s = act.apply(g).abs());
                let set = top_k(score, k, idx);
                st.weight_bytes += self.matmul(&lw.w_up, &set, h, up);
                b.glu(act, gate, up);
                (Some(set), gate)
            }
            (MlpRule::UpFirst { .. }, _) => {
                let wg = lw.w_gate.as_ref().ok_or_else(needs_gate)?;
                st.weight_bytes += self.matmul(&lw.w_up, &full, h, up);
                (score.iter_mut().zip(up.iter())).for_each(|(s, &u)| *s = u.abs());
                let set = top_k(score, k, idx);
                st.weight_bytes += self.matmul(wg, &set, h, gate);
                b.glu(act, gate, up);
                (Some(set), gate)
            }
            (MlpRule::ReluExact | MlpRule::OracleNonzero, _) => {
                // The first projection in full: its ReLU says which neurons are nonzero.
                let nonzero = |a: &[f32]| {
                    let on = (0..a.len() as u32)
                        .filter(|&i| a[i as usize] > 0.0)
                        .collect();
                    IndexSet::new(a.len(), on).expect("increasing indices below n_ff")
                };
                let first = lw.w_gate.as_ref().unwrap_or(&lw.w_up);
                let (set, a) = match &lw.w_gate {
                    None => {
                        let a = self.mlp_first(l, &full, h, &mut *gate, &mut *up, st);
                        (nonzero(a), up)
                    }
                    Some(wg) => {
                        st.weight_bytes += self.matmul(wg, &full, h, gate);
                        let set = nonzero(gate);
                        st.weight_bytes += self.matmul(&lw.w_up, &set, h, up);
                        b.glu(act, gate, up);
                        (set, gate)
                    }
                };
                if rule == MlpRule::OracleNonzero {
                    // An oracle named the set: the first projection's other rows are not counted.
                    st.weight_bytes -= first.qtype.row_bytes(first.cols) * (c.n_ff - set.len());
                }
                (Some(set), a)
            }
            (MlpRule::Oracle { .. }, _) => {
                let gated = lw.w_gate.is_some();
                let a = self.mlp_first(l, &full, h, &mut *gate, &mut *up, st);
                (score.iter_mut().zip(a.iter())).for_each(|(s, &v)| *s = v.abs());
                let set = top_k(score, k, idx);
                // The kept activations into the other buffer, zero elsewhere.
                let (a, other) = if gated { (&*gate, up) } else { (&*up, gate) };
                other.fill(0.0);
                set.iter().for_each(|i| other[i] = a[i]);
                (Some(set), other)
            }
        })
    }

    /// The final norm, `proj_out` and the output head (dense, or the contextual head's preview
    /// plus exact candidates) for tokens `first..last`.
    fn output_head<'s>(
        &self,
        step: &Step,
        first: usize,
        last: usize,
        want: Logits,
        sc: &'s mut Scratch,
        st: &mut StepStats,
    ) -> Result<&'s mut [f32]> {
        let (m, b, c) = (self.model, self.backend, self.config());
        let (d, nl) = (c.d_model, last - first);
        let x = &sc.x[first * d..last * d];
        let hn = buf(&mut sc.h, nl * d);
        match &m.output_norm {
            Some(w) => self.norm(w, x, hn),
            None => hn.copy_from_slice(x),
        }
        let head_in: &mut [f32] = match &m.proj_out {
            Some(p) => {
                let e = buf(&mut sc.e, nl * c.d_embed);
                st.weight_bytes += self.matmul(p, &IndexSet::full(c.d_embed), hn, e);
                e
            }
            None => hn,
        };
        if let Logits::Hidden(..) = want {
            return Ok(head_in);
        }
        let vocab = c.vocab_size;
        let logits = buf(&mut sc.logits, nl * vocab);
        match step.policy.and_then(|p| p.output.as_ref()) {
            Some(rule) if nl == 1 => {
                let pv = &rule.preview;
                let z = buf(&mut sc.z, pv.rank);
                b.matmul(&pv.proj(), &IndexSet::full(pv.rank), head_in, z);
                let preview = buf(&mut sc.preview, vocab);
                b.matmul(&pv.table(), &IndexSet::full(vocab), z, preview);
                let cand = top_k(preview, rule.candidates, &mut sc.idx);
                st.weight_bytes += pv.bytes() + self.matmul(&m.output, &cand, head_in, logits);
                st.exact_logits = cand.len();
                // Exact logits for the candidates, the preview's for every other token.
                for i in cand.iter() {
                    preview[i] = logits[i];
                }
                logits.copy_from_slice(preview);
            }
            _ => {
                st.weight_bytes += self.matmul(&m.output, &IndexSet::full(vocab), head_in, logits);
                st.exact_logits = vocab;
            }
        }
        Ok(logits)
    }
}

/// Measures one block: its wall time and the weight bytes it added to the step's count.
struct Timer {
    at: std::time::Instant,
    bytes: usize,
}

impl Timer {
    fn start(st: &StepStats) -> Self {
        Self {
            at: std::time::Instant::now(),
            bytes: st.weight_bytes,
        }
    }
    fn stop(self, st: &mut StepStats, block: impl Fn(&mut StepStats) -> &mut BlockCost) {
        let bytes = st.weight_bytes - self.bytes;
        let b = block(st);
        b.ns += self.at.elapsed().as_nanos() as u64;
        b.bytes += bytes;
    }
}

/// attn-norm: every head's attention output is known; keep the top heads by its norm and zero
/// the others' outputs. Returns the kept set.
fn top_heads_by_norm(
    att: &mut [f32],
    hd: usize,
    rule: HeadRule,
    norms: &mut Vec<f32>,
    idx: &mut Vec<u32>,
) -> IndexSet {
    let n_heads = att.len() / hd;
    let norms = buf(norms, n_heads);
    (norms.iter_mut().zip(att.chunks_exact(hd))).for_each(|(s, a)| *s = norm(a));
    let set = top_k(norms, rule.kept(n_heads), idx);
    for (hh, a) in att.chunks_exact_mut(hd).enumerate() {
        if !set.contains(hh) {
            a.fill(0.0);
        }
    }
    set
}

/// The MLP's scratch buffers of one step.
struct MlpBufs<'a> {
    gate: &'a mut [f32],
    up: &'a mut [f32],
    score: &'a mut [f32],
    idx: &'a mut Vec<u32>,
}

/// Bytes of `w` a product over `rows` reads.
fn read_bytes(w: &Weight, rows: &IndexSet) -> usize {
    w.qtype.row_bytes(w.cols) * rows.len()
}

fn norm(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Add a bias (if any) to each token row; with `rows`, only to those entries (others stay 0).
fn add_bias(y: &mut [f32], bias: Option<&[f32]>, rows: Option<&IndexSet>) {
    let Some(bias) = bias else { return };
    for yt in y.chunks_exact_mut(bias.len()) {
        match rows {
            Some(r) if !r.is_full() => r.iter().for_each(|i| yt[i] += bias[i]),
            _ => add(yt, bias),
        }
    }
}
