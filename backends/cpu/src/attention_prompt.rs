//! A prompt's attention in tiles: the path of [`crate::attention::attention`] for a batch of at
//! least [`PROMPT_MIN`] tokens. Same formula as there (causal, the [`Scoring`]'s window, scale
//! and cap; unselected heads 0).
//!
//! Per KV group `g` and block of up to [`BLOCK`] tokens (fewer where a block's scores would pass
//! [`MAX_SCORES`]; one pool task each): the keys and values
//! the block reads (from the first its first token's window reaches to its last token's
//! position) are widened to f32 once; one `gemm` gives the scores of every (token, selected
//! head of `g`) row of the block against them (`Q K^T`); each row keeps its own causal window
//! (the tier's softmax over it, zeros elsewhere); a second `gemm` gives the outputs (`P V`). A
//! decode step's kernels read each key once per query and sum each (query, key) pair across a
//! register; here each key is read once per block and the products run in register tiles. The
//! sums run in another order, so the outputs differ from theirs by rounding only (the module's
//! test bounds both against the same f64 reference). A row's keys outside its window enter the
//! second product with weight 0, so a NaN in a later token's value row of the same block
//! reaches the earlier rows too (it reaches the prompt's last token either way).
use crate::kernels::table::Kernels;
use crate::matmul::SyncPtr;
use crate::pool::SpinPool;
#[cfg(doc)]
use dejavu_backend_api::Scoring;
use dejavu_backend_api::{AttnShape, IndexSet, KvSlice};
use half::slice::HalfFloatSliceExt;
use std::cell::RefCell;

/// Fewest tokens that take the tiled path.
pub const PROMPT_MIN: usize = 16;
/// Most tokens per block (a block's rows are its tokens times the group's selected heads).
const BLOCK: usize = 64;
/// Most scores a block's tile holds (8 MiB a thread): long contexts take fewer tokens a block.
const MAX_SCORES: usize = 1 << 21;

/// One thread's tiles, grown to the largest block seen: the block's queries, keys and values
/// (`[n_keys][head_dim]`), scores (`[rows][n_keys]`) and outputs (`[rows][head_dim]`).
#[derive(Default)]
struct Tiles {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
}

thread_local! {
    static TILES: RefCell<Tiles> = RefCell::new(Tiles::default());
}

/// The caller ([`crate::attention::attention`]) checked every extent: `q` and `out` hold
/// `n_tokens * n_heads * head_dim` values, the caches `(pos0 + n_tokens) * n_kv_heads *
/// head_dim`, and `out` is zero.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_prompt(
    kern: &Kernels,
    pool: &SpinPool,
    q: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    heads: &IndexSet,
    s: AttnShape,
    out: &mut [f32],
) {
    assert_eq!(out.len(), q.len(), "attention: out length");
    let scores_per_token = (s.n_heads / s.n_kv_heads) * (s.pos0 + s.n_tokens);
    let bt = (MAX_SCORES / scores_per_token.max(1)).clamp(1, BLOCK);
    let blocks = s.n_tokens.div_ceil(bt);
    let op = SyncPtr::new(out.as_mut_ptr());
    pool.run(s.n_kv_heads * blocks, &|i| {
        let (g, b) = (i % s.n_kv_heads, i / s.n_kv_heads);
        let tokens = b * bt..((b + 1) * bt).min(s.n_tokens);
        TILES.with_borrow_mut(|tiles| {
            // SAFETY: task (g, b) alone writes the outputs of group g's heads for the block's
            // tokens; `out` outlives `pool.run` and holds `q.len()` values.
            unsafe { block(kern, tiles, (q, op), (k, v), heads, s, g, tokens) }
        });
    });
}

/// KV group `g` over `tokens` (see the module doc).
///
/// # Safety
/// `out` points at `q.len()` values, and no other thread touches the outputs of `g`'s heads
/// for `tokens` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    kern: &Kernels,
    t: &mut Tiles,
    (q, out): (&[f32], SyncPtr),
    (k, v): (KvSlice<'_>, KvSlice<'_>),
    heads: &IndexSet,
    s: AttnShape,
    g: usize,
    tokens: std::ops::Range<usize>,
) {
    let (hd, sc) = (s.head_dim, s.scoring);
    let per_group = s.n_heads / s.n_kv_heads;
    let group = g * per_group..(g + 1) * per_group;
    let n_heads = group.clone().filter(|&h| heads.contains(h)).count();
    if n_heads == 0 {
        return;
    }
    let (p_first, p_last) = (s.pos0 + tokens.start, s.pos0 + tokens.end - 1);
    let k0 = sc.first(p_first);
    let n_keys = p_last + 1 - k0;
    let rows = tokens.len() * n_heads;
    t.q.resize(rows * hd, 0.0);
    t.k.resize(n_keys * hd, 0.0);
    t.v.resize(n_keys * hd, 0.0);
    t.s.resize(rows * n_keys, 0.0);
    t.o.resize(rows * hd, 0.0);
    // Row r = (token - tokens.start) * n_heads + the head's index among the selected ones.
    let row_heads = || {
        tokens.clone().flat_map(|tk| {
            group
                .clone()
                .filter(|&h| heads.contains(h))
                .map(move |h| (tk, h))
        })
    };
    for (r, (tk, h)) in row_heads().enumerate() {
        let at = (tk * s.n_heads + h) * hd;
        t.q[r * hd..(r + 1) * hd].copy_from_slice(&q[at..at + hd]);
    }
    widen(k, s, g, k0, &mut t.k[..n_keys * hd]);
    widen(v, s, g, k0, &mut t.v[..n_keys * hd]);
    // S = Q K^T: rows x n_keys, over head_dim.
    gemm(rows, n_keys, hd, &mut t.s, (&t.q, hd, 1), (&t.k, 1, hd));
    for (r, (tk, _)) in row_heads().enumerate() {
        let p = s.pos0 + tk;
        let row = &mut t.s[r * n_keys..(r + 1) * n_keys];
        let (a, b) = (sc.first(p) - k0, p + 1 - k0);
        row[..a].fill(0.0);
        row[b..].fill(0.0);
        (kern.softmax)(&mut row[a..b], sc);
    }
    // O = P V: rows x head_dim, over the keys.
    gemm(rows, hd, n_keys, &mut t.o, (&t.s, n_keys, 1), (&t.v, hd, 1));
    for (r, (tk, h)) in row_heads().enumerate() {
        let at = (tk * s.n_heads + h) * hd;
        // SAFETY: `at + hd <= q.len()` (the head's query was read from there), inside `out`;
        // this task alone writes it (the caller's contract).
        let o = std::slice::from_raw_parts_mut(out.get().add(at), hd);
        o.copy_from_slice(&t.o[r * hd..(r + 1) * hd]);
    }
}

/// Keys (or values) `k0..k0 + dst.len() / head_dim` of KV head `g`, widened to f32 rows.
fn widen(src: KvSlice<'_>, s: AttnShape, g: usize, k0: usize, dst: &mut [f32]) {
    let (hd, stride) = (s.head_dim, s.n_kv_heads * s.head_dim);
    for (j, row) in dst.chunks_exact_mut(hd).enumerate() {
        let at = (k0 + j) * stride + g * hd;
        match src {
            KvSlice::F32(c) => row.copy_from_slice(&c[at..at + hd]),
            // `half`'s slice conversion: F16C where the CPU has it (checked at run time).
            KvSlice::F16(c) => c[at..at + hd].convert_to_f32_slice(row),
        }
    }
}

/// `dst[m][n] = sum_k a(i, k) b(k, j)`, `dst` rows of `n` values; `a` and `b` given as
/// (values, row stride, column stride).
fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    (a, a_rs, a_cs): (&[f32], usize, usize),
    (b, b_rs, b_cs): (&[f32], usize, usize),
) {
    let last = |rs: usize, cs: usize, r: usize, c: usize| (r - 1) * rs + (c - 1) * cs;
    assert!(
        dst.len() >= m * n && a.len() > last(a_rs, a_cs, m, k) && b.len() > last(b_rs, b_cs, k, n),
        "attention: a tile's extents"
    );
    // SAFETY: every index the product reads or writes lies inside the slices (asserted above:
    // the last element of each operand is in bounds, and all strides are positive).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
