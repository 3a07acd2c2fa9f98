//! `dejavu bench`: prefill and decode speed in the style of llama-bench, on any device: the
//! CPU, a GPU, or a tensor-parallel world of them ([`BenchSessions`]), one code path.
//!
//! - `pp<P>`: prompt processing, P tokens from an empty cache (in batches: every unit, whatever
//!   the policy); tokens/s = P / time.
//! - `tg<N>`: text generation, N tokens decoded one at a time from an empty cache (one warm-up
//!   token first, outside the timing), the logits read back after each as generation does;
//!   tokens/s = N / time; GB/s = weight bytes read per decoded token x tokens/s.
//!
//! Under a sparsity policy (`--sparsity dense,recommended,...`, run side by side in one process)
//! every test also reports the speedup over the dense run of the same test on the same device,
//! the weight bytes read per token (predictors and previews included, as the step counted them),
//! the fraction of MLP neurons and heads computed and the output rows computed exactly.
//! Selection cost is inside the timing.
//!
//! Each test runs `repetitions` times after one warm-up run, the policies alternating within
//! each so they see the same machine conditions; we report the median and the sample standard
//! deviation. A decode test then profiles a few steps of each policy block by block. Token ids
//! are a fixed pseudo-random sequence (as llama-bench does), so speed does not depend on a text.
pub mod batched;
mod table;

#[cfg(test)]
pub(crate) use table::tests::run as test_run;
pub use table::{csv, gains, gains_markdown, markdown, plot_gains, GainRow};

use crate::exec::parallel::{self, ParallelDecoder, Shard, WorldSpec};
use crate::exec::{BlockTimes, Decoder, DeviceModel, DevicePlan, DeviceSession, Engine};
use crate::exec::{SessionInfo, StepStats};
use crate::sparsity::layout::SparseLayout;
use crate::sparsity::policy::Policy;
use crate::Result;
use dejavu_backend_api::{Device, MAX_ROWS};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub model: String,
    pub commit: String,
    /// The host's CPU.
    pub cpu: String,
    /// The device the test ran on (`cpu (2 threads, avx512)`, `cuda (NVIDIA H200)`, ...).
    pub backend: String,
    /// CPU worker threads (`None` on a GPU).
    pub threads: Option<usize>,
    pub sparsity: String,
    pub test: String,
    pub n_tokens: usize,
    pub tok_per_s_median: f64,
    pub tok_per_s_stddev: f64,
    /// Weight bytes read per second (decode: bytes per token x tok/s; prefill: the weights are
    /// read once per batch).
    pub weight_gb_per_s: f64,
    /// Mean weight bytes read per token (decode) or per batch (prefill).
    pub weight_bytes_per_token: f64,
    /// Median t/s over the dense run's median t/s (same test and device); `None` without one.
    pub speedup_vs_dense: Option<f64>,
    /// Mean fraction of MLP neurons computed.
    pub mlp_density: f64,
    /// Mean fraction of query heads computed.
    pub head_density: f64,
    /// Mean output rows computed exactly per step.
    pub exact_logits: f64,
    /// Learned predictors: their time per token (ms; `None`: no learned predictors).
    pub predict_ms: Option<f64>,
    pub blocks: Blocks,
    pub samples: Vec<f64>,
    /// CPU decode tests: resident memory at the end of the last repetition.
    pub memory: Option<Memory>,
}

/// Where a decode step's time goes: per block kind, the mean ms (of steps run eagerly, timed
/// block by block: [`DeviceSession::profile`]) and weight MB per step (summed over layers), and
/// the GB/s that achieves. `predictors` is the predictors' own time and bytes; `all_reduce` the
/// collectives of a tensor-parallel world (time only).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Blocks {
    pub attention: BlockTime,
    pub mlp: BlockTime,
    pub output: BlockTime,
    pub predictors: BlockTime,
    pub all_reduce: BlockTime,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct BlockTime {
    pub ms: f64,
    pub mb: f64,
    pub gb_per_s: f64,
}

/// Resident memory during decode, split as the CPU-speed issue states its target:
/// mapped weights (the sparse layout included once built) + KV cache + other state (`other = rss - weights - kv`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Memory {
    pub rss_mib: f64,
    pub weights_mib: f64,
    pub kv_cache_mib: f64,
    pub other_mib: f64,
}

/// The commit this binary was built from.
pub const COMMIT: &str = env!("DEJAVU_COMMIT");

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// The sequences a bench times, one per policy: one device's sessions, or those of a
/// tensor-parallel world (every rank runs each step).
pub trait BenchSessions {
    fn count(&self) -> usize;
    /// Run `tokens` on session `i` after what its cache holds; its last logits read back.
    fn run(&mut self, i: usize, tokens: &[u32]) -> Result<()>;
    /// Empty session `i`'s cache.
    fn reset(&mut self, i: usize) -> Result<()>;
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()>;
    /// Session `i`'s plan and device, and what its last step read (over the world).
    fn info(&mut self, i: usize) -> Result<SessionInfo>;
    /// What session `i`'s last decode step read and computed (over the world).
    fn last_step(&mut self, i: usize) -> Result<StepStats> {
        Ok(self.info(i)?.step)
    }
}

/// One device's sessions, one per policy.
impl<D: Device> BenchSessions for Vec<DeviceSession<'_, D>> {
    fn count(&self) -> usize {
        self.len()
    }
    fn run(&mut self, i: usize, tokens: &[u32]) -> Result<()> {
        self[i].forward(tokens).map(drop)
    }
    fn reset(&mut self, i: usize) -> Result<()> {
        self[i].truncate(0);
        Ok(())
    }
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        self[i].profile(tokens, times)
    }
    fn info(&mut self, i: usize) -> Result<SessionInfo> {
        self[i].info()
    }
    fn last_step(&mut self, i: usize) -> Result<StepStats> {
        self[i].last_step()
    }
}

/// A tensor-parallel world's sessions: a step's bytes and units summed over the ranks.
impl BenchSessions for ParallelDecoder {
    fn count(&self) -> usize {
        self.sessions()
    }
    fn run(&mut self, i: usize, tokens: &[u32]) -> Result<()> {
        self.select(i)?;
        self.decode(tokens).map(drop)
    }
    fn reset(&mut self, i: usize) -> Result<()> {
        self.select(i)?;
        self.truncate(0);
        Ok(())
    }
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        self.select(i)?;
        ParallelDecoder::profile(self, tokens, times)
    }
    fn info(&mut self, i: usize) -> Result<SessionInfo> {
        self.select(i)?;
        let ranks = ParallelDecoder::info(self)?;
        Ok(SessionInfo {
            plan: ranks[0].plan.clone(),
            device: format!("{} x{} (tensor parallel)", ranks[0].device, ranks.len()),
            step: StepStats::sum(ranks.iter().map(|r| r.step)),
            batch: StepStats::sum(ranks.iter().map(|r| r.batch)),
        })
    }
}

/// What [`alternate`] measured for one policy.
#[derive(Debug, Clone, Default)]
pub struct Runs {
    /// Tokens per second of each timed repetition.
    pub samples: Vec<f64>,
    pub steps: StepTotals,
}

/// Run one test (`prefill`: an `n`-token prompt; else `n` tokens decoded) on every session: a
/// warm-up repetition, then `reps` timed ones, the sessions alternating within each. `tick`
/// after every timed run. A decode test then profiles a few steps of each block by block (for
/// [`Blocks`]).
pub fn alternate(
    sessions: &mut dyn BenchSessions,
    vocab: usize,
    prefill: bool,
    n: usize,
    reps: usize,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Runs>> {
    let mut runs = vec![Runs::default(); sessions.count()];
    for rep in 0..=reps {
        for (i, run) in runs.iter_mut().enumerate() {
            let mut st = StepTotals::default();
            let secs = time_once(sessions, i, vocab, prefill, n, rep as u64, &mut st)?;
            if rep > 0 {
                run.samples.push(n as f64 / secs);
                run.steps.add_all(&st);
                tick();
            }
        }
    }
    if !prefill {
        // As many steps as the test decoded (its context holds them), at most PROFILED.
        let toks = tokens(n.min(PROFILED) + 1, vocab, 0);
        for (i, run) in runs.iter_mut().enumerate() {
            sessions.reset(i)?;
            sessions.run(i, &toks[..1])?;
            let mut times = BlockTimes::default();
            sessions.profile(i, &toks[1..], &mut times)?;
            run.steps.add_times(&times);
        }
    }
    Ok(runs)
}

/// Decode steps a bench profiles block by block, per policy.
const PROFILED: usize = 8;

/// Time one repetition of a test on session `i` (`prefill`: n tokens as a prompt; else a
/// warm-up token, then n tokens decoded one at a time) with the token sequence of `seed`, from
/// an empty cache. Returns seconds; adds each timed step's [`StepStats`] to `steps` (a
/// prompt's: each of its batches reads the dense model).
fn time_once(
    sessions: &mut dyn BenchSessions,
    i: usize,
    vocab: usize,
    prefill: bool,
    n: usize,
    seed: u64,
    steps: &mut StepTotals,
) -> Result<f64> {
    let toks = tokens(n + 1, vocab, seed);
    sessions.reset(i)?;
    if prefill {
        let t0 = Instant::now();
        sessions.run(i, &toks[..n])?;
        let secs = t0.elapsed().as_secs_f64();
        let batch = sessions.info(i)?.batch;
        (0..n.div_ceil(MAX_ROWS)).for_each(|_| steps.add(batch));
        return Ok(secs);
    }
    sessions.run(i, &toks[..1])?;
    let mut secs = 0.0;
    for &t in &toks[1..] {
        let t0 = Instant::now();
        sessions.run(i, &[t])?;
        secs += t0.elapsed().as_secs_f64();
        steps.add(sessions.last_step(i)?);
    }
    Ok(secs)
}

/// What a bench runs: each policy's `n_prompt`-token prompt (0: none) and `n_gen`-token decode
/// (0: none), `reps` repetitions after a warm-up.
pub struct BenchSpec<'a> {
    pub engine: &'a Engine,
    pub policies: &'a [Policy],
    pub n_prompt: usize,
    pub n_gen: usize,
    pub reps: usize,
}

impl BenchSpec<'_> {
    /// The context each session needs.
    pub fn n_ctx(&self) -> usize {
        (self.n_gen + 1).max(self.n_prompt)
    }
    /// The sparse layout the policies' plans read (none when all are dense).
    fn layout(&self) -> Result<Option<&SparseLayout>> {
        match self.policies.iter().any(|p| !p.is_dense()) {
            true => Ok(Some(self.engine.sparse_layout()?)),
            false => Ok(None),
        }
    }
}

/// The bench on the engine's CPU device, at its threads (with resident memory).
pub fn on_cpu(spec: &BenchSpec, tick: &mut dyn FnMut()) -> Result<Vec<BenchResult>> {
    let e = spec.engine;
    let mut sessions = (spec.policies.iter())
        .map(|p| e.decoder(p))
        .collect::<Result<Vec<_>>>()?;
    bench(&mut sessions, spec, Some(e.threads()), tick)
}

/// The bench on `dev` (the model uploaded to it), its steps unmeasured: each step's statistics
/// are the plan's, none counted on the device, and input sparsity's thresholds go inside the
/// products (`generate` and `serve` measure, and count kept inputs and nonzero activations).
pub fn on_device<D: Device>(
    dev: &D,
    spec: &BenchSpec,
    tick: &mut dyn FnMut(),
) -> Result<Vec<BenchResult>> {
    let (e, n_ctx) = (spec.engine, spec.n_ctx());
    let policies: Vec<&Policy> = spec.policies.iter().collect();
    let model = e.device_model(dev, &policies)?;
    let mut sessions = (spec.policies.iter())
        .map(|p| {
            let plan = DevicePlan::policy(dev, &e.model.config, p)?;
            let mut s = DeviceSession::new(dev, &model, plan, n_ctx)?;
            s.measure(false);
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    bench(&mut sessions, spec, None, tick)
}

/// The bench on a world of `world` ranks, rank `r` on `device(shard)`: every policy's plan over
/// each rank's units (`DevicePlan::policy_shard`).
pub fn on_world<D: Device>(
    world: usize,
    device: impl Fn(Shard) -> Result<D> + Sync,
    spec: &BenchSpec,
    tick: &mut dyn FnMut(),
) -> Result<Vec<BenchResult>> {
    let cfg = &spec.engine.model.config;
    let world = WorldSpec {
        world,
        device,
        plans: |d: &D, _: &DeviceModel<D>, s: Shard| {
            (spec.policies.iter())
                .map(|p| DevicePlan::policy_shard(d, cfg, s, p))
                .collect()
        },
        model: &spec.engine.model,
        layout: spec.layout()?,
        n_ctx: spec.n_ctx(),
    };
    parallel::run(world, |dec| bench(dec, spec, None, tick))
}

/// Every test of `spec` on `sessions` (one per policy, in order): prefill rows first. `threads`:
/// the CPU engine's (its rows also report resident memory).
fn bench(
    sessions: &mut dyn BenchSessions,
    spec: &BenchSpec,
    threads: Option<usize>,
    tick: &mut dyn FnMut(),
) -> Result<Vec<BenchResult>> {
    let e = spec.engine;
    let vocab = e.model.config.vocab_size;
    let mut out = Vec::new();
    for (prefill, n) in [(true, spec.n_prompt), (false, spec.n_gen)] {
        if n == 0 {
            continue;
        }
        let runs = alternate(sessions, vocab, prefill, n, spec.reps, tick)?;
        // Measured while every session holds its cache.
        let memory = match (prefill, threads) {
            (false, Some(_)) => memory(e, n + 1),
            _ => None,
        };
        let medians: Vec<f64> = runs.iter().map(|r| median_sd(&r.samples).0).collect();
        let dense = (spec.policies.iter().position(|p| p.is_dense())).map(|i| medians[i]);
        for (i, run) in runs.into_iter().enumerate() {
            let info = sessions.info(i)?;
            let (med, sd) = median_sd(&run.samples);
            let (st, bytes) = (&run.steps, run.steps.mean_bytes());
            // A prompt's batches per token (each reads the weights once), or one step a token.
            let per_token = match prefill {
                true => n.div_ceil(MAX_ROWS) as f64 / n as f64,
                false => 1.0,
            };
            out.push(BenchResult {
                model: e.model.label(),
                commit: COMMIT.into(),
                cpu: cpu_model(),
                backend: info.device,
                threads,
                sparsity: spec.policies[i].name.clone(),
                test: format!("{}{n}", if prefill { "pp" } else { "tg" }),
                n_tokens: n,
                tok_per_s_median: med,
                tok_per_s_stddev: sd,
                weight_gb_per_s: bytes * med * per_token / 1e9,
                weight_bytes_per_token: bytes,
                speedup_vs_dense: dense.map(|d| med / d),
                mlp_density: st.mlp_density(),
                head_density: st.head_density(),
                exact_logits: st.mean_exact_logits(),
                predict_ms: st.predict_ms(),
                blocks: st.blocks(),
                samples: run.samples,
                memory,
            });
        }
    }
    Ok(out)
}

/// Resident memory now, with a sequence of `len` positions in its cache, split as weights +
/// the KV cache + other state.
pub fn memory(engine: &Engine, len: usize) -> Option<Memory> {
    // Weights: the model's mapping and, once a sparse policy built it, the sparse layout.
    let mut regions = engine.model.mapped_files();
    regions.extend(engine.loaded_layout().map(|l| l.bytes()));
    let r = crate::memstat::resident(&regions)?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let kv = engine.kv_bytes(len) as u64;
    Some(Memory {
        rss_mib: mib(r.total),
        weights_mib: mib(r.region),
        kv_cache_mib: mib(kv),
        other_mib: mib(r.total.saturating_sub(r.region + kv)),
    })
}

/// Sums of [`StepStats`] over forward steps (for means per step), and of the block times of
/// the steps profiled.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTotals {
    pub n: usize,
    pub weight_bytes: f64,
    pub mlp_kept: f64,
    pub mlp_total: f64,
    pub heads_kept: f64,
    pub heads_total: f64,
    pub exact_logits: f64,
    /// Attention, MLP, output head, predictors and the collectives (no bytes): summed bytes
    /// over the `n` steps.
    pub bytes: [f64; 5],
    /// ... and their summed seconds over the `timed` profiled steps.
    pub secs: [f64; 5],
    pub timed: usize,
}

impl StepTotals {
    pub fn add(&mut self, s: StepStats) {
        let b = s.bytes;
        self.add_all(&StepTotals {
            n: 1,
            weight_bytes: s.weight_bytes as f64,
            mlp_kept: s.mlp_kept as f64,
            mlp_total: s.mlp_total as f64,
            heads_kept: s.heads_kept as f64,
            heads_total: s.heads_total as f64,
            exact_logits: s.exact_logits as f64,
            bytes: [b.attention, b.mlp, b.output, b.predictors, 0].map(|x| x as f64),
            ..Default::default()
        });
    }
    /// The block times of profiled steps.
    pub fn add_times(&mut self, t: &BlockTimes) {
        self.timed += t.steps;
        let secs = [
            t.attention,
            t.mlp,
            t.output + t.embed,
            t.predict,
            t.all_reduce,
        ];
        (self.secs.iter_mut().zip(secs)).for_each(|(a, b)| *a += b);
    }
    pub fn add_all(&mut self, o: &StepTotals) {
        self.n += o.n;
        self.weight_bytes += o.weight_bytes;
        self.mlp_kept += o.mlp_kept;
        self.mlp_total += o.mlp_total;
        self.heads_kept += o.heads_kept;
        self.heads_total += o.heads_total;
        self.exact_logits += o.exact_logits;
        (self.bytes.iter_mut().zip(o.bytes)).for_each(|(a, b)| *a += b);
        (self.secs.iter_mut().zip(o.secs)).for_each(|(a, b)| *a += b);
        self.timed += o.timed;
    }

    /// Per-step means of each block (see [`Blocks`]).
    pub fn blocks(&self) -> Blocks {
        let cost = |i: usize| {
            let ms = self.secs[i] / self.timed.max(1) as f64 * 1e3;
            let mb = self.bytes[i] / self.n.max(1) as f64 / 1e6;
            BlockTime {
                ms,
                mb,
                gb_per_s: if ms > 0.0 { mb / ms } else { 0.0 },
            }
        };
        Blocks {
            attention: cost(0),
            mlp: cost(1),
            output: cost(2),
            predictors: cost(3),
            all_reduce: cost(4),
        }
    }
    pub fn mean_bytes(&self) -> f64 {
        self.weight_bytes / self.n.max(1) as f64
    }
    /// Mean fraction of MLP neurons computed.
    pub fn mlp_density(&self) -> f64 {
        self.mlp_kept / self.mlp_total.max(1.0)
    }
    /// Mean fraction of query heads computed.
    pub fn head_density(&self) -> f64 {
        self.heads_kept / self.heads_total.max(1.0)
    }
    pub fn mean_exact_logits(&self) -> f64 {
        self.exact_logits / self.n.max(1) as f64
    }
    /// Learned predictors' time per step in ms (`None`: none ran).
    pub fn predict_ms(&self) -> Option<f64> {
        (self.bytes[3] > 0.0).then(|| self.blocks().predictors.ms)
    }
}

/// Median and sample standard deviation.
pub fn median_sd(xs: &[f64]) -> (f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let med = if v.is_empty() {
        0.0
    } else if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>()
        / (v.len().saturating_sub(1)).max(1) as f64;
    (med, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_sd() {
        assert_eq!(median_sd(&[3.0, 1.0, 2.0]), (2.0, 1.0));
        assert_eq!(median_sd(&[1.0, 2.0, 3.0, 10.0]).0, 2.5);
    }

    #[test]
    fn bench_tokens_are_deterministic_and_in_range() {
        let a = tokens(100, 50, 1);
        assert_eq!(a, tokens(100, 50, 1));
        assert!(a.iter().all(|&t| t < 50));
        assert_ne!(a, tokens(100, 50, 2));
    }
}
