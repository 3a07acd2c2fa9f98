//! No lost files (issue 23, items 1-4): an output never replaces an input, quantize's temporary
//! file is unique, concurrent writers of one target never mix, and the caches derived from a
//! model are keyed on every byte of it. Through the `dejavu` binary where a user would see it.
mod common;
use common::*;
use dejavu::model::weights::Model;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tiny(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, tiny_llama_gguf(|_, _| {})).unwrap();
    p
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The layout's matrices, every layer's, concatenated.
fn matrices(l: &dejavu::sparsity::layout::SparseLayout, layers: usize) -> Vec<u8> {
    (0..layers)
        .flat_map(|i| [l.down_t(i).data.to_vec(), l.wo_t(i).data.to_vec()])
        .flatten()
        .collect()
}

fn refused(args: &[&str], keep: &Path) {
    let before = std::fs::read(keep).unwrap();
    let (code, err) = run(args);
    assert_eq!(code, Some(1), "{args:?}: {err}");
    assert!(err.contains("would overwrite the input"), "{args:?}: {err}");
    assert_eq!(
        std::fs::read(keep).unwrap(),
        before,
        "{args:?} changed {keep:?}"
    );
}

/// Item 1: every command that writes refuses an output that is one of its inputs.
#[test]
fn outputs_never_replace_inputs() {
    let d = tempfile::tempdir().unwrap();
    let m = tiny(d.path(), "m.gguf");
    let ms = m.to_str().unwrap();
    let text = d.path().join("t.txt");
    std::fs::write(&text, "some text to score and calibrate on. ".repeat(60)).unwrap();
    let ts = text.to_str().unwrap();
    let calib = [
        "calibrate",
        "-m",
        ms,
        "--data",
        ts,
        "--no-search",
        "--sample-tokens",
        "0",
    ];
    refused(
        &[
            &calib[..],
            &["--mlp-tokens", "0", "--ctx", "32", "--out", ms],
        ]
        .concat(),
        &m,
    );
    refused(
        &[
            &calib[..],
            &["--mlp-tokens", "0", "--ctx", "32", "--out", ts],
        ]
        .concat(),
        &text,
    );
    // Another spelling of the same file.
    let dotted = d.path().join(".").join("m.gguf");
    refused(
        &[
            "calibrate",
            "-m",
            ms,
            "--data",
            ts,
            "--no-search",
            "--out",
            dotted.to_str().unwrap(),
        ],
        &m,
    );
    let bench = [
        "bench", "-m", ms, "-p", "0", "-n", "1", "-r", "1", "-t", "1",
    ];
    refused(&[&bench[..], &["--json", ms]].concat(), &m);
    refused(&[&bench[..], &["--csv", ms]].concat(), &m);
    refused(&[&bench[..], &["--plot", ms]].concat(), &m);
    refused(
        &[
            "perplexity",
            "-m",
            ms,
            "--file",
            ts,
            "--ctx",
            "32",
            "--json",
            ms,
        ],
        &m,
    );
    refused(
        &[
            "perplexity",
            "-m",
            ms,
            "--file",
            ts,
            "--ctx",
            "32",
            "--json",
            ts,
        ],
        &text,
    );
    // `report` writes <model stem>.frontier.{md,json,png} into --out: a text of that name is an
    // input.
    let frontier_md = d.path().join("m.frontier.md");
    std::fs::write(&frontier_md, "text. ".repeat(100)).unwrap();
    refused(
        &[
            "report",
            "-m",
            ms,
            "--ctx",
            "32",
            "--file",
            frontier_md.to_str().unwrap(),
            "--out",
            d.path().to_str().unwrap(),
        ],
        &frontier_md,
    );
    refused(&["quantize", ms, "--type", "q8_0", "--out", ms], &m);
    // A checkpoint directory: a file inside it is an input.
    let ck = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture("llama-silu")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, ck.path().join(f.file_name().unwrap())).unwrap();
    }
    let shard = ck.path().join("model.safetensors");
    refused(
        &[
            "quantize",
            ck.path().to_str().unwrap(),
            "--type",
            "q8_0",
            "--out",
            shard.to_str().unwrap(),
        ],
        &shard,
    );
}

/// Item 2: quantize's temporary file is unique, so an input named like the old fixed temporary
/// name (`<out stem>.partial`) is left alone.
#[test]
fn quantize_never_writes_into_an_existing_file() {
    let d = tempfile::tempdir().unwrap();
    let input = tiny(d.path(), "model.partial");
    let before = std::fs::read(&input).unwrap();
    let out = d.path().join("model.gguf");
    let (code, err) = run(&[
        "quantize",
        input.to_str().unwrap(),
        "--type",
        "f16",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        std::fs::read(&input).unwrap(),
        before,
        "the input was changed"
    );
    Model::load(&out).unwrap();
    // Nothing is left behind but the input and the output.
    let names = names_in(d.path());
    assert_eq!(names, ["model.gguf", "model.partial"]);
}

/// Item 3: two quantize runs to one `--out` at once: the result is one run's whole file, byte
/// for byte, never a mix (3 trials, as the probe ran).
#[test]
fn concurrent_quantize_runs_to_one_output_never_mix() {
    let d = tempfile::tempdir().unwrap();
    let input = fixture("llama-relu");
    let solo = |t: &str| {
        let p = d.path().join(format!("solo-{t}.gguf"));
        let (code, err) = run(&[
            "quantize",
            input.to_str().unwrap(),
            "--type",
            t,
            "-o",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(0), "{err}");
        std::fs::read(p).unwrap()
    };
    let (q8, f16) = (solo("q8_0"), solo("f16"));
    let out = d.path().join("out.gguf");
    for trial in 0..3 {
        let spawn = |t: &str| {
            Command::new(env!("CARGO_BIN_EXE_dejavu"))
                .args([
                    "quantize",
                    input.to_str().unwrap(),
                    "--type",
                    t,
                    "-o",
                    out.to_str().unwrap(),
                ])
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        };
        let (mut a, mut b) = (spawn("q8_0"), spawn("f16"));
        assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
        let got = std::fs::read(&out).unwrap();
        assert!(
            got == q8 || got == f16,
            "trial {trial}: the output is neither run's file"
        );
    }
}

/// Item 4: a same-size edit between the old fingerprint's samples, with the modification time
/// set back, still changes the model's key, and the sparse layout cached from the old weights is
/// not used for the new ones.
#[test]
fn an_edit_the_old_samples_missed_rebuilds_the_cache() {
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture("llama-relu")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
    }
    let shard = d.path().join("model.safetensors");
    let backend = dejavu_backend_cpu::CpuBackend::new(1).unwrap();
    let (fp, layout) = {
        let m = Model::load(d.path()).unwrap();
        let l = dejavu::sparsity::layout::SparseLayout::load_or_build(&m, &backend).unwrap();
        (m.fingerprint().to_string(), matrices(&l, m.config.n_layers))
    };
    // A weight of layer 1's down projection past the first MiB and between two of the old 256
    // samples (1 KiB each, spread evenly): the sampled fingerprint never read it.
    let len = std::fs::metadata(&shard).unwrap().len() as usize;
    let step = len / 256;
    let t = &dejavu_formats::safetensors::SafetensorsFile::open(&shard)
        .unwrap()
        .tensors["model.layers.1.mlp.down_proj.weight"];
    let mut at = (t.start / step + 1) * step + step / 2;
    at -= (at - t.start) % 2; // an f16's first byte
    assert!(at > 1 << 20 && at + 2 <= t.start + t.n_bytes);
    let mtime = std::fs::metadata(&shard).unwrap().modified().unwrap();
    {
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&shard)
            .unwrap();
        let mut b = [0u8; 2];
        f.seek(SeekFrom::Start(at as u64)).unwrap();
        f.read_exact(&mut b).unwrap();
        b[1] ^= 0x10; // an exponent bit of the f16: a large change
        f.seek(SeekFrom::Start(at as u64)).unwrap();
        f.write_all(&b).unwrap();
        f.set_modified(mtime).unwrap();
    }
    assert_eq!(std::fs::metadata(&shard).unwrap().len() as usize, len);
    let m = Model::load(d.path()).unwrap();
    assert_ne!(m.fingerprint(), fp, "the edit kept the model's key");
    let cached = dejavu::sparsity::layout::SparseLayout::load_or_build(&m, &backend).unwrap();
    let fresh = {
        let other = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(d.path()).unwrap() {
            let f = f.unwrap().path();
            if f.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("dejavu.")
            {
                continue;
            }
            std::fs::copy(&f, other.path().join(f.file_name().unwrap())).unwrap();
        }
        let m2 = Model::load(other.path()).unwrap();
        let l = dejavu::sparsity::layout::SparseLayout::load_or_build(&m2, &backend).unwrap();
        matrices(&l, m2.config.n_layers)
    };
    assert!(layout != fresh, "the edit should change the layout");
    assert!(cached.path.is_some(), "the layout is cached on disk");
    assert!(
        matrices(&cached, m.config.n_layers) == fresh,
        "a stale layout was used"
    );
}

/// The cost of keying on every byte: the full hash of each real model (run with --nocapture;
/// the README quotes it). A stamp match (the usual load) costs one `stat` per file.
#[test]
fn hash_cost() {
    for name in [SMOLLM2, QWEN] {
        let m = Model::load(model_path(name)).unwrap();
        let bytes = std::fs::metadata(&m.path).unwrap().len();
        let t0 = std::time::Instant::now();
        let h = m.fingerprint().to_string();
        let dt = t0.elapsed().as_secs_f64();
        eprintln!(
            "{name}: full content hash of {:.1} MB in {:.3} s ({:.1} GB/s): {h}",
            bytes as f64 / 1e6,
            dt,
            bytes as f64 / dt / 1e9
        );
        assert_eq!(h.len(), 32);
    }
}

/// `calibrate` (and the sparse layout it builds) write to the cache directory, never into the
/// model's own directory, unless `--out` says otherwise; `recommended` finds them there.
#[test]
fn derived_files_go_to_the_cache_directory() {
    let home = tempfile::tempdir().unwrap();
    let d = tempfile::tempdir().unwrap();
    let m = tiny(d.path(), "m.gguf");
    let text = d.path().join("t.txt");
    std::fs::write(
        &text,
        "contextual sparsity skips the rows it does not need. ".repeat(100),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .env("DEJAVU_HOME", home.path())
        .args([
            "calibrate",
            "-m",
            m.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
        ])
        .args([
            "--no-search",
            "--sample-tokens",
            "0",
            "--ctx",
            "32",
            "--validation-tokens",
            "64",
        ])
        .args(["--mlp-tokens", "256", "--mlp-rank", "32", "--rank", "32"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let written = PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().next().unwrap());
    assert!(
        written.starts_with(home.path().join("predictors")),
        "{written:?}"
    );
    let names = names_in(d.path());
    assert_eq!(
        names,
        ["m.gguf", "t.txt"],
        "the model's directory was written to"
    );
    // A policy that reads the predictors finds them in the cache.
    let gen = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .env("DEJAVU_HOME", home.path())
        .args([
            "generate",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "2",
            "--sparsity",
            "dejavu:0.5",
        ])
        .output()
        .unwrap();
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    assert!(
        home.path()
            .join("layouts")
            .read_dir()
            .unwrap()
            .next()
            .is_some(),
        "no cached layout"
    );
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
}
