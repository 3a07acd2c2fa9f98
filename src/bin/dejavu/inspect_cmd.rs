//! `dejavu inspect`: a model's config and tensor table (and a GGUF's metadata), printed so that
//! a closed pipe ends it quietly.
use anyhow::Result;
use std::io::Write;

/// Write `text` to stdout; a closed pipe (`dejavu inspect M | head`) ends quietly.
pub fn print_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// The model's config and tensor table (and a GGUF's metadata), as text.
pub fn cmd_inspect(path: &std::path::Path) -> Result<String> {
    use std::fmt::Write as _;
    let mut s = String::new();
    let row = |s: &mut String, name: &str, ty: &str, dims: String, offset: usize, bytes: usize| {
        let _ = writeln!(s, "{name:40} {ty:6} {dims:>20} {offset:>12} {bytes:>12}");
    };
    if path.is_dir() {
        let ckpt = dejavu_formats::hf::HfCheckpoint::open(path)?;
        let _ = writeln!(
            s,
            "checkpoint: {}  ({} shards, {} bytes)",
            path.display(),
            ckpt.shards.len(),
            ckpt.total_size()
        );
        match dejavu::model::arch::from_hf(&ckpt.config) {
            Ok((c, _)) => {
                let _ = writeln!(s, "config: {c:?}");
            }
            Err(e) => {
                let _ = writeln!(s, "config: not loadable: {e}");
            }
        }
        let _ = writeln!(
            s,
            "\n## tensors\n{:40} {:6} {:>20} {:>12} {:>12}",
            "name", "dtype", "shape", "offset", "bytes"
        );
        let mut names: Vec<_> = ckpt.tensors.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        for (name, t) in names {
            row(
                &mut s,
                name,
                &format!("{:?}", t.info.dtype),
                format!("{:?}", t.info.shape),
                t.info.start,
                t.info.n_bytes,
            );
        }
        return Ok(s);
    }
    let f = dejavu_formats::GgufFile::open(path)?;
    let h = &f.header;
    let _ = writeln!(s, "file: {}  ({} bytes)", path.display(), f.file_size());
    let _ = writeln!(
        s,
        "GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        h.version,
        h.metadata.len(),
        h.tensors.len(),
        h.alignment
    );
    match dejavu::model::config::ModelConfig::from_gguf(h) {
        Ok(c) => {
            let _ = writeln!(s, "config: {c:?}");
        }
        Err(e) => {
            let _ = writeln!(s, "config: not loadable: {e}");
        }
    }
    let _ = writeln!(s, "\n## metadata");
    for (k, v) in &h.metadata {
        let _ = writeln!(s, "{k:48} {}", v.summary(60).replace('\n', "\\n"));
    }
    let _ = writeln!(
        s,
        "\n## tensors\n{:40} {:6} {:>20} {:>12} {:>12}",
        "name", "type", "dims", "offset", "bytes"
    );
    for t in &h.tensors {
        row(
            &mut s,
            &t.name,
            t.ggml_type.name(),
            format!("{:?}", t.dims),
            t.start,
            t.n_bytes,
        );
    }
    Ok(s)
}
