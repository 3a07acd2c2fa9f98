//! Synthetic models at the paper's shapes, for speed only: `--model synthetic:opt-6.7b`.
//!
//! The Deja Vu paper measures latency on random weights; so do we. The weights are seeded random
//! numbers at Hugging Face's initialisation (every matrix `N(0, 0.02)`, biases 0, norm gains 1),
//! built directly in memory in the file type asked for (f16, bf16, Q8_0, Q4_0 and the K-quant
//! mixes Q4_K_S/M, Q5_K_S/M, Q6_K), each matrix in the type `llama-quantize` gives it in that
//! file type (`quantize::mix`: the output head in Q6_K, some `attn_v` and `ffn_down` in Q6_K under
//! Q4_K_M, ...), quantized with one pass of rounding (ggml's for the 32-wide types). They come with random low-rank predictors of a configurable rank, so every
//! policy runs its real selection path and pays its real cost. Nothing computed on them means
//! anything: every output that names the model says `synthetic`, and `perplexity` and
//! `calibrate` refuse them.
//!
//! Element `(r, c)` of a matrix is a pure function of the seed, the tensor's name and `r * cols +
//! c` (a counter-based generator), so the sparse layout's transposed matrices are generated as the
//! exact transposes of the model's, not converted (see `layout_bytes`).
use crate::model::arch;
use crate::model::config::ModelConfig;
use crate::model::names::{GlobalTensor, LayerTensor};
use crate::quantize::mix::{FileType, Mix};
use crate::{Error, Result};
use dejavu_backend_api::quantize::quantize_row_absmax;
use dejavu_backend_api::QuantType;
use memmap2::MmapMut;

/// What `--model` names start with.
pub const PREFIX: &str = "synthetic:";

/// Hugging Face's `initializer_range` / `init_std` for OPT and llama.
const INIT_STD: f32 = 0.02;

/// A model shape (the published configs).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub name: &'static str,
    /// SwiGLU llama (else OPT: learned positions, LayerNorm, biases, ReLU fc1/fc2, tied head).
    llama: bool,
    d_model: usize,
    n_layers: usize,
    n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    n_kv_heads: usize,
    n_ff: usize,
    vocab: usize,
    context: usize,
    rope_theta: f64,
}

const fn opt(name: &'static str, d: usize, l: usize, h: usize) -> Shape {
    Shape {
        name,
        llama: false,
        d_model: d,
        n_layers: l,
        n_heads: h,
        n_kv_heads: h,
        n_ff: 4 * d,
        vocab: 50272,
        context: 2048,
        rope_theta: 0.0,
    }
}

/// A SwiGLU llama of the published config: `(d, layers, heads, kv heads, ffn, vocab, context,
/// RoPE base)`.
#[allow(clippy::too_many_arguments)]
const fn llama(
    name: &'static str,
    d: usize,
    l: usize,
    h: usize,
    kv: usize,
    ff: usize,
    vocab: usize,
    context: usize,
    rope_theta: f64,
) -> Shape {
    Shape {
        name,
        llama: true,
        d_model: d,
        n_layers: l,
        n_heads: h,
        n_kv_heads: kv,
        n_ff: ff,
        vocab,
        context,
        rope_theta,
    }
}

pub const SHAPES: [Shape; 10] = [
    opt("opt-125m", 768, 12, 12),
    opt("opt-1.3b", 2048, 24, 32),
    opt("opt-6.7b", 4096, 32, 32),
    opt("opt-13b", 5120, 40, 40),
    opt("opt-30b", 7168, 48, 56),
    opt("opt-66b", 9216, 64, 72),
    opt("opt-175b", 12288, 96, 96),
    llama("llama-7b", 4096, 32, 32, 32, 11008, 32000, 2048, 10000.0),
    llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    // Grouped-query attention (32 query heads over 8 KV heads), the 128256-token vocabulary.
    llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
];

/// How a synthetic model is built.
#[derive(Debug, Clone, Copy)]
pub struct SyntheticOptions {
    /// The file type whose per-tensor mix the matrices take (one of [`DTYPES`]).
    pub dtype: FileType,
    /// Rank of the synthetic MLP and head predictors (default: [`default_rank`]).
    pub predictor_rank: Option<usize>,
    pub seed: u64,
}

impl Default for SyntheticOptions {
    fn default() -> Self {
        Self {
            dtype: FileType::F16,
            predictor_rank: None,
            seed: 0,
        }
    }
}

/// The file types a synthetic model can be built in: those people download (the types with a
/// one-pass rounding; `quantize` writes the others from a real model).
pub const DTYPES: [FileType; 9] = [
    FileType::F16,
    FileType::BF16,
    FileType::Q8_0,
    FileType::Q4_0,
    FileType::Q4KS,
    FileType::Q4KM,
    FileType::Q5KS,
    FileType::Q5KM,
    FileType::Q6K,
];

/// [`DTYPES`]' names, for messages.
pub fn dtype_names() -> String {
    DTYPES.map(|f| f.name()).join(", ")
}

/// The shape a `synthetic:NAME` model argument names (`None`: not a synthetic name; an unknown
/// NAME is an error listing the known ones).
pub fn parse(arg: &str) -> Option<Result<&'static Shape>> {
    let name = arg.strip_prefix(PREFIX)?;
    Some(SHAPES.iter().find(|s| s.name == name).ok_or_else(|| {
        let known: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        Error::Invalid(format!(
            "unknown synthetic model `{name}` (known: {})",
            known.join(", ")
        ))
    }))
}

/// The predictor rank used when none is given: `d_model / 16`, rounded up to a block of 32,
/// within 32..=1024 (opt-6.7b: 256; the paper's OPT-175B predictors: 1000 for d = 12288). At 10%
/// density a predictor of this rank reads about a third of the selected MLP rows' bytes.
pub fn default_rank(d_model: usize) -> usize {
    (d_model / 16).div_ceil(32).clamp(1, 32) * 32
}

impl Shape {
    /// The shape as a Hugging Face `config.json`, parsed by the same code as a real checkpoint's.
    fn config(&self) -> Result<ModelConfig> {
        let text = if self.llama {
            serde_json::json!({
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": self.d_model,
                "intermediate_size": self.n_ff,
                "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads,
                "vocab_size": self.vocab,
                "max_position_embeddings": self.context,
                "rms_norm_eps": 1e-5,
                "rope_theta": self.rope_theta,
                "hidden_act": "silu",
                "tie_word_embeddings": false,
            })
        } else {
            serde_json::json!({
                "architectures": ["OPTForCausalLM"],
                "hidden_size": self.d_model,
                "ffn_dim": self.n_ff,
                "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads,
                "vocab_size": self.vocab,
                "max_position_embeddings": self.context,
                "do_layer_norm_before": true,
                "word_embed_proj_dim": self.d_model,
                "activation_function": "relu",
            })
        };
        Ok(arch::from_hf(&text.to_string())?.0)
    }
}

/// One tensor to generate: canonical name, type, `[rows, cols]`, and how to fill it.
#[derive(Debug, Clone)]
pub(crate) struct TensorSpec {
    pub name: String,
    pub qtype: QuantType,
    pub shape: [usize; 2],
    fill: Fill,
}

impl TensorSpec {
    /// Bytes of the tensor in its type.
    pub fn n_bytes(&self) -> usize {
        self.shape[0] * self.qtype.row_bytes(self.shape[1])
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    Random,
    Zeros,
    Ones,
}

/// Every tensor of a model of config `c`, as the loader will look them up; each matrix in the type
/// `llama-quantize` gives it in file type `ftype` (in its file order: layer by layer).
fn tensors(c: &ModelConfig, ftype: FileType) -> Vec<TensorSpec> {
    let (d, q_dim, kv, ff, vocab) = (
        c.d_model,
        c.n_heads * c.head_dim,
        c.kv_dim(),
        c.n_ff,
        c.vocab_size,
    );
    let gqa = c.n_heads / c.n_kv_heads.max(1);
    let mut mix = Mix::new(ftype, false, false, c.tied_output, gqa, c.n_layers);
    let mut v = Vec::new();
    // A type, or (`None`) a matrix: the mix's type for it.
    let mut push = |name: String, qtype: Option<QuantType>, shape: [usize; 2], fill| {
        let qtype = qtype.unwrap_or_else(|| mix.tensor_type(&name, shape[1]));
        v.push(TensorSpec {
            name,
            qtype,
            shape,
            fill,
        })
    };
    let f32v = Some(QuantType::F32);
    push(
        GlobalTensor::TokenEmbd.name(),
        None,
        [vocab, d],
        Fill::Random,
    );
    if !c.tied_output {
        push(GlobalTensor::Output.name(), None, [vocab, d], Fill::Random);
    }
    if let crate::model::config::Positions::Learned { offset } = c.positions {
        let rows = c.context_length + offset;
        push(
            GlobalTensor::PositionEmbd.name(),
            f32v,
            [rows, d],
            Fill::Random,
        );
    }
    let layer_norm = c.norm == crate::model::config::NormKind::Layer;
    if c.final_norm {
        push(GlobalTensor::OutputNorm.name(), f32v, [1, d], Fill::Ones);
        if layer_norm {
            push(
                GlobalTensor::OutputNormBias.name(),
                f32v,
                [1, d],
                Fill::Zeros,
            );
        }
    }
    for l in 0..c.n_layers {
        let mut m = |t: LayerTensor, shape| push(t.name(l), None, shape, Fill::Random);
        m(LayerTensor::AttnQ, [q_dim, d]);
        m(LayerTensor::AttnK, [kv, d]);
        m(LayerTensor::AttnV, [kv, d]);
        m(LayerTensor::AttnOutput, [d, q_dim]);
        m(LayerTensor::FfnUp, [ff, d]);
        m(LayerTensor::FfnDown, [d, ff]);
        if c.mlp.gated() {
            m(LayerTensor::FfnGate, [ff, d]);
        }
        let mut vec = |t: LayerTensor, n, fill| push(t.name(l), f32v, [1, n], fill);
        vec(LayerTensor::AttnNorm, d, Fill::Ones);
        vec(LayerTensor::FfnNorm, d, Fill::Ones);
        if layer_norm {
            vec(LayerTensor::AttnNormBias, d, Fill::Zeros);
            vec(LayerTensor::FfnNormBias, d, Fill::Zeros);
        }
        if c.qkv_bias {
            vec(LayerTensor::AttnQBias, q_dim, Fill::Zeros);
            vec(LayerTensor::AttnKBias, kv, Fill::Zeros);
            vec(LayerTensor::AttnVBias, kv, Fill::Zeros);
        }
        if c.out_bias {
            vec(LayerTensor::AttnOutputBias, d, Fill::Zeros);
        }
        if c.mlp_bias {
            vec(LayerTensor::FfnUpBias, ff, Fill::Zeros);
            vec(LayerTensor::FfnDownBias, d, Fill::Zeros);
        }
    }
    v
}

/// The weights of a synthetic model: one anonymous mapping per tensor (advised to use huge pages,
/// as the sparse layout is).
pub struct Synthetic {
    pub shape: &'static Shape,
    pub options: SyntheticOptions,
    pub(crate) buffers: Vec<std::sync::Arc<MmapMut>>,
}

impl Synthetic {
    /// A label for outputs: `synthetic:opt-6.7b (random weights, q8_0)`.
    pub fn label(&self) -> String {
        format!(
            "{PREFIX}{} (synthetic random weights, {})",
            self.shape.name,
            self.options.dtype.name()
        )
    }

    /// The random weights of layer `l`'s low-rank predictor (`what`: `mlp` or `heads`) of shape
    /// `(d, n_out)` at the configured rank: the rank, and the Q8_0 rows of `w1` (`rank x d`)
    /// and of `w2` (`n_out x rank`). Speed only: they select real sets of no meaning.
    pub fn predictor_weights(
        &self,
        l: usize,
        what: &str,
        d: usize,
        n_out: usize,
    ) -> Result<(usize, Vec<u8>, Vec<u8>)> {
        let rank = self
            .options
            .predictor_rank
            .unwrap_or_else(|| default_rank(d));
        if rank == 0 || !rank.is_multiple_of(32) {
            return Err(Error::Invalid(format!(
                "predictor rank {rank} must be a positive multiple of 32"
            )));
        }
        let q = QuantType::Q8_0;
        let gen = |name: String, rows, cols| {
            let mut out = vec![0u8; rows * q.row_bytes(cols)];
            fill_rows(
                &mut out,
                q,
                cols,
                key(self.options.seed, &name),
                (1.0 / cols as f32).sqrt(),
            );
            out
        };
        let w1 = gen(format!("blk.{l}.{what}.w1"), rank, d);
        let w2 = gen(format!("blk.{l}.{what}.w2"), n_out, rank);
        Ok((rank, w1, w2))
    }
}

/// The bytes a synthetic model of `shape` takes in `dtype`.
pub fn model_bytes(shape: &Shape, dtype: FileType) -> Result<usize> {
    let c = shape.config()?;
    Ok(tensors(&c, dtype).iter().map(TensorSpec::n_bytes).sum())
}

/// Build the config, the tensor list and every tensor's bytes (in parallel over rows, with a
/// progress bar). Refuses before allocating when the machine lacks the memory.
pub(crate) fn build(
    shape: &'static Shape,
    options: SyntheticOptions,
) -> Result<(ModelConfig, Vec<TensorSpec>, Synthetic)> {
    if !DTYPES.contains(&options.dtype) {
        return Err(Error::Invalid(format!(
            "synthetic models are built in {}, not {}",
            dtype_names(),
            options.dtype.name()
        )));
    }
    let c = shape.config()?;
    let specs = tensors(&c, options.dtype);
    let total: usize = specs.iter().map(TensorSpec::n_bytes).sum();
    if let Some(avail) = crate::memstat::available() {
        if total > avail {
            return Err(Error::Invalid(format!(
                "{PREFIX}{} in {} needs {:.1} GiB; this machine has {:.1} GiB available",
                shape.name,
                options.dtype.name(),
                total as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            )));
        }
    }
    let bar = crate::progress::bytes_bar(total as u64, &format!("building {PREFIX}{}", shape.name));
    let mut buffers = Vec::with_capacity(specs.len());
    for t in &specs {
        let cols = t.shape[1];
        let mut m = crate::memstat::huge_zeroed(t.n_bytes())?;
        let value = match t.fill {
            Fill::Random => None,
            Fill::Zeros => Some(0.0),
            Fill::Ones => Some(1.0),
        };
        match value {
            None => fill_rows(&mut m, t.qtype, cols, key(options.seed, &t.name), INIT_STD),
            Some(v) => {
                let mut row = Vec::new();
                quantize_row_absmax(t.qtype, &vec![v; cols], &mut row)
                    .ok_or_else(|| Error::Invalid(format!("{}: bad row length", t.name)))?;
                m.chunks_exact_mut(row.len())
                    .for_each(|r| r.copy_from_slice(&row));
            }
        }
        bar.inc(t.n_bytes() as u64);
        buffers.push(std::sync::Arc::new(m));
    }
    bar.finish_and_clear();
    let synth = Synthetic {
        shape,
        options,
        buffers,
    };
    Ok((c, specs, synth))
}

/// A sparse layout's transposed matrix (`rows x cols` in `qtype`, into `out`), generated from
/// the same elements as the model's tensor `name` (`cols x rows`): row `j` of `ffn_down_t` is
/// column `j` of `ffn_down`; likewise W_o and the input-major projections.
pub(crate) fn transposed(
    synth: &Synthetic,
    name: &str,
    [rows, cols]: [usize; 2],
    qtype: QuantType,
    out: &mut [u8],
) {
    // The source is `cols x rows`: element (i, j) of the source is at i * rows + j.
    let k = key(synth.options.seed, name);
    assert_eq!(out.len(), rows * qtype.row_bytes(cols), "transposed: size");
    parallel_rows(out, qtype.row_bytes(cols), |j, dst| {
        let row: Vec<f32> = (0..cols)
            .map(|i| INIT_STD * gauss(k, (i * rows + j) as u64))
            .collect();
        quantize_into(qtype, &row, dst);
    });
}

/// Fill `out` (rows of `cols` elements of `qtype`) with `std * N(0, 1)` elements of generator `k`.
fn fill_rows(out: &mut [u8], qtype: QuantType, cols: usize, k: u64, std: f32) {
    parallel_rows(out, qtype.row_bytes(cols), |r, dst| {
        let row: Vec<f32> = (0..cols)
            .map(|c| std * gauss(k, (r * cols + c) as u64))
            .collect();
        quantize_into(qtype, &row, dst);
    });
}

fn quantize_into(qtype: QuantType, row: &[f32], dst: &mut [u8]) {
    let mut bytes = Vec::with_capacity(dst.len());
    quantize_row_absmax(qtype, row, &mut bytes).expect("rows are whole blocks of a writable type");
    dst.copy_from_slice(&bytes);
}

/// Run `f(row index, row bytes)` over the rows of `out`, split evenly over the cores.
fn parallel_rows(out: &mut [u8], row_bytes: usize, f: impl Fn(usize, &mut [u8]) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows = out.len() / row_bytes;
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(per * row_bytes).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (i, dst) in chunk.chunks_exact_mut(row_bytes).enumerate() {
                    f(t * per + i, dst);
                }
            });
        }
    });
}

/// The generator key of tensor `name` under `seed` (FNV-1a of the name, mixed with the seed).
fn key(seed: u64, name: &str) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Element `i` of generator `k`: approximately `N(0, 1)` (the sum of four 16-bit uniforms of one
/// SplitMix64 output, Irwin-Hall, scaled to unit variance; bounded by +-3.46).
fn gauss(k: u64, i: u64) -> f32 {
    let mut z = k.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let s = (z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48);
    // Four uniforms on [0, 1]: mean 2, variance 1/3.
    (s as f32 / 65535.0 - 2.0) * 3f32.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ranks() {
        assert!(parse("model.gguf").is_none());
        assert!(parse("synthetic:opt-6.7b").unwrap().is_ok());
        assert!(parse("synthetic:opt-7b").unwrap().is_err());
        assert_eq!(default_rank(4096), 256);
        assert_eq!(default_rank(768), 64);
        assert_eq!(default_rank(12288), 768);
    }

    /// The generator has unit variance and zero mean, and differs between tensors.
    #[test]
    fn gauss_moments() {
        let n = 200_000u64;
        let (s, ss) = (0..n).fold((0f64, 0f64), |(a, b), i| {
            let v = gauss(key(1, "a"), i) as f64;
            (a + v, b + v * v)
        });
        assert!((s / n as f64).abs() < 0.01);
        assert!((ss / n as f64 - 1.0).abs() < 0.01);
        assert_ne!(gauss(key(1, "a"), 5), gauss(key(1, "b"), 5));
        assert_ne!(gauss(key(1, "a"), 5), gauss(key(2, "a"), 5));
    }

    /// Every published shape parses as a valid config, and the sizes are the known ones.
    #[test]
    fn shapes_are_valid() {
        for s in &SHAPES {
            s.config().unwrap();
        }
        let bytes = |name: &str| {
            let shape = parse(&format!("synthetic:{name}")).unwrap().unwrap();
            model_bytes(shape, FileType::F16).unwrap() as f64
        };
        // 6.66e9 weights in f16 (embedding, positions in f32, vectors).
        let b = bytes("opt-6.7b");
        assert!((13.0e9..13.7e9).contains(&b), "{b}");
        // Llama 2 7B: 6.74e9 weights; Llama 3 8B: 8.03e9 (GQA's K/V are a quarter of Q).
        let b = bytes("llama-2-7b");
        assert!((13.4e9..13.6e9).contains(&b), "{b}");
        let b = bytes("llama-3-8b");
        assert!((16.0e9..16.1e9).contains(&b), "{b}");
        let c = parse("synthetic:llama-3-8b")
            .unwrap()
            .unwrap()
            .config()
            .unwrap();
        assert_eq!((c.n_heads, c.n_kv_heads, c.vocab_size), (32, 8, 128256));
    }
}
