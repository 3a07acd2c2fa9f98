//! The sparse-friendly weight layout: each layer's down projection stored neuron-major, and its
//! attention output projection W_o stored head-major.
//!
//! GGUF stores `ffn_down` as `[d_model rows][n_ff cols]`, quantized in blocks along the neuron
//! axis, so skipping a neuron skips no bytes. The conversion here ("down-t") dequantizes each
//! layer's down projection, transposes it to `[n_ff rows][d_model cols]` and quantizes every
//! neuron's row again (error-minimising scales, `dejavu_backend_api::quantize`): a skipped neuron
//! is then a skipped contiguous row. Float weights are transposed exactly. W_o
//! (`[d_model][n_heads x head_dim]`) is transposed the same way ("wo-t"), so a skipped query head
//! skips `head_dim` contiguous rows.
//!
//! Target types (chosen to keep bytes per weight close to the source; the requantization error is
//! measured in docs/sparsity.md): sources of 2 to 5.5 bits (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K,
//! IQ4_NL, IQ4_XS, Q5_0, Q5_1, Q5_K) become Q5_0 (5.5 bits, 0.69 bytes per weight); Q6_K and
//! Q8_0 become Q8_0.
//!
//! The result is cached in dejavu's cache directory as `layouts/<model file>-<path hash>.sparse-
//! <TYPE>.v3.gguf` (built once, checked against the source's content hash (model::content_key)
//! and the shapes on every load, rebuilt when stale); where that directory is not writable, it is
//! built in memory for the process.
use crate::model::synthetic;
use crate::model::weights::{ggml_type, weight_ref, Model, WeightRef};
use crate::{Error, Result};
use dejavu_backend_api::{quantize, Backend, QuantType, Weight};
use dejavu_formats::gguf::{self, GgmlType, MetaValue};
use dejavu_formats::GgufFile;
use std::path::PathBuf;

/// Bump when the conversion changes: older cache files are rebuilt.
/// 2: W_o added. 3: keyed on the full content hash and the files' stamp (model::content_key).
/// 4: the requantized rows search scales at both ends of the range (lower error).
pub const LAYOUT_VERSION: u32 = 4;
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

/// The transposed matrices of one layer: the down projection, then W_o.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    Down,
    Wo,
}
const PARTS: [Part; 2] = [Part::Down, Part::Wo];

fn tensor_name(l: usize, part: Part) -> String {
    match part {
        Part::Down => format!("blk.{l}.ffn_down_t.weight"),
        Part::Wo => format!("blk.{l}.attn_output_t.weight"),
    }
}

/// The source weight of `part` in layer `l`, and its transposed shape `[rows, cols]`.
fn source(model: &Model, l: usize, part: Part) -> (&WeightRef, [usize; 2]) {
    let c = &model.config;
    match part {
        Part::Down => (&model.layers[l].w_down, [c.n_ff, c.d_model]),
        Part::Wo => (&model.layers[l].wo, [c.n_heads * c.head_dim, c.d_model]),
    }
}

/// Where the converted layout of `model` is cached (one file per target type of its first layer).
pub fn cache_path(model: &Model) -> PathBuf {
    let qt = down_t_type(
        model
            .layers
            .first()
            .map_or(QuantType::F32, |l| l.w_down.qtype),
    );
    model.cache_path(
        "layouts",
        &format!("sparse-{}.v{LAYOUT_VERSION}.gguf", qt.name()),
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
    fn copy_of(bytes: &[u8]) -> Result<Self> {
        let mut m = memmap2::MmapMut::map_anon(bytes.len().max(1))?;
        #[cfg(target_os = "linux")]
        let _ = m.advise(memmap2::Advice::HugePage);
        m[..bytes.len()].copy_from_slice(bytes);
        Ok(Self(m))
    }
}

/// The neuron-major down projections (`[n_ff][d_model]`) and head-major W_o (`[n_heads *
/// head_dim][d_model]`) of every layer.
pub struct SparseLayout {
    storage: std::sync::Arc<Storage>,
    /// Per layer, one per [`PARTS`].
    tensors: Vec<[WeightRef; 2]>,
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

    /// Layer `l`'s neuron-major down projection.
    pub fn down_t(&self, l: usize) -> Weight<'_> {
        self.tensors[l][0].view(&self.storage.0)
    }

    /// Layer `l`'s head-major W_o: row `h * head_dim + i` is the output column of query head `h`'s
    /// dimension `i`.
    pub fn wo_t(&self, l: usize) -> Weight<'_> {
        self.tensors[l][1].view(&self.storage.0)
    }

    /// Load the cached layout of `model`, or build (and cache) it.
    pub fn load_or_build(model: &Model, backend: &dyn Backend) -> Result<Self> {
        if let Some(synth) = model.synthetic_source() {
            // Generated as the exact transposes of the random weights; never cached.
            let bytes = build(model, |l, part| {
                let (src, shape) = source(model, l, part);
                synthetic::transposed(synth, &src.name, shape, expected_type(model, l, part))
            })?;
            return Self::in_memory(model, &bytes);
        }
        let path = cache_path(model);
        if let Ok(f) = GgufFile::open(&path) {
            if let Ok(tensors) = check(model, &f) {
                return Ok(Self {
                    storage: std::sync::Arc::new(Storage::copy_of(f.bytes())?),
                    tensors,
                    path: Some(path),
                });
            }
        }
        let bytes = build(model, |l, part| transpose(model, backend, l, part))?;
        let dir_ok = path
            .parent()
            .is_none_or(|d| std::fs::create_dir_all(d).is_ok());
        if dir_ok && crate::fsio::write(&path, &bytes).is_ok() {
            if let Ok(f) = GgufFile::open(&path) {
                let tensors = check(model, &f)?;
                return Ok(Self {
                    storage: std::sync::Arc::new(Storage::copy_of(f.bytes())?),
                    tensors,
                    path: Some(path),
                });
            }
        }
        Self::in_memory(model, &bytes)
    }

    /// The layout serialized in `bytes`, for this process only.
    fn in_memory(model: &Model, bytes: &[u8]) -> Result<Self> {
        let header = gguf::parse(bytes)?;
        let tensors = (0..model.config.n_layers)
            .map(|l| {
                let get = |part| {
                    let name = tensor_name(l, part);
                    let t = header.tensor(&name).ok_or(Error::MissingTensor(name))?;
                    WeightRef::from_info(t, expected_type(model, l, part))
                };
                Ok([get(Part::Down)?, get(Part::Wo)?])
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            storage: std::sync::Arc::new(Storage::copy_of(bytes)?),
            tensors,
            path: None,
        })
    }
}

fn expected_type(model: &Model, l: usize, part: Part) -> QuantType {
    down_t_type(source(model, l, part).0.qtype)
}

/// The cached file's tensors, if it matches this model (version, source size, shapes, types).
fn check(model: &Model, f: &GgufFile) -> Result<Vec<[WeightRef; 2]>> {
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
            let get = |part| {
                let w = weight_ref(f, tensor_name(l, part), source(model, l, part).1)?;
                if w.qtype != expected_type(model, l, part) {
                    return Err(stale("type"));
                }
                Ok(w)
            };
            Ok([get(Part::Down)?, get(Part::Wo)?])
        })
        .collect()
}

/// Convert every layer (`convert(layer, part)`, in parallel over layers) and serialize as GGUF.
fn build(model: &Model, convert: impl Fn(usize, Part) -> Vec<u8> + Sync) -> Result<Vec<u8>> {
    let c = &model.config;
    // The converted matrices, their serialization and the final copy: twice the layout at once.
    let layout: usize = (0..c.n_layers)
        .flat_map(|l| PARTS.map(|p| (l, p)))
        .map(|(l, p)| {
            let [rows, cols] = source(model, l, p).1;
            rows * expected_type(model, l, p).row_bytes(cols)
        })
        .sum();
    if let Some(avail) = crate::memstat::available() {
        if 2 * layout > avail {
            return Err(Error::Invalid(format!(
                "the sparse layout ({:.1} GiB) needs {:.1} GiB to build; {:.1} GiB are available",
                layout as f64 / (1u64 << 30) as f64,
                2.0 * layout as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            )));
        }
    }
    let bar = crate::progress::bar(c.n_layers as u64, "sparse layout (down projection, W_o)");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let layers: Vec<usize> = (0..c.n_layers).collect();
    let mut converted: Vec<(usize, Part, Vec<u8>)> = std::thread::scope(|s| {
        let handles: Vec<_> = layers
            .chunks(c.n_layers.div_ceil(threads))
            .map(|ls| {
                let (bar, convert) = (&bar, &convert);
                s.spawn(move || {
                    let mut out = Vec::new();
                    for &l in ls {
                        for part in PARTS {
                            out.push((l, part, convert(l, part)));
                        }
                        bar.inc(1);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    bar.finish_and_clear();
    converted.sort_by_key(|(l, p, _)| (*l, *p == Part::Wo));
    if converted.len() != c.n_layers * PARTS.len() {
        return Err(Error::Invalid("sparse layout conversion failed".into()));
    }
    let names: Vec<String> = converted
        .iter()
        .map(|(l, p, _)| tensor_name(*l, *p))
        .collect();
    // GGUF dims are innermost first: [cols, rows].
    let dims: Vec<[u64; 2]> = converted
        .iter()
        .map(|(l, p, _)| {
            let [rows, cols] = source(model, *l, *p).1;
            [cols as u64, rows as u64]
        })
        .collect();
    let tensors: Vec<(&str, &[u64], GgmlType, &[u8])> = converted
        .iter()
        .enumerate()
        .map(|(i, (l, p, bytes))| {
            (
                names[i].as_str(),
                &dims[i][..],
                ggml_type(expected_type(model, *l, *p)),
                bytes.as_slice(),
            )
        })
        .collect();
    Ok(gguf::write(
        &[
            (KEY_VERSION, MetaValue::U32(LAYOUT_VERSION)),
            (
                KEY_SOURCE,
                MetaValue::String(model.fingerprint().to_string()),
            ),
            (KEY_STAMP, MetaValue::String(model.stamp().to_string())),
        ],
        &tensors,
    ))
}

/// Layer `l`'s `part`, dequantized, transposed and quantized row by row.
fn transpose(model: &Model, backend: &dyn Backend, l: usize, part: Part) -> Vec<u8> {
    let (src, [rows, cols]) = source(model, l, part);
    let w = model.weight(src);
    // The source is `cols` rows of `rows` elements.
    let mut dense = vec![0f32; rows * cols];
    for (r, out) in dense.chunks_exact_mut(rows).enumerate() {
        backend.dequantize_row(&w, r, out);
    }
    let qt = down_t_type(w.qtype);
    let mut bytes = Vec::with_capacity(rows * qt.row_bytes(cols));
    let mut row = vec![0f32; cols];
    for j in 0..rows {
        for (i, v) in row.iter_mut().enumerate() {
            *v = dense[i * rows + j];
        }
        quantize::quantize_row(qt, &row, &mut bytes).expect("down_t_type returns writable types");
    }
    bytes
}
