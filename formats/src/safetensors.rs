//! safetensors reader over a memory map (used for predictors and HF-layout weights).
//!
//! Layout: `u64 header_len`, a JSON header naming each tensor's dtype, shape and
//! `[begin, end)` byte range relative to the data section, then the data. The `safetensors` crate
//! validates the header (ranges in bounds, contiguous, sizes matching shapes); we keep only the
//! resulting table and borrow data from the mapping.
use crate::{FormatError, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use safetensors::Dtype;

#[derive(Debug, Clone)]
pub struct StTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range inside the file.
    pub start: usize,
    pub n_bytes: usize,
}

pub struct SafetensorsFile {
    pub path: PathBuf,
    pub tensors: HashMap<String, StTensor>,
    pub metadata: HashMap<String, String>,
    mmap: std::sync::Arc<memmap2::Mmap>,
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let (path, mmap) = map(path.as_ref())?;
        let (tensors, metadata) = parse(&mmap)?;
        Ok(Self {
            path,
            tensors,
            metadata,
            mmap: std::sync::Arc::new(mmap),
        })
    }

    /// A PyTorch zip (`torch.save`): its tensors located by [`crate::torch::parse`], read in
    /// place like a safetensors file's.
    pub fn open_torch(path: impl AsRef<Path>) -> Result<Self> {
        let (path, mmap) = map(path.as_ref())?;
        let tensors = crate::torch::parse(&path, &mmap)?;
        Ok(Self {
            path,
            tensors,
            metadata: HashMap::new(),
            mmap: std::sync::Arc::new(mmap),
        })
    }

    pub fn data(&self, t: &StTensor) -> &[u8] {
        &self.mmap[t.start..t.start + t.n_bytes]
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }
    /// The mapping itself, for a backend that reads the tensors in place.
    pub fn shared(&self) -> std::sync::Arc<memmap2::Mmap> {
        self.mmap.clone()
    }
}

/// A non-empty file mapped read-only.
fn map(path: &Path) -> Result<(std::path::PathBuf, memmap2::Mmap)> {
    let path = path.to_path_buf();
    let io = |source| FormatError::Io {
        path: path.clone(),
        source,
    };
    let file = std::fs::File::open(&path).map_err(io)?;
    if file.metadata().map_err(io)?.len() == 0 {
        return Err(FormatError::Empty { path });
    }
    // SAFETY: read-only private mapping; the file is assumed not to change while mapped.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok((path, mmap))
}

type Table = (HashMap<String, StTensor>, HashMap<String, String>);

/// Parse and validate a safetensors image into a tensor table with absolute offsets.
pub fn parse(buf: &[u8]) -> Result<Table> {
    let st = safetensors::SafeTensors::deserialize(buf)
        .map_err(|e| FormatError::Safetensors(e.to_string()))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(buf)
        .map_err(|e| FormatError::Safetensors(e.to_string()))?;
    let data_start = 8 + header_len;
    let mut tensors = HashMap::new();
    for (name, view) in st.tensors() {
        let info = meta
            .info(&name)
            .ok_or_else(|| FormatError::Safetensors(format!("no info for `{name}`")))?;
        let (b, e) = info.data_offsets;
        tensors.insert(
            name,
            StTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                start: data_start + b,
                n_bytes: e - b,
            },
        );
    }
    let metadata = meta.metadata().clone().unwrap_or_default();
    Ok((tensors, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_truncation() {
        let data: Vec<u8> = (0..24u8).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &data).unwrap();
        let buf = safetensors::serialize([("a", view)], &None).unwrap();
        let (t, _) = parse(&buf).unwrap();
        let a = &t["a"];
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(&buf[a.start..a.start + a.n_bytes], &data[..]);
        assert!(parse(&buf[..buf.len() - 1]).is_err());
        assert!(parse(&[]).is_err());
    }
}
