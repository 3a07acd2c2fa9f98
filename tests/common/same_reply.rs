//! Same request, same reply: the replies of `dejavu serve`, however a request is sent, against
//! `dejavu generate`'s bytes (tests/determinism.rs on the CPU, tests/device/cuda.rs on the GPU
//! under `--deterministic`).
use super::server::ServerProcess;
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
pub const SPARSE: &str = "gate-first:0.5";
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
fn generate(model: &Path, question: &str, draw: Draw, sparsity: &str, on: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dejavu"));
    cmd.args(["generate", "--chat", "--ctx", "512", "-t", "2"])
        .args(on)
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
    let text = super::stdout_of(&mut cmd);
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

/// (a)-(f) for `model` on the device `on` names (extra arguments of both commands: `--backend
/// cuda --deterministic true`; none for the CPU) under each of `sparsities`: every reply equals
/// `generate`'s, greedy and sampled.
pub fn replies_equal_generate(model: &Path, name: &str, on: &[&str], sparsities: &[&str]) {
    for &sparsity in sparsities {
        let what = sparsity;
        let want = |draw| {
            (QUESTIONS.iter())
                .map(|q| generate(model, q, draw, sparsity, on))
                .collect::<Vec<_>>()
        };
        let (greedy, sampled) = (want(Draw::Greedy), want(Draw::Sampled));
        assert!(greedy.iter().any(|w| !w.is_empty()), "{greedy:?}");
        let both = [(Draw::Greedy, &greedy), (Draw::Sampled, &sampled)];
        let base = [&["--ctx", "512", "--sparsity", sparsity][..], on].concat();
        // (b), (a), (c), (d) at 2 threads, 8 sequences batched.
        let s = ServerProcess::start(
            model,
            &[&base[..], &["-t", "2", "--parallel", "8"]].concat(),
        );
        for (draw, want) in both {
            all_at_once(&s, want, draw, &format!("{name} {what} -t 2 --parallel 8"));
            one_by_one(&s, want, draw, &format!("{name} {what} -t 2 --parallel 8"));
        }
        drop(s);
        // (e) one thread, one slot.
        let s = ServerProcess::start(
            model,
            &[&base[..], &["-t", "1", "--parallel", "1"]].concat(),
        );
        for (draw, want) in both {
            one_by_one(&s, want, draw, &format!("{name} {what} -t 1"));
        }
    }
}
