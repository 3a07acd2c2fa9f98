//! Replays every committed fuzz input (the seed corpus, tests/fuzz/corpus/<target>/, and the
//! crashes found and fixed, tests/fuzz/regressions/<target>/) through the fuzz targets' bodies.
//! A regression that panics again fails here, under a plain `cargo test`.
#[path = "fuzz/targets.rs"]
mod targets;

use std::path::Path;

/// A target: its name (the folder of its inputs) and its body.
type Target = (&'static str, fn(&[u8]));

const TARGETS: [Target; 6] = [
    ("gguf", targets::gguf),
    ("hf", targets::hf),
    ("torch", targets::torch),
    ("predictors", targets::predictors),
    ("chat_template", targets::chat_template),
    ("request", targets::request),
];

fn inputs(kind: &str, target: &str) -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz")
        .join(kind)
        .join(target);
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn committed_fuzz_inputs_run_without_panics() {
    for (target, run) in TARGETS {
        let seeds = inputs("corpus", target);
        assert!(!seeds.is_empty(), "{target}: no seed corpus");
        let regressions = inputs("regressions", target);
        for p in seeds.iter().chain(&regressions) {
            let data = std::fs::read(p).unwrap();
            let caught = std::panic::catch_unwind(|| run(&data));
            assert!(caught.is_ok(), "{target}: {} panics", p.display());
        }
        println!(
            "{target}: {} seeds, {} regressions",
            seeds.len(),
            regressions.len()
        );
    }
}
