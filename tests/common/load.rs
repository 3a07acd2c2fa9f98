//! The load test of `dejavu serve` as a process (`tests/serve_load.rs` on the CPU,
//! `tests/device/cuda.rs` on the GPU): `clients` concurrent clients x `rounds` requests each
//! (chat and completions, streamed and whole, greedy), every reply whole and checked against
//! what `dejavu generate` prints with the same settings; the server's anonymous memory flat
//! over the run; then SIGTERM with streams in flight: each ends whole, and the process exits 0.
//!
//! The check ([`Load::near_tie`]): `None`, byte for byte `generate`'s (the CPU: a sequence's
//! logits do not depend on what else is in its batch). `Some(eps)`, for a device whose batched
//! products round otherwise than a lone sequence's (the GPU: tensor-core products of several
//! rows, a matrix-vector product for one): the reply is `generate`'s, or parts from it where
//! the served reply's top two log-probabilities lie within `eps` (a near-tie that the two
//! roundings may settle either way; see [`check_reply`]); the rest is then not compared.
use super::inproc::sse_events;
use super::server::ServerProcess;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Each a question for the chat template and a text to continue.
pub const PROMPTS: [[&str; 2]; 8] = [
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

/// One run of the load test.
pub struct Load<'a> {
    pub model: &'a Path,
    /// `serve`'s arguments besides `-m` and `--port`.
    pub serve: &'a [&'a str],
    /// `generate`'s arguments besides `-m`, `-p`, `-n`, `--temperature` and `--chat`.
    pub generate: &'a [&'a str],
    pub clients: usize,
    pub rounds: usize,
    pub max_tokens: usize,
    /// `None`: every reply byte for byte `generate`'s; `Some(eps)`: see the module's doc.
    /// With `Some`, both sides ignore end-of-generation tokens (each reply `max_tokens` long,
    /// so a parting is always at a token of the served reply).
    pub near_tie: Option<f32>,
}

/// A reply: its text, its completion tokens, and (asked for with `near_tie`) each token's
/// bytes and its top two log-probabilities.
struct Reply {
    text: String,
    tokens: u64,
    pieces: Vec<(usize, Vec<f32>)>,
}

/// The load test of a fixture model on `backend` (`cpu` or `cuda`): 4 sequences batched, 32
/// clients x 8 requests of 16 tokens, each reply against `generate` on the same backend
/// within a near-tie bound of `near_tie`.
pub fn on_fixture(model: &Path, backend: &str, near_tie: f32) {
    let ctx = ["--backend", backend, "--ctx", "512"];
    let serve = [
        &ctx[..],
        &["--parallel", "4", "-t", "2", "--no-prefix-reuse"],
    ]
    .concat();
    Load {
        model,
        serve: &serve,
        generate: &ctx,
        clients: 32,
        rounds: 8,
        max_tokens: 16,
        near_tie: Some(near_tie),
    }
    .run();
}

/// Request `i` of client `c`: which prompt, through the chat template or not, streamed or not.
fn case(c: usize, i: usize) -> (usize, bool, bool) {
    (
        (c + i) % PROMPTS.len(),
        (c / 2 + i).is_multiple_of(2),
        c % 2 == 1,
    )
}

impl Load<'_> {
    /// What `dejavu generate` prints for a prompt (its closing newline taken off).
    fn generate(&self, prompt: &str, chat: bool) -> String {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dejavu"));
        cmd.arg("generate")
            .args(self.generate)
            .args(["--temperature", "0", "-n", &self.max_tokens.to_string()])
            .args(["-p", prompt, "-m"])
            .arg(self.model);
        if chat {
            cmd.arg("--chat");
        }
        if self.near_tie.is_some() {
            cmd.arg("--ignore-eos");
        }
        let text = super::stdout_of(&mut cmd);
        text.strip_suffix('\n').unwrap().to_string()
    }

    /// One request: its text (streamed chunks joined), completion tokens and pieces.
    fn request(&self, base: &str, prompt: &str, chat: bool, stream: bool) -> Reply {
        let (path, mut body) = match chat {
            true => (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": prompt}]}),
            ),
            false => ("/v1/completions", json!({"prompt": prompt})),
        };
        body["max_tokens"] = json!(self.max_tokens);
        body["temperature"] = json!(0);
        body["stream"] = json!(stream);
        body["stream_options"] = json!({"include_usage": stream});
        if self.near_tie.is_some() {
            body["ignore_eos"] = json!(true);
            match chat {
                true => (body["logprobs"], body["top_logprobs"]) = (json!(true), json!(2)),
                false => body["logprobs"] = json!(2),
            }
        }
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
        let choices: Vec<Value> = match stream {
            false => vec![resp.into_json().unwrap()],
            true => {
                let events = sse_events(resp.into_reader());
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "ends");
                (events[..events.len() - 1].iter())
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect()
            }
        };
        let text = (choices.iter())
            .filter_map(|c| text_of(&c["choices"][0]))
            .collect();
        let usage = choices.last().unwrap()["usage"]["completion_tokens"].as_u64();
        let pieces = (choices.iter())
            .flat_map(|c| pieces(&c["choices"][0]["logprobs"], chat))
            .collect();
        Reply {
            text,
            tokens: usage.expect("a usage count"),
            pieces,
        }
    }

    /// `got` against `want` (see the module's doc).
    fn check(&self, got: &Reply, want: &str, what: &str) {
        if self.near_tie.is_some() {
            // Each token listed with two alternatives, the tokens' bytes the text's.
            let bytes: usize = got.pieces.iter().map(|(len, _)| len).sum();
            let pairs = got.pieces.iter().all(|(_, top)| top.len() == 2);
            assert!(
                bytes == got.text.len() && pairs && got.pieces.len() == self.max_tokens,
                "{what}: log-probabilities of {} tokens over {bytes} bytes for {} tokens of \
                 text {:?}",
                got.pieces.len(),
                got.tokens,
                got.text
            );
        }
        if let Err(e) = check_reply(self.near_tie, &got.text, &got.pieces, want) {
            panic!("{what}: {e}");
        }
    }

    /// Run it; panics at the first failure. Prints the latency and throughput (bench
    /// figures, not asserted).
    pub fn run(&self) {
        let mut server = ServerProcess::start(self.model, self.serve);
        let pid = server.child.id();
        let base = server.base();

        // The references, while the server warms up.
        let want: Arc<Vec<[String; 2]>> = Arc::new(
            PROMPTS
                .iter()
                .map(|[q, t]| [self.generate(t, false), self.generate(q, true)])
                .collect(),
        );
        for [q, _] in PROMPTS.iter().take(2) {
            self.request(&base, q, true, false);
        }
        let rss_before = rss_anon_kib(pid);
        assert!(
            want.iter().flatten().all(|w| !w.is_empty()),
            "every reference has text to compare: {want:?}"
        );

        let t0 = Instant::now();
        let (lat, tokens) = std::thread::scope(|scope| {
            let clients: Vec<_> = (0..self.clients)
                .map(|c| {
                    let (base, want) = (&base, &want);
                    scope.spawn(move || {
                        (0..self.rounds)
                            .map(|i| {
                                let (p, chat, stream) = case(c, i);
                                let t = Instant::now();
                                let prompt = PROMPTS[p][chat as usize ^ 1];
                                let got = self.request(base, prompt, chat, stream);
                                let what = format!("client {c} request {i} ({chat}, {stream})");
                                self.check(&got, &want[p][chat as usize], &what);
                                (t.elapsed(), got.tokens)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let (mut lat, mut tokens) = (Vec::new(), 0);
            for c in clients {
                for (d, n) in c.join().expect("a client failed") {
                    lat.push(d);
                    tokens += n;
                }
            }
            (lat, tokens)
        });
        let wall = t0.elapsed();
        let rss_after = rss_anon_kib(pid);
        let mut lat = lat;
        lat.sort();
        assert_eq!(lat.len(), self.clients * self.rounds, "no request lost");
        let how = match self.near_tie {
            None => "equal to".to_string(),
            Some(eps) => format!("equal (or parting at a near-tie within {eps}) to"),
        };
        println!(
            "load: {} clients x {} requests, {} replies whole and {how} generate's; latency p50 \
             {:.2} s, p99 {:.2} s; {tokens} tokens in {:.1} s = {:.1} tok/s aggregate; RssAnon \
             {} -> {} KiB",
            self.clients,
            self.rounds,
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
        self.terminate_under_load(&mut server, &want);
    }

    /// SIGTERM with streams in flight: each ends whole, then the process exits 0.
    fn terminate_under_load(&self, server: &mut ServerProcess, want: &[[String; 2]]) {
        let base = server.base();
        std::thread::scope(|scope| {
            let streams: Vec<_> = (0..6)
                .map(|i| {
                    let (base, chat) = (&base, i % 2 == 0);
                    let prompt = PROMPTS[i][chat as usize ^ 1];
                    let t = scope.spawn(move || self.request(base, prompt, chat, true));
                    (t, &want[i][chat as usize])
                })
                .collect();
            // Every stream sent and at least one still held. Streams counted as finished
            // before the server is asked are not among those it holds, so `held + finished`
            // reaches the count only once each has been sent (a fast device may finish some).
            let t = Instant::now();
            loop {
                let finished = streams.iter().filter(|(s, _)| s.is_finished()).count();
                let h: Value = ureq::get(&format!("{base}/health"))
                    .call()
                    .unwrap()
                    .into_json()
                    .unwrap();
                let held = h["slots_busy"].as_u64().unwrap() + h["queued"].as_u64().unwrap();
                if held > 0 && held as usize + finished == streams.len() {
                    break; // every stream is queued, generating or done, and some are in flight
                }
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "streams not started (or all done before SIGTERM): {h}, {finished} finished"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            let status = server.terminate(Duration::from_secs(60));
            for (s, expected) in streams {
                let got = s.join().expect("a stream in flight at SIGTERM ended whole");
                self.check(&got, expected, "a reply finished in the shutdown grace");
            }
            assert!(status.success(), "exit status after SIGTERM: {status}");
        });
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err(),
            "closed"
        );
    }
}

/// A reply's `text` (its tokens' lengths in bytes and top log-probabilities: `pieces`) against
/// `generate`'s `want`: byte for byte (`near_tie` `None`), or parting from it only at a
/// near-tie (see the module's doc). Where the two choices parted is not in the text alone (two
/// tokenizations may agree on bytes for a while: " th" + "ink" against " the" + "re"), so the
/// near-tie is looked for among the last [`NEAR`] tokens up to the one that holds the first
/// byte that differs (the last token, where the served text is a prefix of `want`).
pub fn check_reply(
    near_tie: Option<f32>,
    text: &str,
    pieces: &[(usize, Vec<f32>)],
    want: &str,
) -> Result<(), String> {
    if text == want {
        return Ok(());
    }
    let Some(eps) = near_tie else {
        return Err(format!("served {text:?}, generate {want:?}"));
    };
    let same = (text.bytes().zip(want.bytes()))
        .take_while(|(a, b)| a == b)
        .count();
    let mut end = 0;
    let held = pieces.iter().position(|(len, _)| {
        end += len;
        end > same
    });
    let Some(k) = held.or(pieces.len().checked_sub(1).filter(|_| end == text.len())) else {
        return Err(format!(
            "its tokens ({} bytes) do not cover the text\n  served: {text:?}\n  generate: \
             {want:?}",
            end
        ));
    };
    let gap = |top: &[f32]| match top {
        [a, b, ..] => a - b,
        _ => f32::INFINITY,
    };
    let near = (k.saturating_sub(NEAR - 1)..=k).find(|&i| gap(&pieces[i].1) <= eps);
    match near {
        Some(_) => Ok(()),
        None => Err(format!(
            "parts from generate's at byte {same} (token {k}) with no near-tie within {eps} \
             among tokens {}..={k}: their top log-probabilities {:?}\n  served: {text:?}\n  \
             generate: {want:?}",
            k.saturating_sub(NEAR - 1),
            &pieces[k.saturating_sub(NEAR - 1)..=k]
        )),
    }
}

/// How many tokens, up to the one that holds the first differing byte, may hold the near-tie.
pub const NEAR: usize = 3;

/// Each token's length in bytes and its top log-probabilities, largest first, from a choice's
/// `logprobs` (chat's `content` list, or the completions' lists); none where not asked for.
fn pieces(lp: &Value, chat: bool) -> Vec<(usize, Vec<f32>)> {
    let sorted = |mut v: Vec<f32>| {
        v.sort_by(|a, b| b.total_cmp(a));
        v
    };
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NEG_INFINITY) as f32;
    if chat {
        let content = lp["content"].as_array().cloned().unwrap_or_default();
        return (content.iter())
            .map(|t| {
                let len = t["bytes"].as_array().map_or(0, Vec::len);
                let top = t["top_logprobs"].as_array().cloned().unwrap_or_default();
                (
                    len,
                    sorted(top.iter().map(|e| num(&e["logprob"])).collect()),
                )
            })
            .collect();
    }
    let tokens = lp["tokens"].as_array().cloned().unwrap_or_default();
    let tops = lp["top_logprobs"].as_array().cloned().unwrap_or_default();
    (tokens.iter().zip(&tops))
        .map(|(t, top)| {
            let len = t.as_str().map_or(0, str::len);
            let vals = top.as_object().map(|m| m.values().map(num).collect());
            (len, sorted(vals.unwrap_or_default()))
        })
        .collect()
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
