//! `dejavu serve` as a process on a free loopback port, for the tests that talk to it as
//! clients do (the openai package, the load test, the chat page in a browser).
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server process; killed if the test ends before it stops it.
pub struct ServerProcess {
    pub child: Child,
    pub port: u16,
    /// The model id it serves (as `/v1/models` lists it).
    pub model_id: String,
}

impl ServerProcess {
    /// Start `dejavu serve -m model --port P` with `args`; return once it is listening.
    pub fn start(model: &Path, args: &[&str]) -> Self {
        Self::start_named(model.to_str().unwrap(), args)
    }

    /// The same with `-m NAME` as given (a known model name, or a path).
    pub fn start_named(model: &str, args: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .arg("serve")
            .args(args)
            .args(["--port", &port.to_string(), "-m"])
            .arg(model)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let t0 = Instant::now();
        let mut line = String::new();
        while !line.starts_with("serving") {
            line.clear();
            let n = err.read_line(&mut line).unwrap();
            assert!(
                n > 0 && t0.elapsed() < Duration::from_secs(120),
                "no start: {line}"
            );
        }
        let model_id = line.split_whitespace().nth(1).unwrap().to_string();
        // Keep reading its stderr so it never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        Self {
            child,
            port,
            model_id,
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// POST the JSON `body` to `path`: the status and the JSON (or text) answer.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let r = ureq::post(&format!("{}{path}", self.base()))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string());
        let resp = match r {
            Ok(resp) => resp,
            Err(ureq::Error::Status(_, resp)) => resp,
            Err(e) => panic!("POST {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap();
        let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (status, v)
    }

    /// SIGTERM, then the exit status (within `wait`).
    pub fn terminate(&mut self, wait: Duration) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").arg(pid).status().unwrap().success());
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t.elapsed() < wait, "no exit {wait:?} after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
