//! What generation, perplexity and serving run on: one sequence's cache and the forward pass that
//! extends it.
use crate::exec::StepStats;
use crate::Result;

/// What generation runs on: a sequence's KV cache and the model that extends it
/// (`exec::DeviceSession`, on the CPU or a GPU, or a tensor-parallel world).
pub trait Decoder {
    /// Run `tokens` after what the cache holds; the logits of the last.
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]>;
    /// Tokens in the cache.
    fn len(&self) -> usize;
    fn n_ctx(&self) -> usize;
    /// Forget positions from `len` on (a chat reuses the prefix it shares).
    fn truncate(&mut self, len: usize);
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What a decode step reads and computes under the plan (`None` where not known).
    fn last_step(&self) -> Option<StepStats> {
        None
    }
}
