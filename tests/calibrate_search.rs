//! `dejavu calibrate` with its default search, end to end (issue 52): on OPT (ReLU)
//! checkpoints the search used to compose candidates the policy parser refuses
//! (`teal:...+lazy-kv`; `wina:...` with a head rule) and exit 1, saving nothing. Now a refused
//! composition is skipped with its reason, and the run saves its predictors and a
//! recommendation. The text and token counts are small (this checks the search's course, not
//! its choice); the search's stages and candidates are the default ones. Every fixture family
//! runs it (OPT's ReLU rules and multi-head attention with the lazy K/V candidates; gated Llama,
//! Mistral, Qwen2/3, Phi-3 and Gemma 2/3 with grouped queries, windows, soft caps, fused and
//! post-norm blocks): 5-10 s each.
mod common;
use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_default_search_completes_on_every_fixture_family() {
    let dir = tempfile::tempdir().unwrap();
    let eval = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/eval.txt");
    let text = dir.path().join("text.txt");
    let head: String = std::fs::read_to_string(eval)
        .unwrap()
        .chars()
        .take(5000)
        .collect();
    std::fs::write(&text, head).unwrap();
    for name in common::HF_FIXTURES {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf")
            .join(name);
        let out = dir.path().join(format!("{name}.preds"));
        let run = Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(["calibrate", "-m"])
            .arg(&model)
            .arg("--data")
            .arg(&text)
            .arg("--out")
            .arg(&out)
            .args(["--sample-tokens", "0", "--validation-tokens", "96"])
            .args(["--mlp-tokens", "192", "--ctx", "64", "-t", "2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{name}: {err}");
        assert!(err.contains("search, stage 3"), "{name}: no search: {err}");
        assert!(err.contains("recommended: "), "{name}: {err}");
        assert!(out.exists(), "{name}: no predictors saved");
    }
}

/// The search validates on text of other domains (a source of the calibration text held out of
/// training whole, and `--validation-file`), and says on stdout which texts its bound was
/// validated on; every candidate is scored on each of them (one perplexity each in its line).
#[test]
fn the_recommendation_is_validated_on_other_domains() {
    let dir = tempfile::tempdir().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let eval = std::fs::read_to_string(root.join("tests/fixtures/hf/eval.txt")).unwrap();
    // Two sources (two files): code and, held out, the project's prose.
    let code = dir.path().join("code.txt");
    std::fs::write(&code, eval.chars().take(6000).collect::<String>()).unwrap();
    let prose = dir.path().join("prose.txt");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    std::fs::write(&prose, readme.chars().take(2500).collect::<String>()).unwrap();
    let other = dir.path().join("other.txt");
    let docs = std::fs::read_to_string(root.join("docs/sparsity.md")).unwrap();
    std::fs::write(&other, docs.chars().take(3000).collect::<String>()).unwrap();
    let out = dir.path().join("p.preds");
    let run = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(["calibrate", "-m"])
        .arg(root.join("tests/fixtures/hf/llama-silu"))
        .arg("--data")
        .args([&code, &prose])
        .arg("--validation-file")
        .arg(&other)
        .arg("--out")
        .arg(&out)
        .args(["--sample-tokens", "0", "--validation-tokens", "128"])
        .args(["--mlp-tokens", "192", "--ctx", "64", "-t", "2"])
        .output()
        .unwrap();
    let (stdout, err) = (
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr),
    );
    assert!(run.status.success(), "{err}");
    let measured = stdout
        .lines()
        .find(|l| l.starts_with("validated (perplexity within"))
        .unwrap_or_else(|| panic!("no bound line: {stdout}"));
    for text in [
        "held-out tail of the calibration text",
        "prose.txt (a source held out of training)",
        "other.txt",
    ] {
        assert!(measured.contains(text), "{text} missing: {measured}");
    }
    // Each candidate's line has one perplexity change per text.
    let line = (err.lines())
        .find(|l| l.trim_start().starts_with("gate-first:0.8"))
        .unwrap_or_else(|| panic!("no candidate line: {err}"));
    let ppl = line
        .split("ppl")
        .nth(1)
        .unwrap()
        .split("kl")
        .next()
        .unwrap();
    assert_eq!(ppl.split_whitespace().count(), 3, "{line}");
}
