//! Faults that reach the batch thread, against `dejavu serve` as a process on any backend
//! (`tests/device/cuda.rs` on the GPU, `tests/serve_load.rs` on the CPU; `tests/serve.rs` runs
//! the HTTP layer's faults in process on the CPU). Two sequences stepped as one batch:
//! - a client that hangs up mid-stream cancels its reply, and the row beside it goes on whole;
//! - a prompt longer than the context is a 400, and the batch goes on;
//! - a shutdown whose grace runs out ends the streams in flight with an error chunk and
//!   `[DONE]`, and the process exits 0.
//!
//! Replies ignore end-of-generation tokens and run to nearly the context (480 tokens), so that
//! each is still in flight when the fault arrives on a fast device too.
use super::inproc::{metric_in, settles_to, sse_events};
use super::server::ServerProcess;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

const LONG: usize = 480;

/// The faults above on a fixture model (a context of 512) on `backend` (`cpu` or `cuda`).
/// `exact`: a reply in a batch of two equals the reply alone byte for byte (the CPU's batch
/// invariance); otherwise (the GPU: a batch's products round otherwise than one row's) it
/// must end whole, of `max_tokens`.
pub fn on_fixture(model: &Path, backend: &str, exact: bool) {
    let args = [
        "--backend",
        backend,
        "--ctx",
        "512",
        "--parallel",
        "2",
        "-t",
        "2",
    ];
    let grace = ["--shutdown-grace", "0", "--no-prefix-reuse"];
    let mut s = ServerProcess::start(model, &[&args[..], &grace].concat());
    let base = s.base();
    let long = |stream: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": true, "stream": stream})
    };
    let (st, whole) = s.post("/v1/completions", &long(false));
    assert_eq!(st, 200, "{whole}");
    let want = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(whole["usage"]["completion_tokens"], LONG, "{whole}");

    // A hang-up beside a reply in flight: the one cancelled, the other whole.
    std::thread::scope(|scope| {
        let other = scope.spawn(|| streamed(&base, &long(true)));
        let cut = hang_up(s.port, &long(true));
        let t0 = Instant::now();
        while metric(&base, "dejavu_requests_cancelled_total") < 1 {
            assert!(t0.elapsed() < Duration::from_secs(20), "never cancelled");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(cut < LONG, "hung up after {cut} of {LONG} chunks");
        let (text, end) = other.join().unwrap();
        assert_eq!(
            end, "length",
            "the row beside the hang-up ends whole: {text:?}"
        );
        if exact {
            assert_eq!(text, want, "the row beside the hang-up");
        }
    });
    settles_to("dejavu_slots_busy", 0, || {
        metric(&base, "dejavu_slots_busy")
    });

    // A prompt past the context is refused; the batch serves the next request.
    let big = json!({"prompt": "word ".repeat(2000), "max_tokens": 4});
    let (st, v) = s.post("/v1/completions", &big);
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.post("/v1/completions", &long(false));
    assert_eq!((st, v["choices"][0]["text"].as_str()), (200, Some(&*want)));

    // SIGTERM with no grace while two streams run: each ends with an error chunk and [DONE].
    let status = std::thread::scope(|scope| {
        let streams: Vec<_> = (0..2)
            .map(|_| scope.spawn(|| events(&base, &long(true))))
            .collect();
        let t0 = Instant::now();
        while metric(&base, "dejavu_slots_busy") < 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "streams not started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let status = s.terminate(Duration::from_secs(30));
        for t in streams {
            let ev = t.join().unwrap();
            assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
            let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
            assert_eq!(last["error"]["code"], "server_busy", "{last}");
            assert!(
                ev.len() - 2 < LONG,
                "ended after {} of {LONG} chunks",
                ev.len() - 2
            );
        }
        status
    });
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

/// Send a streamed request over a raw connection, read its first chunk, then hang up: the
/// chunks seen by then (at most the first few).
fn hang_up(port: u16, body: &Value) -> usize {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = c.read(&mut buf).unwrap();
    let seen = String::from_utf8_lossy(&buf[..n]);
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    seen.matches("data: ").count()
}

/// A streamed completion's events (data lines, `[DONE]` last).
fn events(base: &str, body: &Value) -> Vec<String> {
    let r = ureq::post(&format!("{base}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    sse_events(r.into_reader())
}

/// A streamed completion's text and finish reason.
fn streamed(base: &str, body: &Value) -> (String, String) {
    let (mut text, mut end) = (String::new(), String::new());
    for e in events(base, body).iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        text.push_str(c["text"].as_str().unwrap_or(""));
        if let Some(r) = c["finish_reason"].as_str() {
            end = r.to_string();
        }
    }
    (text, end)
}

fn metric(base: &str, name: &str) -> u64 {
    let m = ureq::get(&format!("{base}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    metric_in(&m, name)
}
