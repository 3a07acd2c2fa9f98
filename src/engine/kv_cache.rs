//! A sequence's state between forward steps: keys and values of every layer for positions
//! `0..len`, the activation buffers of its forward passes, and what the last step read.
//!
//! Keys and values are f32 or f16 ([`KvType`], `--kv-type`), `[len][n_kv_heads * head_dim]` per
//! layer, and grow with the sequence (in steps of [`GROW`] positions) instead of being allocated
//! for the whole window up front: a short chat at `--ctx 8192` holds only what it uses. The
//! activation buffers grow to the largest batch seen, then are reused: decoding allocates
//! nothing per token (but when the cache grows).
use crate::engine::weights::Model;
use dejavu_backend_api::{IndexSet, KvSlice};
use half::f16;

/// The element type of the cached keys and values. F16 halves the cache (rounding each key and
/// value to f16's 11 significant bits); attention reads it with F16C/`wide` kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    F32,
    F16,
}

impl KvType {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            _ => None,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// Positions added to a layer's key/value storage each time it fills.
pub const GROW: usize = 256;

pub struct KvCache {
    pub(crate) kv: KvStore,
    pub(crate) len: usize,
    pub(crate) n_ctx: usize,
    pub(crate) scratch: Scratch,
    pub(crate) last: StepStats,
    /// When set, every forward step appends what calibration trains the predictors on.
    pub capture: Option<Capture>,
}

/// One layer's keys or values.
#[derive(Clone)]
enum Buf {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// Keys and values of every layer.
///
/// Lazy K/V (the paper's recompute, [`crate::sparsity::KvRule::Lazy`]): a step may compute keys
/// and values for the heads it selects only. Then `valid[l][h]` says head `h`'s entries are
/// valid for positions `0..valid[l][h]` (those above are stale), and `inputs[l]` keeps the layer's
/// attention inputs of positions `0..inputs_len[l]`, from which a later step that selects `h`
/// recomputes the missing positions. Invariant: every position a head misses has its input
/// kept (a step skips heads only when all inputs up to it are kept). Steps that compute every
/// head keep nothing extra and mark every head valid.
pub(crate) struct KvStore {
    k: Vec<Buf>,
    v: Vec<Buf>,
    kv_dim: usize,
    n_ctx: usize,
    kv_type: KvType,
    pub(crate) valid: Vec<Vec<usize>>,
    inputs: Vec<Buf>,
    pub(crate) inputs_len: Vec<usize>,
    d_model: usize,
}

/// Per layer, appended by every forward step of a capturing cache.
#[derive(Default)]
pub struct Capture {
    /// Attention inputs (normed, for pre-norm models), `[n][d_model]`.
    pub attn_in: Vec<Vec<f32>>,
    /// Norms of each query head's attention output, `[n][n_heads]`.
    pub head_norm: Vec<Vec<f32>>,
    /// MLP inputs (normed, for pre-norm models), `[n][d_model]`.
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
    /// Time and weight bytes of the attention blocks, the MLP blocks (summed over layers; each
    /// includes any wait for its predictions) and the output head (final norm and projections
    /// included). The predictors' own bytes are in `weight_bytes` only.
    pub attention: BlockCost,
    pub mlp: BlockCost,
    pub output: BlockCost,
}

/// Wall time and weight bytes of one kind of block in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BlockCost {
    pub ns: u64,
    pub bytes: usize,
}

/// Activations of one forward pass (see `Executor::run` for the names).
#[derive(Default)]
pub(crate) struct Scratch {
    pub x: Vec<f32>,
    pub h: Vec<f32>,
    pub q: Vec<f32>,
    pub att: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub o: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// Token embeddings before `proj_in`, and the output head's input after `proj_out`.
    pub e: Vec<f32>,
    pub logits: Vec<f32>,
    /// Selection scores and index scratch of the contextual rules; the output preview.
    pub score: Vec<f32>,
    pub idx: Vec<u32>,
    pub z: Vec<f32>,
    pub preview: Vec<f32>,
    /// Lazy K/V recompute: kept inputs and their keys and values.
    pub gap_x: Vec<f32>,
    pub gap_k: Vec<f32>,
    pub gap_v: Vec<f32>,
}

/// The first `n` elements of `v`, growing it if needed (contents unspecified: every user
/// overwrites them).
pub(crate) fn buf(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl KvCache {
    pub fn new(model: &Model, n_ctx: usize, kv_type: KvType) -> Self {
        let c = &model.config;
        let empty = match kv_type {
            KvType::F32 => Buf::F32(Vec::new()),
            KvType::F16 => Buf::F16(Vec::new()),
        };
        Self {
            kv: KvStore {
                k: vec![empty.clone(); c.n_layers],
                v: vec![empty.clone(); c.n_layers],
                kv_dim: c.kv_dim(),
                n_ctx,
                kv_type,
                valid: vec![vec![0; c.n_kv_heads]; c.n_layers],
                inputs: vec![empty; c.n_layers],
                inputs_len: vec![0; c.n_layers],
                d_model: c.d_model,
            },
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
    /// Bytes of keys and values held for the positions in use (and of the attention inputs
    /// lazy K/V keeps).
    pub fn bytes_in_use(&self) -> usize {
        let kept: usize = self.kv.inputs_len.iter().map(|&n| n.min(self.len)).sum();
        (2 * self.kv.k.len() * self.len * self.kv.kv_dim + kept * self.kv.d_model)
            * self.kv.kv_type.bytes()
    }
    /// Bytes allocated for keys and values (in use, plus the growth margin).
    pub fn bytes_allocated(&self) -> usize {
        let cap = |b: &Buf| match b {
            Buf::F32(v) => v.capacity() * 4,
            Buf::F16(v) => v.capacity() * 2,
        };
        (self.kv.k.iter().chain(&self.kv.v).chain(&self.kv.inputs))
            .map(cap)
            .sum()
    }
    pub fn kv_type(&self) -> KvType {
        self.kv.kv_type
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

impl KvStore {
    /// Store layer `l`'s keys and values for positions `pos0..pos0 + n` (`k`, `v`: `n * kv_dim`)
    /// and return the layer's keys and values for positions `0..pos0 + n`.
    pub(crate) fn append(
        &mut self,
        l: usize,
        pos0: usize,
        k: &[f32],
        v: &[f32],
    ) -> (KvSlice<'_>, KvSlice<'_>) {
        let (start, end) = (pos0 * self.kv_dim, pos0 * self.kv_dim + k.len());
        let cap = self.capacity(end, self.kv_dim);
        for (store, new) in [(&mut self.k[l], k), (&mut self.v[l], v)] {
            match store {
                Buf::F32(s) => put(s, start, cap, new.iter().copied()),
                Buf::F16(s) => put(s, start, cap, new.iter().map(|&x| f16::from_f32(x))),
            }
        }
        self.valid[l]
            .iter_mut()
            .for_each(|v| *v = pos0 + k.len() / self.kv_dim);
        (view(&self.k[l], end), view(&self.v[l], end))
    }

    /// Elements to reserve for a store of rows of `row` elements that must hold `end`: the next
    /// multiple of [`GROW`] rows, at most the window (at least `end`).
    fn capacity(&self, end: usize, row: usize) -> usize {
        (end.div_ceil(GROW * row) * GROW * row)
            .min(self.n_ctx * row)
            .max(end)
    }

    /// Forget what lies at or beyond `pos0` (a truncated sequence): heads and kept inputs are
    /// valid up to `pos0` at most.
    pub(crate) fn clamp(&mut self, l: usize, pos0: usize) {
        self.valid[l].iter_mut().for_each(|v| *v = (*v).min(pos0));
        self.inputs_len[l] = self.inputs_len[l].min(pos0);
    }

    /// Keep layer `l`'s attention inputs `h` (`n * d_model`) of positions `pos0..` when every
    /// earlier one is kept; returns whether all inputs up to `pos0 + n` are now kept.
    pub(crate) fn keep_inputs(&mut self, l: usize, pos0: usize, h: &[f32]) -> bool {
        if self.inputs_len[l] != pos0 {
            return false;
        }
        let (start, end) = (pos0 * self.d_model, pos0 * self.d_model + h.len());
        let cap = self.capacity(end, self.d_model);
        match &mut self.inputs[l] {
            Buf::F32(s) => put(s, start, cap, h.iter().copied()),
            Buf::F16(s) => put(s, start, cap, h.iter().map(|&x| f16::from_f32(x))),
        }
        self.inputs_len[l] = pos0 + h.len() / self.d_model;
        true
    }

    /// `heads` of layer `l` split for a step at `pos0`: those valid through `pos0` (they need this
    /// step's positions only), and the others grouped by the first position they miss, in order.
    pub(crate) fn stale_groups(
        &self,
        l: usize,
        pos0: usize,
        heads: &IndexSet,
    ) -> (IndexSet, Vec<(usize, IndexSet)>) {
        let mut groups: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
        for h in heads.iter() {
            groups
                .entry(self.valid[l][h].min(pos0))
                .or_default()
                .push(h as u32);
        }
        let n = heads.universe();
        let set = |hs: Vec<u32>| IndexSet::new(n, hs).expect("increasing heads below n_kv_heads");
        let current = set(groups.remove(&pos0).unwrap_or_default());
        (
            current,
            groups
                .into_iter()
                .map(|(from, hs)| (from, set(hs)))
                .collect(),
        )
    }

    /// Layer `l`'s kept inputs of positions `from..to` into `out` (`(to - from) * d_model`).
    pub(crate) fn inputs(&self, l: usize, from: usize, to: usize, out: &mut [f32]) {
        assert!(to <= self.inputs_len[l] && out.len() == (to - from) * self.d_model);
        let r = from * self.d_model..to * self.d_model;
        match &self.inputs[l] {
            Buf::F32(s) => out.copy_from_slice(&s[r]),
            Buf::F16(s) => (out.iter_mut().zip(&s[r])).for_each(|(o, x)| *o = x.to_f32()),
        }
    }

    /// Store the keys and values of `heads` only (entries `h * head_dim..` of each row of `k`,
    /// `v`: `m * kv_dim`) for positions `p0..p0 + m`, growing the storage to hold them (other
    /// heads' new entries are zero and not valid) and marking those heads valid up to `p0 + m`.
    /// Each head must be valid up to `p0` already (no holes).
    pub(crate) fn write_heads(
        &mut self,
        l: usize,
        p0: usize,
        heads: &IndexSet,
        head_dim: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let kvd = self.kv_dim;
        let m = k.len() / kvd;
        assert!(k.len() == m * kvd && v.len() == k.len() && heads.universe() * head_dim == kvd);
        let end = (p0 + m) * kvd;
        for (store, new) in [(&mut self.k[l], k), (&mut self.v[l], v)] {
            match store {
                Buf::F32(s) => scatter(s, end, p0, kvd, heads, head_dim, new, |x| x),
                Buf::F16(s) => scatter(s, end, p0, kvd, heads, head_dim, new, f16::from_f32),
            }
        }
        for h in heads.iter() {
            assert!(
                self.valid[l][h] >= p0,
                "lazy K/V: head {h} has a hole before {p0}"
            );
            self.valid[l][h] = self.valid[l][h].max(p0 + m);
        }
    }

    /// Layer `l`'s keys and values of positions `0..end`.
    pub(crate) fn view(&self, l: usize, end: usize) -> (KvSlice<'_>, KvSlice<'_>) {
        let e = end * self.kv_dim;
        (view(&self.k[l], e), view(&self.v[l], e))
    }
}

/// Grow `store` to `end` elements (zeros) and write the `heads` slices of `new`'s rows at row
/// `p0` on.
#[allow(clippy::too_many_arguments)]
fn scatter<T: Copy + Default>(
    store: &mut Vec<T>,
    end: usize,
    p0: usize,
    kvd: usize,
    heads: &IndexSet,
    hd: usize,
    new: &[f32],
    conv: impl Fn(f32) -> T,
) {
    if store.len() < end {
        store.resize(end, T::default());
    }
    for (t, row) in new.chunks_exact(kvd).enumerate() {
        let dst = &mut store[(p0 + t) * kvd..(p0 + t + 1) * kvd];
        for h in heads.iter() {
            let r = h * hd..(h + 1) * hd;
            (dst[r.clone()].iter_mut().zip(&row[r])).for_each(|(d, &x)| *d = conv(x));
        }
    }
}

fn view(b: &Buf, end: usize) -> KvSlice<'_> {
    match b {
        Buf::F32(s) => KvSlice::F32(&s[..end]),
        Buf::F16(s) => KvSlice::F16(&s[..end]),
    }
}

/// Truncate `store` to `start`, make room for `cap` elements, append `new`.
fn put<T>(store: &mut Vec<T>, start: usize, cap: usize, new: impl ExactSizeIterator<Item = T>) {
    // Every layer holds at least the positions the cache counts (its length moves only after
    // all layers appended), so `start` never lies past the stored data.
    assert!(
        store.len() >= start,
        "KV store shorter than the cache length"
    );
    store.truncate(start);
    let end = start + new.len();
    if store.capacity() < end {
        store.reserve_exact(cap.max(end) - store.len());
    }
    store.extend(new);
}
