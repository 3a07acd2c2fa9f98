//! The model: a GGUF file, a Hugging Face checkpoint directory or a synthetic shape, mapped and
//! validated into a typed [`config::ModelConfig`] (parsed once, one file per architecture family
//! in [`arch`]), weight views ([`weights`], named as [`names`] says), the tokenizer its file
//! carries ([`tokenizer`]), and the load-time conversions ([`repack`]). Parsing only: nothing
//! here computes a forward pass (that is [`crate::exec`]).
pub mod arch;
pub mod config;
pub mod content_key;
pub mod finite;
pub mod names;
pub mod repack;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;
