//! A model: its mapped files (one GGUF, or the shards of a Hugging Face checkpoint), its
//! [`ModelConfig`], and every weight as a validated view.
//!
//! Both sources become one table of tensors under the canonical (GGUF) names (see
//! `model::names`, `model::arch`), so one loader checks them: present, expected shape, a
//! supported type. Matrices are never copied: [`WeightRef`] records a tensor's file, checked type,
//! shape and byte range, and [`Model::weight`] turns it into a borrowed [`Weight`] on demand (f16
//! and bf16 stay 16-bit). Norm gains and biases, a few vectors of `d_model`, are converted to f32
//! once at load.
mod table;

use crate::model::arch;
use crate::model::config::{ModelConfig, Positions};
use crate::model::names::{GlobalTensor, LayerTensor};
use crate::model::synthetic::{self, Shape, Synthetic, SyntheticOptions};
use crate::{Error, Result};
use dejavu_backend_api::{QuantType, RowLayout, SharedBytes, Weight};
use dejavu_formats::gguf::GgufHeader;
use dejavu_formats::hf::HfCheckpoint;
use dejavu_formats::{GgmlType, GgufFile, TensorInfo};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
pub(crate) use table::weight_ref;
use table::{unfuse, weight_ref_of, Entry, Table, Tensors};

/// A checked 2-D tensor: `rows x cols`, row-major, `qtype`, inside mapped file `file`.
#[derive(Debug, Clone)]
pub struct WeightRef {
    pub name: String,
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    /// Index of the mapped file (or [`CONVERTED`]) and byte range in it.
    file: usize,
    start: usize,
    n_bytes: usize,
    /// How the rows are arranged (`Repacked` after `Model::repack`).
    pub layout: RowLayout,
}

/// The `file` of a weight moved to the model's converted buffer by `Model::repack`.
pub(crate) const CONVERTED: usize = usize::MAX;

impl WeightRef {
    /// The weight inside `file_bytes`, the whole file it was checked against.
    pub fn view<'a>(&self, file_bytes: &'a [u8]) -> Weight<'a> {
        Weight::new(
            self.qtype,
            self.rows,
            self.cols,
            &file_bytes[self.start..self.start + self.n_bytes],
        )
        .expect("WeightRef sizes are checked at load")
        .with_layout(self.layout)
    }

    /// `(file, start)`: where the bytes are.
    pub(crate) fn location(&self) -> (usize, usize) {
        (self.file, self.start)
    }

    /// The same bytes, now at `(file, start)` and arranged as `layout`.
    pub(crate) fn relocate(&mut self, (file, start): (usize, usize), layout: RowLayout) {
        (self.file, self.start, self.layout) = (file, start, layout);
    }

    /// A 2-D tensor of a parsed GGUF header, which must be of type `want`.
    pub fn from_info(t: &TensorInfo, want: QuantType) -> Result<Self> {
        let w = weight_ref_of(&Entry::gguf(t, 0), &t.name, None)?;
        if w.qtype != want || t.dims.len() != 2 {
            return Err(Error::BadTensor {
                tensor: t.name.clone(),
                reason: format!("expected a 2-D {} tensor", want.name()),
            });
        }
        Ok(w)
    }

    pub fn n_bytes(&self) -> usize {
        self.n_bytes
    }
}

/// A norm's gain and (LayerNorm) bias, in f32.
#[derive(Debug, Clone)]
pub struct NormWeights {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// The weights of one transformer block. Shapes as `[rows, cols]` (rows = outputs). For a plain
/// MLP (OPT) `w_up` is fc1 and `w_down` fc2; `w_gate` exists only in gated MLPs.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: NormWeights,
    pub wq: WeightRef, // [n_heads*head_dim, d_model]
    pub wk: WeightRef, // [kv_dim, d_model]
    pub wv: WeightRef, // [kv_dim, d_model]
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub wo: WeightRef, // [d_model, n_heads*head_dim]
    pub bo: Option<Vec<f32>>,
    /// Gains of the per-head RMSNorm of Q and of K (`head_dim` each; qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: NormWeights,
    pub w_gate: Option<WeightRef>, // [n_ff, d_model]
    pub w_up: WeightRef,           // [n_ff, d_model]
    pub b_up: Option<Vec<f32>>,
    pub w_down: WeightRef, // [d_model, n_ff]
    pub b_down: Option<Vec<f32>>,
    /// Norms of the attention block's and the MLP's outputs (Gemma).
    pub post_attn_norm: Option<NormWeights>,
    pub post_ffn_norm: Option<NormWeights>,
}

impl LayerWeights {
    /// The block's matrices (each read once by a dense step).
    pub fn matrices(&self) -> impl Iterator<Item = &WeightRef> {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_up,
            &self.w_down,
        ]
        .into_iter()
        .chain(&self.w_gate)
    }
    pub fn matrices_mut(&mut self) -> impl Iterator<Item = &mut WeightRef> {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_up,
            &mut self.w_down,
        ]
        .into_iter()
        .chain(self.w_gate.as_mut())
    }
}

/// Where the weights live.
pub enum Source {
    Gguf(GgufFile),
    Hf(HfCheckpoint),
    /// Random weights built in memory, one buffer per tensor (see `model::synthetic`).
    Synthetic(Synthetic),
}

impl Source {
    fn bytes(&self, file: usize) -> &[u8] {
        match self {
            Source::Gguf(f) => f.bytes(),
            Source::Hf(c) => c.shards[file].bytes(),
            Source::Synthetic(s) => &s.buffers[file],
        }
    }
    fn owner(&self, file: usize) -> SharedBytes {
        match self {
            Source::Gguf(f) => f.shared(),
            Source::Hf(c) => c.shards[file].shared(),
            Source::Synthetic(s) => s.buffers[file].clone(),
        }
    }
    /// How many files [`Self::files`] lists.
    fn count(&self) -> usize {
        match self {
            Source::Gguf(_) => 1,
            Source::Hf(c) => c.shards.len(),
            Source::Synthetic(s) => s.buffers.len(),
        }
    }
    fn files(&self) -> Vec<&[u8]> {
        match self {
            Source::Gguf(f) => vec![f.bytes()],
            Source::Hf(c) => c.shards.iter().map(|s| s.bytes()).collect(),
            Source::Synthetic(s) => s.buffers.iter().map(|b| &b[..]).collect(),
        }
    }
}

pub struct Model {
    /// The GGUF file or the checkpoint directory.
    pub path: PathBuf,
    pub source: Source,
    pub config: ModelConfig,
    pub token_embd: WeightRef, // [vocab, d_embed]
    /// Learned positions (OPT): `[n_positions + offset, d_model]`.
    pub pos_embd: Option<WeightRef>,
    /// `[d_model, d_embed]` and `[d_embed, d_model]` when `d_embed != d_model`.
    pub proj_in: Option<WeightRef>,
    pub proj_out: Option<WeightRef>,
    pub output_norm: Option<NormWeights>,
    /// `output.weight`, or the token embedding when tied. `[vocab, d_embed]`
    pub output: WeightRef,
    /// Each RoPE pair's frequency divisor under Llama 3's scaling (a GGUF's `rope_freqs.weight`,
    /// or computed from a checkpoint's `rope_scaling`).
    pub rope_factors: Option<Vec<f32>>,
    pub layers: Vec<LayerWeights>,
    key: super::content_key::ContentKey,
    /// The repacked matrices of a mapped model (see `Model::repack`), in one anonymous buffer.
    pub(crate) converted: Option<std::sync::Arc<memmap2::MmapMut>>,
    /// A checkpoint's tensors whose data was not aligned in its shard, copied (file
    /// `source.files().len()`; see `table::copy_misaligned`).
    copied: Option<std::sync::Arc<memmap2::MmapMut>>,
}

impl Model {
    /// A GGUF file, or a Hugging Face checkpoint directory.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::MissingFile(path.to_path_buf()));
        }
        if path.is_dir() {
            if !HfCheckpoint::is_checkpoint(path) {
                return Err(Error::Invalid(format!(
                    "{} is a directory without config.json (expected a Hugging Face checkpoint)",
                    path.display()
                )));
            }
            let ckpt = HfCheckpoint::open(path)?;
            let (config, map) = arch::from_hf(&ckpt.config)?;
            let mut table = HashMap::new();
            for (name, t) in &ckpt.tensors {
                if let Some(canonical) = map(name) {
                    let e = Entry::hf(&t.info, t.shard, name);
                    if table.insert(canonical.clone(), e).is_some() {
                        return Err(Error::BadTensor {
                            tensor: canonical,
                            reason: "two checkpoint tensors map to it".into(),
                        });
                    }
                }
            }
            // Before `unfuse`, so that a fused matrix's row ranges view the copy.
            let source = Source::Hf(ckpt);
            let copied = table::copy_misaligned(&mut table, &source.files())?;
            unfuse(&mut table, &config)?;
            return Self::build(path, source, config, &table, copied);
        }
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file.header)?;
        let mut table = file
            .header
            .tensors
            .iter()
            .map(|t| (t.name.clone(), Entry::gguf(t, 0)))
            .collect();
        unfuse(&mut table, &config)?;
        Self::build(path, Source::Gguf(file), config, &table, None)
    }

    /// A synthetic model (`synthetic:NAME`, see `model::synthetic`), built in memory.
    pub fn synthetic(shape: &'static Shape, options: SyntheticOptions) -> Result<Self> {
        let (config, specs, synth) = synthetic::build(shape, options)?;
        let table = specs
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), Entry::memory(i, t)))
            .collect();
        let path = PathBuf::from(format!("{}{}", synthetic::PREFIX, shape.name));
        Self::build(&path, Source::Synthetic(synth), config, &table, None)
    }

    /// The synthetic model's weights, if it is one.
    pub fn synthetic_source(&self) -> Option<&Synthetic> {
        match &self.source {
            Source::Synthetic(s) => Some(s),
            _ => None,
        }
    }

    /// How outputs name the model: the file name, or a synthetic model's label.
    pub fn label(&self) -> String {
        match &self.source {
            Source::Synthetic(s) => s.label(),
            _ => {
                (self.path.file_name()).map_or("model".into(), |f| f.to_string_lossy().into_owned())
            }
        }
    }

    /// The model of `table`'s entries in `source`'s files, and in `copied` (file
    /// `source.files().len()`: [`table::copy_misaligned`]).
    fn build(
        path: &Path,
        source: Source,
        config: ModelConfig,
        table: &Tensors,
        copied: Option<std::sync::Arc<memmap2::MmapMut>>,
    ) -> Result<Self> {
        let c = &config;
        let mut files = source.files();
        files.extend(copied.as_deref().map(|c| &c[..]));
        // Counts from the file size allocations only once the file can hold them: a layer
        // needs tensors of its own.
        if c.n_layers > table.len() {
            return Err(Error::Invalid(format!(
                "the configuration has {} layers, but the file holds only {} tensors",
                c.n_layers,
                table.len()
            )));
        }
        let t = Table {
            table,
            files: &files,
            c,
            used: Default::default(),
        };
        let (d, q_dim, kv, ff, vocab, de) = (
            c.d_model,
            c.n_heads * c.head_dim,
            c.kv_dim(),
            c.n_ff,
            c.vocab_size,
            c.d_embed,
        );
        let g = |name: GlobalTensor, shape| t.weight(&name.name(), shape);
        let token_embd = g(GlobalTensor::TokenEmbd, [vocab, de])?;
        let output = match c.tied_output {
            true => token_embd.clone(),
            false => g(GlobalTensor::Output, [vocab, de])?,
        };
        let pos_embd = match c.positions {
            Positions::Learned { offset } => Some(g(
                GlobalTensor::PositionEmbd,
                [c.context_length + offset, d],
            )?),
            Positions::Rope { .. } => None,
        };
        let (proj_in, proj_out) = match de != d {
            true => (
                Some(g(GlobalTensor::ProjIn, [d, de])?),
                Some(g(GlobalTensor::ProjOut, [de, d])?),
            ),
            false => (None, None),
        };
        let output_norm = match c.final_norm {
            true => Some(t.norm(
                &GlobalTensor::OutputNorm.name(),
                &GlobalTensor::OutputNormBias.name(),
            )?),
            false => None,
        };
        let rope_factors = match (c.rope(), c.rope_scaling) {
            (Some(_), _) if t.table.contains_key(&GlobalTensor::RopeFreqs.name()) => {
                Some(t.vector(&GlobalTensor::RopeFreqs.name(), c.head_dim / 2)?)
            }
            (Some((theta, _)), Some(s)) => Some(s.factors(theta, c.head_dim)),
            _ => None,
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let w = |name: LayerTensor, shape| t.weight(&name.name(l), shape);
            let bias = |on: bool, name: LayerTensor, n| match on {
                true => t.vector(&name.name(l), n).map(Some),
                false => Ok(None),
            };
            let norm = |w: LayerTensor, b: LayerTensor| t.norm(&w.name(l), &b.name(l));
            // RMSNorm gains, stored as `w - 1` by Gemma checkpoints.
            let gains = |on: bool, name: LayerTensor, n| match on {
                true => t.gains(&name.name(l), n).map(Some),
                false => Ok(None),
            };
            let post = |w: LayerTensor| match c.post_norms {
                true => t.norm(&w.name(l), "").map(Some),
                false => Ok(None),
            };
            layers.push(LayerWeights {
                attn_norm: norm(LayerTensor::AttnNorm, LayerTensor::AttnNormBias)?,
                wq: w(LayerTensor::AttnQ, [q_dim, d])?,
                wk: w(LayerTensor::AttnK, [kv, d])?,
                wv: w(LayerTensor::AttnV, [kv, d])?,
                bq: bias(c.qkv_bias, LayerTensor::AttnQBias, q_dim)?,
                bk: bias(c.qkv_bias, LayerTensor::AttnKBias, kv)?,
                bv: bias(c.qkv_bias, LayerTensor::AttnVBias, kv)?,
                wo: w(LayerTensor::AttnOutput, [d, q_dim])?,
                bo: bias(c.out_bias, LayerTensor::AttnOutputBias, d)?,
                q_norm: gains(c.qk_norm, LayerTensor::AttnQNorm, c.head_dim)?,
                k_norm: gains(c.qk_norm, LayerTensor::AttnKNorm, c.head_dim)?,
                ffn_norm: norm(LayerTensor::FfnNorm, LayerTensor::FfnNormBias)?,
                w_gate: match c.mlp.gated() {
                    true => Some(w(LayerTensor::FfnGate, [ff, d])?),
                    false => None,
                },
                w_up: w(LayerTensor::FfnUp, [ff, d])?,
                b_up: bias(c.mlp_bias, LayerTensor::FfnUpBias, ff)?,
                w_down: w(LayerTensor::FfnDown, [d, ff])?,
                b_down: bias(c.mlp_bias, LayerTensor::FfnDownBias, d)?,
                post_attn_norm: post(LayerTensor::AttnPostNorm)?,
                post_ffn_norm: post(LayerTensor::FfnPostNorm)?,
            });
        }
        if c.tied_output {
            // A tied checkpoint may still store its (equal) output matrix.
            t.used.borrow_mut().insert(GlobalTensor::Output.name());
        }
        t.all_used()?;
        // A checkpoint's config is part of what the model computes (GGUF metadata is in the
        // file's first MiB).
        let (extra, paths) = match &source {
            Source::Hf(c) => (
                c.config.clone().into_bytes(),
                std::iter::once(c.dir.join("config.json"))
                    .chain(c.shards.iter().map(|s| s.path.clone()))
                    .collect(),
            ),
            Source::Gguf(f) => (Vec::new(), vec![f.path.clone()]),
            Source::Synthetic(s) => (
                format!("{} seed {}", s.label(), s.options.seed).into_bytes(),
                Vec::new(),
            ),
        };
        let key = super::content_key::ContentKey::new(paths, extra);
        let synthetic = matches!(source, Source::Synthetic(_));
        let model = Self {
            path: path.to_path_buf(),
            source,
            config,
            token_embd,
            pos_embd,
            proj_in,
            proj_out,
            output_norm,
            output,
            rope_factors,
            layers,
            key,
            converted: None,
            copied,
        };
        // Random synthetic weights are finite by construction (and can be tens of GB).
        if !synthetic {
            model.check_finite()?;
        }
        Ok(model)
    }

    /// Borrow a weight's bytes from the mapping (range and size were checked at load).
    pub fn weight(&self, w: &WeightRef) -> Weight<'_> {
        w.view(self.file_bytes(w.file))
    }

    /// The mapped file or buffer that holds `w`'s bytes (for [`Device::share_mat`]).
    ///
    /// [`Device::share_mat`]: dejavu_backend_api::Device::share_mat
    pub fn owner(&self, w: &WeightRef) -> SharedBytes {
        match (&self.converted, &self.copied, w.file) {
            (Some(c), _, CONVERTED) => c.clone(),
            (_, Some(c), f) if f == self.source.count() => c.clone(),
            _ => self.source.owner(w.file),
        }
    }

    /// Mapped file `file`, or the converted buffer.
    pub(crate) fn file_bytes(&self, file: usize) -> &[u8] {
        match (&self.converted, &self.copied, file) {
            (Some(c), _, CONVERTED) => c,
            (_, Some(c), f) if f == self.source.count() => c,
            _ => self.source.bytes(file),
        }
    }

    /// The mapped files (one GGUF, or the checkpoint's shards), and the converted buffer.
    pub fn mapped_files(&self) -> Vec<&[u8]> {
        let mut v = self.source.files();
        v.extend(self.copied.as_deref().map(|c| &c[..]));
        v.extend(self.converted.as_deref().map(|c| &c[..]));
        v
    }

    /// The GGUF header, for a GGUF model.
    pub fn gguf_header(&self) -> Option<&GgufHeader> {
        match &self.source {
            Source::Gguf(f) => Some(&f.header),
            Source::Hf(_) | Source::Synthetic(_) => None,
        }
    }

    /// Every matrix the executor reads (embedding and output included), for capability checks.
    pub fn matrices(&self) -> Vec<&WeightRef> {
        let mut v = vec![&self.token_embd, &self.output];
        v.extend(self.pos_embd.iter().chain(self.projections()));
        v.extend(self.layers.iter().flat_map(LayerWeights::matrices));
        v
    }

    pub(crate) fn projections(&self) -> impl Iterator<Item = &WeightRef> {
        self.proj_in.iter().chain(&self.proj_out)
    }

    /// Bytes of weights one dense decode step reads (every matrix once, plus one embedding row
    /// and one position row).
    pub fn dense_bytes_per_token(&self) -> usize {
        let row = |w: &WeightRef| w.qtype.row_bytes(w.cols);
        let whole: usize = (self.layers.iter().flat_map(LayerWeights::matrices))
            .chain(self.projections())
            .chain([&self.output])
            .map(|w| w.n_bytes)
            .sum();
        whole + row(&self.token_embd) + self.pos_embd.as_ref().map_or(0, row)
    }

    /// The content hash of the weights (every byte of every file, and a checkpoint's
    /// `config.json`; a synthetic model's label and seed): what files derived from the model are
    /// keyed on (see `model::content_key`). Computed on first use.
    pub fn fingerprint(&self) -> &str {
        self.key.hash(&self.key_bytes())
    }

    /// The files' stamp at load (see `model::content_key`), recorded beside the fingerprint.
    pub fn stamp(&self) -> &str {
        self.key.stamp()
    }

    /// Whether a derived file that recorded (`fingerprint`, `stamp`) was built from these weights.
    pub fn built_from_this(&self, fingerprint: &str, stamp: &str) -> bool {
        self.key.matches(&self.key_bytes(), fingerprint, stamp)
    }

    fn key_bytes(&self) -> Vec<&[u8]> {
        match &self.source {
            // Generated from its label and seed, which the key's extra bytes hold.
            Source::Synthetic(_) => Vec::new(),
            s => s.files(),
        }
    }

    /// Where a file derived from the model is cached: in dejavu's cache directory
    /// (`$DEJAVU_HOME/<kind>/`), named by the model's file and a hash of its canonical path, never
    /// in the model's own directory (which may be read-only or shared). Content is checked on
    /// load, not trusted by name (`model::content_key`). A synthetic model's go to the temporary
    /// directory (nothing is cached for one: its layout and predictors are generated).
    pub fn cache_path(&self, kind: &str, suffix: &str) -> PathBuf {
        if let Source::Synthetic(_) = &self.source {
            return self.derived_path(suffix);
        }
        let canonical = self
            .path
            .canonicalize()
            .unwrap_or_else(|_| self.path.clone());
        let key = xxhash_rust::xxh3::xxh3_64(canonical.as_os_str().as_encoded_bytes());
        let label = self.label().replace(['/', ':', ' '], "-");
        crate::fetch::home_dir()
            .join(kind)
            .join(format!("{label}-{key:016x}.{suffix}"))
    }

    /// Where earlier versions cached a derived file: beside a GGUF (`model.gguf.<suffix>`), or
    /// inside a checkpoint directory (`dejavu.<suffix>`); for a synthetic model, in the temporary
    /// directory.
    pub fn derived_path(&self, suffix: &str) -> PathBuf {
        match &self.source {
            Source::Hf(_) => self.path.join(format!("dejavu.{suffix}")),
            Source::Synthetic(s) => {
                std::env::temp_dir().join(format!("dejavu-synthetic-{}.{suffix}", s.shape.name))
            }
            Source::Gguf(_) => {
                let mut name = self.path.file_name().unwrap_or_default().to_os_string();
                name.push(format!(".{suffix}"));
                self.path.with_file_name(name)
            }
        }
    }
}

/// The GGUF type of an engine type (the inverse of the loader's mapping).
pub fn ggml_type(q: QuantType) -> GgmlType {
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
        QuantType::Q5_1 => GgmlType::Q5_1,
        QuantType::Q2K => GgmlType::Q2K,
        QuantType::Q3K => GgmlType::Q3K,
        QuantType::Q5K => GgmlType::Q5K,
        QuantType::IQ4NL => GgmlType::IQ4NL,
        QuantType::IQ4XS => GgmlType::IQ4XS,
    }
}
