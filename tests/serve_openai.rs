//! The official `openai` Python package (tests/clients/openai_client.py) against `dejavu serve`
//! started as a process on a free loopback port, on a tiny Hugging Face fixture. Skipped, with
//! the reason printed, where Python or the package is missing (`.ci/run` installs it).
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The server process, killed if the test fails before it stops it.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_openai_package_talks_to_the_server() {
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return eprintln!(
            "skipped: python3 with the `openai` package not found (pip install openai)"
        );
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let model = root().join("tests/fixtures/hf/llama-silu");
    let mut server = Kill(
        Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args([
                "serve",
                "--port",
                &port.to_string(),
                "--ctx",
                "128",
                "-t",
                "1",
                "-m",
            ])
            .arg(&model)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let server = &mut server.0;
    // Wait for the "serving" line (the model id is the last path part, as /v1/models lists).
    let mut err = BufReader::new(server.stderr.take().unwrap());
    let t0 = Instant::now();
    let mut line = String::new();
    while !line.starts_with("serving") {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 || t0.elapsed() > Duration::from_secs(60) {
            panic!("the server did not start: {line}");
        }
    }
    let id = line.split_whitespace().nth(1).unwrap().to_string();
    let out = Command::new("python3")
        .arg(root().join("tests/clients/openai_client.py"))
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .arg(&id)
        .output()
        .unwrap();
    // SIGTERM: a clean exit (status 0) after the requests above.
    let _ = Command::new("kill").arg(server.id().to_string()).status();
    let status = server.wait().unwrap();
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
