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
use crate::model::{Model, WeightRef};
use crate::sparsity::SparsePlan;
use crate::{Error, Result};
use dejavu_backend_api::{AttnShape, Backend, IndexSet, MatmulJob};

/// Keys and values of every layer for positions `0..len`, f32, `[n_ctx][n_kv_heads * head_dim]`,
/// plus the activation buffers of the sequence's forward passes (grown to the largest batch seen,
/// then reused: decoding allocates nothing per token).
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    n_ctx: usize,
    scratch: Scratch,
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
}

pub struct Executor<'m> {
    pub model: &'m Model,
    pub backend: &'m dyn Backend,
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
        Ok(Self { model, backend })
    }

    fn matmul(&self, w: &WeightRef, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
        self.backend.matmul(&self.model.weight(w), rows, x, y)
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

    /// Run `tokens` at positions `cache.len()..`, append their keys/values to the cache and return
    /// the logits asked for (`[n][vocab]`, n = 1 for `Last`), valid until the cache's next use.
    pub fn forward<'c>(
        &self,
        tokens: &[u32],
        cache: &'c mut KvCache,
        plan: &SparsePlan,
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
        if plan.layers.len() != c.n_layers {
            return Err(Error::BadPlan(format!(
                "{} layer plans for {} layers",
                plan.layers.len(),
                c.n_layers
            )));
        }
        let (d, qd, kvd, ff) = (c.d_model, c.n_heads * c.head_dim, c.kv_dim(), c.n_ff);

        let (first, last) = match want {
            Logits::Last => (n - 1, n),
            Logits::Range(s, e) if s < e && e <= n => (s, e),
            Logits::Range(s, e) => {
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
        let full_kv = IndexSet::full(kvd);
        let full_d = IndexSet::full(d);

        for (l, (lw, lp)) in m.layers.iter().zip(&plan.layers).enumerate() {
            b.rmsnorm(x, m.vector(&lw.attn_norm), c.rms_eps, h);
            b.matmul_shared_input(
                h,
                &mut [
                    self.job(&lw.wq, lp.q_rows(), q),
                    self.job(&lw.wk, &full_kv, k),
                    self.job(&lw.wv, &full_kv, v),
                ],
            );
            if let (Some(bq), Some(bk), Some(bv)) = (&lw.bq, &lw.bk, &lw.bv) {
                add_bias(q, m.vector(bq), Some(lp.q_rows()));
                add_bias(k, m.vector(bk), None);
                add_bias(v, m.vector(bv), None);
            }
            b.rope(q, c.n_heads, c.head_dim, pos0, c.rope_theta, c.rope_style);
            b.rope(
                k,
                c.n_kv_heads,
                c.head_dim,
                pos0,
                c.rope_theta,
                c.rope_style,
            );
            cache.k[l][pos0 * kvd..(pos0 + n) * kvd].copy_from_slice(k);
            cache.v[l][pos0 * kvd..(pos0 + n) * kvd].copy_from_slice(v);
            let shape = AttnShape {
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim,
                pos0,
                n_tokens: n,
            };
            let end = (pos0 + n) * kvd;
            b.attention(
                q,
                &cache.k[l][..end],
                &cache.v[l][..end],
                &lp.heads,
                shape,
                att,
            );
            self.matmul(&lw.wo, &full_d, att, o);
            add(x, o);

            b.rmsnorm(x, m.vector(&lw.ffn_norm), c.rms_eps, h);
            b.matmul_shared_input(
                h,
                &mut [
                    self.job(&lw.w_gate, &lp.mlp, gate),
                    self.job(&lw.w_up, &lp.mlp, up),
                ],
            );
            b.silu_mul(gate, up);
            self.matmul(&lw.w_down, &full_d, gate, o);
            add(x, o);
        }
        cache.len = pos0 + n;

        let hn = &mut h[..(last - first) * d];
        b.rmsnorm(
            &x[first * d..last * d],
            m.vector(&m.output_norm),
            c.rms_eps,
            hn,
        );
        let logits = buf(&mut sc.logits, (last - first) * c.vocab_size);
        self.matmul(&m.output, &IndexSet::full(c.vocab_size), hn, logits);
        Ok(logits)
    }
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
