//! The device trait: the verbs of one decode step over buffers that live in a backend's own
//! memory (a GPU's), so weights are uploaded once, activations and the KV cache never leave the
//! device, and the host reads back only the logits.
//!
//! Unlike [`crate::Backend`], whose verbs take host slices and full [`crate::IndexSet`]s, a
//! [`Device`] reads its row and head selections from index lists in its own memory
//! ([`Device::Idx`]), written by the plan's upload or by [`Device::top_k`] on the device, and
//! reads the step's token and position from its own memory too ([`Device::set_step`]). A step
//! recorded once ([`Device::begin_capture`]) can therefore be replayed at every position with the
//! same selections' sizes: the plan lives on the device.
//!
//! Selections are *compact*: a product over `Rows::Sel` writes output `j` for the `j`-th
//! selected row, and the verbs after it (activation, attention, [`Device::axpy`]) read the same
//! compact order. The dense plan is the same verbs with `Rows::All`.
//!
//! A step is a *batch* of `rows` tokens at consecutive positions ([`Device::set_step`]): a
//! decode step is one row; a prompt runs as batches of up to [`MAX_ROWS`] (its products through
//! [`Device::matmul`]). Row-wise verbs take the batch's `rows`; buffers hold their rows one after
//! another (row `r` at `r * width`), and row `r` is at position `pos + r`.
use crate::{Activation, BackendError, QuantType, RopeStyle, Scoring, Weight};

/// Bytes held by their owner (a mapped file, an anonymous buffer) that a host-memory device
/// may keep a handle to instead of a copy ([`Device::share_mat`]).
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The most rows one batch ([`Device::set_step`]) holds.
pub const MAX_ROWS: usize = 512;

/// Which rows a product reads. `All`: rows `0..n` (output `j` is row `j`). `Sel`: `count *
/// group` outputs, output `j` being row `idx[j / group] * group + j % group` (`group` > 1
/// expands head indices to the `head_dim` rows of each head). `idx` holds at least `count`
/// entries, each below `rows / group`; the order is the list's (any order).
pub enum Rows<'a, I> {
    All,
    Sel {
        idx: &'a I,
        count: usize,
        group: usize,
    },
}

impl<I> Clone for Rows<'_, I> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<I> Copy for Rows<'_, I> {}

/// One product of [`Device::matvecs`]: `y[j] = act(dot(W[row(j)], x) + bias[row(j)])` over
/// the outputs of `rows`, or with `accumulate` `y[j] += dot(..) + bias[..]` (no activation).
/// `x` is the call's input unless the product names its own ([`Product::input`]).
pub struct Product<'a, D: Device + ?Sized> {
    pub w: &'a D::Mat,
    pub x: Option<&'a D::Buf>,
    pub rows: Rows<'a, D::Idx>,
    pub bias: Option<&'a D::Buf>,
    pub act: Option<Activation>,
    pub accumulate: bool,
    pub y: &'a mut D::Buf,
}

impl<'a, D: Device + ?Sized> Product<'a, D> {
    /// `y = x W^T` over `rows`.
    pub fn new(w: &'a D::Mat, rows: Rows<'a, D::Idx>, y: &'a mut D::Buf) -> Self {
        Self {
            w,
            x: None,
            rows,
            bias: None,
            act: None,
            accumulate: false,
            y,
        }
    }
    /// Read `x` instead of the call's input (products of different inputs in one launch: the
    /// predictors' second layers).
    pub fn input(self, x: &'a D::Buf) -> Self {
        Self { x: Some(x), ..self }
    }
    pub fn bias(self, bias: Option<&'a D::Buf>) -> Self {
        Self { bias, ..self }
    }
    pub fn act(self, act: Activation) -> Self {
        Self {
            act: Some(act),
            ..self
        }
    }
    /// Add to `y` (a residual) instead of overwriting it.
    pub fn accumulate(self) -> Self {
        Self {
            accumulate: true,
            ..self
        }
    }
}

/// One selection of [`Device::top_ks`]: the indices of the `k` largest of row `row` of
/// `scores` (`scores[row * n..][..n]`: a step of several sequences' predictor scores, one row
/// each) into `out[..k]`, in any order (ties broken by any rule).
pub struct TopK<'a, D: Device + ?Sized> {
    pub scores: &'a D::Buf,
    pub row: usize,
    pub n: usize,
    pub k: usize,
    pub out: &'a mut D::Idx,
}

/// Which inputs [`Device::sparsify`] keeps: those whose score `|x[i]| * scale[i]` (or `|x[i]|`
/// without scales) exceeds `threshold` (finite, or infinite: none kept; negative: every one).
pub struct InputMask<'a, B> {
    pub threshold: f32,
    pub scale: Option<&'a B>,
}

impl<B> Clone for InputMask<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for InputMask<'_, B> {}

/// The scalar definition of [`Device::sparsify`] (NaN never compares below a threshold, so a
/// NaN input is kept, and a NaN threshold keeps every input).
pub fn sparsify_ref(x: &[f32], threshold: f32, scale: Option<&[f32]>, out: &mut [f32]) {
    for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        let s = v.abs() * scale.map_or(1.0, |s| s[i]);
        *o = if s <= threshold { 0.0 } else { v };
    }
}

/// One layer's lazy K/V ([`Device::kv_fill`], multi-head attention): its key and value
/// projections, the heads selected at this step, and the layer's kept attention inputs
/// (`inputs` row `p`: the input at position `p`, [`Device::store_row`]).
/// The batch's `rows` (its last position `pos + rows - 1` is the last one filled).
pub struct LazyKv<'a, D: Device + ?Sized> {
    pub wk: &'a D::Mat,
    pub wv: &'a D::Mat,
    pub bk: Option<&'a D::Buf>,
    pub bv: Option<&'a D::Buf>,
    pub inputs: &'a D::Cache,
    /// Query (= KV) heads, group 1.
    pub heads: Rows<'a, D::Idx>,
    pub head_dim: usize,
    /// RoPE of the keys, at each filled position.
    pub rope: Option<Rotary<'a, D::Buf>>,
    /// The batch's rows.
    pub rows: usize,
}

/// RoPE's parameters: pair `i` of a head at position `p` turns by `p * theta^(-2i/head_dim) /
/// factors[i]`. `factors` (`head_dim / 2` values, llama.cpp's `rope_freqs`: Llama 3's scaling)
/// is 1 everywhere when `None`.
pub struct Rotary<'a, B> {
    pub theta: f32,
    pub style: RopeStyle,
    pub factors: Option<&'a B>,
}

impl<B> Clone for Rotary<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Rotary<'_, B> {}

/// Which step value selects the row of an embedding lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRow {
    /// The row's token id less `first`: a table that holds the vocabulary's rows from `first`
    /// on (one rank's share under tensor parallelism; 0 for the whole table).
    Token { first: usize },
    /// The row's position plus an offset (OPT's learned positions start at 2).
    Position { offset: usize },
}

/// [`Device::scale_cap`]'s parameters: a finite scale, a finite positive cap.
pub fn check_scale_cap(s: f32, cap: Option<f32>) -> Result<(), BackendError> {
    let ok = s.is_finite() && cap.is_none_or(|c| c.is_finite() && c > 0.0);
    match ok {
        true => Ok(()),
        false => Err(BackendError::Shape(format!("scale {s} and cap {cap:?}"))),
    }
}

/// The shape of one layer's attention over a batch: the query heads of row `r` (compact, as the
/// `Rows` of the call name them) attend causally to the cache positions up to `pos + r` that
/// `scoring` keeps; query head `h` reads KV head `h / (n_heads / n_kv_heads)`. `n_ctx` is the
/// caches' capacity.
#[derive(Debug, Clone, Copy)]
pub struct AttnGeom {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_ctx: usize,
    /// The batch's rows.
    pub rows: usize,
    pub scoring: Scoring,
}

/// One row of [`Device::attend_rows`]: its sequence's key and value caches (of `n_ctx`
/// positions), its position, and the query heads it attends with (a selection of group 1, or
/// every head).
pub struct SeqRow<'a, D: Device + ?Sized> {
    pub k: &'a mut D::Cache,
    pub v: &'a mut D::Cache,
    pub pos: usize,
    pub n_ctx: usize,
    pub heads: Rows<'a, D::Idx>,
}

/// One row of [`Device::set_seq_rows`]: its sequence's key and value caches of every layer,
/// its position and context, and its heads at each layer (as [`SeqRow`]'s).
pub struct SeqRows<'a, D: Device + ?Sized> {
    pub k: &'a [D::Cache],
    pub v: &'a [D::Cache],
    pub pos: usize,
    pub n_ctx: usize,
    pub heads: Vec<Rows<'a, D::Idx>>,
}

/// Verbs of a device-resident decode step. Every verb is enqueued in order on the device's lane
/// (one, unless [`Device::fork`] opened a second) and may return before it ran; errors of a launch are reported by the next call that
/// synchronizes ([`Device::download`]). Lengths are checked at every entry (an `Err`, never an
/// out-of-bounds access): `Buf`s are at least as long as the verb reads or writes.
pub trait Device: Send + Sync {
    /// An f32 vector.
    type Buf: Send + Sync;
    /// A list of u32 indices (a selection).
    type Idx: Send + Sync;
    /// A weight matrix, uploaded once.
    type Mat: Send + Sync;
    /// One layer's keys or values, `[n_ctx][width]`, in f16.
    type Cache: Send + Sync;
    /// A recorded step.
    type Graph;

    fn name(&self) -> String;
    /// Is the device batch-invariant: does every verb of several rows give each row bit for bit
    /// what a one-row decode step gives it, whatever the rows beside it, the thread count and
    /// the cache's length? Then a token's keys, values and logits do not depend on how its
    /// prompt was split, on a cached prefix, or on the batch it shares (deterministic
    /// generation).
    fn batch_invariant(&self) -> bool {
        false
    }
    /// Can this device compute with weights of this type?
    fn supports(&self, qtype: QuantType) -> bool;
    /// Does [`Device::axpy`] read matrices in the input-block layout
    /// ([`crate::RowLayout::InputBlocks`])? Those that do not get input-major rows requantized
    /// in the file's row layout instead.
    fn reads_input_blocks(&self) -> bool {
        false
    }
    /// The fraction of their inputs kept below which [`Device::axpys`] over these input-major
    /// matrices (the products of one input) is expected to take less time than the dense
    /// products of the same matrices over the file's rows, `dense_bytes` of them (more than
    /// the input-major bytes where those are requantized to a wider type): input sparsity runs
    /// a group of inputs whose expected kept fraction is above it dense. 1 (the default):
    /// every dropped input saves time.
    fn input_break_even(&self, mats: &[&Self::Mat], dense_bytes: usize) -> f64 {
        let _ = (mats, dense_bytes);
        1.0
    }

    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf, BackendError>;
    fn upload(&self, x: &[f32]) -> Result<Self::Buf, BackendError>;
    fn upload_idx(&self, idx: &[u32]) -> Result<Self::Idx, BackendError>;
    /// The matrix, in its file's (ggml) layout.
    fn upload_mat(&self, w: &Weight) -> Result<Self::Mat, BackendError>;
    /// The matrix `w`, to be read by row products only ([`Device::matvecs`], [`Device::matmul`],
    /// [`Device::matmul_steps`]; never by the `axpy` verbs): in whichever layout of its rows
    /// the device computes those fastest (the CPU's repacked rows, whatever the model's
    /// weights keep). Default: [`Device::upload_mat`].
    fn upload_rows(&self, w: &Weight) -> Result<Self::Mat, BackendError> {
        self.upload_mat(w)
    }
    /// The matrix `w`, whose bytes lie inside `owner` (the mapped file or buffer that holds
    /// them): a device that computes in host memory keeps a handle to `owner` and reads the
    /// rows in place; the others upload them ([`Device::upload_mat`], the default).
    fn share_mat(&self, w: &Weight, owner: &SharedBytes) -> Result<Self::Mat, BackendError> {
        let _ = owner;
        self.upload_mat(w)
    }
    fn cache(&self, n_ctx: usize, width: usize) -> Result<Self::Cache, BackendError>;
    /// Give a cache's memory back to the system where the device can (the CPU's pages, which
    /// it maps again as positions are written); its values are undefined until written again.
    /// The default keeps it (a GPU's caches stay allocated).
    fn release(&self, cache: &mut Self::Cache) -> Result<(), BackendError> {
        let _ = cache;
        Ok(())
    }
    /// Positions `0..n` of `src` into `dst`, caches of one width with at least `n` positions
    /// each: a sequence that starts from another's prefix (the choices of one prompt).
    fn copy_cache(
        &self,
        src: &Self::Cache,
        dst: &mut Self::Cache,
        n: usize,
    ) -> Result<(), BackendError>;
    /// Wait for the queued work, then copy `out.len()` leading values of `x` to the host.
    fn download(&self, x: &Self::Buf, out: &mut [f32]) -> Result<(), BackendError>;
    fn download_idx(&self, x: &Self::Idx, out: &mut [u32]) -> Result<(), BackendError>;
    /// `x[..v.len()] = v`, in order with the queued verbs (a list that a recorded step names
    /// keeps its place). Not while recording.
    fn write_idx(&self, x: &mut Self::Idx, v: &[u32]) -> Result<(), BackendError>;

    /// The batch that the next verbs read (set before a replay too): `tokens[r]` at position
    /// `pos + r`, 1 to [`MAX_ROWS`] rows.
    fn set_step(&self, tokens: &[u32], pos: usize) -> Result<(), BackendError>;
    /// A step of several sequences (set before a replay too): `tokens[r]` at `positions[r]`,
    /// as [`Device::embed`]'s `StepRow::Position` reads them (the verbs that read a position
    /// from the step, RoPE, `store` and `attention`, read `positions[0] + r`; a step of
    /// several sequences runs them through [`Device::attend_rows`] instead). Forgets the
    /// rows [`Device::set_seq_rows`] wrote.
    fn set_steps(&self, tokens: &[u32], positions: &[usize]) -> Result<(), BackendError>;

    /// For each of the batch's `rows`: `x[r] = table[row]` (`accumulate`: `+=`), the row chosen
    /// by `which`; a row outside the table writes zeros (`accumulate`: adds nothing), so the
    /// ranks' lookups in their shares of a table sum to the whole table's.
    fn embed(
        &self,
        table: &Self::Mat,
        which: StepRow,
        accumulate: bool,
        x: &mut Self::Buf,
        rows: usize,
    ) -> Result<(), BackendError>;

    /// Several products of the input `x` (Q, K and V; gate and up) or of their own inputs, as if
    /// each ran alone (see [`Product`]; at most 3), in one launch where the device can. Every
    /// `w.cols` is its input's width.
    fn matvecs(&self, x: &Self::Buf, jobs: &mut [Product<'_, Self>]) -> Result<(), BackendError>;

    /// [`Device::matvecs`] of each of `rows` rows of the inputs (row `r` of a product's input at
    /// `r * w.cols`, of its output at `r * w.rows`): the products of a prompt's batch. Every
    /// product's rows are `Rows::All` (a batch runs the dense plan).
    fn matmul(
        &self,
        x: &Self::Buf,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError>;

    /// [`Device::matmul`], each row computed as [`Device::matvecs`] computes a one-row step:
    /// a batch of decode rows (the rows a speculative draft asks the dense model to verify)
    /// whose outputs must be a decode step's. A device that states batch invariance (the CPU)
    /// makes them equal bit for bit, at the cost of the decode path's throughput; the default
    /// is [`Device::matmul`] (equal within its rounding). A product's rows may be a selection
    /// (a step of several sequences under a sparse plan: the union of their neurons): each
    /// row's outputs are compact, row `r` at `r * count`.
    fn matmul_steps(
        &self,
        x: &Self::Buf,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.matmul(x, rows, jobs)
    }

    /// `y[j] = dot(W[row(j)], x) (+ bias[row(j)])`, or with `accumulate` `y[j] +=` that, for
    /// the outputs of `rows` (see [`Rows`]). `x`: `w.cols`.
    fn matvec(
        &self,
        w: &Self::Mat,
        rows: Rows<'_, Self::Idx>,
        x: &Self::Buf,
        bias: Option<&Self::Buf>,
        y: &mut Self::Buf,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let p = Product::new(w, rows, y).bias(bias);
        let p = if accumulate { p.accumulate() } else { p };
        self.matvecs(x, &mut [p])
    }

    /// `y += sum over outputs j of a[j] * W[row(j)] (+ bias)`, for a neuron-major matrix (row
    /// `r` is neuron `r`'s output column): the sparse down projection over compact activations
    /// `a`, with the layer's output bias (`w.cols` values). Rows whose `a[j]` is zero may go
    /// unread.
    fn axpy(
        &self,
        w: &Self::Mat,
        rows: Rows<'_, Self::Idx>,
        a: &Self::Buf,
        bias: Option<&Self::Buf>,
        y: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// [`Device::axpy`] of each of `n` rows: row `r` of `a` at `r * count` (the selection's
    /// outputs), of `y` at `r * w.cols`, each with the bias. A step of several sequences' down
    /// projection over the union of their neurons: each weight row read once for all rows where
    /// the device can. The default takes one row (more are unsupported).
    fn axpy_steps(
        &self,
        w: &Self::Mat,
        rows: Rows<'_, Self::Idx>,
        a: &Self::Buf,
        n: usize,
        bias: Option<&Self::Buf>,
        y: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        match n {
            1 => self.axpy(w, rows, a, bias, y),
            _ => Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("the sparse down projection of {n} rows"),
            }),
        }
    }

    /// [`Device::axpy`] of each job with the same coefficients `a` (`job.x` is not read): `y +=`
    /// the product over the job's `rows` of its matrix, plus its bias (`act` and `accumulate`
    /// are not read: an axpy always adds). Q, K and V of one input under input sparsity; gate
    /// and up. One launch where the device can; at most 3 jobs. With `mask`, the coefficients
    /// are what [`Device::sparsify`] of `a` would give (`mask.scale` covering them), bit for
    /// bit, without that pass: input sparsity's threshold inside the product. The default
    /// takes no mask.
    fn axpys(
        &self,
        a: &Self::Buf,
        mask: Option<InputMask<'_, Self::Buf>>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        if jobs.is_empty() || jobs.len() > 3 {
            return Err(BackendError::Shape(format!(
                "{} axpys in one launch (1 to 3)",
                jobs.len()
            )));
        }
        if mask.is_some() {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: "input sparsity's mask inside axpys".into(),
            });
        }
        for p in jobs.iter_mut() {
            self.axpy(p.w, p.rows, a, p.bias, p.y)?;
        }
        Ok(())
    }

    /// `x[..n] = 0` for each `(x, n)` (at most 3): the outputs an axpy then adds to.
    fn clear(&self, bufs: &mut [(&mut Self::Buf, usize)]) -> Result<(), BackendError>;

    /// `out = x / sqrt(mean(x^2) + eps) * w` for each of `rows` rows of `w`'s length: a batch's
    /// rows, or each head of them (qwen3's Q and K norms: `rows` x heads rows of `head_dim`).
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        out: &mut Self::Buf,
        rows: usize,
    ) -> Result<(), BackendError>;

    /// `out = (x - mean) / sqrt(var + eps) * w + b` for each of `rows` rows of `w`'s length.
    fn layernorm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        eps: f32,
        out: &mut Self::Buf,
        rows: usize,
    ) -> Result<(), BackendError>;

    /// `x[..n] += y[..n]` (a bias added after a sparse down projection).
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<(), BackendError>;

    /// `y[..n] = x[..n]`.
    fn copy(&self, x: &Self::Buf, y: &mut Self::Buf, n: usize) -> Result<(), BackendError>;

    /// `y[..n * width] = x[r * width..(r + n) * width]`: rows `r..r + n` of a batch (its last,
    /// whose logits a prompt wants; the rows a perplexity window scores).
    fn take_rows(
        &self,
        x: &Self::Buf,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `y[r * width..(r + n) * width] = x[..n * width]`: rows of a batch written back (the
    /// inverse of [`Device::take_rows`]; a row of a step of several sequences, computed on its
    /// own against its sequence's cache).
    fn put_rows(
        &self,
        x: &Self::Buf,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `dst[idx[j / group] * group + j % group] = src[j]` for `j < count * group`: the inverse
    /// of [`Device::gather`] (the exact logits of the contextual head's candidates; a row's
    /// attention of its own heads, put back at the heads' places), the indices distinct; a
    /// value whose place is past `dst` is not written.
    fn scatter(
        &self,
        src: &Self::Buf,
        idx: &Self::Idx,
        count: usize,
        group: usize,
        dst: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `dst[j] = src[idx[j / group] * group + j % group]` for `j < count * group`: the compact
    /// values of a selection, as its products would write them (the activations a rule that
    /// computed every unit keeps). Each index is below `src.len() / group`.
    fn gather(
        &self,
        src: &Self::Buf,
        idx: &Self::Idx,
        count: usize,
        group: usize,
        dst: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Input sparsity (TEAL, WINA): `out[i] = x[i]` where `|x[i]| * scale[i] > threshold`, else
    /// 0, for `i < n` (`scale[i]` = 1 without `scale`: TEAL's magnitude threshold; with an
    /// input-major matrix's row norms, WINA's weight-informed score). A NaN input is kept (it
    /// is not dropped silently). The kept inputs then feed [`Device::axpy`] over the
    /// input-major matrix, which leaves the rows of the zeros unread.
    fn sparsify(
        &self,
        x: &Self::Buf,
        n: usize,
        mask: InputMask<'_, Self::Buf>,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `x[i] = |x[i]|` for `i < n` (scores by magnitude, for [`Device::top_k`]).
    fn abs(&self, x: &mut Self::Buf, n: usize) -> Result<(), BackendError>;

    /// `out[slot]` = how many groups of `group` consecutive values of `x[..n]` (the last one
    /// short where `group` does not divide `n`) hold a nonzero value, exact below 2^24; `group`
    /// 1 counts the nonzero values. What a step that skips zero activations computed (and, by
    /// 32, the input blocks it read: [`crate::input_block_table_bytes`]), counted where they are.
    fn count_nonzero(
        &self,
        x: &Self::Buf,
        n: usize,
        group: usize,
        out: &mut Self::Buf,
        slot: usize,
    ) -> Result<(), BackendError>;

    /// `out[g]` = the Euclidean norm of `x[g * width..(g + 1) * width]`, for `g < groups` (each
    /// head's attention output, for selecting heads by it).
    fn group_norms(
        &self,
        x: &Self::Buf,
        groups: usize,
        width: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Rotate `n_heads` heads of each of `rows` rows of `x`, row `r` at position `pos + r`.
    fn rope(
        &self,
        x: &mut Self::Buf,
        n_heads: usize,
        head_dim: usize,
        rope: Rotary<'_, Self::Buf>,
        rows: usize,
    ) -> Result<(), BackendError>;

    /// [`Device::rope`] of `q` (`n_q` heads) and of `k` (`n_k` heads), in one launch where the
    /// device can.
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Self::Buf,
        n_q: usize,
        k: &mut Self::Buf,
        n_k: usize,
        head_dim: usize,
        rope: Rotary<'_, Self::Buf>,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.rope(q, n_q, head_dim, rope, rows)?;
        self.rope(k, n_k, head_dim, rope, rows)
    }
    /// The attention block of a step of several sequences, one row each (`rows[r]`), in a
    /// few launches where the device can: row `r` of `q` and `k` (every head: `geom.n_heads`
    /// and `geom.n_kv_heads`) roped at the row's position (with `rope`), its keys and values
    /// (row `r` of `k`, `v`) stored at that position of its own caches, and its attention over
    /// its own heads into row `r` of `out` (every head's place; zeros for the heads it did not
    /// select). `geom.n_ctx` and `geom.rows` are not read (each row's own). The step
    /// ([`Device::set_step`]) is not read. The default is unsupported: the caller then runs
    /// the rows one by one with the one-row verbs.
    /// `layer` names the rows' caches among those [`Device::set_seq_rows`] wrote, if it did.
    #[allow(clippy::too_many_arguments)]
    fn attend_rows(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        rope: Option<Rotary<'_, Self::Buf>>,
        geom: AttnGeom,
        layer: usize,
        rows: &mut [SeqRow<'_, Self>],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let _ = (q, k, v, rope, geom, layer, rows, out);
        Err(BackendError::Unsupported {
            backend: self.name(),
            what: "the attention of several sequences in one call".into(),
        })
    }
    /// Before a step of several sequences (after [`Device::set_steps`]): every layer's rows
    /// of its [`Device::attend_rows`] at once (`rows[r]`: row `r`'s caches of every layer, its
    /// position and context, and its heads at each layer), so that a recorded step reads them
    /// on the device when replayed (a replay runs none of the caller's code); each layer's
    /// `attend_rows` then checks its rows against them and launches for the most any step of
    /// these rows could need (every head of a row's count, spans by context, not position).
    /// `n_heads`: the model's query heads (a row's count where it runs every head). `false`:
    /// this device reads each layer's rows at its call (the default), and a step of several
    /// sequences is not recorded.
    fn set_seq_rows(
        &self,
        n_heads: usize,
        rows: &[SeqRows<'_, Self>],
    ) -> Result<bool, BackendError> {
        let _ = (n_heads, rows);
        Ok(false)
    }

    /// `gate[i] = act(gate[i]) * up[i]` for `i < n`.
    fn glu(
        &self,
        act: Activation,
        gate: &mut Self::Buf,
        up: &Self::Buf,
        n: usize,
    ) -> Result<(), BackendError>;

    /// `x[i] = act(x[i])` for `i < n`.
    fn activate(&self, act: Activation, x: &mut Self::Buf, n: usize) -> Result<(), BackendError>;

    /// `x[i] = s * x[i]`, then with a cap `c`: `x[i] = c * tanh(x[i] / c)`, for `i < n` (Gemma's
    /// embedding scale and final-logit soft cap). `s` and `c` finite, `c` positive.
    fn scale_cap(
        &self,
        x: &mut Self::Buf,
        n: usize,
        s: f32,
        cap: Option<f32>,
    ) -> Result<(), BackendError>;

    /// Store row `r` of `k` and of `v` (`width` values each) as position `pos + r` of `kc` and
    /// `vc`, for each of `rows` rows.
    fn store(
        &self,
        k: &Self::Buf,
        v: &Self::Buf,
        kc: &mut Self::Cache,
        vc: &mut Self::Cache,
        rows: usize,
    ) -> Result<(), BackendError>;

    /// `c[pos + r] = x[r]` (`c.width` values) in f16 for each of `rows` rows (a layer's
    /// attention inputs, kept for lazy K/V).
    fn store_row(
        &self,
        x: &Self::Buf,
        c: &mut Self::Cache,
        rows: usize,
    ) -> Result<(), BackendError>;
    /// Lazy K/V (the paper's recompute): for each selected head `h`, the keys and values of the
    /// positions `valid[h]..=last` it is missing (`last = pos + job.rows - 1`), from the kept
    /// inputs:
    /// `k[p][h] = rope_p(W_k[h] inputs[p] + b_k[h])`, `v[p][h] = W_v[h] inputs[p] + b_v[h]`
    /// (`W_k[h]`: the head's `head_dim` rows); then `valid[h] = last + 1`. `valid` holds one
    /// entry per head, each at most `last + 1`.
    fn kv_fill(
        &self,
        job: LazyKv<'_, Self>,
        valid: &mut Self::Idx,
        k: &mut Self::Cache,
        v: &mut Self::Cache,
    ) -> Result<(), BackendError>;
    /// Attention of the selected query heads of each of the batch's `geom.rows` rows: `q` and
    /// `out` are compact (per row, the heads `heads` names, `head_dim` each), row `r` over keys
    /// and values at positions `0..=pos + r`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        k: &Self::Cache,
        v: &Self::Cache,
        heads: Rows<'_, Self::Idx>,
        geom: AttnGeom,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// The indices of the `k` largest of `scores[..n]` into `out[..k]`, in any order (ties
    /// broken by any rule).
    fn top_k(
        &self,
        scores: &Self::Buf,
        n: usize,
        k: usize,
        out: &mut Self::Idx,
    ) -> Result<(), BackendError>;

    /// Several [`TopK`] selections (the predictors of one layer), in one launch where the device
    /// can. The default takes selections of row 0 (others are unsupported).
    fn top_ks(&self, jobs: &mut [TopK<'_, Self>]) -> Result<(), BackendError> {
        jobs.iter_mut().try_for_each(|j| match j.row {
            0 => self.top_k(j.scores, j.n, j.k, j.out),
            r => Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("a top-k of scores' row {r}"),
            }),
        })
    }
    /// Lanes (the paper's lookahead, the predictors overlapped with the layer): after `fork`,
    /// verbs go to a second lane, which first waits for what the main lane has queued; after
    /// `back`, to the main lane again while the second runs on; `join` makes the main lane wait
    /// for what the second has queued. Verbs of the second lane may read what the main lane
    /// wrote before the fork, and the main lane reads what they write only after the join; a
    /// recording must join every fork. A device of one lane runs the verbs in the order given
    /// (these defaults do nothing).
    fn fork(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn back(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn join(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Wait until every queued verb has run.
    fn sync(&self) -> Result<(), BackendError>;

    /// This device's place in a tensor-parallel world, `(rank, size)`: `(0, 1)` alone. Every
    /// rank of a world runs the same verbs in the same order, the collectives included.
    fn world(&self) -> (usize, usize) {
        (0, 1)
    }
    /// `x[..n]` = the sum over the world's ranks of their `x[..n]`, in order with the queued
    /// verbs of the main lane (not between `fork` and `back`). Alone: nothing to do.
    fn all_reduce(&self, x: &mut Self::Buf, n: usize) -> Result<(), BackendError> {
        let _ = (x, n);
        match self.world().1 {
            1 => Ok(()),
            w => Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("an all-reduce over {w} ranks"),
            }),
        }
    }
    /// `out[r * n..(r + 1) * n]` = rank `r`'s `x[..n]`, for every rank `r` of the world, on the
    /// main lane. Alone: `out[..n] = x[..n]`.
    fn all_gather(&self, x: &Self::Buf, n: usize, out: &mut Self::Buf) -> Result<(), BackendError> {
        match self.world().1 {
            1 => self.copy(x, out, n),
            w => Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!("an all-gather over {w} ranks"),
            }),
        }
    }

    /// Start recording the verbs that follow instead of running them; `false` if this device
    /// does not record (its verbs then run as they are called).
    fn begin_capture(&self) -> Result<bool, BackendError>;
    /// The recorded step (after a `begin_capture` that returned `true`).
    fn end_capture(&self) -> Result<Self::Graph, BackendError>;
    /// Run a recorded step.
    fn replay(&self, graph: &Self::Graph) -> Result<(), BackendError>;
}
