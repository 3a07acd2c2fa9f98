//! `dejavu serve` in-process on loopback (a tiny Hugging Face fixture, one slot): the routes,
//! greedy replies equal to `generate` with the same settings (whole and streamed), stop
//! sequences, errors in OpenAI's shape with their status, the API key, a client that hangs up
//! mid-stream (its slot comes back), a shutdown that lets an in-flight stream finish, and faults:
//! slow headers and bodies, oversize and deeply nested JSON, a connection flood, and a shutdown
//! whose grace runs out. The hang-up and fault tests run again with two slots stepped as one
//! batch (continuous batching), and five concurrent chats under batching equal `generate`.
mod common;
use common::inproc::*;
use dejavu::serve::Limits;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

#[test]
fn the_server_answers_like_generate_and_refuses_bad_requests() {
    let s = Server::start(None, false);
    let (st, health) = s.get("/health");
    assert_eq!(st, 200, "{health}");
    let (st, models) = s.get("/v1/models");
    assert!(st == 200 && models.contains("\"tiny\""), "{models}");
    let (st, page) = s.get("/");
    assert!(
        st == 200 && page.contains("/v1/chat/completions"),
        "the chat page"
    );

    // A greedy chat reply equals `generate`'s, whole and streamed.
    let msgs = [("user", "Tell me a story")];
    let (want, n) = reference(&msgs, 12);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 12, "temperature": 0});
    let (st, v) = s.post("/v1/chat/completions", &body.to_string(), None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], n);
    let finish = if n == 12 { "length" } else { "stop" };
    assert_eq!(v["choices"][0]["finish_reason"], finish);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let resp = s
        .agent
        .post(&s.url("/v1/chat/completions"))
        .send_string(&sb.to_string())
        .unwrap();
    assert!(resp.content_type().contains("text/event-stream"));
    let events = sse_events(resp.into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = (events.iter().rev().skip(1).rev())
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want, "streamed text");
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        finish
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], n);

    // A completion with a stop sequence: the text before it, finish_reason `stop`.
    let c = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0});
    let (st, v) = s.post("/v1/completions", &c.to_string(), None);
    assert_eq!((st, &v["object"]), (200, &json!("text_completion")), "{v}");
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(full.chars().count() > 4, "a reply to cut: {full:?}");
    let stop: String = full.chars().skip(2).take(2).collect();
    let at = full.find(&stop).unwrap();
    let mut cs = c.clone();
    cs["stop"] = json!([stop, "\u{1}never"]);
    let (st, v) = s.post("/v1/completions", &cs.to_string(), None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], &full[..at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Errors: OpenAI's shape, the right status.
    let long = "word ".repeat(N_CTX * 2);
    for (path, body, status) in [
        ("/v1/chat/completions", "{not json".to_string(), 400),
        ("/v1/chat/completions", "\u{feff}".to_string(), 400),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 17}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            404,
        ),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400),
        ("/v1/completions", "x".repeat(5000), 413),
        ("/v1/nowhere", "{}".to_string(), 404),
    ] {
        let (st, v) = s.post(path, &body, None);
        assert_eq!(st, status, "{path} {}: {v}", &body[..body.len().min(60)]);
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let raw = {
        let mut c = TcpStream::connect(s.addr).unwrap();
        let body = b"{\"prompt\": \"\xff\xfe\"}";
        write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).unwrap();
        c.write_all(body).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    };
    assert!(raw.starts_with("HTTP/1.1 400"), "invalid UTF-8: {raw}");
    let (st, m) = s.get("/metrics");
    assert!(st == 200 && m.contains("dejavu_requests_total"), "{m}");

    // Shutdown with a stream in flight: the stream ends with [DONE], the server returns.
    let mut long_req = sb.clone();
    long_req["max_tokens"] = json!(60);
    long_req["temperature"] = json!(0.8);
    let reader = s
        .agent
        .post(&s.url("/v1/chat/completions"))
        .send_string(&long_req.to_string())
        .unwrap()
        .into_reader();
    let stopper = std::thread::spawn(move || s.shutdown());
    let events = sse_events(reader);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "the in-flight stream ended whole"
    );
    stopper.join().unwrap().unwrap();
}

/// A client that hangs up mid-stream cancels its reply (of up to 80 tokens at >= 5 ms each):
/// the slot comes back at once, counted as cancelled, and serves the next request.
#[test]
fn a_client_that_hangs_up_frees_its_slot() {
    hangs_up(Server::start(None, true));
}

/// The same with two slots stepped as one batch: the sequence left waits for no other.
#[test]
fn a_client_that_hangs_up_frees_its_slot_under_batching() {
    hangs_up(Server::batched(2, N_CTX, true, Limits::default()));
}

fn hangs_up(s: Server) {
    // Greedy, this prompt's reply runs past 80 tokens (no end token to stop it sooner).
    assert_eq!(
        reference(&[("user", "Count")], 80).1,
        80,
        "a reply long enough to cut"
    );
    let t0 = Instant::now();
    {
        let mut c = TcpStream::connect(s.addr).unwrap();
        let body = json!({"messages": [{"role": "user", "content": "Count"}], "max_tokens": 80, "temperature": 0, "stream": true})
        .to_string();
        write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut buf = [0u8; 256];
        let _ = c.read(&mut buf).unwrap();
    }
    loop {
        if counter(&s, "dejavu_requests_cancelled_total") == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the reply was never cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    settles(&s, "dejavu_slots_busy", 0);
    assert!(
        t0.elapsed() < Duration::from_millis(80 * 5),
        "cancelled after {:?}: sooner than the whole reply would take",
        t0.elapsed()
    );
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).to_string();
    assert_eq!(s.post("/v1/chat/completions", &body, None).0, 200);
    s.shutdown().unwrap();
}

#[test]
fn an_api_key_guards_the_v1_routes() {
    let s = Server::start(Some("sesame"), false);
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let (st, v) = s.post("/v1/chat/completions", &body, None);
    assert_eq!(st, 401, "{v}");
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(s.post("/v1/chat/completions", &body, Some("wrong")).0, 401);
    assert_eq!(s.post("/v1/chat/completions", &body, Some("sesame")).0, 200);
    assert_eq!(s.get("/v1/models").0, 401);
    // Issue 52: what the slots are doing is behind the key too.
    assert_eq!(s.get("/slots").0, 401, "/slots needs the key");
    assert_eq!(s.get("/health").0, 200, "health needs no key");
    s.shutdown().unwrap();
}

/// Item 7 of issue 23: the key is checked on the headers, before any body byte is read: a
/// request that announces a 1 MiB body and sends none is answered 401 at once (not after the
/// read timeout), and refused requests are not counted as requests.
#[test]
fn the_key_is_checked_before_the_body_is_read() {
    let s = Server::start(Some("sesame"), false);
    let before = counter(&s, "dejavu_requests_total");
    let head =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: 1000000\r\n\r\n";
    let t0 = Instant::now();
    let (reply, _) = raw(s.addr, head, Duration::from_secs(3));
    assert!(reply.starts_with("HTTP/1.1 401"), "{reply}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string();
    for _ in 0..5 {
        assert_eq!(s.post("/v1/chat/completions", &body, Some("wrong")).0, 401);
    }
    assert_eq!(
        counter(&s, "dejavu_requests_total"),
        before,
        "refused requests were counted"
    );
    assert_eq!(s.post("/v1/chat/completions", &body, Some("sesame")).0, 200);
    assert_eq!(counter(&s, "dejavu_requests_total"), before + 1);
    s.shutdown().unwrap();
}

/// Item 14: a field that asks for what the server does not do is a 400 naming it; the neutral
/// values clients send by default are accepted. The sampling fields it does take are 400s
/// naming them when out of range.
#[test]
fn unsupported_fields_are_refused_by_name_unless_neutral() {
    let s = Server::start(None, false);
    let base = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        s.post("/v1/chat/completions", &b.to_string(), None)
    };
    let asks = [
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("tool_choice", json!("required")),
        ("response_format", json!({"type": "xml"})),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        ),
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3.0)),
        ("top_logprobs", json!(21)),
        ("logprobs", json!(3)),
        ("logit_bias", json!({"x": 1})),
        ("logit_bias", json!({"5": -101})),
        ("min_p", json!(1.5)),
        ("repeat_penalty", json!(0)),
        // Issue 52: OpenAI fields for what this server does not do.
        ("prediction", json!({"type": "content", "content": "x"})),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
    ];
    for (k, v) in asks {
        let (st, e) = with(k, v.clone());
        assert_eq!(st, 400, "{k}: {v}: {e}");
        assert_eq!(e["error"]["param"], k, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(k), "{e}");
    }
    let taken = [
        ("logprobs", json!(false)),
        ("logprobs", json!(true)),
        ("top_logprobs", json!(0)),
        ("logit_bias", json!({})),
        ("logit_bias", json!({"15": 100})),
        ("tools", json!([])),
        ("tool_choice", json!("none")),
        ("response_format", json!({"type": "text"})),
        ("response_format", json!({"type": "json_object"})),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-1.0)),
        ("logprobs", Value::Null),
        ("ignore_eos", json!(true)),
        ("cache_prompt", json!(false)),
        ("modalities", json!(["text"])),
        ("prediction", Value::Null),
    ];
    for (k, v) in taken {
        let (st, e) = with(k, v.clone());
        assert_eq!(st, 200, "{k}: {v}: {e}");
    }
    // Issue 52: a key named twice, at any depth, is a 400 (not the last one silently).
    for body in [
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 9}"#,
        r#"{"messages": [{"role": "user", "role": "system", "content": "hi"}], "max_tokens": 1}"#,
    ] {
        let (st, e) = s.post("/v1/chat/completions", body, None);
        assert_eq!(st, 400, "{body}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("appears twice"),
            "{e}"
        );
    }
    // Embeddings: no shortened `dimensions`, no empty input.
    for (body, param) in [
        (json!({"input": "hi", "dimensions": 8}), "dimensions"),
        (json!({"input": ""}), "input"),
        (json!({"input": ["a", ""]}), "input"),
    ] {
        let (st, e) = s.post("/v1/embeddings", &body.to_string(), None);
        assert_eq!(st, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    s.shutdown().unwrap();
}

/// Item 9: the model answers to every name it was launched or fetched by.
#[test]
fn the_model_answers_to_its_names() {
    let names = dejavu::serve::model_names(
        &["my-alias".into()],
        "smollm2-135m-instruct",
        std::path::Path::new("/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    );
    assert_eq!(
        names,
        [
            "my-alias",
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct.Q4_1"
        ]
    );
    // Through the binary: launched by its fetch name, asked for by each name.
    let mut srv = common::server::ServerProcess::start_named(
        "smollm2-135m-instruct",
        &["--alias", "assistant"],
    );
    let agent = ureq::AgentBuilder::new().build();
    let ask = |model: &str| {
        let body = json!({"model": model, "prompt": "Hi", "max_tokens": 1});
        match agent
            .post(&format!("{}/v1/completions", srv.base()))
            .send_json(body)
        {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(st, _)) => st,
            Err(e) => panic!("{e}"),
        }
    };
    for n in [
        "assistant",
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct.Q4_1",
    ] {
        assert_eq!(ask(n), 200, "{n}");
    }
    assert_eq!(ask("gpt-4"), 404);
    let listed: Value = agent
        .get(&format!("{}/v1/models", srv.base()))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(listed["data"][0]["id"], "assistant");
    assert!(srv.terminate(Duration::from_secs(30)).success());
}

/// Item 8: a key no client can send is refused at start.
#[test]
fn a_whitespace_api_key_is_refused() {
    for key in [" ", "\t", " sesame", "sesame "] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args([
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                "0",
                "--api-key",
                key,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{key:?}: {err}");
        assert!(err.contains("--api-key"), "{key:?}: {err}");
    }
}

/// Write `sent` on a fresh connection, then read until the server closes it (at most `wait`):
/// what came back, and when the connection ended (`None`: still open at `wait`).
fn raw(addr: SocketAddr, sent: &[u8], wait: Duration) -> (String, Option<Duration>) {
    let t0 = Instant::now();
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(wait)).unwrap();
    c.write_all(sent).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let ended = loop {
        match c.read(&mut buf) {
            Ok(0) => break Some(t0.elapsed()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break Some(t0.elapsed()),
            Err(_) => break None,
        }
    };
    (String::from_utf8_lossy(&out).into_owned(), ended)
}

/// Whether the server closes `c` within `wait` (it sent nothing); `Duration::ZERO` asks
/// without waiting.
fn closed_within(c: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 64];
    if wait.is_zero() {
        c.set_nonblocking(true).unwrap();
    } else {
        c.set_read_timeout(Some(wait)).unwrap();
    }
    let closed = match c.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => panic!("the server sent bytes to an idle connection"),
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    c.set_nonblocking(false).unwrap();
    closed
}

/// Faults a server on an edge box meets, each with a bound: the server keeps serving the next
/// client after every one, and its slot is free at the end.
#[test]
fn faults_are_bounded_and_the_server_keeps_serving() {
    faults(|limits| Server::with_limits(None, true, limits));
}

/// The same faults with two slots stepped as one batch.
#[test]
fn faults_are_bounded_under_batching() {
    faults(|limits| Server::batched(2, N_CTX, true, limits));
}

fn faults(start: impl Fn(Limits) -> Server) {
    let limits = Limits {
        max_connections: 6,
        // Long enough that the idle connections of the flood below still hold their places
        // when the one past the limit arrives, on a busy machine too.
        read_timeout: Duration::from_secs(3),
        stall_timeout: Duration::from_secs(1),
        shutdown_grace: Duration::from_millis(300),
    };
    let s = start(limits);
    let ok = |s: &Server| {
        let body =
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
        let (st, v) = s.post("/v1/chat/completions", &body, None);
        assert_eq!(st, 200, "still serving: {v}");
    };
    let wait = Duration::from_secs(10);

    // Slowloris: headers that never end are cut at the read timeout.
    let (_, ended) = raw(
        s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
        wait,
    );
    let ended = ended.expect("a connection with unfinished headers is closed");
    assert!(
        ended >= limits.read_timeout - Duration::from_millis(100)
            && ended < limits.read_timeout + Duration::from_secs(4),
        "{ended:?}"
    );
    // A body that stops short of its length: 408 at the read timeout.
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
    let (out, ended) = raw(s.addr, head.as_bytes(), wait);
    assert!(out.starts_with("HTTP/1.1 408"), "slow body: {out}");
    assert!(ended.is_some(), "the slow body's connection closes");
    // A body announced as huge: 413 before anything is read.
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n";
    let (out, _) = raw(s.addr, head.as_bytes(), wait);
    assert!(
        out.starts_with("HTTP/1.1 413"),
        "huge Content-Length: {out}"
    );
    // Deeply nested JSON and a wrong Content-Type are 400s, not crashes.
    let nested = format!("{{\"prompt\": {}1{}}}", "[".repeat(1500), "]".repeat(1500));
    let (st, v) = s.post("/v1/completions", &nested, None);
    assert_eq!(st, 400, "{v}");
    let (st, v) = s.post(
        "/v1/completions",
        r#"{"prompt": 5, "max_tokens": 1e999}"#,
        None,
    );
    assert_eq!(st, 400, "{v}");
    ok(&s);

    // A flood of idle connections: while `max_connections` are open, each one past them is
    // closed at once, and once the idle ones time out the server serves again. The test's
    // agent keeps no connection, so the open ones are the flood's.
    let probe = Duration::from_millis(150);
    let mut idle = Vec::new();
    let refused = loop {
        let mut c = TcpStream::connect(s.addr).unwrap();
        if closed_within(&mut c, probe) {
            break idle.len();
        }
        idle.push(c);
        assert!(
            idle.len() <= limits.max_connections,
            "past the limit, still open"
        );
    };
    assert_eq!(refused, limits.max_connections, "refused before the limit");
    let (out, ended) = raw(s.addr, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", wait);
    assert!(out.is_empty(), "over the limit: {out}");
    assert!(
        ended.is_some_and(|e| e < Duration::from_millis(500)),
        "{ended:?}"
    );
    // The flood was still open while the ones past it were refused (a stalled machine would
    // have let the read timeout close it first, and the check above would prove nothing).
    for c in &mut idle {
        assert!(
            !closed_within(c, Duration::ZERO),
            "an idle connection closed early"
        );
    }
    std::thread::sleep(limits.read_timeout + Duration::from_millis(300));
    ok(&s);
    drop(idle);

    // A client that hangs up while a whole (not streamed) reply is generated cancels it.
    let cancelled = counter(&s, "dejavu_requests_cancelled_total");
    let body = json!({"messages": [{"role": "user", "content": "Count"}], "max_tokens": 80,
        "temperature": 0})
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (_, ended) = raw(s.addr, req.as_bytes(), Duration::from_millis(100));
    assert!(ended.is_none(), "still generating when the client leaves");
    let t0 = Instant::now();
    while counter(&s, "dejavu_requests_cancelled_total") == cancelled {
        assert!(t0.elapsed() < Duration::from_secs(10), "never cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
    ok(&s);
    settles(&s, "dejavu_slots_busy", 0);

    // Shutdown whose grace runs out: a long stream ends with an error chunk and [DONE], and
    // the server returns.
    let long = json!({"messages": [{"role": "user", "content": "Count"}], "max_tokens": 80,
        "temperature": 0, "stream": true})
    .to_string();
    let reader = s
        .agent
        .post(&s.url("/v1/chat/completions"))
        .send_string(&long)
        .unwrap()
        .into_reader();
    let t0 = Instant::now();
    let stopper = std::thread::spawn(move || s.shutdown());
    let events = sse_events(reader);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["code"], "server_busy", "{last}");
    stopper.join().unwrap().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
}

/// A chat that continues finds its history in the slot's cache: only the new turn is computed,
/// and the reply is still the one a fresh `generate` gives.
#[test]
fn a_continued_chat_reuses_its_history() {
    let s = Server::start(None, false);
    let chat = |msgs: &[(&str, &str)]| {
        let m: Vec<Value> = (msgs.iter())
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let body = json!({"messages": m, "max_tokens": 10, "temperature": 0});
        let (st, v) = s.post("/v1/chat/completions", &body.to_string(), None);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let first = [("user", "Tell me a story")];
    let a = chat(&first);
    assert_eq!(a, reference(&first, 10).0);
    assert_eq!(counter(&s, "dejavu_prompt_tokens_reused_total"), 0);
    let second = [
        ("user", "Tell me a story"),
        ("assistant", &a),
        ("user", "And then?"),
    ];
    let b = chat(&second);
    assert_eq!(b, reference(&second, 10).0, "the reply on a reused prefix");
    let reused = counter(&s, "dejavu_prompt_tokens_reused_total");
    assert!(
        reused >= 5,
        "the first turn's tokens came from the cache: {reused}"
    );
    // Another conversation shares only the template's start; it is still answered right.
    let other = [("user", "Count")];
    assert_eq!(chat(&other), reference(&other, 10).0);
    s.shutdown().unwrap();
}

/// Three slots stepped as one batch (sequences of 320 positions), five greedy chats at once,
/// whole and streamed, one with a prompt longer than a prefill chunk (the harness's
/// `PROMPT_CHUNK`, so it is prefilled between the others' steps): every reply is the one
/// `generate` gives alone.
#[test]
fn concurrent_replies_under_batching_equal_generate() {
    let long = "Tell me about the sea, the wind and the old harbour town. ".repeat(12);
    let chats: Vec<String> = ["Count", "Tell me a story", "hi", &long, "Why?"]
        .iter()
        .map(|c| c.to_string())
        .collect();
    let s = Server::batched(3, 320, false, Limits::default());
    let eng = engine_of(320);
    let prompt_len = |c: &str| {
        let msgs = vec![("user".to_string(), c.to_string())];
        let text = eng.tokenizer.apply_chat_template(&msgs).unwrap();
        eng.tokenizer.encode(&text).unwrap().len()
    };
    assert!(
        prompt_len(&long) > PROMPT_CHUNK,
        "the long prompt spans chunks"
    );
    let url = s.url("/v1/chat/completions");
    let replies: Vec<_> = (chats.iter().enumerate())
        .map(|(i, c)| {
            let (url, c) = (url.clone(), c.clone());
            std::thread::spawn(move || {
                let body = json!({"messages": [{"role": "user", "content": c}],
                    "max_tokens": 24, "temperature": 0, "stream": i % 2 == 1});
                let r = ureq::post(&url).send_string(&body.to_string()).unwrap();
                let text = match i % 2 {
                    0 => {
                        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                        v["choices"][0]["message"]["content"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    }
                    _ => (sse_events(r.into_reader()).iter())
                        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                        .filter_map(|v| {
                            v["choices"][0]["delta"]["content"]
                                .as_str()
                                .map(String::from)
                        })
                        .collect::<String>(),
                };
                (c, text)
            })
        })
        .collect();
    for r in replies {
        let (c, got) = r.join().unwrap();
        let want = reference_of(&eng, &[("user", &c)], 24).0;
        assert_eq!(got, want, "the reply to {c:?}");
    }
    s.shutdown().unwrap();
}

/// `GET /slots` (llama-server's debugging route): one entry per slot with its context, and after
/// a reply the slot that ran it is idle, with the request's prompt and decoded counts and its
/// cache holding the prompt and the reply (cut by `max_tokens`: each token was decoded before
/// the count was checked).
#[test]
fn slots_report_what_each_slot_holds() {
    let s = Server::batched(2, N_CTX, false, Limits::default());
    let body = json!({"messages": [{"role": "user", "content": "Count"}], "max_tokens": 5,
        "temperature": 0})
    .to_string();
    let (st, v) = s.post("/v1/chat/completions", &body, None);
    assert_eq!(st, 200, "{v}");
    let (prompt, done) = (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    let t0 = Instant::now();
    let slots = loop {
        let (st, text) = s.get("/slots");
        assert_eq!(st, 200);
        let slots: Vec<Value> = serde_json::from_str(&text).unwrap();
        if slots.iter().all(|x| x["is_processing"] == false) {
            break slots;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{text}");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(slots.len(), 2);
    assert!(slots.iter().all(|x| x["n_ctx"] == N_CTX as u64));
    let used: Vec<&Value> = slots.iter().filter(|x| x["n_decoded"] != 0).collect();
    assert_eq!(used.len(), 1, "{slots:?}");
    assert_eq!(used[0]["n_prompt_tokens"], prompt);
    assert_eq!(used[0]["n_decoded"], done);
    assert_eq!(done, 5, "a reply cut by max_tokens");
    assert_eq!(used[0]["n_cached"], prompt + done);
    s.shutdown().unwrap();
}

/// `serve --kv-pool` (the batched sequences' positions bounded together): with a pool of 120
/// positions over two slots, a prompt of about 64 tokens while another reply of 64 holds its
/// slot is a 503 that names the pool; once that reply is done, the same request takes the idle
/// slot's cache back and its reply is `generate`'s, as is the first prompt's again afterwards
/// (its slot's cache may be gone: the prompt then runs whole).
#[test]
fn a_full_kv_pool_is_a_503_and_idle_caches_go_back() {
    let s = Server::batched_pool(2, N_CTX, true, Limits::default(), Some(120));
    let eng = engine();
    let tokens = |c: &str| {
        let msgs = vec![("user".to_string(), c.to_string())];
        let text = eng.tokenizer.apply_chat_template(&msgs).unwrap();
        eng.tokenizer.encode(&text).unwrap().len()
    };
    // Two chats of 61 to 66 prompt tokens each.
    let chat = |topic: &str| {
        let mut c = format!("Tell me about {topic}.");
        while tokens(&c) < 61 {
            c += " And more.";
        }
        assert!(tokens(&c) <= 66, "{c}");
        c
    };
    let (a, b) = (chat("the sea"), chat("the hills"));
    let body = |c: &str, max: u64| {
        json!({"messages": [{"role": "user", "content": c}], "max_tokens": max,
            "temperature": 0})
        .to_string()
    };
    let url = s.url("/v1/chat/completions");
    let first = {
        let (url, body) = (url.clone(), body(&a, 28));
        std::thread::spawn(move || {
            let r = ureq::post(&url)
                .send_string(&body)
                .map_err(|e| e.to_string());
            r.map(|r| r.into_string())
        })
    };
    // Wait for a's reply to be under way (its prompt in its slot's cache, a token decoded).
    let t0 = Instant::now();
    let under_way = || {
        let slots: Vec<Value> = serde_json::from_str(&s.get("/slots").1).unwrap();
        (slots.iter()).any(|x| x["is_processing"] == true && x["n_decoded"].as_u64() > Some(0))
    };
    while !under_way() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "a's reply never started"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let (st, v) = s.post("/v1/chat/completions", &body(&b, 8), None);
    assert_eq!(st, 503, "{v}");
    assert!(v.to_string().contains("KV pool is full"), "{v}");
    let got_a = first.join().unwrap().unwrap().unwrap();
    let got_a: Value = serde_json::from_str(&got_a).unwrap();
    let want_a = reference_of(&eng, &[("user", &a)], 28).0;
    assert_eq!(got_a["choices"][0]["message"]["content"], want_a.as_str());
    for (c, max) in [(&b, 8), (&a, 28)] {
        let (st, v) = s.post("/v1/chat/completions", &body(c, max), None);
        assert_eq!(st, 200, "{v}");
        let want = reference_of(&eng, &[("user", c)], max as usize).0;
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{c}");
    }
    s.shutdown().unwrap();
}

/// `--kv-pool` without batched CPU sequences, or below one context, is refused at start.
#[test]
fn a_kv_pool_that_cannot_bound_anything_is_refused() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama-silu");
    for (args, says) in [
        (
            &["--parallel", "1", "--kv-pool", "512"][..],
            "--parallel > 1",
        ),
        (
            &["--parallel", "2", "--kv-pool", "16"][..],
            "below the context",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(["serve", "-m", fixture, "--port", "0", "--ctx", "64"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
