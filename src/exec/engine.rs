//! The engine: an [`Engine`] holds a loaded model, its tokenizer and the CPU device (kernels and
//! thread pool) it runs on, and makes sessions of the forward pass on it.
use crate::exec::{DeviceModel, DevicePlan, DeviceSession};
use crate::model::synthetic::SyntheticOptions;
use crate::model::tokenizer::Tokenizer;
use crate::model::weights::Model;
use crate::sparsity::input::{Group, InputNorms, InputStats};
use crate::sparsity::layout::{self, Form, Kind, Part, SparseLayout};
use crate::sparsity::policy::Policy;
use crate::sparsity::predictors_file::Predictors;
use crate::sparsity::SparsePlan;
use crate::{Error, Result};
use dejavu_backend_api::Backend;
use dejavu_backend_cpu::device::CpuDevice;
use dejavu_backend_cpu::CpuBackend;
use std::path::Path;

/// Embedding rows a checkpoint may have past its tokenizer's vocabulary (see `Engine::load`).
pub const MAX_PADDING_ROWS: usize = 512;

/// Context window used when the caller does not choose one (capped by the model's own).
pub const DEFAULT_CTX: usize = 4096;

#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// Worker threads (default: every core).
    pub threads: Option<usize>,
    /// Context window in tokens (default: min(model's, DEFAULT_CTX)).
    pub n_ctx: Option<usize>,
    /// Element type of the KV cache (default f32).
    pub kv_type: KvType,
    /// How a `synthetic:NAME` model is built (ignored for real models).
    pub synthetic: SyntheticOptions,
    /// Keep the file's row layout: skip the load-time repacking (`model::repack`).
    pub keep_file_layout: bool,
    /// Run the CPU's prompt batches through tiles (`--deterministic false`): faster on long
    /// prompts, but no longer batch-invariant (see `CpuDevice::with_prompt_tiles`).
    pub prompt_tiles: bool,
}

/// The CPU device on `threads` threads, its caches of `kv` values.
fn cpu_device(threads: usize, kv: KvType, file_layout: bool, tiles: bool) -> Result<CpuDevice> {
    let d = CpuDevice::from_backend(CpuBackend::new(threads)?);
    let d = match file_layout {
        true => d.with_file_layout(),
        false => d,
    };
    let d = match tiles {
        true => d.with_prompt_tiles(),
        false => d,
    };
    Ok(match kv {
        KvType::F32 => d.with_f32_cache(),
        KvType::F16 => d,
    })
}

/// The element type of the cached keys and values. F16 halves the cache (rounding each key and
/// value to f16's 11 significant bits).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    F32,
    F16,
}

impl KvType {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            _ => None,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// Hand freed heap pages back to the OS (glibc keeps them otherwise; elsewhere a no-op).
fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim only releases free memory of the allocator's arenas; it may
        // be called at any time from any thread.
        unsafe {
            malloc_trim(0);
        }
    }
}

pub struct Engine {
    pub model: Model,
    /// Shared with whoever serves the model (the HTTP layer tokenizes on its own threads).
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub n_ctx: usize,
    /// The CPU device the engine runs on (its kernels and thread pool).
    device: CpuDevice,
    /// The model on the CPU device, reading the mapped weights in place: without the sparse
    /// layouts, with the units' layout, and with the inputs' too (each made on first use).
    on_cpu: [std::sync::OnceLock<DeviceModel<CpuDevice>>; 3],
    threads: usize,
    kv_type: KvType,
    /// The rows keep the file's layout (`keep_file_layout`): the model's and the predictors'.
    file_layout: bool,
    /// The neuron-major layout, loaded or built on first use by a sparse policy.
    layout: std::sync::OnceLock<SparseLayout>,
    /// Input sparsity's input-major layout and WINA's norms, per [`Form`] (rows, blocks),
    /// made on first use.
    inputs_layout: [std::sync::OnceLock<(SparseLayout, InputNorms)>; 2],
    /// A synthetic model's input thresholds (from random tokens), made on first use.
    synthetic_inputs: std::sync::OnceLock<std::sync::Arc<InputStats>>,
    /// A synthetic model's random predictors, made on first use.
    synthetic_predictors: std::sync::OnceLock<Predictors>,
}

impl Engine {
    /// A GGUF file, a Hugging Face checkpoint directory, or `synthetic:NAME`.
    pub fn load(path: impl AsRef<Path>, opts: &EngineOptions) -> Result<Self> {
        let path = path.as_ref();
        let mut model = match path.to_str().and_then(crate::model::synthetic::parse) {
            Some(shape) => Model::synthetic(shape?, opts.synthetic)?,
            None => Model::load(path)?,
        };
        let tokenizer = Tokenizer::from_model(&model)?;
        // The tokenizer has its own vocabulary now: free the header's copy (and the builder's
        // transient allocations) so they do not stay resident during generation.
        if let crate::model::weights::Source::Gguf(f) = &mut model.source {
            f.header.drop_metadata(crate::model::names::VOCAB_KEYS);
        }
        release_free_heap();
        // A GGUF's vocabulary is the embedding's rows; a checkpoint's embedding may be padded
        // beyond its tokenizer (facebook/opt-*: 50272 rows, 50265 tokens; Qwen2.5: 151936 rows,
        // 151665 tokens), by at most MAX_PADDING_ROWS or 1/64 of the rows: a larger gap is
        // another model's tokenizer. Padding rows are never sampled (generate::check_logits).
        let (nt, nv) = (tokenizer.vocab_size(), model.config.vocab_size);
        let gguf = model.gguf_header().is_some();
        // A synthetic model's byte vocabulary means nothing (speed only).
        let padded = nv - nt.min(nv) > (nv / 64).max(MAX_PADDING_ROWS);
        if (gguf && nt != nv) || nt > nv || (padded && model.synthetic_source().is_none()) {
            return Err(Error::Tokenizer(format!(
                "{nt} tokens in the vocabulary but the model has {nv} embedding rows"
            )));
        }
        let max_ctx = model.config.context_length;
        let n_ctx = match opts.n_ctx {
            Some(0) => return Err(Error::Invalid("context size must be positive".into())),
            Some(n) if n > max_ctx => {
                return Err(Error::Invalid(format!(
                    "context {n} exceeds the model's {max_ctx} tokens"
                )))
            }
            Some(n) => n,
            None => max_ctx.min(DEFAULT_CTX),
        };
        let threads = match opts.threads {
            Some(0) => return Err(Error::Invalid("--threads must be at least 1".into())),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let device = cpu_device(
            threads,
            opts.kv_type,
            opts.keep_file_layout,
            opts.prompt_tiles,
        )?;
        if !opts.keep_file_layout {
            model.repack(device.backend())?;
            release_free_heap();
        }
        Ok(Self {
            model,
            tokenizer: std::sync::Arc::new(tokenizer),
            n_ctx,
            device,
            on_cpu: Default::default(),
            threads,
            kv_type: opts.kv_type,
            file_layout: opts.keep_file_layout,
            layout: std::sync::OnceLock::new(),
            inputs_layout: Default::default(),
            synthetic_inputs: std::sync::OnceLock::new(),
            synthetic_predictors: std::sync::OnceLock::new(),
        })
    }

    /// The sparse layout (see [`crate::sparsity::layout`]): loaded from the cache next to the model, or
    /// converted and cached on first use.
    pub fn sparse_layout(&self) -> Result<&SparseLayout> {
        if let Some(l) = self.layout.get() {
            return Ok(l);
        }
        let l = SparseLayout::load_or_build(&self.model, self.device.backend())?;
        Ok(self.layout.get_or_init(|| l))
    }

    /// Input sparsity's input-major layout in `form` (see [`Kind::Inputs`]; the CPU reads
    /// [`Form::Blocks`]) and the weight-row norms of every input (WINA's scales), loaded or
    /// built on first use.
    pub fn input_layout(&self, form: Form) -> Result<&(SparseLayout, InputNorms)> {
        let slot = &self.inputs_layout[(form == Form::Blocks) as usize];
        if let Some(l) = slot.get() {
            return Ok(l);
        }
        let backend = self.device.backend();
        let inputs = SparseLayout::load_or_build_kind(&self.model, backend, Kind::Inputs, form)?;
        let norms = InputNorms::compute(backend, &inputs, self.model.config.n_layers);
        Ok(slot.get_or_init(|| (inputs, norms)))
    }

    /// `model` on `dev` with the layouts that `policies` read: none for dense ones, the units'
    /// for the Deja Vu rules, the inputs' for input sparsity (in the form `dev` reads).
    pub fn device_model<D: dejavu_backend_api::Device>(
        &self,
        dev: &D,
        policies: &[&Policy],
    ) -> Result<DeviceModel<D>> {
        let units = policies.iter().any(|p| p.inputs.is_none() && !p.is_dense());
        let layout = if units {
            Some(self.sparse_layout()?)
        } else {
            None
        };
        let mut m = DeviceModel::upload(dev, &self.model, layout)?;
        if policies.iter().any(|p| p.inputs.is_some()) {
            let form = match dev.reads_input_blocks() {
                true => Form::Blocks,
                false => Form::Rows,
            };
            let (inputs, norms) = self.input_layout(form)?;
            m.attach_inputs(dev, inputs, norms)?;
        }
        Ok(m)
    }

    /// The sparse layout, if a policy has loaded it.
    pub fn loaded_layout(&self) -> Option<&SparseLayout> {
        self.layout.get()
    }

    /// Whether input sparsity's layout (either form) has been loaded or built.
    pub fn input_layout_loaded(&self) -> bool {
        self.inputs_layout.iter().any(|s| s.get().is_some())
    }

    /// Load predictors: `path` if given, else the calibration output next to the model if there
    /// is one (`Ok(None)` when there is none).
    /// A synthetic model's are generated (see `model::synthetic`).
    pub fn predictors(&self, path: Option<&Path>) -> Result<Option<Predictors>> {
        if let Some(p) = path {
            return Predictors::load(p, &self.model).map(Some);
        }
        if self.model.synthetic_source().is_some() {
            // Generated once: every policy of a run shares them.
            if let Some(p) = self.synthetic_predictors.get() {
                return Ok(Some(p.clone()));
            }
            let p = Predictors::synthetic(&self.model)?;
            return Ok(Some(self.synthetic_predictors.get_or_init(|| p).clone()));
        }
        let found = [
            Predictors::default_path(&self.model),
            Predictors::legacy_path(&self.model),
        ]
        .into_iter()
        .find(|p| p.exists());
        match found {
            Some(p) => Predictors::load(&p, &self.model).map(Some),
            None => Ok(None),
        }
    }

    /// Parse a `--sparsity` spec and prepare what it needs (the sparse layouts). A synthetic
    /// model's input thresholds (`teal`, `wina`) are measured on random tokens first.
    pub fn policy(&self, spec: &str, predictors: Option<&Predictors>) -> Result<Policy> {
        let mut with_stats;
        let mut predictors = predictors;
        let wants_inputs = spec
            .split('+')
            .any(|part| part.starts_with("teal:") || part.starts_with("wina:"));
        let synthetic = self.model.synthetic_source().is_some();
        if wants_inputs && synthetic && predictors.is_none_or(|p| p.inputs.is_none()) {
            with_stats = match predictors {
                Some(p) => p.clone(),
                None => self
                    .predictors(None)?
                    .ok_or_else(|| Error::Invalid("a synthetic model without predictors".into()))?,
            };
            with_stats.inputs = Some(self.synthetic_input_stats()?);
            predictors = Some(&with_stats);
        }
        let p = Policy::parse(spec, &self.model.config, predictors)?;
        match p.inputs.is_some() {
            // Built now only if the CPU's plan reads it (another device's model builds its own).
            true if self.plan(&p)?.needs_inputs() => drop(self.input_layout(Form::Blocks)?),
            true => {}
            false if p.sparse_mlp() || p.sparse_heads() => drop(self.sparse_layout()?),
            false => {}
        }
        Ok(p)
    }

    /// A synthetic model's input thresholds: the quantiles of its activations over random
    /// tokens (of no meaning: they make `teal:S` drop the fraction S of a synthetic model's
    /// inputs, for speed measurements).
    fn synthetic_input_stats(&self) -> Result<std::sync::Arc<InputStats>> {
        if let Some(s) = self.synthetic_inputs.get() {
            return Ok(s.clone());
        }
        let c = &self.model.config;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let tokens: Vec<u32> = (0..crate::tune::thresholds::SYNTHETIC_TOKENS)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % c.vocab_size as u64) as u32
            })
            .collect();
        let ctx = tokens.len().min(self.n_ctx);
        let st = crate::tune::thresholds::input_stats(self, self, &tokens, ctx)?;
        Ok(self
            .synthetic_inputs
            .get_or_init(|| std::sync::Arc::new(st))
            .clone())
    }

    /// The CPU's kernels and pool, for work outside the forward pass (repacking, layouts,
    /// calibration's products).
    pub fn backend(&self) -> &dyn Backend {
        self.device.backend()
    }

    /// The CPU device the forward pass runs on.
    pub fn device(&self) -> &CpuDevice {
        &self.device
    }

    /// The model on the CPU device, with the layouts of `level` (0: none, 1: the units', 2:
    /// the inputs', in input blocks), made on first use.
    pub fn cpu_model(&self, level: usize) -> Result<&DeviceModel<CpuDevice>> {
        let level = level.min(2);
        if let Some(m) = self.on_cpu[level].get() {
            return Ok(m);
        }
        let layout = match level {
            1 => Some(self.sparse_layout()?),
            _ => None,
        };
        let mut m = DeviceModel::upload(&self.device, &self.model, layout)?;
        if level == 2 {
            let (inputs, norms) = self.input_layout(Form::Blocks)?;
            m.attach_inputs(&self.device, inputs, norms)?;
        }
        Ok(self.on_cpu[level].get_or_init(|| m))
    }

    /// A sequence on the CPU under `plan` (of [`Self::plan`] or [`Self::fixed_plan`]), with an
    /// empty cache of the engine's context.
    pub fn session(&self, plan: DevicePlan<CpuDevice>) -> Result<DeviceSession<'_, CpuDevice>> {
        let level = match (plan.needs_inputs(), plan.needs_layout()) {
            (true, _) => 2,
            (false, true) => 1,
            (false, false) => 0,
        };
        let model = self.cpu_model(level)?;
        DeviceSession::new(&self.device, model, plan, self.n_ctx)
    }

    /// A policy's plan on the CPU device. Input sparsity's groups whose products this CPU
    /// expects to be slower than dense are kept whole here, from the shapes the input-major
    /// layout will have (the session's own check, made before the layout is built): a plan
    /// that keeps every group whole reads no input-major layout, and the engine neither builds
    /// nor holds one for it.
    pub fn plan(&self, policy: &Policy) -> Result<DevicePlan<CpuDevice>> {
        let mut plan = DevicePlan::policy(&self.device, &self.model.config, policy)?;
        if let Some(ip) = &mut plan.inputs {
            ip.where_it_pays(|l, g| self.input_break_even(l, g));
        }
        Ok(plan)
    }

    /// [`dejavu_backend_api::Device::input_break_even`] of the CPU for input group `g` of
    /// layer `l`, from the shapes and types of its matrices in the input-block layout and the
    /// file's bytes of them.
    fn input_break_even(&self, l: usize, g: usize) -> f64 {
        let gated = self.model.config.mlp.gated();
        let (mut shapes, mut dense) = (Vec::new(), 0);
        for &part in Group::ALL[g].parts() {
            if part == Part::Gate && !gated {
                continue;
            }
            let (q, rows, cols, bytes) = layout::input_major(&self.model, l, part, Form::Blocks);
            shapes.push((q, rows, cols));
            dense += bytes;
        }
        dejavu_backend_cpu::axpy_matmul::break_even(&shapes, dense, self.device.isa())
    }

    /// A fixed plan's sets on the CPU device.
    pub fn fixed_plan(&self, plan: &SparsePlan) -> Result<DevicePlan<CpuDevice>> {
        DevicePlan::fixed(&self.device, &self.model.config, plan, "fixed")
    }

    /// A sequence on the CPU under `policy` (see [`Self::session`]).
    pub fn decoder(&self, policy: &Policy) -> Result<DeviceSession<'_, CpuDevice>> {
        self.session(self.plan(policy)?)
    }

    /// Bytes of keys and values a sequence of `len` positions holds on the CPU device.
    pub fn kv_bytes(&self, len: usize) -> usize {
        let c = &self.model.config;
        2 * c.n_layers * len * c.kv_dim() * self.kv_type.bytes()
    }

    /// The CPU kernel tier in use (`scalar`, `portable`, `neon`, `dotprod`, `avx2`, `avx512`).
    pub fn isa(&self) -> &'static str {
        self.device.isa().name()
    }

    /// An error for work that needs real weights (`what`: e.g. "perplexity") on a synthetic model.
    pub fn require_real_weights(&self, what: &str) -> Result<()> {
        match self.model.synthetic_source() {
            Some(s) => Err(Error::Invalid(format!(
                "{what} needs real weights; {} is for speed measurements only",
                s.label()
            ))),
            None => Ok(()),
        }
    }

    /// Run on `n` worker threads from now on (a new pool; the model stays loaded).
    pub fn set_threads(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::Invalid("--threads must be at least 1".into()));
        }
        let tiles = !dejavu_backend_api::Device::batch_invariant(&self.device);
        self.device = cpu_device(n, self.kv_type, self.file_layout, tiles)?;
        self.threads = n;
        Ok(())
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// Sequences on the engine's CPU device.
impl crate::exec::Sessions for Engine {
    fn config(&self) -> &crate::model::config::ModelConfig {
        &self.model.config
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn open(&self, policy: &Policy) -> Result<Box<dyn crate::exec::Decoder + '_>> {
        Ok(Box::new(self.decoder(policy)?))
    }
    fn name(&self) -> String {
        use dejavu_backend_api::Device;
        self.device.name()
    }
}
