//! `--backend cpu|cuda`: the one place a command's backend is chosen. The model code names no
//! backend; this builds the session (of the one forward pass) a command runs on.
use anyhow::{bail, Result};
use dejavu::eval::bench::{self, BenchResult, BenchSpec};
use dejavu::exec::Engine;
use dejavu::exec::{Decoder, SeqBatch, Sessions};
use dejavu::sparsity::policy::Policy;

/// Where a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The CPU engine (SIMD tiers chosen at run time).
    Cpu,
    /// The GPU (a build with `--features cuda`; the model keeps its file's row layout).
    Cuda,
}

/// Where a command's model runs: a backend, and the ranks it is split over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub backend: BackendKind,
    /// Tensor-parallel ranks (`--tensor-parallel`; 1: the whole model on one device).
    pub tensor_parallel: usize,
    /// `--deterministic true` on the GPU: its batch-invariant kernels
    /// (`CudaDevice::set_deterministic`; the CPU is batch-invariant by default).
    pub deterministic: bool,
}

/// Refuse what `--deterministic` cannot keep on the GPU: several GPUs (the all-reduce's
/// algorithm follows the message size, so the batch), and sparse policies (a step of several
/// sequences computes the union of their neurons).
fn check_deterministic(at: Placement, sparse: bool) -> Result<()> {
    if !at.deterministic || at.backend != BackendKind::Cuda {
        return Ok(());
    }
    if at.tensor_parallel > 1 {
        bail!("--deterministic runs on one GPU: not with --tensor-parallel");
    }
    if sparse {
        bail!(
            "--deterministic on the GPU runs dense plans only (a step of several sequences \
             computes the union of their neurons): use --sparsity dense, or the CPU, which is \
             deterministic under every policy"
        );
    }
    Ok(())
}

/// GPU 0, batch-invariant where `at` says (see [`check_deterministic`]).
#[cfg(feature = "cuda")]
fn cuda_device(at: Placement) -> Result<dejavu_backend_cuda::CudaDevice> {
    let mut dev = dejavu_backend_cuda::CudaDevice::new(0)?;
    dev.set_deterministic(at.deterministic);
    Ok(dev)
}

/// Run `f` on a fresh decoder of `engine` under `policy`, where `at` says.
pub fn with_decoder<R>(
    engine: &Engine,
    at: Placement,
    policy: &Policy,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    check_deterministic(at, !policy.is_dense())?;
    match (at.backend, at.tensor_parallel) {
        (BackendKind::Cpu, 1) => f(&mut engine.decoder(policy)?),
        (BackendKind::Cpu, _) => {
            bail!("tensor parallelism splits a model over GPUs: add --backend cuda")
        }
        (BackendKind::Cuda, 1) => cuda(at, engine, policy, f),
        (BackendKind::Cuda, n) => cuda_parallel(engine, policy, n, f),
    }
}

/// Run `f` on `n` fresh sequences of `engine` under `policy` on one device, where `at` says:
/// what continuous batching steps together (`serve --parallel N`).
pub fn with_sequences<R>(
    engine: &Engine,
    at: Placement,
    policy: &Policy,
    n: usize,
    f: impl FnOnce(&mut dyn SeqBatch) -> Result<R>,
) -> Result<R> {
    with_sequences_each(engine, at, &[policy], n, |sets| f(&mut *sets[0]))
}

/// [`with_sequences`] of each policy: `n` sequences under each, over one copy of the model
/// (`bench --batch` alternating policies).
pub fn with_sequences_each<R>(
    engine: &Engine,
    at: Placement,
    policies: &[&Policy],
    n: usize,
    f: impl FnOnce(&mut [&mut dyn SeqBatch]) -> Result<R>,
) -> Result<R> {
    check_deterministic(at, policies.iter().any(|p| !p.is_dense()))?;
    match (at.backend, at.tensor_parallel) {
        (BackendKind::Cpu, 1) => {
            let mut sets = Vec::with_capacity(policies.len());
            for p in policies {
                let seqs = (0..n).map(|_| engine.decoder(p));
                sets.push(seqs.collect::<dejavu::Result<Vec<_>>>()?);
            }
            let mut refs: Vec<&mut dyn SeqBatch> =
                sets.iter_mut().map(|s| s as &mut dyn SeqBatch).collect();
            f(&mut refs)
        }
        (BackendKind::Cuda, 1) => cuda_sequences(at, engine, policies, n, f),
        (_, _) => bail!("batched sequences run on one device: no --tensor-parallel"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_sequences<R>(
    at: Placement,
    engine: &Engine,
    policies: &[&Policy],
    n: usize,
    f: impl FnOnce(&mut [&mut dyn SeqBatch]) -> Result<R>,
) -> Result<R> {
    use dejavu::exec::{DeviceModel, DevicePlan, DeviceSession};
    let dev = cuda_device(at)?;
    let model: DeviceModel<_> = engine.device_model(&dev, policies)?;
    let mut sets = Vec::with_capacity(policies.len());
    for policy in policies {
        let mut seqs = Vec::with_capacity(n);
        for _ in 0..n {
            let plan = DevicePlan::policy(&dev, &engine.model.config, policy)?;
            seqs.push(DeviceSession::new(&dev, &model, plan, engine.n_ctx)?);
        }
        sets.push(seqs);
    }
    let mut refs: Vec<&mut dyn SeqBatch> =
        sets.iter_mut().map(|s| s as &mut dyn SeqBatch).collect();
    f(&mut refs)
}

#[cfg(not(feature = "cuda"))]
fn cuda_sequences<R>(
    _: Placement,
    _: &Engine,
    _: &[&Policy],
    _: usize,
    _: impl FnOnce(&mut [&mut dyn SeqBatch]) -> Result<R>,
) -> Result<R> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}

/// Run `f` where `at` says, on sequences it opens (`sparse`: under sparse policies too, which on
/// a GPU read the sparse layout uploaded beside the model). One device: a command that compares
/// policies or calibrates opens several sequences.
pub fn with_sessions<R>(
    engine: &Engine,
    at: Placement,
    sparse: bool,
    f: impl FnOnce(&dyn Sessions) -> Result<R>,
) -> Result<R> {
    match (at.backend, at.tensor_parallel) {
        (BackendKind::Cpu, 1) => f(engine),
        (BackendKind::Cuda, 1) => {
            check_deterministic(at, sparse)?;
            cuda_sessions(at, engine, sparse, f)
        }
        (_, _) => bail!("this command runs on one device: no --tensor-parallel"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_sessions<R>(
    at: Placement,
    engine: &Engine,
    sparse: bool,
    f: impl FnOnce(&dyn Sessions) -> Result<R>,
) -> Result<R> {
    use dejavu::exec::{DeviceModel, OnDevice};
    let dev = cuda_device(at)?;
    let layout = match sparse {
        true => Some(engine.sparse_layout()?),
        false => None,
    };
    let model = DeviceModel::upload(&dev, &engine.model, layout)?;
    f(&OnDevice {
        dev: &dev,
        model: &model,
        n_ctx: engine.n_ctx,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_sessions<R>(
    _: Placement,
    _: &Engine,
    _: bool,
    _: impl FnOnce(&dyn Sessions) -> Result<R>,
) -> Result<R> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}

/// The bench of `spec` where `at` says: the engine's CPU (at its threads), one GPU, or a world.
pub fn bench_on(
    at: Placement,
    spec: &BenchSpec,
    tick: &mut dyn FnMut(),
) -> Result<Vec<BenchResult>> {
    match (at.backend, at.tensor_parallel) {
        (BackendKind::Cpu, 1) => Ok(bench::on_cpu(spec, tick)?),
        (BackendKind::Cpu, _) => {
            bail!("tensor parallelism splits a model over GPUs: add --backend cuda")
        }
        (BackendKind::Cuda, _) => {
            check_deterministic(at, spec.policies.iter().any(|p| !p.is_dense()))?;
            cuda_bench(at, spec, tick)
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda_bench(at: Placement, spec: &BenchSpec, tick: &mut dyn FnMut()) -> Result<Vec<BenchResult>> {
    let n = at.tensor_parallel;
    if n == 1 {
        let dev = cuda_device(at)?;
        return Ok(bench::on_device(&dev, spec, tick)?);
    }
    Ok(bench::on_world(n, cuda_world(n)?, spec, tick)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_bench(_: Placement, _: &BenchSpec, _: &mut dyn FnMut()) -> Result<Vec<BenchResult>> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}

/// `f` on a session on `dev`.
#[cfg(feature = "cuda")]
fn on_device<D: dejavu_backend_api::Device, R>(
    dev: &D,
    engine: &Engine,
    policy: &Policy,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    use dejavu::exec::{DeviceModel, DevicePlan, DeviceSession};
    let model: DeviceModel<D> = engine.device_model(dev, &[policy])?;
    let plan = DevicePlan::policy(dev, &engine.model.config, policy)?;
    let mut session = DeviceSession::new(dev, &model, plan, engine.n_ctx)?;
    f(&mut session)
}

/// The sparse layout a policy's plan reads (none for a dense one).
#[cfg(feature = "cuda")]
fn layout_for<'e>(
    engine: &'e Engine,
    policy: &Policy,
) -> Result<Option<&'e dejavu::sparsity::layout::SparseLayout>> {
    Ok(match policy.is_dense() {
        true => None,
        false => Some(engine.sparse_layout()?),
    })
}

#[cfg(feature = "cuda")]
fn cuda<R>(
    at: Placement,
    engine: &Engine,
    policy: &Policy,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    let dev = cuda_device(at)?;
    on_device(&dev, engine, policy, f)
}

/// `f` on a world of `n` GPUs (0 to n - 1), a thread and an NCCL rank each.
#[cfg(feature = "cuda")]
fn cuda_parallel<R>(
    engine: &Engine,
    policy: &Policy,
    n: usize,
    f: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    use dejavu::exec::parallel::{self, Shard, WorldSpec};
    use dejavu::exec::DevicePlan;
    use dejavu_backend_cuda::CudaDevice;
    let cfg = &engine.model.config;
    let spec = WorldSpec {
        world: n,
        device: cuda_world(n)?,
        plans: |d: &CudaDevice, _: &_, s: Shard| {
            Ok(vec![DevicePlan::policy_shard(d, cfg, s, policy)?])
        },
        model: &engine.model,
        layout: layout_for(engine, policy)?,
        n_ctx: engine.n_ctx,
    };
    let mut out = None;
    parallel::run(spec, |dec| {
        out = Some(f(dec));
        Ok(())
    })?;
    out.expect("the world ran its body")
}

/// The devices of a world of `n` GPUs: rank r on GPU r, all joined through one NCCL id made
/// here. An error unless the machine has `n` GPUs and NCCL.
#[cfg(feature = "cuda")]
pub fn cuda_world(
    n: usize,
) -> Result<
    impl Fn(dejavu::exec::parallel::Shard) -> dejavu::Result<dejavu_backend_cuda::CudaDevice> + Sync,
> {
    let gpus = dejavu_backend_cuda::device_count()?;
    if gpus < n {
        bail!("--tensor-parallel {n} needs {n} GPUs; this machine has {gpus}");
    }
    let id = dejavu_backend_cuda::nccl_id()?;
    Ok(move |s: dejavu::exec::parallel::Shard| {
        Ok(dejavu_backend_cuda::CudaDevice::in_world(
            s.rank, s.rank, n, &id,
        )?)
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda<R>(
    _: Placement,
    _: &Engine,
    _: &Policy,
    _: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn cuda_parallel<R>(
    _: &Engine,
    _: &Policy,
    _: usize,
    _: impl FnOnce(&mut dyn Decoder) -> Result<R>,
) -> Result<R> {
    bail!("this build has no CUDA backend: build with `cargo build --release --features cuda`")
}
