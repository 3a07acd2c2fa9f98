//! Every GGUF metadata key and tensor name the engine reads, in one place.

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
/// The vocabulary arrays, which only the tokenizer reads (it keeps its own copy).
pub const VOCAB_KEYS: &[&str] = &[TOK_TOKENS, TOK_TYPES, TOK_MERGES];
pub const TOK_BOS: &str = "tokenizer.ggml.bos_token_id";
pub const TOK_EOS: &str = "tokenizer.ggml.eos_token_id";
pub const TOK_EOT: &str = "tokenizer.ggml.eot_token_id";
pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Tensors that appear once per model.
#[derive(Debug, Clone, Copy)]
pub enum GlobalTensor {
    TokenEmbd,
    OutputNorm,
    Output,
}

impl GlobalTensor {
    pub fn name(self) -> String {
        match self {
            GlobalTensor::TokenEmbd => "token_embd.weight",
            GlobalTensor::OutputNorm => "output_norm.weight",
            GlobalTensor::Output => "output.weight",
        }
        .into()
    }
}

/// Tensors of each layer, named `blk.{layer}.{suffix}`.
#[derive(Debug, Clone, Copy)]
pub enum LayerTensor {
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutput,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
}

impl LayerTensor {
    pub fn name(self, layer: usize) -> String {
        let s = match self {
            LayerTensor::AttnNorm => "attn_norm.weight",
            LayerTensor::AttnQ => "attn_q.weight",
            LayerTensor::AttnK => "attn_k.weight",
            LayerTensor::AttnV => "attn_v.weight",
            LayerTensor::AttnQBias => "attn_q.bias",
            LayerTensor::AttnKBias => "attn_k.bias",
            LayerTensor::AttnVBias => "attn_v.bias",
            LayerTensor::AttnOutput => "attn_output.weight",
            LayerTensor::FfnNorm => "ffn_norm.weight",
            LayerTensor::FfnGate => "ffn_gate.weight",
            LayerTensor::FfnUp => "ffn_up.weight",
            LayerTensor::FfnDown => "ffn_down.weight",
        };
        format!("blk.{layer}.{s}")
    }
}
