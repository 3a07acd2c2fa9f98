//! `--backend cpu|cuda`: the one place a command's backend is chosen. The model code names no
//! backend; this builds the decoder (host executor or device session) a command runs on.
use anyhow::{bail, Result};
use dejavu::engine::executor::Plan;
use dejavu::engine::Engine;
use dejavu::sparsity::policy::Policy;
use dejavu::text::generate::{Decoder, HostDecoder};

/// Where a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The CPU engine (SIMD tiers chosen at run time).
    Cpu,
    /// The GPU (a build with `--features cuda`; the model keeps its file's row layout).
    Cuda,
}

/// Run `f` on a fresh decoder of `engine` under `policy`, on `backend`.
pub fn with_decoder<R>(
    engine: &Engine,
    backend: BackendKind,
    policy: &Policy,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    match backend {
        BackendKind::Cpu => {
            let mut cache = engine.new_cache();
            f(&mut HostDecoder {
                engine,
                cache: &mut cache,
                plan: Plan::Policy(policy),
            })
        }
        BackendKind::Cuda => cuda(engine, policy, f),
    }
}

#[cfg(feature = "cuda")]
fn cuda<R>(
    engine: &Engine,
    policy: &Policy,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    use dejavu::engine::device::{DeviceModel, DevicePlan, DeviceSession};
    let dev = dejavu_backend_cuda::CudaDevice::new(0)?;
    let layout = match policy.is_dense() {
        true => None,
        false => Some(engine.sparse_layout()?),
    };
    let model = DeviceModel::upload(&dev, &engine.model, layout)?;
    let plan = DevicePlan::policy(&dev, &engine.model.config, policy)?;
    let mut session = DeviceSession::new(&dev, &model, plan, engine.n_ctx)?;
    f(&mut session)
}

#[cfg(not(feature = "cuda"))]
fn cuda<R>(_: &Engine, _: &Policy, _: impl FnOnce(&mut dyn Decoder) -> Result<R>) -> Result<R> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}

/// Refuse `cuda` for a command that does not run on it yet.
pub fn cpu_only(backend: BackendKind, command: &str) -> Result<()> {
    match backend {
        BackendKind::Cpu => Ok(()),
        BackendKind::Cuda => bail!("`{command}` runs on the CPU only for now (--backend cpu)"),
    }
}
