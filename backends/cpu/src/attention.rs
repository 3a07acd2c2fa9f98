//! Causal grouped-query attention over an f32 or f16 KV cache, for a subset of query heads.
//!
//! Reference formula, per token t (position p = pos0 + t) and selected head h with kv head
//! g = h / (n_heads / n_kv_heads), with the call's [`Scoring`] (scale, soft cap, window):
//!   s_j = score(q_h . k_{j,g})  for first(p) <= j <= p;   a = softmax(s);   out_h = sum_j a_j v_{j,g}
//! Unselected heads are written as 0. One pool task per (token, head); the scores against all keys
//! and the weighted sum of all values are one call each to the tier's f32 kernels
//! (`Kernels::dot_rows`, `Kernels::axpy_rows`; their `_f16` twins for an f16 cache), the scores
//! in a per-thread buffer grown once, their softmax the tier's (`Kernels::softmax`).
use crate::kernels::table::Kernels;
use crate::matmul::SyncPtr;
use crate::pool::SpinPool;
#[cfg(doc)]
use dejavu_backend_api::Scoring;
use dejavu_backend_api::{AttnShape, IndexSet, KvSlice};
use std::cell::RefCell;

thread_local! {
    /// Per thread: the scores of the current head (grown to the longest context seen).
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    kern: &Kernels,
    pool: &SpinPool,
    q: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    heads: &IndexSet,
    s: AttnShape,
    out: &mut [f32],
) {
    let kv_stride = s.n_kv_heads * s.head_dim;
    // Tasks write `out` through raw pointers: check every extent for real.
    check(s, heads);
    assert_eq!(
        q.len(),
        s.n_tokens * s.n_heads * s.head_dim,
        "attention: q length"
    );
    assert_eq!(out.len(), q.len(), "attention: out length");
    assert!(
        k.len() >= (s.pos0 + s.n_tokens) * kv_stride && same_types(k, v),
        "attention: cache length or types"
    );
    out.fill(0.0);
    let op = SyncPtr::new(out.as_mut_ptr());
    pool.run(s.n_tokens * s.n_heads, &|th| {
        let (t, h) = (th / s.n_heads, th % s.n_heads);
        if !heads.contains(h) {
            return;
        }
        // SAFETY: task `th` alone writes `out[th * hd..(th + 1) * hd]`, inside `out`, which
        // outlives `pool.run`.
        let o =
            unsafe { std::slice::from_raw_parts_mut(op.get().add(th * s.head_dim), s.head_dim) };
        let qh = &q[th * s.head_dim..(th + 1) * s.head_dim];
        head(kern, (k, v), s, h, s.pos0 + t, qh, o);
    });
}

/// One row of [`attention_seqs`]: its sequence's keys and values (every position up to its
/// own, `width` = `n_kv_heads * head_dim` values each), its position, and its query heads.
pub struct SeqAttn<'a> {
    pub k: KvSlice<'a>,
    pub v: KvSlice<'a>,
    pub pos: usize,
    pub heads: &'a IndexSet,
}

/// A step of several sequences: row `r` of `q` (every head) against row `r`'s own keys and
/// values at its own position, over its own heads, into row `r` of `out` (zeros for the heads
/// it did not select); one pool task per (row, head). Each head's output is bit for bit what
/// [`attention`] gives that row alone (`s.pos0` and `s.n_tokens` are not read).
pub fn attention_seqs(
    kern: &Kernels,
    pool: &SpinPool,
    q: &[f32],
    rows: &[SeqAttn<'_>],
    s: AttnShape,
    out: &mut [f32],
) {
    let (n, width) = (rows.len(), s.n_kv_heads * s.head_dim);
    let qd = s.n_heads * s.head_dim;
    assert_eq!(q.len(), n * qd, "attention: q length");
    assert_eq!(out.len(), q.len(), "attention: out length");
    for r in rows {
        check(s, r.heads);
        assert!(
            r.k.len() >= (r.pos + 1) * width && same_types(r.k, r.v),
            "attention: a row's cache length or types"
        );
    }
    out.fill(0.0);
    let op = SyncPtr::new(out.as_mut_ptr());
    pool.run(n * s.n_heads, &|th| {
        let (r, h) = (&rows[th / s.n_heads], th % s.n_heads);
        if !r.heads.contains(h) {
            return;
        }
        // SAFETY: task `th` alone writes `out[th * hd..(th + 1) * hd]`, inside `out`, which
        // outlives `pool.run`.
        let o =
            unsafe { std::slice::from_raw_parts_mut(op.get().add(th * s.head_dim), s.head_dim) };
        let qh = &q[th * s.head_dim..(th + 1) * s.head_dim];
        head(kern, (r.k, r.v), s, h, r.pos, qh, o);
    });
}

/// The head counts, the scoring and the head set agree with `s`.
fn check(s: AttnShape, heads: &IndexSet) {
    assert!(
        s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: head counts"
    );
    assert!(s.scoring.check().is_ok(), "attention: scoring");
    assert_eq!(heads.universe(), s.n_heads, "attention: head set universe");
}

fn same_types(k: KvSlice<'_>, v: KvSlice<'_>) -> bool {
    match (k, v) {
        (KvSlice::F32(k), KvSlice::F32(v)) => k.len() == v.len(),
        (KvSlice::F16(k), KvSlice::F16(v)) => k.len() == v.len(),
        _ => false,
    }
}

/// Query head `h` (`qh`) at position `p` over the keys and values `kv` (in bounds: checked by
/// the callers), into `o`.
fn head(
    kern: &Kernels,
    (k, v): (KvSlice<'_>, KvSlice<'_>),
    s: AttnShape,
    h: usize,
    p: usize,
    qh: &[f32],
    o: &mut [f32],
) {
    let (hd, sc) = (s.head_dim, s.scoring);
    let kv_stride = s.n_kv_heads * hd;
    let g = h / (s.n_heads / s.n_kv_heads);
    let first = sc.first(p);
    let n_keys = p + 1 - first;
    SCORES.with_borrow_mut(|scores| {
        scores.resize(n_keys, 0.0);
        let scores = &mut scores[..n_keys];
        // Keys j of kv head g are rows of `k[g * hd..]` at stride `kv_stride`; values alike.
        let at = first * kv_stride + g * hd;
        match k {
            KvSlice::F32(k) => (kern.dot_rows)(qh, &k[at..], kv_stride, scores),
            KvSlice::F16(k) => (kern.dot_rows_f16)(qh, &k[at..], kv_stride, scores),
        }
        (kern.softmax)(scores, sc);
        match v {
            KvSlice::F32(v) => (kern.axpy_rows)(scores, &v[at..], kv_stride, o),
            KvSlice::F16(v) => (kern.axpy_rows_f16)(scores, &v[at..], kv_stride, o),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use dejavu_backend_api::Scoring;
    use rand::{Rng, SeedableRng};

    /// Straightforward f64 attention, every head, for checking.
    fn naive(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> Vec<f64> {
        let hd = s.head_dim;
        let kvs = s.n_kv_heads * hd;
        let mut out = vec![0f64; q.len()];
        for t in 0..s.n_tokens {
            for h in 0..s.n_heads {
                let g = h / (s.n_heads / s.n_kv_heads);
                let qh = &q[(t * s.n_heads + h) * hd..][..hd];
                let (p, cfg) = (s.pos0 + t, s.scoring);
                let first = cfg.window.map_or(0, |w| (p + 1).saturating_sub(w));
                let sc: Vec<f64> = (first..=p)
                    .map(|j| {
                        let d = (0..hd)
                            .map(|i| qh[i] as f64 * k[j * kvs + g * hd + i] as f64)
                            .sum::<f64>()
                            * cfg.scale as f64;
                        match cfg.softcap {
                            Some(c) => c as f64 * (d / c as f64).tanh(),
                            None => d,
                        }
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for j in first..=p {
                    let a = (sc[j - first] - m).exp() / z;
                    for i in 0..hd {
                        out[(t * s.n_heads + h) * hd + i] += a * v[j * kvs + g * hd + i] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_with_gqa_offsets_and_head_subsets() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // Plain scoring; then Gemma-like ones: a scale of its own, a soft cap, windows shorter
        // than, equal to and longer than the context.
        let gemma = |hd: usize, cap: Option<f32>, window: Option<usize>| Scoring {
            scale: 1.0 / (hd as f32 * 1.5).sqrt(),
            softcap: cap,
            window,
        };
        for (n_heads, n_kv_heads, head_dim, pos0, n_tokens, scoring) in [
            (4, 2, 8, 0, 5, Scoring::plain(8)),
            (6, 3, 16, 7, 1, Scoring::plain(16)),
            (2, 2, 4, 0, 1, Scoring::plain(4)),
            (9, 3, 64, 30, 3, Scoring::plain(64)),
            (4, 2, 8, 0, 5, gemma(8, Some(0.5), Some(3))),
            (6, 3, 16, 7, 4, gemma(16, None, Some(1))),
            (6, 3, 16, 37, 6, gemma(16, Some(2.0), Some(7))),
            (9, 3, 64, 30, 3, gemma(64, Some(1.0), Some(64))),
            (2, 1, 8, 5, 3, gemma(8, None, Some(8))),
        ] {
            let s = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                pos0,
                n_tokens,
                scoring,
            };
            let len = (pos0 + n_tokens) * n_kv_heads * head_dim;
            let mut r = |n| {
                (0..n)
                    .map(|_| rng.gen_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let (q, k, v) = (r(n_tokens * n_heads * head_dim), r(len), r(len));
            // The f16 cache holds the same values rounded to f16; the reference sees those.
            let (k16, v16): (Vec<half::f16>, Vec<half::f16>) = (
                k.iter().map(|&x| half::f16::from_f32(x)).collect(),
                v.iter().map(|&x| half::f16::from_f32(x)).collect(),
            );
            let (kr, vr): (Vec<f32>, Vec<f32>) = (
                k16.iter().map(|x| x.to_f32()).collect(),
                v16.iter().map(|x| x.to_f32()).collect(),
            );
            for (want, kk, vv) in [
                (naive(&q, &k, &v, s), KvSlice::F32(&k), KvSlice::F32(&v)),
                (
                    naive(&q, &kr, &vr, s),
                    KvSlice::F16(&k16),
                    KvSlice::F16(&v16),
                ),
            ] {
                let heads =
                    IndexSet::new(n_heads, (0..n_heads as u32).step_by(2).collect()).unwrap();
                for (kern, set) in Isa::supported()
                    .into_iter()
                    .filter_map(Kernels::for_isa)
                    .flat_map(|k| [(k, IndexSet::full(n_heads)), (k, heads.clone())])
                {
                    let kern = &kern;
                    let mut out = vec![f32::NAN; q.len()];
                    attention(
                        kern,
                        &crate::pool::SpinPool::new(2),
                        &q,
                        kk,
                        vv,
                        &set,
                        s,
                        &mut out,
                    );
                    for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                        let h = (i / head_dim) % n_heads;
                        let w = if set.contains(h) { w } else { 0.0 };
                        assert!(
                            (o as f64 - w).abs() < 1e-5,
                            "shape {s:?} elem {i}: {o} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
