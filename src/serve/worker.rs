//! Engine slots: each runs on its own thread with its own decoder (KV cache), taking jobs from
//! the shared bounded queue. A job streams [`Event`]s back; a client that goes away (its
//! receiver dropped), or reads nothing for the stall timeout, cancels its job at the next token,
//! freeing the slot.
use super::api::{ApiError, GenRequest, Input};
use super::tool_api::{constraint_of, tool_format, ToolUse};
use super::Metrics;
use crate::exec::Decoder;
use crate::exec::Engine;
use crate::text::chat::encode_chat_tools;
use crate::text::constrain::Constraint;
use crate::text::constrain::{Grammars, Guide};
use crate::text::generate::reusable;
use crate::text::tools::ToolCall;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

mod choice;
use choice::{run_wave, Start};

/// Why a reply ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens`, or the context window is full.
    Length,
    /// The reply called tools (its calls were sent as [`Event::ToolCalls`]).
    ToolCalls,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// What a job sends back, in order: `Started` (or one `Error`); per choice (the first field
/// of a choice's events: its index) its `Token`s and `Text`s, then its `Finish`; then `Done`.
/// The events of choices that run together (rows of one batch) interleave. An `Error` may end
/// the events at any point.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Error(ApiError),
    Started {
        prompt_tokens: usize,
    },
    /// A reply token's log-probabilities (when asked for), sent before the text it adds.
    Token(usize, TokenLogprob),
    Text(usize, String),
    /// A choice's tool calls, read from its reply (after its content).
    ToolCalls(usize, Vec<ToolCall>),
    /// One input's embedding (`/v1/embeddings`), in the order of the inputs.
    Embedding(Vec<f32>),
    /// A choice ended.
    Finish(usize, Finish),
    Done {
        completion_tokens: usize,
    },
}

/// A reply token's log-probability and its most likely alternatives, under the model's own
/// distribution (the log-softmax of its logits, before `logit_bias`, penalties and temperature:
/// what vLLM reports by default).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: Piece,
    pub logprob: f32,
    /// Most likely first.
    pub top: Vec<(Piece, f32)>,
}

/// A token's text (its bytes may be part of a character: the text then holds U+FFFD).
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl TokenLogprob {
    /// Of token `chosen` under `logits` (the model's, unmodified), with the `k` most likely.
    pub fn of(engine: &Engine, logits: &[f32], chosen: u32, k: usize) -> Self {
        let log_z = crate::eval::perplexity::log_sum_exp(logits) as f32;
        let lp = |t: u32| {
            logits
                .get(t as usize)
                .map_or(f32::NEG_INFINITY, |l| l - log_z)
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(ids.len());
        if k > 0 && k < ids.len() {
            ids.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
        }
        ids.truncate(k);
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let piece = |t: u32| {
            let text = engine.tokenizer.decode(&[t]).unwrap_or_default();
            Piece {
                bytes: text.as_bytes().to_vec(),
                text,
            }
        };
        Self {
            token: piece(chosen),
            logprob: lp(chosen),
            top: ids.into_iter().map(|t| (piece(t), lp(t))).collect(),
        }
    }
}

/// What a job asks a slot for.
pub enum Work {
    Generate(Box<GenRequest>),
    /// The pooled final hidden state of each text (`/v1/embeddings`).
    Embed(Vec<String>),
}

/// One request in the queue.
pub struct Job {
    pub work: Work,
    pub tx: Sender<Event>,
    pub queued: Instant,
}

/// The queue the slots share, and the server's word to them.
pub struct Jobs {
    rx: Mutex<Receiver<Job>>,
    /// Jobs that waited longer get a 503 instead of a reply.
    pub queue_timeout: Duration,
    /// How long a send may wait on a client that reads nothing before its reply is dropped
    /// as cancelled (a slow reader must not hold a slot).
    pub stall_timeout: Duration,
    /// Keep each slot's KV cache between jobs and compute only what a new prompt does not share
    /// with it (a chat that continues does not recompute its history).
    pub reuse_prefix: bool,
    /// Set when shutdown's grace has run out: replies end with a 503 error at their next token
    /// and waiting jobs are refused.
    stopping: AtomicBool,
}

impl Jobs {
    pub fn new(
        rx: Receiver<Job>,
        queue_timeout: Duration,
        stall_timeout: Duration,
        reuse_prefix: bool,
    ) -> Self {
        Self {
            rx: Mutex::new(rx),
            queue_timeout,
            stall_timeout,
            reuse_prefix,
            stopping: AtomicBool::new(false),
        }
    }

    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The next job; `None` once the queue has closed (or a slot panicked holding it).
    fn next(&self) -> Option<Job> {
        loop {
            let rx = self.rx.lock().ok()?;
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(job) => return Some(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
            }
            drop(rx);
            if self.stopping() {
                // Shutdown: refuse what still waits, then end.
                while let Ok(job) = self.rx.lock().ok()?.try_recv() {
                    let _ = job.tx.try_send(Event::Error(shutting_down()));
                }
                return None;
            }
        }
    }
}

fn shutting_down() -> ApiError {
    ApiError::busy("the server is shutting down")
}

/// Send `e` unless the client is gone or has read nothing for `stall` (then `false`).
fn send(tx: &Sender<Event>, mut e: Event, stall: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        match tx.try_send(e) {
            Ok(()) => return true,
            Err(TrySendError::Closed(_)) => return false,
            Err(TrySendError::Full(back)) if t0.elapsed() < stall => {
                e = back;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(TrySendError::Full(_)) => return false,
        }
    }
}

/// Take jobs until the queue closes or shutdown stops the slots; each runs on `dec`.
pub fn run_slot(engine: &Engine, dec: &mut dyn Decoder, jobs: &Jobs, metrics: &Metrics) {
    let id = metrics.next_slot.fetch_add(1, Ordering::Relaxed);
    let state = metrics.slots.get(id);
    if let Some(st) = state {
        st.n_ctx.store(dec.n_ctx() as u64, Ordering::Relaxed);
    }
    // The tokens whose keys and values the decoder's cache holds, in order.
    let mut cached: Vec<u32> = Vec::new();
    // Structured output's compiler for this vocabulary, made on the first request that asks.
    let mut grammars: Option<Grammars> = None;
    while let Some(job) = jobs.next() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        if job.tx.is_closed() {
            continue; // the client went away while queued
        }
        if jobs.stopping() {
            send(&job.tx, Event::Error(shutting_down()), jobs.stall_timeout);
            continue;
        }
        if job.queued.elapsed() > jobs.queue_timeout {
            let timeout = jobs.queue_timeout;
            let e = ApiError::busy(format!("timed out after {timeout:?} in the queue"));
            send(&job.tx, Event::Error(e), jobs.stall_timeout);
            continue;
        }
        metrics.busy.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        if let Some(st) = state {
            st.processing.store(true, Ordering::Relaxed);
            st.prompt_tokens.store(0, Ordering::Relaxed);
            st.decoded.store(0, Ordering::Relaxed);
        }
        let slot = Running {
            engine,
            job: &job,
            jobs,
            state,
        };
        let done = match &job.work {
            Work::Generate(req) => run_job(&slot, dec, req, &mut grammars, &mut cached),
            Work::Embed(texts) => embed(&slot, dec, texts, &mut cached),
        };
        dec.pause();
        if let Some(st) = state {
            st.cached.store(cached.len() as u64, Ordering::Relaxed);
            st.processing.store(false, Ordering::Relaxed);
        }
        metrics.busy.fetch_sub(1, Ordering::Relaxed);
        match done {
            Ok(Ran {
                n,
                cancelled,
                reused,
                forked,
            }) => {
                metrics
                    .choices_forked
                    .fetch_add(forked as u64, Ordering::Relaxed);
                metrics
                    .prompt_reused
                    .fetch_add(reused as u64, Ordering::Relaxed);
                if cancelled {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                metrics.generated.fetch_add(n as u64, Ordering::Relaxed);
                let us = t0.elapsed().as_micros().max(1) as u64;
                metrics.gen_micros.fetch_add(us, Ordering::Relaxed);
                // Last: a client that reads /metrics once its reply is whole sees it counted.
                if !cancelled && matches!(job.work, Work::Generate(_)) {
                    let done = Event::Done {
                        completion_tokens: n,
                    };
                    send(&job.tx, done, jobs.stall_timeout);
                }
            }
            Err(e) => {
                metrics.failed.fetch_add(1, Ordering::Relaxed);
                send(&job.tx, Event::Error(e), jobs.stall_timeout);
            }
        }
    }
}

/// The prompt's tokens: a conversation through the model's chat template (which places its own
/// BOS) with the `tools` offered, or a plain prompt with the model's BOS.
pub fn prompt_tokens(
    engine: &Engine,
    input: &Input,
    tools: Option<&ToolUse>,
) -> Result<Vec<u32>, ApiError> {
    let t = &engine.tokenizer;
    let ids = match input {
        Input::Chat(messages) => {
            if !t.has_chat_template() {
                return Err(ApiError::invalid(
                    "this model has no chat template: use /v1/completions",
                    Some("messages"),
                ));
            }
            let tools = tools.map(|u| &u.tools[..]);
            return encode_chat_tools(t, messages, tools)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")));
        }
        Input::Text(s) => t.encode_prompt(s),
    };
    ids.map_err(|e| ApiError::invalid(e.to_string(), None))
}

/// How a job went.
struct Ran {
    /// Completion tokens.
    n: usize,
    /// It stopped early because the client is gone.
    cancelled: bool,
    /// Prompt tokens found in the cache.
    reused: usize,
    /// Choices that ran beside the first, on sequences the batch lent.
    forked: usize,
}

/// What a job runs with.
struct Running<'a> {
    engine: &'a Engine,
    job: &'a Job,
    jobs: &'a Jobs,
    /// The slot's `/slots` entry.
    state: Option<&'a super::SlotState>,
}

impl Running<'_> {
    /// Send `e` (false: the client is gone).
    fn send(&self, e: Event) -> bool {
        send(&self.job.tx, e, self.jobs.stall_timeout)
    }
}

/// The structured-output guide of `c` (`None`: free text), compiling the vocabulary's trie
/// into `grammars` on first use; a schema or grammar that does not compile is a 400.
fn guide(
    engine: &Engine,
    c: Option<&Constraint>,
    grammars: &mut Option<Grammars>,
    n_vocab: usize,
) -> Result<Option<Guide>, ApiError> {
    let Some(c) = c else {
        return Ok(None);
    };
    if grammars.is_none() {
        *grammars = Some(Grammars::new(&engine.tokenizer, n_vocab).map_err(internal)?);
    }
    let g = grammars.as_ref().expect("made above");
    g.matcher(c).map(Some).map_err(|e| {
        ApiError::invalid(
            format!("the grammar or schema: {e}"),
            Some("response_format"),
        )
    })
}

/// Generate a request's `n` choices, sending their events. `cached` is what the decoder's
/// cache holds; it is kept up to date with every token decoded. The prompt runs once; each
/// choice after the first starts again from its cached keys and values and its logits, with
/// the seed plus the choice's index.
fn run_job(
    slot: &Running,
    dec: &mut dyn Decoder,
    req: &GenRequest,
    grammars: &mut Option<Grammars>,
    cached: &mut Vec<u32>,
) -> Result<Ran, ApiError> {
    let engine = slot.engine;
    let fmt = tool_format(engine, req)?;
    let constraint = constraint_of(engine, req, fmt)?;
    // A prompt that cannot fit whatever its tokens is refused before it is tokenized (a 1 MiB
    // text costs a second and hundreds of MB to tokenize).
    let bytes = match &req.input {
        Input::Chat(messages) => messages.iter().map(|m| m.content.len()).sum(),
        Input::Text(s) => s.len(),
    };
    let least = bytes / engine.tokenizer.max_token_bytes();
    if least + 1 > dec.n_ctx() {
        return Err(ApiError::invalid(
            format!(
                "the prompt has at least {least} tokens ({bytes} bytes); the context window \
                 holds {} (prompt and reply)",
                dec.n_ctx()
            ),
            None,
        ));
    }
    let ids = prompt_tokens(engine, &req.input, req.tools.as_ref())?;
    if let Some(st) = slot.state {
        st.prompt_tokens.store(ids.len() as u64, Ordering::Relaxed);
    }
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", None));
    }
    if ids.len() + 1 > dec.n_ctx() {
        return Err(ApiError::invalid(
            format!(
                "the prompt has {} tokens; the context window holds {} (prompt and reply)",
                ids.len(),
                dec.n_ctx()
            ),
            None,
        ));
    }
    let n_vocab = engine.model.config.vocab_size;
    let mut first_guide = guide(engine, constraint.as_ref(), grammars, n_vocab)?;
    let mut ran = Ran {
        n: 0,
        cancelled: true,
        reused: 0,
        forked: 0,
    };
    if !slot.send(Event::Started {
        prompt_tokens: ids.len(),
    }) {
        return Ok(ran);
    }
    let reused = match slot.jobs.reuse_prefix && req.cache_prompt {
        true => reusable(cached, &ids),
        false => 0,
    };
    cached.truncate(reused.min(dec.len()));
    dec.truncate(cached.len());
    ran.reused = cached.len();
    // A cache the KV pool took back while the slot was idle: the whole prompt again.
    let first = match dec.prompt(&ids[ran.reused..]).map(|l| l.to_vec()) {
        Err(crate::Error::Evicted) => {
            cached.clear();
            dec.truncate(0);
            ran.reused = 0;
            dec.prompt(&ids).map(|l| l.to_vec())
        }
        first => first,
    };
    let first = first.map_err(decode_error)?;
    cached.extend_from_slice(&ids[ran.reused..]);
    // The choices beside the first run as rows of the same steps, on sequences the batch
    // lends (forks of this prompt); the rest, in further waves.
    let mut forks = match req.n > 1 {
        true => dec.fork(req.n - 1),
        false => Vec::new(),
    };
    ran.forked = forks.len();
    let mut choice = 0;
    while choice < req.n {
        let wave = (req.n - choice).min(1 + forks.len());
        if choice > 0 {
            dec.truncate(ids.len());
            cached.truncate(ids.len());
            forks.iter_mut().for_each(|f| f.truncate(ids.len()));
        }
        let mut starts = Vec::with_capacity(wave);
        for index in choice..choice + wave {
            let guide = match first_guide.take() {
                Some(g) => Some(g),
                None => guide(engine, constraint.as_ref(), grammars, n_vocab)?,
            };
            starts.push(Start {
                ids: &ids,
                index,
                seed: req.sampling.seed.wrapping_add(index as u64),
                guide,
                tools: fmt,
            });
        }
        let ends = run_wave(
            slot,
            dec,
            &mut forks[..wave - 1],
            req,
            starts,
            &first,
            cached,
        );
        let mut gone = false;
        for end in ends {
            match end? {
                Some(n) => ran.n += n,
                None => gone = true,
            }
        }
        if gone {
            return Ok(ran);
        }
        choice += wave;
    }
    // The reply's `Done` goes out from `run_slot`, after the metrics count it.
    ran.cancelled = false;
    Ok(ran)
}

/// Embed each of `texts` (with the model's BOS, as a plain prompt): the mean over its tokens
/// of the final hidden state as the output head reads it (normed, and projected where the
/// model projects it), scaled to unit L2 norm (llama-server's mean pooling and
/// normalization). The slot's cache is overwritten.
fn embed(
    slot: &Running,
    dec: &mut dyn Decoder,
    texts: &[String],
    cached: &mut Vec<u32>,
) -> Result<Ran, ApiError> {
    let engine = slot.engine;
    let mut all = Vec::with_capacity(texts.len());
    for t in texts {
        let ids = prompt_tokens(engine, &Input::Text(t.clone()), None)?;
        if ids.is_empty() || ids.len() > dec.n_ctx() {
            return Err(ApiError::invalid(
                format!(
                    "an input of {} tokens: embeddings take 1 to {} (the context)",
                    ids.len(),
                    dec.n_ctx()
                ),
                Some("input"),
            ));
        }
        all.push(ids);
    }
    let prompt_tokens: usize = all.iter().map(Vec::len).sum();
    let send = |e: Event| slot.send(e);
    let cancelled = Ran {
        n: 0,
        cancelled: true,
        reused: 0,
        forked: 0,
    };
    if !send(Event::Started { prompt_tokens }) {
        return Ok(cancelled);
    }
    cached.clear();
    for ids in &all {
        dec.truncate(0);
        let n = ids.len();
        let h = dec
            .run(ids, crate::exec::Logits::Hidden(0, n))
            .map_err(|e| ApiError::invalid(format!("embeddings: {e}"), None))?;
        let d = h.len() / n;
        let mut mean = vec![0f64; d];
        for row in h.chunks_exact(d) {
            mean.iter_mut().zip(row).for_each(|(m, &v)| *m += v as f64);
        }
        let norm = mean.iter().map(|v| v * v).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        let v = mean.iter().map(|&m| (m * scale) as f32).collect();
        if !send(Event::Embedding(v)) || slot.jobs.stopping() {
            dec.truncate(0);
            return Ok(cancelled);
        }
    }
    dec.truncate(0);
    send(Event::Done {
        completion_tokens: 0,
    });
    Ok(Ran {
        n: 0,
        cancelled: false,
        reused: 0,
        forked: 0,
    })
}

/// A prompt's run failing: a full KV pool is a 503 (retry later), anything else a 500.
fn decode_error(e: crate::Error) -> ApiError {
    match e {
        crate::Error::Busy(m) => ApiError::busy(m),
        e => internal(e),
    }
}

fn internal(e: crate::Error) -> ApiError {
    ApiError::internal(format!("generation failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{send, Event};
    use crate::text::stop::StopFilter;
    use std::time::{Duration, Instant};

    #[test]
    fn a_client_that_reads_nothing_stalls_a_send_only_for_the_stall_timeout() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let stall = Duration::from_millis(60);
        assert!(send(&tx, Event::Text(0, "a".into()), stall), "room for one");
        let t0 = Instant::now();
        assert!(
            !send(&tx, Event::Text(0, "b".into()), stall),
            "full: given up"
        );
        assert!(t0.elapsed() >= stall && t0.elapsed() < stall * 10);
        assert_eq!(rx.try_recv(), Ok(Event::Text(0, "a".into())));
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            (rx.blocking_recv(), rx.blocking_recv())
        });
        assert!(send(
            &tx,
            Event::Text(0, "c".into()),
            Duration::from_secs(5)
        ));
        assert!(
            send(&tx, Event::Text(0, "d".into()), Duration::from_secs(5)),
            "read in time"
        );
        let got = reader.join().unwrap();
        assert_eq!(
            got,
            (
                Some(Event::Text(0, "c".into())),
                Some(Event::Text(0, "d".into()))
            )
        );
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, s) = f.push(p);
            out += &t;
            if s {
                return (out, true);
            }
        }
        (out + &f.flush(), false)
    }

    #[test]
    fn stop_sequences_cut_the_reply_across_pieces() {
        assert_eq!(run(&["\n\n"], &["a", "b\n", "\nc"]), ("ab".into(), true));
        assert_eq!(run(&["END"], &["xE", "N", "y"]), ("xENy".into(), false));
        assert_eq!(run(&["END", "x"], &["aEN", "Dx"]), ("a".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
