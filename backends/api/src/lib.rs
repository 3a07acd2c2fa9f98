//! What every backend shares: the [`Backend`] trait (shaped by the executor's verbs), the quantized
//! block layouts ([`quant`]), weight views ([`Weight`]) and validated index sets ([`IndexSet`]).
//!
//! This crate is a leaf: it opens no files and depends on no other part of the engine.

mod backend;
mod device;
mod index_set;
pub mod quant;
pub mod quantize;
mod quantize_k;
mod quantize_search;

pub use backend::{
    input_block_table_bytes, Activation, AttnShape, Backend, BackendError, KvSlice, MatmulJob,
    RopeStyle, RowLayout, Scoring, Weight,
};
pub use device::{
    check_scale_cap, sparsify_ref, AttnGeom, Device, InputMask, LazyKv, Product, Rotary, Rows,
    SeqRow, SeqRows, SharedBytes, StepRow, TopK, MAX_ROWS,
};
pub use index_set::{IndexSet, IndexSetError};
pub use quant::QuantType;
