//! `dejavu serve`: an OpenAI-compatible HTTP server (axum on tokio) over slots, each a reply in
//! flight with its own sequence (whose decode steps a batch thread may run together:
//! [`batch`]).
//!
//! Routes: `POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent
//! events ending in `data: [DONE]`, or whole), `POST /v1/embeddings`, `POST /tokenize` and
//! `/detokenize`, `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), `GET
//! /slots` and the chat page at `/`. Requests wait in one bounded queue for the first
//! free slot ([`worker::run_slot`]); a full queue is a 503 at once, a request that waited past
//! the timeout a 503 too. Errors are OpenAI's JSON shape ([`api::ApiError`]). With an API key
//! every `/v1` route needs `Authorization: Bearer KEY`. Shutdown (SIGTERM, Ctrl-C) stops
//! accepting, lets in-flight replies finish, and returns.
pub mod api;
pub mod batch;
mod connections;
mod embed;
mod tokens;
pub mod tool_api;
pub mod worker;

use api::{ApiError, Request, Usage};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use worker::{Event, Finish, Job, Jobs, TokenLogprob, Work};

/// How the server runs (the CLI's flags).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The id `/v1/models` lists and replies carry.
    pub model_id: String,
    /// Every name a request may give the model (see [`model_names`]).
    pub model_names: Vec<String>,
    pub api_key: Option<String>,
    /// Requests that may wait for a slot.
    pub queue: usize,
    /// How long a request may wait for a slot.
    pub queue_timeout: Duration,
    /// The largest request body, in bytes (413 past it).
    pub max_body: usize,
    /// `max_tokens` when a request names none.
    pub default_max_tokens: usize,
    /// The model's vocabulary size (token ids a request names are below it).
    pub vocab: usize,
    /// The model's tokenizer (`/tokenize`, `/detokenize`, run on the HTTP threads).
    pub tokenizer: Arc<crate::model::tokenizer::Tokenizer>,
    /// The policy's name and its mean MLP density, for `/metrics`.
    pub sparsity: String,
    pub mlp_density: f64,
    /// Reuse the prompt prefix a slot's KV cache already holds (see [`worker::Jobs`]).
    pub reuse_prefix: bool,
    pub limits: Limits,
}

/// What bounds a client's hold on the server (slowloris, slow readers, shutdown).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections; more are closed at once.
    pub max_connections: usize,
    /// Time to send a request's headers, and again its body (then the connection closes, or a
    /// 408).
    pub read_timeout: Duration,
    /// Time a reply may wait on a client that reads nothing before it is dropped.
    pub stall_timeout: Duration,
    /// On shutdown, time in-flight replies get to finish before they are ended with an error.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            read_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// Counters behind `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    /// Replies stopped because their client went away.
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens found in a slot's cache (not computed again).
    pub prompt_reused: AtomicU64,
    pub generated: AtomicU64,
    /// Choices (`n` > 1) that ran as rows of one batch beside their request's first.
    pub choices_forked: AtomicU64,
    /// Wall time of generation in the slots, for the mean tok/s.
    pub gen_micros: AtomicU64,
    pub queued: AtomicU64,
    pub busy: AtomicU64,
    /// Each slot's state (`/slots`), claimed in order by the slots as they start.
    pub slots: Vec<SlotState>,
    pub(crate) next_slot: std::sync::atomic::AtomicUsize,
}

/// What a slot is doing (llama-server's `/slots`, for debugging): counts only, no text.
#[derive(Debug, Default)]
pub struct SlotState {
    pub n_ctx: AtomicU64,
    pub processing: std::sync::atomic::AtomicBool,
    /// The current (or last) request's prompt tokens and the tokens decoded for it.
    pub prompt_tokens: AtomicU64,
    pub decoded: AtomicU64,
    /// Tokens whose keys and values the slot's cache holds.
    pub cached: AtomicU64,
}

struct AppState {
    opts: ServeOptions,
    queue: SyncSender<Job>,
    metrics: Arc<Metrics>,
    slots: usize,
    started: Instant,
}

type Shared = Arc<AppState>;

/// One engine slot: given the queue, it runs jobs until the queue closes (it calls
/// [`worker::run_slot`] with its own decoder).
pub type Slot = Box<dyn FnOnce(Arc<Jobs>, Arc<Metrics>) + Send>;

/// Is this address a loopback one (no API key needed to bind it)?
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Serve on `listener` until `shutdown` resolves; then stop accepting, give in-flight replies
/// the shutdown grace to finish, end the rest with an error, and return once the slots are
/// done. Each of `slots` runs on a thread of its own.
pub async fn serve(
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    slots: Vec<Slot>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = opts.limits;
    let (tx, rx) = sync_channel::<Job>(opts.queue.max(1));
    let jobs = Arc::new(Jobs::new(
        rx,
        opts.queue_timeout,
        limits.stall_timeout,
        opts.reuse_prefix,
    ));
    let n_slots = slots.len();
    let metrics = Arc::new(Metrics {
        slots: (0..n_slots).map(|_| SlotState::default()).collect(),
        ..Default::default()
    });
    let handles: Vec<_> = (slots.into_iter().enumerate())
        .map(|(i, slot)| {
            let (jobs, metrics) = (jobs.clone(), metrics.clone());
            std::thread::Builder::new()
                .name(format!("slot-{i}"))
                .spawn(move || slot(jobs, metrics))
        })
        .collect::<std::io::Result<_>>()?;
    let state = Arc::new(AppState {
        opts,
        queue: tx,
        metrics,
        slots: n_slots,
        started: Instant::now(),
    });
    let app = router(state.clone());
    drop(state);
    let conns = connections::accept(listener, app, limits, shutdown).await;
    // In-flight replies get the grace; then the slots end theirs, and the connections close.
    let closed = conns.shutdown();
    tokio::pin!(closed);
    if tokio::time::timeout(limits.shutdown_grace, &mut closed)
        .await
        .is_err()
    {
        jobs.stop();
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut closed).await;
    }
    jobs.stop();
    let joined = tokio::task::spawn_blocking(move || {
        for h in handles {
            let _ = h.join();
        }
    });
    let _ = joined.await;
    Ok(())
}

fn router(state: Shared) -> Router {
    let read_body = || axum::middleware::from_fn_with_state(state.clone(), buffered);
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/slots", get(slots))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat).layer(read_body()))
        .route("/v1/completions", post(completions).layer(read_body()))
        .route("/v1/embeddings", post(embed::embeddings).layer(read_body()))
        .route("/tokenize", post(tokens::tokenize).layer(read_body()))
        .route("/detokenize", post(tokens::detokenize).layer(read_body()))
        .fallback(|| async { error(ApiError::not_found("no such route", "unknown_route")) })
        .method_not_allowed_fallback(|| async {
            error(ApiError {
                status: 405,
                ..ApiError::invalid("method not allowed on this route", None)
            })
        })
        .with_state(state)
}

/// Middleware of the generation routes: the whole body is read before the handler runs, in
/// the read timeout (408 past it) and up to the body limit (413 past it).
async fn buffered(
    State(s): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    // The key is checked on the headers, before a byte of the body is read (and a refused
    // request is not counted as a request).
    if let Err(e) = authorized(&s, &parts.headers) {
        return error(e);
    }
    let (limit, wait) = (s.opts.max_body, s.opts.limits.read_timeout);
    let too_large = || ApiError {
        status: 413,
        ..ApiError::invalid(format!("the body is larger than {limit} bytes"), None)
    };
    // An announced length past the limit is refused before any of it is read.
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        s.metrics.requests.fetch_add(1, Ordering::Relaxed);
        return error(too_large());
    }
    let bytes = match tokio::time::timeout(wait, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let over = (e.into_inner())
                .downcast::<http_body_util::LengthLimitError>()
                .is_ok();
            s.metrics.requests.fetch_add(1, Ordering::Relaxed);
            return error(match over {
                true => too_large(),
                false => ApiError::invalid("the body could not be read", None),
            });
        }
        Err(_) => {
            s.metrics.requests.fetch_add(1, Ordering::Relaxed);
            return error(ApiError {
                status: 408,
                ..ApiError::invalid(format!("the body did not arrive within {wait:?}"), None)
            });
        }
    };
    let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
    next.run(req).await
}

fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(e.body())).into_response()
}

async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

async fn health(State(s): State<Shared>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "slots": s.slots,
        "slots_busy": s.metrics.busy.load(Ordering::Relaxed),
        "queued": s.metrics.queued.load(Ordering::Relaxed),
    }))
}

/// `GET /slots`: each slot's context, whether it is generating, its request's prompt and decoded
/// token counts, and the tokens its cache holds (no prompt text). Behind the API key, as in
/// llama-server (what the clients are doing is theirs).
async fn slots(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorized(&s, &headers) {
        return error(e);
    }
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let slots: Vec<serde_json::Value> = (s.metrics.slots.iter().enumerate())
        .map(|(id, st)| {
            serde_json::json!({
                "id": id,
                "n_ctx": get(&st.n_ctx),
                "is_processing": st.processing.load(Ordering::Relaxed),
                "n_prompt_tokens": get(&st.prompt_tokens),
                "n_decoded": get(&st.decoded),
                "n_cached": get(&st.cached),
            })
        })
        .collect();
    axum::Json(slots).into_response()
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    let m = &s.metrics;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let tok_s = get(&m.generated) as f64 / (get(&m.gen_micros).max(1) as f64 / 1e6);
    let text = format!(
        "# HELP dejavu_requests_total Generation requests received.\n\
         # TYPE dejavu_requests_total counter\ndejavu_requests_total {}\n\
         # HELP dejavu_requests_failed_total Requests that ended in an error after queueing.\n\
         # TYPE dejavu_requests_failed_total counter\ndejavu_requests_failed_total {}\n\
         # HELP dejavu_requests_cancelled_total Replies stopped because the client went away.\n\
         # TYPE dejavu_requests_cancelled_total counter\ndejavu_requests_cancelled_total {}\n\
         # HELP dejavu_prompt_tokens_total Prompt tokens of started replies.\n\
         # TYPE dejavu_prompt_tokens_total counter\ndejavu_prompt_tokens_total {}\n\
         # HELP dejavu_prompt_tokens_reused_total Prompt tokens found in a slot's KV cache.\n\
         # TYPE dejavu_prompt_tokens_reused_total counter\ndejavu_prompt_tokens_reused_total {}\n\
         # HELP dejavu_generated_tokens_total Tokens generated.\n\
         # TYPE dejavu_generated_tokens_total counter\ndejavu_generated_tokens_total {}\n\
         # HELP dejavu_choices_batched_total Choices that ran as rows of their first choice's steps.\n\
         # TYPE dejavu_choices_batched_total counter\ndejavu_choices_batched_total {}\n\
         # HELP dejavu_queue_depth Requests waiting for a slot.\n\
         # TYPE dejavu_queue_depth gauge\ndejavu_queue_depth {}\n\
         # HELP dejavu_slots_busy Slots generating.\n\
         # TYPE dejavu_slots_busy gauge\ndejavu_slots_busy {}\n\
         # HELP dejavu_slots Engine slots.\n\
         # TYPE dejavu_slots gauge\ndejavu_slots {}\n\
         # HELP dejavu_tokens_per_second Generated tokens per second of slot time, since start.\n\
         # TYPE dejavu_tokens_per_second gauge\ndejavu_tokens_per_second {tok_s:.3}\n\
         # HELP dejavu_mlp_density Mean fraction of MLP neurons the sparsity policy computes.\n\
         # TYPE dejavu_mlp_density gauge\ndejavu_mlp_density{{policy=\"{}\"}} {:.4}\n\
         # HELP dejavu_uptime_seconds Seconds since the server started.\n\
         # TYPE dejavu_uptime_seconds gauge\ndejavu_uptime_seconds {:.1}\n",
        get(&m.requests),
        get(&m.failed),
        get(&m.cancelled),
        get(&m.prompt_tokens),
        get(&m.prompt_reused),
        get(&m.generated),
        get(&m.choices_forked),
        get(&m.queued),
        get(&m.busy),
        s.slots,
        s.opts.sparsity.replace('"', "'"),
        s.opts.mlp_density,
        s.started.elapsed().as_secs_f64(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// The names the model is served under, the listed one first: each `--alias`, the `--model`
/// argument as given, the file (or checkpoint directory) name and its stem.
pub fn model_names(aliases: &[String], launched_as: &str, path: &std::path::Path) -> Vec<String> {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned());
    let stem = path.file_stem().map(|f| f.to_string_lossy().into_owned());
    let mut names: Vec<String> = Vec::new();
    let given = aliases.iter().cloned().chain([launched_as.to_string()]);
    for n in given.chain(file).chain(stem) {
        if !n.is_empty() && !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

/// Refuse an API key no client could send: whitespace only, whitespace at either end (HTTP
/// trims header values), or characters a header value cannot hold.
pub fn check_api_key(key: &str) -> Result<(), String> {
    if key.trim().is_empty() {
        return Err("--api-key is only whitespace: no client could send it".into());
    }
    if key.trim() != key {
        return Err(
            "--api-key has whitespace at an end, which HTTP drops: no client could send it".into(),
        );
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b) || b == b' ') {
        return Err("--api-key must be printable ASCII (it travels in an HTTP header)".into());
    }
    Ok(())
}

/// `Authorization: Bearer KEY`, when the server has a key.
fn authorized(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.opts.api_key else {
        return Ok(());
    };
    let sent = (headers.get(header::AUTHORIZATION))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compared in time independent of where they differ.
    let same = sent.is_some_and(|t| {
        t.len() == key.len() && t.bytes().zip(key.bytes()).fold(0, |d, (a, b)| d | (a ^ b)) == 0
    });
    match same {
        true => Ok(()),
        false => Err(ApiError::unauthorized()),
    }
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorized(&s, &headers) {
        return error(e);
    }
    Json(json!({"object": "list", "data": [{
        "id": s.opts.model_id, "object": "model", "created": 0, "owned_by": "dejavu",
    }]}))
    .into_response()
}

// The bodies were read whole by `read_body`.
async fn chat(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, true).await
}

async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, false).await
}

/// Check, queue, and answer one request (streamed or whole).
async fn generate(s: Shared, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    if let Err(e) = authorized(&s, &headers) {
        return error(e);
    }
    s.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let parsed = Request::parse(&body).and_then(|r| {
        match r.model.as_deref() {
            None | Some("") => {}
            Some(m) if s.opts.model_names.iter().any(|n| n == m) => {}
            Some(m) => {
                return Err(ApiError::not_found(
                    format!("model `{m}` is not served here (GET /v1/models)"),
                    "model_not_found",
                ))
            }
        }
        r.validate(chat, s.opts.default_max_tokens, s.opts.vocab)
    });
    let req = match parsed {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let (stream, usage_chunk, logprobs) = (req.stream, req.include_usage, req.logprobs.is_some());
    let (rx, prompt_tokens) = match enqueue(&s, Work::Generate(Box::new(req))).await {
        Ok(started) => started,
        Err(e) => return error(e),
    };
    let reply = Reply {
        id: format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, unique()),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: s.opts.model_id.clone(),
        chat,
        prompt_tokens,
        logprobs,
    };
    match stream {
        true => streamed(reply, rx, usage_chunk).into_response(),
        false => whole(reply, rx).await,
    }
}

/// Queue `work` for a slot and wait for it to start: the events that follow, and the prompt's
/// tokens (its first event). A full queue, a slot that never came, and an error the slot
/// answered with are the errors.
async fn enqueue(s: &AppState, work: Work) -> Result<(mpsc::Receiver<Event>, usize), ApiError> {
    let (tx, mut rx) = mpsc::channel(64);
    let job = Job {
        work,
        tx,
        queued: Instant::now(),
    };
    s.metrics.queued.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = s.queue.try_send(job) {
        s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        return Err(match e {
            TrySendError::Full(_) => ApiError::busy("the queue is full: retry later"),
            TrySendError::Disconnected(_) => ApiError::busy("the server is shutting down"),
        });
    }
    // The first event says whether the reply starts (so errors keep their status).
    let wait = s.opts.queue_timeout + Duration::from_secs(5);
    let prompt_tokens = match tokio::time::timeout(wait, rx.recv()).await {
        Ok(Some(Event::Started { prompt_tokens })) => prompt_tokens,
        Ok(Some(Event::Error(e))) => return Err(e),
        Ok(_) => {
            return Err(ApiError::internal(
                "the slot ended the reply before it started",
            ))
        }
        Err(_) => return Err(ApiError::busy("timed out waiting for a slot")),
    };
    s.metrics
        .prompt_tokens
        .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    Ok((rx, prompt_tokens))
}

/// A JSON body of type `T` from a client the key lets in.
fn parse<T: serde::de::DeserializeOwned>(
    s: &AppState,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, ApiError> {
    authorized(s, headers)?;
    api::parse_body(body)
}

/// What every chunk or reply of one request repeats.
#[derive(Clone)]
struct Reply {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    prompt_tokens: usize,
    /// The request asked for log-probabilities.
    logprobs: bool,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One choice: the whole message, a chunk's delta, or a completion's text; with the
    /// log-probabilities `lp` of its tokens (from [`Self::logprobs`]).
    fn choice(
        &self,
        index: usize,
        text: Option<&str>,
        finish: Option<Finish>,
        chunk: bool,
        lp: Value,
    ) -> Value {
        let finish = finish.map(Finish::as_str);
        match (self.chat, chunk) {
            (true, false) => json!({"index": index, "finish_reason": finish, "logprobs": lp,
                "message": {"role": "assistant", "content": text.unwrap_or("")}}),
            (true, true) => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None if finish.is_none() => json!({"role": "assistant", "content": ""}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            (false, _) => json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp,
                "finish_reason": finish}),
        }
    }

    /// The `logprobs` of a choice holding `tokens` (null unless asked for): chat's `content`
    /// list, or the completions' `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`
    /// (`offset`: bytes of the reply before these tokens, advanced past them).
    fn logprobs(&self, tokens: &[TokenLogprob], offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        if self.chat {
            let entry = |p: &worker::Piece, l: f32| json!({"token": p.text, "logprob": l, "bytes": p.bytes});
            let content: Vec<Value> = (tokens.iter())
                .map(|t| {
                    let mut e = entry(&t.token, t.logprob);
                    let top: Vec<Value> = t.top.iter().map(|(p, l)| entry(p, *l)).collect();
                    e["top_logprobs"] = json!(top);
                    e
                })
                .collect();
            return json!({"content": content, "refusal": null});
        }
        let offsets: Vec<usize> = (tokens.iter())
            .map(|t| {
                let at = *offset;
                *offset += t.token.text.len();
                at
            })
            .collect();
        let top: Vec<serde_json::Map<String, Value>> = (tokens.iter())
            .map(|t| {
                t.top
                    .iter()
                    .map(|(p, l)| (p.text.clone(), json!(l)))
                    .collect()
            })
            .collect();
        json!({
            "tokens": tokens.iter().map(|t| t.token.text.as_str()).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }

    fn body(&self, choices: Vec<Value>, usage: Option<Usage>, chunk: bool) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(chunk), "created": self.created,
            "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }
}

/// OpenAI's `tool_calls` of a message (`index` set: a chunk's delta), each with a new id.
fn tool_calls(calls: &[crate::text::tools::ToolCall], index: bool) -> Value {
    let id = unique();
    let list: Vec<Value> = (calls.iter().enumerate())
        .map(|(i, c)| {
            let mut v = json!({"id": format!("call_{id}_{i}"), "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}});
            if index {
                v["index"] = json!(i);
            }
            v
        })
        .collect();
    Value::Array(list)
}

/// A reply collected whole: its choices in order of their index.
async fn whole(reply: Reply, mut rx: mpsc::Receiver<Event>) -> Response {
    /// A choice so far: its text, its tokens' log-probabilities, its tool calls.
    #[derive(Default)]
    struct Sofar {
        text: String,
        tokens: Vec<TokenLogprob>,
        calls: Vec<crate::text::tools::ToolCall>,
    }
    let mut sofar: std::collections::BTreeMap<usize, Sofar> = Default::default();
    let mut choices = std::collections::BTreeMap::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(i, t) => sofar.entry(i).or_default().text += &t,
            Event::Token(i, t) => sofar.entry(i).or_default().tokens.push(t),
            Event::ToolCalls(i, c) => sofar.entry(i).or_default().calls = c,
            Event::Finish(index, finish) => {
                let c = sofar.remove(&index).unwrap_or_default();
                let lp = reply.logprobs(&c.tokens, &mut 0);
                let mut choice = reply.choice(index, Some(&c.text), Some(finish), false, lp);
                if !c.calls.is_empty() {
                    let m = &mut choice["message"];
                    m["tool_calls"] = tool_calls(&c.calls, false);
                    if c.text.is_empty() {
                        m["content"] = Value::Null;
                    }
                }
                choices.insert(index, choice);
            }
            Event::Done { completion_tokens } => {
                let usage = Usage::new(reply.prompt_tokens, completion_tokens);
                let choices = choices.into_values().collect();
                return Json(reply.body(choices, Some(usage), false)).into_response();
            }
            Event::Error(e) => return error(e),
            Event::Started { .. } | Event::Embedding(_) => {}
        }
    }
    error(ApiError::internal("the slot ended the reply early"))
}

/// A reply as server-sent events: a role chunk per choice (chat), text chunks, a finishing
/// chunk per choice, usage if asked, `[DONE]`. A text chunk carries the log-probabilities of
/// the tokens since the last one (when asked for); those of tokens whose text never came
/// (held back, then cut by a stop sequence) go in a chunk of their own before the finishing
/// one. Dropping the stream (the client went away) drops the receiver, which stops the slot's
/// generation at its next token.
fn streamed(
    reply: Reply,
    rx: mpsc::Receiver<Event>,
    usage_chunk: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let data = |v: Value| SseEvent::default().data(v.to_string());
    // Chat opens each choice with a chunk of its role.
    let role = move |r: &Reply, index: usize| match r.chat {
        true => vec![data(r.body(
            vec![r.choice(index, None, None, true, Value::Null)],
            None,
            true,
        ))],
        false => Vec::new(),
    };
    let first = role(&reply, 0);
    let r = reply.clone();
    /// A choice's stream: whether its role chunk went out, its pending log-probabilities,
    /// and its text's bytes so far.
    #[derive(Default)]
    struct Open {
        opened: bool,
        pending: Vec<TokenLogprob>,
        offset: usize,
    }
    let mut open: std::collections::HashMap<usize, Open> = Default::default();
    open.entry(0).or_default().opened = true;
    // The choice's state, and its role chunk if this is its first event.
    let mut at =
        move |r: &Reply, index: usize, f: &mut dyn FnMut(&mut Open, &mut Vec<SseEvent>)| {
            let c = open.entry(index).or_default();
            let mut out = match std::mem::replace(&mut c.opened, true) {
                true => Vec::new(),
                false => role(r, index),
            };
            f(c, &mut out);
            out
        };
    let events = ReceiverStream::new(rx).map(move |ev| match ev {
        Event::Token(i, t) => {
            let mut t = Some(t);
            at(&r, i, &mut |c, _| c.pending.extend(t.take()))
        }
        Event::Text(i, t) => at(&r, i, &mut |c, out| {
            let lp = r.logprobs(&std::mem::take(&mut c.pending), &mut c.offset);
            out.push(data(r.body(
                vec![r.choice(i, Some(&t), None, true, lp)],
                None,
                true,
            )));
        }),
        Event::ToolCalls(i, calls) => at(&r, i, &mut |_, out| {
            let delta = json!({"tool_calls": tool_calls(&calls, true)});
            let choice = json!({"index": i, "delta": delta, "logprobs": null,
                "finish_reason": null});
            out.push(data(r.body(vec![choice], None, true)));
        }),
        Event::Finish(i, finish) => at(&r, i, &mut |c, out| {
            if !c.pending.is_empty() {
                let lp = r.logprobs(&std::mem::take(&mut c.pending), &mut c.offset);
                out.push(data(r.body(
                    vec![r.choice(i, Some(""), None, true, lp)],
                    None,
                    true,
                )));
            }
            let end = r.choice(i, None, Some(finish), true, Value::Null);
            out.push(data(r.body(vec![end], None, true)));
        }),
        Event::Done { completion_tokens } => {
            let mut out = Vec::new();
            if usage_chunk {
                let u = Usage::new(r.prompt_tokens, completion_tokens);
                out.push(data(r.body(Vec::new(), Some(u), true)));
            }
            out.push(SseEvent::default().data("[DONE]"));
            out
        }
        Event::Error(e) => vec![data(e.body()), SseEvent::default().data("[DONE]")],
        Event::Started { .. } | Event::Embedding(_) => Vec::new(),
    });
    let all = stream::iter(first)
        .chain(events.flat_map(stream::iter))
        .map(Ok);
    Sse::new(all)
}

/// A process-unique id suffix.
fn unique() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{n:x}", t & 0xffff_ffff)
}
