//! GGUF reader (versions 2 and 3), zero-copy over a memory map.
//!
//! On-disk layout (all integers little-endian; spec: ggml's docs/gguf.md):
//! ```text
//! u32  magic = "GGUF"          u32 version (2 | 3)
//! u64  tensor_count            u64 kv_count
//! kv_count x { string key, u32 value_type, value }
//! tensor_count x { string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml_type, u64 offset }
//! padding to `general.alignment` (default 32)
//! tensor data; tensor i lives at data_start + offset_i
//! string = u64 len, len bytes of UTF-8;  array = u32 elem_type, u64 count, count x value (nesting allowed)
//! ```
//! Invariants after [`GgufFile::open`] / [`parse`]: every count was checked against the bytes left
//! (so absurd counts fail before allocating), every tensor's data range is aligned and lies inside
//! the file, tensors do not overlap, and names are unique. Writing lives in `write.rs`.
use crate::{FormatError, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod write;
pub use write::{layout, write, GgufWriter};

pub const MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are rejected (real files nest at most 2).
const MAX_NESTING: u32 = 8;

/// A ggml tensor element type as stored in the file. The block layout (elements per block, bytes
/// per block) is part of the file format, so it lives here; compute support is the backends' business.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ4NL,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            20 => IQ4NL,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            _ => return None,
        })
    }

    /// A type id for messages: ggml's name for the ids this reader does not read (the other
    /// i-quants, ternary and MXFP4 types), with the id.
    pub fn describe_id(id: u32) -> String {
        let name = match id {
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            21 => "IQ3_S",
            22 => "IQ2_S",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return format!("id {id} (unknown)"),
        };
        format!("{name} (id {id})")
    }

    /// (elements per block, bytes per block), as ggml defines them.
    pub fn block_layout(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            IQ4NL => (32, 18),
            IQ4XS => (256, 136),
        }
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ4NL => "IQ4_NL",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value. Arrays keep their element type so that an empty array is still typed.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// Any integer type that fits in u64 (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        use MetaValue::*;
        match *self {
            U8(v) => Some(v as u64),
            U16(v) => Some(v as u64),
            U32(v) => Some(v as u64),
            U64(v) => Some(v),
            I8(v) => u64::try_from(v).ok(),
            I16(v) => u64::try_from(v).ok(),
            I32(v) => u64::try_from(v).ok(),
            I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        use MetaValue::*;
        match *self {
            I8(v) => Some(v as i64),
            I16(v) => Some(v as i64),
            I32(v) => Some(v as i64),
            I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
    /// Short human form: scalars in full, strings up to `max` chars, arrays as `[type; n]`.
    pub fn summary(&self, max: usize) -> String {
        match self {
            MetaValue::String(s) if s.chars().count() > max => {
                format!(
                    "{:?}... ({} chars)",
                    s.chars().take(max).collect::<String>(),
                    s.chars().count()
                )
            }
            MetaValue::String(s) => format!("{s:?}"),
            MetaValue::Array(a) if a.len() > 8 => format!("[{} items]", a.len()),
            MetaValue::Array(a) => {
                let items: Vec<String> = a.iter().map(|v| v.summary(max)).collect();
                format!("[{}]", items.join(", "))
            }
            v => format!("{v:?}")
                .split(['(', ')'])
                .nth(1)
                .unwrap_or_default()
                .to_string(),
        }
    }
}

/// One entry of the tensor table. `dims` are in ggml order: `dims[0]` is the row length.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte range of the data inside the file.
    pub start: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Length of one row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
    /// Number of rows: the product of every dimension but the first.
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
}

/// The parsed header of a GGUF file: metadata in file order, the tensor table, the data start.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_start: usize,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// Forget metadata entries (e.g. the vocabulary arrays, tens of MB for a 150k-token vocabulary,
    /// once a tokenizer owns its copy); `get` returns `None` for them afterwards.
    pub fn drop_metadata(&mut self, keys: &[&str]) {
        self.metadata.retain(|(k, _)| !keys.contains(&k.as_str()));
        self.meta_index = (self.metadata.iter().enumerate())
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
    }
}

/// A GGUF file mapped into memory; tensor data is borrowed from the mapping.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    mmap: std::sync::Arc<memmap2::Mmap>,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| FormatError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(FormatError::Empty { path });
        }
        // SAFETY: the mapping is read-only and private to this process. Like every mmap-based model
        // loader we assume the file is not truncated or rewritten by another process while mapped.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&mmap)?;
        let mmap = std::sync::Arc::new(mmap);
        Ok(Self { path, header, mmap })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.header.get(key)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }
    /// The bytes of a tensor of this file (ranges were validated at parse time).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.start..t.start + t.n_bytes]
    }
    pub fn file_size(&self) -> usize {
        self.mmap.len()
    }
    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }
    /// The mapping itself, for a backend that reads the tensors in place.
    pub fn shared(&self) -> std::sync::Arc<memmap2::Mmap> {
        self.mmap.clone()
    }
    /// Drop this process's resident pages of `start..start + len` (a hint; the pages are read
    /// again from the file if touched later): for tensors the engine copied elsewhere.
    pub fn release(&self, start: usize, len: usize) {
        #[cfg(unix)]
        // SAFETY: the mapping is private and read-only, so MADV_DONTNEED loses nothing: a later
        // read faults the page in again from the file, and no reference sees changed bytes.
        let _ = unsafe {
            self.mmap
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
        };
        #[cfg(not(unix))]
        let _ = (start, len);
    }
}

/// Bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(FormatError::Truncated {
                what: what.into(),
                offset: self.pos,
                need: n,
                have: self.left(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("take returned N bytes"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    /// A count of items each at least `min_item_bytes` long: rejected if the rest of the file cannot hold them.
    fn count(&mut self, what: &str, min_item_bytes: u64) -> Result<u64> {
        let offset = self.pos;
        let n = self.u64(what)?;
        if n.checked_mul(min_item_bytes)
            .is_none_or(|b| b > self.left())
        {
            return Err(FormatError::Implausible {
                what: what.into(),
                value: n,
                offset,
            });
        }
        Ok(n)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(&format!("{what} length"), 1)?;
        let offset = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| FormatError::BadUtf8 { offset })
    }
}

/// Smallest encoded size of one value of a type id (used to bound array counts).
fn min_value_bytes(type_id: u32) -> u64 {
    match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,  // string: u64 length
        9 => 12, // array: u32 type + u64 count
        10..=12 => 8,
        _ => 1,
    }
}

fn read_value(c: &mut Cursor, type_id: u32, depth: u32) -> Result<MetaValue> {
    let v = match type_id {
        0 => MetaValue::U8(c.array::<1>("u8")?[0]),
        1 => MetaValue::I8(c.array::<1>("i8")?[0] as i8),
        2 => MetaValue::U16(u16::from_le_bytes(c.array("u16")?)),
        3 => MetaValue::I16(i16::from_le_bytes(c.array("i16")?)),
        4 => MetaValue::U32(c.u32("u32")?),
        5 => MetaValue::I32(i32::from_le_bytes(c.array("i32")?)),
        6 => MetaValue::F32(f32::from_le_bytes(c.array("f32")?)),
        7 => MetaValue::Bool(c.array::<1>("bool")?[0] != 0),
        8 => MetaValue::String(c.string("string value")?),
        9 => {
            let offset = c.pos;
            if depth >= MAX_NESTING {
                return Err(FormatError::Implausible {
                    what: "array nesting depth".into(),
                    value: depth as u64,
                    offset,
                });
            }
            let elem = c.u32("array element type")?;
            if elem > 12 {
                return Err(FormatError::UnknownValueType {
                    type_id: elem,
                    offset,
                });
            }
            let n = c.count("array length", min_value_bytes(elem))?;
            let mut items = Vec::with_capacity(n as usize);
            for _ in 0..n {
                items.push(read_value(c, elem, depth + 1)?);
            }
            MetaValue::Array(items)
        }
        10 => MetaValue::U64(c.u64("u64")?),
        11 => MetaValue::I64(i64::from_le_bytes(c.array("i64")?)),
        12 => MetaValue::F64(f64::from_le_bytes(c.array("f64")?)),
        t => {
            return Err(FormatError::UnknownValueType {
                type_id: t,
                offset: c.pos.saturating_sub(4),
            })
        }
    };
    Ok(v)
}

/// Parse and validate a whole GGUF image (header, metadata, tensor table, data ranges).
pub fn parse(buf: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array("magic")?;
    if magic != MAGIC {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(FormatError::UnsupportedVersion(version));
    }
    // A tensor-table entry is at least 8 (name len) + 4 + 4 + 8 bytes; a kv at least 8 + 4 + 1.
    let n_tensors = c.count("tensor count", 24)?;
    let n_kv = c.count("metadata count", 13)?;

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut meta_index = HashMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let type_id = c.u32("metadata value type")?;
        let value = read_value(&mut c, type_id, 0)?;
        meta_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }
    let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(FormatError::BadMetadata {
                    key: "general.alignment".into(),
                    reason: format!("must be a power of two integer, got {v:?}"),
                })
            }
        },
    };

    let mut raw = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32("tensor rank")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(FormatError::BadShape {
                tensor: name,
                dims: vec![],
                reason: format!("rank {n_dims} (must be 1..={MAX_DIMS})"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dimension")?);
        }
        let type_id = c.u32("tensor type")?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| FormatError::UnknownGgmlType {
            tensor: name.clone(),
            type_id,
        })?;
        let offset = c.u64("tensor offset")?;
        raw.push((name, dims, ggml_type, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_size = buf.len() as u64;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut tensor_index = HashMap::new();
    for (name, dims, ggml_type, offset) in raw {
        let n_bytes = tensor_bytes(&name, &dims, ggml_type)?;
        if offset % alignment != 0 {
            return Err(FormatError::Misaligned {
                tensor: name,
                offset,
                alignment,
            });
        }
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(n_bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_size => {
                if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                    return Err(FormatError::DuplicateTensor(name));
                }
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ggml_type,
                    start: s as usize,
                    n_bytes: n_bytes as usize,
                });
            }
            _ => {
                return Err(FormatError::TensorOutOfBounds {
                    tensor: name,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_size,
                })
            }
        }
    }
    // No two tensors may share bytes (a crafted table could alias one weight onto another).
    let mut ranges: Vec<(usize, usize, usize)> = (tensors.iter().enumerate())
        .map(|(i, t)| (t.start, t.start + t.n_bytes, i))
        .collect();
    ranges.sort_unstable();
    if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(FormatError::Overlap {
            a: tensors[w[0].2].name.clone(),
            b: tensors[w[1].2].name.clone(),
        });
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_start: data_start as usize,
        meta_index,
        tensor_index,
    })
}

/// Bytes a tensor of this shape and type occupies; rows must hold whole blocks.
fn tensor_bytes(name: &str, dims: &[u64], t: GgmlType) -> Result<u64> {
    let bad = |reason: String| FormatError::BadShape {
        tensor: name.into(),
        dims: dims.to_vec(),
        reason,
    };
    let (block, block_bytes) = t.block_layout();
    if dims.contains(&0) {
        return Err(bad("zero-sized dimension".into()));
    }
    if !dims[0].is_multiple_of(block) {
        return Err(bad(format!(
            "row length {} is not a multiple of the {t} block size {block}",
            dims[0]
        )));
    }
    let rows = dims[1..].iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    rows.and_then(|r| r.checked_mul(dims[0] / block))
        .and_then(|b| b.checked_mul(block_bytes))
        .ok_or_else(|| bad("size overflows".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let data: Vec<u8> = (0..2 * 32 * 4).map(|i| i as u8).collect();
        write(
            &[
                ("general.architecture", MetaValue::String("llama".into())),
                ("n", MetaValue::U32(7)),
                (
                    "nested",
                    MetaValue::Array(vec![
                        MetaValue::Array(vec![MetaValue::I8(-1)]),
                        MetaValue::Array(vec![]),
                    ]),
                ),
                ("pi", MetaValue::F64(3.5)),
            ],
            &[("w", &[32, 2], GgmlType::F32, &data)],
        )
    }

    #[test]
    fn overlapping_tensors_are_refused() {
        let data = vec![0u8; 256];
        let buf = write(
            &[],
            &[
                ("a", &[32], GgmlType::F32, &data[..128]),
                ("b", &[32], GgmlType::F32, &data[128..]),
            ],
        );
        let h = parse(&buf).unwrap();
        // Point b's offset (the last 8 bytes of the tensor table) at a's data.
        let mut bad = buf.clone();
        let pos = (0..h.data_start - 8)
            .rev()
            .find(|&i| bad[i..i + 8] == 128u64.to_le_bytes())
            .unwrap();
        bad[pos..pos + 8].copy_from_slice(&32u64.to_le_bytes());
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn roundtrip_metadata_and_tensor() {
        let buf = sample();
        let h = parse(&buf).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("n").and_then(|v| v.as_u64()), Some(7));
        assert_eq!(h.get("pi").and_then(|v| v.as_f64()), Some(3.5));
        let nested = h.get("nested").unwrap().as_array().unwrap();
        assert_eq!(nested[0], MetaValue::Array(vec![MetaValue::I8(-1)]));
        let t = h.tensor("w").unwrap();
        assert_eq!((t.row_len(), t.n_rows(), t.n_bytes), (32, 2, 256));
        assert_eq!(&buf[t.start..t.start + 4], &[0, 1, 2, 3]);
        assert_eq!(t.start % 32, 0);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = sample();
        for cut in 0..buf.len() {
            assert!(parse(&buf[..cut]).is_err(), "prefix of {cut} bytes parsed");
        }
    }

    #[test]
    fn hostile_headers() {
        let mut buf = sample();
        buf[0] = b'X';
        assert!(matches!(parse(&buf), Err(FormatError::BadMagic { .. })));
        let mut buf = sample();
        buf[4] = 1;
        assert!(matches!(
            parse(&buf),
            Err(FormatError::UnsupportedVersion(1))
        ));
        let mut buf = sample();
        buf[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&buf), Err(FormatError::Implausible { .. })));
        let mut buf = sample();
        // first key length
        buf[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(parse(&buf), Err(FormatError::Implausible { .. })));
    }
}
