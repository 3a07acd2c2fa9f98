//! The sparse-friendly weight layout: each layer's down projection stored neuron-major.
//!
//! GGUF stores `ffn_down` as `[d_model rows][n_ff cols]`, quantized in blocks along the neuron
//! axis, so skipping a neuron skips no bytes. The conversion here ("down-t") dequantizes each
//! layer's down projection, transposes it to `[n_ff rows][d_model cols]` and quantizes every
//! neuron's row again (error-minimising scales, `dejavu_backend_api::quantize`): a skipped neuron
//! is then a skipped contiguous row. Float weights are transposed exactly.
//!
//! Target types (chosen to keep bytes per weight close to the source; the requantization error is
//! measured in docs/sparsity.md): 4-bit sources (Q4_0, Q4_1, Q4_K) and Q5_0 become Q5_0 (5.5
//! bits, 0.69 bytes per weight); Q6_K and Q8_0 become Q8_0.
//!
//! The result is cached next to the model as `<model file>.down-t-<TYPE>.v1.gguf` (built once, checked
//! against the source file's size and the shapes on every load, rebuilt when stale); where that
//! directory is not writable, it is built in memory for the process.
use crate::model::{weight_ref, Model, WeightRef};
use crate::{Error, Result};
use dejavu_backend_api::{quantize, Backend, QuantType, Weight};
use dejavu_formats::gguf::{self, GgmlType, MetaValue};
use dejavu_formats::GgufFile;
use std::path::PathBuf;

/// Bump when the conversion changes: older cache files are rebuilt.
pub const LAYOUT_VERSION: u32 = 1;
const KEY_VERSION: &str = "dejavu.layout.version";
const KEY_SOURCE_SIZE: &str = "dejavu.layout.source_size";

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
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q4K => QuantType::Q5_0,
    }
}

fn ggml_type(q: QuantType) -> GgmlType {
    match q {
        QuantType::F32 => GgmlType::F32,
        QuantType::F16 => GgmlType::F16,
        QuantType::BF16 => GgmlType::BF16,
        QuantType::Q8_0 => GgmlType::Q8_0,
        QuantType::Q4_0 => GgmlType::Q4_0,
        QuantType::Q4_1 => GgmlType::Q4_1,
        QuantType::Q5_0 => GgmlType::Q5_0,
        QuantType::Q4K => GgmlType::Q4K,
        QuantType::Q6K => GgmlType::Q6K,
    }
}

fn tensor_name(l: usize) -> String {
    format!("blk.{l}.ffn_down_t.weight")
}

/// Where the converted layout of `model` is cached (one file per target type of its first layer).
pub fn cache_path(model: &Model) -> PathBuf {
    let p = &model.file.path;
    let qt = down_t_type(
        model
            .layers
            .first()
            .map_or(QuantType::F32, |l| l.w_down.qtype),
    );
    let mut name = p.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".down-t-{}.v{LAYOUT_VERSION}.gguf", qt.name()));
    p.with_file_name(name)
}

/// The converted file's bytes, copied into anonymous memory advised to use huge pages: the sparse
/// path reads scattered rows, and with 4 KiB pages of a file mapping their software prefetches
/// mostly miss the TLB (measured: reading half the rows took longer than reading all of them).
struct Storage(memmap2::MmapMut);

impl Storage {
    fn copy_of(bytes: &[u8]) -> Result<Self> {
        let mut m = memmap2::MmapMut::map_anon(bytes.len().max(1))?;
        #[cfg(target_os = "linux")]
        let _ = m.advise(memmap2::Advice::HugePage);
        m[..bytes.len()].copy_from_slice(bytes);
        Ok(Self(m))
    }
}

/// The neuron-major down projections of every layer (`[n_ff][d_model]`).
pub struct SparseLayout {
    storage: Storage,
    down_t: Vec<WeightRef>,
    /// Where it was loaded from or written to (`None`: in memory only).
    pub path: Option<PathBuf>,
}

impl SparseLayout {
    /// Layer `l`'s neuron-major down projection.
    pub fn down_t(&self, l: usize) -> Weight<'_> {
        self.down_t[l].view(&self.storage.0)
    }

    /// Load the cached layout of `model`, or build (and cache) it.
    pub fn load_or_build(model: &Model, backend: &dyn Backend) -> Result<Self> {
        let path = cache_path(model);
        if let Ok(f) = GgufFile::open(&path) {
            if let Ok(down_t) = check(model, &f) {
                return Ok(Self {
                    storage: Storage::copy_of(f.bytes())?,
                    down_t,
                    path: Some(path),
                });
            }
        }
        let bytes = build(model, backend)?;
        let tmp = path.with_extension("tmp");
        let written = std::fs::write(&tmp, &bytes).and_then(|_| std::fs::rename(&tmp, &path));
        if written.is_ok() {
            if let Ok(f) = GgufFile::open(&path) {
                let down_t = check(model, &f)?;
                return Ok(Self {
                    storage: Storage::copy_of(f.bytes())?,
                    down_t,
                    path: Some(path),
                });
            }
        }
        let _ = std::fs::remove_file(&tmp);
        let header = gguf::parse(&bytes)?;
        let down_t = (0..model.config.n_layers)
            .map(|l| {
                let t = header
                    .tensor(&tensor_name(l))
                    .ok_or_else(|| Error::MissingTensor(tensor_name(l)))?;
                WeightRef::from_info(t, expected_type(model, l))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            storage: Storage::copy_of(&bytes)?,
            down_t,
            path: None,
        })
    }
}

fn expected_type(model: &Model, l: usize) -> QuantType {
    down_t_type(model.layers[l].w_down.qtype)
}

/// The cached file's tensors, if it matches this model (version, source size, shapes, types).
fn check(model: &Model, f: &GgufFile) -> Result<Vec<WeightRef>> {
    let stale = |why: &str| Error::BadTensor {
        tensor: f.path.display().to_string(),
        reason: format!("stale sparse layout: {why}"),
    };
    if f.get(KEY_VERSION).and_then(MetaValue::as_u64) != Some(LAYOUT_VERSION as u64) {
        return Err(stale("version"));
    }
    if f.get(KEY_SOURCE_SIZE).and_then(MetaValue::as_u64) != Some(model.file.file_size() as u64) {
        return Err(stale("source size"));
    }
    let c = &model.config;
    (0..c.n_layers)
        .map(|l| {
            let w = weight_ref(f, tensor_name(l), [c.n_ff, c.d_model])?;
            if w.qtype != expected_type(model, l) {
                return Err(stale("type"));
            }
            Ok(w)
        })
        .collect()
}

/// Convert every layer (in parallel over layers) and serialize as GGUF.
fn build(model: &Model, backend: &dyn Backend) -> Result<Vec<u8>> {
    let c = &model.config;
    let (d, ff) = (c.d_model, c.n_ff);
    let bar = crate::progress::bar(c.n_layers as u64, "neuron-major down projection");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let layers: Vec<usize> = (0..c.n_layers).collect();
    let mut converted: Vec<(usize, Vec<u8>)> = std::thread::scope(|s| {
        let handles: Vec<_> = layers
            .chunks(c.n_layers.div_ceil(threads))
            .map(|ls| {
                let bar = &bar;
                s.spawn(move || {
                    ls.iter()
                        .map(|&l| {
                            let out = transpose_layer(model, backend, l, d, ff);
                            bar.inc(1);
                            (l, out)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    bar.finish_and_clear();
    converted.sort_by_key(|(l, _)| *l);
    if converted.len() != c.n_layers {
        return Err(Error::Invalid("sparse layout conversion failed".into()));
    }
    let names: Vec<String> = (0..c.n_layers).map(tensor_name).collect();
    let dims = [d as u64, ff as u64];
    let tensors: Vec<(&str, &[u64], GgmlType, &[u8])> = converted
        .iter()
        .map(|(l, bytes)| {
            (
                names[*l].as_str(),
                &dims[..],
                ggml_type(expected_type(model, *l)),
                bytes.as_slice(),
            )
        })
        .collect();
    Ok(gguf::write(
        &[
            (KEY_VERSION, MetaValue::U32(LAYOUT_VERSION)),
            (
                KEY_SOURCE_SIZE,
                MetaValue::U64(model.file.file_size() as u64),
            ),
        ],
        &tensors,
    ))
}

/// Layer `l`'s down projection, dequantized, transposed and quantized row by row.
fn transpose_layer(model: &Model, backend: &dyn Backend, l: usize, d: usize, ff: usize) -> Vec<u8> {
    let w = model.weight(&model.layers[l].w_down);
    let mut dense = vec![0f32; d * ff];
    for (r, out) in dense.chunks_exact_mut(ff).enumerate() {
        backend.dequantize_row(&w, r, out);
    }
    let qt = down_t_type(w.qtype);
    let mut bytes = Vec::with_capacity(ff * qt.row_bytes(d));
    let mut row = vec![0f32; d];
    for j in 0..ff {
        for (i, v) in row.iter_mut().enumerate() {
            *v = dense[i * ff + j];
        }
        quantize::quantize_row(qt, &row, &mut bytes).expect("down_t_type returns writable types");
    }
    bytes
}
