//! Typed errors of the format readers: each names what was being read and where.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: the file is empty")]
    Empty { path: PathBuf },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2 and 3)")]
    UnsupportedVersion(u32),
    #[error(
        "truncated file while reading {what} at byte {offset}: need {need} bytes, {have} left"
    )]
    Truncated {
        what: String,
        offset: usize,
        need: u64,
        have: u64,
    },
    #[error("truncated or corrupt file: {what} {value} at byte {offset} is more than the rest of the file can hold")]
    Implausible {
        what: String,
        value: u64,
        offset: usize,
    },
    #[error("invalid UTF-8 in string at byte {offset}")]
    BadUtf8 { offset: usize },
    #[error("unknown metadata value type {type_id} at byte {offset}")]
    UnknownValueType { type_id: u32, offset: usize },
    #[error("tensor `{tensor}`: ggml type {} is not supported", crate::gguf::GgmlType::describe_id(*type_id))]
    UnknownGgmlType { tensor: String, type_id: u32 },
    #[error("tensor `{tensor}`: bad shape {dims:?}: {reason}")]
    BadShape {
        tensor: String,
        dims: Vec<u64>,
        reason: String,
    },
    #[error("tensor `{tensor}`: data [{start}, {end}) lies past the end of the file ({file_size} bytes)")]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error("tensor `{tensor}`: offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensors `{a}` and `{b}` overlap in the file")]
    Overlap { a: String, b: String },
    #[error("duplicate tensor name `{0}`")]
    DuplicateTensor(String),
    #[error("metadata `{key}`: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("safetensors: {0}")]
    Safetensors(String),
    #[error("PyTorch checkpoint: {0}")]
    Torch(String),
}
