//! The one forward pass: embed, per layer the attention block and the MLP block under the plan,
//! the output head; a step of one row (decode) or a batch of rows (a prompt), over the verbs of
//! any [`dejavu_backend_api::Device`]: the CPU (`CpuDevice`, the engine's default; its f32
//! reference is what the GPU and every SIMD tier are checked against) or CUDA. Weights are
//! uploaded once ([`DeviceModel::upload`]; on the CPU they are read in place); the KV cache, the
//! activations and the plan's index lists stay on the device; a decode step is recorded once and
//! replayed at every position where the device can; the host reads back only the logits.
//! [`Engine`] holds a model, its tokenizer and the CPU device, and makes sessions;
//! [`parallel`] splits the model over a world of devices.
//!
//! The plan ([`DevicePlan`]) on the device: a fixed [`crate::sparsity::SparsePlan`] becomes index
//! lists uploaded once; a [`crate::sparsity::policy::Policy`]'s rules become the low-rank
//! predictors, or the rules that select from a layer's own activations, and a device top-k
//! writing fixed-K lists at every step, with no round trip to the host. Full sets are
//! `Rows::All`: the dense plan is the sparse plan with full sets. Selections are compact (see
//! `dejavu_backend_api::device`): the sparse MLP computes `K` neurons and its down projection
//! reads those `K` rows of the neuron-major layout; selected heads compute their rows of W_q,
//! their attention and their rows of the head-major W_o.
mod decoder;
pub mod engine;
mod model;
pub mod parallel;
mod plan;
mod seqs;
mod session;

pub use model::DeviceModel;
pub use plan::DevicePlan;
pub use session::{
    BlockTimes, Capture, DeviceSession, Logits, Selections, SessionInfo, StepBytes, StepStats,
};

pub use decoder::{Decoder, OnDevice, Sessions};
pub use engine::{Engine, EngineOptions, KvType, DEFAULT_CTX, MAX_PADDING_ROWS};
pub use seqs::SeqBatch;
