//! Every GGUF metadata key and tensor name the engine reads, in one place. These are also the
//! engine's canonical tensor names: a Hugging Face checkpoint's tensors are renamed to them on
//! load (see `model::arch`), and `dejavu quantize` writes them.
//!
//! llama.cpp has names for everything of llama and qwen2. For what it has none (OPT, the MLP
//! activation of ReLU llamas) the keys below follow its pattern; the README lists them.

/// Per-architecture metadata keys: the file stores them as `{arch}.{suffix}`.
#[derive(Debug, Clone, Copy)]
pub enum ArchKey {
    BlockCount,
    EmbeddingLength,
    FeedForwardLength,
    HeadCount,
    HeadCountKv,
    ContextLength,
    RopeFreqBase,
    RopeDimensionCount,
    RmsEps,
    VocabSize,
    RopeScalingType,
    RopeScalingFactor,
    /// LayerNorm epsilon (llama.cpp's key for LayerNorm models).
    LayerNormEps,
    /// dejavu: `silu` (default) or `relu`, the MLP's activation.
    FeedForwardActivation,
    /// dejavu (OPT): pre-LN (true, default) or post-LN (false).
    LayerNormBefore,
    /// dejavu (OPT): width of the token embedding when it differs from the hidden size.
    EmbeddingProjection,
    /// Width of each key and value head (qwen3: may differ from the hidden size over the head
    /// count).
    KeyLength,
    ValueLength,
    /// Sliding-window attention's width (each query sees this many positions, itself
    /// included).
    SlidingWindow,
    /// The sliding-window layers: one flag a layer, or a period (Gemma).
    SlidingWindowPattern,
    /// Gemma 2's soft caps of the attention scores and of the final logits.
    AttnLogitSoftcap,
    FinalLogitSoftcap,
    /// RoPE's base on the sliding-window layers (Gemma 3).
    RopeFreqBaseSwa,
    /// Attention's score scale, where a model sets its own (Gemma's `query_pre_attn_scalar`).
    AttentionScale,
}

impl ArchKey {
    pub fn key(self, arch: &str) -> String {
        let suffix = match self {
            ArchKey::BlockCount => "block_count",
            ArchKey::EmbeddingLength => "embedding_length",
            ArchKey::FeedForwardLength => "feed_forward_length",
            ArchKey::HeadCount => "attention.head_count",
            ArchKey::HeadCountKv => "attention.head_count_kv",
            ArchKey::ContextLength => "context_length",
            ArchKey::RopeFreqBase => "rope.freq_base",
            ArchKey::RopeDimensionCount => "rope.dimension_count",
            ArchKey::RmsEps => "attention.layer_norm_rms_epsilon",
            ArchKey::VocabSize => "vocab_size",
            ArchKey::RopeScalingType => "rope.scaling.type",
            ArchKey::RopeScalingFactor => "rope.scaling.factor",
            ArchKey::LayerNormEps => "attention.layer_norm_epsilon",
            ArchKey::SlidingWindow => "attention.sliding_window",
            ArchKey::SlidingWindowPattern => "attention.sliding_window_pattern",
            ArchKey::AttnLogitSoftcap => "attn_logit_softcapping",
            ArchKey::FinalLogitSoftcap => "final_logit_softcapping",
            ArchKey::RopeFreqBaseSwa => "rope.freq_base_swa",
            ArchKey::AttentionScale => "attention.scale",
            ArchKey::FeedForwardActivation => "feed_forward_activation",
            ArchKey::LayerNormBefore => "layer_norm_before",
            ArchKey::EmbeddingProjection => "embedding_projection_length",
            ArchKey::KeyLength => "attention.key_length",
            ArchKey::ValueLength => "attention.value_length",
        };
        format!("{arch}.{suffix}")
    }
}

pub const ARCHITECTURE: &str = "general.architecture";
pub const TOK_MODEL: &str = "tokenizer.ggml.model";
pub const TOK_PRE: &str = "tokenizer.ggml.pre";
pub const TOK_TOKENS: &str = "tokenizer.ggml.tokens";
pub const TOK_TYPES: &str = "tokenizer.ggml.token_type";
pub const TOK_MERGES: &str = "tokenizer.ggml.merges";
/// SentencePiece vocabularies: each token's score.
pub const TOK_SCORES: &str = "tokenizer.ggml.scores";
/// The vocabulary arrays, which only the tokenizer reads (it keeps its own copy).
pub const VOCAB_KEYS: &[&str] = &[TOK_TOKENS, TOK_TYPES, TOK_MERGES, TOK_SCORES];
pub const TOK_UNK: &str = "tokenizer.ggml.unknown_token_id";
/// SentencePiece: put a `▁` before the text (default true).
pub const TOK_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
pub const TOK_BOS: &str = "tokenizer.ggml.bos_token_id";
pub const TOK_EOS: &str = "tokenizer.ggml.eos_token_id";
pub const TOK_EOT: &str = "tokenizer.ggml.eot_token_id";
pub const TOK_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
/// The whole Hugging Face `tokenizer.json` (GGUF's own key for it).
pub const TOK_HF_JSON: &str = "tokenizer.huggingface.json";
pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Tensors that appear once per model.
#[derive(Debug, Clone, Copy)]
pub enum GlobalTensor {
    TokenEmbd,
    /// Learned positions (OPT), `[n_positions + offset][d_model]`.
    PositionEmbd,
    OutputNorm,
    OutputNormBias,
    Output,
    /// OPT's `project_in` (`d_embed -> d_model`) and `project_out` (`d_model -> d_embed`).
    ProjIn,
    ProjOut,
    /// Llama 3: each RoPE pair's frequency divisor (`head_dim / 2` values, f32).
    RopeFreqs,
}

impl GlobalTensor {
    pub fn name(self) -> String {
        match self {
            GlobalTensor::TokenEmbd => "token_embd.weight",
            GlobalTensor::PositionEmbd => "position_embd.weight",
            GlobalTensor::OutputNorm => "output_norm.weight",
            GlobalTensor::OutputNormBias => "output_norm.bias",
            GlobalTensor::Output => "output.weight",
            GlobalTensor::ProjIn => "proj_in.weight",
            GlobalTensor::ProjOut => "proj_out.weight",
            GlobalTensor::RopeFreqs => "rope_freqs.weight",
        }
        .into()
    }
}

/// Tensors of each layer, named `blk.{layer}.{suffix}`.
#[derive(Debug, Clone, Copy)]
pub enum LayerTensor {
    AttnNorm,
    AttnNormBias,
    AttnQ,
    AttnK,
    AttnV,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutput,
    AttnOutputBias,
    /// qwen3: RMSNorm gains of each query and key head (`head_dim` wide).
    AttnQNorm,
    AttnKNorm,
    FfnNorm,
    FfnNormBias,
    FfnGate,
    FfnUp,
    FfnUpBias,
    FfnDown,
    FfnDownBias,
    /// Gemma: RMSNorm gains of the attention block's and the MLP's outputs.
    AttnPostNorm,
    FfnPostNorm,
}

impl LayerTensor {
    pub fn name(self, layer: usize) -> String {
        let s = match self {
            LayerTensor::AttnNorm => "attn_norm.weight",
            LayerTensor::AttnNormBias => "attn_norm.bias",
            LayerTensor::AttnQ => "attn_q.weight",
            LayerTensor::AttnK => "attn_k.weight",
            LayerTensor::AttnV => "attn_v.weight",
            LayerTensor::AttnQBias => "attn_q.bias",
            LayerTensor::AttnKBias => "attn_k.bias",
            LayerTensor::AttnVBias => "attn_v.bias",
            LayerTensor::AttnOutput => "attn_output.weight",
            LayerTensor::AttnOutputBias => "attn_output.bias",
            LayerTensor::AttnQNorm => "attn_q_norm.weight",
            LayerTensor::AttnKNorm => "attn_k_norm.weight",
            LayerTensor::FfnNorm => "ffn_norm.weight",
            LayerTensor::FfnNormBias => "ffn_norm.bias",
            LayerTensor::FfnGate => "ffn_gate.weight",
            LayerTensor::FfnUp => "ffn_up.weight",
            LayerTensor::FfnUpBias => "ffn_up.bias",
            LayerTensor::FfnDown => "ffn_down.weight",
            LayerTensor::AttnPostNorm => "post_attention_norm.weight",
            LayerTensor::FfnPostNorm => "post_ffw_norm.weight",
            LayerTensor::FfnDownBias => "ffn_down.bias",
        };
        format!("blk.{layer}.{s}")
    }
}
