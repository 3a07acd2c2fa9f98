//! Grammars and schemas that used to kill the server or answer 500 (issue 52): long flat
//! chains of Lark rules, GBNF rules and `$ref`s overflowed a slot thread's stack and aborted
//! the process for every client; unsatisfiable or hostile ones answered 500 with the parser's
//! internal state. Now a chain within the bounds compiles (on a thread with a deep stack) and
//! constrains the reply, one past them is a 400 naming the bound, the hostile ones are 400s
//! with a short reason, and another client's stream runs on to its end throughout.
mod common;
use common::inproc::*;
use dejavu::serve::Limits;
use dejavu::text::constrain::MAX_RULES;
use serde_json::{json, Value};
use std::time::Duration;

fn lark_chain(n: usize) -> String {
    let rules: String = (0..n).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
    format!("start: r0\n{rules}r{n}: \"ok\"\n")
}

fn gbnf_chain(n: usize) -> String {
    let rules: String = (0..n).map(|i| format!("r{i} ::= r{}\n", i + 1)).collect();
    format!("root ::= r0\n{rules}r{n} ::= \"ok\"\n")
}

/// `n` objects, each holding the next through a `$ref` (ordinary data modelling).
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let next = json!({"$ref": format!("#/$defs/d{}", i + 1)});
        let obj = json!({"type": "object", "properties": {"x": next}, "required": ["x"]});
        defs.insert(format!("d{i}"), obj);
    }
    defs.insert(format!("d{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/d0", "$defs": defs})
}

fn schema(s: Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
}

fn chat(extra: Value) -> String {
    let mut body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

#[test]
fn hostile_grammars_are_400s_and_other_streams_run_on() {
    let s = Server::batched_with(2, N_CTX, true, Limits::default(), None, Some(1 << 20));
    // Another client's long stream, in flight while the grammars arrive.
    let stream = {
        let url = s.url("/v1/completions");
        let body = json!({"prompt": "Once", "max_tokens": 80, "ignore_eos": true,
                          "temperature": 0, "stream": true});
        std::thread::spawn(move || {
            let r = ureq::post(&url)
                .timeout(Duration::from_secs(120))
                .send_string(&body.to_string())
                .unwrap();
            sse_events(r.into_reader())
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // Chains within the bounds compile and constrain the reply.
    for (what, extra, want) in [
        (
            "a Lark chain of 700 rules",
            json!({"grammar": lark_chain(700)}),
            "ok",
        ),
        (
            "a GBNF chain of 1000 rules",
            json!({"grammar": gbnf_chain(1000)}),
            "ok",
        ),
    ] {
        let (status, v) = s.post("/v1/chat/completions", &chat(extra), None);
        assert_eq!(status, 200, "{what}: {v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(text, want, "{what}");
    }
    let refs = json!({"response_format": schema(ref_chain(300)), "max_tokens": 8});
    let (status, v) = s.post("/v1/chat/completions", &chat(refs), None);
    assert_eq!(status, 200, "300 objects chained by $ref: {v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with("{\"x\": {\"x\":"), "{text}");
    // Past the bounds, or hostile: a 400 with a short reason.
    let big = MAX_RULES + 10;
    for (what, extra, needle) in [
        (
            "a Lark chain past the bound",
            json!({"grammar": lark_chain(big)}),
            "at most",
        ),
        (
            "a GBNF chain past the bound",
            json!({"grammar": gbnf_chain(big)}),
            "at most",
        ),
        (
            "a $ref chain past the bound",
            json!({"response_format": schema(ref_chain(big))}),
            "at most",
        ),
        (
            "a schema of itself",
            json!({"response_format": schema(json!({"$ref": "#"}))}),
            "no reply can start",
        ),
        (
            "a rule of itself",
            json!({"grammar": "start: start"}),
            "no reply can start",
        ),
        (
            "an empty language",
            json!({"grammar": "start: /[^\\s\\S]/"}),
            "no reply can start",
        ),
        (
            "a huge repeat",
            json!({"grammar": "start: \"a\"{1000000}"}),
            "the grammar",
        ),
        (
            "a huge regex repeat",
            json!({"grammar": "start: /a{1000000}/"}),
            "the grammar",
        ),
        (
            "a bad grammar",
            json!({"grammar": "start: ???"}),
            "the grammar",
        ),
    ] {
        let (status, v) = s.post("/v1/chat/completions", &chat(extra), None);
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, 400, "{what}: {v}");
        assert!(msg.contains(needle), "{what}: {msg}");
        assert!(
            !msg.contains("<state>") && msg.len() < 400,
            "{what}: the parser's state leaked: {msg}"
        );
    }
    let events = stream.join().expect("the stream's client");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(events.len() > 80, "{} events", events.len());
    // And the server still serves.
    let (status, v) = s.post("/v1/chat/completions", &chat(json!({})), None);
    assert_eq!(status, 200, "{v}");
}

/// Issue 52: a prompt that cannot fit the context whatever its tokens (1 MiB of text against
/// a context of 96) is a 400 before it is tokenized: eight of them in a row take a fraction of
/// a second each (tokenizing one took about a second and hundreds of MB), and a small request
/// after them is served at once.
#[test]
fn a_prompt_too_long_for_any_tokenization_is_refused_untokenized() {
    let s = Server::batched_with(1, N_CTX, false, Limits::default(), None, Some(2 << 20));
    let big = json!({"prompt": "lorem ipsum dolor ".repeat(60_000), "max_tokens": 4}).to_string();
    assert!(big.len() > 1 << 20);
    let t0 = std::time::Instant::now();
    for _ in 0..8 {
        let (status, v) = s.post("/v1/completions", &big, None);
        assert_eq!(status, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("the prompt has at least"), "{msg}");
    }
    let small = json!({"prompt": "Once", "max_tokens": 2}).to_string();
    let (status, v) = s.post("/v1/completions", &small, None);
    assert_eq!(status, 200, "{v}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}
