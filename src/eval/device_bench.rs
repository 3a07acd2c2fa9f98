//! `dejavu bench --backend cuda`: prefill and decode speed of the device-resident decoder
//! (`engine::device`) under each policy, alternated as the CPU bench does: one warm-up run per
//! policy (which also records its step), then `repetitions` rounds, each running every policy
//! once. `pp<P>` runs a P-token prompt from an empty cache (in batches: every unit, whatever
//! the policy) and reads its last logits back; `tg<N>` decodes N tokens from an empty cache,
//! reading the logits back after every token as generation does. Weight bytes per token are the
//! plan's (predictors included); a prompt's batch reads the dense model once.
use crate::engine::device::{BlockTimes, DeviceModel, DevicePlan, DeviceSession};
use crate::engine::Engine;
use crate::eval::bench::median_sd;
use crate::sparsity::policy::Policy;
use crate::Result;
use dejavu_backend_api::{Device, MAX_ROWS};
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
    /// Mean fraction of MLP neurons and of heads computed.
    pub mlp_density: f64,
    pub head_density: f64,
    /// Per token, ms in each block of an eager run synchronized at every block's end (so
    /// their sum exceeds `ms_per_token` by the waits; see `DeviceSession::profile`).
    pub blocks_ms: BlockTimes,
    pub samples: Vec<f64>,
}

/// A `n_prompt`-token prefill (0: none) and a `n_gen`-token decode under each policy, `reps`
/// alternated rounds after a warm-up; the prefill rows first.
pub fn bench<D: Device>(
    dev: &D,
    eng: &Engine,
    policies: &[Policy],
    n_prompt: usize,
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
    let n_ctx = (n_gen + 1).max(n_prompt);
    let mut sessions = specs
        .iter()
        .map(|p| {
            let plan = DevicePlan::policy(dev, &eng.model.config, p)?;
            DeviceSession::new(dev, &model, plan, n_ctx)
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens: Vec<u32> = (0..n_gen.max(n_prompt) as u32)
        .map(|i| (i * 7919 + 13) % eng.model.config.vocab_size as u32)
        .collect();
    let mut rows = Vec::new();
    if n_prompt > 0 {
        let prompt = &tokens[..n_prompt];
        let samples = alternate(&mut sessions, reps, "prefill runs", |s| {
            s.truncate(0);
            let t0 = Instant::now();
            s.forward(prompt)?;
            Ok(n_prompt as f64 / t0.elapsed().as_secs_f64())
        })?;
        let bytes = model.dense_bytes() as f64 * n_prompt.div_ceil(MAX_ROWS) as f64;
        for (s, samples) in sessions.iter().zip(samples) {
            let per_token = bytes / n_prompt as f64;
            let test = format!("pp{n_prompt}");
            let blocks = BlockTimes::default();
            rows.push(row(
                eng,
                dev,
                s,
                test,
                samples,
                per_token,
                (1.0, 1.0),
                blocks,
            ));
        }
    }
    if n_gen == 0 {
        return Ok(rows);
    }
    let tokens = &tokens[..n_gen];
    let samples = alternate(&mut sessions, reps, "decode runs", |s| {
        s.truncate(0);
        let t0 = Instant::now();
        for &t in tokens {
            s.forward(&[t])?;
        }
        Ok(n_gen as f64 / t0.elapsed().as_secs_f64())
    })?;
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
    for ((s, samples), blocks) in sessions.iter().zip(samples).zip(blocks) {
        let (bytes, test) = (s.step_bytes() as f64, format!("tg{n_gen}"));
        let mut r = row(eng, dev, s, test, samples, bytes, s.densities(), blocks);
        r.speedup_vs_dense = dense.map(|d| r.tok_per_s_median / d);
        rows.push(r);
    }
    Ok(rows)
}

/// One session's row of `test` from its tok/s samples and the weight bytes a token reads (no
/// speedup: the caller knows the dense run).
#[allow(clippy::too_many_arguments)]
fn row<D: Device>(
    eng: &Engine,
    dev: &D,
    s: &DeviceSession<'_, D>,
    test: String,
    samples: Vec<f64>,
    bytes_per_token: f64,
    (mlp_density, head_density): (f64, f64),
    blocks_ms: BlockTimes,
) -> DeviceBenchRow {
    let (med, sd) = median_sd(&samples);
    DeviceBenchRow {
        model: eng.model.label(),
        backend: dev.name(),
        sparsity: s.plan_name().to_string(),
        test,
        tok_per_s_median: med,
        tok_per_s_stddev: sd,
        ms_per_token: 1e3 / med,
        speedup_vs_dense: None,
        weight_bytes_per_token: bytes_per_token,
        weight_gb_per_s: bytes_per_token * med / 1e9,
        mlp_density,
        head_density,
        blocks_ms,
        samples,
    }
}

/// `reps` rounds of `run` over every session (after one warm-up round, not kept): each
/// session's samples.
fn alternate<D: Device>(
    sessions: &mut [DeviceSession<'_, D>],
    reps: usize,
    what: &str,
    mut run: impl FnMut(&mut DeviceSession<'_, D>) -> Result<f64>,
) -> Result<Vec<Vec<f64>>> {
    let bar = crate::progress::bar(((reps + 1) * sessions.len()) as u64, what);
    let mut samples = vec![Vec::new(); sessions.len()];
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
    Ok(samples)
}

/// The rows as a markdown table.
pub fn markdown(rows: &[DeviceBenchRow]) -> String {
    let mut out = String::from(
        "| model | backend | sparsity | test | t/s | ms/token | speedup | weight MB/token | GB/s | ms attention / MLP / predictors / output (eager) |\n|---|---|---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {} | {} | {:.1} ± {:.1} | {:.3} | {} | {:.1} | {:.0} | {} |\n",
            r.model,
            r.backend,
            r.sparsity,
            r.test,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            r.ms_per_token,
            r.speedup_vs_dense
                .map_or("-".into(), |s| format!("{s:.2}x")),
            r.weight_bytes_per_token / 1e6,
            r.weight_gb_per_s,
            match r.blocks_ms.steps {
                0 => "-".to_string(),
                _ => format!(
                    "{:.2} / {:.2} / {:.2} / {:.2}",
                    r.blocks_ms.attention, r.blocks_ms.mlp, r.blocks_ms.predict, r.blocks_ms.output
                ),
            },
        );
    }
    out
}

/// One point of the CPU-against-GPU comparison: a backend's speedup over its own dense decoding
/// at an MLP density.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct GainRow {
    pub backend: String,
    pub sparsity: String,
    pub mlp_density: f64,
    pub head_density: f64,
    pub tok_per_s: f64,
    pub speedup_vs_dense: f64,
}

/// The decode rows of both backends as gain rows (rows without a dense run are left out).
pub fn gains(cpu: &[crate::eval::bench::BenchResult], gpu: &[DeviceBenchRow]) -> Vec<GainRow> {
    let mut out: Vec<GainRow> = (cpu.iter().filter(|r| r.test.starts_with("tg")))
        .filter_map(|r| {
            Some(GainRow {
                backend: format!("cpu ({} threads, {})", r.threads, r.isa),
                sparsity: r.sparsity.clone(),
                mlp_density: r.mlp_density,
                head_density: r.head_density,
                tok_per_s: r.tok_per_s_median,
                speedup_vs_dense: r.speedup_vs_dense?,
            })
        })
        .collect();
    out.extend(
        gpu.iter()
            .filter(|r| r.test.starts_with("tg"))
            .filter_map(|r| {
                Some(GainRow {
                    backend: r.backend.clone(),
                    sparsity: r.sparsity.clone(),
                    mlp_density: r.mlp_density,
                    head_density: r.head_density,
                    tok_per_s: r.tok_per_s_median,
                    speedup_vs_dense: r.speedup_vs_dense?,
                })
            }),
    );
    out
}

pub fn gains_markdown(rows: &[GainRow]) -> String {
    let mut out = String::from(
        "| backend | sparsity | MLP density | head density | t/s | speedup over the backend's dense |\n|---|---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {:.3} | {:.2} | {:.1} | {:.2}x |\n",
            r.backend, r.sparsity, r.mlp_density, r.head_density, r.tok_per_s, r.speedup_vs_dense
        );
    }
    out
}

/// Speedup over each backend's own dense decoding against MLP density, one line per backend,
/// with the ideal `1 / density`.
pub fn plot_gains(rows: &[GainRow], title: &str, path: &std::path::Path) -> Result<()> {
    use crate::eval::plot::{line_chart, Axes, Series};
    use plotters::style::RGBColor;
    let ymax = rows.iter().map(|r| r.speedup_vs_dense).fold(4.0, f64::max) * 1.1;
    let mut series = vec![Series {
        label: "ideal (1 / density)".into(),
        color: RGBColor(150, 150, 150),
        width: 1,
        dots: false,
        points: (1..=100)
            .map(|i| i as f64 / 100.0)
            .filter(|d| 1.0 / d <= ymax)
            .map(|d| (d, 1.0 / d))
            .collect(),
    }];
    let mut backends: Vec<&str> = rows.iter().map(|r| r.backend.as_str()).collect();
    backends.dedup();
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
    ];
    for (b, &color) in backends.iter().zip(colors.iter().cycle()) {
        let mut points: Vec<(f64, f64)> = (rows.iter().filter(|r| r.backend == *b))
            .map(|r| (r.mlp_density, r.speedup_vs_dense))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push(Series {
            label: b.to_string(),
            color,
            width: 2,
            dots: true,
            points,
        });
    }
    let axes = Axes {
        x_desc: "MLP density (fraction of neurons computed)",
        x_max: 1.05,
        y_desc: "decode speedup over the same backend's dense",
        y_max: ymax,
    };
    line_chart(path, title, axes, &series)
}
