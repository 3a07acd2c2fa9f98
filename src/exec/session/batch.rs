//! A prompt's batches: up to [`dejavu_backend_api::MAX_ROWS`] tokens through the one layer loop
//! at once ([`Pass::Batch`]: every neuron and head; a policy selects per token, at decode steps).
//! A fixed sparse plan runs its prompt token by token. Layers under lazy K/V keep the batch's
//! inputs and fill every head's keys and values from them, those a head missed before the batch
//! included.
use super::rows::Want;
use super::step::Pass;
use super::DeviceSession;
use crate::exec::plan::Sel;
use crate::{Error, Result};
use dejavu_backend_api::Device;

impl<D: Device> DeviceSession<'_, D> {
    /// Can the prompt run in batches? Every selection is every unit or predicted per token (a
    /// batch then runs every unit); a fixed sparse selection runs token by token.
    pub(super) fn batchable(&self) -> bool {
        let free = |s: &Sel<D>| !matches!(s, Sel::Fixed { .. });
        self.plan.mlp.iter().chain(&self.plan.heads).all(free)
    }

    /// `tokens` (1 to [`dejavu_backend_api::MAX_ROWS`]) at the next positions as one batch,
    /// handing back what `want` names of it; `steps`: each row as a dense decode step
    /// computes it (see [`Pass::Batch`]).
    pub(super) fn run_batch(&mut self, tokens: &[u32], want: Want, steps: bool) -> Result<()> {
        let (dev, n) = (self.dev, tokens.len());
        if self.s.grow(dev, self.model, n, self.n_ctx)? {
            self.forget_graphs();
        }
        dev.set_step(tokens, self.len)?;
        self.layers(Pass::Batch { rows: n, steps }, &mut None)?;
        match want {
            Want::Nothing => Ok(()),
            Want::Last => {
                // The last row to the front (through `h`, free after the layers), then the head.
                let (s, d) = (&mut self.s, self.model.local.d_model);
                dev.take_rows(&s.x, n - 1, 1, d, &mut s.h)?;
                dev.copy(&s.h, &mut s.x, d)?;
                self.output(&mut None)
            }
            Want::Rows { rows, hidden } => self.batch_rows(rows, hidden, steps),
        }
    }

    /// The dense model's verdict on a speculative draft: `tokens` (1 to
    /// [`dejavu_backend_api::MAX_ROWS`]) at the next positions as one batch of every unit, the
    /// logits of each (`[n][vocab]`), each row computed as a dense decode step at its position
    /// computes it (bit for bit on the CPU: [`Device::matmul_steps`]), and the keys and values
    /// of those positions written as dense decoding writes them. The caller then truncates the
    /// cache past the rows it keeps. Whatever the plan, this is the dense model: a draft that
    /// the sparse steps wrote at these positions is overwritten.
    pub fn verify(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.check(tokens)?;
        if tokens.len() > dejavu_backend_api::MAX_ROWS {
            return Err(Error::Invalid(format!(
                "a verification of {} tokens: at most {} at once",
                tokens.len(),
                dejavu_backend_api::MAX_ROWS
            )));
        }
        if self.plan.lazy_kv {
            return Err(Error::Invalid(
                "speculation under lazy K/V: its caches fill from the sparse steps' inputs; \
                 drop lazy-kv (the dense verification computes every key and value anyway)"
                    .into(),
            ));
        }
        if !self.model.shard.is_whole() {
            return Err(Error::Invalid(
                "speculation's verification needs every row's logits: one device only".into(),
            ));
        }
        self.clamp_lazy()?;
        self.rows_out.clear();
        let n = tokens.len();
        let want = Want::Rows {
            rows: 0..n,
            hidden: false,
        };
        self.run_batch(tokens, want, true)?;
        self.len += n;
        Ok(&mut self.rows_out)
    }
}
