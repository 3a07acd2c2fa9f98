//! Continuous batching: one thread owns every slot's sequence ([`SeqBatch`]) and runs their
//! decode steps together, one row per sequence, so one read of the weights serves every
//! reply in flight. Slots keep their own threads and their straight-line code (sampling,
//! grammars, stop sequences, streaming); their decoder is a [`BatchDecoder`] that hands its
//! tokens to this thread and waits for the logits.
//!
//! Each round the thread runs one chunk of a waiting prompt ([`PROMPT_CHUNK`] tokens, so a
//! long prompt does not stall the replies in flight for longer), then one step of the decode rows that
//! have arrived. A step waits for every sequence of the last step to send its next token (a
//! slot samples between steps), at most [`JOIN_WAIT`]; new sequences join at the next step.
//! A slot whose reply ends says so ([`Decoder::pause`]), and the step stops waiting for it.
use crate::exec::{Decoder, Logits, SeqBatch};
use crate::{Error, Result};
use std::collections::{BTreeSet, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Tokens of a prompt run between two decode steps (vLLM's chunked prefill, llama.cpp's
/// micro-batch): one prompt batch, as `generate` runs a prompt. Measured with
/// `tools/serve_bench.py` on SmolLM2 at 2 threads, alternating: a 512-token prompt's first
/// token came after 0.64-0.87 s with chunks of 512 against 0.84-0.90 s with chunks of 128
/// while 7 other replies ran, at the same aggregate tok/s (the others wait out one chunk).
pub const PROMPT_CHUNK: usize = 512;
/// How long a step waits for the sequences of the last step to send their next token.
pub const JOIN_WAIT: Duration = Duration::from_millis(5);

/// What a slot asks of the batch thread.
enum Op {
    /// Run tokens after what the sequence holds; reply with the rows `want` names and the new
    /// length.
    Run {
        tokens: Vec<u32>,
        want: Logits,
    },
    Truncate(usize),
    Pause,
}

type Reply = Result<(Vec<f32>, usize)>;

/// One message on the batch thread's queue.
pub struct Ask {
    seq: usize,
    op: Op,
    reply: Option<Sender<Reply>>,
}

/// A slot's sequence, decoded on the batch thread.
pub struct BatchDecoder {
    seq: usize,
    tx: Sender<Ask>,
    len: usize,
    n_ctx: usize,
    out: Vec<f32>,
}

/// The batch thread's queue and a decoder for each of `n` sequences of `n_ctx` positions.
pub fn decoders(n: usize, n_ctx: usize) -> (Vec<BatchDecoder>, Receiver<Ask>) {
    let (tx, rx) = channel();
    let decs = (0..n)
        .map(|seq| BatchDecoder {
            seq,
            tx: tx.clone(),
            len: 0,
            n_ctx,
            out: Vec::new(),
        })
        .collect();
    (decs, rx)
}

impl BatchDecoder {
    fn ask(&self, op: Op, reply: Option<Sender<Reply>>) -> Result<()> {
        let ask = Ask {
            seq: self.seq,
            op,
            reply,
        };
        (self.tx.send(ask)).map_err(|_| Error::Invalid("the batch thread has ended".into()))
    }
}

impl Decoder for BatchDecoder {
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.run(tokens, Logits::Last)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// Always sent: after a failed run the sequence may hold more than `len()` says (chunks
    /// of a prompt that ran before the failure).
    fn truncate(&mut self, len: usize) {
        if self.ask(Op::Truncate(len), None).is_ok() {
            self.len = self.len.min(len);
        }
    }
    fn run(&mut self, tokens: &[u32], want: Logits) -> Result<&mut [f32]> {
        let (tx, rx) = channel();
        let tokens = tokens.to_vec();
        self.ask(Op::Run { tokens, want }, Some(tx))?;
        let (out, len) = rx
            .recv()
            .map_err(|_| Error::Invalid("the batch thread has ended".into()))??;
        (self.out, self.len) = (out, len);
        Ok(&mut self.out)
    }
    fn pause(&mut self) {
        let _ = self.ask(Op::Pause, None);
    }
}

/// A prompt being run in chunks.
struct Prompt {
    seq: usize,
    tokens: Vec<u32>,
    done: usize,
    reply: Sender<Reply>,
}

/// Serve the decoders' asks on `seqs` until every decoder is gone, running prompts in chunks of
/// `chunk` tokens ([`PROMPT_CHUNK`]; at least 1).
pub fn run(seqs: &mut dyn SeqBatch, rx: Receiver<Ask>, chunk: usize) {
    let chunk = chunk.max(1);
    let mut steps: Vec<(usize, u32, Sender<Reply>)> = Vec::new();
    let mut prompts: VecDeque<Prompt> = VecDeque::new();
    // Sequences mid-reply: the next step waits (a while) for their tokens.
    let mut expected = BTreeSet::new();
    let mut since: Option<Instant> = None;
    let mut open = true;
    while open || !steps.is_empty() || !prompts.is_empty() {
        // Take what has arrived: wait for something when there is nothing to do, or for the
        // rows the step expects.
        loop {
            let idle = steps.is_empty() && prompts.is_empty();
            let waiting = !idle && prompts.is_empty() && !all_in(&expected, &steps);
            let msg = if idle && open {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else if waiting && open {
                let left = JOIN_WAIT.saturating_sub(since.map_or(JOIN_WAIT, |t| t.elapsed()));
                if left.is_zero() {
                    break;
                }
                rx.recv_timeout(left)
            } else {
                match rx.try_recv() {
                    Ok(m) => Ok(m),
                    Err(_) => break,
                }
            };
            let ask = match msg {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    break;
                }
            };
            match ask.op {
                Op::Truncate(len) => seqs.truncate(ask.seq, len),
                Op::Pause => {
                    expected.remove(&ask.seq);
                }
                Op::Run { tokens, want } => {
                    let Some(reply) = ask.reply else { continue };
                    match (tokens.as_slice(), want) {
                        (&[t], Logits::Last) => {
                            since.get_or_insert_with(Instant::now);
                            steps.push((ask.seq, t, reply));
                        }
                        (_, Logits::Last) if !tokens.is_empty() => prompts.push_back(Prompt {
                            seq: ask.seq,
                            tokens,
                            done: 0,
                            reply,
                        }),
                        // Rows other than the last (embeddings): the whole run at once.
                        _ => {
                            let out = seqs.run(ask.seq, &tokens, want);
                            let _ = reply.send(out.map(|o| (o, seqs.len(ask.seq))));
                        }
                    }
                }
            }
        }
        if let Some(mut p) = prompts.pop_front() {
            let end = (p.done + chunk).min(p.tokens.len());
            match seqs.run(p.seq, &p.tokens[p.done..end], Logits::Last) {
                Ok(out) if end == p.tokens.len() => {
                    let _ = p.reply.send(Ok((out, seqs.len(p.seq))));
                    expected.insert(p.seq);
                }
                Ok(_) => {
                    p.done = end;
                    prompts.push_back(p);
                }
                Err(e) => {
                    let _ = p.reply.send(Err(e));
                }
            }
        }
        if !steps.is_empty() {
            step(seqs, &mut steps, &mut expected);
            since = None;
        }
    }
}

/// Whether every expected sequence has its row in `steps`.
fn all_in(expected: &BTreeSet<usize>, steps: &[(usize, u32, Sender<Reply>)]) -> bool {
    expected.iter().all(|e| steps.iter().any(|(s, ..)| s == e))
}

/// One step of the rows in `steps` (emptied), each reply its row's logits; the stepped
/// sequences are expected at the next one.
fn step(
    seqs: &mut dyn SeqBatch,
    steps: &mut Vec<(usize, u32, Sender<Reply>)>,
    expected: &mut BTreeSet<usize>,
) {
    let ids: Vec<usize> = steps.iter().map(|(s, ..)| *s).collect();
    let tokens: Vec<u32> = steps.iter().map(|(_, t, _)| *t).collect();
    match seqs.step(&ids, &tokens) {
        Ok(out) => {
            let vocab = out.len() / ids.len().max(1);
            for ((seq, _, reply), row) in steps.drain(..).zip(out.chunks_exact(vocab.max(1))) {
                let _ = reply.send(Ok((row.to_vec(), seqs.len(seq))));
                expected.insert(seq);
            }
        }
        // One bad row fails the step before it runs: each row again on its own, so only the
        // bad one gets the error.
        Err(_) if steps.len() > 1 => {
            for (seq, t, reply) in steps.drain(..) {
                let out = seqs.step(&[seq], &[t]);
                let _ = reply.send(out.map(|o| (o, seqs.len(seq))));
                expected.insert(seq);
            }
        }
        Err(e) => {
            for (_, _, reply) in steps.drain(..) {
                let _ = reply.send(Err(Error::Invalid(e.to_string())));
            }
        }
    }
}
