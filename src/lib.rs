//! dejavu: a CPU-first LLM inference engine built for contextual sparsity (Deja Vu, Liu et al. 2023).
//!
//! The tree follows the flow of a decode step:
//! - [`engine`]: a model file or Hugging Face directory mapped and validated into a typed
//!   [`engine::config::ModelConfig`] and weight views ([`engine::weights`]), one file per
//!   architecture family ([`engine::arch`]), the KV cache, and the layer executor that runs a
//!   [`sparsity::SparsePlan`] on a [`dejavu_backend_api::Backend`] (dense = full sets);
//! - [`sparsity`]: the plan, the policies that build it per token, Deja Vu's predictors and their
//!   file, the sparse weight layout, lookahead and calibration;
//! - [`eval`]: perplexity, bench, the frontier report;
//! - [`text`]: tokenizer and chat template, sampling, generation;
//! - [`quantize`]: any loaded model written as a GGUF of one weight type.
//!
//! The command line is the thin binary in `src/bin/dejavu/`.

pub mod engine;
mod error;
pub mod eval;
pub mod fetch;
pub mod fsio;
pub mod progress;
pub mod quantize;
pub mod serve;
pub mod sparsity;
pub mod text;

pub use error::{Error, Result};
