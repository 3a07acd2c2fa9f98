//! Writing GGUF v3: an image in memory ([`write`], for tests and small files) or a stream, one
//! tensor at a time ([`GgufWriter`], for `dejavu quantize`). Both lay data out with the default
//! alignment, and what they write parses back with [`super::parse`].
use super::{GgmlType, MetaValue, DEFAULT_ALIGNMENT, MAGIC};
use std::collections::HashMap;

/// Write a GGUF v3 image in memory (used by tests to craft files, and by tools). Tensors are
/// given as (name, dims, type, bytes); values as (key, value). Data is laid out with the default
/// alignment. [`GgufWriter`] writes the same layout to a stream, one tensor at a time.
pub fn write(
    metadata: &[(&str, MetaValue)],
    tensors: &[(&str, &[u64], GgmlType, &[u8])],
) -> Vec<u8> {
    let infos: Vec<(&str, &[u64], GgmlType, usize)> = tensors
        .iter()
        .map(|&(n, d, t, b)| (n, d, t, b.len()))
        .collect();
    let mut out = header_bytes(metadata, &infos);
    for (_, _, _, data) in tensors {
        out.resize(
            out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize,
            0,
        );
        out.extend(*data);
    }
    out
}

/// Where [`write`] puts each tensor: the header's bytes, each tensor's data offset in the file,
/// and the file's length; so a caller can fill a buffer of that length in place (the header at
/// 0, tensor `i` at `starts[i]`, zeros between) instead of holding the tensors twice.
pub fn layout(
    metadata: &[(&str, MetaValue)],
    tensors: &[(&str, &[u64], GgmlType, usize)],
) -> (Vec<u8>, Vec<usize>, usize) {
    let header = header_bytes(metadata, tensors);
    let align = |n: usize| n.div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize;
    let (mut starts, mut end) = (Vec::with_capacity(tensors.len()), header.len());
    for t in tensors {
        let at = align(end);
        starts.push(at);
        end = at + t.3;
    }
    (header, starts, end)
}

/// A GGUF v3 file written as a stream: the header (metadata and the tensor table, from each
/// tensor's name, dims, type and byte size) first, then each tensor's data in table order.
pub struct GgufWriter<W: std::io::Write> {
    out: W,
    pos: u64,
    sizes: Vec<usize>,
    next: usize,
}

impl<W: std::io::Write> GgufWriter<W> {
    pub fn start(
        mut out: W,
        metadata: &[(&str, MetaValue)],
        tensors: &[(&str, &[u64], GgmlType, usize)],
    ) -> std::io::Result<Self> {
        let header = header_bytes(metadata, tensors);
        out.write_all(&header)?;
        Ok(Self {
            out,
            pos: header.len() as u64,
            sizes: tensors.iter().map(|t| t.3).collect(),
            next: 0,
        })
    }

    /// The next tensor's data; its length must be the size given to [`Self::start`].
    pub fn push(&mut self, data: &[u8]) -> std::io::Result<()> {
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
        match self.sizes.get(self.next) {
            Some(&n) if n == data.len() => {}
            Some(&n) => {
                return Err(bad(format!(
                    "tensor {}: {} bytes, declared {n}",
                    self.next,
                    data.len()
                )))
            }
            None => return Err(bad("more tensors than declared".into())),
        }
        let pad = self.pos.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT - self.pos;
        self.out.write_all(&vec![0u8; pad as usize])?;
        self.out.write_all(data)?;
        self.pos += pad + data.len() as u64;
        self.next += 1;
        Ok(())
    }

    /// Check that every declared tensor was written, and flush.
    pub fn finish(mut self) -> std::io::Result<W> {
        if self.next != self.sizes.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} of {} tensors written", self.next, self.sizes.len()),
            ));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Magic, version, counts, metadata and the tensor table (offsets for the default alignment).
fn header_bytes(
    metadata: &[(&str, MetaValue)],
    tensors: &[(&str, &[u64], GgmlType, usize)],
) -> Vec<u8> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn type_id(v: &MetaValue) -> u32 {
        use MetaValue::*;
        match v {
            U8(_) => 0,
            I8(_) => 1,
            U16(_) => 2,
            I16(_) => 3,
            U32(_) => 4,
            I32(_) => 5,
            F32(_) => 6,
            Bool(_) => 7,
            String(_) => 8,
            Array(_) => 9,
            U64(_) => 10,
            I64(_) => 11,
            F64(_) => 12,
        }
    }
    fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
        use MetaValue::*;
        match v {
            U8(x) => out.push(*x),
            I8(x) => out.push(*x as u8),
            U16(x) => out.extend(x.to_le_bytes()),
            I16(x) => out.extend(x.to_le_bytes()),
            U32(x) => out.extend(x.to_le_bytes()),
            I32(x) => out.extend(x.to_le_bytes()),
            F32(x) => out.extend(x.to_le_bytes()),
            Bool(x) => out.push(*x as u8),
            String(s) => put_str(out, s),
            Array(a) => {
                out.extend(a.first().map_or(4, type_id).to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| put_value(out, x));
            }
            U64(x) => out.extend(x.to_le_bytes()),
            I64(x) => out.extend(x.to_le_bytes()),
            F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    let type_ids: HashMap<GgmlType, u32> = (0..64)
        .filter_map(|i| GgmlType::from_id(i).map(|t| (t, i)))
        .collect();
    let mut out = Vec::new();
    out.extend(MAGIC);
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend(type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    for (name, dims, t, n_bytes) in tensors {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(type_ids[t].to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (*n_bytes as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_tensors_as_write_does() {
        let a: Vec<u8> = (0..70).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..33).map(|i| (i * 5) as u8).collect();
        let meta = [("k", MetaValue::U32(7))];
        let tensors: [(&str, &[u64], GgmlType, &[u8]); 2] = [
            ("a", &[70], GgmlType::I8, &a),
            ("b", &[33], GgmlType::I8, &b),
        ];
        let want = write(&meta, &tensors);
        let infos: Vec<_> = tensors
            .iter()
            .map(|&(n, d, t, x)| (n, d, t, x.len()))
            .collect();
        let (header, starts, len) = layout(&meta, &infos);
        let mut got = vec![0u8; len];
        got[..header.len()].copy_from_slice(&header);
        got[starts[0]..starts[0] + 70].copy_from_slice(&a);
        got[starts[1]..starts[1] + 33].copy_from_slice(&b);
        assert_eq!(got, want);
    }

    #[test]
    fn streaming_writer_matches_in_memory_writer() {
        let a: Vec<u8> = (0..96).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..64).map(|i| (i * 3) as u8).collect();
        let meta = [("k", MetaValue::U32(1))];
        let tensors: [(&str, &[u64], GgmlType, &[u8]); 2] = [
            ("a", &[24], GgmlType::F32, &a),
            ("b", &[32], GgmlType::F16, &b),
        ];
        let want = write(&meta, &tensors);
        let infos: Vec<_> = tensors
            .iter()
            .map(|&(n, d, t, x)| (n, d, t, x.len()))
            .collect();
        let mut w = GgufWriter::start(Vec::new(), &meta, &infos).unwrap();
        assert!(w.push(&b).is_err(), "wrong size refused");
        w.push(&a).unwrap();
        w.push(&b).unwrap();
        assert_eq!(w.finish().unwrap(), want);
    }
}
