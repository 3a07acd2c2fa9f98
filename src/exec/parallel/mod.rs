//! Tensor parallelism (Megatron-LM's split, as the Deja Vu paper ran OPT-175B on 8 GPUs): each
//! rank of a world holds a [`Shard`] of every layer and runs the device step on it, and the
//! ranks sum their partial outputs with the device's collectives (`Device::all_reduce`, NCCL on
//! GPUs).
//!
//! - Attention: the rank's heads. W_q, W_k and W_v are split by rows (column-parallel), W_o by
//!   columns (row-parallel); the KV cache holds the rank's heads only. One all-reduce after W_o.
//! - MLP: the rank's neurons. fc1 (and the gate) by rows, fc2 by columns; one all-reduce after
//!   fc2. The biases of W_o and fc2 are added by rank 0 only, so the sum holds them once.
//! - Embedding and output head: split by vocabulary rows. A token outside a rank's rows looks up
//!   zeros, and an all-reduce gives every rank the whole row; each rank's logits of its rows are
//!   all-gathered.
//! - Norms, learned positions and the OPT projections are replicated.
//! - Sparse plans: each rank selects among its own neurons and heads (K / world per rank, from
//!   the replicated predictors' scores of its units); a fixed plan's sets are split by range.
//!
//! A rank's layers are the whole model's shapes with `n_heads`, `n_kv_heads` and `n_ff` divided
//! by the world ([`Shard::local_config`]), so the session's step is the same verbs: world size 1
//! is the single-device path itself.
use crate::model::config::ModelConfig;
use crate::{Error, Result};
use std::ops::Range;

mod decoder;
pub use decoder::{run, ParallelDecoder, WorldSpec};

/// Rank `rank` of a tensor-parallel world of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The whole model (world size 1).
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    pub fn new(rank: usize, world: usize) -> Result<Self> {
        match world > 0 && rank < world {
            true => Ok(Self { rank, world }),
            false => Err(Error::Invalid(format!(
                "rank {rank} of a tensor-parallel world of {world}"
            ))),
        }
    }

    pub fn is_whole(&self) -> bool {
        self.world == 1
    }

    /// This rank's equal share of `n` units (`n` a multiple of the world: checked by
    /// [`Self::local_config`]).
    pub fn part(&self, n: usize) -> Range<usize> {
        let per = n / self.world;
        self.rank * per..(self.rank + 1) * per
    }

    /// Rows of the vocabulary each rank's output head computes: `vocab` rounded up to the world.
    pub fn vocab_per_rank(&self, vocab: usize) -> usize {
        vocab.div_ceil(self.world)
    }

    /// This rank's rows of the vocabulary (the last rank's may be fewer, or none).
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        let per = self.vocab_per_rank(vocab);
        let lo = (self.rank * per).min(vocab);
        lo..(lo + per).min(vocab)
    }

    /// The shapes of this rank's layers: the model's, with its heads, KV heads and neurons
    /// divided by the world (the vocabulary stays whole: the logits are gathered). An error
    /// when the world does not divide them.
    pub fn local_config(&self, c: &ModelConfig) -> Result<ModelConfig> {
        let w = self.world;
        for (what, n) in [
            ("attention heads", c.n_heads),
            ("KV heads", c.n_kv_heads),
            ("MLP neurons", c.n_ff),
        ] {
            if !n.is_multiple_of(w) {
                return Err(Error::Invalid(format!(
                    "tensor parallelism over {w} ranks: the model's {n} {what} do not split evenly"
                )));
            }
        }
        if c.vocab_size < w {
            return Err(Error::Invalid(format!(
                "tensor parallelism over {w} ranks: a vocabulary of {} rows",
                c.vocab_size
            )));
        }
        Ok(ModelConfig {
            n_heads: c.n_heads / w,
            n_kv_heads: c.n_kv_heads / w,
            n_ff: c.n_ff / w,
            ..c.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_units_once() {
        for world in 1..=5 {
            let (mut units, mut vocab) = (Vec::new(), Vec::new());
            for rank in 0..world {
                let s = Shard::new(rank, world).unwrap();
                units.extend(s.part(60));
                vocab.extend(s.vocab(49));
                assert!(s.vocab(49).len() <= s.vocab_per_rank(49));
            }
            assert_eq!(units, (0..60).collect::<Vec<_>>(), "world {world}");
            assert_eq!(vocab, (0..49).collect::<Vec<_>>(), "world {world}");
        }
        assert!(Shard::new(2, 2).is_err() && Shard::new(0, 0).is_err());
    }
}
