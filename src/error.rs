//! The engine's typed error. Every variant names what was wrong and where; the CLI prints it and
//! exits non-zero.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] dejavu_formats::FormatError),
    #[error("model file not found: {0}")]
    MissingFile(PathBuf),
    #[error("metadata key `{0}` is missing")]
    MissingKey(String),
    #[error("metadata key `{key}` is invalid: {reason}")]
    BadKey { key: String, reason: String },
    #[error("unsupported architecture `{0}` (supported: GGUF llama, qwen2, qwen3, phi3, gemma2, gemma3, opt; Hugging Face OPTForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)")]
    UnknownArchitecture(String),
    #[error("tensor `{0}` is missing")]
    MissingTensor(String),
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<u64>,
        got: Vec<u64>,
    },
    #[error("tensor `{tensor}`: unsupported weight type {qtype}")]
    UnsupportedType { tensor: String, qtype: String },
    #[error("tensor `{tensor}`: {reason}")]
    BadTensor { tensor: String, reason: String },
    #[error("prompt of {n_tokens} tokens does not fit the context window of {n_ctx} tokens")]
    ContextOverflow { n_tokens: usize, n_ctx: usize },
    #[error("invalid sparse plan: {0}")]
    BadPlan(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("fetching model: {0}")]
    Fetch(String),
    #[error("{0}")]
    Invalid(String),
    /// Out of a shared resource for now (the server's KV pool): retry later.
    #[error("{0}")]
    Busy(String),
    /// A batched sequence's caches went back to the KV pool while its slot was idle: what the
    /// slot remembers of them is gone.
    #[error("this sequence's KV cache went back to the pool")]
    Evicted,
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Backend(#[from] dejavu_backend_api::BackendError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
