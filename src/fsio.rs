//! How every file the project writes reaches the disk (GGUF, predictors, the sparse layout cache,
//! JSON, CSV, Markdown and PNG reports).
//!
//! Contract:
//! - the bytes go to a unique temporary file in the target's directory, created exclusively
//!   (`tempfile`: `O_EXCL`, a random name), so two runs writing the same target never share a file;
//! - the file is fsynced, then renamed over the target: a reader sees the old file or the whole
//!   new one, and an interrupted run leaves only a `.dejavu-<host>-<pid>-*.tmp` file that
//!   nothing reads (removed on error and on drop; a killed run's by the next write into that
//!   directory, once its process is gone);
//! - an existing file is never opened for writing, and [`refuse_overwrite`] keeps a command's
//!   output from replacing one of its inputs;
//! - the new file gets the permissions any new file does (`0o666` less the umask, on Unix), not
//!   a temporary file's owner-only `0o600`.
use crate::{Error, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// This process's prefix of temporary names: `.dejavu-<host>-<pid>-` (see [`clean_stale`]).
fn temp_prefix() -> String {
    format!(".dejavu-{}-{}-", host(), std::process::id())
}

/// This machine's host name (Linux), or "host".
fn host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = (name.trim().chars())
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '_')
        .collect();
    match name.is_empty() {
        true => "host".into(),
        false => name,
    }
}

/// Remove from `dir` the temporary files of this host's processes that have died (killed before
/// they could remove their own: SIGKILL, or SIGXFSZ past a file-size limit). Best effort, on
/// Linux only: a process is alive while `/proc/<pid>` exists; another host's files, and names
/// without a host and pid (older runs), are left alone.
fn clean_stale(dir: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mine = format!(".dejavu-{}-", host());
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&mine)) else {
            continue;
        };
        let Some(Ok(pid)) = rest.split_once('-').map(|(p, _)| p.parse::<u32>()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A unique temporary file beside `target`, once the stale ones of dead runs are removed.
fn temp_beside(target: &Path, suffix: &str) -> Result<tempfile::NamedTempFile> {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    clean_stale(&dir);
    let prefix = temp_prefix();
    let mut b = tempfile::Builder::new();
    b.prefix(&prefix).suffix(suffix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o666)); // less the umask, at open
    }
    b.tempfile_in(&dir)
        .map_err(|e| io_error(target, "creating a temporary file beside", e))
}

fn io_error(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Invalid(format!("{what} {}: {e}", path.display()))
}

/// Write `target` through `fill`, which writes the whole content to the buffered writer.
pub fn write_with(
    target: &Path,
    fill: impl FnOnce(&mut BufWriter<&File>) -> Result<()>,
) -> Result<()> {
    let tmp = temp_beside(target, ".tmp")?;
    {
        let mut w = BufWriter::new(tmp.as_file());
        // A writer's I/O error (a full disk) names the file it was writing.
        fill(&mut w).map_err(|e| match e {
            Error::Io(e) => io_error(target, "writing", e),
            e => e,
        })?;
        w.flush().map_err(|e| io_error(target, "writing", e))?;
    }
    commit(tmp, target)
}

/// Write `bytes` to `target`.
pub fn write(target: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_with(target, |w| {
        w.write_all(bytes.as_ref())
            .map_err(|e| io_error(target, "writing", e))
    })
}

/// For writers that take a path (a plot's bitmap backend picks the format by the extension):
/// `render` writes to a fresh unique path with `target`'s extension, which then replaces `target`.
pub fn write_via_path(target: &Path, render: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let ext = target
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let tmp = temp_beside(target, &ext)?;
    render(tmp.path())?;
    commit(tmp, target)
}

fn commit(tmp: tempfile::NamedTempFile, target: &Path) -> Result<()> {
    // `render` may have replaced the file at the temporary path; sync what is there now.
    File::open(tmp.path())
        .and_then(|f| f.sync_all())
        .map_err(|e| io_error(target, "syncing", e))?;
    tmp.persist(target)
        .map_err(|e| io_error(target, "renaming into place", e.error))?;
    // The rename itself is durable once the directory is synced (best effort: not every
    // platform can open a directory).
    if let Some(dir) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The largest text file a command reads whole (a corpus, an evaluation text).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// The UTF-8 text of `path`, reading at most `limit` bytes (a device like `/dev/zero` never
/// ends). `truncate`: past `limit` the text is cut there (at a character boundary), for a
/// reader that needs only a prefix; otherwise a longer file is an error.
pub fn read_text(path: &Path, limit: u64, truncate: bool) -> Result<String> {
    use std::io::Read;
    let f = File::open(path).map_err(|e| io_error(path, "reading", e))?;
    let mut bytes = Vec::new();
    f.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, "reading", e))?;
    if bytes.len() as u64 > limit {
        if !truncate {
            return Err(Error::Invalid(format!(
                "{} is larger than {limit} bytes, the most read as a text",
                path.display()
            )));
        }
        bytes.truncate(limit as usize);
        let keep = match std::str::from_utf8(&bytes) {
            Ok(_) => bytes.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(), // a cut character
            Err(_) => bytes.len(),
        };
        bytes.truncate(keep);
    }
    String::from_utf8(bytes)
        .map_err(|e| Error::Invalid(format!("{} is not UTF-8 text: {e}", path.display())))
}

/// Whether `a` and `b` name the same file (the same inode where both exist, else the same
/// canonical path).
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    match (canonical(a), canonical(b)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// The canonical path of `p`, or of its parent joined with its name when `p` does not exist.
fn canonical(p: &Path) -> Option<PathBuf> {
    if let Ok(c) = p.canonicalize() {
        return Some(c);
    }
    let parent = match p.parent() {
        Some(x) if !x.as_os_str().is_empty() => x.canonicalize().ok()?,
        _ => std::env::current_dir().ok()?,
    };
    Some(parent.join(p.file_name()?))
}

/// Refuse an output file (`flag` names it) that cannot be written where it says, before any
/// work: an existing directory, or a path whose folder does not exist.
pub fn refuse_unwritable(flag: &str, out: &Path) -> Result<()> {
    if out.is_dir() {
        return Err(Error::Invalid(format!(
            "{flag} {} is a directory; give the output file's path",
            out.display()
        )));
    }
    match out.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) if !dir.is_dir() => Err(Error::Invalid(format!(
            "{flag} {}: the folder {} does not exist",
            out.display(),
            dir.display()
        ))),
        _ => Ok(()),
    }
}

/// Refuse an output (`flag` names it in the error) that would replace `input`: the same file, or,
/// for an input directory (a checkpoint), the directory itself or an existing file inside it.
pub fn refuse_overwrite(flag: &str, out: &Path, input: &Path) -> Result<()> {
    let clash = if input.is_dir() {
        same_file(out, input)
            || (out.exists()
                && out.parent().map(|p| canonical(p) == canonical(input)) == Some(true))
    } else {
        same_file(out, input)
    };
    if clash {
        return Err(Error::Invalid(format!(
            "{flag} {} would overwrite the input {}",
            out.display(),
            input.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 52: a run killed mid-write (SIGXFSZ) left its temporary file forever: the next
    /// write into that directory removes this host's temporaries of dead processes, and keeps
    /// a live process's, another host's and an old-style name.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_write_removes_the_temporaries_of_dead_runs() {
        let d = tempfile::tempdir().unwrap();
        let dead = format!(".dejavu-{}-999999999-abc.tmp", host());
        let keep = [
            format!(".dejavu-{}-1-abc.tmp", host()),
            ".dejavu-otherhost-999999999-abc.tmp".to_string(),
            ".dejavu-abc.tmp".to_string(),
        ];
        for n in keep.iter().chain([&dead]) {
            std::fs::write(d.path().join(n), b"partial").unwrap();
        }
        write(&d.path().join("out.json"), b"{}").unwrap();
        assert!(!d.path().join(&dead).exists());
        for n in &keep {
            assert!(d.path().join(n).exists(), "{n} removed");
        }
    }

    /// Issue 52: a full disk (ENOSPC) while a writer fills the file is an error naming the
    /// target, and leaves neither the target nor a temporary file.
    #[test]
    fn a_full_disk_names_the_file() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("out.gguf");
        let full = std::io::Error::from_raw_os_error(28);
        let e = write_with(&target, |_| Err(Error::Io(full))).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("out.gguf") && msg.contains("writing"), "{msg}");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_write_replaces_the_target_whole_and_leaves_no_temporary_file() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("out.json");
        std::fs::write(&t, b"old old old old").unwrap();
        write(&t, b"new").unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "only the target remains");
    }

    /// A written file (and a rendered one) has the mode a plain new file gets under this
    /// process's umask, not the temporary file's `0o600`.
    #[cfg(unix)]
    #[test]
    fn a_written_file_has_a_new_files_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let plain = d.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let (t, r) = (d.path().join("out.json"), d.path().join("plot.png"));
        write(&t, b"{}").unwrap();
        write_via_path(&r, |p| Ok(std::fs::write(p, b"png")?)).unwrap();
        assert_eq!(mode(&t), mode(&plain), "a written file");
        assert_eq!(mode(&r), mode(&plain), "a rendered file");
        if mode(&plain) == 0o600 {
            eprintln!("under umask 077 every new file is 0o600: the check above cannot fail");
        }
    }

    #[test]
    fn a_failed_fill_keeps_the_old_file_and_removes_the_temporary_one() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("model.gguf");
        std::fs::write(&t, b"precious").unwrap();
        let r = write_with(&t, |w| {
            w.write_all(b"half").unwrap();
            Err(Error::Invalid("interrupted".into()))
        });
        assert!(r.is_err());
        assert_eq!(std::fs::read(&t).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn concurrent_writers_of_one_target_never_mix() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("out.bin");
        std::thread::scope(|s| {
            for k in 0..8u8 {
                let t = &t;
                s.spawn(move || {
                    for _ in 0..20 {
                        write(t, vec![k; 64 * 1024]).unwrap();
                    }
                });
            }
        });
        let got = std::fs::read(&t).unwrap();
        assert_eq!(got.len(), 64 * 1024);
        assert!(got.iter().all(|&b| b == got[0]), "one writer's bytes only");
    }

    #[test]
    fn outputs_that_replace_an_input_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("m.gguf");
        std::fs::write(&m, b"x").unwrap();
        assert!(refuse_overwrite("--out", &m, &m).is_err());
        // Another spelling of the same file.
        let other = d.path().join(".").join("m.gguf");
        assert!(refuse_overwrite("--out", &other, &m).is_err());
        #[cfg(unix)]
        {
            let link = d.path().join("link.gguf");
            std::os::unix::fs::symlink(&m, &link).unwrap();
            assert!(refuse_overwrite("--out", &link, &m).is_err());
        }
        assert!(refuse_overwrite("--out", &d.path().join("new.gguf"), &m).is_ok());
        // A checkpoint directory: its own files are inputs; a new name beside them is not.
        let ck = d.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        std::fs::write(ck.join("model.safetensors"), b"x").unwrap();
        assert!(refuse_overwrite("--out", &ck.join("model.safetensors"), &ck).is_err());
        assert!(refuse_overwrite("--out", &ck, &ck).is_err());
        assert!(refuse_overwrite("--out", &ck.join("q8.gguf"), &ck).is_ok());
        // Issue 52: a directory, or a file in a folder that is not there, before any work.
        assert!(refuse_unwritable("--out", &ck).is_err());
        assert!(refuse_unwritable("--out", &ck.join("no/such.gguf")).is_err());
        assert!(refuse_unwritable("--out", &ck.join("q8.gguf")).is_ok());
        assert!(refuse_unwritable("--out", Path::new("q8.gguf")).is_ok());
    }
}
