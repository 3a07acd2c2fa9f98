//! A model: the mapped GGUF file, its [`ModelConfig`], and every weight as a validated view.
//!
//! Weights are never copied: [`WeightRef`] records a tensor's checked type, shape and byte range,
//! and [`Model::weight`] turns it into a borrowed [`Weight`] on demand. Load checks every tensor the
//! config needs: present, expected shape, a supported type.
use crate::engine::config::ModelConfig;
use crate::engine::names::{GlobalTensor, LayerTensor};
use crate::{Error, Result};
use dejavu_backend_api::{QuantType, Weight};
use dejavu_formats::{GgmlType, GgufFile, TensorInfo};
use std::path::Path;

/// A checked tensor of the file: `rows x cols`, row-major, `qtype`.
#[derive(Debug, Clone)]
pub struct WeightRef {
    pub name: String,
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    n_bytes: usize,
}

impl WeightRef {
    /// The weight inside `file_bytes`, the whole file it was checked against.
    pub fn view<'a>(&self, file_bytes: &'a [u8]) -> Weight<'a> {
        Weight {
            qtype: self.qtype,
            rows: self.rows,
            cols: self.cols,
            data: &file_bytes[self.start..self.start + self.n_bytes],
        }
    }

    /// A 2-D tensor of a parsed header, which must be of type `want`.
    pub fn from_info(t: &TensorInfo, want: QuantType) -> Result<Self> {
        let qtype = quant_type(t)?;
        if qtype != want || t.dims.len() != 2 {
            return Err(Error::BadTensor {
                tensor: t.name.clone(),
                reason: format!("expected a 2-D {} tensor", want.name()),
            });
        }
        let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
        if qtype.row_bytes(cols) * rows != t.n_bytes {
            return Err(Error::BadTensor {
                tensor: t.name.clone(),
                reason: "byte size disagrees with its type".into(),
            });
        }
        Ok(Self {
            name: t.name.clone(),
            qtype,
            rows,
            cols,
            start: t.start,
            n_bytes: t.n_bytes,
        })
    }

    pub fn n_bytes(&self) -> usize {
        self.n_bytes
    }
}

/// The weights of one transformer block. Shapes as `[rows, cols]` (rows = outputs).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: WeightRef,  // F32 [1, d_model]
    pub wq: WeightRef,         // [n_heads*head_dim, d_model]
    pub wk: WeightRef,         // [kv_dim, d_model]
    pub wv: WeightRef,         // [kv_dim, d_model]
    pub bq: Option<WeightRef>, // F32 [1, n_heads*head_dim]
    pub bk: Option<WeightRef>, // F32 [1, kv_dim]
    pub bv: Option<WeightRef>, // F32 [1, kv_dim]
    pub wo: WeightRef,         // [d_model, n_heads*head_dim]
    pub ffn_norm: WeightRef,   // F32 [1, d_model]
    pub w_gate: WeightRef,     // [n_ff, d_model]
    pub w_up: WeightRef,       // [n_ff, d_model]
    pub w_down: WeightRef,     // [d_model, n_ff]
}

pub struct Model {
    pub file: GgufFile,
    pub config: ModelConfig,
    pub token_embd: WeightRef,  // [vocab, d_model]
    pub output_norm: WeightRef, // F32 [1, d_model]
    /// `output.weight`, or the token embedding when tied. [vocab, d_model]
    pub output: WeightRef,
    pub layers: Vec<LayerWeights>,
}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::MissingFile(path.to_path_buf()));
        }
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file.header)?;
        let c = &config;
        let get = |name: String, shape: [usize; 2]| weight_ref(&file, name, shape);
        let (d, q_dim, kv, ff, vocab) = (
            c.d_model,
            c.n_heads * c.head_dim,
            c.kv_dim(),
            c.n_ff,
            c.vocab_size,
        );
        let token_embd = get(GlobalTensor::TokenEmbd.name(), [vocab, d])?;
        let output = if c.tied_output {
            token_embd.clone()
        } else {
            get(GlobalTensor::Output.name(), [vocab, d])?
        };
        let output_norm = f32_vec(get(GlobalTensor::OutputNorm.name(), [1, d])?)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let t = |name: LayerTensor, shape| get(name.name(l), shape);
            let bias = |name: LayerTensor, n| -> Result<Option<WeightRef>> {
                if c.qkv_bias {
                    Ok(Some(f32_vec(t(name, [1, n])?)?))
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: f32_vec(t(LayerTensor::AttnNorm, [1, d])?)?,
                wq: t(LayerTensor::AttnQ, [q_dim, d])?,
                wk: t(LayerTensor::AttnK, [kv, d])?,
                wv: t(LayerTensor::AttnV, [kv, d])?,
                bq: bias(LayerTensor::AttnQBias, q_dim)?,
                bk: bias(LayerTensor::AttnKBias, kv)?,
                bv: bias(LayerTensor::AttnVBias, kv)?,
                wo: t(LayerTensor::AttnOutput, [d, q_dim])?,
                ffn_norm: f32_vec(t(LayerTensor::FfnNorm, [1, d])?)?,
                w_gate: t(LayerTensor::FfnGate, [ff, d])?,
                w_up: t(LayerTensor::FfnUp, [ff, d])?,
                w_down: t(LayerTensor::FfnDown, [d, ff])?,
            });
        }
        Ok(Self {
            file,
            config,
            token_embd,
            output_norm,
            output,
            layers,
        })
    }

    /// Borrow a weight's bytes from the mapping (range and size were checked at load).
    pub fn weight(&self, w: &WeightRef) -> Weight<'_> {
        w.view(self.file_bytes())
    }

    /// An F32 vector weight (norm gains, biases) as a slice.
    pub fn vector(&self, w: &WeightRef) -> &[f32] {
        // Alignment and length were checked by `f32_vec` at load.
        bytemuck::cast_slice(self.weight(w).data)
    }

    fn file_bytes(&self) -> &[u8] {
        self.file.bytes()
    }

    /// Bytes of weights one dense decode step reads (every matrix once, plus one embedding row).
    pub fn dense_bytes_per_token(&self) -> usize {
        let c = &self.config;
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(|w| w.n_bytes)
            .sum();
        layers + self.output.n_bytes + self.token_embd.qtype.row_bytes(c.d_model)
    }
}

fn quant_type(t: &TensorInfo) -> Result<QuantType> {
    let q = match t.ggml_type {
        GgmlType::F32 => QuantType::F32,
        GgmlType::F16 => QuantType::F16,
        GgmlType::BF16 => QuantType::BF16,
        GgmlType::Q8_0 => QuantType::Q8_0,
        GgmlType::Q4_0 => QuantType::Q4_0,
        GgmlType::Q4_1 => QuantType::Q4_1,
        GgmlType::Q5_0 => QuantType::Q5_0,
        GgmlType::Q4K => QuantType::Q4K,
        GgmlType::Q6K => QuantType::Q6K,
        other => {
            return Err(Error::UnsupportedType {
                tensor: t.name.clone(),
                qtype: other.name().into(),
            })
        }
    };
    Ok(q)
}

/// Look up a tensor and check its shape `[rows, cols]` (a 1-D tensor is `[1, n]`).
pub(crate) fn weight_ref(
    file: &GgufFile,
    name: String,
    [rows, cols]: [usize; 2],
) -> Result<WeightRef> {
    let t = file
        .tensor(&name)
        .ok_or_else(|| Error::MissingTensor(name.clone()))?;
    let expected: Vec<u64> = if rows == 1 {
        vec![cols as u64]
    } else {
        vec![cols as u64, rows as u64]
    };
    if t.dims != expected {
        return Err(Error::ShapeMismatch {
            tensor: name,
            expected,
            got: t.dims.clone(),
        });
    }
    let qtype = quant_type(t)?;
    // The format layer computed n_bytes from its own block table; the backend's must agree.
    if qtype.row_bytes(cols) * rows != t.n_bytes {
        return Err(Error::BadTensor {
            tensor: name,
            reason: "byte size disagrees with its type".into(),
        });
    }
    Ok(WeightRef {
        name,
        qtype,
        rows,
        cols,
        start: t.start,
        n_bytes: t.n_bytes,
    })
}

fn f32_vec(w: WeightRef) -> Result<WeightRef> {
    if w.qtype != QuantType::F32 || w.start % 4 != 0 {
        return Err(Error::BadTensor {
            tensor: w.name,
            reason: format!("expected an aligned F32 vector, got {}", w.qtype.name()),
        });
    }
    Ok(w)
}
