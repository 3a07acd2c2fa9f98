//! `dejavu serve` in process on loopback over a tiny Hugging Face fixture (tests/serve.rs): one
//! slot, or slots stepped as one batch; requests, metrics, and the replies `generate` gives.
use dejavu::exec::Decoder;
use dejavu::exec::{Engine, EngineOptions};
use dejavu::serve::{self, Limits, ServeOptions, Slot};
use dejavu::sparsity::policy::Policy;
use dejavu::text::generate::generate_on;
use dejavu::text::sampling::{Sampler, SamplerConfig};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const N_CTX: usize = 96;
/// Prompt tokens run between two steps of the batched server: short, so that prompts span
/// several chunks.
pub const PROMPT_CHUNK: usize = 64;

pub fn engine() -> Engine {
    engine_of(N_CTX)
}

pub fn engine_of(n_ctx: usize) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-silu");
    let opts = EngineOptions {
        threads: Some(1),
        n_ctx: Some(n_ctx),
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap()
}

/// A running server and what stops it.
pub struct Server {
    pub addr: SocketAddr,
    /// Keeps no idle connection, so the server's open connections are the test's own.
    pub agent: ureq::Agent,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<std::io::Result<()>>,
}

impl Server {
    /// `slow`: each decode call of the slot sleeps 5 ms first (a slow model, so a reply of
    /// hundreds of tokens takes seconds).
    pub fn start(api_key: Option<&str>, slow: bool) -> Self {
        Self::with_limits(api_key, slow, Limits::default())
    }

    pub fn with_limits(api_key: Option<&str>, slow: bool, limits: Limits) -> Self {
        let eng = engine();
        let opts = options(&eng, api_key, limits);
        let slot: Slot = Box::new(move |jobs, metrics| {
            let policy = Policy::dense(&eng.model.config);
            let mut dec = Slow {
                inner: eng.decoder(&policy).unwrap(),
                delay: Duration::from_millis(if slow { 5 } else { 0 }),
            };
            serve::worker::run_slot(&eng, &mut dec, &jobs, &metrics);
        });
        Self::launch(opts, vec![slot])
    }

    /// `n` slots whose sequences (of `n_ctx` positions) step together on a batch thread, as
    /// `dejavu serve --parallel n` runs them (prompts in chunks of [`PROMPT_CHUNK`]).
    pub fn batched(n: usize, n_ctx: usize, slow: bool, limits: Limits) -> Self {
        Self::batched_pool(n, n_ctx, slow, limits, None)
    }

    /// [`Self::batched`] with the sequences' positions bounded by `pool` (`serve --kv-pool`).
    pub fn batched_pool(
        n: usize,
        n_ctx: usize,
        slow: bool,
        limits: Limits,
        pool: Option<usize>,
    ) -> Self {
        Self::batched_with(n, n_ctx, slow, limits, pool, None)
    }

    /// [`Self::batched_pool`], taking request bodies of up to `max_body` bytes where given.
    pub fn batched_with(
        n: usize,
        n_ctx: usize,
        slow: bool,
        limits: Limits,
        pool: Option<usize>,
        max_body: Option<usize>,
    ) -> Self {
        let eng = Arc::new(engine_of(n_ctx));
        let (decs, rx) = serve::batch::decoders(n, n_ctx);
        let owner = eng.clone();
        std::thread::spawn(move || {
            let policy = Policy::dense(&owner.model.config);
            let mut seqs: Vec<_> = (0..n).map(|_| owner.decoder(&policy).unwrap()).collect();
            serve::batch::run(&mut seqs, rx, PROMPT_CHUNK, pool);
        });
        // Room in the queue for every request a test sends at once (one slot's 4 would turn
        // the fifth of five concurrent requests away with a 503 while the slots start).
        let base = options(&eng, None, limits);
        let opts = ServeOptions {
            queue: 16,
            max_body: max_body.unwrap_or(base.max_body),
            ..base
        };
        let slots = (decs.into_iter())
            .map(|dec| {
                let eng = eng.clone();
                let delay = Duration::from_millis(if slow { 5 } else { 0 });
                Box::new(
                    move |jobs: Arc<serve::worker::Jobs>, metrics: Arc<serve::Metrics>| {
                        let mut dec = Slow { inner: dec, delay };
                        serve::worker::run_slot(&eng, &mut dec, &jobs, &metrics);
                    },
                ) as Slot
            })
            .collect();
        Self::launch(opts, slots)
    }

    pub fn launch(opts: ServeOptions, slots: Vec<Slot>) -> Self {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (done_tx, done) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let r = rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                addr_tx.send(l.local_addr()?).unwrap();
                let shutdown = async move {
                    let _ = stop_rx.await;
                };
                serve::serve(l, opts, slots, shutdown).await
            });
            let _ = done_tx.send(r);
        });
        let addr = addr_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        Self {
            addr,
            agent: ureq::AgentBuilder::new()
                .max_idle_connections(0)
                .max_idle_connections_per_host(0)
                .build(),
            stop: Some(stop),
            done,
        }
    }
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
    /// POST `body`; the status and the JSON (or text) answer.
    pub fn post(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut r = self
            .agent
            .post(&self.url(path))
            .set("Content-Type", "application/json");
        if let Some(k) = key {
            r = r.set("Authorization", &format!("Bearer {k}"));
        }
        let resp = match r.send_string(body) {
            Ok(resp) => resp,
            Err(ureq::Error::Status(_, resp)) => resp,
            Err(e) => panic!("POST {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
    pub fn get(&self, path: &str) -> (u16, String) {
        match self.agent.get(&self.url(path)).call() {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap()),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }
    /// Stop accepting; wait for the server to return.
    pub fn shutdown(mut self) -> std::io::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        self.done.recv_timeout(Duration::from_secs(60)).unwrap()
    }
}

/// The server's options for the fixture `eng`.
pub fn options(eng: &Engine, api_key: Option<&str>, limits: Limits) -> ServeOptions {
    ServeOptions {
        model_id: "tiny".into(),
        model_names: vec!["tiny".into()],
        api_key: api_key.map(String::from),
        queue: 4,
        queue_timeout: Duration::from_secs(30),
        max_body: 4096,
        default_max_tokens: 8,
        vocab: eng.model.config.vocab_size,
        tokenizer: eng.tokenizer.clone(),
        sparsity: "dense".into(),
        mlp_density: 1.0,
        reuse_prefix: true,
        limits,
    }
}

/// A decoder that waits before each call.
pub struct Slow<D: Decoder> {
    inner: D,
    delay: Duration,
}

impl<D: Decoder> Decoder for Slow<D> {
    fn pause(&mut self) {
        self.inner.pause()
    }
    fn decode(&mut self, tokens: &[u32]) -> dejavu::Result<&mut [f32]> {
        std::thread::sleep(self.delay);
        self.inner.decode(tokens)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }
    fn truncate(&mut self, len: usize) {
        self.inner.truncate(len)
    }
    fn run(&mut self, tokens: &[u32], want: dejavu::exec::Logits) -> dejavu::Result<&mut [f32]> {
        std::thread::sleep(self.delay);
        self.inner.run(tokens, want)
    }
    fn prompt(&mut self, tokens: &[u32]) -> dejavu::Result<&mut [f32]> {
        std::thread::sleep(self.delay);
        self.inner.prompt(tokens)
    }
    fn reuses_steps(&self) -> bool {
        self.inner.reuses_steps()
    }
}

/// The value of a counter in `/metrics`.
pub fn counter(s: &Server, name: &str) -> u64 {
    metric_in(&s.get("/metrics").1, name)
}

/// The value of the metric `name` in a `/metrics` text.
pub fn metric_in(m: &str, name: &str) -> u64 {
    let line = m.lines().find(|l| l.starts_with(&format!("{name} ")));
    line.and_then(|l| l.split(' ').nth(1)?.parse().ok())
        .unwrap_or_else(|| panic!("{name}: {m}"))
}

/// Wait (10 s at most) for the metric `name` to read `want`: a slot frees itself just after
/// its reply is sent, so a client can see the reply before the gauge moves.
pub fn settles(s: &Server, name: &str, want: u64) {
    settles_to(name, want, || counter(s, name));
}

/// [`settles`] with the metric read by `read` (a server in another process).
pub fn settles_to(name: &str, want: u64, read: impl Fn() -> u64) {
    let t0 = Instant::now();
    while read() != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{name} never read {want}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `generate` on a fresh cache of another engine, greedy: the reply the server must give.
pub fn reference(messages: &[(&str, &str)], max_tokens: usize) -> (String, usize) {
    reference_of(&engine(), messages, max_tokens)
}

pub fn reference_of(eng: &Engine, messages: &[(&str, &str)], max_tokens: usize) -> (String, usize) {
    let owned: Vec<(String, String)> = messages
        .iter()
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .collect();
    let ids = eng
        .tokenizer
        .encode(&eng.tokenizer.apply_chat_template(&owned).unwrap())
        .unwrap();
    let policy = Policy::dense(&eng.model.config);
    let mut dec = eng.decoder(&policy).unwrap();
    let mut text = String::new();
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let (out, _) =
        generate_on(eng, &mut dec, &ids, max_tokens, &mut sampler, |t| text += t).unwrap();
    (text, out.len())
}

/// The `data:` payloads of a streamed reply read from `r`, up to `[DONE]`.
pub fn sse_events(r: impl Read) -> Vec<String> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.unwrap();
        if let Some(d) = line.strip_prefix("data: ") {
            out.push(d.to_string());
            if d == "[DONE]" {
                break;
            }
        }
    }
    out
}
