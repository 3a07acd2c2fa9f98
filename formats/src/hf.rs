//! Hugging Face checkpoint directories: `config.json` plus `model.safetensors`, or the shards
//! that `model.safetensors.index.json` lists; else PyTorch's `pytorch_model.bin` or the shards
//! of `pytorch_model.bin.index.json` (the facebook/opt-* layout), read by [`crate::torch`]'s
//! pickle reader, which never executes anything.
//!
//! Contract: this reads the directory's files and maps every shard; it returns the raw JSON texts
//! (the engine parses them into its typed config) and one table of tensors, each pointing into
//! the shard that holds it. It never computes and never copies tensor data.
use crate::safetensors::{SafetensorsFile, StTensor};
use crate::{FormatError, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const CONFIG: &str = "config.json";
pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";
pub const TORCH_SINGLE: &str = "pytorch_model.bin";
pub const TORCH_INDEX: &str = "pytorch_model.bin.index.json";

/// A tensor of a checkpoint: which shard (index into [`HfCheckpoint::shards`]) and where in it.
#[derive(Debug, Clone)]
pub struct HfTensor {
    pub shard: usize,
    pub info: StTensor,
}

pub struct HfCheckpoint {
    pub dir: PathBuf,
    /// The text of `config.json`.
    pub config: String,
    pub shards: Vec<SafetensorsFile>,
    pub tensors: HashMap<String, HfTensor>,
}

impl HfCheckpoint {
    /// Whether `path` looks like a checkpoint directory (a directory with `config.json`).
    pub fn is_checkpoint(path: &Path) -> bool {
        path.is_dir() && path.join(CONFIG).is_file()
    }

    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config = read_text(&dir.join(CONFIG))?;
        let shard_names = shard_names(&dir)?;
        let listed: std::collections::HashSet<&String> = (shard_names.iter())
            .flat_map(|(_, names)| names.iter().flatten())
            .collect();
        let mut shards = Vec::with_capacity(shard_names.len());
        let mut tensors = HashMap::new();
        for (i, (file, names)) in shard_names.iter().enumerate() {
            let (f, index) = match file.ends_with(".bin") {
                true => (SafetensorsFile::open_torch(dir.join(file))?, TORCH_INDEX),
                false => (SafetensorsFile::open(dir.join(file))?, INDEX),
            };
            for (name, info) in &f.tensors {
                if let Some(want) = names {
                    if !listed.contains(name) {
                        // As the GGUF path refuses unused tensors: the files and the index
                        // disagree, so what the model computes is in doubt.
                        return Err(FormatError::Safetensors(format!(
                            "{file} holds `{name}`, which {index}'s weight_map does not list"
                        )));
                    }
                    if !want.contains(name) {
                        continue; // another shard's per the index (a second copy)
                    }
                }
                let t = HfTensor {
                    shard: i,
                    info: info.clone(),
                };
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(FormatError::DuplicateTensor(name.clone()));
                }
            }
            if let Some(want) = names {
                if let Some(missing) = want.iter().find(|n| !f.tensors.contains_key(*n)) {
                    return Err(FormatError::Safetensors(format!(
                        "{index} puts `{missing}` in {file}, which does not hold it"
                    )));
                }
            }
            shards.push(f);
        }
        Ok(Self {
            dir,
            config,
            shards,
            tensors,
        })
    }

    /// The text of an optional file of the directory (`tokenizer_config.json`, ...).
    pub fn optional_text(&self, name: &str) -> Result<Option<String>> {
        let p = self.dir.join(name);
        if p.is_file() {
            read_text(&p).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The bytes of a tensor (ranges were validated when its shard was parsed).
    pub fn data(&self, t: &HfTensor) -> &[u8] {
        self.shards[t.shard].data(&t.info)
    }

    /// Total bytes of the mapped shards.
    pub fn total_size(&self) -> usize {
        self.shards.iter().map(|s| s.bytes().len()).sum()
    }
}

/// The shard files, each with the tensor names the index assigns it (`None`: a single file).
type Shards = Vec<(String, Option<Vec<String>>)>;

fn shard_names(dir: &Path) -> Result<Shards> {
    let index = dir.join(INDEX);
    if index.is_file() {
        let text = read_text(&index)?;
        return parse_index(&text);
    }
    if dir.join(SINGLE).is_file() {
        return Ok(vec![(SINGLE.to_string(), None)]);
    }
    // PyTorch's files, when there are no safetensors.
    let index = dir.join(TORCH_INDEX);
    if index.is_file() {
        let shards = parse_index(&read_text(&index)?)?;
        if let Some((f, _)) = shards.iter().find(|(f, _)| !f.ends_with(".bin")) {
            return Err(FormatError::Torch(format!(
                "{TORCH_INDEX} names `{f}`, not a .bin shard"
            )));
        }
        return Ok(shards);
    }
    if dir.join(TORCH_SINGLE).is_file() {
        return Ok(vec![(TORCH_SINGLE.to_string(), None)]);
    }
    Err(FormatError::Safetensors(format!(
        "{} has none of {SINGLE}, {INDEX}, {TORCH_SINGLE}, {TORCH_INDEX}",
        dir.display()
    )))
}

/// `{"weight_map": {"tensor": "shard file", ...}}` into shards in first-seen order.
pub fn parse_index(text: &str) -> Result<Shards> {
    let bad = |why: &str| FormatError::Safetensors(format!("{INDEX}: {why}"));
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object"))?;
    let mut shards: Shards = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad("a shard name is not a string"))?;
        // Shards are plain file names inside the directory.
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(bad(&format!(
                "shard name `{file}` is not a file of the directory"
            )));
        }
        match shards.iter_mut().find(|(f, _)| f == file) {
            Some((_, names)) => names.get_or_insert_with(Vec::new).push(name.clone()),
            None => shards.push((file.to_string(), Some(vec![name.clone()]))),
        }
    }
    if shards.is_empty() {
        return Err(bad("`weight_map` is empty"));
    }
    Ok(shards)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_groups_tensors_by_shard() {
        let s =
            parse_index(r#"{"metadata":{},"weight_map":{"a":"s1","b":"s2","c":"s1"}}"#).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].0, "s1");
        assert_eq!(s[0].1.as_ref().unwrap().len(), 2);
        for bad in [
            "{}",
            r#"{"weight_map":{}}"#,
            r#"{"weight_map":{"a":"../x"}}"#,
            r#"{"weight_map":{"a":3}}"#,
            "not json",
        ] {
            assert!(parse_index(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_pickle_file_that_is_not_a_torch_zip_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(CONFIG), "{}").unwrap();
        std::fs::write(d.path().join("pytorch_model.bin"), b"PK").unwrap();
        let e = HfCheckpoint::open(d.path()).err().unwrap().to_string();
        assert!(e.contains("not a PyTorch zip"), "{e}");
    }
}
