//! PyTorch checkpoints (`torch.save`'s zip format: `pytorch_model.bin` and its shards), read
//! without executing anything.
//!
//! Contract: the zip's `<archive>/data.pkl` is interpreted by a small pickle machine that knows
//! the opcodes `torch.save` writes and builds values only; it calls nothing. The only globals it
//! accepts are `torch._utils._rebuild_tensor_v2`, `torch._utils._rebuild_parameter`,
//! `collections.OrderedDict` and the `torch.*Storage` classes; any other (`os.system`,
//! `builtins.eval`, ...) is refused by name, as is every opcode outside the list. Sizes are
//! capped: the pickle's length, the values it builds (counted as they are made or copied, so a
//! pickle cannot multiply memory through its memo), and the nesting of its containers (so
//! dropping a value cannot exhaust the stack). The result must be a flat `{name: tensor}`
//! dictionary of contiguous tensors; each tensor's bytes are its storage entry
//! (`<archive>/data/<key>`, stored uncompressed) at the element offset, read in place from the
//! memory map. Everything is checked against the file's size.
use crate::safetensors::StTensor;
use crate::{FormatError, Result};
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::Path;

/// The largest `data.pkl` read (a state dict's pickle is kilobytes per tensor).
const MAX_PICKLE: u64 = 256 << 20;
/// Deepest container nesting a pickle may build.
const MAX_DEPTH: usize = 32;

/// A value of the restricted pickle machine.
#[derive(Debug, Clone)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    /// A float (its value is never needed).
    Float,
    Str(String),
    Tuple(Vec<V>, usize),
    List(Vec<V>, usize),
    Dict(Vec<(V, V)>, usize),
    Global(Global),
    Storage {
        key: String,
        dtype: Dtype,
    },
    Tensor(Tensor),
    Mark,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Global {
    RebuildTensor,
    RebuildParameter,
    OrderedDict,
    Storage(Dtype),
}

/// A tensor as the pickle describes it: a view of a storage.
#[derive(Debug, Clone)]
struct Tensor {
    key: String,
    dtype: Dtype,
    offset: u64,
    shape: Vec<usize>,
}

impl V {
    /// Nesting depth (1 for a scalar).
    fn depth(&self) -> usize {
        match self {
            V::Tuple(_, d) | V::List(_, d) | V::Dict(_, d) => *d,
            _ => 1,
        }
    }
    fn int(&self) -> Option<i64> {
        match self {
            V::Int(i) => Some(*i),
            V::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }
}

fn bad(why: impl Into<String>) -> FormatError {
    FormatError::Torch(why.into())
}

/// The globals a checkpoint may name; anything else is refused with its name.
fn global(module: &str, name: &str) -> Result<Global> {
    let storage = |d| Ok(Global::Storage(d));
    match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => Ok(Global::RebuildTensor),
        ("torch._utils", "_rebuild_parameter") => Ok(Global::RebuildParameter),
        ("collections", "OrderedDict") => Ok(Global::OrderedDict),
        ("torch", "FloatStorage") => storage(Dtype::F32),
        ("torch", "HalfStorage") => storage(Dtype::F16),
        ("torch", "BFloat16Storage") => storage(Dtype::BF16),
        ("torch", "DoubleStorage") => storage(Dtype::F64),
        ("torch", "LongStorage") => storage(Dtype::I64),
        ("torch", "IntStorage") => storage(Dtype::I32),
        ("torch", "ShortStorage") => storage(Dtype::I16),
        ("torch", "CharStorage") => storage(Dtype::I8),
        ("torch", "ByteStorage") => storage(Dtype::U8),
        ("torch", "BoolStorage") => storage(Dtype::BOOL),
        _ => Err(bad(format!(
            "the pickle asks for the global `{module}.{name}`, which is not a tensor's \
             (refused: a checkpoint is never executed)"
        ))),
    }
}

/// The pickle machine's state: stack, memo, and the budget of values built.
struct Machine<'a> {
    buf: &'a [u8],
    at: usize,
    stack: Vec<V>,
    memo: HashMap<u32, V>,
    cells: usize,
    budget: usize,
}

impl<'a> Machine<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Machine {
            buf,
            at: 0,
            stack: Vec::new(),
            memo: HashMap::new(),
            cells: 0,
            budget: 16 * buf.len() + (1 << 16),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end =
            end.ok_or_else(|| bad(format!("the pickle ends inside an operand at {}", self.at)))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn line(&mut self) -> Result<&'a str> {
        let rest = &self.buf[self.at..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("an unterminated GLOBAL"))?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| bad("a GLOBAL name is not UTF-8"))?;
        self.at += n + 1;
        Ok(s)
    }
    fn text(&mut self, n: usize) -> Result<String> {
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad("a string is not UTF-8"))
    }

    /// Count `n` cells built; refuse a pickle that builds far more than its length.
    fn spend(&mut self, n: usize) -> Result<()> {
        self.cells = self.cells.saturating_add(n.max(1));
        match self.cells > self.budget {
            true => Err(bad("the pickle builds more values than its size allows")),
            false => Ok(()),
        }
    }
    fn push(&mut self, v: V) -> Result<()> {
        if v.depth() > MAX_DEPTH {
            return Err(bad(format!("containers nested deeper than {MAX_DEPTH}")));
        }
        self.spend(1)?;
        self.stack.push(v);
        Ok(())
    }
    fn pop(&mut self) -> Result<V> {
        match self.stack.pop() {
            Some(V::Mark) | None => Err(bad("the pickle pops an empty stack")),
            Some(v) => Ok(v),
        }
    }
    /// The values above the topmost MARK (which is removed).
    fn pop_mark(&mut self) -> Result<Vec<V>> {
        let m = (self.stack.iter().rposition(|v| matches!(v, V::Mark)))
            .ok_or_else(|| bad("no MARK on the stack"))?;
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items)
    }
    fn container(&mut self, items: &[V]) -> Result<usize> {
        self.spend(items.len())?;
        Ok(1 + items.iter().map(V::depth).max().unwrap_or(0))
    }
    fn top_mut(&mut self) -> Result<&mut V> {
        self.stack
            .last_mut()
            .ok_or_else(|| bad("the pickle pops an empty stack"))
    }

    /// Run to STOP; the value it returns.
    fn run(mut self) -> Result<V> {
        loop {
            let op_at = self.at;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let p = self.u8()?; // PROTO
                    if p > 5 {
                        return Err(bad(format!("pickle protocol {p}")));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint
                }
                b'.' => return self.pop(), // STOP
                b'(' => self.stack.push(V::Mark),
                b'}' => self.push(V::Dict(Vec::new(), 1))?,
                b']' => self.push(V::List(Vec::new(), 1))?,
                b')' => self.push(V::Tuple(Vec::new(), 1))?,
                b't' => {
                    let items = self.pop_mark()?;
                    let d = self.container(&items)?;
                    self.push(V::Tuple(items, d))?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize; // TUPLE1..3
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    let d = self.container(&items)?;
                    self.push(V::Tuple(items, d))?;
                }
                b'q' | b'r' | 0x94 => {
                    let i = match op {
                        b'q' => self.u8()? as u32,
                        b'r' => self.u32()?,
                        _ => self.memo.len() as u32, // MEMOIZE
                    };
                    let v = self
                        .stack
                        .last()
                        .cloned()
                        .ok_or_else(|| bad("PUT on an empty stack"))?;
                    self.spend(1)?;
                    self.memo.insert(i, v);
                }
                b'h' | b'j' => {
                    let i = match op {
                        b'h' => self.u8()? as u32,
                        _ => self.u32()?,
                    };
                    let v = self
                        .memo
                        .get(&i)
                        .cloned()
                        .ok_or_else(|| bad(format!("GET of unset memo {i}")))?;
                    self.spend(weight(&v))?;
                    self.push(v)?;
                }
                b'J' => {
                    let b = self.take(4)?;
                    self.push(V::Int(
                        i32::from_le_bytes(b.try_into().unwrap_or_default()) as i64
                    ))?;
                }
                b'K' => {
                    let b = self.u8()?;
                    self.push(V::Int(b as i64))?;
                }
                b'M' => {
                    let b = self.take(2)?;
                    self.push(V::Int(u16::from_le_bytes([b[0], b[1]]) as i64))?;
                }
                0x8a => {
                    let n = self.u8()? as usize; // LONG1
                    let b = self.take(n)?;
                    if n > 8 {
                        return Err(bad("an integer wider than 64 bits"));
                    }
                    let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
                        0xff
                    } else {
                        0
                    };
                    let mut w = [fill; 8];
                    w[..n].copy_from_slice(b);
                    self.push(V::Int(i64::from_le_bytes(w)))?;
                }
                b'G' => {
                    self.take(8)?;
                    self.push(V::Float)?;
                }
                b'X' | 0x8c | b'T' | b'U' => {
                    let n = match op {
                        b'X' | b'T' => self.u32()? as usize,
                        _ => self.u8()? as usize,
                    };
                    let s = self.text(n)?;
                    self.spend(n / 16)?;
                    self.push(V::Str(s))?;
                }
                0x88 => self.push(V::Bool(true))?,
                0x89 => self.push(V::Bool(false))?,
                b'N' => self.push(V::None)?,
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.push(V::Global(global(module, name)?))?;
                }
                0x93 => {
                    let (name, module) = (self.pop()?, self.pop()?); // STACK_GLOBAL
                    match (module, name) {
                        (V::Str(m), V::Str(n)) => self.push(V::Global(global(&m, &n)?))?,
                        _ => return Err(bad("STACK_GLOBAL of non-strings")),
                    }
                }
                b'Q' => {
                    let pid = self.pop()?; // BINPERSID
                    let v = storage(pid)?;
                    self.push(v)?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = reduce(f, args)?;
                    self.push(v)?;
                }
                b'b' => {
                    // BUILD: an OrderedDict's `_metadata`, a tensor's attributes: dropped.
                    self.pop()?;
                    match self.top_mut()? {
                        V::Dict(..) | V::Tensor(_) => {}
                        other => return Err(bad(format!("BUILD of {}", kind(other)))),
                    }
                }
                b's' | b'u' => {
                    let items = match op {
                        b's' => {
                            let v = self.pop()?;
                            vec![self.pop()?, v]
                        }
                        _ => self.pop_mark()?,
                    };
                    if items.len() % 2 != 0 {
                        return Err(bad("SETITEMS of an odd count"));
                    }
                    let add = 1 + items.iter().map(V::depth).max().unwrap_or(0);
                    self.spend(items.len())?;
                    match self.top_mut()? {
                        V::Dict(d, depth) => {
                            *depth = (*depth).max(add);
                            let mut it = items.into_iter();
                            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                                d.push((k, v));
                            }
                            if *depth > MAX_DEPTH {
                                return Err(bad("containers nested too deep"));
                            }
                        }
                        other => return Err(bad(format!("SETITEM on {}", kind(other)))),
                    }
                }
                b'a' | b'e' => {
                    let items = match op {
                        b'a' => vec![self.pop()?],
                        _ => self.pop_mark()?,
                    };
                    let add = 1 + items.iter().map(V::depth).max().unwrap_or(0);
                    self.spend(items.len())?;
                    match self.top_mut()? {
                        V::List(l, depth) => {
                            *depth = (*depth).max(add);
                            l.extend(items);
                            if *depth > MAX_DEPTH {
                                return Err(bad("containers nested too deep"));
                            }
                        }
                        other => return Err(bad(format!("APPEND to {}", kind(other)))),
                    }
                }
                other => {
                    return Err(bad(format!(
                        "pickle opcode 0x{other:02x} at byte {op_at} is not one a checkpoint uses \
                         (refused)"
                    )))
                }
            }
        }
    }
}

/// Cells a copy of `v` costs.
fn weight(v: &V) -> usize {
    match v {
        V::Tuple(i, _) | V::List(i, _) => 1 + i.iter().map(weight).sum::<usize>(),
        V::Dict(i, _) => 1 + i.iter().map(|(k, v)| weight(k) + weight(v)).sum::<usize>(),
        _ => 1,
    }
}

fn kind(v: &V) -> &'static str {
    match v {
        V::None => "None",
        V::Bool(_) => "a bool",
        V::Int(_) => "an int",
        V::Float => "a float",
        V::Str(_) => "a string",
        V::Tuple(..) => "a tuple",
        V::List(..) => "a list",
        V::Dict(..) => "a dict",
        V::Global(_) => "a global",
        V::Storage { .. } => "a storage",
        V::Tensor(_) => "a tensor",
        V::Mark => "a MARK",
    }
}

/// `('storage', StorageClass, key, location, numel)` into a storage.
fn storage(pid: V) -> Result<V> {
    let V::Tuple(items, _) = pid else {
        return Err(bad("a persistent id that is not a tuple"));
    };
    match items.as_slice() {
        [V::Str(tag), V::Global(Global::Storage(dtype)), V::Str(key), _, _] if tag == "storage" => {
            Ok(V::Storage {
                key: key.clone(),
                dtype: *dtype,
            })
        }
        _ => Err(bad("a persistent id that is not a tensor storage")),
    }
}

/// Apply an allowed callable to its arguments.
fn reduce(f: V, args: V) -> Result<V> {
    let V::Tuple(args, _) = args else {
        return Err(bad("REDUCE with arguments that are not a tuple"));
    };
    match f {
        V::Global(Global::OrderedDict) if args.is_empty() => Ok(V::Dict(Vec::new(), 1)),
        V::Global(Global::RebuildParameter) => match args.into_iter().next() {
            Some(t @ V::Tensor(_)) => Ok(t),
            _ => Err(bad("_rebuild_parameter of something other than a tensor")),
        },
        V::Global(Global::RebuildTensor) => rebuild_tensor(args),
        other => Err(bad(format!("REDUCE of {}", kind(&other)))),
    }
}

/// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])`: a
/// row-major contiguous view.
fn rebuild_tensor(args: Vec<V>) -> Result<V> {
    let ints = |v: &V| -> Result<Vec<i64>> {
        match v {
            V::Tuple(items, _) => items
                .iter()
                .map(|x| x.int().ok_or_else(|| bad("a non-integer size")))
                .collect(),
            _ => Err(bad("a tensor size that is not a tuple")),
        }
    };
    let (V::Storage { key, dtype }, Some(offset), Ok(size), Ok(stride)) = (
        args.first().cloned().unwrap_or(V::None),
        args.get(1).and_then(V::int),
        args.get(2).map_or(Err(bad("no size")), ints),
        args.get(3).map_or(Err(bad("no stride")), ints),
    ) else {
        return Err(bad("_rebuild_tensor_v2 with arguments of the wrong kinds"));
    };
    if offset < 0 || size.iter().any(|&s| s < 0) || size.len() != stride.len() {
        return Err(bad(format!(
            "tensor of size {size:?}, stride {stride:?}, offset {offset}"
        )));
    }
    // Row-major contiguous: each stride the product of the sizes after it.
    let mut want = 1i64;
    for (s, st) in size.iter().zip(&stride).rev() {
        if *s > 1 && *st != want {
            return Err(bad(format!(
                "a non-contiguous tensor (size {size:?}, stride {stride:?}); save it contiguous"
            )));
        }
        want = want
            .checked_mul(*s)
            .ok_or_else(|| bad("a tensor size overflows"))?;
    }
    Ok(V::Tensor(Tensor {
        key,
        dtype,
        offset: offset as u64,
        shape: size.iter().map(|&s| s as usize).collect(),
    }))
}

/// Run the restricted machine over a bare pickle (the fuzz target's entry): `Ok` if it builds a
/// value, else why not.
pub fn check_pickle(buf: &[u8]) -> Result<()> {
    Machine::new(buf).run().map(drop)
}

/// Read a `torch.save` zip mapped as `map`: every tensor of its state dict, with the absolute
/// byte range of its data in the file.
pub fn parse(path: &Path, map: &[u8]) -> Result<HashMap<String, StTensor>> {
    let zerr =
        |e: zip::result::ZipError| bad(format!("{}: not a PyTorch zip ({e})", path.display()));
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(map)).map_err(zerr)?;
    let names: Vec<String> = z.file_names().map(String::from).collect();
    let pkl: Vec<&String> = names
        .iter()
        .filter(|n| n.ends_with("/data.pkl") || *n == "data.pkl")
        .collect();
    let [pkl] = pkl.as_slice() else {
        return Err(bad(format!(
            "{}: expected one data.pkl, found {}",
            path.display(),
            pkl.len()
        )));
    };
    let prefix = pkl.strip_suffix("data.pkl").unwrap_or_default().to_string();
    let mut entries: HashMap<String, (u64, u64)> = HashMap::new();
    let mut pickle = Vec::new();
    for i in 0..z.len() {
        let f = z.by_index_raw(i).map_err(zerr)?;
        let name = f.name().to_string();
        if name == **pkl {
            if f.compression() != zip::CompressionMethod::Stored || f.size() > MAX_PICKLE {
                return Err(bad("data.pkl is compressed or too large"));
            }
            let (s, n) = (f.data_start() as usize, f.size() as usize);
            pickle = map
                .get(s..s + n)
                .ok_or_else(|| bad("data.pkl lies outside the file"))?
                .to_vec();
        } else if let Some(key) = name.strip_prefix(&format!("{prefix}data/")) {
            if f.compression() != zip::CompressionMethod::Stored {
                return Err(bad(format!(
                    "storage {key} is compressed (torch.save stores them)"
                )));
            }
            entries.insert(key.to_string(), (f.data_start(), f.size()));
        }
    }
    let top = Machine::new(&pickle).run()?;
    let V::Dict(items, _) = top else {
        return Err(bad(format!(
            "the checkpoint is {}, not a dict of tensors",
            kind(&top)
        )));
    };
    let mut tensors = HashMap::new();
    for (k, v) in items {
        let (V::Str(name), V::Tensor(t)) = (k, v) else {
            return Err(bad("an entry of the state dict is not a named tensor"));
        };
        let &(start, size) = entries
            .get(&t.key)
            .ok_or_else(|| bad(format!("`{name}`: storage {} is not in the zip", t.key)))?;
        let el = t.dtype.size() as u64;
        let numel = t
            .shape
            .iter()
            .try_fold(1u64, |a, &s| a.checked_mul(s as u64));
        let bytes = numel.and_then(|n| n.checked_mul(el));
        let from = t.offset.checked_mul(el);
        let (Some(bytes), Some(from)) = (bytes, from) else {
            return Err(bad(format!("`{name}`: size overflows")));
        };
        let end = from.checked_add(bytes).filter(|&e| e <= size);
        if end.is_none() || start.checked_add(size).is_none_or(|e| e > map.len() as u64) {
            return Err(bad(format!("`{name}`: data past its storage or the file")));
        }
        let info = StTensor {
            dtype: t.dtype,
            shape: t.shape,
            start: (start + from) as usize,
            n_bytes: bytes as usize,
        };
        if tensors.insert(name.clone(), info).is_some() {
            return Err(FormatError::DuplicateTensor(name));
        }
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &[u8]) -> Result<V> {
        Machine::new(p).run()
    }

    #[test]
    fn code_is_refused_by_name() {
        // cos.system\n(S'echo hi'\ntR.  and  cbuiltins\neval\n...
        let e = run(b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00hi\x85R.").unwrap_err();
        assert!(e.to_string().contains("`os.system`"), "{e}");
        let e = run(b"cbuiltins\neval\n.").unwrap_err();
        assert!(e.to_string().contains("`builtins.eval`"), "{e}");
        let e = run(b"\x8c\x08builtins\x8c\x04exec\x93.").unwrap_err();
        assert!(e.to_string().contains("`builtins.exec`"), "{e}");
        // INST and OBJ (classic instance building) are not in the list.
        let e = run(b"(ios\nsystem\n.").unwrap_err();
        assert!(e.to_string().contains("0x69"), "{e}");
    }

    #[test]
    fn hostile_shapes_are_errors() {
        // Nesting: 10,000 empty lists appended into each other.
        let mut p = b"\x80\x02".to_vec();
        p.extend(std::iter::repeat_n(b']', 10_000));
        p.extend(std::iter::repeat_n(b'a', 9_999));
        p.push(b'.');
        assert!(run(&p).unwrap_err().to_string().contains("nested"));
        // The memo multiplying a list: build a list of 1000, then GET it 100,000 times.
        let mut p = b"\x80\x02]q\x00(".to_vec();
        p.extend(std::iter::repeat_n(b"K\x01".as_slice(), 1000).flatten());
        p.extend(b"eq\x00");
        p.extend(std::iter::repeat_n(b"h\x00".as_slice(), 100_000).flatten());
        p.push(b'.');
        assert!(run(&p).unwrap_err().to_string().contains("more values"));
        // Truncated operands, empty stacks, unknown memo slots.
        for p in [
            &b"X\xff\xff\xff\xff"[..],
            b"R.",
            b"h\x05.",
            b"",
            b"\x8a\x09\x00",
        ] {
            assert!(run(p).is_err(), "{p:?}");
        }
    }

    #[test]
    fn a_state_dict_pickle_builds_tensors() {
        // {'w': _rebuild_tensor_v2(('storage', HalfStorage, '0', 'cpu', 6), 2, (2, 2), (2, 1),
        //  False, OrderedDict())}
        let mut p =
            b"\x80\x02}q\x00(X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((".to_vec();
        p.extend(b"X\x07\x00\x00\x00storagectorch\nHalfStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x06tQ");
        p.extend(b"K\x02K\x02K\x02\x86K\x02K\x01\x86\x89ccollections\nOrderedDict\n)RtRu.");
        let V::Dict(items, _) = run(&p).unwrap() else {
            panic!()
        };
        let V::Tensor(t) = &items[0].1 else { panic!() };
        assert_eq!(
            (t.key.as_str(), t.offset, t.shape.as_slice()),
            ("0", 2, &[2, 2][..])
        );
        assert_eq!(t.dtype, Dtype::F16);
        // A transposed view (stride (1, 2)) is refused.
        let at = p.windows(5).position(|w| w == b"K\x02K\x01\x86").unwrap();
        let mut q = p.clone();
        q[at..at + 5].copy_from_slice(b"K\x01K\x02\x86");
        let e = run(&q).unwrap_err();
        assert!(e.to_string().contains("non-contiguous"), "{e}");
    }
}
