//! The official `openai` Python package (tests/clients/openai_client.py) against `dejavu serve`
//! started as a process on a free loopback port, on a tiny Hugging Face fixture. Skipped, with
//! the reason printed, where Python or the package is missing (`.ci/run` installs it).
mod common;

use common::server::ServerProcess;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run the client script `script` (tests/clients) against `dejavu serve` on `model` with
/// `args`, then stop the server with SIGTERM: the client and the exit must succeed. Skipped,
/// saying so, without Python's `openai` package.
fn client_against_server(model: &std::path::Path, args: &[&str], script: &str) {
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return eprintln!(
            "skipped: python3 with the `openai` package not found (pip install openai)"
        );
    }
    let mut server = ServerProcess::start(model, args);
    let out = Command::new("python3")
        .arg(root().join("tests/clients").join(script))
        .arg(format!("{}/v1", server.base()))
        .arg(&server.model_id)
        .output()
        .unwrap();
    // SIGTERM: a clean exit (status 0) after the requests above.
    let status = server.terminate(Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the client failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", text.trim());
    assert!(
        status.success(),
        "the server's exit after SIGTERM: {status}"
    );
}

#[test]
fn the_openai_package_talks_to_the_server() {
    let model = root().join("tests/fixtures/hf/llama-silu");
    let args = ["--ctx", "128", "-t", "1", "--parallel", "3"];
    client_against_server(&model, &args, "openai_client.py");
}

/// Tool calling with the `openai` package (tests/clients/openai_tools.py) against `dejavu serve`
/// on Qwen2.5-Coder-0.5B-Instruct, whose chat template renders tools: `auto`, `required`, a
/// named function, streamed calls, a tool's result sent back, `none`, and bad tool requests.
#[test]
fn tool_calls_with_the_openai_package() {
    let model = common::model_path(common::QWEN);
    client_against_server(&model, &["--ctx", "1024", "-t", "2"], "openai_tools.py");
}
