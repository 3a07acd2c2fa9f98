//! Trained predictors and the file that holds them.
//!
//! [`OutputPreview`]: the contextual output head. A rank-r preview of the output matrix E
//! (vocab x d) picks the candidate tokens whose logits are then computed exactly. The preview is
//! the activation-weighted low-rank approximation: with Sigma = L L^T the second moment of the
//! final hidden states h on calibration text, it minimises E||(E - E_r) h||^2, i.e.
//! `E_r = [E L]_r L^-1`, stored as `table = E L V_r` (vocab x r, Q8_0) and `proj = V_r^T L^-1`
//! (r x d, f32), where V_r are the top right singular vectors of E L. Preview logits are
//! `table * (proj * h)`. Components are ordered, so the first r' of them are the rank-r' preview.
//!
//! [`MlpPredictor`] and [`HeadPredictor`] (see [`crate::sparsity::predictor`]): Deja Vu's per-layer low-rank
//! scorers of MLP neurons and of the next layer's query heads.
//!
//! The file: safetensors, metadata `format = dejavu-predictors`, `version`, the model file it was
//! calibrated for (`model`, `model_size`), the `recommended` policy and a calibration summary.
use crate::sparsity::input::{InputStats, POINTS};
use crate::sparsity::predictor::{HeadPredictor, LowRankPredictor, MlpPredictor};
use crate::{Error, Result};
use dejavu_backend_api::quant::{BlockQ8_0, QK};
use dejavu_backend_api::{quantize, QuantType, Weight};
use half::f16;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const FORMAT: &str = "dejavu-predictors";
/// 2: predictors read the layer's attention input (lookahead) and head predictors were added.
pub const VERSION: u32 = 2;

pub struct OutputPreview {
    pub rank: usize,
    d: usize,
    vocab: usize,
    proj: Vec<f32>,
    table: Vec<u8>,
}

impl OutputPreview {
    /// From f32 factors: `proj` r x d, `table` vocab x r (quantized to Q8_0 here).
    pub fn new(rank: usize, d: usize, proj: Vec<f32>, table_f32: &[f32]) -> Result<Self> {
        if rank == 0 || !rank.is_multiple_of(QK) || proj.len() != rank * d {
            return Err(Error::Invalid(format!(
                "output preview: rank {rank} must be a positive multiple of {QK} with a {rank}x{d} projection"
            )));
        }
        let vocab = table_f32.len() / rank;
        let mut table = Vec::with_capacity(QuantType::Q8_0.row_bytes(rank) * vocab);
        quantize::quantize_row(QuantType::Q8_0, table_f32, &mut table)
            .ok_or_else(|| Error::Invalid("output preview table".into()))?;
        Ok(Self {
            rank,
            d,
            vocab,
            proj,
            table,
        })
    }

    pub fn proj(&self) -> Weight<'_> {
        // The sizes were checked when the predictor was built or loaded.
        Weight::new(
            QuantType::F32,
            self.rank,
            self.d,
            bytemuck::cast_slice(&self.proj),
        )
        .expect("predictor sizes are checked at load")
    }

    pub fn table(&self) -> Weight<'_> {
        // The sizes were checked when the predictor was built or loaded.
        Weight::new(QuantType::Q8_0, self.vocab, self.rank, &self.table)
            .expect("predictor sizes are checked at load")
    }

    /// Bytes one preview reads.
    pub fn bytes(&self) -> usize {
        self.proj.len() * 4 + self.table.len()
    }

    /// The rank-`r` preview (its first `r` components), `r` a multiple of 32 up to `self.rank`.
    pub fn truncated(self: &Arc<Self>, r: usize) -> Result<Arc<Self>> {
        if r == self.rank {
            return Ok(self.clone());
        }
        if r == 0 || !r.is_multiple_of(QK) || r > self.rank {
            return Err(Error::Invalid(format!(
                "output preview rank {r}: must be a multiple of {QK} up to {}",
                self.rank
            )));
        }
        let (src_row, dst_row) = (
            QuantType::Q8_0.row_bytes(self.rank),
            QuantType::Q8_0.row_bytes(r),
        );
        let table = self
            .table
            .chunks_exact(src_row)
            .flat_map(|row| &row[..dst_row])
            .copied()
            .collect();
        Ok(Arc::new(Self {
            rank: r,
            d: self.d,
            vocab: self.vocab,
            proj: self.proj[..r * self.d].to_vec(),
            table,
        }))
    }
}

/// Everything a predictors file holds.
#[derive(Clone)]
pub struct Predictors {
    pub path: Option<PathBuf>,
    pub metadata: HashMap<String, String>,
    pub output: Option<Arc<OutputPreview>>,
    /// Deja Vu MLP predictors, one per layer (empty when not trained).
    pub mlp: Arc<[MlpPredictor]>,
    /// One per layer (empty when not trained): layer l's scores the heads of layer l + 1.
    pub heads: Arc<[HeadPredictor]>,
    /// Input sparsity's calibration quantiles (`teal`, `wina`), if calibrated.
    pub inputs: Option<Arc<InputStats>>,
}

/// A Q8_0 matrix stored as two tensors: `NAME.qs` (I8, rows x cols) and `NAME.d` (F16, rows x
/// cols/32), the block layout safetensors has no dtype for. Returns the Q8_0 bytes.
fn read_q8(
    f: &dejavu_formats::safetensors::SafetensorsFile,
    name: &str,
    rows: usize,
    cols: usize,
) -> std::result::Result<Vec<u8>, String> {
    use dejavu_formats::safetensors::Dtype;
    let (qs, d) = match (
        f.tensors.get(&format!("{name}.qs")),
        f.tensors.get(&format!("{name}.d")),
    ) {
        (Some(qs), Some(d)) => (qs, d),
        _ => return Err(format!("`{name}` is missing")),
    };
    if qs.dtype != Dtype::I8
        || qs.shape != [rows, cols]
        || d.dtype != Dtype::F16
        || d.shape != [rows, cols / QK]
        || !cols.is_multiple_of(QK)
    {
        return Err(format!("`{name}` has the wrong types or shapes"));
    }
    let mut out = Vec::with_capacity(rows * QuantType::Q8_0.row_bytes(cols));
    for (q, s) in f.data(qs).chunks_exact(QK).zip(f.data(d).chunks_exact(2)) {
        let mut b = BlockQ8_0 {
            d: f16::from_le_bytes([s[0], s[1]]),
            qs: [0; QK],
        };
        b.qs.iter_mut().zip(q).for_each(|(o, &v)| *o = v as i8);
        out.extend(bytemuck::bytes_of(&b));
    }
    Ok(out)
}

type Owned = Vec<(String, safetensors::tensor::Dtype, Vec<usize>, Vec<u8>)>;

/// The inverse of [`read_q8`].
fn push_q8(owned: &mut Owned, name: &str, q8: &[u8], rows: usize, cols: usize) {
    use safetensors::tensor::Dtype;
    let blocks: Vec<BlockQ8_0> = q8
        .chunks_exact(size_of::<BlockQ8_0>())
        .map(bytemuck::pod_read_unaligned)
        .collect();
    owned.push((
        format!("{name}.qs"),
        Dtype::I8,
        vec![rows, cols],
        blocks.iter().flat_map(|b| b.qs.map(|v| v as u8)).collect(),
    ));
    owned.push((
        format!("{name}.d"),
        Dtype::F16,
        vec![rows, cols / QK],
        blocks.iter().flat_map(|b| b.d.to_le_bytes()).collect(),
    ));
}

impl Predictors {
    /// Random MLP and head predictors for a synthetic model, at its configured rank (for speed
    /// only: they select real sets at a real cost, of no meaning).
    pub fn synthetic(model: &crate::model::weights::Model) -> Result<Self> {
        let (c, synth) = match model.synthetic_source() {
            Some(s) => (&model.config, s),
            None => return Err(Error::Invalid("not a synthetic model".into())),
        };
        let layers = |what: &str, n_out: usize| {
            (0..c.n_layers)
                .map(|l| {
                    let (rank, w1, w2) = synth.predictor_weights(l, what, c.d_model, n_out)?;
                    LowRankPredictor::from_parts(rank, c.d_model, n_out, w1, w2)
                })
                .collect::<Result<Arc<[_]>>>()
        };
        let (mlp, heads) = (layers("mlp", c.n_ff)?, layers("heads", c.n_heads)?);
        Ok(Self {
            path: None,
            metadata: HashMap::from([("synthetic".to_string(), "true".to_string())]),
            output: None,
            mlp,
            heads,
            inputs: None,
        })
    }

    /// A file of input thresholds only (what `teal` and `wina` read).
    pub fn inputs_only(stats: InputStats) -> Self {
        Self {
            path: None,
            metadata: HashMap::new(),
            output: None,
            mlp: Vec::new().into(),
            heads: Vec::new().into(),
            inputs: Some(Arc::new(stats)),
        }
    }

    /// Per-layer MLP density measured at calibration (the fraction of nonzero activations), if
    /// stored.
    pub fn mlp_density(&self) -> Option<Vec<f64>> {
        let v = self.metadata.get("mlp_density")?;
        v.split(',').map(|x| x.trim().parse().ok()).collect()
    }

    /// The policy calibration recommends (`None` if the file has none).
    pub fn recommended(&self) -> Option<&str> {
        self.metadata.get("recommended").map(String::as_str)
    }

    /// Where `dejavu calibrate` writes, and `--sparsity recommended` looks, for a model file.
    /// Where `dejavu calibrate` writes a model's predictors and `--sparsity recommended` finds
    /// them: the cache directory (`$DEJAVU_HOME/predictors`, see `Model::cache_path`), never the
    /// model's own directory.
    pub fn default_path(model: &crate::model::weights::Model) -> PathBuf {
        model.cache_path("predictors", &format!("predictors.v{VERSION}.safetensors"))
    }

    /// Where earlier versions wrote them: beside a GGUF, inside a checkpoint directory (still
    /// read when the cache has none).
    pub fn legacy_path(model: &crate::model::weights::Model) -> PathBuf {
        model.derived_path(&format!("predictors.v{VERSION}.safetensors"))
    }

    /// Load and check against the model it is used with (`d_model`, vocabulary, content fingerprint).
    pub fn load(path: &Path, model: &crate::model::weights::Model) -> Result<Self> {
        if !path.exists() {
            return Err(Error::MissingFile(path.to_path_buf()));
        }
        let f = dejavu_formats::safetensors::SafetensorsFile::open(path)?;
        let bad = |why: String| Error::BadTensor {
            tensor: path.display().to_string(),
            reason: why,
        };
        let meta = |k: &str| f.metadata.get(k).map(String::as_str);
        if meta("format") != Some(FORMAT) {
            return Err(bad(format!("not a {FORMAT} file")));
        }
        if meta("version") != Some(&VERSION.to_string()) {
            return Err(bad(format!(
                "version {:?}, this build reads version {VERSION}",
                meta("version")
            )));
        }
        let (fp, stamp) = (meta("model_fingerprint"), meta("model_stamp"));
        if !model.built_from_this(fp.unwrap_or_default(), stamp.unwrap_or_default()) {
            return Err(bad(format!(
                "calibrated for another model or other weights ({:?}, fingerprint {:?}); this \
                 one's fingerprint is {} (recalibrate with `dejavu calibrate`)",
                meta("model"),
                fp,
                model.fingerprint()
            )));
        }
        let c = &model.config;
        use dejavu_formats::safetensors::Dtype;
        let output = match f.tensors.get("output.preview.proj") {
            Some(p) => {
                let rank = p.shape.first().copied().unwrap_or(0);
                if p.dtype != Dtype::F32
                    || p.shape != [rank, c.d_embed]
                    || rank == 0
                    || !rank.is_multiple_of(QK)
                {
                    return Err(bad(
                        "output preview projection has the wrong type or shape".into()
                    ));
                }
                let proj: Vec<f32> = f
                    .data(p)
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let table = read_q8(&f, "output.preview", c.vocab_size, rank).map_err(bad)?;
                Some(Arc::new(OutputPreview {
                    rank,
                    d: c.d_embed,
                    vocab: c.vocab_size,
                    proj,
                    table,
                }))
            }
            None => None,
        };
        // Low-rank predictors `blk.{l}.{name}.w1/w2` of `n_out` units, rank in metadata `{name}_rank`.
        let low_rank = |name: &str, n_out: usize| -> Result<Vec<LowRankPredictor>> {
            let Some(rank) = f.metadata.get(&format!("{name}_rank")) else {
                return Ok(Vec::new());
            };
            let rank: usize = rank.parse().map_err(|_| bad(format!("bad {name}_rank")))?;
            (0..c.n_layers)
                .map(|l| {
                    let w = |m: &str, rows, cols| {
                        read_q8(&f, &format!("blk.{l}.{name}.{m}"), rows, cols).map_err(bad)
                    };
                    let (w1, w2) = (w("w1", rank, c.d_model)?, w("w2", n_out, rank)?);
                    LowRankPredictor::from_parts(rank, c.d_model, n_out, w1, w2)
                })
                .collect()
        };
        let mlp = low_rank("mlp_pred", c.n_ff)?;
        let heads = low_rank("head_pred", c.n_heads)?;
        // Input sparsity's quantiles: `inputs.teal` and `inputs.wina`, F32 [layers][4][POINTS].
        let quantiles = |name: &str| -> Result<Option<Vec<f32>>> {
            let Some(t) = f.tensors.get(name) else {
                return Ok(None);
            };
            if t.dtype != Dtype::F32 || t.shape != [c.n_layers, 4, POINTS] {
                return Err(bad(format!("`{name}` has the wrong type or shape")));
            }
            let v: Vec<f32> = (f.data(t).chunks_exact(4))
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            match v.iter().all(|x| x.is_finite()) {
                true => Ok(Some(v)),
                false => Err(bad(format!("`{name}` holds values that are not finite"))),
            }
        };
        // TEAL's allocation across the groups (optional): `inputs.teal_alloc`, F32 [rows][5].
        let alloc = match f.tensors.get("inputs.teal_alloc") {
            None => Vec::new(),
            Some(t) if t.dtype == Dtype::F32 && t.shape.len() == 2 && t.shape[1] == 5 => {
                let v: Vec<f32> = (f.data(t).chunks_exact(4))
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let rows: Vec<[f32; 5]> = (v.chunks_exact(5))
                    .map(|r| [r[0], r[1], r[2], r[3], r[4]])
                    .collect();
                let fractions = v.iter().all(|x| (0.0..=1.0).contains(x));
                let rising = rows.windows(2).all(|w| w[0][0] < w[1][0]);
                if !fractions || !rising {
                    return Err(bad(
                        "`inputs.teal_alloc` holds sparsities outside [0, 1] or not rising".into(),
                    ));
                }
                rows
            }
            Some(_) => return Err(bad("`inputs.teal_alloc` has the wrong type or shape".into())),
        };
        let inputs = match (quantiles("inputs.teal")?, quantiles("inputs.wina")?) {
            (Some(teal), Some(wina)) => Some(Arc::new(InputStats {
                teal,
                wina,
                n_layers: c.n_layers,
                alloc,
            })),
            (None, None) => None,
            _ => {
                return Err(bad(
                    "one of `inputs.teal` and `inputs.wina` is missing".into()
                ))
            }
        };
        Ok(Self {
            path: Some(path.to_path_buf()),
            metadata: f.metadata.clone(),
            output,
            mlp: mlp.into(),
            heads: heads.into(),
            inputs,
        })
    }

    /// Serialize to `path` (as `crate::fsio` writes; never over the model itself).
    pub fn save(&self, path: &Path, model: &crate::model::weights::Model) -> Result<()> {
        crate::fsio::refuse_overwrite("--out", path, &model.path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        use safetensors::tensor::{Dtype, TensorView};
        let mut meta = self.metadata.clone();
        meta.insert("format".into(), FORMAT.into());
        meta.insert("version".into(), VERSION.to_string());
        meta.insert(
            "model".into(),
            model
                .path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
        );
        meta.insert("model_fingerprint".into(), model.fingerprint().to_string());
        meta.insert("model_stamp".into(), model.stamp().to_string());
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        if let Some(o) = &self.output {
            owned.push((
                "output.preview.proj".into(),
                Dtype::F32,
                vec![o.rank, o.d],
                bytemuck::cast_slice(&o.proj).to_vec(),
            ));
            push_q8(&mut owned, "output.preview", &o.table, o.vocab, o.rank);
        }
        for (name, preds) in [("mlp_pred", &self.mlp), ("head_pred", &self.heads)] {
            if let Some(first) = preds.first() {
                meta.insert(format!("{name}_rank"), first.rank.to_string());
            }
            for (l, p) in preds.iter().enumerate() {
                let pre = format!("blk.{l}.{name}");
                push_q8(&mut owned, &format!("{pre}.w1"), &p.w1, p.rank, p.d);
                push_q8(&mut owned, &format!("{pre}.w2"), &p.w2, p.n_out, p.rank);
            }
        }
        if let Some(st) = &self.inputs {
            for (name, q) in [("inputs.teal", &st.teal), ("inputs.wina", &st.wina)] {
                let shape = vec![st.n_layers, 4, POINTS];
                owned.push((
                    name.into(),
                    Dtype::F32,
                    shape,
                    bytemuck::cast_slice(q).to_vec(),
                ));
            }
            if !st.alloc.is_empty() {
                owned.push((
                    "inputs.teal_alloc".into(),
                    Dtype::F32,
                    vec![st.alloc.len(), 5],
                    bytemuck::cast_slice(&st.alloc).to_vec(),
                ));
            }
        }
        let views: Vec<(String, TensorView)> = owned
            .iter()
            .map(|(n, dt, shape, data)| {
                TensorView::new(*dt, shape.clone(), data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| Error::Invalid(format!("predictor tensor {n}: {e}")))
            })
            .collect::<Result<_>>()?;
        let bytes = safetensors::serialize(views, &Some(meta))
            .map_err(|e| Error::Invalid(format!("serializing predictors: {e}")))?;
        crate::fsio::write(path, bytes)
    }
}
