//! `dejavu bench`: prefill and decode speed in the style of llama-bench.
//!
//! - `pp<P>`: prompt processing, P tokens in one batch from an empty cache; tokens/s = P / time.
//! - `tg<N>`: text generation, N tokens decoded one at a time from an empty cache (one warm-up
//!   token first, outside the timing); tokens/s = N / time; GB/s = weight bytes read per
//!   decoded token x tokens/s.
//!
//! Under a sparsity policy (`--sparsity dense,recommended,...`, run side by side in one process)
//! every test also reports the speedup over the dense run of the same test and thread count,
//! the weight bytes actually read per token (predictors and previews included), the fraction of
//! MLP neurons computed and the output rows computed exactly. Selection cost is inside the timing.
//!
//! Each test runs `repetitions` times after one warm-up run; we report the median and the sample
//! standard deviation. Token ids are a fixed pseudo-random sequence (as llama-bench does), so
//! speed does not depend on a text.
use crate::exec::Engine;
use crate::exec::{BlockTimes, DeviceSession, Logits, StepStats};
use crate::sparsity::policy::Policy;
use crate::Result;
use dejavu_backend_cpu::device::CpuDevice;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub model: String,
    pub commit: String,
    pub cpu: String,
    pub isa: String,
    pub threads: usize,
    pub sparsity: String,
    pub test: String,
    pub n_tokens: usize,
    pub tok_per_s_median: f64,
    pub tok_per_s_stddev: f64,
    /// Weight bytes read per second (decode: dense bytes per token x tok/s; prefill: the weights
    /// are read once per batch).
    pub weight_gb_per_s: f64,
    /// Mean weight bytes read per token (decode) or per batch (prefill).
    pub weight_bytes_per_token: f64,
    /// Median t/s over the dense run's median t/s (same test and threads); `None` without one.
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
    /// Decode tests: resident memory at the end of the last repetition.
    pub memory: Option<Memory>,
}

/// Where a decode step's time goes: per block kind, the mean ms (of steps run eagerly, timed
/// block by block: [`DeviceSession::profile`]) and weight MB per step (summed over layers), and
/// the GB/s that achieves. `predictors` is the predictors' own time and bytes.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Blocks {
    pub attention: BlockTime,
    pub mlp: BlockTime,
    pub output: BlockTime,
    pub predictors: BlockTime,
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

/// What [`alternate`] measured for one policy.
#[derive(Debug, Clone, Default)]
pub struct Runs {
    /// Tokens per second of each timed repetition.
    pub samples: Vec<f64>,
    pub steps: StepTotals,
    /// Decode tests: resident memory after the last repetition.
    pub memory: Option<Memory>,
}

/// Run one test (`prefill`: `n` tokens in one batch; else `n` decoded) for every policy, each
/// on its own session: a warm-up repetition, then `reps` timed ones, the policies alternating
/// within each so they see the same machine conditions. `tick` after every timed run. A decode
/// test then profiles a few steps of each policy block by block (for [`Blocks`]).
pub fn alternate(
    engine: &Engine,
    policies: &[Policy],
    prefill: bool,
    n: usize,
    reps: usize,
    mut tick: impl FnMut(),
) -> Result<Vec<Runs>> {
    let mut sessions = (policies.iter())
        .map(|p| engine.decoder(p))
        .collect::<Result<Vec<_>>>()?;
    let mut runs = vec![Runs::default(); policies.len()];
    for rep in 0..=reps {
        for (session, run) in sessions.iter_mut().zip(runs.iter_mut()) {
            let mut st = StepTotals::default();
            let secs = time_once(session, prefill, n, rep as u64, &mut st)?;
            if rep > 0 {
                run.samples.push(n as f64 / secs);
                run.steps.add_all(&st);
                tick();
            }
            if !prefill && rep == reps {
                run.memory = memory(engine, session.len());
            }
        }
    }
    if !prefill {
        // As many steps as the test decoded (its context holds them), at most PROFILED.
        let toks = tokens(n.min(PROFILED) + 1, engine.model.config.vocab_size, 0);
        for (session, run) in sessions.iter_mut().zip(runs.iter_mut()) {
            session.truncate(0);
            session.forward(&toks[..1])?;
            let mut times = BlockTimes::default();
            session.profile(&toks[1..], &mut times)?;
            run.steps.add_times(&times);
        }
    }
    Ok(runs)
}

/// Decode steps a bench profiles block by block, per policy.
const PROFILED: usize = 8;

/// Time one repetition of a test (`prefill`: n tokens in one batch; else a warm-up token, then
/// n tokens decoded one at a time) with the token sequence of `seed`, from an empty cache.
/// Returns seconds; adds each timed step's [`StepStats`] to `steps` (a prompt's: its batches
/// read the dense model).
pub fn time_once(
    session: &mut DeviceSession<'_, CpuDevice>,
    prefill: bool,
    n: usize,
    seed: u64,
    steps: &mut StepTotals,
) -> Result<f64> {
    let toks = tokens(n + 1, session.config().vocab_size, seed);
    session.truncate(0);
    if prefill {
        let t0 = Instant::now();
        session.run(&toks[..n], Logits::Last)?;
        let secs = t0.elapsed().as_secs_f64();
        steps.add(session.batch_step());
        return Ok(secs);
    }
    session.run(&toks[..1], Logits::Last)?;
    let mut secs = 0.0;
    for &t in &toks[1..] {
        let t0 = Instant::now();
        session.run(&[t], Logits::Last)?;
        secs += t0.elapsed().as_secs_f64();
        steps.add(session.last_step()?);
    }
    Ok(secs)
}

/// Resident memory now, with a sequence of `len` positions in its cache, split as weights +
/// the KV cache + other state.
pub fn memory(engine: &Engine, len: usize) -> Option<Memory> {
    // Weights: the model's mapping and, once a sparse policy built it, the sparse layout.
    let mut regions = engine.model.mapped_files();
    regions.extend(engine.loaded_layout().map(|l| l.bytes()));
    let r = crate::eval::memstat::resident(&regions)?;
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
    /// Attention, MLP, output head and predictors: summed bytes over the `n` steps.
    pub bytes: [f64; 4],
    /// ... and their summed seconds over the `timed` profiled steps.
    pub secs: [f64; 4],
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
            bytes: [b.attention, b.mlp, b.output, b.predictors].map(|x| x as f64),
            ..Default::default()
        });
    }
    /// The block times of profiled steps.
    pub fn add_times(&mut self, t: &BlockTimes) {
        self.timed += t.steps;
        let secs = [t.attention, t.mlp, t.output + t.embed, t.predict];
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

/// The markdown table people read.
pub fn markdown(results: &[BenchResult]) -> String {
    let mut s = String::new();
    if let Some(r) = results.first() {
        s += &format!(
            "model: {} | commit: {} | cpu: {}\n\n",
            r.model, r.commit, r.cpu
        );
    }
    s += "| isa | threads | sparsity | test | t/s (median ± sd) | speedup | weight GB/s \
          | weight MB/token | MLP density | head density | exact logits \
          | predictors ms/token | RSS MiB = weights + KV + other |\n";
    s += "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
    for r in results {
        let mem = r.memory.map_or(String::from("-"), |m| {
            format!(
                "{:.1} = {:.1} + {:.1} + {:.1}",
                m.rss_mib, m.weights_mib, m.kv_cache_mib, m.other_mib
            )
        });
        let speedup = r
            .speedup_vs_dense
            .map_or(String::from("-"), |x| format!("{x:.2}x"));
        let pred = r.predict_ms.map_or("-".into(), |ms| format!("{ms:.3}"));
        s += &format!(
            "| {} | {} | {} | {} | {:.1} ± {:.1} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.0} | {} | {} |\n",
            r.isa,
            r.threads,
            r.sparsity,
            r.test,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            speedup,
            r.weight_gb_per_s,
            r.weight_bytes_per_token / 1e6,
            r.mlp_density,
            r.head_density,
            r.exact_logits,
            pred,
            mem
        );
    }
    s += "\nPer block, mean per decoded token (ms of steps timed block by block, weight MB, \
          GB/s):\n\n| threads | sparsity | test | attention | MLP | output head | predictors |\n\
          |---:|---|---|---:|---:|---:|---:|\n";
    let cell = |b: &BlockTime| format!("{:.2} ms, {:.1} MB, {:.1} GB/s", b.ms, b.mb, b.gb_per_s);
    for r in results {
        let b = &r.blocks;
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.threads,
            r.sparsity,
            r.test,
            cell(&b.attention),
            cell(&b.mlp),
            cell(&b.output),
            cell(&b.predictors)
        );
    }
    s
}

pub fn csv(results: &[BenchResult]) -> String {
    let mut s = String::from("model,commit,cpu,isa,threads,sparsity,test,n_tokens,tok_per_s_median,tok_per_s_stddev,weight_gb_per_s,weight_bytes_per_token,speedup_vs_dense,mlp_density,head_density,exact_logits,predict_ms\n");
    for r in results {
        s += &format!(
            "{},{},\"{}\",{},{},\"{}\",{},{},{:.3},{:.3},{:.3},{:.0},{},{:.4},{:.4},{:.1},{}\n",
            r.model,
            r.commit,
            r.cpu,
            r.isa,
            r.threads,
            r.sparsity,
            r.test,
            r.n_tokens,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            r.weight_gb_per_s,
            r.weight_bytes_per_token,
            r.speedup_vs_dense
                .map_or(String::new(), |x| format!("{x:.4}")),
            r.mlp_density,
            r.head_density,
            r.exact_logits,
            r.predict_ms.map_or(String::new(), |x| format!("{x:.4}")),
        );
    }
    s
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
