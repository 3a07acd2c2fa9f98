//! Continuous batching: one thread owns every slot's sequence ([`SeqBatch`]) and runs their
//! decode steps together, one row per sequence, so one read of the weights serves every
//! reply in flight. Slots keep their own threads and their straight-line code (sampling,
//! grammars, stop sequences, streaming); their decoder is a [`BatchDecoder`] that hands its
//! tokens to this thread and waits for the logits.
//!
//! Each round the thread runs the waiting prompts, in turn, up to [`PROMPT_CHUNK`] tokens in all
//! (so a long prompt does not stall the replies in flight for longer), then one step of the decode rows that
//! have arrived. A step waits for every sequence of the last step to send its next token (a
//! slot samples between steps), at most [`JOIN_WAIT`]; new sequences join at the next step.
//! A slot whose reply ends says so ([`Decoder::pause`]), and the step stops waiting for it.
//!
//! With a KV pool ([`Pool`], `serve --kv-pool`) the sequences' positions are bounded together:
//! a prompt chunk or a step that needs more than is free first takes back the caches of idle
//! sequences, least recently used first.
//!
//! The choices of one request (`n` > 1) run as rows of the same steps: its slot borrows idle
//! slots' sequences, each forked from its prompt ([`Decoder::fork`]). While a sequence is lent,
//! its own slot's asks wait; it comes back empty, so that slot's cached prefix is gone
//! (`Error::Evicted` at its next prompt, which then runs whole).
use crate::exec::{Decoder, Logits, SeqBatch};
use crate::{Error, Result};
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prompt tokens run between two decode steps, of one prompt or several (vLLM's chunked
/// prefill, llama.cpp's micro-batch); a prompt's chunk is one prompt batch, as `generate` runs
/// a prompt. Measured with
/// `tools/serve_bench.py` on SmolLM2 at 2 threads, alternating: a 512-token prompt's first
/// token came after 0.64-0.87 s with chunks of 512 against 0.84-0.90 s with chunks of 128
/// while 7 other replies ran, at the same aggregate tok/s (the others wait out one chunk).
pub const PROMPT_CHUNK: usize = 512;
/// How long a step waits for the sequences of the last step to send their next token.
pub const JOIN_WAIT: Duration = Duration::from_millis(5);

/// What a slot asks of the batch thread.
enum Op {
    /// Run tokens after the `from` positions the sequence holds; reply with the rows `want`
    /// names and the new length (`Error::Evicted` when the pool took its positions back).
    Run {
        tokens: Vec<u32>,
        want: Logits,
        from: usize,
        /// (The rest of) a prompt, run as a prompt even when one token (`Decoder::prompt`).
        prompt: bool,
    },
    Truncate(usize),
    Pause,
    /// Lend up to `k` idle sequences, each holding the first `len` positions of the asker's.
    Fork {
        k: usize,
        len: usize,
        reply: Sender<Vec<usize>>,
    },
    /// A lent sequence goes back to its slot, empty.
    Return,
}

type Reply = Result<(Vec<f32>, usize)>;

/// One message on the batch thread's queue.
pub struct Ask {
    seq: usize,
    op: Op,
    reply: Option<Sender<Reply>>,
    /// Asked through a lent sequence's decoder (not its own slot's).
    lent: bool,
}

/// A slot's sequence, or one lent to another slot's choice (returned when dropped), decoded
/// on the batch thread.
pub struct BatchDecoder {
    seq: usize,
    tx: Sender<Ask>,
    len: usize,
    n_ctx: usize,
    out: Vec<f32>,
    lent: bool,
    /// The sequences' `SeqBatch::reuses_steps`, set by the batch thread when it starts (until
    /// then `false`: a prompt reuses only what prompts wrote).
    reuses: Arc<AtomicBool>,
}

/// The batch thread's end of the decoders' queue (for [`run`]).
pub struct Queue {
    rx: Receiver<Ask>,
    reuses: Arc<AtomicBool>,
}

/// The batch thread's queue and a decoder for each of `n` sequences of `n_ctx` positions.
pub fn decoders(n: usize, n_ctx: usize) -> (Vec<BatchDecoder>, Queue) {
    let (tx, rx) = channel();
    let reuses = Arc::new(AtomicBool::new(false));
    let decs = (0..n)
        .map(|seq| BatchDecoder {
            seq,
            tx: tx.clone(),
            len: 0,
            n_ctx,
            out: Vec::new(),
            lent: false,
            reuses: reuses.clone(),
        })
        .collect();
    (decs, Queue { rx, reuses })
}

impl BatchDecoder {
    /// `Decoder::run`; `prompt`: the tokens are (the rest of) a prompt.
    fn run_as(&mut self, tokens: &[u32], want: Logits, prompt: bool) -> Result<&mut [f32]> {
        let (tx, rx) = channel();
        let (tokens, from) = (tokens.to_vec(), self.len);
        let op = Op::Run {
            tokens,
            want,
            from,
            prompt,
        };
        self.ask(op, Some(tx))?;
        let got = rx
            .recv()
            .map_err(|_| Error::Invalid("the batch thread has ended".into()))?;
        if let Err(Error::Evicted) = got {
            self.len = 0;
        }
        let (out, len) = got?;
        (self.out, self.len) = (out, len);
        Ok(&mut self.out)
    }

    fn ask(&self, op: Op, reply: Option<Sender<Reply>>) -> Result<()> {
        let ask = Ask {
            seq: self.seq,
            op,
            reply,
            lent: self.lent,
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
        self.run_as(tokens, want, false)
    }
    fn prompt(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.run_as(tokens, Logits::Last, true)
    }
    fn reuses_steps(&self) -> bool {
        self.reuses.load(Ordering::Acquire)
    }
    fn pause(&mut self) {
        let _ = self.ask(Op::Pause, None);
    }
    fn fork(&mut self, k: usize) -> Vec<Box<dyn Decoder + Send>> {
        let (tx, rx) = channel();
        let (len, n_ctx) = (self.len, self.n_ctx);
        if k == 0 || self.ask(Op::Fork { k, len, reply: tx }, None).is_err() {
            return Vec::new();
        }
        let seqs = rx.recv().unwrap_or_default();
        (seqs.into_iter())
            .map(|seq| {
                let tx = self.tx.clone();
                let out = Vec::new();
                let d = BatchDecoder {
                    seq,
                    tx,
                    len,
                    n_ctx,
                    out,
                    lent: true,
                    reuses: self.reuses.clone(),
                };
                Box::new(d) as Box<dyn Decoder + Send>
            })
            .collect()
    }
}

impl Drop for BatchDecoder {
    fn drop(&mut self) {
        if self.lent {
            let _ = self.ask(Op::Return, None);
        }
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
/// `chunk` tokens ([`PROMPT_CHUNK`]; at least 1), the sequences' positions bounded by `pool`
/// when given.
pub fn run(seqs: &mut dyn SeqBatch, queue: Queue, chunk: usize, pool: Option<usize>) {
    let Queue { rx, reuses } = queue;
    reuses.store(seqs.reuses_steps(), Ordering::Release);
    let chunk = chunk.max(1);
    let mut pool = pool.map(|size| Pool::new(size, seqs.count()));
    let mut steps: Vec<(usize, u32, Sender<Reply>)> = Vec::new();
    let mut prompts: VecDeque<Prompt> = VecDeque::new();
    // Sequences mid-reply: the next step waits (a while) for their tokens.
    let mut expected = BTreeSet::new();
    let mut since: Option<Instant> = None;
    let mut open = true;
    let mut lending = Lending::new(seqs.count());
    while open || !steps.is_empty() || !prompts.is_empty() {
        // Take what has arrived: wait for something when there is nothing to do, or for the
        // rows the step expects.
        loop {
            let idle = steps.is_empty() && prompts.is_empty();
            let waiting = !idle && prompts.is_empty() && !all_in(&expected, &steps);
            let msg = if let Some(ask) = lending.replay.pop_front() {
                Ok(ask)
            } else if idle && open {
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
            let Some(ask) = lending.admit(ask) else {
                continue;
            };
            match ask.op {
                Op::Truncate(len) => seqs.truncate(ask.seq, len),
                Op::Pause => {
                    expected.remove(&ask.seq);
                }
                Op::Fork { k, len, reply } => {
                    let _ = reply.send(lending.lend(seqs, &mut pool, ask.seq, k, len));
                }
                Op::Return => {
                    expected.remove(&ask.seq);
                    lending.give_back(seqs, ask.seq);
                }
                Op::Run {
                    tokens,
                    want,
                    from,
                    prompt,
                } => {
                    let Some(reply) = ask.reply else { continue };
                    if seqs.len(ask.seq) != from {
                        let _ = reply.send(Err(Error::Evicted));
                        continue;
                    }
                    match (tokens.as_slice(), want) {
                        (&[t], Logits::Last) if !prompt => {
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
                            let len = seqs.len(ask.seq) + tokens.len();
                            let room = need(&mut pool, seqs, &lending, ask.seq, len);
                            let out = room.and_then(|()| seqs.run(ask.seq, &tokens, want));
                            let _ = reply.send(out.map(|o| (o, seqs.len(ask.seq))));
                        }
                    }
                }
            }
        }
        // Waiting prompts in turn while their next chunks fit `chunk` tokens in all: several
        // short prompts start together (their replies then step together from their first
        // token); a long one runs one chunk. A prompt's chunks are always `chunk` tokens from
        // its start (the splits `generate` makes: another split rounds otherwise).
        let mut budget = chunk;
        while let Some(next) = prompts.front() {
            let take = chunk.min(next.tokens.len() - next.done);
            if take > budget {
                break;
            }
            budget -= take;
            let mut p = prompts.pop_front().expect("looked at");
            let end = p.done + take;
            // The whole rest of the prompt, so that one that cannot fit runs no chunk.
            let len = seqs.len(p.seq) + p.tokens.len() - p.done;
            let ran = need(&mut pool, seqs, &lending, p.seq, len)
                .and_then(|()| seqs.run(p.seq, &p.tokens[p.done..end], Logits::Last));
            match ran {
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
        if let Some(p) = &mut pool {
            // Each row's next position, or its reply is the pool's error.
            let mut kept = Vec::with_capacity(steps.len());
            for (seq, t, reply) in steps.drain(..) {
                let len = seqs.len(seq) + 1;
                match p.need(seqs, seq, len, |s| lending.busy(s)) {
                    Ok(()) => kept.push((seq, t, reply)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            steps = kept;
        }
        if !steps.is_empty() {
            step(seqs, &mut steps, &mut expected);
            since = None;
        }
    }
}

/// Which sequences are lent to another slot's choices, and which are in use by their own slot
/// (a reply in flight: asked since its last pause); either is busy, the rest idle (the KV
/// pool's to take back, a fork's to borrow). The asks of a slot whose sequence is lent wait,
/// then run in order once it is back.
struct Lending {
    lent: Vec<bool>,
    active: Vec<bool>,
    waiting: Vec<Ask>,
    replay: VecDeque<Ask>,
}

impl Lending {
    fn new(n: usize) -> Self {
        Self {
            lent: vec![false; n],
            active: vec![false; n],
            waiting: Vec::new(),
            replay: VecDeque::new(),
        }
    }

    /// Whether sequence `s` is lent or has a reply in flight.
    fn busy(&self, s: usize) -> bool {
        self.lent.get(s).is_some_and(|&l| l) || self.active.get(s).is_some_and(|&a| a)
    }

    /// `ask` if it may run now; a slot's ask for its lent sequence waits.
    fn admit(&mut self, ask: Ask) -> Option<Ask> {
        let Some(&lent) = self.lent.get(ask.seq) else {
            return Some(ask);
        };
        if ask.lent {
            return Some(ask);
        }
        if lent {
            self.waiting.push(ask);
            return None;
        }
        self.active[ask.seq] = !matches!(ask.op, Op::Pause);
        Some(ask)
    }

    /// Up to `k` idle sequences (neither lent nor in use), each forked from the first `len`
    /// positions of `from` (room made in the pool first); fewer where there are fewer, or a
    /// fork fails.
    fn lend(
        &mut self,
        seqs: &mut dyn SeqBatch,
        pool: &mut Option<Pool>,
        from: usize,
        k: usize,
        len: usize,
    ) -> Vec<usize> {
        let mut got = Vec::new();
        for to in 0..self.lent.len() {
            if got.len() == k {
                break;
            }
            if to == from || self.busy(to) {
                continue;
            }
            if need(pool, seqs, self, to, len).is_err() {
                break;
            }
            if seqs.fork(from, to, len).is_err() {
                // Partly copied at most: its slot's cached prefix is gone.
                seqs.truncate(to, 0);
                break;
            }
            self.lent[to] = true;
            got.push(to);
        }
        got
    }

    /// Sequence `seq` back from a choice, empty; its slot's waiting asks run next.
    fn give_back(&mut self, seqs: &mut dyn SeqBatch, seq: usize) {
        if let Some(l) = self.lent.get_mut(seq) {
            *l = false;
        }
        seqs.truncate(seq, 0);
        let (back, rest) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|a: &Ask| a.seq == seq);
        self.waiting = rest;
        self.replay.extend(back);
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

/// [`Pool::need`] when there is a pool, the busy sequences those `lending` says.
fn need(
    pool: &mut Option<Pool>,
    seqs: &mut dyn SeqBatch,
    lending: &Lending,
    seq: usize,
    len: usize,
) -> Result<()> {
    match pool {
        Some(p) => p.need(seqs, seq, len, |s| lending.busy(s)),
        None => Ok(()),
    }
}

/// The KV positions the sequences hold together (`serve --kv-pool`), at most `size`. A
/// sequence holds the most positions it has held since its caches were last given back (its
/// pages stay mapped); an idle sequence's cache (the prompt prefix a next request may reuse)
/// is the first to go back when another needs room.
pub struct Pool {
    size: usize,
    held: Vec<usize>,
    /// When each sequence last grew (a count of growths), for least-recently-used eviction.
    last: Vec<u64>,
    clock: u64,
}

impl Pool {
    pub fn new(size: usize, n: usize) -> Self {
        Self {
            size,
            held: vec![0; n],
            last: vec![0; n],
            clock: 0,
        }
    }

    /// Positions held now.
    pub fn used(&self) -> usize {
        self.held.iter().sum()
    }

    /// Room for sequence `seq` to hold `len` positions: idle sequences (not `busy`) give their
    /// caches back (least recently used first) until it fits; `Error::Busy` when the busy ones
    /// hold too much.
    pub fn need(
        &mut self,
        seqs: &mut dyn SeqBatch,
        seq: usize,
        len: usize,
        busy: impl Fn(usize) -> bool,
    ) -> Result<()> {
        let have = *self
            .held
            .get(seq)
            .ok_or_else(|| Error::Invalid(format!("sequence {seq}")))?;
        if len <= have {
            return Ok(());
        }
        while self.used() - have + len > self.size {
            let idle = (0..self.held.len())
                .filter(|&s| s != seq && !busy(s) && self.held[s] > 0)
                .min_by_key(|&s| self.last[s]);
            let Some(s) = idle else {
                return Err(Error::Busy(format!(
                    "the KV pool is full: the replies in flight hold {} of its {} positions, and \
                     this one needs {len}; retry later",
                    self.used() - have,
                    self.size
                )));
            };
            seqs.release(s)?;
            self.held[s] = 0;
        }
        self.clock += 1;
        (self.held[seq], self.last[seq]) = (len, self.clock);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::Decoder;

    /// Sequences that hold their tokens; a row's logits are its length after the run.
    struct Held(Vec<Vec<u32>>, Sender<usize>);

    impl SeqBatch for Held {
        fn count(&self) -> usize {
            self.0.len()
        }
        fn n_ctx(&self) -> usize {
            100
        }
        fn len(&self, seq: usize) -> usize {
            self.0[seq].len()
        }
        fn truncate(&mut self, seq: usize, len: usize) {
            self.0[seq].truncate(len);
        }
        fn batches(&self) -> bool {
            true
        }
        fn run(&mut self, seq: usize, tokens: &[u32], _: Logits) -> Result<Vec<f32>> {
            self.0[seq].extend_from_slice(tokens);
            Ok(vec![self.0[seq].len() as f32])
        }
        fn step(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
            let rows = seqs.iter().zip(tokens);
            rows.map(|(&s, &t)| self.run(s, &[t], Logits::Last).map(|r| r[0]))
                .collect()
        }
        fn release(&mut self, seq: usize) -> Result<()> {
            self.0[seq].clear();
            let _ = self.1.send(seq);
            Ok(())
        }
        fn fork(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
            self.0[to] = self.0[from][..len].to_vec();
            Ok(())
        }
    }

    /// [`Held`], each run and step told to the test: `(seq, tokens)` of a run, `(usize::MAX,
    /// rows)` of a step.
    struct Logged(Held, Sender<(usize, usize)>);

    impl SeqBatch for Logged {
        fn count(&self) -> usize {
            self.0.count()
        }
        fn n_ctx(&self) -> usize {
            self.0.n_ctx()
        }
        fn len(&self, seq: usize) -> usize {
            self.0.len(seq)
        }
        fn truncate(&mut self, seq: usize, len: usize) {
            self.0.truncate(seq, len)
        }
        fn batches(&self) -> bool {
            true
        }
        fn run(&mut self, seq: usize, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
            let _ = self.1.send((seq, tokens.len()));
            self.0.run(seq, tokens, want)
        }
        fn step(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
            let _ = self.1.send((usize::MAX, seqs.len()));
            self.0.step(seqs, tokens)
        }
        fn release(&mut self, seq: usize) -> Result<()> {
            self.0.release(seq)
        }
        fn fork(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
            self.0.fork(from, to, len)
        }
    }

    /// Short prompts waiting together run in one round, before the step, while their chunks
    /// fit the round's tokens; a long prompt's chunks are `chunk` tokens from its start
    /// whatever ran before them in its round.
    #[test]
    fn waiting_prompts_share_a_round_and_keep_their_chunks() {
        let (decs, rx) = decoders(4, 100);
        // Queued in this order before the batch thread starts: d's one token (a step), then
        // the prompts of a (3 tokens), b (4) and c (20); each client is given 100 ms to send
        // before the next starts (a busy machine too).
        let clients: Vec<_> = (decs.into_iter().zip([1, 3, 4, 20]))
            .map(|(mut dec, n)| {
                let t = std::thread::spawn(move || dec.decode(&vec![1; n]).map(|l| l[0]));
                std::thread::sleep(Duration::from_millis(100));
                t
            })
            .collect();
        let (log_tx, log) = channel();
        let (freed_tx, _freed) = channel();
        let thread = std::thread::spawn(move || {
            let mut seqs = Logged(Held(vec![Vec::new(); 4], freed_tx), log_tx);
            run(&mut seqs, rx, 8, None);
        });
        let lens: Vec<f32> = clients
            .into_iter()
            .map(|t| t.join().unwrap().unwrap())
            .collect();
        assert_eq!(lens, [1.0, 3.0, 4.0, 20.0]);
        thread.join().unwrap();
        let step = usize::MAX;
        let got: Vec<(usize, usize)> = log.try_iter().collect();
        assert_eq!(got, [(1, 3), (2, 4), (step, 1), (3, 8), (3, 8), (3, 4)]);
    }

    /// A slot's choices borrow idle sequences only (not one mid-reply), each forked from its
    /// prompt; the owner of a lent sequence waits until it is back, then learns its cached
    /// prefix is gone.
    #[test]
    fn forks_borrow_idle_sequences_and_their_slots_wait() {
        let (mut decs, rx) = decoders(3, 100);
        let (freed_tx, _freed) = channel();
        let thread = std::thread::spawn(move || {
            let mut held = Held(vec![Vec::new(); 3], freed_tx);
            run(&mut held, rx, 8, None);
        });
        let mut c = decs.pop().unwrap();
        let mut b = decs.pop().unwrap();
        let mut a = decs.pop().unwrap();
        assert_eq!(c.decode(&[1, 2]).unwrap()[0], 2.0, "c mid-reply");
        assert_eq!(b.decode(&[7, 7, 7]).unwrap()[0], 3.0);
        b.pause();
        assert_eq!(a.decode(&[5; 10]).unwrap()[0], 10.0);
        let mut forks = a.fork(2);
        assert_eq!(forks.len(), 1, "b's sequence only: c's reply is in flight");
        assert_eq!(forks[0].len(), 10);
        assert_eq!(
            forks[0].decode(&[6]).unwrap()[0],
            11.0,
            "a's prompt, forked"
        );
        let (tx, waited) = channel();
        let owner = std::thread::spawn(move || {
            let got = b.decode(&[8]).map(|l| l[0]);
            tx.send(got.is_ok()).unwrap();
            (got.err(), b.len())
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            waited.try_recv().is_err(),
            "b waits while its sequence is lent"
        );
        assert_eq!(a.decode(&[6]).unwrap()[0], 11.0);
        drop(forks);
        let (err, len) = owner.join().unwrap();
        assert!(matches!(err, Some(Error::Evicted)), "{err:?}");
        assert_eq!(len, 0);
        drop((a, c));
        thread.join().unwrap();
    }

    /// A pool of 40 positions over two sequences: an idle sequence's cache goes back when the
    /// other needs room, its slot then learns it is gone (`Error::Evicted`, its length 0); a
    /// sequence whose reply is in flight keeps its positions, and the one that needs more
    /// gets `Error::Busy` without running.
    #[test]
    fn the_pool_takes_back_idle_caches_and_refuses_past_busy_ones() {
        let (mut decs, rx) = decoders(2, 100);
        let (freed_tx, freed) = channel();
        let thread = std::thread::spawn(move || {
            let mut held = Held(vec![Vec::new(), Vec::new()], freed_tx);
            run(&mut held, rx, 8, Some(40));
        });
        let prompt: Vec<u32> = (0..30).collect();
        let (a, b) = decs.split_at_mut(1);
        let (a, b) = (&mut a[0], &mut b[0]);
        assert_eq!(a.decode(&prompt).unwrap()[0], 30.0);
        a.pause();
        assert_eq!(
            b.decode(&prompt).unwrap()[0],
            30.0,
            "room made by taking a's back"
        );
        assert_eq!(freed.recv().unwrap(), 0);
        assert!(matches!(a.decode(&[7]), Err(Error::Evicted)));
        assert_eq!(a.len(), 0);
        match a.decode(&prompt) {
            Err(Error::Busy(m)) => assert!(m.contains("30 of its 40"), "{m}"),
            other => panic!("b's reply is in flight: {:?}", other.map(|l| l.to_vec())),
        }
        assert_eq!(b.decode(&[1]).unwrap()[0], 31.0, "b steps on");
        b.pause();
        assert_eq!(a.decode(&prompt).unwrap()[0], 30.0);
        assert_eq!(freed.recv().unwrap(), 1);
        drop(decs);
        thread.join().unwrap();
    }
}
