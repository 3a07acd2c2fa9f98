//! The chat page at `/` in headless Chromium (tests/clients/chat_page.mjs, playwright-core
//! over the system's Chromium): the model's name; settings (max tokens, temperature, system
//! prompt) in the request; a message typed and sent, the reply streamed into the page as
//! markdown (the model's own markup escaped); the theme toggled; a reply stopped mid-stream and
//! the conversation going on; and a screenshot saved to target/chat-page.png. Skipped, with the reason printed, where node,
//! Chromium or playwright-core is missing (`.ci/run` installs them).
mod common;

use common::server::ServerProcess;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_chat_page_streams_a_reply_in_a_browser() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let module = root().join("tests/clients/node_modules/playwright-core");
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|o| o.status.success()) || !Path::new(&chromium).exists() || !module.is_dir()
    {
        return eprintln!(
            "skipped: needs node, Chromium at {chromium} and playwright-core \
             (npm install --prefix tests/clients)"
        );
    }
    let model = root().join("tests/fixtures/hf/llama-silu");
    // Two sequences stepped as one batch: the page runs against continuous batching.
    let mut server = ServerProcess::start(&model, &["--ctx", "256", "-t", "1", "--parallel", "2"]);
    let shot = root().join("target/chat-page.png");
    let _ = std::fs::remove_file(&shot);
    let out = Command::new("node")
        .arg(root().join("tests/clients/chat_page.mjs"))
        .arg(format!("{}/", server.base()))
        .arg(&shot)
        .env("CHROMIUM", &chromium)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the page run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    let reply = v["reply"].as_str().unwrap();
    assert!(!reply.is_empty() && reply != "…", "{v}");
    for check in [
        "model_name",
        "settings",
        "markdown",
        "theme",
        "stop",
        "after_stop",
    ] {
        assert_eq!(v["checks"][check], true, "{check}: {v}");
    }
    assert!(
        v["updates"].as_u64().unwrap() >= 2,
        "the reply came in pieces: {v}"
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5000,
        "a screenshot"
    );
    eprintln!("chat page: {v} (screenshot {})", shot.display());
    assert!(server.terminate(Duration::from_secs(30)).success());
}
