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
