//! Causal grouped-query attention over an f32 or f16 KV cache, for a subset of query heads.
//!
//! Reference formula, per token t (position p = pos0 + t) and selected head h with kv head
//! g = h / (n_heads / n_kv_heads), with the call's [`Scoring`] (scale, soft cap, window):
//!   s_j = score(q_h . k_{j,g})  for first(p) <= j <= p;   a = softmax(s);   out_h = sum_j a_j v_{j,g}
//! Unselected heads are written as 0. One pool task per (token, KV group, chunk of the group's
//! query heads): the chunk's scores against all keys and its weighted sums of all values are
//! one call each to the tier's many-head kernels (`Kernels::dot_rows_many`,
//! `Kernels::axpy_rows_many`; their `_f16` twins for an f16 cache), which read each key and value
//! row once for several heads (grouped-query attention) and give each head what the one-head
//! kernels give it, so the split into tasks never changes a result. The scores sit in a
//! per-thread buffer grown once; their softmax is the tier's (`Kernels::softmax`). A prompt's
//! batch of at least `attention_prompt::PROMPT_MIN` tokens goes in tiles through `gemm`
//! instead (`attention_prompt.rs`).
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
    attention_of(kern, pool, (q, k, v), heads, s, out, true)
}

/// [`attention`] with every token as a one-token call computes it (a decode step's kernels,
/// never the prompt's tiles), so each token's outputs are bit for bit those of its own decode
/// step, however many tokens share the call: the batch-invariant path.
#[allow(clippy::too_many_arguments)]
pub fn attention_steps(
    kern: &Kernels,
    pool: &SpinPool,
    q: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    heads: &IndexSet,
    s: AttnShape,
    out: &mut [f32],
) {
    attention_of(kern, pool, (q, k, v), heads, s, out, false)
}

/// [`attention`] (`tiles`: a prompt of at least `PROMPT_MIN` tokens may take the tiled path)
/// or [`attention_steps`].
fn attention_of(
    kern: &Kernels,
    pool: &SpinPool,
    (q, k, v): (&[f32], KvSlice<'_>, KvSlice<'_>),
    heads: &IndexSet,
    s: AttnShape,
    out: &mut [f32],
    tiles: bool,
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
    if tiles && s.n_tokens >= crate::attention_prompt::PROMPT_MIN {
        return crate::attention_prompt::attention_prompt(kern, pool, q, k, v, heads, s, out);
    }
    let op = SyncPtr::new(out.as_mut_ptr());
    by_groups(pool, s.n_tokens, s, heads, &|t, g, hs| {
        // SAFETY: the tasks' heads are disjoint, and each writes only its heads' outputs
        // `out[(t * n_heads + h) * hd..][..hd]`, inside `out`, which outlives the run.
        unsafe { group(kern, (k, v), s, g, s.pos0 + t, (q, op), t, hs) };
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
    by_groups_of(pool, n, s, &|r| rows[r].heads, &|r, g, hs| {
        let row = &rows[r];
        // SAFETY: as in `attention`: disjoint heads, each task writing its own heads' outputs.
        unsafe { group(kern, (row.k, row.v), s, g, row.pos, (q, op), r, hs) };
    });
}

/// Most query heads one task hands the many-head kernels at once (the AVX-512 tier's).
const HEADS_AT_ONCE: usize = 4;

/// [`by_groups_of`] with one head set for every unit.
fn by_groups(
    pool: &SpinPool,
    units: usize,
    s: AttnShape,
    heads: &IndexSet,
    task: &(dyn Fn(usize, usize, &[usize]) + Sync),
) {
    by_groups_of(pool, units, s, &|_| heads, task);
}

/// `task(unit, kv group, heads)` for every unit (token or row) and KV group, over chunks of the
/// group's query heads that `heads_of(unit)` selects (at most [`HEADS_AT_ONCE`] a call, none
/// empty). Where the units give each thread two, a pool task is one unit, its groups in order:
/// a row's keys of one group are strided slices of its cache lines, and the prefetchers bring
/// the neighbouring groups' lines along, which the same thread then reads from its own cache
/// (measured: 8 rows at a 1024-token context, SmolLM2, 37.6-38.2 ms a step with a task per
/// group, 33.0-33.9 with a task per row). Else a task is a group, or a chunk of one where
/// the groups alone would not give each thread two.
fn by_groups_of<'h>(
    pool: &SpinPool,
    units: usize,
    s: AttnShape,
    heads_of: &(dyn Fn(usize) -> &'h IndexSet + Sync),
    task: &(dyn Fn(usize, usize, &[usize]) + Sync),
) {
    let per_group = s.n_heads / s.n_kv_heads;
    let groups = units * s.n_kv_heads;
    let splits = match groups >= 2 * pool.threads() {
        true => 1,
        false => (2 * pool.threads()).div_ceil(groups.max(1)).min(per_group),
    };
    let chunk = per_group.div_ceil(splits).min(HEADS_AT_ONCE);
    let chunks = per_group.div_ceil(chunk);
    // Chunk `i` of every unit's groups and chunks.
    let run = |u: usize, i: usize| {
        let (g, c) = (i / chunks, i % chunks);
        let first = g * per_group + c * chunk;
        let set = heads_of(u);
        let mut hs = [0usize; HEADS_AT_ONCE];
        let mut n = 0;
        for h in (first..(first + chunk).min((g + 1) * per_group)).filter(|&h| set.contains(h)) {
            hs[n] = h;
            n += 1;
        }
        if n > 0 {
            task(u, g, &hs[..n]);
        }
    };
    let per_unit = s.n_kv_heads * chunks;
    match units >= 2 * pool.threads() {
        true => pool.run(units, &|u| (0..per_unit).for_each(|i| run(u, i))),
        false => pool.run(units * per_unit, &|i| run(i / per_unit, i % per_unit)),
    }
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

/// Query heads `hs` (1 to [`HEADS_AT_ONCE`], all of KV group `g`) of unit `u` of `q` at
/// position `p`, over the keys and values `kv` (in bounds: checked by the callers), into their
/// outputs in `out` (row `u`, head `h`: `out[(u * n_heads + h) * hd..][..hd]`).
///
/// # Safety
/// `out` points at `q.len()` values that outlive the call, and no other thread reads or writes
/// the outputs of `hs` in row `u` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn group(
    kern: &Kernels,
    (k, v): (KvSlice<'_>, KvSlice<'_>),
    s: AttnShape,
    g: usize,
    p: usize,
    (q, out): (&[f32], SyncPtr),
    u: usize,
    hs: &[usize],
) {
    let (hd, sc, m) = (s.head_dim, s.scoring, hs.len());
    let kv_stride = s.n_kv_heads * hd;
    let first = sc.first(p);
    let n_keys = p + 1 - first;
    let at = |h: usize| (u * s.n_heads + h) * hd;
    let qs: [&[f32]; HEADS_AT_ONCE] = std::array::from_fn(|i| match i < m {
        true => &q[at(hs[i])..at(hs[i]) + hd],
        false => &[],
    });
    assert!(
        at(hs[m - 1]) + hd <= q.len(),
        "attention: a head past the queries"
    );
    let mut os: [&mut [f32]; HEADS_AT_ONCE] = std::array::from_fn(|i| match i < m {
        // SAFETY: inside `out` (the same extent as `q`, asserted above for the last and
        // largest head), written by this task alone (the caller's contract).
        true => unsafe { std::slice::from_raw_parts_mut(out.get().add(at(hs[i])), hd) },
        false => &mut [],
    });
    SCORES.with_borrow_mut(|scores| {
        scores.resize(m * n_keys, 0.0);
        let mut parts = scores.chunks_exact_mut(n_keys);
        let mut sc_of: [&mut [f32]; HEADS_AT_ONCE] =
            std::array::from_fn(|_| parts.next().unwrap_or_default());
        // Keys j of kv head g are rows of `k[g * hd..]` at stride `kv_stride`; values alike.
        let at = first * kv_stride + g * hd;
        match k {
            KvSlice::F32(k) => (kern.dot_rows_many)(&qs[..m], &k[at..], kv_stride, &mut sc_of[..m]),
            KvSlice::F16(k) => {
                (kern.dot_rows_many_f16)(&qs[..m], &k[at..], kv_stride, &mut sc_of[..m])
            }
        }
        for scores in sc_of[..m].iter_mut() {
            (kern.softmax)(scores, sc);
        }
        let mut it = sc_of.iter();
        let a: [&[f32]; HEADS_AT_ONCE] =
            std::array::from_fn(|_| it.next().map_or(&[][..], |x| &**x));
        match v {
            KvSlice::F32(v) => (kern.axpy_rows_many)(&a[..m], &v[at..], kv_stride, &mut os[..m]),
            KvSlice::F16(v) => {
                (kern.axpy_rows_many_f16)(&a[..m], &v[at..], kv_stride, &mut os[..m])
            }
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
            // Prompts in tiles (16 tokens and up): blocks of 32 and a ragged last one, windows
            // inside a block and across blocks, a cap.
            (6, 3, 16, 0, 40, Scoring::plain(16)),
            (4, 2, 8, 10, 33, gemma(8, Some(0.5), Some(7))),
            (9, 3, 64, 5, 70, Scoring::plain(64)),
            (2, 1, 8, 0, 16, gemma(8, None, Some(20))),
            // A long context: blocks cut to 58 tokens (the tile's score budget), 70 tokens.
            (2, 2, 8, 36000, 70, Scoring::plain(8)),
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

    /// The batch-invariant path: each of a prompt's tokens (past the tiles' `PROMPT_MIN`) gets
    /// bit for bit what its own one-token call at its position gives, on every tier, whatever
    /// the pool's thread count.
    #[test]
    fn steps_give_each_token_its_own_calls_outputs() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (n_heads, n_kv_heads, hd, pos0, n) = (6, 3, 16, 5, 37);
        let len = (pos0 + n) * n_kv_heads * hd;
        let mut r = |n| {
            (0..n)
                .map(|_| rng.gen_range(-1.0f32..1.0))
                .collect::<Vec<_>>()
        };
        let (q, k, v) = (r(n * n_heads * hd), r(len), r(len));
        let heads = IndexSet::new(n_heads, vec![0, 2, 3, 5]).unwrap();
        let s = |pos0, n_tokens| AttnShape {
            n_heads,
            n_kv_heads,
            head_dim: hd,
            pos0,
            n_tokens,
            scoring: Scoring::plain(hd),
        };
        let qd = n_heads * hd;
        for kern in Isa::supported().into_iter().filter_map(Kernels::for_isa) {
            let one = crate::pool::SpinPool::new(1);
            let mut want = vec![0f32; q.len()];
            for t in 0..n {
                let (kk, vv) = (KvSlice::F32(&k), KvSlice::F32(&v));
                let (qt, ot) = (&q[t * qd..(t + 1) * qd], &mut want[t * qd..(t + 1) * qd]);
                attention(&kern, &one, qt, kk, vv, &heads, s(pos0 + t, 1), ot);
            }
            for threads in [1, 2, 3] {
                let pool = crate::pool::SpinPool::new(threads);
                let mut got = vec![f32::NAN; q.len()];
                let (kk, vv) = (KvSlice::F32(&k), KvSlice::F32(&v));
                attention_steps(&kern, &pool, &q, kk, vv, &heads, s(pos0, n), &mut got);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{} threads {threads}", kern.isa);
            }
        }
    }
}
