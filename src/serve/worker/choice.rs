//! One reply's choices: each samples its tokens from the prompt's logits, streaming their
//! text and log-probabilities, until a stop, the length, or its client goes away; the choices
//! of one wave run together, each on its own decoder and thread (rows of one batch).
use super::{internal, shutting_down, Event, Finish, Running, TokenLogprob};
use crate::exec::Decoder;
use crate::serve::api::{ApiError, GenRequest};
use crate::serve::tool_api::{marker_tokens, CallHold};
use crate::text::constrain::Guide;
use crate::text::generate::TextStream;
use crate::text::sampling::Sampler;
use crate::text::stop::StopFilter;
use crate::text::tools::ToolFormat;
use std::sync::atomic::Ordering;

/// The choices `starts` together from the prompt (its next-token logits `first`): the first on
/// `dec` (whose tokens `cached` records), each other on its fork, on its own thread. Each
/// choice's tokens, or `None` when its client went away.
pub(super) fn run_wave(
    slot: &Running,
    dec: &mut dyn Decoder,
    forks: &mut [Box<dyn Decoder + Send>],
    req: &GenRequest,
    starts: Vec<Start>,
    first: &[f32],
    cached: &mut Vec<u32>,
) -> Vec<Result<Option<usize>, ApiError>> {
    let mut starts = starts.into_iter();
    let Some(lead) = starts.next() else {
        return Vec::new();
    };
    std::thread::scope(|s| {
        let others: Vec<_> = (forks.iter_mut().zip(starts))
            .map(|(f, start)| {
                s.spawn(move || choice(slot, &mut **f, req, start, first, &mut Vec::new()))
            })
            .collect();
        let mut ends = vec![choice(slot, dec, req, lead, first, cached)];
        for h in others {
            let end = h.join();
            ends.push(
                end.unwrap_or_else(|_| Err(ApiError::internal("a choice's thread panicked"))),
            );
        }
        ends
    })
}

/// One choice and its `Finish`: its tokens, or `None` when its client went away.
fn choice(
    slot: &Running,
    dec: &mut dyn Decoder,
    req: &GenRequest,
    start: Start,
    first: &[f32],
    cached: &mut Vec<u32>,
) -> Result<Option<usize>, ApiError> {
    let index = start.index;
    let mut logits = first.to_vec();
    let Some((finish, n)) = one_choice(slot, dec, req, start, &mut logits, cached)? else {
        return Ok(None);
    };
    Ok(slot.send(Event::Finish(index, finish)).then_some(n))
}

/// Where a choice starts: the prompt, its seed, its grammar's guide, and the format of the
/// tool calls its reply may hold (tools offered).
pub(super) struct Start<'a> {
    pub(super) ids: &'a [u32],
    /// The choice's index.
    pub(super) index: usize,
    pub(super) seed: u64,
    pub(super) guide: Option<Guide>,
    pub(super) tools: Option<ToolFormat>,
}

/// One choice from the prompt (whose next-token `logits` are given; the cache holds exactly
/// the prompt): why it ended and its tokens, or `None` when its client went away.
fn one_choice(
    slot: &Running,
    dec: &mut dyn Decoder,
    req: &GenRequest,
    start: Start,
    logits: &mut [f32],
    cached: &mut Vec<u32>,
) -> Result<Option<(Finish, usize)>, ApiError> {
    let (engine, job, jobs) = (slot.engine, slot.job, slot.jobs);
    let send = |e: Event| slot.send(e);
    let keep_steps = dec.reuses_steps();
    let Start {
        ids,
        index,
        seed,
        mut guide,
        tools,
    } = start;
    let mut calls = CallHold::new(tools, req.tools.as_ref());
    let marks = marker_tokens(engine, tools);
    let eog = &engine.tokenizer.end_of_generation;
    let mut sampling = req.sampling.clone();
    sampling.seed = seed;
    if req.ignore_eos && guide.is_none() {
        (sampling.logit_bias).extend(eog.iter().map(|&t| (t, f32::NEG_INFINITY)));
    }
    let mut sampler = Sampler::new(sampling);
    let mut raw = Vec::new();
    let mut stops = StopFilter::new(&req.stop);
    let (mut history, mut n, mut stream) = (ids.to_vec(), 0, TextStream::default());
    let mut logits = logits;
    let finish = loop {
        if n == req.max_tokens {
            break Finish::Length;
        }
        crate::text::generate::check_logits(engine, logits).map_err(internal)?;
        if req.logprobs.is_some() {
            raw.clear();
            raw.extend_from_slice(logits);
        }
        if let Some(g) = &mut guide {
            g.mask(logits).map_err(grammar_error)?;
        }
        let next = sampler.sample(logits, &history);
        if eog.contains(&next) {
            break Finish::Stop;
        }
        if let Some(k) = req.logprobs {
            if !send(Event::Token(index, TokenLogprob::of(engine, &raw, next, k))) {
                return Ok(None);
            }
        }
        let complete = match &mut guide {
            Some(g) => g.advance(next).map_err(grammar_error)?,
            None => false,
        };
        n += 1;
        history.push(next);
        if let Some(st) = slot.state {
            st.decoded.fetch_add(1, Ordering::Relaxed);
        }
        let piece = match marks.iter().find(|(id, _)| *id == next) {
            // A call's marker that is a control token: its text, for the call's parser.
            Some((_, m)) => Some(m.to_string()),
            None => stream.push(engine, next).map_err(internal)?,
        };
        let (text, stopped) = stops.push(piece.as_deref().unwrap_or(""));
        let text = calls.push(&text);
        if !text.is_empty() && !send(Event::Text(index, text)) {
            return Ok(None);
        }
        if stopped || complete {
            break Finish::Stop;
        }
        if job.tx.is_closed() {
            return Ok(None);
        }
        if jobs.stopping() {
            return Err(shutting_down());
        }
        if dec.len() + 1 >= dec.n_ctx() {
            break Finish::Length;
        }
        logits = match dec.decode(&[next]) {
            Ok(l) => l,
            // The KV pool has no room for this reply's next position.
            Err(crate::Error::Busy(_)) => break Finish::Length,
            Err(e) => return Err(internal(e)),
        };
        // A later prompt reuses this position only where a step writes what a prompt would
        // (a sparse plan's steps do not: the prompt then computes it again, as a cold cache).
        if keep_steps {
            cached.push(next);
        }
    };
    // The held-back text and the detokenizer's rest, unless a stop sequence ended the reply.
    if !stops.stopped {
        let rest = stream.finish(engine).map_err(internal)?.unwrap_or_default();
        let (text, _) = stops.push(&rest);
        let tail = calls.push(&(text + &stops.flush()));
        if !tail.is_empty() {
            send(Event::Text(index, tail));
        }
    }
    let (rest, found) = calls.finish();
    if !rest.is_empty() && !send(Event::Text(index, rest)) {
        return Ok(None);
    }
    match found {
        None => Ok(Some((finish, n))),
        Some(c) => Ok(send(Event::ToolCalls(index, c)).then_some((Finish::ToolCalls, n))),
    }
}

/// A grammar that reached one of the parser's limits mid-reply: the request's fault, a 400
/// with the parser's short reason.
fn grammar_error(e: String) -> ApiError {
    ApiError::invalid(format!("the grammar or schema: {e}"), None)
}
