//! `dejavu bench --backend cuda`: prefill and decode speed of the device-resident decoder
//! (`exec`) under each policy, alternated as the CPU bench does: one warm-up run per
//! policy (which also records its step), then `repetitions` rounds, each running every policy
//! once. `pp<P>` runs a P-token prompt from an empty cache (in batches: every unit, whatever
//! the policy) and reads its last logits back; `tg<N>` decodes N tokens from an empty cache,
//! reading the logits back after every token as generation does. Weight bytes per token are the
//! plan's (predictors included); a prompt's batch reads the dense model once.
use crate::eval::bench::median_sd;
use crate::exec::parallel::{self, ParallelDecoder, SessionInfo, Shard, WorldSpec};
use crate::exec::Decoder;
use crate::exec::Engine;
use crate::exec::{BlockTimes, DeviceModel, DevicePlan, DeviceSession};
use crate::sparsity::layout::SparseLayout;
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

/// The sequences a bench times, one per policy: one device's sessions, or those of a
/// tensor-parallel world (every rank runs each step).
pub trait BenchSessions {
    fn count(&self) -> usize;
    fn forward(&mut self, i: usize, tokens: &[u32]) -> Result<()>;
    /// Empty session `i`'s cache.
    fn reset(&mut self, i: usize);
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()>;
    /// Session `i`'s plan and bytes, over the world.
    fn info(&mut self, i: usize) -> Result<SessionInfo>;
}

/// One device's sessions.
pub struct OnDevice<'a, D: Device> {
    pub dev: &'a D,
    pub sessions: Vec<DeviceSession<'a, D>>,
    pub model: &'a DeviceModel<D>,
}

impl<D: Device> BenchSessions for OnDevice<'_, D> {
    fn count(&self) -> usize {
        self.sessions.len()
    }
    fn forward(&mut self, i: usize, tokens: &[u32]) -> Result<()> {
        self.sessions[i].forward(tokens).map(drop)
    }
    fn reset(&mut self, i: usize) {
        self.sessions[i].truncate(0)
    }
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        self.sessions[i].profile(tokens, times)
    }
    fn info(&mut self, i: usize) -> Result<SessionInfo> {
        let s = &self.sessions[i];
        Ok(SessionInfo {
            plan: s.plan_name().to_string(),
            device: self.dev.name(),
            step_bytes: s.step_bytes(),
            dense_bytes: self.model.dense_bytes(),
            densities: s.densities(),
        })
    }
}

/// A tensor-parallel world's sessions: bytes summed over the ranks, densities their mean.
impl BenchSessions for ParallelDecoder {
    fn count(&self) -> usize {
        self.sessions()
    }
    fn forward(&mut self, i: usize, tokens: &[u32]) -> Result<()> {
        self.select(i)?;
        self.decode(tokens).map(drop)
    }
    fn reset(&mut self, i: usize) {
        if self.select(i).is_ok() {
            self.truncate(0)
        }
    }
    fn profile(&mut self, i: usize, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        self.select(i)?;
        ParallelDecoder::profile(self, tokens, times)
    }
    fn info(&mut self, i: usize) -> Result<SessionInfo> {
        self.select(i)?;
        let ranks = ParallelDecoder::info(self)?;
        let n = ranks.len() as f64;
        Ok(SessionInfo {
            plan: ranks[0].plan.clone(),
            device: format!("{} x{} (tensor parallel)", ranks[0].device, ranks.len()),
            step_bytes: ranks.iter().map(|r| r.step_bytes).sum(),
            dense_bytes: ranks.iter().map(|r| r.dense_bytes).sum(),
            densities: (
                ranks.iter().map(|r| r.densities.0).sum::<f64>() / n,
                ranks.iter().map(|r| r.densities.1).sum::<f64>() / n,
            ),
        })
    }
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
    let model = DeviceModel::upload(dev, &eng.model, layout_for(eng, policies)?)?;
    let n_ctx = (n_gen + 1).max(n_prompt);
    let sessions = policies
        .iter()
        .map(|p| {
            let plan = DevicePlan::policy(dev, &eng.model.config, p)?;
            // Timed as generation runs: no statistics gathered on the device.
            let mut s = DeviceSession::new(dev, &model, plan, n_ctx)?;
            s.measure(false);
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut on = OnDevice {
        dev,
        sessions,
        model: &model,
    };
    bench_sessions(&mut on, eng, policies, n_prompt, n_gen, reps)
}

/// [`bench()`] on a world of `world` ranks, rank `r` on `device(shard)`: every policy's plan over
/// each rank's units (`DevicePlan::policy_shard`).
pub fn bench_parallel<D: Device>(
    world: usize,
    device: impl Fn(Shard) -> Result<D> + Sync,
    eng: &Engine,
    policies: &[Policy],
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
) -> Result<Vec<DeviceBenchRow>> {
    let cfg = &eng.model.config;
    let spec = WorldSpec {
        world,
        device,
        plans: |d: &D, _: &DeviceModel<D>, s: Shard| {
            (policies.iter())
                .map(|p| DevicePlan::policy_shard(d, cfg, s, p))
                .collect()
        },
        model: &eng.model,
        layout: layout_for(eng, policies)?,
        n_ctx: (n_gen + 1).max(n_prompt),
    };
    parallel::run(spec, |dec| {
        bench_sessions(dec, eng, policies, n_prompt, n_gen, reps)
    })
}

/// The sparse layout the policies' plans read (none when all are dense).
fn layout_for<'e>(eng: &'e Engine, policies: &[Policy]) -> Result<Option<&'e SparseLayout>> {
    match policies.iter().any(|p| !p.is_dense()) {
        true => Ok(Some(eng.sparse_layout()?)),
        false => Ok(None),
    }
}

/// The bench of [`bench`] over `sessions` (one per policy, in order).
fn bench_sessions(
    sessions: &mut impl BenchSessions,
    eng: &Engine,
    policies: &[Policy],
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
) -> Result<Vec<DeviceBenchRow>> {
    let tokens: Vec<u32> = (0..n_gen.max(n_prompt) as u32)
        .map(|i| (i * 7919 + 13) % eng.model.config.vocab_size as u32)
        .collect();
    let infos = (0..sessions.count())
        .map(|i| sessions.info(i))
        .collect::<Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    if n_prompt > 0 {
        let prompt = &tokens[..n_prompt];
        let samples = alternate(sessions, reps, "prefill runs", |s, i| {
            s.reset(i);
            let t0 = Instant::now();
            s.forward(i, prompt)?;
            Ok(n_prompt as f64 / t0.elapsed().as_secs_f64())
        })?;
        for (info, samples) in infos.iter().zip(samples) {
            let bytes = info.dense_bytes as f64 * n_prompt.div_ceil(MAX_ROWS) as f64;
            let per_token = bytes / n_prompt as f64;
            let test = format!("pp{n_prompt}");
            let blocks = BlockTimes::default();
            rows.push(row(eng, info, test, samples, per_token, (1.0, 1.0), blocks));
        }
    }
    if n_gen == 0 {
        return Ok(rows);
    }
    let tokens = &tokens[..n_gen];
    let samples = alternate(sessions, reps, "decode runs", |s, i| {
        s.reset(i);
        let t0 = Instant::now();
        for &t in tokens {
            s.forward(i, &[t])?;
        }
        Ok(n_gen as f64 / t0.elapsed().as_secs_f64())
    })?;
    let mut blocks = Vec::new();
    for i in 0..sessions.count() {
        sessions.reset(i);
        let mut t = BlockTimes::default();
        sessions.profile(i, &tokens[..n_gen.min(16)], &mut t)?;
        let steps = t.steps as f64;
        blocks.push(t.map(|v| v * 1e3 / steps));
    }
    let dense = (policies.iter().position(|p| p.is_dense())).map(|i| median_sd(&samples[i]).0);
    for ((info, samples), blocks) in infos.iter().zip(samples).zip(blocks) {
        let (bytes, test) = (info.step_bytes as f64, format!("tg{n_gen}"));
        let mut r = row(eng, info, test, samples, bytes, info.densities, blocks);
        r.speedup_vs_dense = dense.map(|d| r.tok_per_s_median / d);
        rows.push(r);
    }
    Ok(rows)
}

/// One session's row of `test` from its tok/s samples and the weight bytes a token reads (no
/// speedup: the caller knows the dense run).
fn row(
    eng: &Engine,
    info: &SessionInfo,
    test: String,
    samples: Vec<f64>,
    bytes_per_token: f64,
    (mlp_density, head_density): (f64, f64),
    blocks_ms: BlockTimes,
) -> DeviceBenchRow {
    let (med, sd) = median_sd(&samples);
    DeviceBenchRow {
        model: eng.model.label(),
        backend: info.device.clone(),
        sparsity: info.plan.clone(),
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
fn alternate<S: BenchSessions>(
    sessions: &mut S,
    reps: usize,
    what: &str,
    mut run: impl FnMut(&mut S, usize) -> Result<f64>,
) -> Result<Vec<Vec<f64>>> {
    let n = sessions.count();
    let bar = crate::progress::bar(((reps + 1) * n) as u64, what);
    let mut samples = vec![Vec::new(); n];
    for rep in 0..=reps {
        for (i, out) in samples.iter_mut().enumerate() {
            let tps = run(sessions, i)?;
            if rep > 0 {
                out.push(tps);
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
            match (r.blocks_ms.steps, r.blocks_ms.all_reduce > 0.0) {
                (0, _) => "-".to_string(),
                (_, ar) => format!(
                    "{:.2} / {:.2} / {:.2} / {:.2}{}",
                    r.blocks_ms.attention,
                    r.blocks_ms.mlp,
                    r.blocks_ms.predict,
                    r.blocks_ms.output,
                    match ar {
                        true => format!(" (all-reduce {:.2})", r.blocks_ms.all_reduce),
                        false => String::new(),
                    }
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
