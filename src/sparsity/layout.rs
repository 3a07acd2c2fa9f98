//! The sparse-friendly weight layouts: matrices stored input-major (transposed), so that a
//! skipped input skips contiguous bytes.
//!
//! GGUF stores a projection as `[outputs rows][inputs cols]`, quantized in blocks along the
//! input axis, so skipping an input skips no bytes. The conversion here dequantizes each matrix,
//! transposes it to `[inputs][outputs]` and quantizes every input's row again (error-minimising
//! scales, `dejavu_backend_api::quantize`). Float weights are transposed exactly. Two layouts
//! ([`Kind`]), each its own file, built on first use:
//! - the units' ("down-t", "wo-t"): each layer's down projection neuron-major, so a skipped
//!   neuron is a skipped row, and W_o (`[d_model][n_heads x head_dim]`) head-major, so a skipped
//!   query head skips `head_dim` contiguous rows. What the Deja Vu rules read.
//! - the inputs': Q, K, V, gate and up input-major, `[d_model][outputs]`. Input sparsity
//!   (`teal`, `wina`) reads them with the units' layout (W_o's and the down projection's
//!   inputs). It holds a second copy of those matrices (the file's rows serve prompts' batches).
//!
//! Target types (chosen to keep bytes per weight close to the source; the requantization error is
//! measured in docs/sparsity.md): sources of 2 to 5.5 bits (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K,
//! IQ4_NL, IQ4_XS, Q5_0, Q5_1, Q5_K) become Q5_0 (5.5 bits, 0.69 bytes per weight); Q6_K and
//! Q8_0 become Q8_0.
//!
//! The result is cached in dejavu's cache directory as `layouts/<model file>-<path hash>.<kind>-
//! <TYPE>.v6.gguf` (built once, straight into the memory that holds it; checked against the
//! source's content hash (model::content_key) and the shapes on every load, rebuilt when
//! stale); where that directory is not writable, it is built in memory for the process.
use crate::model::synthetic;
use crate::model::weights::{ggml_type, weight_ref, Model, WeightRef};
use crate::{Error, Result};
use dejavu_backend_api::{quantize, Backend, QuantType, RowLayout, Weight};
use dejavu_formats::gguf::{self, GgmlType, MetaValue};
use dejavu_formats::GgufFile;
use std::path::PathBuf;

/// Bump when the conversion changes: older cache files are rebuilt.
/// 2: W_o added. 3: keyed on the full content hash and the files' stamp (model::content_key).
/// 4: the requantized rows search scales at both ends of the range (lower error).
/// 5: Q5_0, Q5_1 and Q5_K sources in the input-block layout (their own 5-bit values).
/// 6: Q6_K, Q2_K, Q3_K and the IQ4 types requantized into the input-block layout.
pub const LAYOUT_VERSION: u32 = 6;
const KEY_VERSION: &str = "dejavu.layout.version";
const KEY_SOURCE: &str = "dejavu.layout.source_fingerprint";
const KEY_STAMP: &str = "dejavu.layout.source_stamp";

/// The type a neuron-major row of a down projection of type `src` is stored in: the rule above,
/// or the type named by `DEJAVU_DOWN_T` (F32, F16, BF16, Q8_0, Q5_0, Q4_1) for every layer.
pub fn down_t_type(src: QuantType) -> QuantType {
    if let Some(q) = std::env::var("DEJAVU_DOWN_T")
        .ok()
        .and_then(|v| QuantType::from_name(&v))
        .filter(|q| quantize::WRITABLE.contains(q))
    {
        return q;
    }
    match src {
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => src,
        QuantType::Q8_0 | QuantType::Q6K => QuantType::Q8_0,
        QuantType::Q2K
        | QuantType::Q3K
        | QuantType::Q4_0
        | QuantType::Q4_1
        | QuantType::Q4K
        | QuantType::IQ4NL
        | QuantType::IQ4XS
        | QuantType::Q5_0
        | QuantType::Q5_1
        | QuantType::Q5K => QuantType::Q5_0,
    }
}

/// One transposed matrix of a layer. Each is the source (`[out][in]` in the file) stored
/// input-major, `[in][out]`: row `i` is input `i`'s column, so a skipped input (a neuron, a
/// head's dimension, or an entry TEAL or WINA drops) skips one contiguous row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Down,
    Wo,
    Q,
    K,
    V,
    /// Absent from a plain (ungated) MLP.
    Gate,
    /// The up projection (fc1 of a plain MLP).
    Up,
}

/// Which matrices a layout holds: the units' (`Units`: the neuron-major down projection and
/// head-major W_o that the Deja Vu rules read) or the inputs' (`Inputs`: every projection
/// input-major, what input sparsity reads). Each is its own cached file: a model that never runs
/// input sparsity never holds the second copy of its projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Units,
    Inputs,
}

impl Kind {
    fn parts(self, gated: bool) -> &'static [Part] {
        match (self, gated) {
            (Kind::Units, _) => &[Part::Down, Part::Wo],
            (Kind::Inputs, true) => &[
                Part::Q,
                Part::K,
                Part::V,
                Part::Wo,
                Part::Gate,
                Part::Up,
                Part::Down,
            ],
            (Kind::Inputs, false) => &[Part::Q, Part::K, Part::V, Part::Wo, Part::Up, Part::Down],
        }
    }
    fn stem(self, form: Form) -> &'static str {
        match (self, form) {
            (Kind::Units, _) => "sparse",
            (Kind::Inputs, Form::Rows) => "inputs",
            (Kind::Inputs, Form::Blocks) => "inputs-blocks",
        }
    }
    fn what(self) -> &'static str {
        match self {
            Kind::Units => "sparse layout (down projection, W_o)",
            Kind::Inputs => "input-major layout (every projection)",
        }
    }
}

/// How a quantized matrix is stored input-major: `Rows`, each input's row requantized in the
/// file's row layout (every device reads it); `Blocks`, the input-block layout where the
/// matrix's shape allows ([`crate::sparsity::blocks`]: the source's own values for Q8_0, Q4_0,
/// Q4_1, Q4_K and the 5-bit types, requantized as `Rows` are for Q6_K, Q2_K, Q3_K and IQ4; read
/// by devices that [`dejavu_backend_api::Device::reads_input_blocks`]), else `Rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Rows,
    Blocks,
}

/// The type and row layout of layer `l`'s transposed `part` in `form`.
fn target(model: &Model, l: usize, part: Part, form: Form) -> (QuantType, RowLayout) {
    let (src, [rows, cols]) = source(model, l, part);
    match (form, crate::sparsity::blocks::target(src.qtype, cols, rows)) {
        (Form::Blocks, Some(q)) => (q, RowLayout::InputBlocks),
        _ => (down_t_type(src.qtype), RowLayout::Ggml),
    }
}

/// Layer `l`'s `part` as the inputs' layout of `form` holds it, without building it: its type,
/// rows (the source's inputs) and columns (its outputs), and the source's bytes (what its dense
/// product reads).
pub fn input_major(
    model: &Model,
    l: usize,
    part: Part,
    form: Form,
) -> (QuantType, usize, usize, usize) {
    let (src, [rows, cols]) = source(model, l, part);
    (target(model, l, part, form).0, rows, cols, src.n_bytes())
}

fn tensor_name(l: usize, part: Part) -> String {
    let t = match part {
        Part::Down => "ffn_down_t",
        Part::Wo => "attn_output_t",
        Part::Q => "attn_q_t",
        Part::K => "attn_k_t",
        Part::V => "attn_v_t",
        Part::Gate => "ffn_gate_t",
        Part::Up => "ffn_up_t",
    };
    format!("blk.{l}.{t}.weight")
}

/// The source weight of `part` in layer `l`, and its transposed shape `[rows, cols]`.
fn source(model: &Model, l: usize, part: Part) -> (&WeightRef, [usize; 2]) {
    let lw = &model.layers[l];
    let w = match part {
        Part::Down => &lw.w_down,
        Part::Wo => &lw.wo,
        Part::Q => &lw.wq,
        Part::K => &lw.wk,
        Part::V => &lw.wv,
        Part::Gate => lw
            .w_gate
            .as_ref()
            .expect("Kind::parts names the gate of gated MLPs only"),
        Part::Up => &lw.w_up,
    };
    (w, [w.cols, w.rows])
}

/// Where the converted layout of `model` is cached (one file per kind, form and target type of
/// its first layer's down projection).
pub fn cache_path(model: &Model, kind: Kind, form: Form) -> PathBuf {
    let qt = down_t_type(
        model
            .layers
            .first()
            .map_or(QuantType::F32, |l| l.w_down.qtype),
    );
    model.cache_path(
        "layouts",
        &format!("{}-{}.v{LAYOUT_VERSION}.gguf", kind.stem(form), qt.name()),
    )
}

/// The converted file's bytes, copied into anonymous memory advised to use huge pages: the sparse
/// path reads scattered rows, and with 4 KiB pages of a file mapping their software prefetches
/// mostly miss the TLB (measured: reading half the rows took longer than reading all of them).
struct Storage(memmap2::MmapMut);

impl AsRef<[u8]> for Storage {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Storage {
    fn zeroed(len: usize) -> Result<Self> {
        Ok(Self(crate::memstat::huge_zeroed(len)?))
    }
    fn copy_of(bytes: &[u8]) -> Result<Self> {
        let mut m = Self::zeroed(bytes.len())?;
        m.0[..bytes.len()].copy_from_slice(bytes);
        Ok(m)
    }
}

/// Transposed matrices of every layer (see [`Kind`]): the units' neuron-major down projections
/// (`[n_ff][d_model]`) and head-major W_o (`[n_heads * head_dim][d_model]`), or the inputs'
/// Q, K, V, gate and up (`[d_model][outputs]`).
pub struct SparseLayout {
    storage: std::sync::Arc<Storage>,
    kind: Kind,
    form: Form,
    /// The matrices of each layer (`kind.parts`), in the order of `tensors`' entries.
    parts: &'static [Part],
    /// Per layer, one per part.
    tensors: Vec<Vec<WeightRef>>,
    /// Where it was loaded from or written to (`None`: in memory only).
    pub path: Option<PathBuf>,
}

impl SparseLayout {
    /// The buffer that holds the layout (for [`dejavu_backend_api::Device::share_mat`]).
    pub fn owner(&self) -> dejavu_backend_api::SharedBytes {
        self.storage.clone()
    }

    /// The whole layout in memory (for resident-memory accounting).
    pub fn bytes(&self) -> &[u8] {
        &self.storage.0
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }
    pub fn form(&self) -> Form {
        self.form
    }

    /// Layer `l`'s transposed `part`, if this layout holds it.
    pub fn get(&self, l: usize, part: Part) -> Option<Weight<'_>> {
        let i = self.parts.iter().position(|&p| p == part)?;
        Some(self.tensors.get(l)?[i].view(&self.storage.0))
    }

    /// Layer `l`'s neuron-major down projection (a units layout).
    pub fn down_t(&self, l: usize) -> Weight<'_> {
        self.get(l, Part::Down)
            .expect("a units layout holds the down projection")
    }

    /// Layer `l`'s head-major W_o (a units layout): row `h * head_dim + i` is the output column
    /// of query head `h`'s dimension `i`.
    pub fn wo_t(&self, l: usize) -> Weight<'_> {
        self.get(l, Part::Wo).expect("a units layout holds W_o")
    }

    /// Load the cached units layout of `model`, or build (and cache) it.
    pub fn load_or_build(model: &Model, backend: &dyn Backend) -> Result<Self> {
        Self::load_or_build_kind(model, backend, Kind::Units, Form::Rows)
    }

    /// Load the cached layout of `kind` in `form` (the units' are always rows), or build (and
    /// cache) it.
    pub fn load_or_build_kind(
        model: &Model,
        backend: &dyn Backend,
        kind: Kind,
        form: Form,
    ) -> Result<Self> {
        let form = if kind == Kind::Units {
            Form::Rows
        } else {
            form
        };
        if let Some(synth) = model.synthetic_source() {
            // Rows are generated as the exact transposes of the random weights (the generator
            // splits each matrix's rows over the cores); input blocks hold the model's own
            // quantized values. Never cached.
            let storage = build(model, kind, form, 1, |l, part, out| {
                let (src, shape) = source(model, l, part);
                match target(model, l, part, form) {
                    (qt, RowLayout::InputBlocks) => {
                        crate::sparsity::blocks::convert(&model.weight(src), qt, out)
                    }
                    (qt, _) => synthetic::transposed(synth, &src.name, shape, qt, out),
                }
            })?;
            return Self::from_storage(model, kind, form, storage, None);
        }
        let path = cache_path(model, kind, form);
        if let Ok(f) = GgufFile::open(&path) {
            if let Ok(tensors) = check(model, kind, form, &f) {
                return Ok(Self {
                    storage: std::sync::Arc::new(Storage::copy_of(f.bytes())?),
                    kind,
                    form,
                    parts: kind.parts(model.config.mlp.gated()),
                    tensors,
                    path: Some(path),
                });
            }
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let storage = build(model, kind, form, threads, |l, part, out| {
            match target(model, l, part, form) {
                (qt, RowLayout::InputBlocks) => {
                    let src = source(model, l, part).0;
                    crate::sparsity::blocks::convert(&model.weight(src), qt, out)
                }
                _ => transpose(model, backend, l, part, out),
            }
        })?;
        let dir_ok = path
            .parent()
            .is_none_or(|d| std::fs::create_dir_all(d).is_ok());
        // Where the cache is not writable, the layout lives in memory for this process.
        let written = dir_ok && crate::fsio::write(&path, &storage.0).is_ok();
        Self::from_storage(model, kind, form, storage, written.then_some(path))
    }

    /// The layout serialized in `storage`.
    fn from_storage(
        model: &Model,
        kind: Kind,
        form: Form,
        storage: Storage,
        path: Option<PathBuf>,
    ) -> Result<Self> {
        let header = gguf::parse(&storage.0)?;
        let tensors = (0..model.config.n_layers)
            .map(|l| {
                (kind.parts(model.config.mlp.gated()).iter())
                    .map(|&part| {
                        let name = tensor_name(l, part);
                        let t = header.tensor(&name).ok_or(Error::MissingTensor(name))?;
                        let (qt, layout) = target(model, l, part, form);
                        let mut w = WeightRef::from_info(t, qt)?;
                        w.layout = layout;
                        Ok(w)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            storage: std::sync::Arc::new(storage),
            kind,
            form,
            parts: kind.parts(model.config.mlp.gated()),
            tensors,
            path,
        })
    }
}

/// The cached file's tensors, if it matches this model (version, source size, shapes, types).
fn check(model: &Model, kind: Kind, form: Form, f: &GgufFile) -> Result<Vec<Vec<WeightRef>>> {
    let stale = |why: &str| Error::BadTensor {
        tensor: f.path.display().to_string(),
        reason: format!("stale sparse layout: {why}"),
    };
    if f.get(KEY_VERSION).and_then(MetaValue::as_u64) != Some(LAYOUT_VERSION as u64) {
        return Err(stale("version"));
    }
    let recorded = |k| f.get(k).and_then(MetaValue::as_str).unwrap_or_default();
    if !model.built_from_this(recorded(KEY_SOURCE), recorded(KEY_STAMP)) {
        return Err(stale("built from other weights"));
    }
    (0..model.config.n_layers)
        .map(|l| {
            (kind.parts(model.config.mlp.gated()).iter())
                .map(|&part| {
                    let mut w = weight_ref(f, tensor_name(l, part), source(model, l, part).1)?;
                    let (qt, layout) = target(model, l, part, form);
                    if w.qtype != qt {
                        return Err(stale("type"));
                    }
                    w.layout = layout;
                    Ok(w)
                })
                .collect()
        })
        .collect()
}

/// Convert every matrix of `kind` (`convert(layer, part, out)` writes its bytes into `out`,
/// on `threads` threads over the matrices) straight into the buffer that holds the GGUF
/// serialization, so the layout is held once while it is built.
fn build(
    model: &Model,
    kind: Kind,
    form: Form,
    threads: usize,
    convert: impl Fn(usize, Part, &mut [u8]) + Sync,
) -> Result<Storage> {
    let c = &model.config;
    let jobs: Vec<(usize, Part)> = (0..c.n_layers)
        .flat_map(|l| kind.parts(c.mlp.gated()).iter().map(move |&p| (l, p)))
        .collect();
    let names: Vec<String> = jobs.iter().map(|&(l, p)| tensor_name(l, p)).collect();
    // GGUF dims are innermost first: [cols, rows].
    let dims: Vec<[u64; 2]> = (jobs.iter())
        .map(|&(l, p)| {
            let [rows, cols] = source(model, l, p).1;
            [cols as u64, rows as u64]
        })
        .collect();
    let infos: Vec<(&str, &[u64], GgmlType, usize)> = (jobs.iter().enumerate())
        .map(|(i, &(l, p))| {
            let qt = target(model, l, p, form).0;
            let [rows, cols] = source(model, l, p).1;
            (
                names[i].as_str(),
                &dims[i][..],
                ggml_type(qt),
                rows * qt.row_bytes(cols),
            )
        })
        .collect();
    let meta = [
        (KEY_VERSION, MetaValue::U32(LAYOUT_VERSION)),
        (
            KEY_SOURCE,
            MetaValue::String(model.fingerprint().to_string()),
        ),
        (KEY_STAMP, MetaValue::String(model.stamp().to_string())),
    ];
    let (header, starts, len) = gguf::layout(&meta, &infos);
    if let Some(avail) = crate::memstat::available() {
        if len > avail {
            return Err(Error::Invalid(format!(
                "the {} ({:.1} GiB) does not fit in the {:.1} GiB available",
                kind.what(),
                len as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            )));
        }
    }
    let mut storage = Storage::zeroed(len)?;
    storage.0[..header.len()].copy_from_slice(&header);
    // Each matrix's bytes, split off in file order.
    let mut outs: Vec<(usize, Part, &mut [u8])> = Vec::with_capacity(jobs.len());
    let mut rest = &mut storage.0[..];
    let mut at = 0;
    for (i, &(l, p)) in jobs.iter().enumerate() {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(starts[i] - at);
        let (out, tail) = tail.split_at_mut(infos[i].3);
        outs.push((l, p, out));
        (rest, at) = (tail, starts[i] + infos[i].3);
    }
    let bar = crate::progress::bar(jobs.len() as u64, kind.what());
    let per = outs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for chunk in outs.chunks_mut(per) {
            let (bar, convert) = (&bar, &convert);
            s.spawn(move || {
                for (l, p, out) in chunk.iter_mut() {
                    convert(*l, *p, out);
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    Ok(storage)
}

/// Layer `l`'s `part`, dequantized, transposed and quantized row by row into `out`.
fn transpose(model: &Model, backend: &dyn Backend, l: usize, part: Part, out: &mut [u8]) {
    let (src, [rows, cols]) = source(model, l, part);
    let w = model.weight(src);
    // The source is `cols` rows of `rows` elements.
    let mut dense = vec![0f32; rows * cols];
    for (r, out) in dense.chunks_exact_mut(rows).enumerate() {
        backend.dequantize_row(&w, r, out);
    }
    let qt = down_t_type(w.qtype);
    let row_bytes = qt.row_bytes(cols);
    let (mut row, mut bytes) = (vec![0f32; cols], Vec::with_capacity(row_bytes));
    for (j, dst) in out.chunks_exact_mut(row_bytes).enumerate().take(rows) {
        for (i, v) in row.iter_mut().enumerate() {
            *v = dense[i * rows + j];
        }
        bytes.clear();
        quantize::quantize_row(qt, &row, &mut bytes).expect("down_t_type returns writable types");
        dst.copy_from_slice(&bytes);
    }
}
