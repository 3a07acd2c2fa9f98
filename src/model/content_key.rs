//! What files derived from a model (the sparse layout cache, the predictors file) are keyed on.
//!
//! Contract: a cache records the model's [`ContentKey::hash`] (XXH3-128 over every byte of every
//! weight file, plus a checkpoint's `config.json`) and its [`ContentKey::stamp`] (device, inode,
//! size, modification and change times of each file) when it is built. A later load trusts the
//! cache when the stamp is unchanged (a `stat` per file), and otherwise hashes the files again and
//! trusts it only when the hash matches. An edit of any byte changes the change time (`ctime`),
//! which no user call can set back, so it cannot keep a stale cache. The hash is computed at most
//! once per process, and only when a cache is built or a stamp differs.
//!
//! Cost, measured with `cargo test --release --test write_safety -- --nocapture hash_cost`: see
//! the README's "Write safety" section.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Bytes hashed per parallel piece (the pieces' hashes are then hashed in order).
const PIECE: usize = 64 << 20;

pub struct ContentKey {
    /// Bytes that are part of the model but not a weight file (a checkpoint's config text, a
    /// synthetic model's label and seed).
    extra: Vec<u8>,
    files: Vec<PathBuf>,
    stamp: String,
    hash: OnceLock<String>,
}

impl ContentKey {
    /// The key of a model read from `files` (stamped now), with `extra` bytes.
    pub fn new(files: Vec<PathBuf>, extra: Vec<u8>) -> Self {
        let stamp = stamp_of(&files);
        Self {
            extra,
            files,
            stamp,
            hash: OnceLock::new(),
        }
    }

    /// The stamp taken when the model was loaded.
    pub fn stamp(&self) -> &str {
        &self.stamp
    }

    /// The content hash of `bytes` (the mapped files, in order), computed on first use.
    pub fn hash(&self, bytes: &[&[u8]]) -> &str {
        self.hash.get_or_init(|| hash_of(&self.extra, bytes))
    }

    /// Whether a cache that recorded (`hash`, `stamp`) was built from these weights.
    pub fn matches(&self, bytes: &[&[u8]], hash: &str, stamp: &str) -> bool {
        (!self.files.is_empty() && stamp == self.stamp && self.hash.get().is_none_or(|h| h == hash))
            || self.hash(bytes) == hash
    }
}

/// XXH3-128 of `extra`, then of each file's length and the hashes of its 64 MiB pieces (hashed
/// on every core).
pub fn hash_of(extra: &[u8], files: &[&[u8]]) -> String {
    use xxhash_rust::xxh3::xxh3_128;
    let mut acc: Vec<u8> = Vec::new();
    acc.extend_from_slice(&xxh3_128(extra).to_le_bytes());
    for f in files {
        acc.extend_from_slice(&(f.len() as u64).to_le_bytes());
        let pieces: Vec<&[u8]> = f.chunks(PIECE).collect();
        let hashes: Vec<std::sync::OnceLock<u128>> =
            pieces.iter().map(|_| Default::default()).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::thread::scope(|s| {
            for _ in 0..workers.min(pieces.len()) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(p) = pieces.get(i) else { break };
                    let _ = hashes[i].set(xxh3_128(p));
                });
            }
        });
        for h in &hashes {
            acc.extend_from_slice(&h.get().copied().unwrap_or_default().to_le_bytes());
        }
    }
    format!("{:032x}", xxh3_128(&acc))
}

/// `dev:ino:size:mtime:ctime` of each file (nanoseconds), `;`-separated; a file that cannot be
/// read stamps as `?`, which matches no stored stamp.
fn stamp_of(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|p| stat(p).unwrap_or_else(|| "?".into()))
        .collect::<Vec<_>>()
        .join(";")
}

#[cfg(unix)]
fn stat(p: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some(format!(
        "{}:{}:{}:{}.{}:{}.{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// Elsewhere only size and modification time are known: the stamp is weaker, so a differing
/// hash is the real check there too (a stamp match is still trusted).
#[cfg(not(unix))]
fn stat(p: &Path) -> Option<String> {
    let m = std::fs::metadata(p).ok()?;
    let t = m
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    Some(format!("{}:{}", m.len(), t.as_nanos()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_counts() {
        let a = vec![7u8; 3 * 1024 + 5];
        let mut b = a.clone();
        b[2049] ^= 1;
        assert_ne!(hash_of(b"", &[&a]), hash_of(b"", &[&b]));
        assert_ne!(hash_of(b"x", &[&a]), hash_of(b"", &[&a]));
        // The split into files is part of the key.
        assert_ne!(hash_of(b"", &[&a[..10], &a[10..]]), hash_of(b"", &[&a]));
        assert_eq!(hash_of(b"", &[&a]), hash_of(b"", &[&a.clone()]));
    }

    #[test]
    fn an_edit_changes_the_stamp_even_with_the_old_mtime() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("w.bin");
        std::fs::write(&p, [1u8; 4096]).unwrap();
        let before = stamp_of(std::slice::from_ref(&p));
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        {
            use std::io::{Seek, Write};
            let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            f.seek(std::io::SeekFrom::Start(100)).unwrap();
            f.write_all(&[2]).unwrap();
            f.set_modified(mtime).unwrap();
        }
        assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), mtime);
        #[cfg(unix)]
        assert_ne!(stamp_of(std::slice::from_ref(&p)), before);
    }
}
