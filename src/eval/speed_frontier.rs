//! `dejavu report --speed`: decode speed against MLP density, the paper's latency-vs-sparsity
//! figure, as a markdown table, JSON and a PNG plot with the ideal `1 / density` line.
//!
//! For each density D the policy is `dejavu:D` (the low-rank predictors pick D of every layer's
//! neurons; attention stays dense), timed against dense decoding with the two alternating in one
//! process ([`crate::eval::bench::alternate`]). The MLP block's speedup is the one that should
//! follow `1 / D`; the whole step's is bounded by the dense attention and output head. On a
//! synthetic model (the paper's method) the predictors are random, so the sets are random too:
//! a speed measurement, not a quality one.
use crate::eval::bench::{alternate, median_sd, StepTotals};
use crate::exec::Engine;
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Serialize)]
pub struct SpeedRow {
    pub policy: String,
    /// Mean fraction of MLP neurons computed (1 for dense).
    pub mlp_density: f64,
    pub tok_per_s: f64,
    pub step_speedup: f64,
    /// MLP blocks' ms per token (predictor waits included) and their speedup over dense's.
    pub mlp_ms: f64,
    pub mlp_speedup: f64,
    pub mlp_gb_per_s: f64,
    /// Predictors' own ms per token.
    pub predict_ms: f64,
    /// `1 / density`: the MLP speedup if time followed the neuron count.
    pub ideal_mlp_speedup: f64,
}

/// Time dense and `dejavu:D` for each density (`n_gen` decoded tokens, `reps` repetitions after
/// a warm-up, policies alternating within each repetition).
pub fn measure(
    engine: &Engine,
    densities: &[f64],
    n_gen: usize,
    reps: usize,
) -> Result<Vec<SpeedRow>> {
    let preds = engine.predictors(None)?.ok_or_else(|| {
        Error::Invalid("no predictors: run `dejavu calibrate` (or use a synthetic model)".into())
    })?;
    let mut specs = vec!["dense".to_string()];
    specs.extend(densities.iter().map(|d| format!("dejavu:{d}")));
    let policies = (specs.iter())
        .map(|s| engine.policy(s, Some(&preds)))
        .collect::<Result<Vec<_>>>()?;
    let bar = crate::progress::bar((reps * policies.len()) as u64, "speed against density");
    let runs = alternate(engine, &policies, false, n_gen, reps, || bar.inc(1))?;
    bar.finish_and_clear();
    let tps: Vec<&[f64]> = runs.iter().map(|r| r.samples.as_slice()).collect();
    let steps: Vec<&StepTotals> = runs.iter().map(|r| &r.steps).collect();
    let dense_tps = median_sd(tps[0]).0;
    let dense_mlp = steps[0].blocks().mlp.ms;
    Ok((0..policies.len())
        .map(|i| {
            let (b, density) = (steps[i].blocks(), steps[i].mlp_density());
            SpeedRow {
                policy: policies[i].name.clone(),
                mlp_density: density,
                tok_per_s: median_sd(tps[i]).0,
                step_speedup: median_sd(tps[i]).0 / dense_tps,
                mlp_ms: b.mlp.ms,
                mlp_speedup: dense_mlp / b.mlp.ms.max(1e-9),
                mlp_gb_per_s: b.mlp.gb_per_s,
                predict_ms: b.predictors.ms,
                ideal_mlp_speedup: 1.0 / density.max(1e-9),
            }
        })
        .collect())
}

pub fn markdown(rows: &[SpeedRow]) -> String {
    let mut s = String::from(
        "| policy | MLP density | t/s | step speedup | MLP ms/token | MLP speedup | ideal (1/density) | MLP GB/s | predictors ms/token |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.3} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.1}x | {:.1} | {:.2} |\n",
            r.policy,
            r.mlp_density,
            r.tok_per_s,
            r.step_speedup,
            r.mlp_ms,
            r.mlp_speedup,
            r.ideal_mlp_speedup,
            r.mlp_gb_per_s,
            r.predict_ms
        );
    }
    s
}

/// Speedup against MLP density: the MLP block and the whole step, measured, and the ideal.
pub fn plot(rows: &[SpeedRow], title: &str, path: &Path) -> Result<()> {
    use crate::eval::plot::{line_chart, Axes, Series};
    use plotters::style::RGBColor;
    let ymax = rows
        .iter()
        .map(|r| r.ideal_mlp_speedup.min(25.0))
        .fold(2.0, f64::max)
        * 1.05;
    let mut sorted = rows.to_vec();
    sorted.sort_by(|a, b| a.mlp_density.total_cmp(&b.mlp_density));
    type Pick = fn(&SpeedRow) -> f64;
    let picks: [(&str, RGBColor, Pick); 3] = [
        ("ideal MLP (1 / density)", RGBColor(150, 150, 150), |r| {
            r.ideal_mlp_speedup.min(25.0)
        }),
        ("MLP block, measured", RGBColor(214, 39, 40), |r| {
            r.mlp_speedup
        }),
        ("whole decode step, measured", RGBColor(31, 119, 180), |r| {
            r.step_speedup
        }),
    ];
    let series: Vec<Series> = picks
        .into_iter()
        .map(|(label, color, pick)| Series {
            label: label.into(),
            color,
            width: 2,
            dots: true,
            points: sorted.iter().map(|r| (r.mlp_density, pick(r))).collect(),
        })
        .collect();
    let axes = Axes {
        x_desc: "MLP density (fraction of neurons computed)",
        x_max: 1.05,
        y_desc: "speedup over dense",
        y_max: ymax,
    };
    line_chart(path, title, axes, &series)
}
