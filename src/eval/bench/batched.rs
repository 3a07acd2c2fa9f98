//! `dejavu bench --batch 1,2,4,...`: decode steps of several sequences at once (continuous
//! batching's step, `DeviceSession::step_many`), their aggregate tokens per second at each
//! batch size against one sequence's, on one device.
use crate::eval::plot::{line_chart, Axes, Series};
use crate::exec::{Logits, SeqBatch};
use crate::{Error, Result};
use plotters::style::RGBColor;
use std::path::Path;
use std::time::Instant;

/// One batch size's median over the repetitions, under one policy.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BatchRow {
    pub backend: String,
    pub policy: String,
    pub batch: usize,
    /// Context each sequence holds when its steps start.
    pub n_prompt: usize,
    pub step_ms: f64,
    /// Generated tokens per second, summed over the batch's sequences.
    pub tok_per_s: f64,
    /// `tok_per_s` over batch 1's (when batch 1 is measured).
    pub vs_one: Option<f64>,
    /// `tok_per_s` over the first policy's at the same batch size (the others' speedup over
    /// it, dense as a rule).
    pub vs_first: Option<f64>,
    /// Under a sparse plan, the density of the MLP's union of the rows' neurons (its neurons
    /// over the layer's, over the steps' layers that select; batches of 2 or more).
    pub mlp_union: Option<f64>,
}

/// On each set of `sets` (one per policy of `policies`, each of at least the largest batch of
/// sequences): each sequence holds an `n_prompt`-token prompt; then for each repetition, each
/// batch size `b` and each policy in turn (alternating, so a slow phase of a shared machine
/// hits every size and policy), `n_gen` steps of sequences `0..b`, timed. `tick` after each
/// timed run.
pub fn batched(
    sets: &mut [&mut dyn SeqBatch],
    backend: &str,
    policies: &[String],
    batches: &[usize],
    (n_prompt, n_gen, reps): (usize, usize, usize),
    tick: &mut dyn FnMut(),
) -> Result<Vec<BatchRow>> {
    let most = batches.iter().copied().max().unwrap_or(0);
    let fewest = sets.iter().map(|s| s.count()).min().unwrap_or(0);
    if most == 0 || most > fewest || n_gen == 0 || reps == 0 || sets.len() != policies.len() {
        return Err(Error::Invalid(format!(
            "batches {batches:?} of {fewest} sequences under {} policies, {n_gen} steps, {reps} repetitions",
            policies.len()
        )));
    }
    let prompt: Vec<u32> = (0..n_prompt.max(1) as u32)
        .map(|i| (i * 7 + 1) % 1000)
        .collect();
    for seqs in sets.iter_mut() {
        for s in 0..most {
            seqs.truncate(s, 0);
            seqs.run(s, &prompt, Logits::Last)?;
        }
    }
    let n_sets = sets.len();
    let mut samples = vec![Vec::new(); batches.len() * n_sets];
    let mut unions = vec![None; batches.len() * n_sets];
    for _ in 0..=reps {
        for (i, &b) in batches.iter().enumerate() {
            for (p, seqs) in sets.iter_mut().enumerate() {
                let ids: Vec<usize> = (0..b).collect();
                (0..b).for_each(|s| seqs.truncate(s, prompt.len()));
                seqs.union_density();
                let t0 = Instant::now();
                for step in 0..n_gen {
                    let tokens: Vec<u32> = (0..b)
                        .map(|s| ((step * 31 + s * 17) % 997) as u32)
                        .collect();
                    seqs.step(&ids, &tokens)?;
                }
                samples[i * n_sets + p].push(t0.elapsed().as_secs_f64() / n_gen as f64);
                unions[i * n_sets + p] = seqs.union_density();
                tick();
            }
        }
    }
    let mut rows = Vec::new();
    for (i, &b) in batches.iter().enumerate() {
        for (p, policy) in policies.iter().enumerate() {
            // The first run of each size warms up.
            let s = &mut samples[i * n_sets + p][1..];
            s.sort_by(f64::total_cmp);
            let step = s[s.len() / 2];
            rows.push(BatchRow {
                backend: backend.into(),
                policy: policy.clone(),
                batch: b,
                n_prompt: prompt.len(),
                step_ms: step * 1e3,
                tok_per_s: b as f64 / step,
                vs_one: None,
                vs_first: None,
                mlp_union: unions[i * n_sets + p],
            });
        }
    }
    let speed = |rows: &[BatchRow], p: &str, b: usize| {
        (rows.iter())
            .find(|r| r.policy == p && r.batch == b)
            .map(|r| r.tok_per_s)
    };
    let first = &policies[0];
    for i in 0..rows.len() {
        let r = &rows[i];
        let (one, base) = (speed(&rows, &r.policy, 1), speed(&rows, first, r.batch));
        let (t, own) = (r.tok_per_s, r.policy == *first);
        rows[i].vs_one = one.map(|o| t / o);
        rows[i].vs_first = base.filter(|_| !own).map(|f| t / f);
    }
    Ok(rows)
}

/// The rows as a markdown table.
pub fn markdown(rows: &[BatchRow]) -> String {
    let mut out = String::from(
        "| backend | policy | batch | context | step ms | tok/s (all sequences) | vs batch 1 | vs first policy | MLP union density |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let ratio = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}x"));
    for r in rows {
        let union = r.mlp_union.map_or("-".into(), |u| format!("{u:.3}"));
        out += &format!(
            "| {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {union} |\n",
            r.backend,
            r.policy,
            r.batch,
            r.n_prompt,
            r.step_ms,
            r.tok_per_s,
            ratio(r.vs_one),
            ratio(r.vs_first),
        );
    }
    out
}

/// Aggregate tok/s against the batch size, one line per backend and policy, each over its
/// backend's first policy at batch 1 (so a sparse policy's line sits above dense's by its
/// speedup), with the ideal (a step of `b` rows as fast as one) for reference.
pub fn plot(rows: &[BatchRow], title: &str, path: &Path) -> Result<()> {
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
    ];
    let mut lines: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        if !lines.contains(&(&r.backend, &r.policy)) {
            lines.push((&r.backend, &r.policy));
        }
    }
    let base = |backend: &str| {
        (rows.iter())
            .find(|r| r.backend == backend && r.batch == 1)
            .map(|r| r.tok_per_s)
    };
    let x_max = rows.iter().map(|r| r.batch).max().unwrap_or(1) as f64;
    let mut series: Vec<Series> = (lines.iter().enumerate())
        .map(|(i, (b, p))| Series {
            label: format!("{b}, {p}"),
            color: colors[i % colors.len()],
            width: 2,
            dots: true,
            points: (rows.iter())
                .filter(|r| r.backend == *b && r.policy == *p)
                .filter_map(|r| Some((r.batch as f64, r.tok_per_s / base(b)?)))
                .collect(),
        })
        .collect();
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    series.push(Series {
        label: "ideal (a step of b rows costs one)".into(),
        color: RGBColor(160, 160, 160),
        width: 1,
        dots: false,
        points: vec![(1.0, 1.0), (x_max.min(y_max * 1.2), x_max.min(y_max * 1.2))],
    });
    let axes = Axes {
        x_desc: "sequences per step (batch)",
        x_max: x_max * 1.05,
        y_desc: "aggregate tok/s over the first policy's at batch 1",
        y_max: y_max * 1.2,
    };
    line_chart(path, title, axes, &series)
}
