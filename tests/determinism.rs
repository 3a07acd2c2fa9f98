//! Same request, same reply (issue 52): on the CPU a token's logits do not depend on how its
//! prompt was split, on a cached prefix, on the requests batched beside it or on the thread
//! count, so every way of sending a request gives the bytes `dejavu generate` prints.
//!
//! For SmolLM2 and Qwen2.5-Coder-0.5B, 16 requests of 4 chat prompts, greedy and sampled at
//! temperature 0.8 with a fixed seed, against `dejavu serve` as a process:
//! (a) one by one, (b) all at once with `--parallel 8`, (c) each again after itself (a warm
//! prompt cache: all but its last token reused), (d) with `"cache_prompt": false`, (e) under
//! `-t 1` and `-t 2`, (f) under a sparse policy (`gate-first:0.5`, against `generate` under
//! it). Every reply must equal `generate`'s byte for byte. And the logits of a prompt's last
//! position are bit for bit the same whether the prompt ran whole, in chunks of 1, 7 or 64
//! tokens, or after a cached prefix, at 1 and 2 threads, dense and under the policy.
mod common;

use common::server::ServerProcess;
use common::{engine, model_path, QWEN, SMOLLM2};
use dejavu::exec::{Engine, EngineOptions};
use dejavu::sparsity::policy::Policy;
use serde_json::json;
use std::path::Path;
use std::process::Command;

const QUESTIONS: [&str; 4] = [
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is a prime number? Answer briefly, then give two examples of one.",
    "Give me a name for a cat.",
];
const MAX_TOKENS: usize = 16;
const SPARSE: &str = "gate-first:0.5";
/// Greedy, and sampled at temperature 0.8 with this seed (and llama.cpp's top-k 40, top-p
/// 0.95, min-p 0.05, set on both sides).
const SAMPLED: (f32, u64) = (0.8, 1234);

/// How a reply is drawn: greedy, or sampled with [`SAMPLED`].
#[derive(Clone, Copy, Debug)]
enum Draw {
    Greedy,
    Sampled,
}

/// What `dejavu generate --chat` prints (its closing newline taken off).
fn generate(model: &Path, question: &str, draw: Draw, sparsity: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dejavu"));
    cmd.args(["generate", "--chat", "--ctx", "512", "-t", "2"])
        .args(["-n", &MAX_TOKENS.to_string(), "--sparsity", sparsity])
        .args(["-p", question, "-m"])
        .arg(model);
    match draw {
        Draw::Greedy => cmd.args(["--temperature", "0"]),
        Draw::Sampled => cmd.args([
            "--temperature",
            &SAMPLED.0.to_string(),
            "--seed",
            &SAMPLED.1.to_string(),
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--min-p",
            "0.05",
        ]),
    };
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// One chat request's reply text.
fn ask(s: &ServerProcess, question: &str, draw: Draw, cache_prompt: bool) -> String {
    let mut body = json!({
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "cache_prompt": cache_prompt,
    });
    match draw {
        Draw::Greedy => body["temperature"] = json!(0),
        Draw::Sampled => {
            (body["temperature"], body["seed"]) = (json!(SAMPLED.0), json!(SAMPLED.1));
            (body["top_k"], body["top_p"], body["min_p"]) = (json!(40), json!(0.95), json!(0.05));
        }
    }
    let (status, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

/// Every question of [`QUESTIONS`] 4 times (16 requests) at once; each reply against `want`.
fn all_at_once(s: &ServerProcess, want: &[String], draw: Draw, what: &str) {
    std::thread::scope(|scope| {
        let sent: Vec<_> = (0..16)
            .map(|i| {
                let q = i % QUESTIONS.len();
                (q, scope.spawn(move || ask(s, QUESTIONS[q], draw, true)))
            })
            .collect();
        for (q, h) in sent {
            let got = h.join().expect("a client failed");
            assert_eq!(
                got, want[q],
                "{what}, {draw:?}, all at once: {:?}",
                QUESTIONS[q]
            );
        }
    });
}

/// Each question twice in a row (the second on a warm cache), then with `cache_prompt` off.
fn one_by_one(s: &ServerProcess, want: &[String], draw: Draw, what: &str) {
    for (q, w) in QUESTIONS.iter().zip(want) {
        for round in ["cold", "warm"] {
            let got = ask(s, q, draw, true);
            assert_eq!(
                &got, w,
                "{what}, {draw:?}, one by one ({round} cache): {q:?}"
            );
        }
        let got = ask(s, q, draw, false);
        assert_eq!(&got, w, "{what}, {draw:?}, cache_prompt false: {q:?}");
    }
}

fn replies_equal_generate(name: &str) {
    let model = model_path(name);
    for (sparsity, what) in [("dense", "dense"), (SPARSE, SPARSE)] {
        let want = |draw| {
            (QUESTIONS.iter())
                .map(|q| generate(&model, q, draw, sparsity))
                .collect::<Vec<_>>()
        };
        let (greedy, sampled) = (want(Draw::Greedy), want(Draw::Sampled));
        assert!(greedy.iter().all(|w| !w.is_empty()), "{greedy:?}");
        let both = [(Draw::Greedy, &greedy), (Draw::Sampled, &sampled)];
        let base = ["--ctx", "512", "--sparsity", sparsity];
        // (b), (a), (c), (d) at 2 threads, 8 sequences batched.
        let s = ServerProcess::start(
            &model,
            &[&base[..], &["-t", "2", "--parallel", "8"]].concat(),
        );
        for (draw, want) in both {
            all_at_once(&s, want, draw, &format!("{name} {what} -t 2 --parallel 8"));
            one_by_one(&s, want, draw, &format!("{name} {what} -t 2 --parallel 8"));
        }
        drop(s);
        // (e) one thread, one slot.
        let s = ServerProcess::start(
            &model,
            &[&base[..], &["-t", "1", "--parallel", "1"]].concat(),
        );
        for (draw, want) in both {
            one_by_one(&s, want, draw, &format!("{name} {what} -t 1"));
        }
    }
}

#[test]
fn smollm2_replies_are_generates_however_they_are_sent() {
    replies_equal_generate(SMOLLM2);
}

#[test]
fn qwen_replies_are_generates_however_they_are_sent() {
    replies_equal_generate(QWEN);
}

/// The last position's logits of `ids` on a fresh sequence, the prompt run as `chunks` (each
/// [`Decoder::prompt`], after `cached` tokens run and kept as a prefix first).
fn last_logits(
    eng: &Engine,
    policy: &Policy,
    ids: &[u32],
    chunk: usize,
    cached: usize,
) -> Vec<u32> {
    let mut dec = eng.decoder(policy).unwrap();
    if cached > 0 {
        // A cache that held a longer sequence: the prefix is kept, the rest run again.
        dec.prompt(ids).unwrap();
        dec.truncate(cached);
    }
    let mut last = Vec::new();
    for c in ids[cached..].chunks(chunk) {
        last = dec.prompt(c).unwrap().iter().map(|v| v.to_bits()).collect();
    }
    last
}

#[test]
fn a_positions_logits_do_not_depend_on_the_prompts_split() {
    for name in [SMOLLM2, QWEN] {
        let text = "The old harbour town woke up slowly, and the fishermen carried their nets \
                    down to the boats while the gulls circled overhead. ";
        let ids = engine(name).tokenizer.encode(&text.repeat(4)).unwrap();
        assert!(ids.len() > 64, "{} tokens", ids.len());
        for threads in [1, 2] {
            let opts = EngineOptions {
                threads: Some(threads),
                n_ctx: Some(256),
                ..Default::default()
            };
            let eng = Engine::load(model_path(name), &opts).unwrap();
            let policies = [
                Policy::dense(&eng.model.config),
                Policy::parse(SPARSE, &eng.model.config, None).unwrap(),
            ];
            for policy in &policies {
                let whole = last_logits(&eng, policy, &ids, ids.len(), 0);
                for (chunk, cached) in [(1, 0), (7, 0), (64, 0), (ids.len(), 40), (5, 61)] {
                    let got = last_logits(&eng, policy, &ids, chunk, cached);
                    assert!(
                        got == whole,
                        "{name} -t {threads} {}: chunks of {chunk} after {cached} cached \
                         differ from the whole prompt",
                        policy.name
                    );
                }
            }
        }
    }
}
