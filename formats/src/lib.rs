//! Zero-copy readers for the weight file formats: GGUF (v2/v3), safetensors, PyTorch zips
//! (`torch.save`, through a pickle reader that never executes), and Hugging Face checkpoint
//! directories (sharded safetensors or PyTorch files).
//!
//! Contract: this crate turns bytes into named, typed, shaped *views* of a memory map. It never
//! computes on weights and never copies tensor data. Every offset and count read from a file is
//! checked against the file size with overflow-checked arithmetic before it is used, so a
//! malformed or hostile file yields a [`FormatError`], never a panic.

mod error;
pub mod gguf;
pub mod hf;
pub mod safetensors;
pub mod torch;

pub use error::FormatError;
pub use gguf::{GgmlType, GgufFile, MetaValue, TensorInfo};

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
