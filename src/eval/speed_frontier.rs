//! `dejavu report --speed`: decode speed against MLP density, the paper's latency-vs-sparsity
//! figure, as a markdown table, JSON and a PNG plot with the ideal `1 / density` line.
//!
//! For each density D the policy is `dejavu:D` (the low-rank predictors pick D of every layer's
//! neurons; attention stays dense), timed against dense decoding with the two alternating in one
//! process ([`crate::eval::bench`], on any device). The MLP block's speedup is the one that should
//! follow `1 / D`; the whole step's is bounded by the dense attention and output head. On a
//! synthetic model (the paper's method) the predictors are random, so the sets are random too:
//! a speed measurement, not a quality one.
use crate::eval::bench::BenchResult;
use crate::exec::Engine;
use crate::sparsity::policy::Policy;
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

/// The policies a speed frontier times: dense, then `dejavu:D` for each density.
pub fn policies(engine: &Engine, densities: &[f64]) -> Result<Vec<Policy>> {
    let preds = engine.predictors(None)?.ok_or_else(|| {
        Error::Invalid("no predictors: run `dejavu calibrate` (or use a synthetic model)".into())
    })?;
    let mut specs = vec!["dense".to_string()];
    specs.extend(densities.iter().map(|d| format!("dejavu:{d}")));
    (specs.iter())
        .map(|s| engine.policy(s, Some(&preds)))
        .collect()
}

/// The frontier from a bench of [`policies`] (decode rows only, dense first; `bench --sparsity`
/// times them alternating within each repetition, on any device).
pub fn rows(results: &[BenchResult]) -> Result<Vec<SpeedRow>> {
    let decode: Vec<&BenchResult> = results
        .iter()
        .filter(|r| r.test.starts_with("tg"))
        .collect();
    let Some(dense) = decode.first().filter(|r| r.sparsity == "dense") else {
        return Err(Error::Invalid(
            "a speed frontier needs a dense decode run first".into(),
        ));
    };
    let dense_mlp = dense.blocks.mlp.ms;
    Ok((decode.iter())
        .map(|r| SpeedRow {
            policy: r.sparsity.clone(),
            mlp_density: r.mlp_density,
            tok_per_s: r.tok_per_s_median,
            step_speedup: r.tok_per_s_median / dense.tok_per_s_median,
            mlp_ms: r.blocks.mlp.ms,
            mlp_speedup: dense_mlp / r.blocks.mlp.ms.max(1e-9),
            mlp_gb_per_s: r.blocks.mlp.gb_per_s,
            predict_ms: r.blocks.predictors.ms,
            ideal_mlp_speedup: 1.0 / r.mlp_density.max(1e-9),
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
