//! `dejavu report --speed`: decode speed against density, the paper's latency-vs-sparsity
//! figure, as a markdown table, JSON and a PNG plot with the ideal `1 / density` line; and
//! `report --speed-map`: several of those JSONs (model sizes, CPU and GPU) on one map.
//!
//! For each density D the policy is `dejavu:D` on a ReLU model (the low-rank predictors pick D of
//! every layer's neurons; attention stays dense) and `teal:1-D` on a gated (SwiGLU/GeGLU) one,
//! whose neurons are not sparse (every projection reads the fraction D of its inputs, `:always`:
//! none kept dense where its sparse products are slower, so the map shows the kernels), timed
//! against dense decoding with the two alternating in one process ([`crate::eval::bench`], on any
//! device). The MLP block's speedup is the one that should follow `1 / D`; the whole step's is
//! bounded by what stays dense. On a synthetic model (the paper's method) the predictors and
//! thresholds are random or measured on random tokens: a speed measurement, not a quality one.
use crate::eval::bench::BenchResult;
use crate::exec::Engine;
use crate::sparsity::policy::Policy;
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SpeedRow {
    pub policy: String,
    /// The density asked for: MLP neurons kept (`dejavu:D`) or projection inputs kept
    /// (`teal:1-D`); 1 for dense.
    pub density: f64,
    /// Mean fraction of MLP neurons computed (1 for dense).
    pub mlp_density: f64,
    pub tok_per_s: f64,
    pub step_speedup: f64,
    /// MLP blocks' ms per token (predictor waits included) and their speedup over dense's.
    pub mlp_ms: f64,
    pub mlp_speedup: f64,
    pub mlp_gb_per_s: f64,
    /// The MLP's kept-byte efficiency: its rate over dense's MLP rate in the same run (1 for
    /// dense; absent from reports written before it was measured).
    #[serde(default)]
    pub mlp_efficiency: f64,
    /// Predictors' own ms per token.
    pub predict_ms: f64,
    /// `1 / density`: the MLP speedup if time followed the neuron count.
    pub ideal_mlp_speedup: f64,
}

/// One model's speed frontier on one device, as `report --speed` writes it (JSON).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SpeedReport {
    /// The model's label (`synthetic:opt-13b f16 (random weights)`, a file name, ...).
    pub model: String,
    /// The device (`cpu (2 threads, avx512)`, `cuda (NVIDIA H200)`).
    pub backend: String,
    pub cpu: String,
    pub commit: String,
    /// The rule swept: `dejavu` or `teal`.
    pub rule: String,
    /// Tokens decoded per repetition.
    pub n_gen: usize,
    pub rows: Vec<SpeedRow>,
}

/// The rule a speed frontier sweeps on `engine`'s model (see the module's comment).
pub fn rule(engine: &Engine) -> &'static str {
    match engine.model.config.mlp.activation() {
        dejavu_backend_api::Activation::Relu => "dejavu",
        _ => "teal",
    }
}

/// The policies a speed frontier times, each with its density: dense (1), then the rule at each
/// density.
pub fn policies(engine: &Engine, densities: &[f64]) -> Result<Vec<(f64, Policy)>> {
    let preds = engine.predictors(None)?.ok_or_else(|| {
        Error::Invalid("no predictors: run `dejavu calibrate` (or use a synthetic model)".into())
    })?;
    let mut specs = vec![(1.0, "dense".to_string())];
    for &d in densities {
        specs.push(match rule(engine) {
            "dejavu" => (d, format!("dejavu:{d}")),
            // Rounded: 1 - 0.9 prints as 0.09999999999999998.
            _ => (
                d,
                format!("teal:{}:always", ((1.0 - d) * 1e6).round() / 1e6),
            ),
        });
    }
    (specs.iter())
        .map(|(d, s)| Ok((*d, engine.policy(s, Some(&preds))?)))
        .collect()
}

/// The frontier from a bench of [`policies`] (decode rows only, dense first, in the order of
/// `densities`, the policies' own; `bench --sparsity` times them alternating within each
/// repetition, on any device).
pub fn rows(results: &[BenchResult], densities: &[f64]) -> Result<Vec<SpeedRow>> {
    let decode: Vec<&BenchResult> = results
        .iter()
        .filter(|r| r.test.starts_with("tg"))
        .collect();
    let Some(dense) = decode.first().filter(|r| r.sparsity == "dense") else {
        return Err(Error::Invalid(
            "a speed frontier needs a dense decode run first".into(),
        ));
    };
    if decode.len() != densities.len() {
        return Err(Error::Invalid(format!(
            "a speed frontier of {} policies got {} decode runs",
            densities.len(),
            decode.len()
        )));
    }
    let (dense_mlp, dense_rate) = (dense.blocks.mlp.ms, dense.blocks.mlp.gb_per_s);
    Ok((decode.iter().zip(densities))
        .map(|(r, &density)| SpeedRow {
            policy: r.sparsity.clone(),
            density,
            mlp_density: r.mlp_density,
            tok_per_s: r.tok_per_s_median,
            step_speedup: r.tok_per_s_median / dense.tok_per_s_median,
            mlp_ms: r.blocks.mlp.ms,
            mlp_speedup: dense_mlp / r.blocks.mlp.ms.max(1e-9),
            mlp_gb_per_s: r.blocks.mlp.gb_per_s,
            mlp_efficiency: r.blocks.mlp.gb_per_s / dense_rate.max(1e-9),
            predict_ms: r.blocks.predictors.ms,
            ideal_mlp_speedup: 1.0 / density.max(1e-9),
        })
        .collect())
}

pub fn markdown(rows: &[SpeedRow]) -> String {
    let mut s = String::from(
        "| policy | density | MLP density | t/s | step speedup | MLP ms/token | MLP speedup | ideal (1/density) | MLP GB/s | MLP rate / dense's | predictors ms/token |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.2} | {:.3} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.1}x | {:.1} | {:.2}x | {:.2} |\n",
            r.policy,
            r.density,
            r.mlp_density,
            r.tok_per_s,
            r.step_speedup,
            r.mlp_ms,
            r.mlp_speedup,
            r.ideal_mlp_speedup,
            r.mlp_gb_per_s,
            r.mlp_efficiency,
            r.predict_ms
        );
    }
    s
}

/// Speedup against density: the MLP block and the whole step, measured, and the ideal.
pub fn plot(rows: &[SpeedRow], x_desc: &str, title: &str, path: &Path) -> Result<()> {
    use crate::eval::plot::{line_chart, Axes, Series};
    use plotters::style::RGBColor;
    let ymax = rows
        .iter()
        .map(|r| r.ideal_mlp_speedup.min(25.0))
        .fold(2.0, f64::max)
        * 1.05;
    let mut sorted = rows.to_vec();
    sorted.sort_by(|a, b| a.density.total_cmp(&b.density));
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
            points: sorted.iter().map(|r| (r.density, pick(r))).collect(),
        })
        .collect();
    let axes = Axes {
        x_desc,
        x_max: 1.05,
        y_desc: "speedup over dense",
        y_max: ymax,
    };
    line_chart(path, title, axes, &series)
}

/// The x-axis of `rule`'s frontier.
pub fn x_desc(rule: &str) -> &'static str {
    match rule {
        "dejavu" => "MLP density (fraction of neurons computed)",
        _ => "density (fraction of each projection's inputs read)",
    }
}

/// The map's table: per model and device, the dense t/s and the step speedup at each density.
pub fn map_markdown(reports: &[SpeedReport]) -> String {
    let mut ds: Vec<f64> = (reports.iter())
        .flat_map(|r| r.rows.iter().map(|x| x.density))
        .filter(|d| *d < 1.0)
        .collect();
    ds.sort_by(|a, b| b.total_cmp(a));
    ds.dedup();
    let mut s = String::from("| device | model | rule | dense t/s |");
    for d in &ds {
        s += &format!(" {d} |");
    }
    s += "\n|---|---|---|---:|";
    s += &"---:|".repeat(ds.len());
    s += "\n";
    for r in reports {
        let dense = r.rows.iter().find(|x| x.density >= 1.0);
        s += &format!(
            "| {} | {} | {} | {} |",
            r.backend,
            r.model,
            r.rule,
            dense.map_or("-".into(), |x| format!("{:.2}", x.tok_per_s))
        );
        for d in &ds {
            s += &match r.rows.iter().find(|x| (x.density - d).abs() < 1e-9) {
                Some(x) => format!(" {:.2}x |", x.step_speedup),
                None => " - |".into(),
            };
        }
        s += "\n";
    }
    s
}

/// Is `backend` a GPU (the map's right panel)?
fn on_gpu(backend: &str) -> bool {
    !backend.starts_with("cpu")
}

/// One map of several [`SpeedReport`]s: the whole step's speedup over the same device's dense
/// against density, a line per model, the CPU's reports in the left panel and the GPU's in the
/// right, with the ideal `1 / density` for reference.
pub fn map_plot(reports: &[SpeedReport], title: &str, path: &Path) -> Result<()> {
    use crate::eval::plot::{panels, Axes, Panel, Series};
    use plotters::style::RGBColor;
    const COLOURS: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    let ymax = (reports.iter())
        .flat_map(|r| r.rows.iter().map(|x| x.step_speedup))
        .fold(2.0f64, f64::max)
        * 1.15;
    let mut models: Vec<&str> = Vec::new();
    for m in reports.iter().map(|r| short_model(&r.model)) {
        if !models.contains(&m) {
            models.push(m);
        }
    }
    let panel = |gpu: bool| {
        let mut series = vec![Series::ideal(ymax)];
        let mut seen: Vec<&str> = Vec::new();
        for r in reports.iter().filter(|r| on_gpu(&r.backend) == gpu) {
            let mut pts: Vec<(f64, f64)> =
                r.rows.iter().map(|x| (x.density, x.step_speedup)).collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            // One colour per model in both panels.
            let i = models
                .iter()
                .position(|m| *m == short_model(&r.model))
                .unwrap_or(0);
            // A model's second type in a panel (Q4_0 and Q4_K_M): its colour, lighter.
            let RGBColor(red, green, blue) = COLOURS[i % COLOURS.len()];
            let light = |c: u8| ((c as u16 + 255) / 2) as u8;
            let color = match seen.contains(&short_model(&r.model)) {
                true => RGBColor(light(red), light(green), light(blue)),
                false => RGBColor(red, green, blue),
            };
            seen.push(short_model(&r.model));
            series.push(Series {
                label: format!("{} {} ({})", short_model(&r.model), dtype(&r.model), r.rule),
                color,
                width: 2,
                dots: true,
                points: pts,
            });
        }
        let device = (reports.iter())
            .find(|r| on_gpu(&r.backend) == gpu)
            .map_or(if gpu { "GPU" } else { "CPU" }.into(), |r| {
                r.backend.clone()
            });
        Panel {
            title: device,
            axes: Axes {
                x_desc: "density (MLP neurons kept for dejavu, projection inputs kept for teal)",
                x_max: 1.05,
                y_desc: "decode speedup over the same device's dense",
                y_max: ymax,
            },
            series,
        }
    };
    panels(path, title, &[panel(false), panel(true)])
}

/// A model label without its description (`synthetic:opt-13b (synthetic random weights, f16)`
/// -> `synthetic:opt-13b`).
fn short_model(label: &str) -> &str {
    label.split(" (").next().unwrap_or(label)
}

/// The weight type at the end of a synthetic model's description (`f16`), or nothing.
fn dtype(label: &str) -> &str {
    (label.strip_suffix(')'))
        .and_then(|l| l.rsplit(", ").next())
        .filter(|t| !t.contains(' '))
        .unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(model: &str, backend: &str, speedups: &[(f64, f64)]) -> SpeedReport {
        let row = |(density, step_speedup): (f64, f64)| SpeedRow {
            policy: format!("p{density}"),
            density,
            mlp_density: density,
            tok_per_s: 10.0 * step_speedup,
            step_speedup,
            mlp_ms: 1.0,
            mlp_speedup: 1.0,
            mlp_gb_per_s: 1.0,
            mlp_efficiency: 1.0,
            predict_ms: 0.0,
            ideal_mlp_speedup: 1.0 / density,
        };
        SpeedReport {
            model: model.into(),
            backend: backend.into(),
            cpu: "cpu".into(),
            commit: "c".into(),
            rule: "dejavu".into(),
            n_gen: 16,
            rows: speedups.iter().copied().map(row).collect(),
        }
    }

    /// The map's table has a column per density of any report (a dash where a report lacks
    /// one) and each report's dense t/s; labels lose their description but keep the weight type.
    #[test]
    fn map_table_and_labels() {
        let a = report(
            "synthetic:opt-13b (synthetic random weights, f16)",
            "cuda (NVIDIA H200)",
            &[(1.0, 1.0), (0.5, 1.25)],
        );
        let b = report(
            "model.gguf",
            "cpu (2 threads, avx2)",
            &[(1.0, 1.0), (0.25, 0.9)],
        );
        let md = map_markdown(&[a, b]);
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(
            lines[0],
            "| device | model | rule | dense t/s | 0.5 | 0.25 |"
        );
        assert!(lines[2].ends_with("| 10.00 | 1.25x | - |"), "{}", lines[2]);
        assert!(lines[3].ends_with("| 10.00 | - | 0.90x |"), "{}", lines[3]);
        assert_eq!(
            short_model("synthetic:opt-13b (synthetic random weights, f16)"),
            "synthetic:opt-13b"
        );
        assert_eq!(
            dtype("synthetic:opt-13b (synthetic random weights, f16)"),
            "f16"
        );
        assert_eq!(dtype("model.gguf"), "");
        assert!(on_gpu("cuda (NVIDIA H200)") && !on_gpu("cpu (2 threads, avx2)"));
    }

    /// Reports written before the MLP's kept-byte efficiency was measured (a report of
    /// docs/speed-map with the field taken out) still load (the field reads as 0) and still
    /// draw a map's table.
    #[test]
    fn reports_without_the_efficiency_still_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/speed-map/gpu");
        let text = std::fs::read_to_string(format!("{dir}/synthetic-opt-13b.speed.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let rows = v["rows"].as_array_mut().unwrap();
        for row in rows.iter_mut() {
            row.as_object_mut()
                .unwrap()
                .remove("mlp_efficiency")
                .unwrap();
        }
        let r: SpeedReport = serde_json::from_value(v).unwrap();
        assert!(!r.rows.is_empty() && r.rows.iter().all(|row| row.mlp_efficiency == 0.0));
        assert!(map_markdown(&[r]).contains("synthetic:opt-13b"));
    }

    /// Each row's MLP rate over dense's: half the bytes in 0.8 of the time is 0.62x.
    #[test]
    fn rows_state_the_mlps_kept_byte_efficiency() {
        use crate::eval::bench::test_run;
        let runs = [
            test_run("dense", (2.0, 40.0), 2),
            test_run("p", (1.6, 20.0), 2),
        ];
        let rows = rows(&runs, &[1.0, 0.5]).unwrap();
        assert_eq!(rows[0].mlp_efficiency, 1.0);
        assert!(
            (rows[1].mlp_efficiency - 0.625).abs() < 1e-9,
            "{}",
            rows[1].mlp_efficiency
        );
        assert!(
            markdown(&rows).contains("| 12.5 | 0.62x |"),
            "{}",
            markdown(&rows)
        );
    }
}
