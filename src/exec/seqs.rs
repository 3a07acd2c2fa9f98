//! Several sequences on one device, decoded together: what continuous batching runs on
//! (`dejavu serve --parallel N`). Each sequence has its own KV cache; a step of several runs
//! one row per sequence through [`DeviceSession::step_many`].
use crate::exec::{DeviceSession, Logits};
use crate::{Error, Result};
use dejavu_backend_api::Device;

/// Sequences `0..count()` of one model on one device.
pub trait SeqBatch {
    fn count(&self) -> usize;
    /// The context of each sequence.
    fn n_ctx(&self) -> usize;
    /// Tokens in sequence `seq`'s cache.
    fn len(&self, seq: usize) -> usize;
    /// Forget sequence `seq`'s positions from `len` on.
    fn truncate(&mut self, seq: usize, len: usize);
    /// Do steps of several sequences run as one batch (every sequence's plan batches: see
    /// `DeviceSession::batches`)? If not, [`Self::step`] runs them one after another.
    fn batches(&self) -> bool;
    /// `tokens` after what sequence `seq` holds, alone (a prompt, or a chunk of one, run as a
    /// prompt: see `DeviceSession::prompt`); the rows `want` names.
    fn run(&mut self, seq: usize, tokens: &[u32], want: Logits) -> Result<Vec<f32>>;
    /// One decode step of the distinct sequences `seqs`: `tokens[i]` after what `seqs[i]`
    /// holds. The logits, `[n][vocab]`.
    fn step(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<Vec<f32>>;
    /// The density of the MLP unions the batched steps under a sparse plan computed since the
    /// last call (their neurons over their layers'); `None` when none did.
    fn union_density(&mut self) -> Option<f64> {
        None
    }
    /// Forget sequence `seq`'s positions and give its caches' memory back where the device
    /// can.
    fn release(&mut self, seq: usize) -> Result<()>;
    /// Sequence `to` holds sequence `from`'s first `len` positions, and nothing after.
    fn fork(&mut self, from: usize, to: usize, len: usize) -> Result<()>;
    /// May a later prompt reuse what decode steps wrote (see `Decoder::reuses_steps`)?
    fn reuses_steps(&self) -> bool {
        true
    }
}

impl<D: Device> SeqBatch for Vec<DeviceSession<'_, D>> {
    fn count(&self) -> usize {
        self.len()
    }
    fn n_ctx(&self) -> usize {
        self.first().map_or(0, crate::exec::Decoder::n_ctx)
    }
    fn len(&self, seq: usize) -> usize {
        self.get(seq).map_or(0, |s| s.len())
    }
    fn truncate(&mut self, seq: usize, len: usize) {
        if let Some(s) = self.get_mut(seq) {
            s.truncate(len);
        }
    }
    fn batches(&self) -> bool {
        self.iter().all(|s| s.batches())
    }
    fn reuses_steps(&self) -> bool {
        self.iter().all(|s| s.reuses_steps())
    }
    fn run(&mut self, seq: usize, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let s = self.get_mut(seq).ok_or_else(|| no_sequence(seq))?;
        Ok(s.run_as(tokens, want, true)?.to_vec())
    }
    fn release(&mut self, seq: usize) -> Result<()> {
        let s = self.get_mut(seq).ok_or_else(|| no_sequence(seq))?;
        s.release()
    }
    fn fork(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
        let (lo, hi) = (from.min(to), from.max(to));
        if from == to || hi >= self.len() {
            return Err(no_sequence(hi));
        }
        let (a, b) = self.split_at_mut(hi);
        match from < to {
            true => b[0].copy_prefix(&a[lo], len),
            false => a[lo].copy_prefix(&b[0], len),
        }
    }
    fn union_density(&mut self) -> Option<f64> {
        let (u, n) = (self.iter_mut().map(|s| s.take_union_counts()))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        (n > 0).then(|| u as f64 / n as f64)
    }
    fn step(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
        let mut all: Vec<Option<&mut DeviceSession<D>>> = self.iter_mut().map(Some).collect();
        let mut rows = Vec::with_capacity(seqs.len());
        for &s in seqs {
            let taken = all.get_mut(s).and_then(Option::take);
            rows.push(taken.ok_or_else(|| no_sequence(s))?);
        }
        if rows.iter().all(|s| s.batches()) {
            return DeviceSession::step_many(&mut rows, tokens);
        }
        if tokens.len() != rows.len() {
            return Err(Error::Invalid(
                "a step's tokens and sequences differ".into(),
            ));
        }
        let mut out = Vec::new();
        for (s, &t) in rows.iter_mut().zip(tokens) {
            out.extend_from_slice(s.forward(&[t])?);
        }
        Ok(out)
    }
}

fn no_sequence(seq: usize) -> Error {
    Error::Invalid(format!(
        "sequence {seq} is not in the batch, or named twice"
    ))
}
