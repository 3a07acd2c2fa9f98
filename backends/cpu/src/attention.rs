//! Causal grouped-query attention over an f32 KV cache, for a subset of query heads.
//!
//! Reference formula, per token t (position p = pos0 + t) and selected head h with kv head
//! g = h / (n_heads / n_kv_heads):
//!   s_j = q_h . k_{j,g} / sqrt(head_dim)  for j <= p;   a = softmax(s);   out_h = sum_j a_j v_{j,g}
//! Unselected heads are written as 0. Rayon over tokens (prefill) and heads.
use crate::vec_dot::dot_f32;
use dejavu_backend_api::{AttnShape, IndexSet};
use rayon::prelude::*;

pub fn attention(q: &[f32], k: &[f32], v: &[f32], heads: &IndexSet, s: AttnShape, out: &mut [f32]) {
    let hd = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let kv_stride = s.n_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    debug_assert_eq!(q.len(), s.n_tokens * s.n_heads * hd);
    debug_assert!(k.len() >= (s.pos0 + s.n_tokens) * kv_stride && v.len() == k.len());
    out.fill(0.0);
    out.par_chunks_mut(hd).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / s.n_heads, th % s.n_heads);
        if !heads.contains(h) {
            return;
        }
        let g = h / group;
        let n_keys = s.pos0 + t + 1;
        let qh = &q[th * hd..(th + 1) * hd];
        let mut scores: Vec<f32> = (0..n_keys)
            .map(|j| dot_f32(qh, &k[j * kv_stride + g * hd..][..hd]) * scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        for (j, &a) in scores.iter().enumerate() {
            let vj = &v[j * kv_stride + g * hd..][..hd];
            let a = a / sum;
            for (o, &vv) in o.iter_mut().zip(vj) {
                *o += a * vv;
            }
        }
    });
}
