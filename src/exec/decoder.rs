//! What generation, perplexity, serving and calibration run on: one sequence's cache and the
//! forward pass that extends it ([`Decoder`]), and where such sequences are opened: a device
//! with the model on it ([`Sessions`]).
use crate::exec::{Capture, DeviceModel, DevicePlan, DeviceSession, Logits, StepStats};
use crate::model::config::ModelConfig;
use crate::sparsity::policy::Policy;
use crate::{Error, Result};
use dejavu_backend_api::Device;

/// What generation runs on: a sequence's KV cache and the model that extends it
/// (`exec::DeviceSession`, on the CPU or a GPU, or a tensor-parallel world).
pub trait Decoder {
    /// Run `tokens` after what the cache holds; the logits of the last. One token is a decode
    /// step, under the plan.
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]>;
    /// Run a prompt, or the rest of one after a cached prefix, after what the cache holds; the
    /// logits of its last token. Its tokens run as a prompt's do, even one alone (under a plan
    /// that selects per step, every unit: see `DeviceSession::prompt`).
    fn prompt(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.decode(tokens)
    }
    /// May a later prompt reuse, as its cached prefix, the positions decode steps wrote? On a
    /// batch-invariant device only where steps write bit for bit what a prompt of the same
    /// tokens writes (a plan that computes every unit), so that a warm cache changes no reply;
    /// elsewhere (no such guarantee to keep) yes. Where not, a prompt reuses only the positions
    /// an earlier prompt wrote.
    fn reuses_steps(&self) -> bool {
        true
    }
    /// Tokens in the cache.
    fn len(&self) -> usize;
    fn n_ctx(&self) -> usize;
    /// Forget positions from `len` on (a chat reuses the prefix it shares).
    fn truncate(&mut self, len: usize);
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The caller will not decode for a while (a reply ended): a decoder whose steps join a
    /// batch of sequences stops holding the batch for this one's next token.
    fn pause(&mut self) {}
    /// Up to `k` more decoders, each holding what this one holds, whose steps run as rows of
    /// this one's batch (the choices of one prompt, decoded together); none where the decoder
    /// does not batch. Each gives its sequence back when dropped.
    fn fork(&mut self, k: usize) -> Vec<Box<dyn Decoder + Send>> {
        let _ = k;
        Vec::new()
    }
    /// What the last decode step read and computed under the plan (`None` where not known).
    fn last_step(&self) -> Result<Option<StepStats>> {
        Ok(None)
    }
    /// Run `tokens` and return the rows `want` names (see [`Logits`]). A decoder that gathers
    /// only the last row's logits (a tensor-parallel world) refuses the others.
    fn run(&mut self, tokens: &[u32], want: Logits) -> Result<&mut [f32]> {
        match want {
            Logits::Last => self.decode(tokens),
            _ => Err(unsupported("rows other than the last")),
        }
    }
    /// The dense model's logits of each of `tokens` run at the next positions (`[n][vocab]`),
    /// each row as a dense decode step computes it, whatever the plan: the verification of a
    /// speculative draft (see `DeviceSession::verify`). The cache then holds the tokens.
    fn verify(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        let _ = tokens;
        Err(unsupported("speculative verification"))
    }
    /// Record each layer's block inputs from now on (see [`Capture`]), or stop.
    fn capture(&mut self, on: bool) -> Result<()> {
        let _ = on;
        Err(unsupported("capturing activations"))
    }
    /// What the runs since [`Self::capture`] recorded.
    fn take_capture(&mut self) -> Capture {
        Capture::default()
    }
    /// `|a|`, every MLP activation of layer `l` for the rows `h` (`[n][d_model]`, the layer's
    /// MLP inputs as a [`Capture`] holds them): `[n][n_ff]`, the magnitudes calibration's
    /// labels rank.
    fn mlp_activations(&mut self, l: usize, h: &[f32]) -> Result<Vec<f32>> {
        let _ = (l, h);
        Err(unsupported("MLP activations"))
    }
    /// From now on (or no longer), a prompt's batches apply a `teal` plan's thresholds: each
    /// projection's input rows zeroed below them, then multiplied as dense, so every row of a
    /// batch is what a decode step under the plan computes (up to the order of summation).
    /// What calibration's allocation search runs its candidates on.
    fn mask_batches(&mut self, on: bool) -> Result<()> {
        let _ = on;
        Err(unsupported("masked batches"))
    }
}

fn unsupported(what: &str) -> Error {
    Error::Invalid(format!(
        "{what}: not on a tensor-parallel world (one device only)"
    ))
}

/// Where sequences are opened: a device and the model on it (the CPU [`crate::exec::Engine`],
/// or a GPU). Perplexity comparisons and calibration open several and run on any.
pub trait Sessions {
    fn config(&self) -> &ModelConfig;
    /// The context of each sequence.
    fn n_ctx(&self) -> usize;
    /// An empty sequence under `policy`.
    fn open(&self, policy: &Policy) -> Result<Box<dyn Decoder + '_>>;
    /// The device's name, for reports (`cpu (2 threads, avx512)`, `cuda (NVIDIA H200)`).
    fn name(&self) -> String;
}

/// A device and a whole model on it (uploaded with the sparse layout when sparse policies are
/// to run): sequences of `n_ctx` positions.
pub struct OnDevice<'a, D: Device> {
    pub dev: &'a D,
    pub model: &'a DeviceModel<D>,
    pub n_ctx: usize,
}

impl<D: Device> Sessions for OnDevice<'_, D> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn open(&self, policy: &Policy) -> Result<Box<dyn Decoder + '_>> {
        let plan = DevicePlan::policy(self.dev, &self.model.config, policy)?;
        let session = DeviceSession::new(self.dev, self.model, plan, self.n_ctx)?;
        Ok(Box::new(session))
    }
    fn name(&self) -> String {
        self.dev.name()
    }
}
