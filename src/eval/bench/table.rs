//! What a bench prints and draws: the markdown table people read, CSV, and the sparsity gains
//! of each device against MLP density (a table and a PNG).
use super::{BenchResult, BlockTime, Blocks};
use crate::Result;
use serde::Serialize;

/// The markdown table people read: one row per device, policy and test, then the decode steps'
/// time and bytes by block.
pub fn markdown(results: &[BenchResult]) -> String {
    let mut s = String::new();
    if let Some(r) = results.first() {
        s += &format!(
            "model: {} | commit: {} | cpu: {}\n\n",
            r.model, r.commit, r.cpu
        );
    }
    s += "| backend | sparsity | test | t/s (median ± sd) | speedup | weight GB/s \
          | weight MB/token | MLP density | head density | exact logits \
          | predictors ms/token | RSS MiB = weights + KV + other |\n";
    s += "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
    for r in results {
        let mem = r.memory.map_or(String::from("-"), |m| {
            format!(
                "{:.1} = {:.1} + {:.1} + {:.1}",
                m.rss_mib, m.weights_mib, m.kv_cache_mib, m.other_mib
            )
        });
        let speedup = (r.speedup_vs_dense).map_or(String::from("-"), |x| format!("{x:.2}x"));
        let pred = r.predict_ms.map_or("-".into(), |ms| format!("{ms:.3}"));
        s += &format!(
            "| {} | {} | {} | {:.1} ± {:.1} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.0} | {} | {} |\n",
            r.backend,
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
          GB/s; a sparse policy's rate over the same block's dense rate in this run, where both \
          read bytes: its kept-byte efficiency):\n\n| backend | sparsity | test | attention \
          | MLP | output head | predictors | all-reduce ms |\n|---|---|---|---:|---:|---:|---:|---:|\n";
    for r in results.iter().filter(|r| r.test.starts_with("tg")) {
        let (b, d) = (&r.blocks, dense_blocks(results, r));
        let pick = |f: fn(&Blocks) -> BlockTime| (f(b), d.map(f));
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.sparsity,
            r.test,
            cell(pick(|b| b.attention)),
            cell(pick(|b| b.mlp)),
            cell(pick(|b| b.output)),
            cell(pick(|b| b.predictors)),
            match b.all_reduce.ms > 0.0 {
                true => format!("{:.2}", b.all_reduce.ms),
                false => "-".into(),
            }
        );
    }
    s
}

/// The blocks of the dense run of `r`'s device, threads and test, where `r` is a sparse one.
fn dense_blocks<'a>(results: &'a [BenchResult], r: &BenchResult) -> Option<&'a Blocks> {
    if r.sparsity == "dense" {
        return None;
    }
    let same = |d: &&BenchResult| {
        d.sparsity == "dense"
            && d.backend == r.backend
            && d.threads == r.threads
            && d.test == r.test
    };
    results.iter().find(same).map(|d| &d.blocks)
}

/// A block's time, bytes and rate, and with a dense run beside it (`dense`) the rate's ratio
/// to dense's (where both read bytes).
fn cell((b, dense): (BlockTime, Option<BlockTime>)) -> String {
    let mut c = format!("{:.2} ms, {:.1} MB, {:.1} GB/s", b.ms, b.mb, b.gb_per_s);
    if let Some(d) = dense.filter(|d| d.gb_per_s > 0.0 && b.gb_per_s > 0.0) {
        c += &format!(", {:.2}x dense's rate", b.gb_per_s / d.gb_per_s);
    }
    c
}

pub fn csv(results: &[BenchResult]) -> String {
    let mut s = String::from("model,commit,cpu,backend,threads,sparsity,test,n_tokens,tok_per_s_median,tok_per_s_stddev,weight_gb_per_s,weight_bytes_per_token,speedup_vs_dense,mlp_density,head_density,exact_logits,predict_ms\n");
    let opt = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.4}"));
    for r in results {
        s += &format!(
            "{},{},\"{}\",\"{}\",{},\"{}\",{},{},{:.3},{:.3},{:.3},{:.0},{},{:.4},{:.4},{:.1},{}\n",
            r.model,
            r.commit,
            r.cpu,
            r.backend,
            r.threads.map_or(String::new(), |t| t.to_string()),
            r.sparsity,
            r.test,
            r.n_tokens,
            r.tok_per_s_median,
            r.tok_per_s_stddev,
            r.weight_gb_per_s,
            r.weight_bytes_per_token,
            opt(r.speedup_vs_dense),
            r.mlp_density,
            r.head_density,
            r.exact_logits,
            opt(r.predict_ms),
        );
    }
    s
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

/// The decode rows as gain rows (rows without a dense run on their device are left out).
pub fn gains(results: &[BenchResult]) -> Vec<GainRow> {
    (results.iter().filter(|r| r.test.starts_with("tg")))
        .filter_map(|r| {
            Some(GainRow {
                backend: r.backend.clone(),
                sparsity: r.sparsity.clone(),
                mlp_density: r.mlp_density,
                head_density: r.head_density,
                tok_per_s: r.tok_per_s_median,
                speedup_vs_dense: r.speedup_vs_dense?,
            })
        })
        .collect()
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
    let mut series = vec![Series::ideal(ymax)];
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A decode run of 64 tokens on `threads` threads: its MLP block `mlp` (ms, MB), attention
    /// and output head 1 ms and 10 MB each.
    pub(crate) fn run(sparsity: &str, mlp: (f64, f64), threads: usize) -> BenchResult {
        let t = |ms: f64, mb: f64| BlockTime {
            ms,
            mb,
            gb_per_s: if ms > 0.0 { mb / ms } else { 0.0 },
        };
        BenchResult {
            model: "m".into(),
            commit: "c".into(),
            cpu: "cpu".into(),
            backend: "cpu (2 threads)".into(),
            threads: Some(threads),
            sparsity: sparsity.into(),
            test: "tg64".into(),
            n_tokens: 64,
            tok_per_s_median: 100.0,
            tok_per_s_stddev: 0.0,
            weight_gb_per_s: 1.0,
            weight_bytes_per_token: 1.0,
            speedup_vs_dense: Some(1.0),
            mlp_density: 1.0,
            head_density: 1.0,
            exact_logits: 1.0,
            predict_ms: None,
            blocks: Blocks {
                attention: t(1.0, 10.0),
                mlp: t(mlp.0, mlp.1),
                output: t(1.0, 10.0),
                predictors: t(0.0, 0.0),
                all_reduce: t(0.0, 0.0),
            },
            samples: Vec::new(),
            memory: None,
        }
    }

    /// A sparse run's blocks say their rate against the same device's dense run of the same
    /// test (the MLP reads half the bytes in 0.8 of the time: 0.62x dense's rate); the dense row
    /// says nothing, nor does a run at other threads, nor a block that reads no bytes.
    #[test]
    fn sparse_blocks_state_their_rate_against_dense() {
        let rows = [
            run("dense", (2.0, 40.0), 2),
            run("teal:0.5", (1.6, 20.0), 2),
            run("teal:0.5", (1.6, 20.0), 1),
        ];
        let md = markdown(&rows);
        let lines: Vec<&str> = md
            .lines()
            .filter(|l| l.contains("| tg64 | 1.00 ms"))
            .collect();
        assert_eq!(lines.len(), 3, "{md}");
        assert!(!lines[0].contains("dense's rate"), "{}", lines[0]);
        assert!(
            lines[1].contains("1.60 ms, 20.0 MB, 12.5 GB/s, 0.62x dense's rate"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains("1.00 ms, 10.0 MB, 10.0 GB/s, 1.00x dense's rate"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains("| 0.00 ms, 0.0 MB, 0.0 GB/s |"),
            "{}",
            lines[1]
        );
        assert!(!lines[2].contains("dense's rate"), "{}", lines[2]);
    }
}
