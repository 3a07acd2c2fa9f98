//! The load test of `dejavu serve`: SmolLM2 served as a process (four sequences in one batch), 32 concurrent
//! clients x 8 requests each (chat and completions, streamed and whole, greedy). Every reply
//! must arrive whole and equal, byte for byte, what `dejavu generate` prints with the same
//! settings; the server's anonymous memory must stay flat over the run. Then SIGTERM with
//! streams in flight: each ends with `[DONE]`, and the process exits 0.
//!
//! It prints the p50/p99 latency and the aggregate tok/s: bench figures, not asserted.
mod common;

use common::server::ServerProcess;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLIENTS: usize = 32;
const ROUNDS: usize = 8;
const MAX_TOKENS: usize = 16;
const CTX: &str = "512";
/// Each a question for the chat template and a text to continue.
const PROMPTS: [[&str; 2]; 8] = [
    [
        "Write one sentence about the sea.",
        "The old harbour town woke up slowly, and",
    ],
    ["List three colours.", "My favourite recipe starts with"],
    ["What is a prime number?", "In 1905, the young physicist"],
    ["Give me a name for a cat.", "The train left the station at"],
    ["How do bees make honey?", "def fibonacci(n):"],
    [
        "Translate 'good morning' into French.",
        "Dear customer, we are writing to",
    ],
    [
        "Why is the sky blue?",
        "The three main causes of the war were",
    ],
    [
        "Describe a bicycle in a few words.",
        "Step 1: open the box. Step 2:",
    ],
];

/// Request `i` of client `c`: which prompt, through the chat template or not, streamed or not.
fn case(c: usize, i: usize) -> (usize, bool, bool) {
    (
        (c + i) % PROMPTS.len(),
        (c / 2 + i).is_multiple_of(2),
        c % 2 == 1,
    )
}

/// What `dejavu generate` prints for a prompt (its closing newline taken off).
fn generate(model: &Path, prompt: &str, chat: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dejavu"));
    cmd.args(["generate", "-t", "1", "--ctx", CTX, "--temperature", "0"])
        .args(["-n", &MAX_TOKENS.to_string(), "-p", prompt, "-m"])
        .arg(model);
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap().to_string()
}

/// One request; its text (streamed chunks joined) and the completion tokens.
fn request(base: &str, prompt: &str, chat: bool, stream: bool) -> (String, u64) {
    let (path, mut body) = match chat {
        true => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}]}),
        ),
        false => ("/v1/completions", json!({"prompt": prompt})),
    };
    body["max_tokens"] = json!(MAX_TOKENS);
    body["temperature"] = json!(0);
    body["stream"] = json!(stream);
    body["stream_options"] = json!({"include_usage": stream});
    let resp = ureq::post(&format!("{base}{path}"))
        .timeout(Duration::from_secs(300))
        .send_string(&body.to_string())
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let text_of = |c: &Value| match chat {
        true => c["delta"]["content"]
            .as_str()
            .or(c["message"]["content"].as_str())
            .map(String::from),
        false => c["text"].as_str().map(String::from),
    };
    if !stream {
        let v: Value = resp.into_json().unwrap();
        let text = text_of(&v["choices"][0]).expect("a reply's text");
        return (text, v["usage"]["completion_tokens"].as_u64().unwrap());
    }
    let events = sse_events(resp.into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "ends");
    let chunks: Vec<Value> = (events[..events.len() - 1].iter())
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = (chunks.iter())
        .filter_map(|c| text_of(&c["choices"][0]))
        .collect();
    let usage = chunks.last().unwrap()["usage"]["completion_tokens"].as_u64();
    (text, usage.expect("a usage chunk"))
}

/// The `data:` payloads of a streamed reply, up to `[DONE]`.
fn sse_events(r: impl Read) -> Vec<String> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let Some(data) = line.unwrap().strip_prefix("data: ").map(String::from) else {
            continue;
        };
        let done = data == "[DONE]";
        out.push(data);
        if done {
            break;
        }
    }
    out
}

/// The process's anonymous resident memory (heap and stacks; the mapped weights left out).
fn rss_anon_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (status.lines())
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn thirty_two_clients_get_every_reply_whole_and_equal_to_generate() {
    let model = dejavu::fetch::fetch(dejavu::fetch::DEFAULT_MODEL).unwrap();
    // Prefix reuse off: a prompt computed on cached keys and values of another batch split is
    // the same math in another rounding order, and greedy replies could then part from
    // `generate`'s at near-ties (tests/serve.rs checks reuse itself).
    let args = [
        "--parallel",
        "4",
        "-t",
        "2",
        "--ctx",
        CTX,
        "--no-prefix-reuse",
    ];
    let mut server = ServerProcess::start(&model, &args);
    let pid = server.child.id();
    let base = server.base();

    // The references, while the server warms up.
    let want: Arc<Vec<[String; 2]>> = Arc::new(
        PROMPTS
            .iter()
            .map(|[q, t]| [generate(&model, t, false), generate(&model, q, true)])
            .collect(),
    );
    for [q, _] in PROMPTS.iter().take(2) {
        request(&base, q, true, false);
    }
    let rss_before = rss_anon_kib(pid);
    assert!(
        want.iter().flatten().all(|w| !w.is_empty()),
        "every reference has text to compare: {want:?}"
    );

    let t0 = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (base, want) = (base.clone(), want.clone());
            std::thread::spawn(move || {
                (0..ROUNDS)
                    .map(|i| {
                        let (p, chat, stream) = case(c, i);
                        let t = Instant::now();
                        let prompt = PROMPTS[p][chat as usize ^ 1];
                        let (text, n) = request(&base, prompt, chat, stream);
                        let expected = &want[p][chat as usize];
                        assert_eq!(&text, expected, "client {c} request {i} ({chat}, {stream})");
                        (t.elapsed(), n)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut tokens = 0;
    for c in clients {
        for (d, n) in c.join().expect("a client failed") {
            lat.push(d);
            tokens += n;
        }
    }
    let wall = t0.elapsed();
    let rss_after = rss_anon_kib(pid);
    lat.sort();
    assert_eq!(lat.len(), CLIENTS * ROUNDS, "no request lost");
    println!(
        "load: {} clients x {} requests, {} replies whole and equal to generate; latency p50 {:.2} s, \
         p99 {:.2} s; {tokens} tokens in {:.1} s = {:.1} tok/s aggregate; RssAnon {} -> {} KiB",
        CLIENTS,
        ROUNDS,
        lat.len(),
        percentile(&lat, 0.5).as_secs_f64(),
        percentile(&lat, 0.99).as_secs_f64(),
        wall.as_secs_f64(),
        tokens as f64 / wall.as_secs_f64(),
        rss_before,
        rss_after,
    );
    assert!(
        rss_after < rss_before + 32 * 1024,
        "memory grew over the run: {rss_before} -> {rss_after} KiB"
    );

    // SIGTERM with streams in flight: each ends whole, then the process exits 0.
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let base = base.clone();
            let chat = i % 2 == 0;
            let prompt = PROMPTS[i][chat as usize ^ 1];
            let t = std::thread::spawn(move || request(&base, prompt, chat, true).0);
            (t, &want[i][chat as usize])
        })
        .collect();
    let t = Instant::now();
    loop {
        let h: Value = ureq::get(&format!("{base}/health"))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        let held = h["slots_busy"].as_u64().unwrap() + h["queued"].as_u64().unwrap();
        if held == streams.len() as u64 {
            break; // every stream is queued or generating
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "streams not started: {h}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = server.terminate(Duration::from_secs(60));
    for (s, expected) in streams {
        let text = s.join().expect("a stream in flight at SIGTERM ended whole");
        assert_eq!(&text, expected, "a reply finished in the shutdown grace");
    }
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err(),
        "closed"
    );
}
