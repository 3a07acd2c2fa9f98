//! `dejavu bench`: prefill and decode speed in the style of llama-bench.
//!
//! - `pp<P>`: prompt processing, P tokens in one batch from an empty cache; tokens/s = P / time.
//! - `tg<N>`: text generation, N tokens decoded one at a time from an empty cache (one warm-up
//!   token first, outside the timing); tokens/s = N / time; GB/s = dense weight bytes read per
//!   decoded token x tokens/s.
//!
//! Each test runs `repetitions` times after one warm-up run; we report the median and the sample
//! standard deviation. Token ids are a fixed pseudo-random sequence (as llama-bench does), so
//! speed does not depend on a text.
use crate::engine::Engine;
use crate::executor::Logits;
use crate::sparsity::SparsePlan;
use crate::Result;
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
    pub weight_bytes_per_token: usize,
    pub samples: Vec<f64>,
    /// Decode tests: resident memory at the end of the last repetition.
    pub memory: Option<Memory>,
}

/// Resident memory during decode, split as the CPU-speed issue states its target:
/// mapped weights + KV cache + other state (`other = rss - weights - kv`).
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

/// Time one test (`prefill` P tokens, or decode N tokens) `reps` times after a warm-up; for
/// decode also the resident memory after the last token. `on_rep` is called after each timed
/// repetition.
pub fn run_test(
    engine: &Engine,
    prefill: bool,
    n: usize,
    reps: usize,
    mut on_rep: impl FnMut(),
) -> Result<(Vec<f64>, Option<Memory>)> {
    let exec = engine.executor();
    let plan = SparsePlan::dense(&engine.model.config);
    let vocab = engine.model.config.vocab_size;
    let mut cache = engine.new_cache();
    let mut samples = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let toks = tokens(n + 1, vocab, rep as u64);
        cache.clear();
        let secs = if prefill {
            let t0 = Instant::now();
            exec.forward(&toks[..n], &mut cache, &plan, Logits::Last)?;
            t0.elapsed().as_secs_f64()
        } else {
            exec.forward(&toks[..1], &mut cache, &plan, Logits::Last)?;
            let t0 = Instant::now();
            for &t in &toks[1..] {
                exec.forward(&[t], &mut cache, &plan, Logits::Last)?;
            }
            t0.elapsed().as_secs_f64()
        };
        if rep > 0 {
            samples.push(n as f64 / secs);
            on_rep();
        }
    }
    let memory = (!prefill)
        .then(|| crate::memstat::resident(engine.model.file.bytes()))
        .flatten()
        .map(|r| {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            let kv = cache.bytes_in_use() as u64;
            Memory {
                rss_mib: mib(r.total),
                weights_mib: mib(r.region),
                kv_cache_mib: mib(kv),
                other_mib: mib(r.total.saturating_sub(r.region + kv)),
            }
        });
    Ok((samples, memory))
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
    s += "| isa | threads | sparsity | test | t/s (median ± sd) | weight GB/s | weight MB/token \
          | RSS MiB = weights + KV + other |\n";
    s += "|---|---:|---|---|---:|---:|---:|---|\n";
    for r in results {
        let mem = r.memory.map_or(String::from("-"), |m| {
            format!(
                "{:.1} = {:.1} + {:.1} + {:.1}",
                m.rss_mib, m.weights_mib, m.kv_cache_mib, m.other_mib
            )
        });
        s += &format!(
            "| {} | {} | {} | {} | {:.1} ± {:.1} | {:.1} | {:.1} | {} |\n",
            r.isa,
            r.threads,
            r.sparsity,
            r.test,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            r.weight_gb_per_s,
            r.weight_bytes_per_token as f64 / 1e6,
            mem
        );
    }
    s
}

pub fn csv(results: &[BenchResult]) -> String {
    let mut s = String::from("model,commit,cpu,isa,threads,sparsity,test,n_tokens,tok_per_s_median,tok_per_s_stddev,weight_gb_per_s\n");
    for r in results {
        s += &format!(
            "{},{},\"{}\",{},{},{},{},{},{:.3},{:.3},{:.3}\n",
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
            r.weight_gb_per_s
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
