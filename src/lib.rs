//! dejavu: a CPU-first LLM inference engine built for contextual sparsity (Deja Vu, Liu et al. 2023).
//!
//! Flow: [`model::Model`] maps a GGUF file and validates it into a typed [`config::ModelConfig`] and
//! weight views; [`executor::Executor`] runs the layer loop on a [`dejavu_backend_api::Backend`]
//! under a [`sparsity::SparsePlan`] (dense = full sets); [`generate`], [`perplexity`] and
//! [`sampling`] drive it; [`tokenizer`] builds the GGUF's own BPE tokenizer and chat template.

pub mod bench;
pub mod calibrate;
pub mod config;
pub mod engine;
mod error;
pub mod executor;
pub mod fetch;
pub mod generate;
pub mod layout;
pub mod lookahead;
pub mod memstat;
pub mod model;
pub mod names;
pub mod perplexity;
pub mod policy;
pub mod predictor;
pub mod predictors;
pub mod progress;
pub mod report;
pub mod sampling;
pub mod sparsity;
pub mod tokenizer;

pub use error::{Error, Result};
