//! `dejavu serve` as a process on a tiny Hugging Face fixture: llama-server's `/tokenize` and
//! `/detokenize` against the model's tokenizer, and `/v1/embeddings` (the `openai` package's
//! view of it is in tests/clients/openai_client.py).
mod common;
use common::server::ServerProcess;
use dejavu::exec::{Engine, EngineOptions};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-silu")
}

/// The server on the fixture, and the fixture's engine (its tokenizer and shapes).
fn start() -> (ServerProcess, Engine) {
    let server = ServerProcess::start(&fixture(), &["--ctx", "128", "-t", "1"]);
    let opts = EngineOptions {
        threads: Some(1),
        ..Default::default()
    };
    (server, Engine::load(fixture(), &opts).unwrap())
}

/// `/tokenize` and `/detokenize` (llama-server's) round-trip text through the model's
/// tokenizer, with pieces and the BOS on request; ids past the vocabulary are 400s.
#[test]
fn tokenize_and_detokenize_round_trip() {
    let (mut s, eng) = start();
    let text = "Hello world, tokens!";
    let (st, r) = s.post("/tokenize", &json!({ "content": text }));
    assert_eq!(st, 200, "{r}");
    let ids: Vec<u32> = serde_json::from_value(r["tokens"].clone()).unwrap();
    assert_eq!(ids, eng.tokenizer.encode_plain(text).unwrap());
    let (_, back) = s.post("/detokenize", &json!({ "tokens": ids }));
    assert_eq!(
        back["content"],
        eng.tokenizer.decode(&ids).unwrap(),
        "{back}"
    );
    assert_eq!(back["content"].as_str().unwrap().trim(), text);
    let body = json!({"content": text, "add_special": true, "with_pieces": true});
    let (_, p) = s.post("/tokenize", &body);
    let pieces = p["tokens"].as_array().unwrap();
    let want = eng.tokenizer.encode_prompt(text).unwrap();
    assert_eq!(pieces.len(), want.len(), "{p}");
    for (t, &id) in pieces.iter().zip(&want) {
        assert_eq!(t["id"], id);
        assert_eq!(t["piece"], eng.tokenizer.decode(&[id]).unwrap());
    }
    for (path, bad) in [
        ("/detokenize", json!({"tokens": [1, 1_000_000]})),
        ("/detokenize", json!({"tokens": "x"})),
        ("/tokenize", json!({"text": "x"})),
    ] {
        let (st, e) = s.post(path, &bad);
        assert_eq!(st, 400, "{path} {bad}: {e}");
    }
    assert!(s.terminate(Duration::from_secs(30)).success());
}

/// `/v1/embeddings`: one unit vector per input, of the head's input width, in order; the same
/// text gives the same vector, whether alone or among others; bad inputs are 400s.
#[test]
fn embeddings_are_unit_vectors_in_input_order() {
    let (mut s, eng) = start();
    let d = eng.model.config.d_embed;
    let embed = |input: Value| {
        let (st, r) = s.post("/v1/embeddings", &json!({ "input": input }));
        assert_eq!(st, 200, "{r}");
        let rows: Vec<Vec<f32>> = (r["data"].as_array().unwrap().iter())
            .map(|e| serde_json::from_value(e["embedding"].clone()).unwrap())
            .collect();
        (rows, r)
    };
    let (rows, r) = embed(json!(["a cat sat", "the compiler"]));
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (r["data"][1]["index"].as_u64(), r["object"].as_str()),
        (Some(1), Some("list"))
    );
    assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() >= 4, "{r}");
    for v in &rows {
        assert_eq!(v.len(), d);
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
    }
    let (alone, _) = embed(json!("the compiler"));
    let diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(
        diff(&alone[0], &rows[1]) < 1e-5,
        "{}",
        diff(&alone[0], &rows[1])
    );
    assert!(diff(&rows[0], &rows[1]) > 1e-3, "two texts, one vector");
    for bad in [json!([]), json!([1, 2]), json!(7), json!({"x": 1})] {
        let (st, e) = s.post("/v1/embeddings", &json!({ "input": bad }));
        assert_eq!(st, 400, "{bad}: {e}");
    }
    let fmt = json!({"input": "x", "encoding_format": "hex"});
    assert_eq!(s.post("/v1/embeddings", &fmt).0, 400);
    assert!(s.terminate(Duration::from_secs(30)).success());
}
