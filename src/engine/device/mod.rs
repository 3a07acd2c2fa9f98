//! The device-resident decoder: the executor's layer loop (see `executor`) over the verbs of a
//! [`dejavu_backend_api::Device`], for backends whose memory is their own (CUDA). Weights are uploaded once
//! ([`DeviceModel::upload`]); the KV cache, the activations and the plan's index lists stay on
//! the device; a decode step is recorded once and replayed at every position; the host reads
//! back only the logits. The code names no backend: `CpuDevice` (the CPU backend's kernels; its
//! f32 reference is what the GPU is checked against) runs it on any machine, and the tests hold
//! it to the host executor.
//!
//! The plan ([`DevicePlan`]) is the host's, on the device: a fixed [`crate::sparsity::SparsePlan`] becomes index
//! lists uploaded once; a [`crate::sparsity::policy::Policy`]'s Deja Vu rules become the low-rank predictors and a device
//! top-k writing fixed-K lists at every step, with no round trip to the host. Full sets are
//! `Rows::All`: the dense plan is the sparse plan with full sets. Selections are compact (see
//! `dejavu_backend_api::device`): the sparse MLP computes `K` neurons and its down projection
//! reads those `K` rows of the neuron-major layout; selected heads compute their rows of W_q,
//! their attention and their rows of the head-major W_o. Keys and values of every head are
//! computed (the `KvRule::All` of the host).
mod model;
mod plan;
mod session;

pub use model::DeviceModel;
pub use plan::DevicePlan;
pub use session::{BlockTimes, Capture, DeviceSession, Logits, Selections, StepBytes, StepStats};
