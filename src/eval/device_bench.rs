//! `dejavu bench --backend cuda`: decode speed of the device-resident decoder
//! (`engine::device`) under each policy, alternated as the CPU bench does: one warm-up run per
//! policy (which also records its step), then `repetitions` rounds, each running every policy
//! once. tg<N> decodes N tokens from an empty cache, reading the logits back after every token
//! as generation does. Weight bytes per token are the plan's (predictors included).
use crate::engine::device::{BlockTimes, DeviceModel, DevicePlan, DeviceSession};
use crate::engine::Engine;
use crate::eval::bench::median_sd;
use crate::sparsity::policy::Policy;
use crate::Result;
use dejavu_backend_api::Device;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct DeviceBenchRow {
    pub model: String,
    pub backend: String,
    pub sparsity: String,
    pub test: String,
    pub tok_per_s_median: f64,
    pub tok_per_s_stddev: f64,
    pub ms_per_token: f64,
    pub speedup_vs_dense: Option<f64>,
    pub weight_bytes_per_token: f64,
    pub weight_gb_per_s: f64,
    /// Per token, ms in each block of an eager run synchronized at every block's end (so
    /// their sum exceeds `ms_per_token` by the waits; see `DeviceSession::profile`).
    pub blocks_ms: BlockTimes,
    pub samples: Vec<f64>,
}

/// Decode `n_gen` tokens under each policy, `reps` alternated rounds after a warm-up.
pub fn decode<D: Device>(
    dev: &D,
    eng: &Engine,
    policies: &[Policy],
    n_gen: usize,
    reps: usize,
) -> Result<Vec<DeviceBenchRow>> {
    let specs = policies;
    let sparse = policies.iter().any(|p| !p.is_dense());
    let layout = match sparse {
        true => Some(eng.sparse_layout()?),
        false => None,
    };
    let model = DeviceModel::upload(dev, &eng.model, layout)?;
    let n_ctx = n_gen + 1;
    let mut sessions = specs
        .iter()
        .map(|p| {
            let plan = DevicePlan::policy(dev, &eng.model.config, p)?;
            DeviceSession::new(dev, &model, plan, n_ctx)
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens: Vec<u32> = (0..n_gen as u32)
        .map(|i| (i * 7919 + 13) % eng.model.config.vocab_size as u32)
        .collect();
    let run = |s: &mut DeviceSession<'_, D>| -> Result<f64> {
        s.truncate(0);
        let t0 = Instant::now();
        for &t in &tokens {
            s.forward(&[t])?;
        }
        Ok(n_gen as f64 / t0.elapsed().as_secs_f64())
    };
    let bar = crate::progress::bar(((reps + 1) * specs.len()) as u64, "decode runs");
    let mut samples = vec![Vec::new(); specs.len()];
    for rep in 0..=reps {
        for (i, s) in sessions.iter_mut().enumerate() {
            let tps = run(s)?;
            if rep > 0 {
                samples[i].push(tps);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let mut blocks = Vec::new();
    for s in sessions.iter_mut() {
        s.truncate(0);
        let mut t = BlockTimes::default();
        s.profile(&tokens[..n_gen.min(16)], &mut t)?;
        let ms = |v: f64| v * 1e3 / t.steps as f64;
        blocks.push(BlockTimes {
            steps: t.steps,
            embed: ms(t.embed),
            predict: ms(t.predict),
            attention: ms(t.attention),
            mlp: ms(t.mlp),
            output: ms(t.output),
        });
    }
    let dense = (specs.iter().position(|p| p.is_dense())).map(|i| median_sd(&samples[i]).0);
    Ok(sessions
        .iter()
        .zip(samples)
        .zip(blocks)
        .map(|((s, samples), blocks_ms)| {
            let (med, sd) = median_sd(&samples);
            let bytes = s.step_bytes() as f64;
            DeviceBenchRow {
                model: eng.model.label(),
                backend: dev.name(),
                sparsity: s.plan_name().to_string(),
                test: format!("tg{n_gen}"),
                tok_per_s_median: med,
                tok_per_s_stddev: sd,
                ms_per_token: 1e3 / med,
                speedup_vs_dense: dense.map(|d| med / d),
                weight_bytes_per_token: bytes,
                weight_gb_per_s: bytes * med / 1e9,
                blocks_ms,
                samples,
            }
        })
        .collect())
}

/// The rows as a markdown table.
pub fn markdown(rows: &[DeviceBenchRow]) -> String {
    let mut out = String::from(
        "| model | backend | sparsity | test | t/s | ms/token | speedup | weight MB/token | GB/s | ms attention / MLP / predictors / output (eager) |\n|---|---|---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {} | {} | {:.1} ± {:.1} | {:.3} | {} | {:.1} | {:.0} | {:.2} / {:.2} / {:.2} / {:.2} |\n",
            r.model,
            r.backend,
            r.sparsity,
            r.test,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            r.ms_per_token,
            r.speedup_vs_dense.map_or("-".into(), |s| format!("{s:.2}x")),
            r.weight_bytes_per_token / 1e6,
            r.weight_gb_per_s,
            r.blocks_ms.attention,
            r.blocks_ms.mlp,
            r.blocks_ms.predict,
            r.blocks_ms.output,
        );
    }
    out
}
