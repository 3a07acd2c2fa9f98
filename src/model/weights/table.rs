//! The canonical table of one source (GGUF, checkpoint or synthetic): each tensor under its
//! canonical (GGUF) name as an [`Entry`] of its file, Phi-3's fused matrices split into views
//! ([`unfuse`]), and the typed, shape-checked reads [`Model`](super::Model)'s build makes of it
//! ([`Table`]). Every read is checked against the file it points into.
use super::{NormWeights, WeightRef};
use crate::model::config::{Architecture, ModelConfig, NormKind};
use crate::model::synthetic;
use crate::{Error, Result};
use dejavu_backend_api::{QuantType, RowLayout};
use dejavu_formats::safetensors::Dtype;
use dejavu_formats::{GgufFile, TensorInfo};
use std::collections::HashMap;

/// One tensor of a source under its canonical name.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    file: usize,
    /// The engine's type, or the name of an unsupported one.
    qtype: std::result::Result<QuantType, String>,
    /// ggml order: `dims[0]` is the row length.
    dims: Vec<u64>,
    start: usize,
    n_bytes: usize,
    /// The name in the source file (for messages).
    source_name: String,
}

pub(super) type Tensors = HashMap<String, Entry>;

impl Entry {
    pub(super) fn gguf(t: &TensorInfo, file: usize) -> Self {
        let qtype = QuantType::ALL
            .into_iter()
            .find(|&q| super::ggml_type(q) == t.ggml_type)
            .ok_or_else(|| t.ggml_type.name().to_string());
        Self {
            file,
            qtype,
            dims: t.dims.clone(),
            start: t.start,
            n_bytes: t.n_bytes,
            source_name: t.name.clone(),
        }
    }

    /// Tensor `file` of a synthetic model (its own buffer).
    pub(super) fn memory(file: usize, t: &synthetic::TensorSpec) -> Self {
        Self {
            file,
            qtype: Ok(t.qtype),
            dims: ggml_dims(t.shape),
            start: 0,
            n_bytes: t.n_bytes(),
            source_name: t.name.clone(),
        }
    }

    pub(super) fn hf(t: &dejavu_formats::safetensors::StTensor, file: usize, name: &str) -> Self {
        let qtype = match t.dtype {
            Dtype::F32 => Ok(QuantType::F32),
            Dtype::F16 => Ok(QuantType::F16),
            Dtype::BF16 => Ok(QuantType::BF16),
            other => Err(format!(
                "{other:?} (f32, f16 and bf16 checkpoints are supported)"
            )),
        };
        Self {
            file,
            qtype,
            dims: t.shape.iter().rev().map(|&d| d as u64).collect(),
            start: t.start,
            n_bytes: t.n_bytes,
            source_name: name.to_string(),
        }
    }
}

/// The tensors of a checkpoint whose data in its shard is not aligned to its type (a PyTorch
/// zip or a safetensors file from a writer that does not pad: `torch.save` aligns storages to
/// 64 bytes), copied into one buffer at 64-byte offsets and their entries pointed at it, as
/// file `files.len()` (one past the shards); None where every tensor is aligned (zero-copy).
pub(super) fn copy_misaligned(
    table: &mut Tensors,
    files: &[&[u8]],
) -> Result<Option<std::sync::Arc<memmap2::MmapMut>>> {
    let misaligned = |e: &Entry| {
        let Ok(q) = e.qtype else { return false };
        let within = files
            .get(e.file)
            .and_then(|f| f.get(e.start..e.start + e.n_bytes));
        within.is_some_and(|b| !(b.as_ptr() as usize).is_multiple_of(q.align()))
    };
    let mut names: Vec<String> = (table.iter())
        .filter(|(_, e)| misaligned(e))
        .map(|(k, _)| k.clone())
        .collect();
    if names.is_empty() {
        return Ok(None);
    }
    names.sort();
    let size: usize = names
        .iter()
        .map(|n| table[n].n_bytes.next_multiple_of(64))
        .sum();
    let mut buf = memmap2::MmapMut::map_anon(size.max(1))?;
    let mut at = 0;
    for n in &names {
        let e = table.get_mut(n).expect("listed above");
        buf[at..at + e.n_bytes].copy_from_slice(&files[e.file][e.start..e.start + e.n_bytes]);
        (e.file, e.start) = (files.len(), at);
        at += e.n_bytes.next_multiple_of(64);
    }
    Ok(Some(std::sync::Arc::new(buf)))
}

/// Phi-3's fused matrices (see [`crate::model::arch::phi3`]) replaced by entries of their row ranges:
/// views of the same bytes, so nothing is copied. Phi-3's LongRoPE tables are refused by name.
pub(super) fn unfuse(table: &mut Tensors, c: &ModelConfig) -> Result<()> {
    if c.arch != Architecture::Phi3 {
        return Ok(());
    }
    if let Some(n) = ["rope_factors_long.weight", "rope_factors_short.weight"]
        .into_iter()
        .find(|n| table.contains_key(*n))
    {
        return Err(Error::BadTensor {
            tensor: n.into(),
            reason: "LongRoPE (Phi-3 128k, Phi-3.5) is not supported".into(),
        });
    }
    let widths = (c.n_heads * c.head_dim, c.kv_dim(), c.n_ff);
    // Each fused tensor with its parts, found once.
    type Parts = Vec<(String, usize, usize)>;
    let fused: Vec<(String, Entry, Parts)> = (table.iter())
        .filter(|(_, e)| e.dims.len() == 2)
        .filter_map(|(n, e)| {
            let parts = crate::model::arch::phi3::unfused(n, e.dims[1] as usize, widths)?;
            Some((n.clone(), e.clone(), parts))
        })
        .collect();
    for (name, e, parts) in fused {
        let qtype = e.qtype.clone().map_err(|t| Error::UnsupportedType {
            tensor: e.source_name.clone(),
            qtype: t,
        })?;
        let cols = e.dims[0] as usize;
        if cols == 0 || !cols.is_multiple_of(qtype.block_len()) {
            return Err(Error::BadTensor {
                tensor: e.source_name,
                reason: format!("rows of {cols} do not fit {}", qtype.name()),
            });
        }
        let row = qtype.row_bytes(cols);
        table.remove(&name);
        for (part, from, n) in parts {
            let entry = Entry {
                dims: vec![cols as u64, n as u64],
                start: e.start + from * row,
                n_bytes: n * row,
                source_name: format!("{} (rows {from}..{})", e.source_name, from + n),
                ..e.clone()
            };
            if table.insert(part.clone(), entry).is_some() {
                return Err(Error::BadTensor {
                    tensor: part,
                    reason: format!("both it and the fused {name} are in the file"),
                });
            }
        }
    }
    Ok(())
}

/// The canonical table of one source, with the files its entries point into.
pub(super) struct Table<'a> {
    pub(super) table: &'a Tensors,
    pub(super) files: &'a [&'a [u8]],
    pub(super) c: &'a ModelConfig,
    /// The names looked up so far: every tensor of the file must be one of them.
    pub(super) used: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl Table<'_> {
    fn entry(&self, name: &str) -> Result<&Entry> {
        self.used.borrow_mut().insert(name.to_string());
        self.table
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// Refuse tensors the configuration does not use (a layer count smaller than the file's, a
    /// tensor of another architecture), as llama.cpp does: computing without them would be
    /// silently wrong.
    pub(super) fn all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        let mut unused: Vec<&String> = self.table.keys().filter(|k| !used.contains(*k)).collect();
        if unused.is_empty() {
            return Ok(());
        }
        unused.sort();
        let n = unused.len();
        let shown: Vec<&str> = unused.iter().take(4).map(|s| s.as_str()).collect();
        Err(Error::Invalid(format!(
            "{n} tensor(s) the configuration ({} layers) does not use: {}{}",
            self.c.n_layers,
            shown.join(", "),
            if n > 4 { ", ..." } else { "" }
        )))
    }

    /// A matrix (or `[1, n]` vector) of shape `[rows, cols]`.
    pub(super) fn weight(&self, name: &str, shape: [usize; 2]) -> Result<WeightRef> {
        let e = self.entry(name)?;
        let w = weight_ref_of(e, name, Some(shape))?;
        if e.file >= self.files.len() || e.start + e.n_bytes > self.files[e.file].len() {
            return Err(Error::BadTensor {
                tensor: name.into(),
                reason: "data lies outside its file".into(),
            });
        }
        let addr = self.files[e.file].as_ptr() as usize + e.start;
        if !addr.is_multiple_of(w.qtype.align()) {
            return Err(Error::BadTensor {
                tensor: name.into(),
                reason: format!(
                    "its data starts at byte {} of its file, not aligned to the {} bytes {:?} needs",
                    e.start,
                    w.qtype.align(),
                    w.qtype
                ),
            });
        }
        Ok(w)
    }

    /// A float vector of length `n`, converted to f32; every value finite.
    pub(super) fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let v = self.vector_any(name, n)?;
        crate::model::finite::check_vector(name, &v)?;
        Ok(v)
    }

    /// A norm's gains: the stored vector, plus 1 where the checkpoint stores `w - 1`.
    pub(super) fn gains(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let mut v = self.vector(name, n)?;
        if self.c.norm_plus_one {
            v.iter_mut().for_each(|w| *w += 1.0);
        }
        Ok(v)
    }

    fn vector_any(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let w = self.weight(name, [1, n])?;
        let bytes = &self.files[w.file][w.start..w.start + w.n_bytes];
        match w.qtype {
            QuantType::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            QuantType::F16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            QuantType::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            other => Err(Error::BadTensor {
                tensor: name.into(),
                reason: format!("expected a float vector, got {}", other.name()),
            }),
        }
    }

    /// A norm's gain (and bias, for LayerNorm); gain 1 and no bias when the model's norms are
    /// not affine.
    pub(super) fn norm(&self, weight: &str, bias: &str) -> Result<NormWeights> {
        let d = self.c.d_model;
        if !self.c.norm_affine {
            return Ok(NormWeights {
                weight: vec![1.0; d],
                bias: None,
            });
        }
        Ok(NormWeights {
            weight: self.gains(weight, d)?,
            bias: match self.c.norm {
                NormKind::Layer => Some(self.vector(bias, d)?),
                NormKind::Rms => None,
            },
        })
    }
}

/// The ggml dims (innermost first) of shape `[rows, cols]`; a 1-D tensor is `[1, n]`.
fn ggml_dims([rows, cols]: [usize; 2]) -> Vec<u64> {
    match rows {
        1 => vec![cols as u64],
        _ => vec![cols as u64, rows as u64],
    }
}

/// Check an entry's type and (if given) shape `[rows, cols]` (a 1-D tensor is `[1, n]`).
pub(super) fn weight_ref_of(e: &Entry, name: &str, shape: Option<[usize; 2]>) -> Result<WeightRef> {
    if let Some(shape) = shape {
        let expected = ggml_dims(shape);
        if e.dims != expected {
            return Err(Error::ShapeMismatch {
                tensor: e.source_name.clone(),
                expected,
                got: e.dims.clone(),
            });
        }
    }
    let qtype = e.qtype.clone().map_err(|t| Error::UnsupportedType {
        tensor: e.source_name.clone(),
        qtype: t,
    })?;
    let cols = *e.dims.first().unwrap_or(&0) as usize;
    let rows = e.dims.get(1..).map_or(1, |d| d.iter().product::<u64>()) as usize;
    // The format layer computed n_bytes from its own table; the backend's must agree.
    if cols == 0
        || !cols.is_multiple_of(qtype.block_len())
        || qtype.row_bytes(cols) * rows != e.n_bytes
    {
        return Err(Error::BadTensor {
            tensor: e.source_name.clone(),
            reason: "byte size disagrees with its type".into(),
        });
    }
    Ok(WeightRef {
        name: name.to_string(),
        qtype,
        rows,
        cols,
        file: e.file,
        start: e.start,
        n_bytes: e.n_bytes,
        layout: RowLayout::Ggml,
    })
}

/// Look up a tensor of a GGUF file and check its shape `[rows, cols]` (the sparse layout's cache).
pub(crate) fn weight_ref(file: &GgufFile, name: String, shape: [usize; 2]) -> Result<WeightRef> {
    let t = file
        .tensor(&name)
        .ok_or_else(|| Error::MissingTensor(name.clone()))?;
    weight_ref_of(&Entry::gguf(t, 0), &name, Some(shape))
}
