//! dejavu: a CPU-first LLM inference engine built for contextual sparsity (Deja Vu, Liu et al. 2023).
//!
//! The tree follows the flow of a decode step, each layer using only those above it:
//! - [`model`]: a model file or Hugging Face directory mapped and validated into a typed
//!   [`model::config::ModelConfig`] and weight views ([`model::weights`]), one file per
//!   architecture family ([`model::arch`]), and its tokenizer;
//! - [`sparsity`]: the plan as data, the policies that build it per token, Deja Vu's predictors
//!   and their file, the sparse weight layout;
//! - [`exec`]: the one forward pass over any [`dejavu_backend_api::Device`] (the CPU, CUDA), its
//!   sessions, tensor parallelism, and the [`exec::Engine`] that holds a model on the CPU;
//! - [`text`] (chat template, sampling, generation), [`eval`] (perplexity, bench, reports),
//!   [`tune`] (calibration), [`quantize`];
//! - [`serve`]: the OpenAI-compatible server.
//!
//! The command line is the thin binary in `src/bin/dejavu/`.

mod error;
pub mod eval;
pub mod exec;
pub mod fetch;
pub mod fsio;
pub mod memstat;
pub mod model;
pub mod progress;
pub mod quantize;
pub mod serve;
pub mod sparsity;
pub mod text;
pub mod tune;

pub use error::{Error, Result};
