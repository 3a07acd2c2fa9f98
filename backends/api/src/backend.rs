//! The backend trait: the few verbs the layer executor needs. Every op takes the subset of rows or
//! heads to compute, so the dense path is the sparse path with full sets.
use crate::{IndexSet, QuantType};

/// A row-major weight matrix borrowed from the model file: `rows` rows of `cols` elements, each row
/// `qtype.row_bytes(cols)` bytes. Built only through [`Weight::new`], which checks the length
/// (`non_exhaustive` rules out struct literals in other crates); backends check it again at
/// every entry that writes through raw pointers ([`Weight::check`]), since the fields are public.
///
/// ```compile_fail
/// use dejavu_backend_api::{QuantType, Weight};
/// let w = Weight { qtype: QuantType::F32, rows: 1000, cols: 1, data: &[] };
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Weight<'a> {
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// How each row's blocks are arranged inside the row (the bytes per row are the same).
    pub layout: RowLayout,
}

/// The arrangement of a weight row's blocks. `Ggml` is the file's; `Repacked` is the CPU
/// backend's interleaved groups of 8 blocks (`dejavu_backend_cpu::kernels::repack`), made once at
/// load by [`Backend::repack`] for the types [`Backend::repacks`] names.
///
/// `InputBlocks` is an input-major matrix (`rows` inputs of `cols` outputs, both multiples of
/// 32) that keeps its source's 8-, 5- or 4-bit quantization (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
/// Q4_K, Q5_K): per block of 32 inputs, a table of the outputs' scales (and offsets) as f16, or
/// the K-quants' 6-bit scales and mins under f16 scales shared by the 8 blocks of 256 inputs
/// ([`input_block_table_bytes`]), then the 32 inputs' quants (see
/// `dejavu_backend_cpu::kernels::axpy_blocks`). Its size is the type's `rows * row_bytes(cols)`;
/// only [`crate::Device::axpy`] reads it, on a device that [`crate::Device::reads_input_blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowLayout {
    #[default]
    Ggml,
    Repacked,
    InputBlocks,
}

/// Bytes of the scale table of each block of 32 inputs of an input-block matrix of `cols`
/// outputs in `q` (`RowLayout::InputBlocks`): an f16 scale per output, and an f16 offset too for
/// Q4_1 and Q5_1; Q4_K, Q5_K: 12 bits of scale and min per output, and an eighth of the f16
/// scale and min per output that its 8 blocks of a super-block of 256 inputs share (a block read
/// alone reads them all: counted so, the count holds where every block of a super-block has a
/// kept input). A product that keeps any input of a block reads its whole table, and the kept
/// inputs' rows of quants: the rest of the block's bytes, `row_bytes(cols) - table / 32` an
/// input.
pub fn input_block_table_bytes(q: QuantType, cols: usize) -> usize {
    match q {
        QuantType::Q4_1 | QuantType::Q5_1 => 4 * cols,
        _ => 2 * cols,
    }
}

impl<'a> Weight<'a> {
    pub fn new(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, BackendError> {
        if !cols.is_multiple_of(qtype.block_len()) {
            return Err(BackendError::Shape(format!(
                "{qtype:?}: row length {cols} is not a multiple of the block size {}",
                qtype.block_len()
            )));
        }
        let need = rows.checked_mul(qtype.row_bytes(cols));
        if need != Some(data.len()) {
            return Err(BackendError::Shape(format!(
                "{qtype:?} {rows}x{cols} needs {need:?} bytes, got {}",
                data.len()
            )));
        }
        Ok(Self {
            qtype,
            rows,
            cols,
            data,
            layout: RowLayout::Ggml,
        })
    }

    /// The same weight, its rows arranged as `layout`.
    pub fn with_layout(self, layout: RowLayout) -> Self {
        Self { layout, ..self }
    }

    /// Panic unless the fields still describe `data` (whole blocks, `rows` rows of `cols`).
    #[inline]
    pub fn check(&self) {
        assert!(
            self.cols.is_multiple_of(self.qtype.block_len())
                && self.rows.checked_mul(self.qtype.row_bytes(self.cols)) == Some(self.data.len()),
            "weight {:?} {}x{} does not match its {} bytes",
            self.qtype,
            self.rows,
            self.cols,
            self.data.len()
        );
    }
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.qtype.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `rows` of the matrix, borrowed (a column-parallel shard: some heads' or neurons'
    /// rows).
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> Result<Weight<'a>, BackendError> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(BackendError::Shape(format!(
                "rows {rows:?} of a {}-row matrix",
                self.rows
            )));
        }
        let rb = self.qtype.row_bytes(self.cols);
        Ok(Weight {
            rows: rows.len(),
            data: &self.data[rows.start * rb..rows.end * rb],
            ..*self
        })
    }

    /// Columns `cols` of every row, copied into bytes of `rows x cols.len()` in the same type
    /// (a row-parallel shard: W_o's columns of some heads, fc2's of some neurons). The range
    /// must fall on the type's block boundaries, and the rows be in the file's layout.
    pub fn col_range(&self, cols: std::ops::Range<usize>) -> Result<Vec<u8>, BackendError> {
        let bl = self.qtype.block_len();
        if cols.start > cols.end || cols.end > self.cols {
            return Err(BackendError::Shape(format!(
                "columns {cols:?} of a {}-column matrix",
                self.cols
            )));
        }
        if !cols.start.is_multiple_of(bl) || !cols.end.is_multiple_of(bl) {
            return Err(BackendError::Shape(format!(
                "columns {cols:?} do not fall on {:?}'s blocks of {bl}",
                self.qtype
            )));
        }
        if self.layout != RowLayout::Ggml {
            return Err(BackendError::Shape("columns of a repacked matrix".into()));
        }
        let (lo, hi) = (
            self.qtype.row_bytes(cols.start),
            self.qtype.row_bytes(cols.end),
        );
        let mut out = Vec::with_capacity(self.rows * (hi - lo));
        for r in 0..self.rows {
            out.extend_from_slice(&self.row(r)[lo..hi]);
        }
        Ok(out)
    }
}

/// One product of [`Backend::matmul_shared_input`]: `y = x W^T` over `rows`, 0 elsewhere.
pub struct MatmulJob<'a> {
    pub w: Weight<'a>,
    pub rows: &'a IndexSet,
    pub y: &'a mut [f32],
}

/// How RoPE pairs the dimensions of a head: `Interleaved` rotates `(x[2i], x[2i+1])` (ggml's
/// "normal" mode, llama GGUFs), `Neox` rotates `(x[i], x[i + d/2])` (qwen2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Neox,
}

/// The element-wise nonlinearity of an MLP: `x * sigmoid(x)` (SwiGLU's gate), `max(x, 0)`, or
/// GELU's tanh approximation (Gemma's GeGLU: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    Relu,
    GeluTanh,
}

impl Activation {
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Relu => x.max(0.0),
            Activation::GeluTanh => {
                const C: f32 = 0.797_884_6; // sqrt(2 / pi)
                0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }
}

/// Keys or values of a KV cache, `[positions][n_kv_heads * head_dim]`, in the cache's type.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl KvSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(x) => x.len(),
            KvSlice::F16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Geometry of one attention call: `n_tokens` queries at positions `pos0..pos0+n_tokens`, each
/// attending causally to the cache entries its [`Scoring`] keeps (`0..=pos`, or the window).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub pos0: usize,
    pub n_tokens: usize,
    pub scoring: Scoring,
}

/// How a query at position `p` scores the keys: `s_j = q . k_j * scale`, then (with a soft cap
/// `c`, Gemma 2) `s_j = c * tanh(s_j / c)`, over the positions `j` in `first(p)..=p`, where
/// `first(p)` is 0, or `p + 1 - window` (sliding-window attention: each query sees `window`
/// positions, itself included, as Mistral and Gemma's local layers do).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoring {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
}

impl Scoring {
    /// `1 / sqrt(head_dim)`, no cap, no window: the usual attention.
    pub fn plain(head_dim: usize) -> Self {
        Scoring {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// The first position a query at `p` attends to.
    pub fn first(&self, p: usize) -> usize {
        match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// A raw dot product `s` as the softmax sees it.
    pub fn score(&self, s: f32) -> f32 {
        let s = s * self.scale;
        match self.softcap {
            Some(c) => c * (s / c).tanh(),
            None => s,
        }
    }

    /// Whether the scoring is usable: a positive finite scale and cap, a positive window.
    pub fn check(&self) -> Result<(), String> {
        let ok = self.scale.is_finite()
            && self.scale > 0.0
            && self.softcap.is_none_or(|c| c.is_finite() && c > 0.0)
            && self.window.is_none_or(|w| w > 0);
        match ok {
            true => Ok(()),
            false => Err(format!("attention scoring {self:?}")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("backend `{backend}` does not support {what}")]
    Unsupported { backend: String, what: String },
    /// A device failed (out of memory, a driver or kernel compilation error).
    #[error("device: {0}")]
    Device(String),
}

/// Verbs of the layer executor. Activations are f32, token-major (`[n_tokens][width]`).
/// Contracts shared by all ops: slices have exactly the stated lengths (the executor guarantees
/// it; implementations check it and panic otherwise, never read or write out of bounds), and
/// outputs for unselected rows or heads are written as 0.
pub trait Backend: Send + Sync {
    fn name(&self) -> String;

    /// Capability query: can this backend compute with weights of this type?
    fn supports(&self, qtype: QuantType) -> bool;

    /// `y[t][r] = dot(W[r], x[t])` for `r` in `rows`, 0 for other rows.
    /// `x`: `n_tokens * w.cols`, `y`: `n_tokens * w.rows`.
    fn matmul(&self, w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]);

    /// Several products of the same input, as if `matmul(job.w, job.rows, x, job.y)` ran for each
    /// job (Q, K and V of a layer; gate and up). Every job's `w.cols` equals `x`'s width. Backends
    /// may prepare the input once and run all rows in one parallel dispatch.
    fn matmul_shared_input(&self, x: &[f32], jobs: &mut [MatmulJob<'_>]) {
        for j in jobs {
            self.matmul(&j.w, j.rows, x, j.y);
        }
    }

    /// Weighted sum of selected rows: `y[t] = sum over r in rows of a[t][r] * W[r]`, for weights
    /// stored neuron-major (the sparse path's transposed down projection: row r is neuron r's
    /// output column). `a`: `n_tokens * w.rows`; `y`: `n_tokens * w.cols`, overwritten.
    fn axpy_rows(&self, w: &Weight, rows: &IndexSet, a: &[f32], y: &mut [f32]);

    /// Does this backend read rows of `qtype` faster in another layout (see [`Backend::repack`])?
    fn repacks(&self, _qtype: QuantType) -> bool {
        false
    }

    /// `dst` (`w.data.len()` bytes) = the rows of `w` (ggml layout) in this backend's faster
    /// layout for `w.qtype`, which is returned; only for types [`Backend::repacks`] names.
    fn repack(&self, w: &Weight, _dst: &mut [u8]) -> RowLayout {
        panic!("{} does not repack {:?}", self.name(), w.qtype)
    }

    /// Dequantize row `r` of `w` into `out` (`w.cols` long): embedding lookup.
    fn dequantize_row(&self, w: &Weight, r: usize, out: &mut [f32]);

    /// Per token: `out = x / sqrt(mean(x^2) + eps) * weight`. `x`, `out`: `n_tokens * weight.len()`.
    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);

    /// Rotate each head of `x` (`n_tokens * n_heads * head_dim`), token `t` at position `pos0 + t`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        theta: f32,
        style: RopeStyle,
    );

    /// Per token: `out = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias` (LayerNorm; `bias`
    /// absent is 0). `x`, `out`: `n_tokens * weight.len()`; `bias`, if given, `weight.len()`.
    fn layernorm(&self, x: &[f32], weight: &[f32], bias: Option<&[f32]>, eps: f32, out: &mut [f32]);

    /// Gated MLP activation (SwiGLU, gated ReLU): `gate[i] = act(gate[i]) * up[i]`.
    fn glu(&self, act: Activation, gate: &mut [f32], up: &[f32]);

    /// Plain MLP activation (OPT's ReLU): `x[i] = act(x[i])`.
    fn activate(&self, act: Activation, x: &mut [f32]);

    /// Causal grouped-query attention for the selected query heads. `q`/`out`:
    /// `n_tokens * n_heads * head_dim`; `k_cache`/`v_cache` (f32 or f16, both the same type):
    /// `(pos0 + n_tokens) * n_kv_heads * head_dim` at least. Query head `h` reads kv head
    /// `h / (n_heads / n_kv_heads)`.
    fn attention(
        &self,
        q: &[f32],
        k_cache: KvSlice<'_>,
        v_cache: KvSlice<'_>,
        heads: &IndexSet,
        shape: AttnShape,
        out: &mut [f32],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_and_column_ranges_slice_the_blocks() {
        let (q, rows, cols) = (QuantType::Q8_0, 3, 96);
        let rb = q.row_bytes(cols);
        let data: Vec<u8> = (0..rows * rb).map(|i| (i % 251) as u8).collect();
        let w = Weight::new(q, rows, cols, &data).unwrap();
        let r = w.row_range(1..3).unwrap();
        assert_eq!((r.rows, r.cols, r.data), (2, cols, &data[rb..]));
        let c = w.col_range(32..96).unwrap();
        let bb = q.block_bytes();
        let want: Vec<u8> = (0..rows)
            .flat_map(|r| data[r * rb + bb..(r + 1) * rb].to_vec())
            .collect();
        assert_eq!(c, want);
        assert!(w.col_range(16..48).is_err(), "not on a block boundary");
        assert!(w.col_range(64..128).is_err() && w.row_range(2..4).is_err());
        let f = Weight::new(QuantType::F32, 2, 3, &[0u8; 24]).unwrap();
        assert_eq!(f.col_range(1..2).unwrap().len(), 8);
    }
}
